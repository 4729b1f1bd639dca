"""CI smoke test: each benchmark script runs its --quick mode on the smallest size only.

No timing is asserted. What is asserted: the records carry the issue's fields, every
implementation that claims a method computes the same hypergradient as float64 plain
PyTorch (all libraries run the same computation), and the tables and plots are written.
"""

import json
import math

import pytest

from bench import calm_step, hypergrad, scaling

FIELDS = {"problem", "size", "library", "method", "seconds_median", "peak_mem_mb", "rel_error"}


@pytest.mark.slow
def test_hypergrad_quick_smallest(tmp_path):
    stem = tmp_path / "hg"
    hypergrad.main(
        [
            "--quick",
            "--smallest",
            "--steps",
            "3",
            "--repeats",
            "3",
            "--budget",
            "0",
            "--no-memory",
            "--problems",
            "quadratic",
            "logistic",
            "--out",
            str(stem),
        ]
    )
    records = json.loads(stem.with_suffix(".json").read_text())["records"]
    assert all(FIELDS <= set(r) for r in records)
    measured = [r for r in records if r["seconds_median"] is not None]
    libraries = {r["library"] for r in measured}
    assert {"plain_torch", "bilevel"} <= libraries
    methods = {(r["problem"], r["method"]) for r in measured if r["library"] == "bilevel"}
    assert {
        (p, m)
        for p in ("quadratic", "logistic")
        for m in ("unrolled", "implicit_cg", "implicit_neumann")
    } == methods
    for r in measured:
        _has_a_timing(r)  # the record's shape, not its value: no timing is asserted
        assert r["peak_mem_mb"] is None  # --no-memory
        assert math.isfinite(r["rel_error"])
        if r["library"] in ("plain_torch", "bilevel", "torchopt", "higher"):
            assert r["rel_error_vs_f64_same_method"] < 1e-4, r
    skipped = [r for r in records if r["seconds_median"] is None]
    assert all(r["note"].startswith("skipped: ") for r in skipped)
    text = stem.with_suffix(".md").read_text()
    assert "| problem | size | method | library |" in text and "## Targets" in text


def _has_a_timing(record):
    """A measured record carries a finite, positive float in its timing field."""
    value = record["seconds_median"]
    ok = isinstance(value, float) and math.isfinite(value) and value > 0
    assert ok, record


@pytest.mark.slow
def test_scaling_quick_smallest(tmp_path):
    stem = tmp_path / "scaling"
    scaling.main(["--quick", "--smallest", "--budget", "0", "--no-memory", "--out", str(stem)])
    records = json.loads(stem.with_suffix(".json").read_text())["records"]
    assert {r["solver"] for r in records} == set(scaling.SOLVERS)
    assert {r["study"] for r in records} == {"T", "dim"}
    for r in records:
        assert FIELDS <= set(r)
        _has_a_timing(r)
    assert (tmp_path / "scaling_T.png").stat().st_size > 0
    assert (tmp_path / "scaling_dim.png").stat().st_size > 0


@pytest.mark.slow
def test_calm_step_quick_smallest(tmp_path):
    stem = tmp_path / "cs"
    calm_step.main(
        [
            "--quick",
            "--smallest",
            "--solvers",
            "bome",
            "--rounds",
            "3",
            "--budget",
            "0",
            "--no-memory",
            "--batch",
            "2",
            "--out",
            str(stem),
        ]
    )
    records = json.loads(stem.with_suffix(".json").read_text())["records"]
    assert [r["solver"] for r in records] == ["sft", "bome"]
    for r in records:
        assert FIELDS | {"model", "T", "time_ratio_vs_sft", "mem_ratio_vs_sft"} <= set(r)
        assert r["model"] == "tiny"
        assert r["time_ratio_vs_sft"] > 0 and r["mem_ratio_vs_sft"] > 0
    assert records[0]["time_ratio_vs_sft"] == 1.0 and records[1]["T"] == 1


