"""One outer step of each (library, method) on a classic problem, for bench/peers.py.

Every library receives the same :class:`Spec` (objectives, initialization, batches, outer
Adam step size, T, inner step size, CG iterations) and returns a function
``hypergrad(state) -> (dF/dα per α leaf, θ after the step or None)``; :meth:`State.apply`
then takes the same outer step for all of them (α.grad ← the hypergradient, Adam; θ ← θ^(T),
the warm start of ITD/AID in ``bilevel.fit(inner_update="solution")``).

Each peer is driven the way its own documentation and examples use it:

- torchopt 0.7: ``MetaSGD`` / ``MetaAdam`` unrolled on an ``nn.Module`` (ITD; MAML one task
  at a time as in its MAML example), ``torchopt.diff.implicit.custom_root`` with
  ``linear_solve.solve_cg`` and ``torch.func.grad`` of g as the optimality condition (AID-CG);
  the T inner steps before the implicit solve are written by hand (torchopt has no solver).
- higher 0.2: ``innerloop_ctx`` with a differentiable ``torch.optim.SGD`` / ``Adam``.
- betty-ml 0.1.1: ``betty.hypergradient.get_grads`` with its ``cg`` on the stand-in problems
  of bench/libs/betty_lib.py (its engine is not used; the T inner steps are by hand).
- BOAT (boat-torch 1.1.1): its ``Problem`` API with NGD + RAD or CG (bench/libs/boat_lib.py).

Peers are imported only inside these functions: bench/ and tests are their only users.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

import bilevel

Grads = tuple[list[torch.Tensor], list[torch.Tensor] | None]
Hypergrad = Callable[["State"], Grads]
METHODS = ("ITD-SGD", "ITD-Adam", "AID-CG", "MAML", "V-PBGD")


@dataclass(frozen=True)
class Spec:
    """One classic problem with one method's settings: what every library gets.

    ``init()`` returns fresh ``(α, θ)`` dicts of leaf tensors, the same values on every call.
    ``gamma`` is V-PBGD's penalty γ (constant); its θ step size is ``inner_lr / gamma``, as in
    the examples (the θ direction ∇f + γ∇g scales with γ). ``task_loss`` is set for meta-learning (``bilevel.meta_problem``'s per-task loss; θ then
    carries a leading task dimension and ``batches`` are (query, support)).
    """

    problem: bilevel.Problem
    init: Callable[[], tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]]
    batches: tuple[Any, Any]
    outer_lr: float
    inner_steps: int
    inner_lr: float
    cg_iters: int = 20
    gamma: float = 10.0
    task_loss: Callable[[dict, Any], torch.Tensor] | None = None


class State:
    """α, θ and the outer Adam optimizer of one (library, method) run."""

    def __init__(self, spec: Spec) -> None:
        self.alpha, self.theta = spec.init()
        self.opt = torch.optim.Adam(list(self.alpha.values()), lr=spec.outer_lr)

    def apply(self, grads: list[torch.Tensor], theta: list[torch.Tensor] | None) -> None:
        """α ← Adam step along ``grads``; θ ← ``theta`` (in place, when given)."""
        for a, g in zip(self.alpha.values(), grads):
            a.grad = g.detach()
        self.opt.step()
        if theta is not None:
            with torch.no_grad():
                for t, new in zip(self.theta.values(), theta):
                    t.copy_(new)


class Holder(nn.Module):
    """θ as module parameters (new leaves sharing storage), in the dict's key order."""

    def __init__(self, theta: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.names = list(theta)
        for k, v in theta.items():
            # a module's parameter names ("0.weight") may not contain "." as attributes
            self.register_parameter(k.replace(".", "__"), nn.Parameter(v.detach()))

    def as_dict(self, params: Any = None) -> dict[str, torch.Tensor]:
        """The current (possibly non-leaf, after a meta-optimizer step) parameters by name."""
        return dict(zip(self.names, params if params is not None else self.parameters()))


def _alpha_leaves(state: State) -> list[torch.Tensor]:
    return list(state.alpha.values())


def _gd_steps(spec: Spec, state: State) -> dict[str, torch.Tensor]:
    """θ^(T): T graph-free gradient steps on g from the current θ (AID's inner loop)."""
    alpha = {k: v.detach() for k, v in state.alpha.items()}
    theta = {k: v.detach() for k, v in state.theta.items()}
    lower_batch = spec.batches[1]
    for _ in range(spec.inner_steps):
        theta = {k: v.requires_grad_(True) for k, v in theta.items()}
        g = spec.problem.lower(alpha, theta, lower_batch)
        grads = torch.autograd.grad(g, list(theta.values()))
        theta = {k: (v - spec.inner_lr * d).detach() for (k, v), d in zip(theta.items(), grads)}
    return theta


def bilevel_hypergrad(spec: Spec, method: str) -> Hypergrad:
    """This project's solver for ``method``: its ``step`` gives dF/dα and θ^(T)."""
    T, lr = spec.inner_steps, spec.inner_lr
    solvers = {
        "ITD-SGD": lambda: bilevel.ITD(T, lr),
        "ITD-Adam": lambda: bilevel.ITD(T, lr, inner_optimizer=bilevel.Adam()),
        "AID-CG": lambda: bilevel.AID(T, lr, bilevel.linalg.CG(maxiter=spec.cg_iters)),
        "MAML": lambda: bilevel.MAML(T, lr),
        "V-PBGD": lambda: bilevel.VPBGD(T, lr, gamma=spec.gamma),
    }
    solver = solvers[method]()
    upper_batch, lower_batch = spec.batches

    def run(state: State) -> Grads:
        r = solver.step(
            spec.problem, state.alpha, state.theta, upper_batch=upper_batch, lower_batch=lower_batch
        )
        if method == "V-PBGD":  # a joint direction: θ takes its SGD step of size β/γ
            step = spec.inner_lr / spec.gamma
            theta = [state.theta[k].detach() - step * r.inner_grad[k] for k in state.theta]
        else:
            theta = [r.inner_solution[k] for k in state.theta]
        return [r.outer_grad[k] for k in state.alpha], theta

    return run


def _unrolled(
    spec: Spec, state: State, net: Holder, step: Callable[[torch.Tensor], Any], params: Callable
) -> Grads:
    """T differentiable steps ``step(g)`` on g, then dF/dα through them (ITD)."""
    upper_batch, lower_batch = spec.batches
    for _ in range(spec.inner_steps):
        step(spec.problem.lower(state.alpha, net.as_dict(params()), lower_batch))
    theta = net.as_dict(params())
    f = spec.problem.upper(state.alpha, theta, upper_batch)
    grads = torch.autograd.grad(f, _alpha_leaves(state))
    return list(grads), [t.detach() for t in theta.values()]


def _meta_tasks(spec: Spec, state: State, adapt: Callable) -> Grads:
    """MAML one task at a time, as both peers' MAML examples do: for task b, a module whose
    parameters are new leaves equal to α, ``adapt(net, support_b)`` returns θ_{b,T}; the
    meta-gradient is (1/B) Σ_b ∇_{θ_{b,0}} L_b(θ_{b,T}; query_b)."""
    assert spec.task_loss is not None
    query, support = spec.batches
    tasks = support["x"].shape[0]
    total = [torch.zeros_like(a) for a in state.alpha.values()]
    for b in range(tasks):
        net = Holder(state.alpha)
        start = list(net.parameters())
        theta = adapt(net, {k: v[b] for k, v in support.items()})
        f = spec.task_loss(theta, {k: v[b] for k, v in query.items()}) / tasks
        for acc, g in zip(total, torch.autograd.grad(f, start)):
            acc.add_(g)
    return total, None


def torchopt_hypergrad(spec: Spec, method: str) -> Hypergrad:
    """torchopt's MetaSGD / MetaAdam (ITD, MAML) or custom_root with CG (AID-CG)."""
    import torchopt

    if method == "AID-CG":
        return _torchopt_implicit(spec)
    T, lr = spec.inner_steps, spec.inner_lr

    def meta_opt(net: Holder) -> Any:
        if method == "ITD-Adam":
            # torch.optim.Adam's rule, as bilevel.Adam(): eps outside the root, eps_root = 0
            return torchopt.MetaAdam(net, lr=lr, betas=(0.9, 0.999), eps=1e-8, eps_root=0.0)
        return torchopt.MetaSGD(net, lr=lr)

    def adapt(net: Holder, support: Any) -> dict[str, torch.Tensor]:
        opt = meta_opt(net)
        for _ in range(T):
            opt.step(spec.task_loss(net.as_dict(), support))
        return net.as_dict()

    def run(state: State) -> Grads:
        if method == "MAML":
            return _meta_tasks(spec, state, adapt)
        net = Holder(state.theta)
        return _unrolled(spec, state, net, meta_opt(net).step, net.parameters)

    return run


def _torchopt_implicit(spec: Spec) -> Hypergrad:
    """θ^(T) by hand, then ``custom_root(∇_θ g, solve_cg(maxiter=K, rtol=1e-6))``: the same
    stopping rule as bilevel.linalg.CG's default (‖r‖ ≤ 1e-6 ‖b‖ or K matvecs)."""
    import torchopt

    upper_batch, lower_batch = spec.batches
    solve = torchopt.linear_solve.solve_cg(maxiter=spec.cg_iters, rtol=1e-6, atol=0.0)

    def run(state: State) -> Grads:
        names, a_names = list(state.theta), list(state.alpha)

        def lower(theta: tuple, alpha: tuple) -> torch.Tensor:
            return spec.problem.lower(dict(zip(a_names, alpha)), dict(zip(names, theta)), lower_batch)

        @torchopt.diff.implicit.custom_root(torch.func.grad(lower, argnums=0), argnums=1, solve=solve)
        def solution(theta: tuple, alpha: tuple) -> tuple:
            return theta  # θ^(T) is computed before: only the implicit backward is torchopt's

        theta_T = _gd_steps(spec, state)
        alpha = tuple(_alpha_leaves(state))
        theta = solution(tuple(theta_T.values()), alpha)
        f = spec.problem.upper(state.alpha, dict(zip(names, theta)), upper_batch)
        return list(torch.autograd.grad(f, alpha)), list(theta_T.values())

    return run


def higher_hypergrad(spec: Spec, method: str) -> Hypergrad:
    """higher's ``innerloop_ctx`` with a differentiable SGD or Adam (ITD, MAML)."""
    import higher

    T, lr = spec.inner_steps, spec.inner_lr

    def inner_opt(net: Holder) -> torch.optim.Optimizer:
        if method == "ITD-Adam":
            return torch.optim.Adam(net.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8)
        return torch.optim.SGD(net.parameters(), lr=lr)

    def adapt(net: Holder, support: Any) -> dict[str, torch.Tensor]:
        # copy_initial_weights=False: the meta-gradient flows into net's own leaves (= α)
        with higher.innerloop_ctx(net, inner_opt(net), copy_initial_weights=False) as (fnet, diff):
            for _ in range(T):
                diff.step(spec.task_loss(net.as_dict(fnet.parameters()), support))
            return net.as_dict(fnet.parameters())

    def run(state: State) -> Grads:
        if method == "MAML":
            return _meta_tasks(spec, state, adapt)
        net = Holder(state.theta)
        with higher.innerloop_ctx(net, inner_opt(net), copy_initial_weights=True) as (fnet, diff):
            return _unrolled(spec, state, net, diff.step, fnet.parameters)

    return run


def betty_hypergrad(spec: Spec, method: str) -> Hypergrad:
    """betty's ``cg`` (cg_iterations = K, cg_alpha = 1) at θ^(T) reached by hand (AID-CG)."""
    from .libs.betty_lib import Lower, unavailable

    why = unavailable()  # puts $BETTY_PATH on sys.path
    if why is not None:
        raise ImportError(why)
    from betty.hypergradient import get_grads

    config = SimpleNamespace(type="cg", cg_iterations=spec.cg_iters, cg_alpha=1.0)
    upper_batch, lower_batch = spec.batches

    def run(state: State) -> Grads:
        names, a_names = list(state.theta), list(state.alpha)
        theta_T = _gd_steps(spec, state)
        alpha = _alpha_leaves(state)
        adapter = SimpleNamespace(
            theta=list(theta_T.values()),
            lower_batch=lower_batch,
            lower=lambda a, th, batch: spec.problem.lower(
                dict(zip(a_names, a)), dict(zip(names, th)), batch
            ),
        )
        lower = Lower(adapter, alpha, config)
        upper = SimpleNamespace(trainable_parameters=lambda: alpha)
        f = spec.problem.upper(state.alpha, dict(zip(names, lower.params)), upper_batch)
        # the problems' f does not read α, so betty's implicit term is the whole dF/dα
        grads = get_grads(f, [upper, lower, upper], retain_graph=False)
        return list(grads), list(theta_T.values())

    return run


def _boat(spec: Spec, method: str) -> Hypergrad:
    from .libs.boat_lib import boat_hypergrad  # imports this module: loaded on first use

    return boat_hypergrad(spec, method)


# library -> (methods it has, builder); "bilevel" is the reference every ratio divides by.
LIBRARIES: dict[str, tuple[tuple[str, ...], Callable[[Spec, str], Hypergrad]]] = {
    "bilevel": (METHODS, bilevel_hypergrad),
    "torchopt": (("ITD-SGD", "ITD-Adam", "AID-CG", "MAML"), torchopt_hypergrad),
    "higher": (("ITD-SGD", "ITD-Adam", "MAML"), higher_hypergrad),
    "betty": (("AID-CG",), betty_hypergrad),
    "boat": (("ITD-SGD", "ITD-Adam", "AID-CG", "V-PBGD"), _boat),
}
