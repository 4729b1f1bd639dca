"""Post-hoc calibration: fit an α parameterization to held-out logits by minimizing NLL.

Temperature scaling (Guo et al. 2017) fits one T > 0 to minimize
NLL(T) = −(1/N) Σ_i log softmax(z_i / T)_{y_i} over log T. NLL is convex in 1/T (a
log-sum-exp of a linear function minus a linear one), hence unimodal in log T, so a bracketed
1-D search on a bounded interval always finds the optimum inside it.

The optimum can sit at T → ∞: for a model at chance (logits unrelated to labels) NLL decreases
monotonically toward ln K as T grows. The search is therefore restricted to
``log_t_bounds`` (default [−5, 5], i.e. T ∈ [0.0067, 148]); when the fit ends on a bound, the
result says so (``at_boundary=True``) and a ``UserWarning`` is issued, because such a "fitted"
T only reflects the bound. (The CFT paper's released baseline never moves T from its initial
1.5: its loss is computed under no_grad. This one moves.)

Vector scaling fits the "affine" α (per-class τ and l) the same way, with L-BFGS in float64;
``fit_alpha`` does so for any registered parameterization.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from calibration import alpha as alpha_lib

__all__ = ["AlphaFit", "TemperatureFit", "fit_alpha", "fit_temperature", "fit_vector_scaling"]

_GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0


@dataclass(frozen=True)
class TemperatureFit:
    """Result of ``fit_temperature``: T = exp(log_temperature), NLL at T = 1 and at T, and
    whether T ended on a bound of the searched range (then T only reflects the bound)."""

    temperature: float
    log_temperature: float
    nll_before: float
    nll_after: float
    at_boundary: bool


@dataclass(frozen=True)
class AlphaFit:
    """Result of ``fit_alpha``: ``params`` usable with ``alpha.get(name, **options).apply``."""

    name: str
    params: dict[str, torch.Tensor]
    nll_before: float
    nll_after: float
    converged: bool


def _check_logits_labels(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    z = torch.as_tensor(logits).detach().to(torch.float64)
    y = torch.as_tensor(labels).detach().to(z.device)
    if z.ndim != 2 or z.shape[0] == 0 or z.shape[1] < 2:
        raise ValueError(f"logits must have shape (N, K) with N >= 1, K >= 2, got {tuple(z.shape)}")
    if y.shape != (z.shape[0],):
        raise ValueError(f"labels must have shape ({z.shape[0]},), got {tuple(y.shape)}")
    if y.is_floating_point() or y.dtype == torch.bool:
        raise TypeError(f"labels must have an integer dtype, got {y.dtype}")
    y = y.long()
    if (y < 0).any() or (y >= z.shape[1]).any():
        raise ValueError(f"labels must lie in [0, {z.shape[1]})")
    if not torch.isfinite(z).all():
        raise ValueError("logits contain NaN or infinite values")
    return z, y


def _refuse_probabilities(z: torch.Tensor, who: str) -> None:
    """Probabilities passed as logits fit a meaningless T: softmax(p / T) is not the model's
    distribution for any T (T = 1 gives a nearly uniform one), so the fit would scale the wrong
    quantity without a word. Rows that are all in [0, 1] and each sum to 1 are probabilities
    (real logits, defined up to a shift per row, essentially never are)."""
    if z.shape[0] < 2:  # one row could be either; nothing to say
        return
    in_unit = bool(((z >= 0) & (z <= 1)).all())
    if in_unit and bool(((z.sum(dim=1) - 1).abs() <= 1e-3).all()):
        raise ValueError(
            f"{who}: these look like probabilities, not logits (every entry is in [0, 1] and "
            "every row sums to 1); pass the logits, or log(probs), which softmax maps back to "
            "the same probabilities"
        )


def _golden_section(f: Callable[[float], float], lo: float, hi: float, tol: float) -> float:
    """Minimizer of a unimodal f on [lo, hi] to within tol (golden-section search)."""
    a, b = lo, hi
    c, d = b - _GOLDEN * (b - a), a + _GOLDEN * (b - a)
    fc, fd = f(c), f(d)
    while b - a > tol:
        if fc <= fd:
            b, d, fd = d, c, fc
            c = b - _GOLDEN * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + _GOLDEN * (b - a)
            fd = f(d)
    # The interval's ends can beat its interior when the minimum is on a bound.
    candidates = [(f(lo), lo), (f(hi), hi), (f(0.5 * (a + b)), 0.5 * (a + b))]
    return min(candidates)[1]


def _lbfgs_log_temperature(nll: Callable[[torch.Tensor], torch.Tensor], max_iter: int) -> float:
    """L-BFGS (strong Wolfe) on s = log T from s = 0; the s it ends at (maybe not finite)."""
    s = torch.zeros((), dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS(
        [s], lr=1.0, max_iter=max_iter, tolerance_grad=1e-12, tolerance_change=1e-15,
        line_search_fn="strong_wolfe",
    )

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = nll(s)
        loss.backward()
        return loss

    opt.step(closure)
    return float(s.detach())


def _is_stationary_inside(
    nll: Callable[[torch.Tensor], torch.Tensor], s_hat: float, lo: float, hi: float
) -> bool:
    """s_hat is finite, strictly inside (lo, hi), and |dNLL/ds| < 1e-7 there."""
    if not (math.isfinite(s_hat) and lo < s_hat < hi):
        return False
    st = torch.tensor(s_hat, dtype=torch.float64, requires_grad=True)
    (g,) = torch.autograd.grad(nll(st), [st])
    return abs(float(g)) < 1e-7


def fit_temperature(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    log_t_bounds: tuple[float, float] = (-5.0, 5.0),
    max_iter: int = 100,
    tol: float = 1e-9,
) -> TemperatureFit:
    """Fit T > 0 minimizing NLL(T) = mean_i −log softmax(z_i / T)_{y_i} on (logits, labels).

    logits: (N, K) (any float dtype; fitted in float64). labels: (N,) ints in [0, K).
    L-BFGS on s = log T from s = 0; if it leaves ``log_t_bounds`` or does not reach a
    stationary point, a golden-section search on the bounded interval (valid because NLL is
    unimodal in s) takes over. Warns and sets ``at_boundary`` when s ends within ``tol`` of a
    bound. NLL never increases: if the fit were worse than T = 1, T = 1 is returned.
    """
    lo, hi = log_t_bounds
    if not lo < 0.0 < hi:
        raise ValueError(f"log_t_bounds must satisfy lo < 0 < hi (T = 1 inside), got {log_t_bounds}")
    z, y = _check_logits_labels(logits, labels)
    _refuse_probabilities(z, "fit_temperature")

    def nll(s: torch.Tensor | float) -> torch.Tensor:
        return F.cross_entropy(z * torch.exp(-torch.as_tensor(s, dtype=torch.float64)), y)

    nll_before = float(nll(0.0))
    s_hat = _lbfgs_log_temperature(nll, max_iter)
    if not _is_stationary_inside(nll, s_hat, lo, hi):
        s_hat = _golden_section(lambda v: float(nll(v)), lo, hi, tol)

    nll_after = float(nll(s_hat))
    if nll_after > nll_before:
        # Only reachable through round-off on a flat NLL; keep the identity rather than worsen.
        s_hat, nll_after = 0.0, nll_before
    at_boundary = min(s_hat - lo, hi - s_hat) <= tol
    if at_boundary:
        warnings.warn(
            f"fit_temperature: the NLL optimum lies on the bound log T = {s_hat:.3g} of "
            f"log_t_bounds={log_t_bounds} (T = {math.exp(s_hat):.3g}); NLL keeps decreasing "
            "beyond it (e.g. a model at chance, where the optimum is T → ∞).",
            UserWarning,
            stacklevel=2,
        )
    return TemperatureFit(
        temperature=math.exp(s_hat),
        log_temperature=s_hat,
        nll_before=nll_before,
        nll_after=nll_after,
        at_boundary=at_boundary,
    )


def fit_alpha(
    parameterization: str | alpha_lib.Parameterization,
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    max_iter: int = 500,
    dtype: torch.dtype = torch.float32,
    **options: str,
) -> AlphaFit:
    """Fit any α parameterization post hoc: minimize mean_i −log softmax(apply(α, z_i))_{y_i}.

    ``parameterization`` is a registry name (with ``options``) or a Parameterization. L-BFGS
    (strong Wolfe) in float64 from the identity; returned params are detached, in ``dtype``.
    If the fit ended worse than the identity (it cannot in exact arithmetic), the identity is
    returned. logits (N, K), labels (N,).
    """
    p = (
        alpha_lib.get(parameterization, **options)
        if isinstance(parameterization, str)
        else parameterization
    )
    z, y = _check_logits_labels(logits, labels)
    _refuse_probabilities(z, "fit_alpha")
    init = p.init(z.shape[1], dtype=torch.float64)
    params = {k: v.clone().requires_grad_() for k, v in init.items()}
    nll_before = float(F.cross_entropy(z, y))
    converged = True
    if params:
        opt = torch.optim.LBFGS(
            list(params.values()), lr=1.0, max_iter=max_iter, tolerance_grad=1e-10,
            tolerance_change=1e-14, history_size=50, line_search_fn="strong_wolfe",
        )

        def closure() -> torch.Tensor:
            opt.zero_grad()
            loss = F.cross_entropy(p.apply(params, z), y)
            loss.backward()
            return loss

        opt.step(closure)
        grads = torch.autograd.grad(F.cross_entropy(p.apply(params, z), y), list(params.values()))
        converged = max(float(g.abs().max()) for g in grads) < 1e-5
    fitted = {k: v.detach() for k, v in params.items()}
    nll_after = float(F.cross_entropy(p.apply(fitted, z), y))
    if not math.isfinite(nll_after) or nll_after > nll_before:
        fitted, nll_after = init, nll_before
    return AlphaFit(
        name=p.name,
        params={k: v.to(dtype) for k, v in fitted.items()},
        nll_before=nll_before,
        nll_after=nll_after,
        converged=converged,
    )


def fit_vector_scaling(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    form: str = "scale_shift",
    positivity: str = "log",
    max_iter: int = 500,
    dtype: torch.dtype = torch.float32,
) -> AlphaFit:
    """Vector scaling: per-class τ and l (the "affine" α), fitted by NLL like ``fit_alpha``.

    Use the result with ``alpha.get("affine", form=form, positivity=positivity).apply``.
    """
    return fit_alpha("affine", logits, labels, max_iter=max_iter, dtype=dtype, form=form,
                     positivity=positivity)
