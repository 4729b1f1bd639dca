"""The torch port of benchopt's ``simulated`` bilevel problem (bench/benchopt_problem.py)
against dense float64 oracles independent of it: per-sample sums for the batched value,
autograd for the gradients, and autograd through a dense ``torch.linalg.solve`` of the inner
problem for the closed-form metrics. Needs neither benchopt, JAX nor the benchmark (the
comparison with the benchmark's own JAX functions runs inside bench/benchopt_bilevel.py
--check, where the benchmark is present), so it never skips."""

import torch

from bench.benchopt_problem import Quadratic, SimulatedProblem, quadratic

N, P, D = 12, 5, 3


def random_quadratic(gen: torch.Generator) -> Quadratic:
    def spd(k: int) -> torch.Tensor:
        m = torch.randn(N, k, k, generator=gen, dtype=torch.float64)
        return m @ m.transpose(1, 2) / k + 0.1 * torch.eye(k, dtype=torch.float64)

    return Quadratic(spd(P), spd(D), torch.randn(N, D, P, generator=gen, dtype=torch.float64),
                     torch.randn(N, P, generator=gen, dtype=torch.float64),
                     torch.randn(N, D, generator=gen, dtype=torch.float64))


def test_batched_value_is_the_mean_of_the_per_sample_quadratics():
    gen = torch.Generator().manual_seed(0)
    q = random_quadratic(gen)
    z, x = torch.randn(P, generator=gen, dtype=torch.float64), torch.randn(D, generator=gen, dtype=torch.float64)
    for start, size in ((0, 1), (3, 4), (0, N)):
        per_sample = [quadratic(z, x, q.hess_inner[i], q.hess_outer[i], q.cross[i],
                                q.linear_inner[i], q.linear_outer[i]) for i in range(start, start + size)]
        expected = torch.stack(per_sample).mean()
        assert abs(float(q(z, x, start, size) - expected)) <= 1e-12 * max(1.0, abs(float(expected)))


def test_closed_form_metrics_match_a_dense_float64_solve():
    gen = torch.Generator().manual_seed(1)
    g, f = random_quadratic(gen), random_quadratic(gen)
    problem = SimulatedProblem(g, f)
    x = torch.randn(D, generator=gen, dtype=torch.float64)
    z = torch.randn(P, generator=gen, dtype=torch.float64)

    def inner_solution(x: torch.Tensor) -> torch.Tensor:
        # argmin_z g(z, x): ∇_z g = Ā z + C̄ᵀx + ā = 0, solved densely (LU), not by Cholesky
        gm = g.mean()
        return torch.linalg.solve(gm.hess_inner[0], -(gm.linear_inner[0] + gm.cross[0].T @ x))

    def h(x: torch.Tensor) -> torch.Tensor:
        return f(inner_solution(x), x)

    z_star = inner_solution(x)
    # stationarity of the port's inner solution, by autograd on the full-batch g
    zz = problem.inner_solution(x).requires_grad_(True)
    (grad_z,) = torch.autograd.grad(g(zz, x), zz)
    assert float(grad_z.norm()) < 1e-12
    hypergrad = torch.func.grad(h)(x)  # autograd through the dense solve
    assert float((problem.hypergradient(x) - hypergrad).norm()) <= 1e-10 * float(hypergrad.norm())
    m = problem.metrics(z, x)
    value = float(hypergrad.square().sum())
    assert abs(m["value"] - value) <= 1e-10 * value
    dist = float((z_star - z).square().sum())
    assert abs(m["inner_distance"] - dist) <= 1e-10 * dist
    assert abs(m["func"] - float(h(x))) <= 1e-10 * max(1.0, abs(float(h(x))))


def test_the_bench_names_a_missing_peer_package(monkeypatch):
    import importlib.util

    import pytest

    from bench import benchopt_bilevel

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "benchopt" else real(name, *a))
    with pytest.raises(SystemExit, match="needs the package 'benchopt'"):
        benchopt_bilevel.require_peers()


def test_a_jax_solvers_step_finishes_before_benchopts_callback_reads_the_clock():
    # JAX dispatches asynchronously: the run loop wraps benchopt's callback so the solver's
    # pending step is waited for first, and its time is counted as the solver's, not the
    # evaluation's (without it the JAX rows were 200-560x too fast)
    from bench.benchopt_bilevel import synced

    class AsyncSolver:
        pending = 0  # steps dispatched, not finished

    solver, seen = AsyncSolver(), []

    def callback() -> bool:
        seen.append(solver.pending)  # what benchopt's clock would see unfinished
        return len(seen) < 3

    def sync(s: AsyncSolver) -> None:
        s.pending = 0

    wrapped = synced(callback, solver, sync)
    while wrapped():
        solver.pending += 1
    assert seen == [0, 0, 0]
    assert synced(callback, solver, None) is callback  # torch: synchronous on the CPU, unwrapped
