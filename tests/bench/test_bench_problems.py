"""bench.problems: the reference hypergradients agree with independent oracles.

Quadratic and logistic: central finite differences of F(α) = f(α, θ*(α)), re-solving the
lower level at α ± hv in float64. MLP: the CG reference equals a dense float64 solve with
the full Hessian (torch.autograd.functional.hessian) on a network small enough to materialize.
"""

import math

import pytest
import torch

from bench import problems as P


def _fd_directional(make, alpha, v, h=1e-5):
    """(F(α + hv) − F(α − hv)) / 2h with F evaluated by building the problem at that α."""
    fp, fm = make(alpha + h * v), make(alpha - h * v)
    return (fp - fm) / (2 * h)


def test_quadratic_reference_matches_finite_differences():
    p = P.quadratic(30, m=4)
    a_mat, b_mat, c = p.lower_batch["A"], p.lower_batch["B"], p.upper_batch["c"]

    def value(alpha):
        theta = torch.linalg.solve(a_mat, b_mat @ alpha)
        return float(p.upper(alpha, [theta], p.upper_batch))

    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        v = torch.randn(4, generator=gen, dtype=torch.float64)
        fd = _fd_directional(value, p.alpha, v)
        assert float(p.exact @ v) == pytest.approx(fd, rel=1e-6, abs=1e-9)
    # and θ is the lower-level solution: ∇_θ g = 0
    assert torch.allclose(a_mat @ p.theta[0], b_mat @ p.alpha, atol=1e-10)
    del c


@pytest.mark.parametrize("d,n", [(12, 40), (40, 15)])  # Cholesky and Woodbury branches
def test_logistic_reference_matches_finite_differences(d, n):
    p = P.logistic(d, n=n)
    assert p.detail["lower_grad_norm"] < 1e-10

    def value(alpha):
        # re-solve the lower level at this α with a dense float64 Newton method
        w = p.theta[0].clone()
        for _ in range(30):
            wr = w.clone().requires_grad_(True)
            g = p.lower(alpha, [wr], p.lower_batch)
            (grad,) = torch.autograd.grad(g, wr, create_graph=True)
            hess = torch.stack(
                [torch.autograd.grad(grad[i], wr, retain_graph=True)[0] for i in range(d)]
            )
            w = (w - torch.linalg.solve(hess, grad)).detach()
            if float(grad.detach().norm()) < 1e-14:
                break
        return float(p.upper(alpha, [w], p.upper_batch))

    gen = torch.Generator().manual_seed(2)
    v = torch.randn(d, generator=gen, dtype=torch.float64)
    fd = _fd_directional(value, p.alpha, v)
    assert float(p.exact @ v) == pytest.approx(fd, rel=1e-5)
    assert 0 < p.inner_lr and math.isfinite(p.inner_lr)


def test_mlp_reference_matches_dense_solve():
    p = P.mlp(4, n_in=3, classes=3, n=32)
    assert p.size == 4 * 3 + 4 + 16 + 4 + 12 + 3
    flat = torch.cat([t.reshape(-1) for t in p.theta])
    shapes = [t.shape for t in p.theta]

    def unflat(x):
        out, i = [], 0
        for s in shapes:
            k = math.prod(s)
            out.append(x[i : i + k].reshape(s))
            i += k
        return out

    hess = torch.autograd.functional.hessian(
        lambda x: p.lower(p.alpha, unflat(x), p.lower_batch), flat
    )
    assert float(torch.linalg.eigvalsh(hess).min()) > 0  # a strict local minimum: CG applies
    x = flat.clone().requires_grad_(True)
    (f_theta,) = torch.autograd.grad(p.upper(p.alpha, unflat(x), p.upper_batch), x)
    v = torch.linalg.solve(hess, f_theta)
    exact = -p.alpha.exp() * (flat @ v)  # ∇²_{αθ} g = e^α θ for g = CE + ½ e^α ‖θ‖²
    assert torch.allclose(p.exact, exact, rtol=1e-7)


def test_cast_keeps_labels_and_converts_floats():
    p = P.logistic(5, n=8).cast(torch.float32)
    assert p.alpha.dtype == torch.float32 and p.theta[0].dtype == torch.float32
    assert p.lower_batch["x"].dtype == torch.float32
    m = P.mlp(4, n_in=3, classes=3, n=8).cast(torch.float32)
    assert m.lower_batch["y"].dtype == torch.int64


def test_unknown_problem_is_named():
    with pytest.raises(ValueError, match="unknown problem 'ridge'"):
        P.build("ridge", 10)
