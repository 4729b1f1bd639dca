"""Methods: CALM objectives against hand computations, every solver steps, ablations, baselines."""

import math

import pytest
import torch

from apps.calm_llm import config as C
from apps.calm_llm import methods, scoring
from apps.calm_llm.data import Collator, MCQAExample
from apps.calm_llm.methods.base import Context, gold_only, lr_lambda
from apps.calm_llm.model import load

WORDS = ["red", "blue", "green", "cold", "warm", "tall", "short", "fast", "slow", "soft"]
EXAMPLES = [
    MCQAExample(f"m{i}", f"Question {i}: which word fits {WORDS[i % 10]}?",
                tuple(WORDS[(i + j) % 10] for j in range(3 + i % 2)), i % 3, "synthetic")
    for i in range(16)
]


def make_ctx(mode: str, *extra: str, eager: bool = False) -> Context:
    cfg = C.parse_args(["--config", "tiny", "--mode", mode, "--steps", "3", *extra])
    lm = load(cfg.model, device=torch.device("cpu"), seed=0, eager=eager)
    col = Collator(lm.tokenizer, mode=mode, max_length=96, max_options=5)
    ids = col.option_token_ids if mode == "letter" else None
    return Context(cfg=cfg, lm=lm, collator=col, train_examples=EXAMPLES[:10],
                   calib_examples=EXAMPLES[10:], train_collator=col, option_token_ids=ids)


@pytest.fixture(scope="module")
def cloze():
    return make_ctx("cloze")


@pytest.fixture(scope="module")
def letter():
    return make_ctx("letter", "--alpha-support", "options")


def test_lr_schedule_warmup_then_cosine():
    cfg = C.parse_args(["--config", "tiny", "--steps", "10", "--warmup-ratio", "0.2"])
    f = lr_lambda(cfg)
    assert [f(0), f(1)] == [1 / 3, 2 / 3]
    assert f(2) == 1.0 and f(7) == pytest.approx(0.5 * (1 + math.cos(math.pi * 5 / 8)))
    cfg.train.schedule = "constant"
    assert lr_lambda(cfg)(9) == 1.0


@pytest.mark.parametrize("fixture", ["cloze", "letter"])
def test_calm_objectives_match_hand_computation(fixture, request):
    ctx = request.getfixturevalue(fixture)
    m = methods.get("calm")(ctx)
    lb, ub = ctx.stream("train").next(), ctx.stream("calib").next()
    inner = ctx.lm.inner_state()
    alpha = {k: v.detach() for k, v in m.alpha.params.items()}
    with torch.no_grad():
        # α starts at the identity: g is the plain completion-only CE
        logits, _ = ctx.forward(inner, lb)
        assert m.obj.lower(alpha, inner, lb) == pytest.approx(float(scoring.lm_loss(logits, lb)))
        # a non-trivial α: f = −mean_i H(softmax(option scores of α(z)))
        bumped = {k: v + 0.3 * torch.randn_like(v) for k, v in alpha.items()}
        full = ctx.lm.logits(None, ub)  # every column, no trimming
        z = m.alpha.apply(bumped, full)
        ol = scoring.option_logits(z, ub, option_token_ids=ctx.option_token_ids)
        p = torch.softmax(ol, -1)
        h = -(torch.where(p > 0, p * p.log(), torch.zeros_like(p))).sum(-1).mean()
        assert m.obj.upper(bumped, inner, ub) == pytest.approx(-float(h), rel=1e-5)


def test_cloze_answer_token_entropy(cloze):
    ctx = make_ctx("cloze", "--upper-objective", "answer_tokens")
    m = methods.get("calm")(ctx)
    ub = ctx.stream("calib").next()
    with torch.no_grad():
        full = ctx.lm.logits(None, ub)
        a = scoring.answer_logits(full, ub)
        h = -(torch.softmax(a, -1) * torch.log_softmax(a, -1)).sum(-1).mean()
        f = m.obj.upper({k: v.detach() for k, v in m.alpha.params.items()}, None, ub)
    assert float(f) == pytest.approx(-float(h), rel=1e-5)


def _trained_state(m, ctx, steps=2):
    before_a = {k: v.detach().clone() for k, v in m.outer_params().items()}
    before_t = ctx.lm.inner_state()
    with ctx.lm.mode(True):
        infos = [m.step(k) for k in range(steps)]
    assert all(math.isfinite(i["loss"]) for i in infos)
    moved_t = sum(float((ctx.lm.inner()[n].detach() - t).abs().sum()) for n, t in before_t.items())
    moved_a = sum(float((m.outer_params()[n] - t).abs().sum()) for n, t in before_a.items())
    ctx.lm.load_inner(before_t)
    return infos, moved_t, moved_a


@pytest.mark.parametrize("name", ["calm", "calm_scalar", "calm_iterate", "calm_regularization"])
def test_calm_family_moves_alpha_and_lora(name, cloze):
    m = methods.get(name)(cloze)
    infos, moved_t, moved_a = _trained_state(m, cloze)
    assert moved_t > 0 and moved_a > 0
    if name == "calm_scalar":
        assert sum(t.numel() for t in m.outer_params().values()) == 1
    if name == "calm":
        assert {"lambda", "upper_loss", "lower_loss"} <= set(infos[0])


