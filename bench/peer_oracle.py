"""Float64 oracles for the first-step hypergradients of bench/peers.py, independent of every
library compared (bilevel included): they decide which of two disagreeing results is right.

- ITD-SGD, ITD-Adam, MAML: the unrolled objective F(α) = f(α, θ_T(α)) evaluated in float64
  with plain inner updates (no autograd through them), its directional derivative along u by
  a central difference, D_u F ≈ (F(α + εu) − F(α − εu)) / 2ε, against ⟨h, u⟩ for a library's
  hypergradient h, along a fixed random unit u and along ĥ = h/‖h‖ (so a wrong length or a
  wrong direction both show). Error O(ε²) + float64 rounding / ε; ε from a ladder, on the
  plateau (``EPS_LADDER``).
- V-PBGD: its α direction ∇_α f(α, θ) + γ (∇_α g(α, θ) − ∇_α g(α, θ^(T))) in float64 by plain
  autograd (explicit first-order terms: "explicit").
- AID-CG where θ has ≤ ``DENSE_MAX`` entries: the implicit hypergradient at θ^(T) by a dense
  float64 solve, h* = ∇_α f − ∇²_{αθ} g · H⁻¹ ∇_θ f with H = ∇²_{θθ} g formed column by
  column (CG with K iterations approximates it; a large gap is a wrong solve or an early
  stop, not float32 rounding).
"""

from __future__ import annotations

from typing import Any

import torch

import bilevel

from .peer_steps import Spec

DENSE_MAX = 2000
# Central-difference steps tried: an unrolled Adam is steep where a gradient entry is tiny
# (its step's derivative is ≈ ε/g²), so a fixed step can leave the linear regime (hyper-
# cleaning, full size: 1e-5 gives a 3× wrong derivative, 1e-9 agrees with float64 autograd
# to 3e-4). The estimate used is the one on the plateau: the step whose estimate changes
# least to the next smaller step's, chosen without looking at any library's answer.
EPS_LADDER = (1e-4, 1e-5, 1e-6, 1e-7, 1e-8, 1e-9)


def _inner_steps(
    spec: Spec, method: str, alpha: dict, theta: dict, eps_scaled: bool = False
) -> dict[str, torch.Tensor]:
    """θ_T from ``theta`` by T plain gradient (SGD) or Adam steps on g, fresh moments, as every
    library's unrolled Adam starts them. Adam: torch.optim.Adam's rule
    θ − lr·m̂/(√v̂ + ε); ``eps_scaled``: higher's DifferentiableAdam rule
    θ − lr·(√(1−β₂ᵗ)/(1−β₁ᵗ))·m/(√v + ε), i.e. ε replaced by ε/√(1−β₂ᵗ)."""
    lower_batch = spec.batches[1]
    m = {k: torch.zeros_like(v) for k, v in theta.items()}
    s = {k: torch.zeros_like(v) for k, v in theta.items()}
    for t in range(1, spec.inner_steps + 1):
        th = {k: v.detach().requires_grad_(True) for k, v in theta.items()}
        grads = dict(zip(th, torch.autograd.grad(spec.problem.lower(alpha, th, lower_batch),
                                                 list(th.values()))))
        if method != "ITD-Adam":
            theta = {k: th[k].detach() - spec.inner_lr * grads[k] for k in th}
            continue
        for k in th:
            m[k] = 0.9 * m[k] + 0.1 * grads[k]
            s[k] = 0.999 * s[k] + 0.001 * grads[k] ** 2
        c1, c2 = 1 - 0.9**t, 1 - 0.999**t
        eps = 1e-8 / c2**0.5 if eps_scaled else 1e-8
        theta = {k: th[k].detach() - spec.inner_lr * (m[k] / c1) / ((s[k] / c2).sqrt() + eps)
                 for k in th}
    return theta


def _objective(spec: Spec, method: str, alpha: dict, theta0: dict, eps_scaled: bool) -> float:
    """F(α) = f(α, θ_T(α)); MAML starts every task at α."""
    if method == "MAML":
        theta0 = bilevel.task_copies(alpha, next(iter(theta0.values())).shape[0])
    theta = _inner_steps(spec, method, alpha, theta0, eps_scaled)
    with torch.no_grad():
        return float(spec.problem.upper(alpha, theta, spec.batches[0]))


