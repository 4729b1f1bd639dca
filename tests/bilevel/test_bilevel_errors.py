"""Clear errors for bad objectives, bad configuration and mismatched pytrees; zero
gradients (not errors) for variables an objective does not use."""

import pytest
import torch

import bilevel
from bilevel import linalg
from bilevel.errors import DivergenceError

F64 = torch.float64


def problem(lower=None, upper=None):
    def g(o, i, b):
        return 0.5 * (i["t"] ** 2).sum() - o["a"] * i["t"].sum()

    def f(o, i, b):
        return ((i["t"] - 1) ** 2).sum()

    return bilevel.Problem(upper=upper or f, lower=lower or g)


OUTER = {"a": torch.tensor(0.5, dtype=F64)}
INNER = {"t": torch.zeros(3, dtype=F64)}
ALL = [
    bilevel.BOME(5, 0.1),
    bilevel.ITD(5, 0.1),
    bilevel.ITD(5, 0.1, truncate=2),
    bilevel.AID(5, 0.1),
    bilevel.FD(5, 0.1),
    bilevel.VPBGD(5, 0.1),
    bilevel.F2SA(5, 0.1),
]


def run(solver, prob, outer=OUTER, inner=INNER):
    return solver.step(prob, outer, inner, upper_batch=None, lower_batch=None)


@pytest.mark.parametrize("solver", ALL, ids=repr)
def test_non_scalar_lower_objective_names_objective_shape_and_step(solver):
    def g(o, i, b):
        return 0.5 * i["t"] ** 2  # forgot the reduction

    with pytest.raises(
        ValueError,
        match=r"lower objective must return a scalar .*shape \(3,\) \(inner step 1 of 5\)",
    ):
        run(solver, problem(lower=g))


@pytest.mark.parametrize("solver", ALL, ids=repr)
def test_non_finite_lower_objective_names_objective_and_step(solver):
    calls = []

    def g(o, i, b):
        calls.append(1)
        value = 0.5 * (i["t"] ** 2).sum() - o["a"] * i["t"].sum()
        return value * float("nan") if len(calls) == 3 else value

    with pytest.raises(
        FloatingPointError,
        match=r"lower objective \(inner step 3 of 5\) returned a non-finite value \(nan\)",
    ):
        run(solver, problem(lower=g))


@pytest.mark.parametrize("solver", ALL, ids=repr)
def test_non_finite_upper_objective(solver):
    def f(o, i, b):
        return (i["t"] ** 2).sum() + float("inf")

    with pytest.raises(FloatingPointError, match=r"upper objective .* non-finite value \(inf\)"):
        run(solver, problem(upper=f))


def test_non_tensor_and_integer_objective_values():
    with pytest.raises(TypeError, match="lower objective must return a torch.Tensor, got float"):
        run(bilevel.BOME(2, 0.1), problem(lower=lambda o, i, b: 1.0))
    with pytest.raises(TypeError, match="upper objective returned dtype torch.int64"):
        run(bilevel.BOME(2, 0.1), problem(upper=lambda o, i, b: torch.tensor(1)))


