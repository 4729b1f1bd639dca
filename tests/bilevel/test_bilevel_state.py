"""Solver state: state_dict / load_state_dict / reset on every solver (tensors only, so
torch.load(weights_only=True) reads it), the deprecated reset names, and fit's checkpoint:
2N steps in one call equal N steps, a restart from fresh objects, and N more, bit for bit."""

import warnings

import pytest
import torch

import bilevel

F64 = torch.float64
gen = torch.Generator().manual_seed(0)
X, Y = torch.randn(30, 3, generator=gen, dtype=F64), torch.randn(30, generator=gen, dtype=F64)
XV, YV = torch.randn(12, 3, generator=gen, dtype=F64), torch.randn(12, generator=gen, dtype=F64)
PROBLEM = bilevel.Problem(
    upper=lambda o, i, b: 0.5 * ((b[0] @ i["w"] - b[1]) ** 2).mean(),
    lower=lambda o, i, b: 0.5 * ((b[0] @ i["w"] - b[1]) ** 2).mean()
    + 0.5 * o["a"].exp() * (i["w"] ** 2).sum(),
)

STATEFUL = {
    "AID warm start": lambda: bilevel.AID(3, 0.3, warm_start=True),
    "F2SA": lambda: bilevel.F2SA(3, 0.3, lam=2.0, lam_growth=0.5),
    "VPBGD": lambda: bilevel.VPBGD(3, 0.3, gamma=2.0, gamma_growth=0.5),
    "SOBA": lambda: bilevel.SOBA(0.2),
}


def variables():
    alpha = {"a": torch.tensor(0.0, dtype=F64, requires_grad=True)}
    w = {"w": torch.zeros(3, dtype=F64, requires_grad=True)}
    return alpha, w, torch.optim.Adam(alpha.values(), lr=0.05), torch.optim.SGD(w.values(), lr=0.2)


def run(solver, steps, path=None):
    alpha, w, oa, ow = variables()
    h = bilevel.fit(PROBLEM, solver, alpha, w, steps=steps, progress=False, outer_optimizer=oa,
                    inner_optimizer=ow, upper_batch=(XV, YV), lower_batch=(X, Y),
                    checkpoint=path, checkpoint_every=2)
    return alpha, w, h


@pytest.mark.parametrize("name", list(STATEFUL))
def test_an_interrupted_fit_resumes_bit_for_bit(name, tmp_path):
    whole_a, whole_w, whole_h = run(STATEFUL[name](), 8)
    path = tmp_path / "fit.pt"
    run(STATEFUL[name](), 4, path)            # the first half, then "the process dies"
    a, w, h = run(STATEFUL[name](), 8, path)  # fresh tensors, optimizers and solver
    assert torch.equal(a["a"], whole_a["a"]) and torch.equal(w["w"], whole_w["w"])
    assert h.records == whole_h.records
    saved = torch.load(path, weights_only=True)  # nothing pickled
    assert saved["step"] == 8


@pytest.mark.parametrize("name", list(STATEFUL))
def test_state_dict_round_trips_and_reset_forgets(name, tmp_path):
    solver = STATEFUL[name]()
    run(solver, 3)
    state = solver.state_dict()
    torch.save(state, tmp_path / "s.pt")
    again = STATEFUL[name]()
    again.load_state_dict(torch.load(tmp_path / "s.pt", weights_only=True))
    alpha, w, _, _ = variables()
    args = dict(upper_batch=(XV, YV), lower_batch=(X, Y))
    r1, r2 = solver.step(PROBLEM, alpha, w, **args), again.step(PROBLEM, alpha, w, **args)
    assert torch.equal(r1.outer_grad["a"], r2.outer_grad["a"])
    solver.reset()
    fresh = STATEFUL[name]()
    assert str(solver.state_dict()) == str(fresh.state_dict())
    assert solver == fresh  # equality compares options only (documented)


def test_stateless_solvers_have_the_empty_state_and_a_wrong_state_is_refused():
    for solver in (bilevel.ITD(2, 0.1), bilevel.BOME(2, 0.1), bilevel.MAML(2, 0.1), bilevel.FD(1, 0.1)):
        assert solver.state_dict() == {}
        solver.load_state_dict({})
        solver.reset()
    with pytest.raises(ValueError, match="expected the keys"):
        bilevel.SOBA(0.1).load_state_dict({"k": {"k": 1}})


def test_the_old_reset_names_still_work_with_a_deprecation_warning():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        bilevel.AID(2, 0.1, warm_start=True).reset_warm_start()
        bilevel.VPBGD(2, 0.1).reset_schedule()
    assert [w.category for w in caught] == [DeprecationWarning, DeprecationWarning]


def _indexed(k):
    """SABA's batches: upper term k mod 2 and lower term k mod 3, each with its index."""
    u, lo = k % 2, k % 3
    return (bilevel.Indexed(u, (XV[6 * u:6 * u + 6], YV[6 * u:6 * u + 6])),
            bilevel.Indexed(lo, (X[10 * lo:10 * lo + 10], Y[10 * lo:10 * lo + 10])))


def test_saba_memories_resume_bit_for_bit(tmp_path):
    def go(steps, path=None):
        alpha, w, oa, ow = variables()
        bilevel.fit(PROBLEM, bilevel.SABA(0.2, n_upper=2, n_lower=3), alpha, w, steps=steps,
                    batches=_indexed, progress=False, outer_optimizer=oa, inner_optimizer=ow,
                    checkpoint=path, checkpoint_every=3)
        return alpha, w
    whole = go(7)
    go(4, tmp_path / "saba.pt")
    resumed = go(7, tmp_path / "saba.pt")
    assert torch.equal(resumed[0]["a"], whole[0]["a"]) and torch.equal(resumed[1]["w"], whole[1]["w"])


def test_a_checkpoint_of_another_problem_is_refused(tmp_path):
    path = tmp_path / "fit.pt"
    run(bilevel.ITD(2, 0.1), 2, path)
    alpha, w, oa, ow = variables()
    w = {"w": torch.zeros(4, dtype=F64, requires_grad=True)}
    with pytest.raises(ValueError, match="belongs to another problem"):
        bilevel.fit(PROBLEM, bilevel.ITD(2, 0.1), alpha, w, steps=3, progress=False,
                    outer_optimizer=oa, upper_batch=(XV, YV), lower_batch=(X, Y), checkpoint=path)
