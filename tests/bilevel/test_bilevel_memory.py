"""No autograd graph survives a solver step, and memory does not grow across outer steps
(torchopt #218, higher #6/#37/#138: unrolled optimizers that leak graphs across steps)."""

import dataclasses
import gc
import weakref

import pytest
import torch
from torch.func import functional_call
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import bilevel
from bilevel import linalg


class _TrackOutputs(TorchDispatchMode):
    """Keeps a weak reference to every tensor any operation creates, backward ops included.

    (Tensors saved for backward stay alive exactly as long as their graph, so a leaked
    graph shows up as surviving tensors. Saved-tensor hooks would not do here: a hook
    that holds an op's own output forms a reference cycle through C++ and leaks itself.)
    """

    def __init__(self) -> None:
        super().__init__()
        self.refs: list[weakref.ref] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.refs.extend(weakref.ref(t) for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        return out


def _problem():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    x, y = torch.randn(32, 4), torch.randint(0, 3, (32,))

    def lower(o, i, batch):
        logits = functional_call(model, i, (x,)) / o["log_t"].exp()
        return torch.nn.functional.cross_entropy(logits, y) + 1e-3 * sum(
            (p**2).sum() for p in i.values()
        )

    def upper(o, i, batch):
        p = torch.softmax(functional_call(model, i, (x,)) / o["log_t"].exp(), -1)
        return (p * p.log()).sum(-1).mean()

    inner = {k: v.detach().clone().requires_grad_() for k, v in model.named_parameters()}
    outer = {"log_t": torch.zeros(3, requires_grad=True)}
    return bilevel.Problem(upper=upper, lower=lower), outer, inner


SOLVERS = [
    bilevel.ITD(10, 0.1),
    bilevel.ITD(10, 0.1, truncate=3),
    bilevel.AID(5, 0.1, linear_solver=linalg.Neumann(steps=5, lr=0.1)),
    bilevel.BOME(5, 0.1),
    bilevel.ITD(5, 0.1, truncate=3, inner_optimizer=bilevel.Adam(eps_root=1e-12)),
    bilevel.FD(3, 0.1),
    bilevel.VPBGD(5, 0.1),
    bilevel.F2SA(3, 0.1),
    bilevel.SOBA(0.1),
]


@pytest.mark.parametrize("solver", SOLVERS, ids=lambda s: type(s).__name__)
def test_no_saved_tensor_outlives_a_step(solver):
    problem, outer, inner = _problem()
    tracker = _TrackOutputs()
    with tracker:
        result = solver.step(problem, outer, inner, upper_batch=None, lower_batch=None)
    gc.collect()
    parts = (result.outer_grad, result.inner_grad, result.inner_solution)
    returned = bilevel.tree.leaves(tuple(x for x in parts if x is not None))
    # F2SA's y and SOBA's v are kept by the instance on purpose (their warm starts)
    kept = [getattr(solver, f.name).v for f in dataclasses.fields(solver)
            if not f.init and getattr(getattr(solver, f.name), "v", None) is not None]
    survivors = [r() for r in tracker.refs if r() is not None]
    assert len(tracker.refs) > 100  # the tracker did see the step's work
    # Only the returned tensors (and the warm starts) outlive the step: every graph built
    # inside has been freed.
    assert {id(t) for t in survivors} == {id(t) for t in returned + bilevel.tree.leaves(kept)}
    for t in returned:
        assert not t.requires_grad and t.grad_fn is None


@pytest.mark.slow
@pytest.mark.parametrize("inner_update", ["optimizer", "solution"])
def test_itd_memory_does_not_grow_across_outer_steps(inner_update):
    problem, outer, inner = _problem()
    opt_o = torch.optim.Adam(list(outer.values()), lr=1e-2)
    opt_i = torch.optim.SGD(list(inner.values()), lr=1e-2) if inner_update == "optimizer" else None
    solver = bilevel.ITD(10, 0.1)
    counts = []
    tracker = _TrackOutputs()

    def record(step, result):
        gc.collect()
        # Distinct objects: in-place optimizer ops return the (long-lived) parameters again.
        # Drop dead references as we go: the scan stays linear in what is alive, not in
        # everything every earlier step ever created.
        tracker.refs = [r for r in tracker.refs if r() is not None]
        counts.append(len({id(r()) for r in tracker.refs}))

    with tracker:
        bilevel.fit(
            problem,
            solver,
            outer,
            inner,
            steps=12,
            outer_optimizer=opt_o,
            inner_optimizer=opt_i,
            inner_update=inner_update,
            callback=record,
            progress=False,
        )
    # After the optimizers have created their state (step 1), nothing accumulates.
    assert counts[2:] == [counts[2]] * len(counts[2:]), counts


@pytest.mark.parametrize("fill", [False, True], ids=["zero memory", "filled memory"])
def test_saba_keeps_only_v_and_its_saga_tables(fill):
    problem, outer, inner = _problem()
    solver = bilevel.SABA(0.1, n_upper=2, n_lower=3)
    if fill:
        solver.fill_memory(problem, outer, inner, upper_batches=[None] * 2, lower_batches=[None] * 3)
    tracker = _TrackOutputs()
    with tracker:
        result = solver.step(problem, outer, inner, upper_batch=bilevel.Indexed(1, None),
                             lower_batch=bilevel.Indexed(2, None))
    gc.collect()
    returned = bilevel.tree.leaves((result.outer_grad, result.inner_grad))
    memory = solver._memory
    kept = solver._v.v + memory.lower.rows + memory.lower.mean + memory.upper.rows + memory.upper.mean
    survivors = [r() for r in tracker.refs if r() is not None]
    assert len(tracker.refs) > 100
    # the step's graphs are freed; what stays is the result, the new v and (when the step
    # allocated them) the SAGA tables, updated in place otherwise
    assert {id(t) for t in survivors} <= {id(t) for t in returned + kept}
    assert {id(t) for t in returned} <= {id(t) for t in survivors}
    for t in returned + kept:
        assert not t.requires_grad and t.grad_fn is None