def test_hypergrad_reports_non_finite_values_too():
    def g(o, i, b):
        return 0.5 * (i["t"] ** 2).sum() * o["a"].log()  # log(−1) = nan

    with pytest.raises(FloatingPointError, match=r"hypergrad\(Implicit\): the lower objective"):
        bilevel.hypergrad(
            problem(lower=g),
            {"a": torch.tensor(-1.0, dtype=F64)},
            INNER,
            upper_batch=None,
            lower_batch=None,
            method=bilevel.Implicit(),
        )


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: bilevel.BOME(-1, 0.1), "BOME: inner_steps must be >= 1"),
        (lambda: bilevel.BOME(0, 0.1), "BOME: inner_steps must be >= 1"),
        (lambda: bilevel.BOME(3, 0.0), "BOME: inner_lr must be a finite number > 0"),
        (lambda: bilevel.BOME(3, -0.1), "BOME: inner_lr must be a finite number > 0"),
        (lambda: bilevel.BOME(3, 0.1, phi="gradnorm"), "BOME: phi must be one of"),
        (lambda: bilevel.BOME(3, 0.1, eta=-1.0), "BOME: eta must be a finite number >= 0"),
        (lambda: bilevel.BOME(3.0, 0.1), "BOME: inner_steps must be an int"),
        (lambda: bilevel.BOME(3, 0.1, eps=0.0), "BOME: eps must be a finite number > 0"),
        (lambda: bilevel.ITD(0, 0.1), "ITD: inner_steps must be >= 1"),
        (lambda: bilevel.ITD(3, float("inf")), "ITD: inner_lr must be a finite number > 0"),
        (lambda: bilevel.ITD(3, 0.1, truncate=4), "ITD: truncate=4 exceeds inner_steps=3"),
        (lambda: bilevel.ITD(3, 0.1, truncate=0), "truncate must be >= 1"),
        (lambda: bilevel.AID(-1, 0.1), "AID: inner_steps must be >= 0"),
        (
            lambda: bilevel.AID(3, 0.1, linear_solver="cg"),
            "linear_solver must be a bilevel.linalg solver",
        ),
        (lambda: bilevel.Unrolled(inner_steps=-2, inner_lr=0.1), "Unrolled: inner_steps must be >= 1"),
        (
            lambda: bilevel.Implicit(linear_solver=None),
            "linear_solver must be a bilevel.linalg solver",
        ),
        (lambda: bilevel.Problem(upper=1, lower=lambda o, i, b: 0), "upper must be a callable"),
    ],
)
def test_bad_configuration_fails_at_construction(make, match):
    with pytest.raises((ValueError, TypeError), match=match):
        make()


def test_bad_inputs():
    prob = problem()
    with pytest.raises(TypeError, match="method must be bilevel.Unrolled, bilevel.Implicit or "):
        bilevel.hypergrad(
            prob, OUTER, INNER, upper_batch=None, lower_batch=None, method=linalg.CG()
        )
    with pytest.raises(TypeError, match="problem must be a bilevel.Problem"):
        bilevel.BOME(2, 0.1).step(lambda: 0, OUTER, INNER, upper_batch=None, lower_batch=None)
    with pytest.raises(ValueError, match="inner has no tensor leaves"):
        run(bilevel.BOME(2, 0.1), prob, inner={})
    with pytest.raises(TypeError, match="outer leaf 0 has dtype torch.int64"):
        run(bilevel.BOME(2, 0.1), prob, outer={"a": torch.tensor(1)})
    with pytest.raises(TypeError, match=r"inner\['t'\]\[0\] is float"):
        run(bilevel.BOME(2, 0.1), prob, inner={"t": [1.0, 2.0]})


def test_apply_rejects_directions_with_another_structure():
    outer = {"a": torch.zeros(2, requires_grad=True)}
    result = bilevel.StepResult(outer_grad={"b": torch.ones(2)}, inner_grad={})
    opt = torch.optim.SGD(list(outer.values()), lr=0.1)
    with pytest.raises(ValueError, match="pytree structures differ"):
        bilevel.apply(result, outer, {}, outer_optimizer=opt)


