"""bilevel.functional: a Sequential CNN with BatchNorm through ITD, AID and MAML gives the same
hypergradients, meta-gradients and directions as the hand-written torch.func.functional_call
version (to float64 round-off: rtol 1e-12, atol 1e-14), never writes the module's buffers
unless asked, uses the stored statistics in eval mode, works under vmap over tasks, and names
what is wrong with bad input."""

import copy
import gc
import warnings

import pytest
import torch
from torch import nn
from torch.func import functional_call, vmap

import bilevel
from bilevel import linalg
from tests.bilevel.test_bilevel_memory import _TrackOutputs

F64 = torch.float64
TOL = {"rtol": 1e-12, "atol": 1e-14}  # float64 round-off; the two versions run the same kernels
TASKS = 3


def cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 3, 3), nn.BatchNorm2d(3), nn.ReLU(), nn.Flatten(), nn.Linear(48, 2)
    ).to(F64)


def images(n: int, seed: int, tasks: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    lead = () if tasks is None else (tasks,)
    x = torch.randn(*lead, n, 1, 6, 6, generator=gen, dtype=F64)
    return x, torch.randn(*lead, n, 2, generator=gen, dtype=F64)


def mse(pred: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((pred - y) ** 2).mean()


def problems(model: nn.Module, split: str):
    """The same problem twice: through bilevel.functional (on ``model``) and hand-written with
    functional_call (on a copy, whose buffers it updates as a side effect), plus (α, θ).

    split="all": θ = every CNN parameter, α = a log weight decay;
    split="trunk": α = conv + BatchNorm parameters (an outer *module*), θ = the linear head."""
    twin = copy.deepcopy(model)
    f = bilevel.functional(model)

    def both(forward):
        def lower(o, i, batch):
            x, y = batch
            wd = o["log_wd"].exp() if split == "all" else 0.1
            return mse(forward(o, i, x), y) + 0.5 * wd * sum((v**2).sum() for v in i.values())

        def upper(o, i, batch):
            return mse(forward(o, i, batch[0]), batch[1])

        return bilevel.Problem(upper=upper, lower=lower)

    if split == "all":
        helper = both(lambda o, i, x: f(i, x))
        hand = both(lambda o, i, x: functional_call(twin, i, (x,)))
        outer = {"log_wd": torch.tensor(-2.0, dtype=F64, requires_grad=True)}
        inner = f.params
    else:
        helper = both(lambda o, i, x: f({**o, **i}, x))
        hand = both(lambda o, i, x: functional_call(twin, {**o, **i}, (x,)))
        outer = {k: v for k, v in f.params.items() if not k.startswith("4.")}
        inner = {k: v for k, v in f.params.items() if k.startswith("4.")}
    return helper, hand, outer, inner, twin


SOLVERS = [
    bilevel.ITD(4, 0.1),
    bilevel.AID(4, 0.1, linear_solver=linalg.CG(maxiter=30, tol=1e-12)),
    bilevel.AID(4, 0.1, linear_solver=linalg.Dense()),
]


def assert_close_trees(a, b):
    for x, y in zip(bilevel.tree.leaves(a), bilevel.tree.leaves(b), strict=True):
        assert torch.allclose(x, y, **TOL), (x - y).abs().max()


@pytest.mark.parametrize("split", ["all", "trunk"])
@pytest.mark.parametrize("solver", SOLVERS, ids=lambda s: f"{type(s).__name__}")
def test_itd_and_aid_through_the_helper_equal_the_hand_written_functional_call(solver, split):
    model = cnn()
    helper, hand, outer, inner, twin = problems(model, split)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    batches = {"upper_batch": images(6, 2), "lower_batch": images(8, 1)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # CG on an indefinite Hessian, both
        r1 = solver.step(helper, outer, inner, **batches)
        r2 = solver.step(hand, outer, inner, **batches)
    assert_close_trees((r1.outer_grad, r1.inner_grad, r1.inner_solution),
                       (r2.outer_grad, r2.inner_grad, r2.inner_solution))
    assert sum(float(v.abs().sum()) for v in r1.outer_grad.values()) > 0
    # the helper wrote nothing into the module; the hand-written calls updated the twin's
    # running statistics once per forward in train mode
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert int(twin[1].num_batches_tracked) > 0
    assert all(p.grad is None for p in model.parameters())


def test_unrolled_and_implicit_hypergradients_through_the_helper_equal_the_hand_written():
    helper, hand, outer, inner, _ = problems(cnn(), "all")
    batches = {"upper_batch": images(6, 2), "lower_batch": images(8, 1)}
    for method in (bilevel.Unrolled(5, 0.1), bilevel.Implicit(linalg.Dense())):
        h1 = bilevel.hypergrad(helper, outer, inner, method=method, **batches)
        h2 = bilevel.hypergrad(hand, outer, inner, method=method, **batches)
        assert torch.allclose(h1["log_wd"], h2["log_wd"], **TOL)
        assert h1["log_wd"].abs() > 0


def meta_problems(model: nn.Module):
    """MAML over TASKS tasks: α = the CNN's parameters (an outer module), θ_b task copies.
    The hand-written loss needs running statistics with a task dimension: under vmap a
    train-mode BatchNorm may not update unbatched ones in place."""
    twin = copy.deepcopy(model)
    f = bilevel.functional(model)

    def task_loss(params, batch):
        return vmap(lambda p, x, y: mse(f(p, x), y))(params, batch["x"], batch["y"])

    stats = {k: v.unsqueeze(0).repeat(TASKS, *[1] * v.ndim) for k, v in twin.named_buffers()}

    def hand_task_loss(params, batch):
        def one(p, b, x, y):
            return mse(functional_call(twin, (p, b), (x,)), y)

        return vmap(one)(params, stats, batch["x"], batch["y"])

    return bilevel.meta_problem(task_loss), bilevel.meta_problem(hand_task_loss), f


def task_batches():
    (xs, ys), (xq, yq) = images(5, 3, TASKS), images(4, 4, TASKS)
    return {"upper_batch": {"x": xq, "y": yq}, "lower_batch": {"x": xs, "y": ys}}


@pytest.mark.parametrize("solver", [bilevel.MAML(3, 0.1), bilevel.FOMAML(3, 0.1)],
                         ids=lambda s: type(s).__name__)
def test_maml_through_the_helper_under_vmap_equals_the_hand_written(solver):
    model = cnn()
    helper, hand, f = meta_problems(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    alpha = f.params
    inner = bilevel.task_copies(alpha, TASKS)
    r1 = solver.step(helper, alpha, inner, **task_batches())
    r2 = solver.step(hand, alpha, inner, **task_batches())
    assert_close_trees((r1.outer_grad, r1.inner_grad, r1.inner_solution),
                       (r2.outer_grad, r2.inner_grad, r2.inner_solution))
    assert all(r1.info[k] == pytest.approx(r2.info[k], rel=1e-12) for k in r1.info)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_vmap_over_tasks_equals_one_call_per_task_in_train_and_eval_mode():
    model = cnn()
    with torch.no_grad():  # non-trivial stored statistics for eval mode
        model[1].running_mean.copy_(torch.tensor([0.3, -0.2, 0.1]))
        model[1].running_var.copy_(torch.tensor([2.0, 0.5, 1.5]))
    f = bilevel.functional(model)
    params = bilevel.task_copies(f.params, TASKS)
    params = {k: v + 0.01 * torch.randn_like(v) for k, v in params.items()}  # distinct tasks
    x, _ = images(5, 6, TASKS)
    for mode in (model.train, model.eval):
        mode()
        batched = vmap(f)(params, x)
        looped = torch.stack([f({k: v[b] for k, v in params.items()}, x[b]) for b in range(TASKS)])
        assert batched.shape == (TASKS, 5, 2)
        assert torch.allclose(batched, looped, **TOL)
    # train mode normalizes each task with its own batch statistics: not the eval output
    model.train()
    assert not torch.allclose(vmap(f)(params, x), batched)


def test_eval_mode_batchnorm_uses_the_stored_statistics_and_buffers_replaces_them():
    model = cnn().eval()
    mean, var = torch.tensor([0.3, -0.2, 0.1], dtype=F64), torch.tensor([2.0, 0.5, 1.5], dtype=F64)
    with torch.no_grad():
        model[1].running_mean.copy_(mean)
        model[1].running_var.copy_(var)
    f = bilevel.functional(model)
    x, _ = images(4, 7)
    bn = model[1]

    def by_hand(m, v):
        h = model[0](x)
        h = (h - m[:, None, None]) / (v[:, None, None] + bn.eps).sqrt()
        h = h * bn.weight[:, None, None] + bn.bias[:, None, None]
        return model[4](torch.relu(h).flatten(1))

    assert torch.allclose(f(f.params, x), by_hand(mean, var), **TOL)
    other = {"1.running_mean": torch.zeros(3, dtype=F64), "1.running_var": torch.ones(3, dtype=F64)}
    assert torch.allclose(f(f.params, x, buffers=other), by_hand(other["1.running_mean"],
                                                                 other["1.running_var"]), **TOL)
    # eval mode through a solver: equal to the hand-written version too, buffers unchanged
    helper, hand, outer, inner, _ = problems(model, "all")
    batches = {"upper_batch": images(6, 2), "lower_batch": images(8, 1)}
    r1 = bilevel.ITD(3, 0.1).step(helper, outer, inner, **batches)
    r2 = bilevel.ITD(3, 0.1).step(hand, outer, inner, **batches)
    assert torch.allclose(r1.outer_grad["log_wd"], r2.outer_grad["log_wd"], **TOL)
    assert torch.equal(bn.running_mean, mean) and torch.equal(bn.running_var, var)


def test_update_buffers_writes_the_running_statistics_of_one_train_mode_pass():
    model = cnn()
    f = bilevel.functional(model)
    x, _ = images(8, 8)
    f(f.params, x)  # default: nothing written
    assert int(model[1].num_batches_tracked) == 0
    assert torch.equal(model[1].running_mean, torch.zeros(3, dtype=F64))
    with torch.no_grad():
        f(f.params, x, update_buffers=True)
        h = model[0](x)
    m = model[1].momentum
    batch_mean, batch_var = h.mean((0, 2, 3)), h.var((0, 2, 3), unbiased=True)
    assert torch.allclose(model[1].running_mean, m * batch_mean, **TOL)
    assert torch.allclose(model[1].running_var, (1 - m) + m * batch_var, **TOL)
    assert int(model[1].num_batches_tracked) == 1
    # with buffers= the update lands in the dict given, not in the module
    mine = {k: v.clone() for k, v in f.buffers.items()}
    f(f.params, x, buffers=mine, update_buffers=True)
    assert int(mine["1.num_batches_tracked"]) == 2 and int(model[1].num_batches_tracked) == 1


class Counter(nn.Module):
    """A module whose forward writes a buffer (not a normalization layer)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 1).to(F64)
        self.register_buffer("calls", torch.zeros((), dtype=F64))

    def forward(self, x):
        self.calls.add_(1)
        return self.lin(x)


def test_writes_to_any_other_buffer_are_dropped_unless_asked():
    model = Counter()
    f = bilevel.functional(model)
    x = torch.randn(3, 2, dtype=F64)
    assert torch.allclose(f(f.params, x), model.lin(x), **TOL)
    assert float(model.calls) == 0.0  # f's forward wrote into a copy
    f(f.params, x, update_buffers=True)
    assert float(model.calls) == 1.0


def test_params_alias_the_module_so_fit_trains_it_and_buffers_stay():
    model = cnn()
    helper, _, outer, inner, _ = problems(model, "all")
    stats = {k: v.clone() for k, v in model.named_buffers()}
    start = model[4].weight.detach().clone()
    bilevel.fit(helper, bilevel.ITD(2, 0.1), outer, inner, steps=2,
                outer_optimizer=torch.optim.SGD(outer.values(), lr=0.1),
                upper_batch=images(6, 2), lower_batch=images(8, 1),
                inner_update="solution", progress=False)
    assert inner["4.weight"].data_ptr() == model[4].weight.data_ptr()
    assert not torch.equal(model[4].weight.detach(), start)  # θ ← θ_T wrote into the module
    assert all(torch.equal(v, stats[k]) for k, v in model.named_buffers())


def test_trainable_picks_the_pytree_and_the_rest_are_constants():
    model = cnn()
    f = bilevel.functional(model, trainable=lambda name: name.startswith("4."))
    assert list(f.params) == ["4.weight", "4.bias"]
    g = bilevel.functional(model, trainable=["4.weight", "4.bias"])
    model[0].weight.requires_grad_(False)
    h = bilevel.functional(model)
    assert "0.weight" not in h.params and len(h.params) == 5
    x, _ = images(4, 9)
    expected = functional_call(model, dict(model.named_parameters()), (x,))
    for fm in (f, g, h):
        out = fm(fm.params, x)
        assert torch.allclose(out, expected, **TOL)
        grads = torch.autograd.grad(out.sum(), list(fm.params.values()))
        assert len(grads) == len(fm.params)
    assert all(p.grad is None for p in model.parameters())


def test_bad_input_gets_an_error_that_names_the_problem():
    model = cnn()
    f = bilevel.functional(model)
    x, _ = images(4, 10)
    with pytest.raises(TypeError, match="expected an nn.Module, got dict"):
        bilevel.functional(dict(model.named_parameters()))
    missing = {k: v for k, v in f.params.items() if k != "4.bias"}
    with pytest.raises(ValueError, match=r"missing \['4.bias'\], unknown \[\]"):
        f(missing, x)
    with pytest.raises(ValueError, match=r"missing \[\], unknown \['5.weight'\]"):
        f({**f.params, "5.weight": torch.zeros(2)}, x)
    with pytest.raises(ValueError, match=r"params\['4.weight'\] has shape \(3, 2, 48\).*vmap"):
        f({**f.params, "4.weight": torch.zeros(3, 2, 48, dtype=F64)}, x)
    with pytest.raises(TypeError, match="params must be a dict name -> tensor"):
        f(list(f.params.values()), x)
    with pytest.raises(TypeError, match=r"params\['4.bias'\] is a float"):
        f({**f.params, "4.bias": 0.0}, x)
    with pytest.raises(ValueError, match=r"buffers does not match.*unknown \['1.running_men'\]"):
        f(f.params, x, buffers={"1.running_men": torch.zeros(3)})
    with pytest.raises(ValueError, match=r"trainable names \['4.wieght'\] are not parameters"):
        bilevel.functional(model, trainable=["4.wieght"])
    with pytest.raises(TypeError, match="not a str"):
        bilevel.functional(model, trainable="4.weight")


@pytest.mark.parametrize("name", ["ITD", "AID", "MAML"])
def test_no_saved_tensor_outlives_a_step_through_the_helper(name):
    """The buffer copies and the None statistics leave nothing behind: after a step only the
    returned directions are alive (the check of test_bilevel_memory.py, on the BN CNN)."""
    model = cnn()
    if name == "MAML":
        problem, _, f = meta_problems(model)
        outer, inner, batches = f.params, bilevel.task_copies(f.params, TASKS), task_batches()
        solver = bilevel.MAML(2, 0.1)
    else:
        problem, _, outer, inner, _ = problems(model, "all")
        batches = {"upper_batch": images(6, 2), "lower_batch": images(8, 1)}
        solver = bilevel.ITD(3, 0.1) if name == "ITD" else bilevel.AID(3, 0.1)
    tracker = _TrackOutputs()
    with warnings.catch_warnings(), tracker:
        warnings.simplefilter("ignore", RuntimeWarning)
        result = solver.step(problem, outer, inner, **batches)
    gc.collect()
    returned = bilevel.tree.leaves((result.outer_grad, result.inner_grad, result.inner_solution))
    survivors = [r() for r in tracker.refs if r() is not None]
    assert len(tracker.refs) > 100
    assert {id(t) for t in survivors} == {id(t) for t in returned}


@pytest.mark.parametrize("norm", [
    lambda: nn.BatchNorm1d(4),
    lambda: nn.InstanceNorm1d(4, affine=True, track_running_stats=True),
], ids=["BatchNorm1d", "InstanceNorm1d"])
def test_other_normalization_layers_are_neither_read_nor_written_in_train_mode(norm):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(1, 4, 3), norm(), nn.Tanh(), nn.Flatten()).to(F64)
    twin = copy.deepcopy(model)
    f = bilevel.functional(model)
    x = torch.randn(TASKS, 5, 1, 8, dtype=F64)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert torch.allclose(f(f.params, x[0]), functional_call(twin, f.params, (x[0],)), **TOL)
    assert vmap(f)(bilevel.task_copies(f.params, TASKS), x).shape == (TASKS, 5, 24)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert not torch.equal(twin[1].running_mean, before["1.running_mean"])  # hand-written wrote
