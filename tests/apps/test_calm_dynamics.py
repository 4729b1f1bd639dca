"""CALM's free choices made explicit: α's support, bounded τ, the α prior and clip, BOME as plain
SGD, where α acts, upper losses, --select by the calibration split, and the step record."""

import json

import pytest
import torch

from apps.calm_llm import config as C
from apps.calm_llm import methods
from apps.calm_llm.__main__ import main
from apps.calm_llm.data import Collator, MCQAExample
from apps.calm_llm.history import read_history
from apps.calm_llm.methods.base import Context, finite_option_logits, lr_lambda
from apps.calm_llm.methods.calm import Calm
from apps.calm_llm.model import load
from apps.calm_llm.tasks import mcqa as runner_evaluate

WORDS = ["red", "blue", "green", "cold", "warm", "tall", "short", "fast", "slow", "soft"]
EXAMPLES = [
    MCQAExample(f"d{i}", f"Question {i}: which word fits {WORDS[i % 10]}?",
                tuple(WORDS[(i + j) % 10] for j in range(3 + i % 2)), i % 3, "synthetic")
    for i in range(16)
]


def make_ctx(*extra: str, mode: str = "cloze") -> Context:
    cfg = C.parse_args(["--config", "tiny", "--mode", mode, "--steps", "3", *extra])
    lm = load(cfg.model, device=torch.device("cpu"), seed=0)
    col = Collator(lm.tokenizer, mode=mode, max_length=96, max_options=5)
    ids = col.option_token_ids if mode == "letter" else None
    return Context(cfg=cfg, lm=lm, collator=col, train_examples=EXAMPLES[:10],
                   calib_examples=EXAMPLES[10:], train_collator=col, option_token_ids=ids)


def answer_tokens(ctx: Context) -> set[int]:
    """Every token id at a target position of the gold training continuations and of every
    calibration option, one question at a time."""
    found = set()
    for examples, options in ((ctx.train_examples, "gold"), (ctx.calib_examples, "all")):
        for ex in examples:
            t = ctx.collator([ex], options=options).target_ids
            found.update(t[t != -100].tolist())
    return found


def test_alpha_outside_its_support_stays_exactly_identity():
    ctx = make_ctx("--alpha-lr", "0.5")
    m = methods.get("calm")(ctx)
    support = set(m.alpha.class_ids.tolist())
    assert support == answer_tokens(ctx)
    assert len(support) < ctx.lm.vocab_size
    for k in range(3):
        m.step(k)
    assert m.alpha.stats()["alpha_moved"] > 0  # α did learn on its support
    z = torch.randn(2, 3, ctx.lm.vocab_size)
    out = m.alpha.apply(m.alpha.params, z)
    outside = torch.ones(ctx.lm.vocab_size, dtype=torch.bool)
    outside[m.alpha.class_ids] = False
    assert torch.equal(out[..., outside], z[..., outside])  # exactly, not approximately
    assert not torch.allclose(out[..., ~outside], z[..., ~outside])


def test_letter_mode_support_holds_every_option_letter():
    ctx = make_ctx(mode="letter")
    m = methods.get("calm")(ctx)
    assert set(ctx.option_token_ids.tolist()) <= set(m.alpha.class_ids.tolist())


def test_bome_optimizer_sgd_applies_exactly_minus_xi_times_the_direction():
    ctx = make_ctx("--bome-optimizer", "sgd", "--bome-lr", "0.3", "--warmup-ratio", "0.0",
                   "--max-grad-norm", "1e-9")  # clipping would change the step: sgd must skip it
    m = methods.get("calm")(ctx)
    theta0 = {n: p.detach().clone() for n, p in ctx.lm.inner().items()}
    alpha0 = {n: a.detach().clone() for n, a in m.alpha.params.items()}
    seen = []
    original = m.solver.step

    def spy(*args, **kwargs):
        res = original(*args, **kwargs)
        seen.append(res)
        return res

    m.solver = type("Spy", (), {"step": staticmethod(spy)})()
    m.step(0)
    (res,) = seen
    xi = 0.3 * lr_lambda(ctx.cfg)(0)
    for n, p in ctx.lm.inner().items():
        torch.testing.assert_close(p.detach(), theta0[n] - xi * res.inner_grad[n], rtol=0, atol=1e-7)
    for n, a in m.alpha.params.items():
        torch.testing.assert_close(a.detach(), alpha0[n] - xi * res.outer_grad[n], rtol=0, atol=1e-7)
    assert set(m.optimizers) == {"joint"}