@pytest.mark.parametrize(
    "solver", ALL + [bilevel.AID(3, 0.1, linear_solver=linalg.Dense())], ids=repr
)
def test_unused_variables_get_zero_gradients(solver):
    outer = {"a": torch.tensor(0.5, dtype=F64), "unused": torch.ones(2, dtype=F64)}
    inner = {"t": torch.zeros(3, dtype=F64), "unused": torch.ones(4, dtype=F64)}

    def g(o, i, b):  # the lower level ignores inner["unused"]; the upper ignores α entirely
        return 0.5 * (i["t"] ** 2).sum() - o["a"] * i["t"].sum()

    def f(o, i, b):
        return ((i["t"] - 1) ** 2).sum()

    with pytest.warns(bilevel.UnusedLeafWarning) as record:  # zeros, but named: not silent
        r = solver.step(
            bilevel.Problem(upper=f, lower=g), outer, inner, upper_batch=None, lower_batch=None
        )
    messages = " ".join(str(w.message) for w in record)
    assert "outer['unused']" in messages and "inner['unused']" in messages
    assert torch.equal(r.outer_grad["unused"], torch.zeros(2, dtype=F64))
    assert torch.equal(r.inner_grad["unused"], torch.zeros(4, dtype=F64))
    if not isinstance(solver, bilevel.BOME):  # BOME's λ is 0 here: ∇f and ∇q̂ already agree
        assert r.outer_grad["a"].abs() > 0


def test_lower_level_independent_of_outer_gives_zero_hypergradient():
    def g(o, i, b):
        return 0.5 * (i["t"] ** 2).sum()

    for method in (bilevel.Implicit(linalg.CG()), bilevel.Unrolled(3, 0.1)):
        with pytest.warns(bilevel.UnusedLeafWarning, match=r"outer\['a'\] is used by neither"):
            h = bilevel.hypergrad(
                problem(lower=g), OUTER, INNER, upper_batch=None, lower_batch=None, method=method
            )
        assert torch.equal(h["a"], torch.zeros((), dtype=F64))


# -- a diverging linear solver fails the same way whichever one it is ------------------------------
def test_a_diverging_neumann_series_raises_like_fixed_point():
    a = torch.diag(torch.tensor([1.0, 10.0], dtype=F64))  # lr = 1 > 2 / λ_max = 0.2: diverges
    b = torch.ones(2, dtype=F64)
    # long before the values overflow: the residual passed 1e3 × ‖b‖ (DivergenceError is a
    # FloatingPointError, what these raised before the divergence factor existed)
    with pytest.raises(DivergenceError, match=r"FixedPoint: diverged: .* at iteration 4; .*lower lr"):
        linalg.FixedPoint(maxiter=400, lr=1.0)(lambda v: a @ v, b)
    with pytest.raises(FloatingPointError) as e:  # overflowed to NaN: checked only at the end
        linalg.Neumann(steps=400, lr=1.0)(lambda v: a @ v, b)
    msg = str(e.value)
    assert msg.startswith("Neumann: the solution is non-finite (nan) after 400 iterations")
    assert "lower lr (now 1)" in msg and "2 / λ_max(A)" in msg
    with pytest.raises(DivergenceError, match=r"Neumann: diverged: .*grew to 6.56e\+03"):
        linalg.Neumann(steps=4, lr=1.0)(lambda v: a @ v, b)
    with pytest.raises(FloatingPointError, match=r"FixedPoint: ‖r‖² is inf at iteration \d+"):
        linalg.FixedPoint(maxiter=400, lr=1.0, on_divergence="ignore")(lambda v: a @ v, b)
    with pytest.raises(FloatingPointError, match="Neumann: .* the right-hand side b is not finite"):
        linalg.Neumann(steps=3, lr=0.1)(lambda v: a @ v, torch.tensor([1.0, float("inf")], dtype=F64))
    # converging: unchanged
    x = linalg.Neumann(steps=400, lr=0.1, tol=1e-12)(lambda v: a @ v, b)
    assert torch.allclose(x, torch.tensor([1.0, 0.1], dtype=F64))


def test_a_diverging_neumann_inside_aid_names_the_solver():
    aid = bilevel.AID(3, 0.1, linear_solver=linalg.Neumann(steps=2000, lr=50.0))
    with pytest.raises(FloatingPointError, match="Neumann: the solution is non-finite"):
        run(aid, problem(), {"a": torch.tensor(0.5, dtype=F64)}, {"t": torch.zeros(3, dtype=F64)})


