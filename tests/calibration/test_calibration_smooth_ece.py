"""Smooth ECE on constructions with known answers."""

from __future__ import annotations

import pytest
import torch

from calibration import metrics
from calibration.smooth_ece import _Grid, smooth_ece_binary


def uniform(n: int, lo: float, hi: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return lo + (hi - lo) * torch.rand(n, generator=g, dtype=torch.float64)


def test_grid_kernel_matches_the_analytic_reflected_gaussian():
    # Analytic density of N(x, σ²) folded into [0, 1] by reflection at 0 and 1, with its
    # normalizing constant: if the image sum were wrong, the column renormalization would
    # rescale it and this comparison would fail.
    from scipy.stats import norm

    grid = _Grid(1001)
    t = torch.linspace(0, 1, 1001, dtype=torch.float64).numpy()
    for sigma in (0.02, 0.1, 0.5, 1.0):
        k = grid.kernel(sigma).numpy()
        for g in (0, 137, 500, 1000):
            x = t[g]
            analytic = sum(
                norm.pdf(t, x + 2 * m, sigma) + norm.pdf(t, -x + 2 * m, sigma) for m in range(-6, 7)
            )
            assert k[:, g] == pytest.approx(analytic, rel=2e-3, abs=1e-9)


@pytest.mark.parametrize("offset", [0.05, 0.1, -0.2])
def test_constant_offset_gives_the_offset(offset):
    f = uniform(2000, 0.25, 0.75, 0)
    result = smooth_ece_binary(f, f + offset)
    assert result.value == pytest.approx(abs(offset), abs=1e-5)
    assert result.bandwidth == pytest.approx(abs(offset), abs=1e-5)


def test_exact_calibration_gives_zero():
    f = uniform(500, 0.0, 1.0, 1)
    assert smooth_ece_binary(f, f).value == pytest.approx(0.0, abs=1e-6)


def test_bernoulli_outcomes_calibrated_vs_shifted():
    f = uniform(20000, 0.2, 0.8, 2)
    g = torch.Generator().manual_seed(3)
    u = torch.rand(20000, generator=g, dtype=torch.float64)
    calibrated = smooth_ece_binary(f, (u < f).double()).value
    shifted = smooth_ece_binary(f, (u < f - 0.1).double()).value
    assert calibrated < 0.02
    assert shifted == pytest.approx(0.1, abs=0.02)


def test_always_wrong_at_full_confidence_is_one():
    assert smooth_ece_binary(torch.ones(10), torch.zeros(10)).value == pytest.approx(1.0, abs=1e-5)


def test_metrics_smooth_ece_uses_top_label_and_is_permutation_invariant():
    # K = 2 with confidence 0.8 on class 0 and 80% of labels 0: perfectly calibrated.
    probs = torch.tensor([[0.8, 0.2]] * 10, dtype=torch.float64)
    labels = torch.tensor([0] * 8 + [1] * 2)
    assert metrics.smooth_ece(probs, labels) == pytest.approx(0.0, abs=1e-5)
    # Same confidences, 50% correct: the gap is 0.3.
    labels = torch.tensor([0, 1] * 5)
    assert metrics.smooth_ece(probs, labels) == pytest.approx(0.3, abs=1e-5)
    perm = torch.randperm(10, generator=torch.Generator().manual_seed(0))
    assert metrics.smooth_ece(probs[perm], labels[perm]) == pytest.approx(
        metrics.smooth_ece(probs, labels), abs=1e-12
    )


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="equal length"):
        smooth_ece_binary(torch.rand(3), torch.rand(4))
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        smooth_ece_binary(torch.tensor([1.5]), torch.tensor([1.0]))
    with pytest.raises(ValueError, match="finite"):
        smooth_ece_binary(torch.tensor([float("nan")]), torch.tensor([1.0]))