def test_alpha_grad_clip_bounds_every_entry_of_the_direction():
    ctx = make_ctx("--alpha-grad-clip", "1e-6", "--alpha-optimizer", "sgd", "--alpha-lr", "1.0",
                   "--warmup-ratio", "0.0")
    m = methods.get("calm")(ctx)
    before = {n: a.detach().clone() for n, a in m.alpha.params.items()}
    m.step(0)
    for n, a in m.alpha.params.items():
        assert float((a.detach() - before[n]).abs().max()) <= 1e-6 * (1 + 1e-5)


def test_alpha_decay_adds_the_prior_to_the_upper_loss():
    ctx = make_ctx("--alpha-decay", "2.0")
    m = methods.get("calm")(ctx)
    ub = ctx.stream("calib").next()
    inner = ctx.lm.inner_state()
    moved = {n: (a.detach() + 0.1) for n, a in m.alpha.params.items()}
    with torch.no_grad():
        with_prior = float(m.obj.upper(moved, inner, ub))
        ctx.cfg.calm.alpha_decay = 0.0
        without = float(m.obj.upper(moved, inner, ub))
    n_entries = sum(a.numel() for a in moved.values())
    assert with_prior - without == pytest.approx(2.0 * 0.5 * 0.01 * n_entries, rel=1e-4)


@pytest.mark.parametrize("loss", ["nll", "soft_ece"])
def test_upper_losses_are_the_calibration_losses_of_the_option_distribution(loss):
    from calibration import objectives

    ctx = make_ctx("--upper-loss", loss)
    m = methods.get("calm")(ctx)
    ub = ctx.stream("calib").next()
    inner = ctx.lm.inner_state()
    alpha = {k: v.detach() for k, v in m.alpha.params.items()}
    with torch.no_grad():
        logits, _ = ctx.forward(inner, ub)
        ol = finite_option_logits(ctx.option_logits(logits, ub))
        expect = float(objectives.calibration_loss(loss)(ol, ub.labels))
        assert float(m.obj.upper(alpha, inner, ub)) == pytest.approx(expect, rel=1e-6)


def test_alpha_acts_upper_and_inference_keeps_alpha_out_of_the_lower_loss():
    ctx = make_ctx("--alpha-acts", "upper_and_inference")
    m = methods.get("calm")(ctx)
    lb = ctx.stream("train").next()
    inner = ctx.lm.inner_state()
    far = {n: a.detach() + 1.0 for n, a in m.alpha.params.items()}
    near = {n: a.detach() for n, a in m.alpha.params.items()}
    with torch.no_grad():
        assert float(m.obj.lower(far, inner, lb)) == float(m.obj.lower(near, inner, lb))


def test_alpha_acts_options_is_an_option_level_transform():
    ctx = make_ctx("--alpha-acts", "options", "--alpha-param", "temperature")
    m = methods.get("calm")(ctx)
    assert m.alpha.on == "options"
    z = torch.randn(2, 3, ctx.lm.vocab_size)
    assert torch.equal(m.vocab_transform(z), z)
    with torch.no_grad():
        m.alpha.params["tau_raw"].fill_(0.5)
    ol = torch.tensor([[1.0, 2.0, float("-inf")]])
    tau = float(m.alpha.param.constrained(m.alpha.params)["tau"].detach())
    torch.testing.assert_close(m.option_transform(ol)[:, :2], ol[:, :2] / tau)
    with m.without_alpha():
        assert torch.equal(m.option_transform(ol), ol)


