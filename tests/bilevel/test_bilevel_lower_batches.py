"""``lower_batches=``: a fresh lower batch per inner step, in every solver that takes inner
steps. Oracle: the same solver whose every drawn batch is the step's ``lower_batch`` is the
solver without ``lower_batches`` (bit for bit, same computation), and with different batches
the returned θ_T is the hand-written SGD loop over the drawn batches (float64)."""

import pytest
import torch

import bilevel

F64 = torch.float64
GEN = torch.Generator().manual_seed(0)
BATCHES = [torch.randn(4, generator=GEN, dtype=F64) for _ in range(8)]
UPPER = torch.randn(4, generator=GEN, dtype=F64)


def _upper(outer, inner, batch):
    return ((inner["w"] - batch) ** 2).sum() + 0.1 * (outer["a"] ** 2).sum()


def _lower(outer, inner, batch):
    return 0.5 * ((inner["w"] - batch) ** 2).sum() + 0.5 * torch.exp(outer["a"]).sum() * (inner["w"] ** 2).sum()


PROBLEM = bilevel.Problem(upper=_upper, lower=_lower)
META = bilevel.meta_problem(lambda p, b: ((p["w"] - b) ** 2).sum(), prox=1.0)

SOLVERS = {
    "ITD": lambda lb: bilevel.ITD(3, 0.1, lower_batches=lb),
    "FD": lambda lb: bilevel.FD(3, 0.1, lower_batches=lb),
    "BOME": lambda lb: bilevel.BOME(3, 0.1, lower_batches=lb),
    "VPBGD": lambda lb: bilevel.VPBGD(3, 0.1, lower_batches=lb),
    "F2SA": lambda lb: bilevel.F2SA(3, 0.1, lower_batches=lb),
}
META_SOLVERS = {
    "MAML": lambda lb: bilevel.MAML(3, 0.1, lower_batches=lb),
    "FOMAML": lambda lb: bilevel.FOMAML(3, 0.1, lower_batches=lb),
    "Reptile": lambda lb: bilevel.Reptile(3, 0.1, lower_batches=lb),
    "IMAML": lambda lb: bilevel.IMAML(3, 0.1, lower_batches=lb),
}
DRAWS = {"F2SA": 6}


def _point(meta=False):
    if meta:  # θ_0 = α for the meta solvers: one task, θ shaped like α
        return {"w": torch.full((4,), 0.3, dtype=F64)}, {"w": torch.full((4,), 0.3, dtype=F64)}
    return {"a": torch.tensor([0.3], dtype=F64)}, {"w": torch.zeros(4, dtype=F64)}


def _sgd(outer, inner, batches, problem, lr=0.1):
    """The hand-written loop: θ ← θ − lr ∇_θ g(α, θ; B_t) over the given batches."""
    w = inner["w"].clone()
    for b in batches:
        w = w.detach().requires_grad_(True)
        (gw,) = torch.autograd.grad(problem.lower(outer, {"w": w}, b), w)
        w = w - lr * gw
    return w.detach()


@pytest.mark.parametrize("name", list(SOLVERS) + list(META_SOLVERS))
def test_the_same_batch_drawn_every_step_is_the_solver_without_lower_batches(name):
    make = SOLVERS.get(name) or META_SOLVERS[name]
    problem = PROBLEM if name in SOLVERS else META
    outer, inner = _point(meta=name not in SOLVERS)
    plain = make(None).step(problem, outer, inner, upper_batch=UPPER, lower_batch=BATCHES[0])
    fresh = make(lambda: BATCHES[0]).step(problem, outer, inner, upper_batch=UPPER,
                                          lower_batch=BATCHES[0])
    for x, y in ((plain.outer_grad, fresh.outer_grad), (plain.inner_grad, fresh.inner_grad)):
        for k in x:
            assert torch.allclose(x[k], y[k], rtol=1e-12, atol=1e-14), (name, k)


@pytest.mark.parametrize("name", ["ITD", "FD", "BOME", "VPBGD", "F2SA", "FOMAML", "Reptile", "IMAML", "MAML"])
def test_the_inner_solution_is_the_hand_written_loop_over_the_drawn_batches(name):
    make = SOLVERS.get(name) or META_SOLVERS[name]
    problem = PROBLEM if name in SOLVERS else META
    outer, inner = _point(meta=name not in SOLVERS)
    source = iter(BATCHES[1:])
    r = make(lambda: next(source)).step(problem, outer, inner, upper_batch=UPPER,
                                         lower_batch=BATCHES[0])
    assert len(list(source)) == len(BATCHES) - 1 - DRAWS.get(name, 3)  # one draw per step
    expected = _sgd(outer, inner, BATCHES[1:4], problem)
    assert torch.allclose(r.inner_solution["w"], expected, rtol=1e-12, atol=1e-14)
    # ... and the batches do differ: the step's own lower_batch gives another θ_T
    assert not torch.allclose(expected, _sgd(outer, inner, BATCHES[:1] * 3, problem))


def test_itd_outer_grad_is_the_hand_written_unroll_over_the_drawn_batches():
    outer, inner = _point()
    a = outer["a"].clone().requires_grad_(True)
    w = inner["w"].clone().requires_grad_(True)
    for b in BATCHES[1:4]:
        (gw,) = torch.autograd.grad(_lower({"a": a}, {"w": w}, b), w, create_graph=True)
        w = w - 0.1 * gw
    (expected,) = torch.autograd.grad(_upper({"a": a}, {"w": w}, UPPER), a)
    source = iter(BATCHES[1:4])
    r = bilevel.ITD(3, 0.1, lower_batches=lambda: next(source)).step(
        PROBLEM, outer, inner, upper_batch=UPPER, lower_batch=BATCHES[0])
    assert torch.allclose(r.outer_grad["a"], expected, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("name", list(SOLVERS) + list(META_SOLVERS))
def test_an_exhausted_source_is_a_clear_error(name):
    make = SOLVERS.get(name) or META_SOLVERS[name]
    problem = PROBLEM if name in SOLVERS else META
    outer, inner = _point(meta=name not in SOLVERS)
    source = iter(BATCHES[:1])
    with pytest.raises(RuntimeError, match=rf"{name}.step: lower_batches ran out of batches .* itertools.cycle"):
        make(lambda: next(source)).step(problem, outer, inner, upper_batch=UPPER, lower_batch=BATCHES[0])


@pytest.mark.parametrize("name", list(SOLVERS) + list(META_SOLVERS))
def test_a_non_callable_source_is_refused(name):
    make = SOLVERS.get(name) or META_SOLVERS[name]
    with pytest.raises(TypeError, match=rf"{name}: lower_batches must be a callable"):
        make([1, 2])
