"""Smooth ECE on constructions with known answers."""

from __future__ import annotations

import numpy as np
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


def _direct_smooth_ece(f: np.ndarray, y: np.ndarray) -> float:
    """Independent oracle: the definition evaluated directly, with the analytic reflected
    Gaussian at each f_i (no grid spreading, no column renormalization) and scipy's brentq
    for the fixed point smECE_σ = σ."""
    from scipy.optimize import brentq
    from scipy.stats import norm

    t = np.linspace(0.0, 1.0, 2001)
    r = y - f

    def sm(sigma: float) -> float:
        k = sum(
            norm.pdf(t[:, None], f[None, :] + 2 * m, sigma)
            + norm.pdf(t[:, None], -f[None, :] + 2 * m, sigma)
            for m in range(-2, 3)
        )
        return float(np.trapezoid(np.abs(k @ r) / len(f), t))

    return sm(brentq(lambda s: sm(s) - s, 1e-3, 1.0, xtol=1e-10))


@pytest.mark.parametrize("case", ["bernoulli_f_squared", "smooth_wave"])
def test_matches_a_direct_evaluation_of_the_definition(case):
    # Residuals that change sign and size along [0, 1], so the value depends on the kernel
    # width and the fixed-point search (unlike the constant-offset constructions above).
    rng = np.random.default_rng(0)
    f = rng.uniform(0.05, 0.95, 120)
    if case == "bernoulli_f_squared":
        y = (rng.uniform(size=120) < f**2).astype(float)
    else:
        y = np.clip(f + 0.15 * np.sin(6 * f), 0.0, 1.0)
    expected = _direct_smooth_ece(f, y)
    assert expected > 0.05
    got = smooth_ece_binary(torch.from_numpy(f), torch.from_numpy(y))
    assert got.value == pytest.approx(expected, abs=2e-5)
    assert got.bandwidth == pytest.approx(expected, abs=2e-5)


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
