"""Objectives against closed forms, scipy, brute-force loops and gradcheck (float64)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.stats import entropy as scipy_entropy

from calibration import objectives


def rand(*shape, seed=0, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    return scale * torch.randn(*shape, generator=g, dtype=torch.float64)


# --- entropy ------------------------------------------------------------------------------


def test_entropy_matches_scipy_and_closed_forms():
    z = rand(6, 5)
    expected = np.mean([scipy_entropy(row) for row in z.softmax(-1).numpy()])
    assert float(objectives.entropy(z)) == pytest.approx(expected, rel=1e-12)
    assert float(objectives.entropy(torch.zeros(3, 7))) == pytest.approx(math.log(7))
    assert float(objectives.entropy(torch.tensor([[0.0, -1e4]]))) == pytest.approx(0.0, abs=1e-12)


def test_entropy_mask_averages_kept_rows_only():
    z = rand(2, 3, 4)
    mask = torch.tensor([[True, False, True], [False, False, True]])
    rows = z[mask]
    expected = np.mean([scipy_entropy(r) for r in rows.softmax(-1).numpy()])
    assert float(objectives.entropy(z, mask)) == pytest.approx(expected, rel=1e-12)


def test_entropy_with_minus_inf_logits_has_finite_gradient():
    z = torch.tensor([[0.0, 1.0, -math.inf], [2.0, -math.inf, -math.inf]], requires_grad=True)
    h = objectives.entropy(z)
    h.backward()
    assert torch.isfinite(h)
    assert torch.isfinite(z.grad).all()
    p = torch.tensor([1.0, math.e]) / (1 + math.e)
    assert h.item() == pytest.approx(float(-(p * p.log()).sum()) / 2, rel=1e-6)


def test_entropy_gradcheck():
    z = rand(4, 5, seed=1).requires_grad_()
    mask = torch.tensor([True, False, True, True])
    assert torch.autograd.gradcheck(lambda t: objectives.entropy(t, mask), (z,))


# --- cross-entropy and confidence penalty -------------------------------------------------


def manual_ce(z, y, eps, ignore_index):
    total, count = 0.0, 0
    v = z.shape[-1]
    for zi, yi in zip(z.reshape(-1, v), y.reshape(-1)):
        if int(yi) == ignore_index:
            continue
        logp = zi.log_softmax(-1)
        q = torch.full((v,), eps / v, dtype=torch.float64)
        q[int(yi)] += 1 - eps
        total += float(-(q * logp).sum())
        count += 1
    return total / count


@pytest.mark.parametrize("eps", [0.0, 0.1, 0.5])
def test_cross_entropy_matches_manual_formula_with_padding(eps):
    z = rand(2, 4, 6, seed=2)
    y = torch.tensor([[1, -100, 5, 0], [-100, 2, 3, -100]])
    got = float(objectives.cross_entropy(z, y, label_smoothing=eps))
    assert got == pytest.approx(manual_ce(z, y, eps, -100), rel=1e-12)


def test_confidence_penalty_is_ce_minus_beta_entropy_on_kept_rows():
    z = rand(3, 4, 5, seed=3)
    y = torch.tensor([[0, 1, -1, 2], [4, -1, -1, 3], [2, 2, 2, -1]])
    beta = 0.3
    keep = y != -1
    expected = manual_ce(z, y, 0.0, -1) - beta * float(objectives.entropy(z, keep))
    got = float(objectives.confidence_penalty(z, y, beta=beta, ignore_index=-1))
    assert got == pytest.approx(expected, rel=1e-12)


def test_ce_and_penalty_gradcheck():
    z = rand(5, 4, seed=4).requires_grad_()
    y = torch.tensor([0, 3, -100, 1, 2])
    assert torch.autograd.gradcheck(lambda t: objectives.cross_entropy(t, y, 0.2), (z,))
    assert torch.autograd.gradcheck(lambda t: objectives.confidence_penalty(t, y, beta=0.5), (z,))


def test_objective_errors_are_clear():
    z = rand(3, 4)
    with pytest.raises(ValueError, match="shape"):
        objectives.cross_entropy(z, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="ignore_index"):
        objectives.cross_entropy(z, torch.full((3,), -100))
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        objectives.cross_entropy(z, torch.tensor([0, 1, 4]))
    with pytest.raises(TypeError, match="integer"):
        objectives.cross_entropy(z, torch.tensor([0.0, 1.0, 2.0]))
    with pytest.raises(ValueError, match="label_smoothing"):
        objectives.cross_entropy(z, torch.tensor([0, 1, 2]), label_smoothing=1.5)
    with pytest.raises(ValueError, match="beta"):
        objectives.confidence_penalty(z, torch.tensor([0, 1, 2]), beta=-1.0)
    with pytest.raises(ValueError, match="no rows"):
        objectives.entropy(z, torch.zeros(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="shape"):
        objectives.entropy(z, torch.ones(4, dtype=torch.bool))
    with pytest.raises(TypeError, match="bool"):
        objectives.entropy(z, torch.ones(3))


# --- RCFT E-step and M-step ---------------------------------------------------------------


def brute_force_bin_accuracy(probs, labels, n_bins):
    out = []
    for b in range(n_bins):
        lo, hi = b / n_bins, (b + 1) / n_bins
        hits = [
            float(int(torch.argmax(p)) == int(y))
            for p, y in zip(probs, labels)
            if lo <= float(p.max()) < hi or (b == n_bins - 1 and float(p.max()) == 1.0)
        ]
        out.append(np.mean(hits) if hits else np.nan)
    return np.array(out)


def test_estimate_bin_accuracy_matches_brute_force_and_marks_empty_bins():
    probs = rand(300, 4, seed=5).softmax(-1)
    labels = torch.randint(0, 4, (300,), generator=torch.Generator().manual_seed(6))
    got = objectives.estimate_bin_accuracy(probs, labels).numpy()
    expected = brute_force_bin_accuracy(probs, labels, 10)
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-12)
    assert np.isnan(got[:2]).all()  # K = 4: confidence never below 0.25


def test_rcft_bad_inputs_are_refused():
    probs = rand(5, 3).softmax(-1)
    labels = torch.tensor([0, 1, 2, 0, 1])
    with pytest.raises(ValueError, match="n_bins"):
        objectives.estimate_bin_accuracy(probs, labels, n_bins=0)
    with pytest.raises(TypeError, match="integer"):
        objectives.estimate_bin_accuracy(probs, labels.double())
    with pytest.raises(ValueError, match=r"\[0, 3\)"):
        objectives.estimate_bin_accuracy(probs, labels + 1)
    with pytest.raises(ValueError, match="n_bins"):
        objectives.ece_regularizer(probs, torch.zeros(0), n_bins=0)
    with pytest.raises(ValueError, match=r"bin_accuracy must have shape \(10,\)"):
        objectives.ece_regularizer(probs, torch.zeros(5))


def brute_force_regularizer(probs, acc, n_bins, include_top_bin):
    """The CFT M-step with sorted non-max probabilities, bin by bin, as loops."""
    k = probs.shape[1]
    total = 0.0
    for b in range(n_bins):
        if not include_top_bin and b == n_bins - 1:
            continue
        if math.isnan(acc[b]):
            continue
        lo, hi = b / n_bins, (b + 1) / n_bins
        members = [p for p in probs if lo <= float(p.max()) < hi or (b == n_bins - 1 and float(p.max()) == 1)]
        if not members:
            continue
        a = float(acc[b])
        lk = 0.0
        for p in members:
            s = sorted(p.tolist(), reverse=True)
            pmax, rest = s[0], s[1:]
            if rest[0] * (1 - a) > 0:
                gamma = math.log(k - 1) / (rest[0] * (1 - a))
            else:
                gamma = 0.0
            c = (1 - a) / (sum(math.tanh(gamma * q) for q in rest) + (k - 1))
            targets = [c * (1 + math.tanh(gamma * q)) for q in rest]
            assert sum(targets) == pytest.approx(1 - a)
            lk += (pmax - a) ** 2 + sum((q - t) ** 2 for q, t in zip(rest, targets))
        total += lk / len(members)
    return total


@pytest.mark.parametrize("k", [2, 3, 5])
@pytest.mark.parametrize("include_top_bin", [True, False])
def test_ece_regularizer_matches_brute_force(k, include_top_bin):
    probs = rand(200, k, seed=7 + k, scale=3.0).softmax(-1).requires_grad_()
    acc = torch.linspace(0.2, 1.0, 10, dtype=torch.float64)
    acc[3] = float("nan")  # a bin the E-step never saw
    got = objectives.ece_regularizer(probs, acc, include_top_bin=include_top_bin)
    expected = brute_force_regularizer(probs.detach(), acc.tolist(), 10, include_top_bin)
    assert got.item() == pytest.approx(expected, rel=1e-10)
    got.backward()
    assert torch.isfinite(probs.grad).all()  # the NaN bin must not leak into gradients


def test_ece_regularizer_is_zero_at_its_target_and_handles_k2():
    # K = 2: ln(K − 1) = 0, the target for the other class is 1 − acc; at p = (acc, 1 − acc)
    # with p_max in acc's own bin the loss vanishes.
    acc = torch.full((10,), float("nan"), dtype=torch.float64)
    acc[7] = 0.75
    probs = torch.tensor([[0.75, 0.25], [0.25, 0.75]], dtype=torch.float64)
    assert float(objectives.ece_regularizer(probs, acc)) == pytest.approx(0.0, abs=1e-15)
    # acc = 1 in the top bin: every non-max target is 0 (no division by zero).
    acc[9] = 1.0
    probs = torch.tensor([[0.95, 0.03, 0.02]], dtype=torch.float64)
    expected = 0.05**2 + 0.03**2 + 0.02**2
    assert float(objectives.ece_regularizer(probs, acc)) == pytest.approx(expected)
    assert float(objectives.ece_regularizer(probs, acc, include_top_bin=False)) == 0.0


def test_ece_regularizer_gradcheck_through_softmax():
    z = rand(30, 4, seed=11, scale=2.0).requires_grad_()
    probs0 = z.detach().softmax(-1)
    labels = torch.randint(0, 4, (30,), generator=torch.Generator().manual_seed(12))
    acc = objectives.estimate_bin_accuracy(probs0, labels)
    assert torch.autograd.gradcheck(
        lambda t: objectives.ece_regularizer(t.softmax(-1), acc, detach_targets=False),
        (z,),
        eps=1e-7,
        atol=1e-6,
    )


def test_ece_regularizer_detached_gradient_is_the_frozen_target_closed_form():
    # With fixed targets, dL/dp_max = 2 (p_max − a)/N_k and dL/dp_(j) = 2 (p_(j) − t_(j))/N_k.
    probs = rand(40, 3, seed=13, scale=2.0).softmax(-1).requires_grad_()
    acc = torch.linspace(0.1, 0.95, 10, dtype=torch.float64)
    objectives.ece_regularizer(probs, acc).backward()
    p = probs.detach()
    bins = torch.clamp((p.max(-1).values * 10).floor().long(), max=9)
    counts = torch.bincount(bins, minlength=10).double()
    expected = torch.zeros_like(p)
    for i in range(40):
        a = float(acc[bins[i]])
        order = torch.argsort(p[i], descending=True)
        rest = p[i, order[1:]]
        gamma = math.log(2) / (float(rest[0]) * (1 - a))
        th = torch.tanh(gamma * rest)
        targets = (1 - a) / (th.sum() + 2) * (1 + th)
        expected[i, order[0]] = 2 * (p[i, order[0]] - a) / counts[bins[i]]
        expected[i, order[1:]] = 2 * (rest - targets) / counts[bins[i]]
    torch.testing.assert_close(probs.grad, expected, rtol=1e-10, atol=1e-12)


def test_ece_regularizer_pulls_overconfident_predictions_down():
    # Bin accuracy 0.6 everywhere; predictions at 0.95 should lose confidence under descent.
    z = torch.tensor([[3.5, 0.0, 0.0, 0.0]] * 8, dtype=torch.float64, requires_grad=True)
    acc = torch.full((10,), 0.6, dtype=torch.float64)
    conf0 = float(z.detach().softmax(-1).max(-1).values.mean())
    opt = torch.optim.SGD([z], lr=5.0)
    for _ in range(50):
        opt.zero_grad()
        objectives.ece_regularizer(z.softmax(-1), acc).backward()
        opt.step()
    conf1 = float(z.detach().softmax(-1).max(-1).values.mean())
    assert conf1 < conf0 - 0.2
    assert conf1 == pytest.approx(0.6, abs=0.06)


def test_soft_binned_ece_tends_to_the_binned_ece_and_is_differentiable():
    from calibration import metrics

    g = torch.Generator().manual_seed(3)
    z = (torch.randn(500, 4, generator=g, dtype=torch.float64) * 2).requires_grad_(True)
    y = torch.randint(0, 4, (500,), generator=g)
    hard = metrics.conf_ece(torch.softmax(z.detach(), -1), y, n_bins=10)
    assert float(objectives.soft_binned_ece(z.detach(), y, n_bins=10, width=1e-8)) == pytest.approx(
        hard, abs=1e-6)
    soft = objectives.soft_binned_ece(z, y, n_bins=10)
    soft.backward()
    assert torch.isfinite(z.grad).all() and float(z.grad.abs().sum()) > 0


def test_calibration_losses_registry():
    z = torch.tensor([[2.0, 0.0, -1.0], [0.0, 0.0, 0.0]])
    y = torch.tensor([0, 2])
    assert float(objectives.calibration_loss("entropy")(z, y)) == pytest.approx(-float(objectives.entropy(z)))
    assert float(objectives.calibration_loss("nll")(z, y)) == pytest.approx(
        float(torch.nn.functional.cross_entropy(z, y)))
    with pytest.raises(ValueError, match="unknown calibration loss .brier2.; registered: .*soft_ece"):
        objectives.calibration_loss("brier2")