@pytest.mark.parametrize("solver", ["itd", "aid"])
def test_second_order_solvers_on_the_same_problem(solver):
    ctx = make_ctx("letter", "--solver", solver, "--alpha-support", "options", eager=True)
    assert ctx.lm.model.config._attn_implementation == "eager"
    m = methods.get("calm")(ctx)
    _, moved_t, moved_a = _trained_state(m, ctx)
    assert moved_t > 0 and moved_a > 0


def test_alpha_support_options_only_touches_letter_columns(letter):
    m = methods.get("calm")(letter)
    assert m.alpha.class_ids.tolist() == letter.option_token_ids.tolist()
    z = torch.randn(2, 1, letter.lm.vocab_size)
    params = {k: v.detach() + 0.5 for k, v in m.alpha.params.items()}
    out = m.alpha.apply(params, z)
    other = torch.ones(letter.lm.vocab_size, dtype=torch.bool)
    other[letter.option_token_ids] = False
    assert torch.equal(out[..., other], z[..., other])
    assert not torch.equal(out[..., letter.option_token_ids], z[..., letter.option_token_ids])


@pytest.mark.parametrize("name", ["sft", "label_smoothing"])
def test_sft_and_label_smoothing_train_lora_only(name, letter):
    m = methods.get(name)(letter)
    _, moved_t, _ = _trained_state(m, letter)
    assert moved_t > 0 and m.outer_params() == {}


def test_label_smoothing_uses_the_configured_epsilon(letter):
    assert methods.get("label_smoothing")(letter).smoothing() == letter.cfg.options_of("label_smoothing").epsilon
    assert methods.get("sft")(letter).smoothing() == 0.0


def test_label_smoothing_over_the_option_letters():
    ctx = make_ctx("letter", "--label-smoothing-scope", "options", "--label-smoothing", "0.2")
    m = methods.get("label_smoothing")(ctx)
    b = ctx.stream("train").next()
    with torch.no_grad():
        z = ctx.lm.logits(None, b, last_only=True)
        logp = torch.log_softmax(z[:, -1], -1).double()
        want = []
        for i in range(b.n_questions):  # CE against q = 0.8·δ_gold + 0.2·uniform(option letters)
            n = int(b.n_options[i])
            q = torch.zeros_like(logp[i])
            q[ctx.option_token_ids[:n]] = 0.2 / n
            q[ctx.option_token_ids[b.labels[i]]] += 0.8
            want.append(-(q * logp[i]).sum())
        assert float(m.loss(z, b)) == pytest.approx(float(torch.stack(want).mean()), rel=1e-5)
        # the default (vocabulary) scope is the library's smoothing over all V entries
        m.ctx.cfg.options_of("label_smoothing").scope = "vocab"
        assert float(m.loss(z, b)) == pytest.approx(float(scoring.lm_loss(z, b, label_smoothing=0.2)))


def test_rcft_cloze_estimates_bins_and_trains(cloze):
    from apps.calm_llm.predict import predict_option_logits

    m = methods.get("rcft")(cloze)
    m.predict = lambda ex: predict_option_logits(cloze, m, ex)
    _, moved_t, _ = _trained_state(m, cloze)
    assert moved_t > 0
    assert m.bin_accuracy.shape == (cloze.cfg.options_of("rcft").bins,)


def test_rcft_scale_sets_the_regularizer_weight(cloze):
    """With s = 0 RCFT is SFT on (1 − w)·CE; a large s changes the LoRA step."""
    from apps.calm_llm.predict import predict_option_logits

    options = cloze.cfg.options_of("rcft")
    saved = options.scale

    def lora_after_one_step(scale):
        options.scale = scale
        torch.manual_seed(0)
        m = methods.get("rcft")(cloze)
        m.predict = lambda ex: predict_option_logits(cloze, m, ex)
        before = cloze.lm.inner_state()
        with cloze.lm.mode(True):
            m.step(0)
        after = {n: t.detach().clone() for n, t in cloze.lm.inner().items()}
        cloze.lm.load_inner(before)
        return after

    try:
        zero, big = lora_after_one_step(0.0), lora_after_one_step(10.0)
    finally:
        options.scale = saved
    assert any(not torch.allclose(zero[n], big[n]) for n in zero)


def test_gold_only_keeps_gold_targets(cloze):
    b = cloze.collator(EXAMPLES[:3], options="all")
    g = gold_only(b)
    has = (g.target_ids != -100).any(1)
    assert has.tolist() == (b.seq_option == b.labels[b.seq_question]).tolist()


def test_ts_fits_on_calibration_split(cloze):
    from apps.calm_llm.predict import predict_option_logits

    m = methods.get("ts")(cloze)
    m.after_training(lambda ex: predict_option_logits(cloze, m, ex))
    assert m.temperature > 0 and set(m.extras) >= {"temperature", "at_boundary"}
    ol = torch.tensor([[1.0, 2.0, -math.inf]])
    assert torch.equal(m.option_transform(ol), ol / m.temperature)
