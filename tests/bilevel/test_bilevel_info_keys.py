"""docs/bilevel.md's table "Diagnostics: what `info` holds" lists exactly the keys each
solver (and hypergrad method) reports, and the keys mean what the table says at the points
it names (checked on a quadratic where every point is known in closed form)."""

import re
from pathlib import Path

import pytest
import torch

import bilevel

ROOT = Path(__file__).resolve().parents[2]
F64 = torch.float64
A = torch.tensor([[2.0, 0.5], [0.5, 1.0]], dtype=F64)


def f(o, i, b):
    return 0.5 * ((i["t"] - 1.0) ** 2).sum() + 0.1 * (o["a"] ** 2).sum()


def g(o, i, b):  # strongly convex in t: ∇_t g = A t − a
    return 0.5 * i["t"] @ A @ i["t"] - o["a"] @ i["t"]


PROBLEM = bilevel.Problem(upper=f, lower=g)
SOLVERS = {
    "AID": lambda: bilevel.AID(3, 0.3),
    "BOME": lambda: bilevel.BOME(3, 0.3),
    "F2SA": lambda: bilevel.F2SA(3, 0.3),
    "FD": lambda: bilevel.FD(3, 0.3),
    "FOMAML": lambda: bilevel.FOMAML(3, 0.3),
    "IMAML": lambda: bilevel.IMAML(3, 0.3),
    "ITD": lambda: bilevel.ITD(3, 0.3),
    "MAML": lambda: bilevel.MAML(3, 0.3),
    "Reptile": lambda: bilevel.Reptile(3, 0.3),
    "SABA": lambda: bilevel.SABA(0.1, n_upper=1, n_lower=1),
    "SOBA": lambda: bilevel.SOBA(0.1),
    "VPBGD": lambda: bilevel.VPBGD(3, 0.3),
}
METHODS = {"Unrolled": bilevel.Unrolled(3, 0.3), "Implicit": bilevel.Implicit(),
           "FiniteDifference": bilevel.FiniteDifference(0.3)}


def point():
    # meta solvers need inner shaped like outer: both (2,), under the key each problem reads
    return {"a": torch.tensor([0.3, -0.2], dtype=F64)}, {"t": torch.tensor([0.5, 0.1], dtype=F64)}


def meta_point():
    return {"t": torch.tensor([0.3, -0.2], dtype=F64)}, {"t": torch.tensor([0.5, 0.1], dtype=F64)}


def meta_g(o, i, b):  # a proximal inner problem in the meta solvers' shape (θ_0 = α)
    return 0.5 * i["t"] @ A @ i["t"] + 0.5 * ((i["t"] - o["t"]) ** 2).sum()


META = bilevel.Problem(upper=lambda o, i, b: 0.5 * ((i["t"] - 1.0) ** 2).sum(), lower=meta_g)


def run(name):
    solver = SOLVERS[name]()
    b = bilevel.Indexed(0, None) if name == "SABA" else None
    if name in ("MAML", "FOMAML", "Reptile", "IMAML"):
        return solver.step(META, *meta_point(), upper_batch=b, lower_batch=b)
    return solver.step(PROBLEM, *point(), upper_batch=b, lower_batch=b)


def table():
    """{key: set of reporters} parsed from the markdown table."""
    text = (ROOT / "docs" / "bilevel.md").read_text()
    section = text.split("## Diagnostics: what `info` holds", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    names = set(SOLVERS) | set(METHODS)
    out = {}
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split(" | ")]
        assert len(cells) == 4, row
        reporters = {w for w in re.findall(r"[A-Za-z0-9]+", cells[2]) if w in names}
        if "every solver" in cells[2]:
            reporters |= set(SOLVERS)
        for key in re.findall(r"`([^`]+)`", cells[0]):
            assert key not in out, f"{key} has two rows"
            out[key] = reporters
    return out


def documented(name):
    return {k for k, who in table().items() if name in who}