# -- fit with optimizers that hold none of the tensors it was given ---------------------------------
def _vars():
    return ({"a": torch.tensor(0.5, dtype=F64, requires_grad=True)},
            {"t": torch.zeros(3, dtype=F64, requires_grad=True)})


def test_fit_refuses_optimizers_that_hold_none_of_the_given_tensors():
    outer, inner = _vars()
    copies = {"a": outer["a"].detach().clone().requires_grad_()}  # a copy: steps move only it
    with pytest.raises(ValueError, match=r"fit: outer_optimizer holds none of the 1 outer tensors, "
                                         "so its steps would change nothing; build it over"):
        bilevel.fit(problem(), bilevel.BOME(2, 0.1), outer, inner, steps=3, progress=False,
                    outer_optimizer=torch.optim.SGD(list(copies.values()), lr=0.1))
    with pytest.raises(ValueError, match=r"outer_optimizer holds none of the 1 outer tensors, so "
                                         r"its steps would change nothing \(it holds the inner ones: "
                                         "are the two optimizers swapped"):
        bilevel.fit(problem(), bilevel.BOME(2, 0.1), outer, inner, steps=3, progress=False,
                    outer_optimizer=torch.optim.SGD([inner["t"]], lr=0.1),
                    inner_optimizer=torch.optim.SGD([outer["a"]], lr=0.1))
    with pytest.raises(ValueError, match="fit: inner_optimizer holds none of the 1 inner tensors"):
        bilevel.fit(problem(), bilevel.BOME(2, 0.1), outer, inner, steps=3, progress=False,
                    outer_optimizer=None, inner_optimizer=torch.optim.SGD(list(copies.values())))
    # holding them (among others) is fine, and None still means "leave these alone"
    extra = torch.zeros(2, requires_grad=True)
    h = bilevel.fit(problem(), bilevel.BOME(2, 0.1), outer, inner, steps=2, progress=False,
                    outer_optimizer=torch.optim.SGD([outer["a"], extra], lr=0.1),
                    inner_optimizer=None)
    assert len(h) == 2 and inner["t"].abs().sum() == 0  # no inner optimizer: θ left alone
    bilevel.fit(problem(), bilevel.BOME(2, 0.1), outer, inner, steps=2, progress=False,
                outer_optimizer=None, inner_optimizer=torch.optim.SGD([extra, inner["t"]], lr=0.1))
    assert inner["t"].abs().sum() > 0


# -- user linear solvers that break the (x, info) protocol ------------------------------------------
def _nan_solve(matvec, b, init=None):
    return [torch.full_like(t, float("nan")) for t in b], {}


def _x_only(matvec, b, init=None):  # jaxopt's and torchopt's convention: x alone
    return linalg.CG(tol=1e-14).solve(matvec, b, init)[0]


def _torchopt_style(matvec, b):  # torchopt's solves take no init at all
    return linalg.CG(tol=1e-14).solve(matvec, b)[0]


@pytest.mark.parametrize("where", ["hypergrad", "AID"])
def test_a_linear_solver_returning_nan_raises_naming_the_solver(where):
    msg = r"the linear solver _nan_solve \(‖x‖² of its solution\) returned a non-finite value \(nan\)"
    with pytest.raises(FloatingPointError, match=msg):
        if where == "AID":
            run(bilevel.AID(2, 0.1, linear_solver=_nan_solve), problem())
        else:
            bilevel.hypergrad(problem(), OUTER, INNER, upper_batch=None, lower_batch=None,
                              method=bilevel.Implicit(_nan_solve))


