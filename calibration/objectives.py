"""Differentiable calibration objectives, computed stably from logits.

Shapes: ``logits`` is (..., V) (e.g. (N, K) option scores or (B, T, V) token logits);
``labels`` has shape ``logits.shape[:-1]``; ``mask`` (bool, same shape as ``labels``) marks
the rows that count (True = keep). Every objective is the mean over kept rows and raises
ValueError when no row is kept (a mean over nothing has no value to return).

- ``entropy``:            mean_i H(softmax(z_i)), H(p) = −Σ_j p_j log p_j
- ``cross_entropy``:      mean_i −Σ_j q_ij log softmax(z_i)_j, q = (1 − ε) onehot + ε/V
- ``confidence_penalty``: CE − β·entropy (Pereyra et al. 2017), over the same rows
- ``estimate_bin_accuracy`` / ``ece_regularizer``: the RCFT E-step and M-step (CFT paper)
- ``soft_binned_ece``:    a differentiable ECE (soft bin memberships; Karandikar et al. 2021)
- ``CALIBRATION_LOSSES`` (`calibration.loss_table.LOSSES`, the one table, torch-free) /
  ``calibration_loss(name)``: the
  losses a calibration parameter can be fitted to, each ``(logits (N, K), labels (N,)) -> scalar`` to minimize: ``"entropy"``
  (−mean entropy, CALM's upper level; its optimum is the uniform distribution, so it needs a
  constraint such as CALM's lower level), ``"nll"`` and ``"soft_ece"`` (optimum at calibration)
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from calibration._checks import check_n_bins
from calibration.binning import bin_index
from calibration.loss_table import LOSSES, CalibrationLoss
from calibration.registry import Registry

__all__ = [
    "CALIBRATION_LOSSES",
    "CalibrationLoss",
    "calibration_loss",
    "label_nll",
    "neg_entropy",
    "confidence_penalty",
    "cross_entropy",
    "ece_regularizer",
    "entropy",
    "estimate_bin_accuracy",
    "soft_binned_ece",
]


def _row_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Shannon entropy of softmax(logits) along the last axis, shape logits.shape[:-1].

    Uses log_softmax; entries with p = 0 (logits of −inf, e.g. masked vocabulary) contribute
    0·log 0 = 0 and a zero gradient instead of NaN.
    """
    logp = F.log_softmax(logits, dim=-1)
    p = logp.exp()
    # Zero the log where p underflows to 0 so that neither p·logp nor its gradient is NaN.
    logp = logp.masked_fill(p == 0, 0.0)
    return -(p * logp).sum(dim=-1)


def _check_mask(mask: torch.Tensor | None, shape: torch.Size, device: torch.device) -> torch.Tensor:
    if mask is None:
        return torch.ones(shape, dtype=torch.bool, device=device)
    if mask.dtype != torch.bool:
        raise TypeError(f"mask must be a bool tensor, got dtype {mask.dtype}")
    if mask.shape != shape:
        raise ValueError(
            f"mask must have shape logits.shape[:-1] = {tuple(shape)}, got {tuple(mask.shape)}"
        )
    if not mask.any():
        raise ValueError("mask keeps no rows: the mean over an empty set is undefined")
    return mask


class NonFiniteLogits(ValueError, FloatingPointError):
    """A kept row of logits with NaN, +inf, or no finite entry: its softmax, hence its entropy,
    is undefined. Also a FloatingPointError, so a training loop that stops on non-finite losses
    (with its checkpoint message) stops on this too."""


