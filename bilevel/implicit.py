"""Implicit differentiation of an inner solution computed by any solver: :func:`custom_root`.

Given ``inner = solve(outer, *args)`` with ``F(outer, inner) = 0`` at the solution (F =
``optimality``, a pytree shaped like ``inner``), the implicit function theorem gives

    d inner / d outer = −(∂F/∂inner)⁻¹ ∂F/∂outer,

so for a cotangent v̄ (shaped like ``inner``) the vector-Jacobian product is

    (∂F/∂inner)ᵀ u = v̄,    outer_grad = −(∂F/∂outer)ᵀ u.

The backward of the wrapped function solves that system with ``linear_solver`` (matvec
u ↦ (∂F/∂inner)ᵀ u is one VJP of F; a solver that also takes ``rmatvec`` gets p ↦
(∂F/∂inner) p by the double-VJP trick) and returns −(∂F/∂outer)ᵀ u as outer's gradient.
This is jaxopt's and torchopt's ``custom_root`` design (Blondel et al., "Efficient and
modular implicit differentiation", NeurIPS 2022), written as a ``torch.autograd.Function``.

Decisions (docs/bilevel.md, "Differentiating an inner solution computed elsewhere"):

* Differentiated: the floating-point tensor leaves of ``outer`` (the first argument; any
  pytree) that require grad. Further positional and keyword arguments are passed to
  ``solve`` and ``optimality`` unchanged and are not differentiated.
* ``solve`` is called with ``outer`` detached, in the caller's grad mode (L-BFGS needs grad
  enabled inside), and its result is detached: the solver's own graph, if any, is never
  back-propagated through. Only the implicit derivative reaches ``outer``.
* ``has_aux=True``: ``solve`` returns ``(inner, aux)``; aux is returned as is, not
  differentiated.
* Default linear solver: ``bilevel.linalg.Dense()`` — exact, valid for the non-symmetric
  Jacobians optimality conditions have (a projected-gradient fixed point), and for at most
  ``Dense.max_size`` unknowns. For large inner variables pass an iterative solver; one
  accepting ``rmatvec=`` (a least-squares solver) receives the untransposed product too.
* Linear-solver diagnostics: an ``info`` with ``converged`` False warns with
  :class:`bilevel.ConvergenceWarning` (no ``converged`` key: unknown, no warning); a
  non-finite solution u raises ``FloatingPointError``.
* An outer leaf that requires grad but that ``optimality`` does not depend on gets a zero
  gradient from this function and a :class:`bilevel.UnusedLeafWarning` naming it, once
  per decorated function and outer structure (not at every backward of a training loop).
* The backward is not itself differentiable (``once_differentiable``): second derivatives
  through ``custom_root`` raise.
"""

from __future__ import annotations

import functools
import inspect
import math
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.autograd.function import once_differentiable
from torch.utils import _pytree as pytree

from . import tree
from .errors import ConvergenceWarning, UnusedLeafWarning
from .linalg import Dense, LinearSolve, LinearSolver, as_linear_solve, solver_name, unpack_solution

__all__ = ["custom_root"]


def _paths(leaves: list[torch.Tensor], spec: tree.TreeSpec) -> list[str]:
    """``keystr`` of each leaf's path (``['w']``, ``[0]``; ``''`` for a lone tensor)."""
    flat = pytree.tree_flatten_with_path(tree.unflatten(leaves, spec))[0]
    return [pytree.keystr(p) for p, _ in flat]


def _check_solution(leaves: list[torch.Tensor], spec: tree.TreeSpec) -> None:
    """Refuse a solution with a non-floating or non-finite leaf, naming its path."""
    for path, x in zip(_paths(leaves, spec), leaves):
        if not x.is_floating_point():
            raise TypeError(
                f"custom_root: the solver's inner{path} has dtype {x.dtype}; it must be "
                "floating point to be differentiated"
            )
    finite = torch.stack([torch.isfinite(x).all() for x in leaves]).tolist()  # one sync
    for path, ok in zip(_paths(leaves, spec), finite):
        if not ok:
            raise FloatingPointError(
                f"custom_root: the solver returned a non-finite inner{path}; implicit "
                "differentiation needs a solution of optimality(outer, inner) = 0"
            )


def _optimality_leaves(value: Any, inner: list[torch.Tensor], spec: tree.TreeSpec) -> list:
    """F's leaves, or a ValueError naming both structures (or both shapes) when F is not
    shaped like inner."""
    leaves, fspec = pytree.tree_flatten(value)
    if fspec != spec:
        raise ValueError(
            "custom_root: optimality(outer, inner) must return a pytree shaped like inner, got "
            f"{pytree.treespec_pprint(fspec)} for inner {pytree.treespec_pprint(spec)}"
        )
    for path, f, x in zip(_paths(inner, spec), leaves, inner):
        if not isinstance(f, torch.Tensor) or f.shape != x.shape:
            got = tuple(f.shape) if isinstance(f, torch.Tensor) else type(f).__name__
            raise ValueError(
                f"custom_root: optimality(outer, inner){path} has shape {got} but "
                f"inner{path} has shape {tuple(x.shape)}"
            )
    return leaves


