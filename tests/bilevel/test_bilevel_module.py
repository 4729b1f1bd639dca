"""An nn.Module problem through torch.func.functional_call gives the same answers as the
hand-written pytree version, and frozen parameters receive no gradient."""

import pytest
import torch
from torch import nn
from torch.func import functional_call

import bilevel
from bilevel import linalg

F64 = torch.float64


def setup():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 2)).to(F64)
    gen = torch.Generator().manual_seed(1)
    train = (
        torch.randn(20, 3, generator=gen, dtype=F64),
        torch.randn(20, 2, generator=gen, dtype=F64),
    )
    val = (
        torch.randn(10, 3, generator=gen, dtype=F64),
        torch.randn(10, 2, generator=gen, dtype=F64),
    )
    # inner: the head only (like LoRA adapters); outer: per-output log weight decay.
    inner = {k: v.detach().clone() for k, v in model.named_parameters() if k.startswith("2.")}
    outer = {"log_wd": torch.tensor([-1.0, -2.0], dtype=F64)}

    def module_lower(o, i, batch):
        x, y = batch
        loss = ((functional_call(model, i, (x,)) - y) ** 2).mean()
        return loss + 0.5 * (o["log_wd"].exp() * (i["2.weight"] ** 2).sum(1)).sum()

    def module_upper(o, i, batch):
        x, y = batch
        return ((functional_call(model, i, (x,)) - y) ** 2).mean()

    w1, b1 = model[0].weight.detach().clone(), model[0].bias.detach().clone()

    def forward(i, x):
        return torch.tanh(x @ w1.T + b1) @ i["2.weight"].T + i["2.bias"]

    def tree_lower(o, i, batch):
        x, y = batch
        return ((forward(i, x) - y) ** 2).mean() + 0.5 * (
            o["log_wd"].exp() * (i["2.weight"] ** 2).sum(1)
        ).sum()

    def tree_upper(o, i, batch):
        x, y = batch
        return ((forward(i, x) - y) ** 2).mean()

    module = bilevel.Problem(upper=module_upper, lower=module_lower)
    hand = bilevel.Problem(upper=tree_upper, lower=tree_lower)
    return model, module, hand, outer, inner, train, val


SOLVERS = [
    bilevel.BOME(5, 0.2),
    bilevel.BOME(5, 0.2, phi="value_gap", c=0.5),
    bilevel.ITD(5, 0.2),
    bilevel.ITD(5, 0.2, truncate=2),
    bilevel.AID(5, 0.2, linear_solver=linalg.CG(maxiter=30, tol=1e-12)),
    bilevel.AID(5, 0.2, linear_solver=linalg.Dense()),
    bilevel.ITD(5, 0.2, inner_optimizer=bilevel.SGD(momentum=0.9)),
    bilevel.FD(3, 0.2),
    bilevel.VPBGD(5, 0.2),
    bilevel.F2SA(3, 0.2, warm_start=False),  # called twice below: no state between the calls
]


@pytest.mark.parametrize("solver", SOLVERS, ids=lambda s: type(s).__name__)
def test_module_and_pytree_versions_agree_and_frozen_params_get_no_grad(solver):
    model, module, hand, outer, inner, train, val = setup()
    inner = {k: v.requires_grad_() for k, v in inner.items()}  # as an optimizer would hold them
    assert all(p.requires_grad for p in model.parameters())  # frozen only by not being inner
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    r1 = solver.step(module, outer, inner, upper_batch=val, lower_batch=train)
    r2 = solver.step(hand, outer, inner, upper_batch=val, lower_batch=train)
    for a, b in zip(
        bilevel.tree.leaves((r1.outer_grad, r1.inner_grad, r1.inner_solution)),
        bilevel.tree.leaves((r2.outer_grad, r2.inner_grad, r2.inner_solution)),
    ):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-13)
    for k in r1.info:
        assert r1.info[k] == pytest.approx(r2.info[k], rel=1e-9, abs=1e-12)
    assert all(p.grad is None for p in model.parameters())
    assert all(v.grad is None for v in inner.values())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_hypergrad_through_a_module_matches_the_pytree_version():
    _, module, hand, outer, inner, train, val = setup()
    for method in (bilevel.Unrolled(8, 0.2), bilevel.Implicit(linalg.CG(maxiter=30, tol=1e-12))):
        h1 = bilevel.hypergrad(
            module, outer, inner, upper_batch=val, lower_batch=train, method=method
        )
        h2 = bilevel.hypergrad(
            hand, outer, inner, upper_batch=val, lower_batch=train, method=method
        )
        assert torch.allclose(h1["log_wd"], h2["log_wd"], rtol=1e-10, atol=1e-13)
        assert h1["log_wd"].abs().sum() > 0
