"""The runs tests/bilevel/test_bilevel_distributed.py compares: every solver through
``bilevel.fit`` on the example's L2-HPO problem (examples/distributed_l2_hpo.py) and on a
meta-learning problem, run once per rank of a 2-process gloo group (``worker``, started by
``torch.multiprocessing.spawn``) and once in the test's own process on the whole batches."""

from __future__ import annotations

import datetime
import itertools
import re
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import bilevel
from examples import distributed_l2_hpo as example

F64 = torch.float64
STEPS = 3
TASKS, POINTS, DIM = 4, 6, 3  # the meta problem: 4 tasks (2 per rank) of 6 points in R^3
PROBLEM = bilevel.Problem(upper=example.upper, lower=example.lower)
ROOT = Path(__file__).resolve().parents[2]
DOCS_SECTION = "Distributed (data-parallel) runs: `torchrun`, `bilevel.distributed`"


def task_loss(params: dict[str, torch.Tensor], batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Per-task mean squared error of a linear model, shape (B,)."""
    x, y = batch
    return ((torch.einsum("bnd,bd->bn", x, params["w"]) - y) ** 2).mean(1)


META = bilevel.meta_problem(task_loss)
META_PROX = bilevel.meta_problem(task_loss, prox=1.0)


def meta_data() -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """(query, support) batches of TASKS tasks, identical in every process (seeded)."""
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(TASKS, DIM, generator=gen, dtype=F64)
    x = torch.randn(TASKS, 2 * POINTS, DIM, generator=gen, dtype=F64)
    y = torch.einsum("bnd,bd->bn", x, w) + 0.1 * torch.randn(TASKS, 2 * POINTS, generator=gen,
                                                             dtype=F64)
    return (x[:, POINTS:], y[:, POINTS:]), (x[:, :POINTS], y[:, :POINTS])


def minibatches(shard: Any) -> Any:
    """A ``lower_batches`` source: the training batch's four quarters in turn, each this
    process's shard of it (the same sequence on every rank)."""
    train = example.data()[0]
    quarters = itertools.cycle([shard((train[0][k::4], train[1][k::4])) for k in range(4)])
    return lambda: next(quarters)


def solvers(shard: Any = lambda b: b) -> dict[str, tuple[Any, dict[str, Any]]]:
    """name -> (a fresh solver, how fit applies it); every solver of the library, and the
    fresh-batch inner loops (``lower_batches``) drawing ``shard``s."""
    cg = bilevel.linalg.CG(maxiter=40, tol=1e-13)
    joint = {"inner_update": "optimizer", "inner_lr": 0.3}
    return {
        "ITD minibatch": (bilevel.ITD(4, 0.5, lower_batches=minibatches(shard)), {}),
        "AID stocBiO": (bilevel.AID(3, 0.5, bilevel.linalg.Neumann(5, 0.5, on_unconverged="ignore"),
                                    fresh_inner_steps=True,
                                    lower_batches=minibatches(shard)), {}),
        "BOME minibatch": (bilevel.BOME(4, 0.5, lower_batches=minibatches(shard)), joint),
        "ITD": (bilevel.ITD(6, 0.5), {}),
        "ITD truncated momentum": (
            bilevel.ITD(6, 0.3, truncate=3, inner_optimizer=bilevel.SGD(momentum=0.9)), {}),
        "AID": (bilevel.AID(10, 0.5, cg), {}),
        "AID warm joint": (bilevel.AID(2, 0.5, cg, warm_start=True), joint),
        "BOME": (bilevel.BOME(5, 0.5), joint),
        "BOME value_gap": (bilevel.BOME(5, 0.5, phi="value_gap"), joint),
        "SOBA": (bilevel.SOBA(0.3), joint),
        "SABA": (bilevel.SABA(0.3, n_upper=2, n_lower=2), {**joint, "indexed": True}),
        "FD": (bilevel.FD(4, 0.5), {}),
        "VPBGD": (bilevel.VPBGD(5, 0.5, gamma=2.0), {"inner_update": "optimizer", "inner_lr": 0.1}),
        "F2SA": (bilevel.F2SA(5, 0.5, lam=5.0), {}),
        "MAML": (bilevel.MAML(2, 0.1), {"meta": META}),
        "FOMAML": (bilevel.FOMAML(2, 0.1), {"meta": META}),
        "Reptile": (bilevel.Reptile(2, 0.1), {"meta": META}),
        "IMAML": (bilevel.IMAML(3, 0.1, bilevel.linalg.CG(maxiter=40, tol=1e-14)),
                  {"meta": META_PROX}),
    }


def _variables(meta: bool, tasks: int) -> tuple[dict, dict]:
    if meta:
        outer = {"w": torch.full((DIM,), 0.1, dtype=F64, requires_grad=True)}
        return outer, bilevel.task_copies(outer, tasks)
    outer = {"log_l2": torch.zeros(example.FEATURES, dtype=F64, requires_grad=True)}
    inner = {"w": torch.zeros(example.FEATURES, dtype=F64, requires_grad=True),
             "b": torch.zeros((), dtype=F64, requires_grad=True)}
    return outer, inner


def _batches(how: dict[str, Any], shard: Any) -> dict[str, Any]:
    """fit's batch arguments: this process's shard of the whole batches (``shard``)."""
    if "meta" in how:
        query, support = meta_data()
        return {"upper_batch": shard(query), "lower_batch": shard(support)}
    train, val = example.data()
    if not how.get("indexed"):
        return {"upper_batch": shard(val), "lower_batch": shard(train)}
    # SABA: two terms per finite sum, the same index on every rank (item i is the union of
    # the ranks' shards of item i)
    halves = [(shard(val[0][i::2]), shard(val[1][i::2])) for i in range(2)]
    lows = [(shard(train[0][i::2]), shard(train[1][i::2])) for i in range(2)]
    order = itertools.cycle([0, 1, 1, 0])
    return {"batches": lambda _k: (lambda i: (bilevel.Indexed(i, halves[i]),
                                              bilevel.Indexed(i, lows[i])))(next(order))}


def run(name: str, shard: Any = lambda b: b, steps: int = STEPS, **fit_options: Any
        ) -> dict[str, Any]:
    """``steps`` steps of solver ``name`` on this process's shards: the final α and θ,
    every step's info and the last step's inner_solution (None if no step ran)."""
    solver, how = solvers(shard)[name]
    meta = "meta" in how
    outer, inner = _variables(meta, TASKS // bilevel.distributed.world_size())
    inner_opt = (torch.optim.SGD(bilevel.tree.leaves(inner), lr=how["inner_lr"])
                 if how.get("inner_update") == "optimizer" else None)
    last: list[Any] = []
    history = bilevel.fit(
        how.get("meta", PROBLEM), solver, outer, inner, steps=steps,
        outer_optimizer=torch.optim.SGD(bilevel.tree.leaves(outer), lr=0.3),
        inner_optimizer=inner_opt, progress=False,
        inner_update="optimizer" if meta or inner_opt else "solution",
        callback=lambda _k, result: last.append(result.inner_solution), **_batches(how, shard),
        **fit_options,
    )
    return {"outer": bilevel.tree.detach(outer), "inner": bilevel.tree.detach(inner),
            "info": history.records, "inner_solution": last[-1] if last else None}


def nan_lower(outer: Any, inner: Any, batch: Any) -> torch.Tensor:
    """The example's g, NaN on a batch that says so (one rank's shard only)."""
    value = example.lower(outer, inner, batch[:2])
    return value * batch[2] if len(batch) > 2 else value


def _collective_checks(rank: int, world: int) -> dict[str, Any]:
    """What a run must do beside the solvers: ``average``, ``shard``'s equal-shard check,
    a non-finite value on one rank failing every rank, fit(distributed=False)."""
    out: dict[str, Any] = {"average": bilevel.distributed.average({"r": torch.tensor(float(rank))})}
    try:
        bilevel.distributed.shard(torch.zeros(5, 2))
    except ValueError as e:
        out["shard_error"] = str(e)
    train, val = example.data()
    part = bilevel.distributed.shard(train)
    batch = (*part, torch.tensor(float("nan"))) if rank == 1 else part
    outer, inner = _variables(False, 0)
    try:
        bilevel.BOME(3, 0.5).step(bilevel.Problem(upper=example.upper, lower=nan_lower), outer,
                                  inner, upper_batch=bilevel.distributed.shard(val),
                                  lower_batch=batch)
    except FloatingPointError as e:
        out["nan_error"] = str(e)
    saba = bilevel.SABA(0.3, n_upper=2, n_lower=2)
    try:  # rank r passes index r: the ranks would refresh different memory entries
        saba.step(PROBLEM, outer, inner, upper_batch=bilevel.Indexed(rank, val),
                  lower_batch=bilevel.Indexed(0, train))
    except ValueError as e:
        out["saba_error"] = str(e)
    with bilevel.distributed.data_parallel(False):
        out["world_when_off"] = bilevel.distributed.world_size()
    out["alone"] = run("AID", bilevel.distributed.shard, distributed=False)
    out["example"] = example.run(steps=STEPS)
    out["hypergrad"] = hypergrads(bilevel.distributed.shard)
    out["docs"] = docs_example()
    return out


def hypergrads(shard: Any) -> dict[str, Any]:
    """``bilevel.hypergrad`` by each method, with its info, at one point."""
    train, val = example.data()
    outer = {"log_l2": torch.linspace(-1.0, 0.5, example.FEATURES, dtype=F64)}
    inner = {"w": torch.linspace(0.3, -0.2, example.FEATURES, dtype=F64),
             "b": torch.tensor(0.1, dtype=F64)}
    methods = {"Unrolled": bilevel.Unrolled(5, 0.5),
               "Implicit": bilevel.Implicit(bilevel.linalg.CG(maxiter=30, tol=1e-13)),
               "FiniteDifference": bilevel.FiniteDifference(0.5)}
    return {name: bilevel.hypergrad(PROBLEM, outer, inner, upper_batch=shard(val),
                                    lower_batch=shard(train), method=m, return_info=True)
            for name, m in methods.items()}


def docs_example() -> dict[str, Any]:
    """docs/bilevel.md's data-parallel script, run as written: its final α and info."""
    text = (ROOT / "docs" / "bilevel.md").read_text()
    section = text.split(f"## {DOCS_SECTION}", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```py\n(.*?)```", section, flags=re.S)
    namespace: dict[str, Any] = {"__name__": "__doc_distributed__"}
    exec(compile(block, "docs/bilevel.md#distributed", "exec"), namespace)
    return {"alpha": bilevel.tree.detach(namespace["alpha"]), "info": namespace["history"].last}


def worker(rank: int, world: int, store: str, out_dir: str) -> None:
    """One rank: join the FileStore-initialized gloo group, run every solver and the
    checks on this rank's shards, save the results as out_dir/rank{rank}.pt."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))  # a hang fails, in time
    try:
        results = {name: run(name, bilevel.distributed.shard) for name in solvers()}
        results["checks"] = _collective_checks(rank, world)
        ckpt = Path(out_dir) / "fit.ckpt"
        run("BOME", bilevel.distributed.shard, steps=2, checkpoint=ckpt)  # rank 0 writes it
        results["resumed"] = run("BOME", bilevel.distributed.shard, checkpoint=ckpt)
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()