@pytest.mark.parametrize("param", ["temperature", "affine"])
def test_alpha_on_options_trains_with_an_absent_option_slot(param):
    """The calibration batch holds questions with fewer options than the slots (an absent
    slot's score is -inf): α's direction must be finite and nonzero, and a step must move α.
    (An α applied to the -inf score gave a NaN gradient and a 'diverged' run at step 1.)"""
    ctx = make_ctx("--alpha-acts", "options", "--alpha-param", param)
    m = methods.get("calm")(ctx)
    before = {n: a.detach().clone() for n, a in m.alpha.params.items()}
    m.step(0)
    moved = [not torch.equal(before[n], a.detach()) for n, a in m.alpha.params.items()]
    assert all(torch.isfinite(a).all() for a in m.alpha.params.values()) and any(moved)


def test_config_refuses_inconsistent_choices():
    with pytest.raises(C.ConfigError, match="--alpha-acts options"):
        C.parse_args(["--alpha-acts", "options", "--upper-objective", "answer_tokens"])
    with pytest.raises(C.ConfigError, match="soft_ece"):
        C.parse_args(["--upper-loss", "soft_ece", "--upper-objective", "answer_tokens"])
    with pytest.raises(C.ConfigError, match="--alpha-tau-max"):
        C.parse_args(["--alpha-tau-max", "1.0"])
    with pytest.raises(C.ConfigError, match="not a train or calm option"):
        C.parse_args(["--select", "seed=1,2"])
    with pytest.raises(C.ConfigError, match="at least two distinct"):
        C.parse_args(["--select", "eta=0.5"])
    with pytest.raises(C.ConfigError, match="--eta"):
        C.parse_args(["--select", "eta=0.5,nan"])
    grid = C.select_grid(C.parse_args(["--select", "eta=0.1,0.5", "alpha-lr=0.01,0.1"]))
    assert len(grid) == 4 and grid[1] == {"calm.eta": 0.1, "calm.alpha_lr": 0.1}
    assert C.variant_name("calm", grid[1]) == "calm@eta=0.1,alpha_lr=0.1"
    # 0 means "as large as the lower batch"
    assert C.calib_batch_size(C.parse_args(["--batch-size", "6"])) == 6


TINY = ["--config", "tiny", "--n-boot", "0"]


@pytest.mark.slow
def test_select_reads_only_the_calibration_split(tmp_path, monkeypatch):
    """Poison every test/OOD prediction of one variant (perfect) and the other (wrong):
    the choice and the recorded calibration NLLs must not move."""
    args = [*TINY, "--methods", "calm", "--steps", "2", "--select", "eta=0.1,0.9"]
    assert main([*args, "--out", str(tmp_path / "a")]) == 0
    clean = json.loads((tmp_path / "a" / "metrics.json").read_text())["selection"]["calm"]

    original = runner_evaluate.predict_option_logits
    calib_ids = None

    def poisoned(ctx, method, examples, desc=""):
        nonlocal calib_ids
        ol, y = original(ctx, method, examples, desc)
        if calib_ids is None:
            calib_ids = {e.id for e in ctx.calib_examples}
        if {e.id for e in examples} == calib_ids:
            return ol, y
        good = "eta=0.9" in method.name
        fake = torch.full_like(ol, -5.0)
        fake[torch.arange(len(y)), y if good else (y + 1) % 3] = 5.0
        return fake, y

    monkeypatch.setattr(runner_evaluate, "predict_option_logits", poisoned)
    assert main([*args, "--out", str(tmp_path / "b")]) == 0
    poisoned_sel = json.loads((tmp_path / "b" / "metrics.json").read_text())["selection"]["calm"]
    assert poisoned_sel["chosen"] == clean["chosen"]
    assert [p["calib_nll"] for p in poisoned_sel["points"]] == [p["calib_nll"] for p in clean["points"]]
    res = json.loads((tmp_path / "b" / "metrics.json").read_text())["results"]
    assert res["calm"]["sciq"]["selected"] == clean["chosen"]
    assert res["calm"]["sciq"]["accuracy"] == res[clean["chosen"]]["sciq"]["accuracy"]