def emitted(info):
    return {"solver_<key>" if k.startswith("solver_") else k for k in info}


@pytest.mark.parametrize("name", sorted(SOLVERS))
def test_each_solver_reports_exactly_its_rows_of_the_table(name):
    info = run(name).info
    assert emitted(info) == documented(name)
    assert all(isinstance(v, float) for v in info.values())


@pytest.mark.parametrize("name", sorted(METHODS))
def test_each_hypergrad_method_reports_exactly_its_rows(name):
    _, info = bilevel.hypergrad(PROBLEM, *point(), upper_batch=None, lower_batch=None,
                                method=METHODS[name], return_info=True)
    assert emitted(info) == documented(name)


def test_the_solver_list_is_every_solver_class_of_the_public_api():
    public = {n for n in bilevel.__all__ if n != "Solver" and isinstance(getattr(bilevel, n), type)
              and getattr(bilevel, n).__module__.startswith("bilevel.solvers")
              and callable(getattr(getattr(bilevel, n), "step", None))}
    assert public == set(SOLVERS)


@pytest.mark.parametrize("name", ["AID", "BOME", "F2SA", "FD", "ITD", "VPBGD"])
def test_losses_are_measured_at_the_documented_points(name):
    """upper_loss = f(α, θ̂), lower_loss = g(α, θ), lower_loss_solution = g(α, θ̂) and
    lower_grad_norm = ‖∇_θ g(α, θ̂)‖ = ‖A θ̂ − a‖, θ̂ the returned inner solution."""
    r = run(name)
    outer, inner = point()
    hat = r.inner_solution
    assert not torch.equal(hat["t"], inner["t"])  # θ̂ ≠ θ: the points are distinguishable
    assert r.info["upper_loss"] == pytest.approx(float(f(outer, hat, None)), rel=1e-12)
    assert r.info["lower_loss"] == pytest.approx(float(g(outer, inner, None)), rel=1e-12)
    assert r.info["lower_loss_solution"] == pytest.approx(float(g(outer, hat, None)), rel=1e-12)
    if "lower_grad_norm" in r.info:
        residual = torch.linalg.vector_norm(A @ hat["t"] - outer["a"])
        assert r.info["lower_grad_norm"] == pytest.approx(float(residual), rel=1e-12)
    if name in ("BOME", "VPBGD"):
        assert r.info["upper_loss_current"] == pytest.approx(float(f(outer, inner, None)), rel=1e-12)


def test_soba_has_no_solution_so_its_point_is_the_current_theta():
    r = run("SOBA")
    outer, inner = point()
    assert r.inner_solution is None
    assert r.info["upper_loss"] == pytest.approx(float(f(outer, inner, None)), rel=1e-12)
    assert r.info["lower_grad_norm"] == pytest.approx(r.info["inner_grad_norm"], rel=1e-12)


def test_with_lower_batches_the_stationarity_is_on_the_last_batch_drawn():
    """ITD's lower_batch is unused with lower_batches=; lower_grad_norm is then measured on the
    last batch drawn (the batch scales the linear term: ∇_t g = A t − b·a)."""
    draws = iter([1.0, 2.0, 3.0])

    def g_b(o, i, b):
        return 0.5 * i["t"] @ A @ i["t"] - b * (o["a"] @ i["t"])

    problem = bilevel.Problem(upper=f, lower=g_b)
    r = bilevel.ITD(3, 0.3, lower_batches=lambda: next(draws)).step(
        problem, *point(), upper_batch=None, lower_batch=None)
    outer, hat = point()[0], r.inner_solution
    residual = torch.linalg.vector_norm(A @ hat["t"] - 3.0 * outer["a"])
    assert r.info["lower_grad_norm"] == pytest.approx(float(residual), rel=1e-12)
    assert r.info["lower_loss_solution"] == pytest.approx(float(g_b(outer, hat, 3.0)), rel=1e-12)
