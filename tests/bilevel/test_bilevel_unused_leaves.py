"""No silent zeros: a leaf that no objective uses is named with bilevel.UnusedLeafWarning by
every solver (once per solver kind and problem), by hypergrad, and ITD/AID on
meta_problem(prox=0) say why their meta-gradient is all zero."""

import warnings

import pytest
import torch

import bilevel
from bilevel._autodiff import reached


def f(o, i, b):
    return ((i["a"] - 1.0) ** 2).sum() + 0.1 * (o["a"] ** 2).sum()


def g(o, i, b):
    return ((i["a"] - o["a"]) ** 2).sum()


FACTORIES = {
    "AID": lambda: bilevel.AID(2, 0.1),
    "BOME": lambda: bilevel.BOME(2, 0.1),
    "F2SA": lambda: bilevel.F2SA(2, 0.1),
    "FD": lambda: bilevel.FD(2, 0.1),
    "FOMAML": lambda: bilevel.FOMAML(2, 0.1),
    "IMAML": lambda: bilevel.IMAML(2, 0.1),
    "ITD": lambda: bilevel.ITD(2, 0.1),
    "MAML": lambda: bilevel.MAML(2, 0.1),
    "Reptile": lambda: bilevel.Reptile(2, 0.1),
    "SABA": lambda: bilevel.SABA(0.1, n_upper=1, n_lower=1),
    "SOBA": lambda: bilevel.SOBA(0.1),
    "VPBGD": lambda: bilevel.VPBGD(2, 0.1),
}


def solver_classes():
    return sorted(n for n in bilevel.__all__ if n != "Solver" and isinstance(getattr(bilevel, n), type)
                  and getattr(bilevel, n).__module__.startswith("bilevel.solvers")
                  and callable(getattr(getattr(bilevel, n), "step", None)))


def test_the_factories_cover_every_solver_class_in_the_public_api():
    assert sorted(FACTORIES) == solver_classes()


def step(solver, problem, outer, inner):
    b = bilevel.Indexed(0, None) if isinstance(solver, bilevel.SABA) else None
    return solver.step(problem, outer, inner, upper_batch=b, lower_batch=b)


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_every_solver_names_the_unused_outer_and_inner_leaf_once(name):
    problem = bilevel.Problem(upper=f, lower=g)
    solver = FACTORIES[name]()
    outer = {"a": torch.zeros(2), "u": torch.zeros(3)}
    inner = {"a": torch.ones(2), "u": torch.ones(3)}
    with pytest.warns(bilevel.UnusedLeafWarning) as record:
        r = step(solver, problem, outer, inner)
    messages = [str(w.message) for w in record if w.category is bilevel.UnusedLeafWarning]
    assert len(messages) == 2, messages
    assert f"{name}.step: outer['u']" in messages[0] and "structural zero" in messages[0]
    assert "inner['u'] is not used by the lower objective" in messages[1]
    assert "'a'" not in messages[0].split("structural")[0].replace("outer['u']", "")
    assert all(w.filename == __file__ for w in record)  # the caller's line, not bilevel's
    assert torch.equal(r.outer_grad["u"], torch.zeros(3))
    with warnings.catch_warnings():  # once per solver kind and problem, not every step
        warnings.simplefilter("error", bilevel.UnusedLeafWarning)
        step(solver, problem, outer, inner)
        step(FACTORIES[name](), problem, outer, inner)


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_no_warning_when_every_leaf_is_used(name):
    problem = bilevel.Problem(upper=f, lower=g)
    with warnings.catch_warnings():
        warnings.simplefilter("error", bilevel.UnusedLeafWarning)
        step(FACTORIES[name](), problem, {"a": torch.zeros(2)}, {"a": torch.ones(2)})


def task_loss(params, batch):
    return ((params["w"] - batch) ** 2).sum(-1)  # (B,) per-task losses


@pytest.mark.parametrize("name", ["ITD", "AID", "BOME", "F2SA"])
def test_meta_problem_with_prox_zero_on_a_solver_not_starting_from_alpha_says_why(name):
    problem = bilevel.meta_problem(task_loss, prox=0.0)
    outer = {"w": torch.zeros(2)}
    inner = bilevel.task_copies(outer, 3)
    batch = torch.randn(3, 2, generator=torch.Generator().manual_seed(0))
    with pytest.warns(bilevel.UnusedLeafWarning, match=r"prox=0\).*all-zero meta-gradient"):
        r = FACTORIES[name]().step(problem, outer, inner, upper_batch=batch, lower_batch=batch)
    assert torch.equal(r.outer_grad["w"], torch.zeros(2))  # the silent zero, now named
    with warnings.catch_warnings():  # with prox > 0 α enters g: no warning, a real gradient
        warnings.simplefilter("error", bilevel.UnusedLeafWarning)
        r = FACTORIES[name]().step(bilevel.meta_problem(task_loss, prox=1.0), outer, inner,
                                   upper_batch=batch, lower_batch=batch)
    assert r.outer_grad["w"].abs().max() > 0


@pytest.mark.parametrize("name", ["MAML", "FOMAML", "Reptile"])
def test_meta_solvers_on_prox_zero_are_silent_alpha_enters_through_theta_0(name):
    problem = bilevel.meta_problem(task_loss, prox=0.0)
    outer = {"w": torch.zeros(2)}
    batch = torch.randn(3, 2, generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("error", bilevel.UnusedLeafWarning)
        r = FACTORIES[name]().step(problem, outer, bilevel.task_copies(outer, 3),
                                   upper_batch=batch, lower_batch=batch)
    assert r.outer_grad["w"].abs().max() > 0


@pytest.mark.parametrize("method", [bilevel.Unrolled(2, 0.1), bilevel.Implicit(),
                                    bilevel.FiniteDifference(0.1)], ids=repr)
def test_hypergrad_names_the_unused_outer_leaf_once_per_problem(method):
    problem = bilevel.Problem(upper=f, lower=g)
    outer, inner = {"a": torch.zeros(2), "u": torch.zeros(3)}, {"a": torch.ones(2)}
    kw = {"upper_batch": None, "lower_batch": None, "method": method}
    with pytest.warns(bilevel.UnusedLeafWarning, match=r"outer\['u'\] is used by neither"):
        grads = bilevel.hypergrad(problem, outer, inner, **kw)
    assert torch.equal(grads["u"], torch.zeros(3))
    with warnings.catch_warnings():
        warnings.simplefilter("error", bilevel.UnusedLeafWarning)
        bilevel.hypergrad(problem, outer, inner, **kw)


def test_reached_walks_the_graph_to_leaves_and_to_single_outputs_of_multi_output_nodes():
    a, b, c = (torch.randn(3, requires_grad=True) for _ in range(3))
    x, y = torch._foreach_mul([a, b], 2.0)  # one autograd node with two outputs
    assert x.grad_fn is y.grad_fn
    value = (x.exp() * 3).sum()
    # x's output edge is reached, y's is not; behind the shared node both inputs count as
    # reached (conservative: a missed warning is possible, a false one is not)
    assert reached(value, [a, b, c, x, y]) == [True, True, False, True, False]
    assert reached((a * 2).sum(), [a, c]) == [True, False]
    assert reached(torch.tensor(1.0), [a]) == [False]  # no graph: nothing reached