@pytest.mark.slow
def test_history_and_plot_written_and_resume_continues_without_gaps(tmp_path, monkeypatch):
    args = [*TINY, "--methods", "sft", "calm", "--steps", "5", "--checkpoint-every", "2"]
    assert main([*args, "--out", str(tmp_path / "a")]) == 0
    full = read_history(tmp_path / "a" / "history_calm.jsonl")
    assert [h["step"] for h in full] == [1, 2, 3, 4, 5]
    for key in ("lambda", "q", "phi", "upper_loss", "lower_loss", "upper_grad_norm", "q_grad_norm",
                "cos_outer", "cos_inner", "alpha_tau_min", "alpha_tau_max", "alpha_l_median",
                "alpha_moved", "calib_entropy", "calib_confidence"):
        assert key in full[0], key
    # each step's cost is on record (its value is bench/'s business); the GPU peak only on a GPU
    assert all("step_seconds" in h for h in full) and "max_memory_gib" not in full[0]
    assert (tmp_path / "a" / "training_calm.png").stat().st_size > 0
    assert (tmp_path / "a" / "training_sft.png").is_file()
    results = json.loads((tmp_path / "a" / "metrics.json").read_text())["results"]
    assert {"calm", "calm:no_alpha"} <= set(results)

    original = Calm.step

    def killed(self, k):
        if k == 3:  # after the step-2 checkpoint and one more step written to the history
            raise KeyboardInterrupt("simulated kill")
        return original(self, k)

    monkeypatch.setattr(Calm, "step", killed)
    with pytest.raises(KeyboardInterrupt):
        main([*args, "--out", str(tmp_path / "b")])
    assert [h["step"] for h in read_history(tmp_path / "b" / "history_calm.jsonl")] == [1, 2, 3]
    monkeypatch.setattr(Calm, "step", original)
    assert main(["--resume", str(tmp_path / "b")]) == 0
    resumed = read_history(tmp_path / "b" / "history_calm.jsonl")
    assert [h["step"] for h in resumed] == [1, 2, 3, 4, 5]
    for a, b in zip(full, resumed):
        assert b["lower_loss"] == pytest.approx(a["lower_loss"], rel=1e-5)


def test_export_of_a_supported_alpha_applies_the_same_transform(tmp_path):
    from apps.calm_llm.export import AlphaLogitsProcessor, export_method

    ctx = make_ctx("--alpha-lr", "0.5")
    m = methods.get("calm")(ctx)
    m.step(0)
    proc = AlphaLogitsProcessor.from_dir(export_method(tmp_path, ctx.lm, m))
    assert torch.equal(proc.class_ids, m.alpha.class_ids)
    scores = torch.randn(2, ctx.lm.vocab_size)
    torch.testing.assert_close(proc(torch.zeros(2, 1, dtype=torch.long), scores),
                               m.alpha.apply(m.alpha.params, scores).detach())
    opt = make_ctx("--alpha-acts", "options", "--alpha-param", "temperature")
    mo = methods.get("calm")(opt)
    with pytest.raises(ValueError, match="option scores"):
        AlphaLogitsProcessor.from_dir(export_method(tmp_path / "o", opt.lm, mo))


@pytest.mark.slow
def test_eval_calib_records_the_calibration_split_of_every_method(tmp_path):
    out = tmp_path / "run"
    assert main([*TINY, "--methods", "none", "sft", "calm", "--steps", "2", "--eval-calib",
                 "--out", str(out)]) == 0
    res = json.loads((out / "metrics.json").read_text())["results"]
    assert res["none"]["sciq"]["calib_nll"] > 0  # every method, trained or not
    sft = res["sft"]["sciq"]
    assert 0.0 <= sft["calib_conf_ece"] <= 1.0 and 0.0 <= sft["calib_accuracy"] <= 1.0
    assert sft["calib_nll"] > 0 and sft["calib_nll"] == res["sft"]["arc_easy"]["calib_nll"]
    # the row without α is scored on the calibration split without α
    with_a, without = res["calm"]["sciq"], res["calm:no_alpha"]["sciq"]
    assert with_a["calib_nll"] != without["calib_nll"]
    # scoring the calibration split changes nothing else
    assert main([*TINY, "--methods", "none", "sft", "--steps", "2", "--out", str(tmp_path / "b")]) == 0
    plain = json.loads((tmp_path / "b" / "metrics.json").read_text())["results"]
    for ds in ("sciq", "arc_easy"):
        for key, value in plain["sft"][ds].items():
            assert res["sft"][ds][key] == value, (ds, key)