def _takes_rmatvec(solve: LinearSolve) -> bool:
    try:
        inspect.signature(solve).bind(None, None, init=None, rmatvec=None)
    except (TypeError, ValueError):
        return False
    return True


def _vjp(outs: list, inputs: list, cots: list, **kw: Any) -> list:
    """Σ cotᵀ ∂out/∂inputs with None (input unused) kept; outputs without graph skipped."""
    pairs = [(o, c) for o, c in zip(outs, cots) if o.requires_grad]
    if not pairs or not inputs:
        return [None] * len(inputs)
    o, c = zip(*pairs)
    return list(torch.autograd.grad(o, inputs, grad_outputs=c, allow_unused=True, **kw))


def _zeros_for_none(gs: list, like: list) -> list[torch.Tensor]:
    return [torch.zeros_like(x) if g is None else g for g, x in zip(gs, like)]


def _warn_unconverged(info: dict[str, Any], name: str) -> None:
    """ConvergenceWarning when the solver says it did not converge; no key: unknown."""
    if "converged" in info and not bool(info["converged"]):
        warnings.warn(
            f"custom_root: the linear solver {name} did not converge in the backward "
            f"(residual {float(info.get('residual', math.nan)):.3g}, iterations "
            f"{float(info.get('iterations', math.nan)):.0f}); the gradient is approximate",
            ConvergenceWarning,
            stacklevel=3,
        )


class _Root:
    """What the backward needs: F, the trees' structures, the extra arguments, the solver,
    and the outer structures already warned about (shared by every call of one function)."""

    def __init__(self, optimality: Callable[..., Any], solve: LinearSolve, specs: tuple,
                 args: tuple, kwargs: dict, warned: set) -> None:
        self.optimality, self.solve = optimality, solve
        self.outer_spec, self.inner_spec = specs
        self.args, self.kwargs, self.warned = args, kwargs, warned

    def _solve(self, F: list, theta: list[torch.Tensor], vbar: list) -> list[torch.Tensor]:
        """u with (∂F/∂θ)ᵀ u = v̄, checked finite."""

        def matvec(u: list[torch.Tensor]) -> list[torch.Tensor]:  # (∂F/∂θ)ᵀ u
            return _zeros_for_none(_vjp(F, theta, u, retain_graph=True), theta)

        kw: dict[str, Any] = {}
        if _takes_rmatvec(self.solve):
            # (∂F/∂θ) p as the derivative in w of the linear map w ↦ (∂F/∂θ)ᵀ w
            w = [torch.zeros_like(f, requires_grad=True) for f in F]
            atw = _zeros_for_none(_vjp(F, theta, w, retain_graph=True, create_graph=True), theta)

            def rmatvec(p: list[torch.Tensor]) -> list[torch.Tensor]:
                return _zeros_for_none(_vjp(atw, w, p, retain_graph=True), w)

            kw["rmatvec"] = rmatvec
        u, info = unpack_solution(self.solve(matvec, list(vbar), None, **kw), self.solve,
                                  "custom_root")
        u = list(u)
        if not bool(torch.isfinite(tree.sq_norm_list(u))):
            raise FloatingPointError(
                f"custom_root: the linear solver {solver_name(self.solve)} returned a "
                "non-finite solution of (∂F/∂inner)ᵀ u = v̄ (a singular optimality Jacobian?)"
            )
        _warn_unconverged(info, solver_name(self.solve))
        return u

    def outer_grad(self, outer: list[torch.Tensor], inner: list[torch.Tensor], vbar: list,
                   needs: tuple[bool, ...]) -> list[torch.Tensor | None]:
        """−(∂F/∂outer)ᵀ u for the outer leaves that need a gradient (None for the others)."""
        wrt = [i for i, need in enumerate(needs) if need]
        alpha = [a.detach().requires_grad_(True) if need else a.detach()
                 for a, need in zip(outer, needs)]
        theta = [x.detach().requires_grad_(True) for x in inner]
        with torch.enable_grad():
            value = self.optimality(tree.unflatten(alpha, self.outer_spec),
                                    tree.unflatten(theta, self.inner_spec), *self.args, **self.kwargs)
            F = _optimality_leaves(value, theta, self.inner_spec)
            u = self._solve(F, theta, vbar)
            partial = _vjp(F, [alpha[i] for i in wrt], u)
        grads: list[torch.Tensor | None] = [None] * len(outer)
        for i, g in zip(wrt, partial):
            grads[i] = torch.zeros_like(outer[i]) if g is None else -g
        self._warn_unused([i for i, g in zip(wrt, partial) if g is None], outer)
        return grads

    def _warn_unused(self, unused: list[int], outer: list[torch.Tensor]) -> None:
        key = (str(self.outer_spec), tuple(unused))
        if not unused or key in self.warned:
            return
        self.warned.add(key)
        paths = _paths(outer, self.outer_spec)
        names = ", ".join(f"outer{paths[i]}" for i in unused)
        warnings.warn(
            f"custom_root: optimality(outer, inner) does not depend on {names}: the inner "
            "solution's derivative with respect to it is a structural zero (its gradient "
            "through the solution is 0, not a computed value)",
            UnusedLeafWarning,
            stacklevel=3,
        )