def test_a_linear_solver_returning_x_alone_is_a_type_error_naming_protocol_and_adapter():
    # two leaves: x alone would even unpack as a pair (x₀ taken as x, x₁ as info) without the check
    inner = {"t": torch.zeros(3, dtype=F64), "u": torch.zeros(2, dtype=F64)}
    with pytest.raises(TypeError) as e:
        run(bilevel.AID(2, 0.1, linear_solver=_x_only), problem(), OUTER, inner)
    msg = str(e.value)
    assert "the linear solver _x_only returned list, not a tuple (x, info)" in msg
    assert "solve(matvec, b, init=None) -> (x, info)" in msg
    assert "bilevel.linalg.returns_x_only(solve)" in msg


@pytest.mark.parametrize("fn", [_x_only, _torchopt_style])
def test_returns_x_only_adapts_x_alone_solvers_to_the_same_hypergradient(fn):
    args = dict(upper_batch=None, lower_batch=None)
    theta = {"t": torch.tensor([0.3, -0.2, 0.9], dtype=F64)}
    oracle = bilevel.hypergrad(problem(), OUTER, theta, method=bilevel.Implicit(linalg.Dense()), **args)
    mine, info = bilevel.hypergrad(problem(), OUTER, theta, return_info=True,
                                   method=bilevel.Implicit(linalg.returns_x_only(fn)), **args)
    assert torch.allclose(mine["a"], oracle["a"], rtol=1e-12)
    assert not any(k.startswith("solver_") for k in info)  # the adapter's info is empty
    # warm-started AID passes init only to a solve that takes it
    aid = bilevel.AID(0, 0.1, linear_solver=linalg.returns_x_only(fn), warm_start=True)
    for _ in range(2):
        assert torch.allclose(run(aid, problem(), OUTER, theta).outer_grad["a"], oracle["a"], rtol=1e-12)
    with pytest.raises(TypeError, match="returns_x_only: fn must be callable, got int"):
        linalg.returns_x_only(3)


def test_aid_with_zero_inner_steps_is_implicit_differentiation_at_the_current_theta():
    # inner_steps=0 is meaningful (θ is the lower-level solution, e.g. solved outside or
    # kept near it by the inner optimizer), so it is accepted; inner_lr is then unused.
    theta = {"t": torch.tensor([0.3, -0.2, 0.9], dtype=F64)}
    r = run(bilevel.AID(0, 0.1, linear_solver=linalg.Dense()), problem(), OUTER, theta)
    h = bilevel.hypergrad(problem(), OUTER, theta, upper_batch=None, lower_batch=None,
                          method=bilevel.Implicit(linalg.Dense()))
    assert torch.equal(r.outer_grad["a"], h["a"])
    assert torch.equal(r.inner_solution["t"], theta["t"])


def test_soba_names_the_objective_and_where_it_failed():
    # single loop: no inner steps to number, every call is at the current (α, θ)
    def g(o, i, b):
        return 0.5 * i["t"] ** 2

    with pytest.raises(ValueError, match=r"SOBA.step: the lower objective must return a scalar .*"
                                         r"\(at the current \(α, θ\)\)"):
        run(bilevel.SOBA(0.1), problem(lower=g))
    with pytest.raises(FloatingPointError, match=r"SOBA.step: the upper objective .* \(inf\)"):
        run(bilevel.SOBA(0.1), problem(upper=lambda o, i, b: (i["t"] ** 2).sum() + float("inf")))


@pytest.mark.parametrize(
    "make", [lambda: bilevel.F2SA(3, 0.1), lambda: bilevel.SOBA(0.1),
             lambda: bilevel.AID(3, 0.1, warm_start=True, linear_solver=_nan_solve)],
    ids=["F2SA", "SOBA", "AID"],
)
def test_a_failed_step_leaves_no_non_finite_warm_start_behind(make):
    solver = make()
    bad = problem(upper=lambda o, i, b: ((i["t"] - 1) ** 2).sum() * float("nan"))
    with pytest.raises(FloatingPointError):
        run(solver, bad)
    kept = [getattr(solver, name).v for name in ("_y", "_v", "_last") if hasattr(solver, name)]
    assert kept == [None]  # nothing stored from the failed step