@pytest.mark.slow
def test_scoring_quick_agrees_with_the_old_layout(tmp_path):
    """bench.scoring --quick on the tiny model: the shared-prefix predictions (packed and cache
    layouts) agree with the unshared layout per option (and with lm-eval where it is installed); tables written."""
    from bench import scoring

    stem = tmp_path / "sc"
    out = scoring.main(["--quick", "--sets", "sciq", "--check-sets", "mmlu", "--out", str(stem)])
    agree = [r for r in out["records"] if r["kind"] == "agreement"]
    assert {r["set"] for r in agree} == {"sciq", "mmlu", "mmlu@max_length=128"}
    for r in agree:
        assert r["max_abs_dll"] < 1e-4, r
        assert r["accuracy"] == r["accuracy_before"]
    timing = [r for r in out["records"] if r["kind"] == "timing"]
    assert {r["candidate"] for r in agree} >= {"packed@2048", "cache@2048"}
    assert {r["candidate"] for r in timing} >= {"before", "packed@2048", "cache@2048"}
    if "lm_eval" not in out["meta"]:  # lm-eval installed: both batch sizes are candidates
        assert {r["candidate"] for r in timing} >= {"lm_eval@32", "lm_eval@64"}
        for r in timing:  # one round: the spread collapses onto the single paired ratio
            assert r["speedup_round_min"] == r["speedup_round_median"] == r["speedup_round_max"]
    for r in timing:
        _has_a_timing(r)  # the record's shape, not its value: no timing is asserted
        assert r["target_tokens"] < r["floor_tokens"] < r["unshared_tokens"]
        assert {"floor_head_seconds", "x_floor_head"} <= set(r)
    assert out["meta"]["head_to_body_flops"] > 0  # a FLOP ratio from the weights' shapes
    assert "## Agreement with the old layout" in stem.with_suffix(".md").read_text()


@pytest.mark.slow
def test_calm_step_cloze_times_shared_and_unshared_upper_batches(tmp_path):
    stem = tmp_path / "csc"
    calm_step.main(["--smallest", "--solvers", "bome", "--data-mode", "cloze", "--rounds", "3",
                    "--budget", "0", "--no-memory", "--batch", "2", "--out", str(stem)])
    records = json.loads(stem.with_suffix(".json").read_text())["records"]
    assert [(r["solver"], r["shared_prefix"]) for r in records] == [
        ("sft", True), ("bome", True), ("bome", False)]
    assert all(r["mode"] == "cloze" and r["target_ratio"] is None for r in records)


def test_warm_start_counts_fewer_cg_iterations_for_the_same_hypergradient():
    import torch

    from bench.problems import build

    p = build("quadratic", 100).cast(torch.float64)
    r = hypergrad.warm_start_iterations(p, outer_steps=3)
    assert len(r["cold"]) == len(r["warm"]) == 3
    assert r["warm"][0] == r["cold"][0] and sum(r["warm"]) < sum(r["cold"])
    assert r["max_rel_diff"] < 1e-5 and r["breakdowns"] == (0, 0)


@pytest.mark.slow
def test_training_quick_matches_the_first_loss_and_records_every_candidate(tmp_path):
    """bench.training --quick (tiny model, 2 rounds): the app's SFT step and HF Trainer + peft
    start from the same loss on the same batch; every candidate has a record with its times."""
    from bench import training

    stem = tmp_path / "tr"
    out = training.main(["--quick", "--out", str(stem)])
    records = json.loads(stem.with_suffix(".json").read_text())["records"]
    assert [r["candidate"] for r in records] == ["app_sft", "app_sft_padded", "app_calm",
                                                 "hf_trainer", "hf_trainer_train"]
    by = {r["candidate"]: r for r in records}
    a, h = by["app_sft"]["first_loss"], by["hf_trainer"]["first_loss"]
    print(f"step-1 loss: app_sft {a:.6f}, hf_trainer {h:.6f}")
    assert abs(a - h) <= 1e-4 * abs(a)
    # packing changes the layout, not the loss: the padded app step starts from the same loss
    assert by["app_sft_padded"]["first_loss"] == pytest.approx(a, rel=1e-5)
    # the tiny preset has no warmup (round(0.1 * 4) = 0 steps): both schedules are the same
    # cosine, so all four steps agree; and Trainer.train() itself takes the driven steps
    assert by["hf_trainer"]["max_rel_loss_diff_vs_app_sft"] < 1e-4
    assert by["hf_trainer_train"]["losses"] == pytest.approx(by["hf_trainer"]["losses"], rel=1e-6)
    for r in records:
        _has_a_timing(r)  # the record's shape, not its value: no timing is asserted
        assert len(r["seconds_all"]) == 2 and r["reference"] == "hf_trainer"
        assert r["speedup_round_min"] <= r["speedup_round_median"] <= r["speedup_round_max"]
        assert len(r["losses"]) == 4  # step 1, one warm-up round, two timed rounds
    assert by["hf_trainer"]["speedup_vs_ref"] == 1.0
    meta = out["meta"]
    assert 0 < meta["real_tokens_per_batch"] < meta["padded_tokens_per_batch"]
    assert meta["real_tokens_min"] <= meta["real_tokens_per_batch"] <= meta["real_tokens_max"]
    assert "| app_sft | sft |" in stem.with_suffix(".md").read_text()