class _ImplicitFunction(torch.autograd.Function):
    """Identity on the (detached) inner leaves, with the implicit VJP as backward."""

    @staticmethod
    def forward(ctx: Any, root: _Root, n_outer: int, *tensors: torch.Tensor) -> tuple:
        ctx.root, ctx.n_outer = root, n_outer
        ctx.save_for_backward(*tensors)
        # copies, not views: the caller may change the returned solution in place (a warm
        # start) while the backward still differentiates at the saved root
        return tuple(x.clone() for x in tensors[n_outer:])

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, *vbar: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        saved, n = ctx.saved_tensors, ctx.n_outer
        needs = ctx.needs_input_grad[2 : 2 + n]
        grads = ctx.root.outer_grad(list(saved[:n]), list(saved[n:]), list(vbar), needs)
        return (None, None, *grads, *([None] * (len(saved) - n)))


def custom_root(
    optimality: Callable[..., Any],
    linear_solver: LinearSolver | LinearSolve | None = None,
    *,
    has_aux: bool = False,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: ``solve(outer, *args, **kwargs) -> inner`` becomes differentiable in outer.

    ``optimality(outer, inner, *args, **kwargs)`` returns a pytree shaped like ``inner``
    that is zero at the solution (e.g. ∇_inner g for a smooth inner minimization, or
    ``inner − relu(inner − η ∇_inner g)`` for a non-negativity constraint). The wrapped
    function returns the solver's inner pytree (detached from the solver's own graph) whose
    gradient with respect to ``outer``'s leaves is, for a cotangent v̄ shaped like inner,

        −(∂F/∂outer)ᵀ u   with   (∂F/∂inner)ᵀ u = v̄   (solved by ``linear_solver``),

    so ``loss(outer, solve(outer)).backward()`` and ``torch.autograd.grad`` both work.
    Valid where F(outer, ·) has an invertible Jacobian at the returned point, which must
    be a root: the derivative is that of the exact root, whatever the solver's accuracy.

    Args:
        optimality: F(outer, inner, *args, **kwargs) -> pytree shaped like inner.
        linear_solver: a :mod:`bilevel.linalg` solver or ``solve(matvec, b, init=None) ->
            (x, info)``; a callable also accepting ``rmatvec=`` gets p ↦ (∂F/∂inner) p.
            Default ``bilevel.linalg.Dense()`` (exact, non-symmetric systems; at most
            ``max_size`` = 4096 unknowns).
        has_aux: ``solve`` returns ``(inner, aux)``; ``aux`` is passed through undifferentiated.

    Extra arguments are not differentiated. Cost of a backward: one forward of F with a
    retained graph, one VJP of F per matvec (Dense: one per unknown), one more for the
    outer term; the forward costs the solver alone.
    """
    if not callable(optimality):
        raise TypeError(f"custom_root: optimality must be callable, got {type(optimality).__name__}")
    if not isinstance(has_aux, bool):
        raise TypeError(f"custom_root: has_aux must be a bool, got {has_aux!r}")
    lsolve = as_linear_solve(Dense() if linear_solver is None else linear_solver, "custom_root")

    def decorator(solve: Callable[..., Any]) -> Callable[..., Any]:
        warned: set = set()

        @functools.wraps(solve)
        def wrapped(outer: Any, *args: Any, **kwargs: Any) -> Any:
            outer_leaves, outer_spec = tree.flatten(outer, name="outer")
            result = solve(tree.unflatten([a.detach() for a in outer_leaves], outer_spec),
                           *args, **kwargs)
            if has_aux and not (isinstance(result, tuple) and len(result) == 2):
                raise TypeError("custom_root(has_aux=True): solve must return (inner, aux), got "
                                f"{type(result).__name__}")
            inner, aux = result if has_aux else (result, None)
            leaves, spec = tree.flatten(inner, name="inner")
            if not leaves:
                raise ValueError("custom_root: the solver returned an inner with no tensor leaves")
            leaves = [x.detach() for x in leaves]
            _check_solution(leaves, spec)
            root = _Root(optimality, lsolve, (outer_spec, spec), args, kwargs, warned)
            out = _ImplicitFunction.apply(root, len(outer_leaves), *outer_leaves, *leaves)
            out = tree.unflatten(list(out), spec)
            return (out, aux) if has_aux else out

        return wrapped

    return decorator
