"""The finite-difference hypergradient of DARTS (Liu, Simonyan & Yang, "DARTS: Differentiable
Architecture Search", ICLR 2019, eq. 7–8): no Hessian-vector product, two extra gradients.

The form approximated is the *one-step unrolled* hypergradient. With θ' = θ − ξ ∇_θ g(α, θ)
(one inner gradient step of size ξ from the given θ) and F₁(α) = f(α, θ'(α)):

    dF₁/dα = ∇_α f(α, θ') − ξ ∇²_{αθ} g(α, θ) · v,          v = ∇_θ f(α, θ')

and DARTS replaces the mixed second derivative by a central difference of ∇_α g:

    ∇²_{αθ} g(α, θ) · v ≈ (∇_α g(α, θ⁺) − ∇_α g(α, θ⁻)) / (2r),   θ^± = θ ± r v,  r = ε / ‖v‖

(DARTS: ε = 0.01). The difference is exact when ∇_α g is at most quadratic in θ (e.g. a
quadratic lower level, or a weight decay α·‖θ‖²) and has error O(r²) otherwise, so the
oracle is ``Unrolled(inner_steps=1, inner_lr=ξ)`` at the same θ, not the implicit
hypergradient at θ* (the one-step form is itself an approximation of that).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import tree
from ._autodiff import grad, leaf_aliases
from ._checks import check_positive
from ._internals import Batches, CheckedObjectives, Estimate, FlatVariables

__all__ = ["FiniteDifference"]


@dataclass(frozen=True)
class FiniteDifference:
    """DARTS' second-order approximation: the one-step unrolled hypergradient at θ = ``inner``
    with the mixed Hessian-vector product replaced by a central difference (module docstring).

    Args:
        inner_lr: ξ > 0, the size of the one unrolled inner step (DARTS: the weights'
            learning rate).
        eps: ε > 0; the perturbation is θ ± (ε / ‖v‖) v, so its norm is ε (DARTS: 0.01).

    Cost: one forward-backward of g (∇_θ g at θ), one forward-backward of f at θ' (w.r.t.
    α and θ), two forwards of g at θ^± with a backward w.r.t. α only (autograd runs just the
    operations that touch α). No second derivatives, no graph survives.
    Memory: O(|θ|) (θ', v, θ^±) + one graph of f or g at a time.
    """

    inner_lr: float
    eps: float = 0.01

    def __post_init__(self) -> None:
        check_positive("FiniteDifference", "inner_lr", self.inner_lr)
        check_positive("FiniteDifference", "eps", self.eps)

    def estimate(
        self, objectives: CheckedObjectives, variables: FlatVariables, batches: Batches
    ) -> Estimate:
        """dF₁/dα ≈ ∇_α f(α, θ') − ξ (∇_α g(α, θ⁺) − ∇_α g(α, θ⁻)) / (2r)."""
        alpha = leaf_aliases(variables.outer)
        outer_tree = variables.outer_tree(alpha)
        outer_const = variables.outer_tree([a.detach() for a in variables.outer])
        theta0 = leaf_aliases(variables.inner)
        g0 = objectives.lower(
            outer_const, variables.inner_tree(theta0), batches.lower, "inner step 1 of 1"
        )
        g_theta = objectives.mean(grad(g0, theta0))
        with torch.no_grad():
            theta1 = list(
                torch._foreach_add([t.detach() for t in theta0], g_theta, alpha=-self.inner_lr)
            )
        theta1 = leaf_aliases(theta1)
        f = objectives.upper(outer_tree, variables.inner_tree(theta1), batches.upper,
                             "after 1 inner step")
        df = objectives.mean(grad(f, alpha + theta1))
        f_alpha, v = df[: len(alpha)], df[len(alpha):]
        # r = ε/‖v‖ as a tensor (no device sync); v = 0 gives θ^± = θ and a zero difference.
        norm = tree.sq_norm_list(v).sqrt()
        r = self.eps / norm.clamp_min(torch.finfo(norm.dtype).tiny)
        sides = []
        for sign in (1.0, -1.0):
            with torch.no_grad():
                shifted = [t.detach() + (sign * r).to(t.dtype) * vi for t, vi in zip(theta0, v)]
            label = f"at θ {'+' if sign > 0 else '−'} r·∇_θ f (finite difference)"
            g = objectives.lower(outer_tree, variables.inner_tree(shifted), batches.lower, label)
            sides.append(objectives.mean(grad(g, alpha)))
        scale = -self.inner_lr / (2.0 * r)
        outer_grad = [
            fa + scale.to(p.dtype) * (p - m) for fa, p, m in zip(f_alpha, sides[0], sides[1])
        ]
        return Estimate(
            outer_grad=[x.detach() for x in outer_grad],
            inner_solution=[x.detach() for x in theta1],
            first_inner_grad=g_theta,
            scalars={"upper_loss": f.detach(), "lower_loss": g0.detach(), "fd_radius": r},
        )
