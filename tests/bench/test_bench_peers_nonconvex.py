"""bench/peers_nonconvex.py at a tiny size: the dense references are right, and the row builder
gives every method a row (bilevel's with finite errors; an absent peer says "not installed")."""

import math

import pytest

import bilevel
from bench import peers_nonconvex as pn
from bilevel import linalg


@pytest.fixture(scope="module")
def cases():
    return [pn.mlp_case(n=8, steps=3), pn.darts_case(n=12, batch=4, steps=10, h=3, c=2)]


def _bilevel_dense(case):
    problem = bilevel.Problem(upper=case.upper, lower=case.lower)
    return bilevel.hypergrad(problem, case.alpha, case.theta, upper_batch=case.val,
                             lower_batch=case.train, method=bilevel.Implicit(linalg.Dense()))


def test_dense_reference_matches_bilevel_dense(cases):
    # two independent float64 dense solves of the same linear system: agree to 1e-8 relative
    for case in cases:
        got = _bilevel_dense(case)
        assert float((got - case.exact).norm() / case.exact.norm()) < 1e-8, case.name


def test_rows_one_per_method_finite_bilevel_errors(cases, monkeypatch):
    # peers made absent here whatever the venv holds: their rows must say so, not vanish
    monkeypatch.setattr(pn.torchopt_lib, "unavailable", lambda: "torchopt hidden by the test")
    monkeypatch.setattr(pn.betty_lib, "unavailable", lambda: "betty hidden by the test")
    for case in cases:
        rows = pn.rows(case, timing=True, repeats=1)
        by = {r["method"]: r for r in rows}
        assert set(by) == {f"bilevel {k}" for k in pn.bilevel_solvers(1.0)} | {
            "torchopt solve_normal_cg (default)", "torchopt solve_cg", "betty cg", "betty neumann"}
        for name in ("bilevel MINRES", "bilevel Dense", "bilevel NormalCG"):
            assert math.isfinite(by[name]["error"]) and by[name]["error"] < 1e-6, (case.name, name)
            assert by[name]["ms"] > 0
        for name, r in by.items():  # every bilevel row: a finite error or the exception text
            if name.startswith("bilevel"):
                assert math.isfinite(r["error"]) or r["said"].startswith("raised"), (name, r)
            else:
                assert r["said"].startswith("not installed"), (name, r)
        text = pn.render([case], rows)
        assert "not installed" in text and "bilevel MINRES" in text


def test_rows_with_torchopt_present_match_dense(cases):
    """Where torchopt imports, its solve_cg / solve_normal_cg rows are finite; where it does not,
    the rows say "not installed" (either way the row exists)."""
    rows = {r["method"]: r for r in pn.rows(cases[0], timing=False)}
    for name in ("torchopt solve_cg", "torchopt solve_normal_cg (default)"):
        if pn.torchopt_lib.unavailable() is None:
            assert rows[name]["error"] < 1e-6, rows[name]
        else:
            assert rows[name]["said"].startswith("not installed"), rows[name]