def _flat(tree: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([v.reshape(-1) for v in tree.values()])


def _unflat(x: torch.Tensor, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out, i = {}, 0
    for k, v in like.items():
        out[k] = x[i : i + v.numel()].reshape(v.shape)
        i += v.numel()
    return out


def fd_check(
    spec64: Spec, method: str, grads: list[torch.Tensor], eps_scaled: bool = False, seed: int = 0
) -> float:
    """max over u ∈ {random unit, ĥ} of |⟨h, u⟩ − D_u F| / |D_u F| (F in float64; Adam's ε
    as in :func:`_inner_steps`)."""
    alpha0, theta0 = spec64.init()
    alpha0 = {k: v.detach() for k, v in alpha0.items()}
    theta0 = {k: v.detach() for k, v in theta0.items()}
    h = torch.cat([g.detach().double().reshape(-1) for g in grads])
    rand = torch.randn(h.numel(), generator=torch.Generator().manual_seed(seed), dtype=h.dtype)
    worst = 0.0
    for u in (rand / rand.norm(), h / h.norm()):
        fds = []
        for eps in EPS_LADDER:
            plus = _unflat(_flat(alpha0) + eps * u, alpha0)
            minus = _unflat(_flat(alpha0) - eps * u, alpha0)
            fds.append((_objective(spec64, method, plus, theta0, eps_scaled)
                        - _objective(spec64, method, minus, theta0, eps_scaled)) / (2 * eps))
        i = min(range(len(fds) - 1), key=lambda j: abs(fds[j] - fds[j + 1]))
        fd = fds[i + 1]
        worst = max(worst, abs(float(h @ u) - fd) / max(abs(fd), 1e-300))
    return worst


def dense_implicit(spec64: Spec) -> torch.Tensor | None:
    """h* at θ^(T) (T plain gradient steps from the initial θ) by a dense solve; None when θ
    has more than DENSE_MAX entries."""
    alpha0, theta0 = spec64.init()
    alpha = {k: v.detach().requires_grad_(True) for k, v in alpha0.items()}
    theta_T = _inner_steps(spec64, "ITD-SGD", alpha, {k: v.detach() for k, v in theta0.items()})
    x = _flat(theta_T).requires_grad_(True)
    if x.numel() > DENSE_MAX:
        return None
    upper_batch, lower_batch = spec64.batches

    def g_of(a: dict, flat: torch.Tensor) -> torch.Tensor:
        return spec64.problem.lower(a, _unflat(flat, theta_T), lower_batch)

    grad_g = torch.autograd.grad(g_of(alpha, x), x, create_graph=True)[0]
    hess = torch.stack([torch.autograd.grad(grad_g[i], x, retain_graph=True)[0]
                        for i in range(x.numel())])
    f = spec64.problem.upper(alpha, _unflat(x, theta_T), upper_batch)
    f_alpha_theta = torch.autograd.grad(f, [*alpha.values(), x], allow_unused=True)
    v = torch.linalg.solve(hess, f_alpha_theta[-1])
    mixed = torch.autograd.grad(grad_g, list(alpha.values()), v)
    direct = [d if d is not None else torch.zeros_like(a)
              for d, a in zip(f_alpha_theta[:-1], alpha.values())]
    return torch.cat([(d - m).reshape(-1) for d, m in zip(direct, mixed)])


def penalty_direction(spec64: Spec) -> torch.Tensor:
    """V-PBGD's first α direction at the initial (α, θ), θ^(T) by T plain gradient steps."""
    alpha0, theta0 = spec64.init()
    alpha = {k: v.detach().requires_grad_(True) for k, v in alpha0.items()}
    theta = {k: v.detach() for k, v in theta0.items()}
    theta_T = _inner_steps(spec64, "ITD-SGD", alpha, theta)
    upper_batch, lower_batch = spec64.batches
    leaves = list(alpha.values())

    def d_alpha(value: torch.Tensor) -> list[torch.Tensor]:
        if not value.requires_grad:  # f that does not read α (hyper-cleaning, L2)
            return [torch.zeros_like(a) for a in leaves]
        got = torch.autograd.grad(value, leaves, allow_unused=True)
        return [g if g is not None else torch.zeros_like(a) for g, a in zip(got, leaves)]

    f_a = d_alpha(spec64.problem.upper(alpha, theta, upper_batch))
    g_a = d_alpha(spec64.problem.lower(alpha, theta, lower_batch))
    g_a_T = d_alpha(spec64.problem.lower(alpha, theta_T, lower_batch))
    return torch.cat([(f + spec64.gamma * (g - gT)).reshape(-1)
                      for f, g, gT in zip(f_a, g_a, g_a_T)])


def oracle_errors(spec64: Spec, method: str, firsts: dict[str, list[torch.Tensor]]) -> dict[str, Any]:
    """Per library: ``{"oracle": kind, "oracle_rel_error": value}`` (kind "fd", "dense" or
    "explicit"),
    plus ``oracle_own_rule_rel_error`` for higher's (and BOAT's) Adam (:func:`_inner_steps`)."""
    out: dict[str, Any] = {}
    ref, kind = None, {"AID-CG": "dense", "V-PBGD": "explicit"}.get(method)
    if kind == "dense":
        ref = dense_implicit(spec64)
    elif kind == "explicit":
        ref = penalty_direction(spec64)
    for library, grads in firsts.items():
        if kind is not None:
            if ref is None:
                continue
            got = torch.cat([g.detach().double().reshape(-1) for g in grads])
            out[library] = {"oracle": kind, "oracle_rel_error": float((got - ref).norm() / ref.norm())}
        else:
            out[library] = {"oracle": "fd", "oracle_rel_error": fd_check(spec64, method, grads)}
            if library in ("higher", "boat") and method == "ITD-Adam":
                # higher (and BOAT, through higher) unroll a different Adam (ε/√(1−β₂ᵗ)):
                # checked against that rule too
                own = fd_check(spec64, method, grads, eps_scaled=True)
                out[library]["oracle_own_rule_rel_error"] = own
    return out
