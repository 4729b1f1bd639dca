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
