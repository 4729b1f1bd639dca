"""bench.harness and bench.hypergrad.targets: measurement plumbing against known answers."""

import json

import pytest
import torch

from bench import harness
from bench.hypergrad import targets

CPU = torch.device("cpu")


def test_peak_memory_counts_a_known_allocation():
    def fn():
        a = torch.ones(1_000_000)  # 3.81 MiB
        b = torch.ones(500_000)  # +1.91 MiB while a is alive
        del a, b
        c = torch.ones(250_000)  # after both were freed: below the peak
        return c.sum()

    assert harness.peak_memory_mb(fn, CPU) == pytest.approx(1.5e6 * 4 / 2**20, rel=0.01)


def test_time_alternating_runs_each_candidate_in_rotating_order():
    calls = []
    runs = {k: (lambda k=k: calls.append(k)) for k in "abc"}
    times = harness.time_alternating(runs, device=CPU, warmup=1, repeats=4, budget_s=1e9)
    assert {k: len(v) for k, v in times.items()} == {"a": 4, "b": 4, "c": 4}
    rounds = [calls[i : i + 3] for i in range(3, len(calls), 3)]  # after the warm-up round
    assert rounds == [list("abc"), list("bca"), list("cab"), list("abc")]


def test_time_alternating_stops_on_budget_after_min_repeats():
    times = harness.time_alternating(
        {"x": lambda: None}, device=CPU, warmup=0, repeats=100, budget_s=0.0, min_repeats=3
    )
    assert len(times["x"]) == 3


def test_rel_error_and_recorder(tmp_path):
    assert harness.rel_error(torch.tensor([1.0, 1.0]), torch.tensor([1.0, 0.0])) == pytest.approx(
        1.0
    )
    rec = harness.Recorder(tmp_path / "r.json", {"mode": "test"})
    rec.add({"a": 1})
    rec.add({"a": 2})
    data = json.loads((tmp_path / "r.json").read_text())
    assert data == {"meta": {"mode": "test"}, "records": [{"a": 1}, {"a": 2}]}


def _rec(lib, t, mem, tmin=None):
    return {
        "problem": "q",
        "size": 1,
        "method": "implicit_cg",
        "library": lib,
        "seconds_median": t,
        "seconds_min": tmin or t,
        "peak_mem_mb": mem,
    }


def test_targets_apply_the_1_5x_rule_only_where_reachable():
    # peer at 3× the floor: the toolkit must be 1.5× faster than it
    rows = targets(
        [_rec("plain_torch", 1.0, 10), _rec("bilevel", 1.05, 10), _rec("torchopt", 3.0, 12)]
    )
    (row,) = rows
    assert row["floor_ok"] and row["speedup_needed"] == 1.5 and row["peer_ok"]
    assert row["mem_ok"] and row["mem_vs_least_peer"] == pytest.approx(10 / 12)
    # peer at 1.2× the floor: only "not slower" applies; toolkit slower than floor by 1.3×
    rows = targets(
        [_rec("plain_torch", 1.0, 10), _rec("bilevel", 1.3, 20), _rec("higher", 1.2, 10)]
    )
    (row,) = rows
    assert not row["floor_ok"] and row["speedup_needed"] == 1.0 and not row["peer_ok"]
    assert not row["mem_ok"]


def test_a_row_past_1_2x_the_floor_states_its_extra_milliseconds_and_the_largest_size():
    def at(size, lib, t):
        return {**_rec(lib, t, 1), "size": size}

    rows = {r["size"]: r for r in targets([at(1, "plain_torch", 0.002), at(1, "bilevel", 0.005),
                                           at(9, "plain_torch", 0.100), at(9, "bilevel", 0.103)])}
    assert rows[9]["within"] and "reason" not in rows[9]
    assert not rows[1]["within"]
    assert rows[1]["reason"] == "+3.00 ms per call over a 2.00 ms floor; at size 9: 1.03×"


def test_markdown_table_shape():
    text = harness.markdown_table(["a", "b"], [["1", "2"], ["3", "4"]])
    assert text.splitlines() == ["| a | b |", "|---|---|", "| 1 | 2 |", "| 3 | 4 |"]
