"""Hypergradients dF/dα of F(α) = f(α, θ*(α)): unrolled (ITD) and implicit (AID).

``hypergrad(problem, outer, inner, upper_batch=..., lower_batch=..., method=...)`` returns a
pytree shaped like ``outer``. ``method`` is

* ``Unrolled(inner_steps=T, inner_lr=β, truncate=K)``: θ_0 = inner, θ_{t+1} = θ_t − β ∇_θ g(α, θ_t) and
  dF/dα = d f(α, θ_T)/dα by reverse-mode through the last K steps (all T when K is None);
  the first T − K steps run without a graph, so memory is O(K · |θ|) instead of O(T · |θ|).
  ``inner_optimizer=bilevel.SGD(momentum=...)`` or ``bilevel.Adam(...)`` unrolls that update
  instead of plain gradient descent (:mod:`bilevel.inner_optim`).
* ``Implicit(linear_solver=S)``: takes θ = inner as the lower-level solution and uses the
  implicit function theorem,

      dF/dα = ∇_α f − ∇²_{αθ} g · v,   where  ∇²_{θθ} g · v = ∇_θ f  is solved by S,

  S being any ``solve(matvec, b, init=None) -> (x, info)`` (see :mod:`bilevel.linalg`).
* ``FiniteDifference(inner_lr=ξ, eps)`` (in ``_finite_difference``): DARTS' approximation of
  the one-step unrolled hypergradient, the mixed Hessian-vector product replaced by a central
  difference of ∇_α g;
* any object with the :class:`HypergradMethod` ``estimate`` method.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from . import tree
from ._autodiff import grad, leaf_aliases, vjp
from ._checks import check_int, check_positive
from ._internals import (
    Batches,
    CheckedObjectives,
    Estimate,
    FlatVariables,
    flatten_variables,
    inner_gradient_steps,
)
from .inner_optim import SGD, InnerOptimizer, check_inner_optimizer, detach_state
from .linalg import (
    CG,
    LinearSolve,
    LinearSolver,
    Neumann,
    as_linear_solve,
    solver_name,
    unpack_solution,
)
from .problem import Problem

__all__ = ["Estimate", "HypergradMethod", "Implicit", "Unrolled", "hypergrad"]


@runtime_checkable
class HypergradMethod(Protocol):
    """What ``hypergrad`` accepts as ``method``: ``Unrolled``, ``Implicit`` or your own.

    ``estimate`` evaluates f and g only through ``objectives`` (which checks their values),
    reads α and θ as flat leaf lists from ``variables`` and returns an :class:`Estimate`
    with the hypergradient as a flat list shaped like ``variables.outer``.
    """

    def estimate(
        self, objectives: CheckedObjectives, variables: FlatVariables, batches: Batches
    ) -> Estimate: ...


def check_truncate(owner: str, truncate: object, inner_steps: int) -> None:
    """``truncate`` is None or an int in [1, inner_steps] (ValueError/TypeError naming ``owner``)."""
    if truncate is None:
        return
    check_int(owner, "truncate", truncate, minimum=1)
    if truncate > inner_steps:  # type: ignore[operator]  # an int: check_int passed
        raise ValueError(
            f"{owner}: truncate={truncate} exceeds inner_steps={inner_steps}; use "
            "truncate=None to differentiate through every step"
        )


@dataclass(frozen=True)
class Unrolled:
    """Iterative differentiation through ``inner_steps`` inner gradient steps of size
    ``inner_lr`` (the argument names of :class:`bilevel.ITD`).

    ``truncate=K`` back-propagates through the last K steps only (truncated BPTT;
    Shaban et al., 2019). Cost: T forward-backward passes of g, K of them with a graph
    (create_graph) and one extra backward through those K steps, plus one forward-backward
    of f. Memory: O(K · |θ|) activations of g.

    ``inner_optimizer`` is the update that is unrolled: ``bilevel.SGD()`` (plain gradient
    descent, the default), ``bilevel.SGD(momentum=μ, nesterov=...)`` or
    ``bilevel.Adam(betas, eps)`` (:mod:`bilevel.inner_optim`: torch.optim's rules, written
    differentiably; torchopt's MetaSGD/MetaAdam are the peers), with learning rate
    ``inner_lr``. Its state (momentum buffer, Adam's moments) starts at zero at the given θ
    and is part of the graph; with ``truncate=K`` the state reached after the first T − K
    steps is a constant, like θ_{T−K}. Memory adds the state: one θ-sized buffer per step
    for momentum, two for Adam.
    """

    inner_steps: int
    inner_lr: float
    truncate: int | None = None
    inner_optimizer: InnerOptimizer = field(default_factory=SGD)

    def __post_init__(self) -> None:
        check_int("Unrolled", "inner_steps", self.inner_steps, minimum=1)
        check_positive("Unrolled", "inner_lr", self.inner_lr)
        check_truncate("Unrolled", self.truncate, self.inner_steps)
        check_inner_optimizer("Unrolled", self.inner_optimizer)

    def estimate(
        self, objectives: CheckedObjectives, variables: FlatVariables, batches: Batches,
        *, draw: Callable[[], Any] | None = None,
    ) -> Estimate:
        """dF/dα through the unrolled steps; see the class docstring. ``draw``: each inner
        step evaluates g on its own fresh batch ``draw()`` instead of ``batches.lower``."""
        T = self.inner_steps
        K = T if self.truncate is None else self.truncate
        alpha = leaf_aliases(variables.outer)
        start = variables.replace(outer=alpha, inner=[x.detach() for x in variables.inner])
        opt, lr = self.inner_optimizer, self.inner_lr
        # Steps outside the truncation window: no graph at all.
        if opt.plain:
            state = None
            theta, first_grad, first_value = inner_gradient_steps(
                objectives, start, batches.lower, steps=T - K, lr=lr, total=T, draw=draw
            )
        else:
            theta, state, first_grad, first_value = _optimizer_steps(
                objectives, start, batches.lower, opt, steps=T - K, lr=lr, total=T, draw=draw
            )
        # Steps inside the window, with plain autograd.grad(create_graph=True): faster than
        # torch.func.grad of the whole loop (docs/performance.md, "Measured choices inside
        # bilevel/").
        theta = leaf_aliases(theta)
        outer_tree = variables.outer_tree(alpha)
        for t in range(T - K, T):
            where = f"inner step {t + 1} of {T}"
            b = batches.lower if draw is None else draw()
            g = objectives.lower(outer_tree, variables.inner_tree(theta), b, where)
            # differentiable mean over ranks: the reverse sweep all-reduces its adjoints too
            gth = objectives.mean(grad(g, theta, create_graph=True), differentiable=True)
            if t == 0:
                first_grad, first_value = [x.detach() for x in gth], g.detach()
            theta, state = opt.step(theta, gth, state, lr)
        where = f"after {T} inner steps"
        f = objectives.upper(outer_tree, variables.inner_tree(theta), batches.upper, where)
        # frees the unrolled graph; each rank has the partial through its own α (its f and g
        # evaluations), so their mean over ranks is dF/dα of the mean f
        outer_grad = objectives.mean(grad(f, alpha))
        assert first_grad is not None and first_value is not None  # steps >= 1
        return Estimate(
            outer_grad=[x.detach() for x in outer_grad],
            inner_solution=[x.detach() for x in theta],
            first_inner_grad=first_grad,
            scalars={"upper_loss": f.detach(), "lower_loss": first_value},
        )


def _optimizer_steps(
    objectives: CheckedObjectives,
    variables: FlatVariables,
    batch: Any,
    opt: InnerOptimizer,
    *,
    steps: int,
    lr: float,
    total: int,
    draw: Callable[[], Any] | None = None,
) -> tuple[list[torch.Tensor], Any, list[torch.Tensor] | None, torch.Tensor | None]:
    """``steps`` graph-free steps of a stateful inner optimizer from ``variables.inner``:
    θ, the (detached) optimizer state, and the first step's gradient and value."""
    outer = variables.outer_tree([a.detach() for a in variables.outer])
    theta = [x.detach() for x in variables.inner]
    state = opt.init(theta)
    first_grad, first_value = None, None
    for t in range(steps):
        leaves = leaf_aliases(theta)
        b = batch if draw is None else draw()
        g = objectives.lower(outer, variables.inner_tree(leaves), b, f"inner step {t + 1} of {total}")
        gth = objectives.mean(grad(g, leaves))
        if t == 0:
            first_grad, first_value = gth, g.detach()
        with torch.no_grad():
            theta, state = opt.step(theta, gth, state, lr)
    return theta, detach_state(state), first_grad, first_value


def _check_solution(x: Any, b: list[torch.Tensor]) -> list[torch.Tensor]:
    """The linear solver's x as a list shaped like b, or a ValueError saying what it was."""
    if isinstance(x, torch.Tensor) or not isinstance(x, (list, tuple)):
        raise ValueError(
            "Implicit: the linear solver must return (x, info) with x a list of tensors "
            f"shaped like b, got x of type {type(x).__name__}"
        )
    if len(x) != len(b) or any(
        not isinstance(xi, torch.Tensor) or xi.shape != bi.shape for xi, bi in zip(x, b)
    ):
        raise ValueError(
            "Implicit: the linear solver returned x of shapes "
            f"{[tuple(getattr(xi, 'shape', ())) for xi in x]} for b of shapes "
            f"{[tuple(bi.shape) for bi in b]}"
        )
    return list(x)


@dataclass(frozen=True)
class Implicit:
    """Implicit differentiation at θ = ``inner``, assumed to minimize g(α, ·).

    dF/dα = ∇_α f − ∇²_{αθ} g · v  with  ∇²_{θθ} g · v = ∇_θ f  (solved by ``linear_solver``:
    a `bilevel.linalg` solver or any callable ``solve(matvec, b, init=None) -> (x, info)``
    over lists of tensors; its ``info`` keys appear as ``solver_<key>``).

    Cost: one forward-backward of f; one forward of g and one backward with
    ``create_graph=True`` (the graph of ∇_θ g, kept alive for the solve); one backward
    through that graph per matvec (CG: ≤ maxiter) and one more for the mixed term.
    Memory: O(|θ|) plus one double-backward graph of g, independent of iterations.
    """

    linear_solver: LinearSolver | LinearSolve = field(default_factory=CG)

    def __post_init__(self) -> None:
        as_linear_solve(self.linear_solver, "Implicit")  # validates it

    def estimate(
        self,
        objectives: CheckedObjectives,
        variables: FlatVariables,
        batches: Batches,
        *,
        where: str = "at the inner solution",
        copy_solution: bool = False,
        init: list[torch.Tensor] | None = None,
        matvec: Callable[[list[torch.Tensor]], list[torch.Tensor]] | None = None,
    ) -> Estimate:
        """dF/dα at θ = ``variables.inner``; ``init`` warm-starts the linear solve; ``matvec``
        replaces the Hessian-vector product of the solve (AID's fresh-batch HVPs, stocBiO),
        the mixed term and ∇_θ g still coming from ``batches.lower``.

        Under data parallelism (:mod:`bilevel.distributed`) ∇f and ∇_θ g (ITD/AID's inner
        direction) are averaged over the ranks in one collective, and each Hessian-vector
        product of the solve and the mixed product in one more each; the graph of ∇_θ g
        stays this rank's own."""
        alpha, theta = leaf_aliases(variables.outer), leaf_aliases(variables.inner)
        outer_tree, inner_tree = variables.outer_tree(alpha), variables.inner_tree(theta)
        g = objectives.lower(outer_tree, inner_tree, batches.lower, where)
        # Linearize once: the graph of ∇_θ g is built a single time and every Hessian-vector
        # product below is one backward through it (retain_graph=True); as the Hessian is
        # symmetric, the vector-Jacobian product of ∇_θ g is the HVP. Faster than the torch.func
        # alternatives (timings: docs/performance.md, "Measured choices inside bilevel/"); plain
        # autograd also leaves a model's frozen parameters alone even when requires_grad=True.
        gth = grad(g, theta, create_graph=True)
        f = objectives.upper(outer_tree, inner_tree, batches.upper, where)
        df = objectives.mean(grad(f, alpha + theta) + [x.detach() for x in gth])
        f_alpha, f_theta, g_theta = df[: len(alpha)], df[len(alpha) : -len(theta)], df[-len(theta) :]
        objectives.check()  # a NaN would otherwise surface as a confusing solver failure

        def hvp(v: list[torch.Tensor]) -> list[torch.Tensor]:
            return objectives.mean(vjp(gth, theta, v, retain_graph=True))

        solve = as_linear_solve(self.linear_solver, "Implicit")
        v, solve_info = unpack_solution(solve(matvec or hvp, f_theta, init), solve, "Implicit")
        v = _check_solution(v, f_theta)
        # A NaN or inf in v (a user's solver that does not check) is refused at the step's
        # single finiteness check, naming the solver. Neumann has just checked its sum
        # itself: a second norm and host read per call would be pure overhead.
        if type(self.linear_solver) is not Neumann:
            label = f"the linear solver {solver_name(solve)} (‖x‖² of its solution)"
            objectives.record_finite(tree.sq_norm_list(v), label)
        mixed = objectives.mean(vjp(gth, alpha, v, retain_graph=False))  # ∇²_{αθ} g · v; frees the graph
        scalars: dict[str, torch.Tensor | float] = {"upper_loss": f.detach(), "lower_loss": g.detach()}
        scalars.update({f"solver_{k}": val for k, val in dict(solve_info).items()})
        return Estimate(
            outer_grad=[(fa - m).detach() for fa, m in zip(f_alpha, mixed)],
            # ``inner`` may be the caller's storage: a solver that returns this as its
            # inner_solution asks for a copy (copy_solution=True); ``hypergrad`` discards it,
            # so by default no copy of a possibly LoRA-sized θ is made.
            inner_solution=[x.detach().clone() if copy_solution else x.detach() for x in variables.inner],
            first_inner_grad=g_theta,
            scalars=scalars,
            linear_solution=[x.detach() for x in v],
        )


Method = Unrolled | Implicit | HypergradMethod


def hypergrad(
    problem: Problem,
    outer: Any,
    inner: Any,
    *,
    upper_batch: Any,
    lower_batch: Any,
    method: Method,
    return_info: bool = False,
) -> Any:
    """dF/d(outer) for F(outer) = upper(outer, inner*(outer), upper_batch).

    Args:
        problem: the bilevel problem (upper f, lower g).
        outer: pytree of floating tensors α (any shapes).
        inner: pytree of floating tensors θ: the starting point for ``Unrolled``, the
            (approximate) lower-level solution for ``Implicit``.
        upper_batch: passed unchanged to f.
        lower_batch: passed unchanged to g.
        method: ``Unrolled(...)``, ``Implicit(...)``, ``FiniteDifference(...)`` or any
            :class:`HypergradMethod`.
        return_info: also return the diagnostics (docs/bilevel.md lists the keys).

    Returns:
        A detached pytree with the structure and shapes of ``outer``. Leaves that neither
        objective uses get zeros, named once per method and problem with
        :class:`bilevel.UnusedLeafWarning`. Nothing is written to any ``.grad``. With
        ``return_info=True``, ``(grads, info)``: ``info`` is a dict of Python floats,
        ``upper_loss`` and ``lower_loss`` and, for ``Implicit``, ``solver_<key>`` for each key
        of the linear solver's info (CG: ``solver_iterations``, ``solver_residual``).
    """
    # the shipped methods first: a runtime Protocol check walks the class's attributes
    if not isinstance(method, (Unrolled, Implicit)) and not isinstance(method, HypergradMethod):
        raise TypeError(
            "hypergrad: method must be bilevel.Unrolled, bilevel.Implicit or "
            "bilevel.FiniteDifference (or an object with "
            f"estimate(objectives, variables, batches) -> Estimate), got {type(method).__name__}"
        )
    objectives = CheckedObjectives(problem, f"hypergrad({type(method).__name__})")
    variables = flatten_variables("hypergrad", outer, inner)
    est = method.estimate(objectives, variables, Batches(upper=upper_batch, lower=lower_batch))
    if not return_info:
        objectives.check()
        return variables.outer_tree(est.outer_grad)
    info = objectives.finish(dict(est.scalars))
    return variables.outer_tree(est.outer_grad), info
