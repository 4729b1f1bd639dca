"""The per-round speed-up spreads (bench.harness.paired_ratios, bench.scoring): paired ratios, their
min <= median <= max, and the exact ratio when every round takes the same time."""

from hypothesis import given, settings
from hypothesis import strategies as st

from bench.harness import paired_ratios
from bench.scoring import round_speedups

times_st = st.lists(st.floats(0.01, 100.0), min_size=1, max_size=9)


@settings(max_examples=50, deadline=None)
@given(st.data())
def test_paired_ratios_pair_the_rounds(data):
    ref = data.draw(times_st)
    cand = data.draw(st.lists(st.floats(0.01, 100.0), min_size=len(ref), max_size=len(ref)))
    r = paired_ratios({"ref": ref, "c": cand}, "ref", "c")
    assert r["min"] <= r["median"] <= r["max"]
    ratios = [a / b for a, b in zip(ref, cand)]
    assert r["min"] == min(ratios) and r["max"] == max(ratios)


@settings(max_examples=50, deadline=None)
@given(st.floats(0.01, 100.0), st.floats(0.01, 100.0), st.floats(0.01, 100.0),
       st.integers(1, 7))
def test_round_speedups_take_the_faster_reference_in_each_round(a, b, c, n):
    times = {"lm_eval@32": [a] * n, "lm_eval@64": [b] * n, "packed": [c] * n}
    r = round_speedups(times, ["lm_eval@32", "lm_eval@64"], "packed")
    assert r["speedup_round_min"] == r["speedup_round_max"] == min(a, b) / c
    assert round_speedups(times, [], "packed")["speedup_round_median"] is None