def entropy(logits: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean Shannon entropy (nats) of softmax(logits, -1) over the rows kept by ``mask``.

    logits: (..., V). mask: bool, shape logits.shape[:-1], True = keep (default: all rows).
    Returns a scalar tensor differentiable in ``logits``. This is CALM's upper-level objective
    (maximized on the calibration set). A −inf entry is a class of probability 0; a kept row
    that holds NaN or +inf, or only −inf, raises `NonFiniteLogits` naming the row (its entropy
    would be NaN, and so would the mean).
    """
    if logits.ndim < 1 or logits.shape[-1] < 1:
        raise ValueError(f"logits must have a non-empty last axis, got shape {tuple(logits.shape)}")
    m = _check_mask(mask, logits.shape[:-1], logits.device)
    kept = _row_entropy(logits)[m]
    # H is NaN exactly for the undefined rows; checking the (rows,) result, not the (rows, V)
    # input, keeps the check one small reduction
    if not bool(torch.isfinite(kept).all()):
        bad = m & ~torch.isfinite(_row_entropy(logits.detach()))
        where = tuple(int(i) for i in bad.nonzero()[0])
        row = logits.detach()[where]
        what = ("contains NaN" if bool(torch.isnan(row).any()) else
                "contains +inf" if bool((row == float("inf")).any()) else
                "has no finite logit (every entry is -inf): no class has any probability")
        raise NonFiniteLogits(
            f"entropy: logits row {where[0] if len(where) == 1 else where} {what}; its softmax "
            "is undefined (mask the row out, or find where the NaN/inf comes from)"
        )
    return kept.mean()


def _flatten_for_ce(
    logits: torch.Tensor, labels: torch.Tensor, ignore_index: int
) -> tuple[torch.Tensor, torch.Tensor]:
    if labels.shape != logits.shape[:-1]:
        raise ValueError(
            f"labels must have shape logits.shape[:-1] = {tuple(logits.shape[:-1])}, "
            f"got {tuple(labels.shape)}"
        )
    if labels.is_floating_point() or labels.dtype == torch.bool:
        raise TypeError(f"labels must have an integer dtype, got {labels.dtype}")
    z = logits.reshape(-1, logits.shape[-1])
    y = labels.reshape(-1).long()
    keep = y != ignore_index
    if not keep.any():
        raise ValueError(f"every label equals ignore_index={ignore_index}: nothing to average")
    v = logits.shape[-1]
    bad = keep & ((y < 0) | (y >= v))
    if bad.any():
        raise ValueError(
            f"labels must lie in [0, {v}) or equal ignore_index={ignore_index}; "
            f"got {int(y[bad][0])}"
        )
    return z, y


def cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    label_smoothing: float = 0.0,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Mean cross-entropy of ``labels`` under softmax(``logits``), optionally label-smoothed.

    CE_i = −Σ_j q_ij log softmax(z_i)_j with q_i = (1 − ε)·onehot(y_i) + ε/V (Szegedy et al.
    2016; ε = ``label_smoothing`` in [0, 1]). logits (..., V), labels logits.shape[:-1]
    (int); rows whose label equals ``ignore_index`` are left out of the mean.
    """
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must lie in [0, 1], got {label_smoothing}")
    z, y = _flatten_for_ce(logits, labels, ignore_index)
    return F.cross_entropy(z, y, ignore_index=ignore_index, label_smoothing=label_smoothing)


def confidence_penalty(
    logits: torch.Tensor,
    labels: torch.Tensor,
    beta: float = 0.1,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Entropy-regularized CE (the confidence penalty of Pereyra et al. 2017): CE − β·H.

    Both terms are means over the rows whose label is not ``ignore_index``. ``beta`` ≥ 0
    (0.1 is in the range the paper tunes over). CALM's "Regularization" ablation is this
    objective with the entropy measured on the calibration set instead.
    """
    if beta < 0:
        raise ValueError(f"beta must be non-negative, got {beta}")
    z, y = _flatten_for_ce(logits, labels, ignore_index)
    keep = y != ignore_index
    ce = F.cross_entropy(z, y, ignore_index=ignore_index)
    return ce - beta * _row_entropy(z[keep]).mean()


# --- RCFT (regularized calibration-aware fine-tuning) --------------------------------------


def _check_probs_2d(probs: torch.Tensor) -> None:
    if probs.ndim != 2 or probs.shape[0] == 0 or probs.shape[1] < 2:
        raise ValueError(f"probs must have shape (N, K) with N >= 1, K >= 2, got {tuple(probs.shape)}")


def estimate_bin_accuracy(
    probs: torch.Tensor, labels: torch.Tensor, n_bins: int = 10
) -> torch.Tensor:
    """RCFT E-step: accuracy of the top-label prediction in each confidence bin.

    acc_k = mean_{i: max_j p_ij ∈ bin k} 1[argmax_j p_ij = y_i], equal-width bins as in
    ``calibration.binning``. probs (N, K) (no gradient is taken), labels (N,).
    Returns (n_bins,) float tensor on probs' device; **NaN marks a bin with no samples** (there
    is no accuracy to estimate), and ``ece_regularizer`` leaves such bins out.
    Call it again whenever the estimate should follow the model (e.g. once per epoch).
    """
    _check_probs_2d(probs)
    n_bins = check_n_bins(n_bins)
    if labels.shape != probs.shape[:1]:
        raise ValueError(f"labels must have shape ({probs.shape[0]},), got {tuple(labels.shape)}")
    # A float or out-of-range label would silently count as a wrong prediction.
    if labels.is_floating_point() or labels.dtype == torch.bool:
        raise TypeError(f"labels must have an integer dtype, got {labels.dtype}")
    if ((labels < 0) | (labels >= probs.shape[1])).any():
        raise ValueError(f"labels must lie in [0, {probs.shape[1]})")
    p = probs.detach()
    conf, pred = p.max(dim=1)
    correct = (pred == labels).to(torch.float64)
    idx = bin_index(conf, n_bins)
    dev = p.device
    count = torch.zeros(n_bins, dtype=torch.float64, device=dev).index_add_(
        0, idx, torch.ones_like(correct)
    )
    hits = torch.zeros(n_bins, dtype=torch.float64, device=dev).index_add_(0, idx, correct)
    return (hits / count).to(p.dtype)


def _rcft_targets(p_rest: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """Targets t_(j) for the non-max probabilities p_rest (N, K − 1) given bin accuracies a (N,)."""
    k = p_rest.shape[1] + 1
    scale = p_rest.max(dim=1).values * (1 - a)
    # γ = 0 where the formula divides by zero (a = 1, or no non-max mass) and when K = 2:
    # the targets then split 1 − a evenly, which is the limit of the tanh shape as γ → 0.
    safe = scale > 0
    gamma = torch.where(safe, math.log(k - 1) / torch.where(safe, scale, torch.ones_like(scale)), 0.0)
    th = torch.tanh(gamma[:, None] * p_rest)
    c = (1 - a) / (th.sum(dim=1) + (k - 1))
    return c[:, None] * (1 + th)


def ece_regularizer(
    probs: torch.Tensor,
    bin_accuracy: torch.Tensor,
    n_bins: int = 10,
    include_top_bin: bool = True,
    detach_targets: bool = True,
) -> torch.Tensor:
    """RCFT M-step: Σ_k L_k, pulling each bin's probabilities toward its estimated accuracy.

    For the samples i of a batch whose confidence p_max,i falls in bin k (N_k of them), with
    a_k = ``bin_accuracy[k]`` and the K − 1 non-max probabilities p_(j),i (p_(2),i the largest):

        γ_i = ln(K − 1) / (p_(2),i (1 − a_k))
        c_i = (1 − a_k) / (Σ_j tanh(γ_i p_(j),i) + (K − 1))
        t_(j),i = c_i (1 + tanh(γ_i p_(j),i))             (Σ_j t_(j),i = 1 − a_k)
        L_k = [Σ_i (p_max,i − a_k)² + Σ_i Σ_j (p_(j),i − t_(j),i)²] / N_k

    With ``detach_targets=True`` (default) the targets t are held fixed, as regression targets
    in an EM M-step: the gradient is 2(p − target)/N_k and flows through p_max and p_(j) only.
    ``detach_targets=False`` also differentiates through t(p); the public description of the
    paper does not say which the release does, so both are available. The CFT paper combines it as
    (1 − w)·L_SFT + w·1e-3·Σ_k L_k with w = 0.5; that mixing belongs to the caller.

    Edge cases (documented choices): bins whose ``bin_accuracy`` is NaN (no E-step samples)
    contribute 0; when p_(2),i (1 − a_k) = 0 (a_k = 1 or all non-max mass is 0) or K = 2
    (ln(K − 1) = 0), γ_i = 0 and the targets reduce to the uniform split (1 − a_k)/(K − 1).

    Differences from the paper's released code, and why: (1) the top bin [0.9, 1] is included
    by default (``include_top_bin=False`` reproduces the release, which skips it and so never
    penalizes the most overconfident predictions — the ones aligned LLMs make); (2) the
    released code estimates acc_k once and never again; here the E-step is a separate function
    the caller re-runs on demand, so the targets can track the model as accuracy improves.

    probs: (N, K) probabilities (differentiable); bin_accuracy: (n_bins,). Returns a scalar.
    """
    _check_probs_2d(probs)
    n_bins = check_n_bins(n_bins)
    if bin_accuracy.shape != (n_bins,):
        raise ValueError(f"bin_accuracy must have shape ({n_bins},), got {tuple(bin_accuracy.shape)}")
    n, k = probs.shape
    acc_all = bin_accuracy.to(device=probs.device, dtype=probs.dtype)
    p_max, arg = probs.max(dim=1)
    bins = bin_index(p_max, n_bins)
    acc = acc_all[bins]  # (N,) the estimated accuracy of each sample's bin

    keep = ~torch.isnan(acc)
    if not include_top_bin:
        keep &= bins != n_bins - 1
    if not keep.any():
        return probs.sum() * 0.0  # keeps the graph and the device; nothing to penalize

    nonmax_mask = torch.ones_like(probs, dtype=torch.bool).scatter_(1, arg[:, None], False)
    p_rest = probs[nonmax_mask].reshape(n, k - 1)  # (N, K − 1), original class order
    # Excluded samples get a dummy accuracy: a NaN there would turn their zero gradient into
    # NaN (0 · NaN) in the backward pass even though their loss is masked out.
    a = torch.where(keep, acc, torch.zeros_like(acc)).clamp(0.0, 1.0)
    with torch.set_grad_enabled(torch.is_grad_enabled() and not detach_targets):
        target = _rcft_targets(p_rest, a)

    per_sample = (p_max - a) ** 2 + ((p_rest - target) ** 2).sum(dim=1)  # (N,)
    per_sample = torch.where(keep, per_sample, torch.zeros_like(per_sample))
    # L_k divides by N_k; summing per-sample terms weighted by 1/N_{bin(i)} gives Σ_k L_k.
    count = torch.zeros(n_bins, dtype=probs.dtype, device=probs.device).index_add_(
        0, bins, keep.to(probs.dtype)
    )
    return (per_sample / count[bins].clamp_min(1)).sum()


# --- losses a calibration parameter is fitted to ------------------------------------------


def soft_binned_ece(
    logits: torch.Tensor, labels: torch.Tensor, n_bins: int = 15, width: float | None = None
) -> torch.Tensor:
    """A differentiable ECE: confidence bins with soft memberships (Karandikar et al., "Soft
    Calibration Objectives for Neural Networks", NeurIPS 2021).

        c_i = max_j softmax(z_i)_j,   a_i = 1[argmax_j z_ij = y_i]   (a carries no gradient)
        w_ib = softmax_b(−(c_i − m_b)² / width)      m_b = bin centres (2b + 1) / (2B)
        ECE_soft = Σ_b (Σ_i w_ib / N) · |Σ_i w_ib (a_i − c_i)| / Σ_i w_ib

    As width → 0 the memberships become the hard equal-width bins and ECE_soft the binned
    conf-ECE of `calibration.metrics`. Default width = (1 / B)² / 4, a soft band about half a
    bin wide. Its minimum is at a calibrated predictor, not at the uniform distribution.
    logits (N, K), labels (N,) int; returns a scalar differentiable in logits.
    """
    check_n_bins(n_bins)
    if logits.ndim != 2 or logits.shape[0] == 0:
        raise ValueError(f"logits must be (N, K) with N ≥ 1, got shape {tuple(logits.shape)}")
    _flatten_for_ce(logits, labels, ignore_index=-100)  # shape, dtype and range checks
    if (labels == -100).any():
        raise ValueError("soft_binned_ece: every row needs a label (no ignore_index rows)")
    width = (1.0 / n_bins) ** 2 / 4 if width is None else width
    if not (math.isfinite(width) and width > 0):
        raise ValueError(f"width must be a positive finite number, got {width}")
    p = F.softmax(logits, dim=-1)
    conf = p.max(dim=-1).values
    correct = (logits.argmax(dim=-1) == labels).to(p.dtype)
    centres = (torch.arange(n_bins, dtype=p.dtype, device=p.device) + 0.5) / n_bins
    w = F.softmax(-(conf[:, None] - centres[None, :]).square() / width, dim=-1)  # (N, B)
    mass = w.sum(0)  # (B,)
    gap = (w * (correct - conf)[:, None]).sum(0)  # Σ_i w_ib (a_i − c_i)
    return (gap.abs() * (mass > 0)).sum() / logits.shape[0]


def neg_entropy(logits: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
    """−mean entropy of softmax(logits) (N, K): CALM's label-free upper loss; ``labels`` is
    accepted and ignored, so every calibration loss has one signature."""
    return -entropy(logits)


def label_nll(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``labels`` (N,) under softmax(logits) (N, K)."""
    return cross_entropy(logits, labels)


# the one table of these losses (torch-free, with what each acts on): `calibration.loss_table`
CALIBRATION_LOSSES: Registry[CalibrationLoss] = LOSSES
"""The one table of calibration (upper) losses, ``calibration.loss_table.LOSSES`` itself, under
the name this module has always exported."""


def calibration_loss(name: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The loss ``(logits (N, K), labels (N,)) -> scalar`` registered as ``name``
    (``CALIBRATION_LOSSES``): "entropy" = −mean entropy, "nll" = mean cross-entropy of the
    labels, "soft_ece" = `soft_binned_ece`. An unknown name is a ValueError listing the
    registered ones."""
    return CALIBRATION_LOSSES.get(name).function("options")