def test_hf_inputs_put_each_answer_token_under_the_logit_that_predicts_it():
    """The labels HF's loss shifts back land where the app's shifted targets are; an answer
    ending in the last column gets one padding column for its last label."""
    import torch

    from apps.calm_llm.data import Batch
    from bench.training import hf_inputs

    ids = torch.tensor([[5, 6, 7, 8], [5, 9, 1, 1]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    tgt = torch.tensor([[-100, 7, 8, 4], [-100, 3, -100, -100]])
    z = torch.zeros(2, dtype=torch.long)
    batch = Batch(mode="cloze", input_ids=ids, attention_mask=mask,
                  position_ids=mask.cumsum(1) - 1, target_ids=tgt, labels=z, n_options=z + 1,
                  seq_question=torch.arange(2), seq_option=z, cont_chars=z)
    d = hf_inputs(batch)
    assert d["labels"].tolist() == [[-100, -100, 7, 8, 4], [-100, -100, 3, -100, -100]]
    assert d["attention_mask"][:, -1].tolist() == [0, 0] and d["input_ids"].shape == (2, 5)
    # HF's loss: logits[t] against labels[t + 1], i.e. the app's target_ids[t]
    assert torch.equal(d["labels"][:, 1:][:, :4], tgt)
    bad = Batch(**{**batch.__dict__, "target_ids": torch.tensor([[-100, 9, 8, -100], tgt[1].tolist()])})
    with pytest.raises(ValueError, match="not its next input tokens"):
        hf_inputs(bad)


def test_the_trainer_peer_refuses_an_optimizer_it_cannot_match():
    from bench import training

    cfg = training.app_config("tiny", {"train": {"optimizer": "adam"}}, steps=4)
    with pytest.raises(ValueError, match="train.optimizer 'adam'.*adamw"):
        training.HFTrainerStep(cfg, lambda: None)
@pytest.mark.slow
def test_peers_quick_runs_every_library_on_the_same_problems(tmp_path):
    """bench.peers --quick: bilevel runs every (problem, method) and matches the independent
    float64 oracle; a peer that is installed either agrees with bilevel where both implement
    the same rule (ITD-SGD, MAML, convex AID-CG) or its record carries the evidence."""
    from bench import peers

    stem = tmp_path / "peers"
    peers.main(["--quick", "--no-timing", "--out", str(stem)])
    records = json.loads(stem.with_suffix(".json").read_text())["records"]
    ran = [r for r in records if "metric" in r]
    cases = {(r["problem"], r["method"]) for r in ran if r["library"] == "bilevel"}
    assert cases == {(p, m) for p in ("hyper_cleaning/linear", "hyper_cleaning/mlp", "l2_hpo")
                     for m in ("ITD-SGD", "ITD-Adam", "AID-CG", "V-PBGD")} | {("sinusoid", "MAML")}
    for r in ran:
        assert r["time_ratio"] is None  # --no-timing: no clock, nothing timed or asserted
        assert r["error"] or (r["steps_done"] == r["steps"] and r["first_step_rel_error"] is not None)
        assert all(math.isfinite(v) for v in r["metric"].values()) or r["error"]
        if r["library"] == "bilevel":
            assert not r["error"] and r["first_step_rel_error"] == 0.0
        if r["library"] == "bilevel@float64" and r["method"] != "AID-CG":
            # float32 vs float64 (an unconverged CG amplifies rounding to ~4e-2: not asserted)
            assert r["first_step_rel_error"] < 1e-3, r
        if r["library"].startswith("bilevel") and r.get("oracle") in ("fd", "explicit"):
            assert r["oracle_rel_error"] < 1e-3, r  # exact, to rounding
        same_rule = r["method"] in ("ITD-SGD", "MAML", "V-PBGD") or (
            r["method"] == "AID-CG" and r["problem"] == "l2_hpo")
        if r["library"] in ("torchopt", "higher", "boat") and same_rule:
            assert not r["error"] and r["first_step_rel_error"] < 1e-4, r
    skipped = [r for r in records if "metric" not in r]
    assert all(r["error"].startswith(("skipped: ", "build: ")) for r in skipped)
    text = stem.with_suffix(".md").read_text()
    assert "| problem | method | library |" in text and "float64 oracle" in text


@pytest.mark.slow
def test_peers_timed_round_robin_records_ratios_to_bilevel(tmp_path):
    """The timed path: every library's steps 2.. through harness.time_alternating; the ratio's
    shape is checked (bilevel's own is 1), never its value."""
    from bench import peers

    stem = tmp_path / "peers_timed"
    peers.main(["--quick", "--problems", "l2_hpo", "--steps", "3", "--out", str(stem)])
    records = json.loads(stem.with_suffix(".json").read_text())["records"]
    timed = [r for r in records if r.get("seconds_median") is not None]
    assert {r["method"] for r in timed if r["library"] == "bilevel"} == {
        "ITD-SGD", "ITD-Adam", "AID-CG", "V-PBGD"}
    for r in timed:
        _has_a_timing(r)
        assert r["steps_done"] == 3 and r["time_ratio"] > 0
        assert r["library"] != "bilevel" or r["time_ratio"] == 1.0


def test_peers_drift_stays_at_rounding_on_the_convex_problem(tmp_path):
    """--drift: on the convex L2 problem every library's float32 α stays within float32
    rounding of bilevel's float64 run (the non-convex MAML drift is docs/bilevel.md's)."""
    from bench import peers

    stem = tmp_path / "drift"
    rows = peers.drift("l2_hpo", "ITD-SGD", 2)
    assert [r["step"] for r in rows] == [1, 2] and "bilevel" in rows[0]
    assert all(0 <= v < 1e-4 for r in rows for k, v in r.items() if k != "step"), rows
    peers.main(["--drift", "2", "--problems", "l2_hpo", "--out", str(stem)])
    assert "| step | bilevel |" in stem.with_suffix(".md").read_text()
@pytest.mark.slow
def test_contention_quick(tmp_path):
    """bench.contention --quick on the tiny model, one thread count, one policy, two loads: the
    records and tables are written with every field (no timing is asserted)."""
    from bench import contention

    stem = tmp_path / "contention"
    out = contention.main(["--quick", "--threads", "1", "--policies", "passive",
                           "--loads", "none", "busy", "--steps", "2", "--out", str(stem)])
    saved = json.loads(stem.with_suffix(".json").read_text())
    assert saved["records"] == out["records"]
    assert [(r["threads"], r["policy"], r["load"]) for r in out["records"]] == [
        (1, "passive", "none"), (1, "passive", "busy")]
    for r in out["records"]:
        assert len(r["step_seconds"]) == 2 and r["s_per_step"] > 0 and r["run_cpu_s"] > 0
        assert math.isfinite(r["slowdown"]) and math.isfinite(r["vs_best"])
        k = {"none": 0, "busy": 1}[r["load"]]
        assert r["fair"] == contention.fair_slowdown(1, k, out["meta"]["cpus"])
    assert out["records"][0]["slowdown"] == 1.0
    assert [p["policy"] for p in out["idle_probe"]] == ["passive"]
    text = stem.with_suffix(".md").read_text()
    assert "| threads | OMP_WAIT_POLICY | load |" in text and "idle CPU s" in text


def test_contention_fair_slowdown():
    """The fair-share bound: min(t, C) / min(t, C·t/(t + k))."""
    from bench.contention import fair_slowdown

    assert fair_slowdown(2, 0, 2) == 1.0
    assert fair_slowdown(2, 1, 2) == 1.5  # 2 threads beside a busy loop get 4/3 of 2 CPUs
    assert fair_slowdown(2, 2, 2) == 2.0  # beside a 2-thread twin: one CPU each
    assert fair_slowdown(1, 1, 2) == 1.0 and fair_slowdown(1, 1, 1) == 2.0
    assert fair_slowdown(4, 1, 16) == 1.0  # plenty of CPUs: nothing to share
