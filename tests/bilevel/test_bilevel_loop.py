"""bilevel.fit / bilevel.apply: the optimizers see exactly the solver's directions."""

import logging
import sys

import pytest
import torch

import bilevel

F64 = torch.float64


def toy():
    # Strongly convex lower level (Hessian diag(1, 1)), so that AID's linear system is regular.
    def upper(o, i, b):
        return 0.5 * (o["a"] - i["t"][1]) ** 2 + 0.5 * (i["t"][0] - 1) ** 2

    def lower(o, i, b):
        return 0.5 * (i["t"] ** 2).sum() - o["a"] * i["t"][0]

    outer = {"a": torch.tensor(3.0, dtype=F64, requires_grad=True)}
    inner = {"t": torch.tensor([-2.0, 0.5], dtype=F64, requires_grad=True)}
    return bilevel.Problem(upper=upper, lower=lower), outer, inner


@pytest.mark.parametrize(
    "solver", [bilevel.BOME(3, 0.5), bilevel.ITD(3, 0.5), bilevel.AID(3, 0.5)], ids=repr
)
def test_fit_with_sgd_equals_the_hand_written_update(solver):
    problem, outer, inner = toy()
    a, t = outer["a"].detach().clone(), inner["t"].detach().clone()
    xi = 0.1
    history = bilevel.fit(
        problem,
        solver,
        outer,
        inner,
        steps=5,
        progress=False,
        outer_optimizer=torch.optim.SGD([outer["a"]], lr=xi),
        inner_optimizer=torch.optim.SGD([inner["t"]], lr=xi),
    )
    for _ in range(5):  # u ← u − ξ · direction
        r = solver.step(problem, {"a": a}, {"t": t}, upper_batch=None, lower_batch=None)
        a, t = a - xi * r.outer_grad["a"], t - xi * r.inner_grad["t"]
    assert torch.allclose(outer["a"].detach(), a, rtol=1e-12)
    assert torch.allclose(inner["t"].detach(), t, rtol=1e-12)
    assert len(history) == 5 and history.column("step") == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert history.last["upper_loss"] == history.records[-1]["upper_loss"]


def test_inner_update_solution_copies_the_inner_solution():
    problem, outer, inner = toy()
    r = bilevel.ITD(4, 0.5).step(problem, outer, inner, upper_batch=None, lower_batch=None)
    bilevel.apply(r, outer, inner, outer_optimizer=None, inner_update="solution")
    assert torch.equal(inner["t"].detach(), r.inner_solution["t"])
    assert outer["a"].item() == 3.0  # no outer optimizer: unchanged
    with pytest.raises(ValueError, match="pass inner_optimizer=None"):
        bilevel.apply(
            r,
            outer,
            inner,
            outer_optimizer=None,
            inner_optimizer=torch.optim.SGD([inner["t"]], lr=0.1),
            inner_update="solution",
        )


def test_batches_callback_and_early_stop():
    problem, outer, inner = toy()
    seen = []

    def batches(k):
        return ("upper", k), ("lower", k)

    def upper(o, i, b):
        seen.append(b)
        return problem.upper(o, i, b)

    prob = bilevel.Problem(upper=upper, lower=problem.lower)
    history = bilevel.fit(
        prob,
        bilevel.BOME(2, 0.5),
        outer,
        inner,
        steps=10,
        batches=batches,
        progress=False,
        outer_optimizer=torch.optim.SGD([outer["a"]], lr=0.1),
        inner_optimizer=torch.optim.SGD([inner["t"]], lr=0.1),
        callback=lambda k, r: k == 2,
    )
    # two f calls per BOME step (the direction's, and upper_loss at θ^(T)), each on its batch
    assert len(history) == 3 and seen == [("upper", k) for k in (0, 0, 1, 1, 2, 2)]
    # An iterable of pairs stops the loop when it runs out.
    history = bilevel.fit(
        problem,
        bilevel.BOME(2, 0.5),
        outer,
        inner,
        steps=10,
        progress=False,
        batches=[(None, None)] * 4,
        outer_optimizer=torch.optim.SGD([outer["a"]], lr=0.1),
    )
    assert len(history) == 4


def test_progress_falls_back_to_logging_without_tqdm(monkeypatch, caplog):
    problem, outer, inner = toy()
    monkeypatch.setitem(sys.modules, "tqdm", None)  # makes `import tqdm...` raise ImportError
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)
    with caplog.at_level(logging.INFO, logger="bilevel"):
        bilevel.fit(
            problem,
            bilevel.BOME(2, 0.5),
            outer,
            inner,
            steps=4,
            log_every=2,
            outer_optimizer=torch.optim.SGD([outer["a"]], lr=0.1),
            desc="toy",
        )
    lines = [r.getMessage() for r in caplog.records if r.name == "bilevel"]
    assert len(lines) == 2 and lines[0].startswith("toy step 2/4 upper_loss=")


def test_apply_rejects_non_leaf_parameters():
    problem, outer, inner = toy()
    r = bilevel.BOME(2, 0.5).step(problem, outer, inner, upper_batch=None, lower_batch=None)
    with pytest.raises(ValueError, match="outer leaf 0 is not a leaf tensor"):
        bilevel.apply(
            r, {"a": outer["a"] * 2}, inner, outer_optimizer=torch.optim.SGD([outer["a"]], lr=0.1)
        )
    with pytest.raises(ValueError, match="steps must be an int >= 0"):
        bilevel.fit(problem, bilevel.BOME(2, 0.5), outer, inner, steps=-1, outer_optimizer=None)
