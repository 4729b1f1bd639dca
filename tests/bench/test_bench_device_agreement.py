"""bench.device_agreement: the deviation measure against hand-computed values, half-precision
rounding beyond every tolerance, and the check itself on the CPU (float32 against float64)."""

import math

import pytest
import torch

from bench import device_agreement as da


def test_deviation_is_the_largest_error_over_the_largest_reference_entry():
    ref = torch.tensor([2.0, -4.0, 1.0], dtype=torch.float64)
    got = torch.tensor([2.5, -4.0, 0.0])
    assert da.deviation(got, ref) == pytest.approx(1.0 / 4.0)  # max |Δ| = 1 at the third entry
    # dicts: every tensor's entries together
    assert da.deviation({"a": got, "b": torch.zeros(2)}, {"a": ref, "b": torch.tensor([0.0, 8.0])}) == \
        pytest.approx(8.0 / 8.0)
    # option slots a question does not have are -inf in both: left out; -inf in one only is infinite
    inf = -math.inf
    assert da.deviation(torch.tensor([1.0, inf]), torch.tensor([1.0, inf])) == 0.0
    assert da.deviation(torch.tensor([1.0, 0.0]), torch.tensor([1.0, inf])) == math.inf


def test_half_precision_rounding_alone_fails_every_tolerance():
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    rounded = x.to(torch.bfloat16).double()
    for name, tol in da.TOLERANCES.items():
        assert da.deviation(rounded, x) > tol, name
    assert da.deviation(x.float(), x) < 1e-7  # float32 rounding passes all of them


@pytest.mark.slow
def test_float32_agrees_with_float64_on_the_cpu():
    out = da.check("cpu")
    sdpa = {"option_loglik (sdpa)", "bome_outer (sdpa)", "bome_inner (sdpa)"}
    assert out["device"] == "cpu" and set(out["quantities"]) == set(da.TOLERANCES) | sdpa
    for name, q in out["quantities"].items():
        # nonzero: the two runs are really in two precisions; within tolerance: they agree
        assert 0 < q["deviation"] <= q["tolerance"], name
    assert "largest deviation" in out["table"]
