"""Data parallelism (bilevel.distributed): two gloo processes, each with half of every batch,
take the same steps as one process on the whole batches, to float64 round-off.

For objectives that are means over their batch, the mean over ranks of per-shard mean
gradients is the full-batch mean gradient when the shards have equal sizes; every solver
averages each gradient it forms (inner steps, Hessian-vector and mixed products, ∇f,
BOME's value-function terms, SOBA's oracles, meta-gradients), so the two runs can differ
only by the order of floating-point sums. One ``torch.multiprocessing.spawn`` of two ranks
runs every case (tests/bilevel/distributed_cases.py); the references run here, with no
process group, on the concatenated batches.
"""

import pytest
import torch
import torch.multiprocessing as mp

import bilevel
from tests.bilevel import distributed_cases as cases

WORLD = 2
RTOL, ATOL = 1e-12, 1e-13  # round-off of float64 sums in another order
META = ("MAML", "FOMAML", "Reptile", "IMAML")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """The saved results of both ranks (one spawn for the whole module)."""
    out = tmp_path_factory.mktemp("ranks")
    # a FileStore rendezvous: no port to pick, no race with other runs on the machine
    mp.spawn(cases.worker, args=(WORLD, str(out / "store"), str(out)), nprocs=WORLD, join=True)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def half(x, rank):
    """Rank ``rank``'s half of x's rows (of two)."""
    n = len(x) // 2
    return x[rank * n : (rank + 1) * n]


def close(a, b, rtol=RTOL, atol=ATOL):
    torch.testing.assert_close(a, b, rtol=rtol, atol=atol)


def assert_infos_close(got, want, keys=None, rtol=RTOL):
    assert len(got) == len(want) == cases.STEPS
    for g, w in zip(got, want):
        for key in keys or w:
            assert g[key] == pytest.approx(w[key], rel=rtol, abs=1e-12), key


@pytest.mark.slow
@pytest.mark.parametrize("name", list(cases.solvers()))
def test_two_ranks_take_the_one_process_steps_on_the_whole_batches(ranks, name):
    want = cases.run(name)  # no process group: one process, the whole batches
    got = [r[name] for r in ranks]
    # the ranks' variables are the same computation's result (each rank's all_reduce
    # returns the same bits), so they stay identical
    for key in ("outer", "inner"):
        for a, b in zip(bilevel.tree.leaves(got[0][key]), bilevel.tree.leaves(got[1][key])):
            assert torch.equal(a, b), (name, key)
    close(got[0]["outer"], want["outer"])
    if name in META:
        # each rank adapts its own tasks: together they are the one process's θ_T
        joined = {k: torch.cat([g["inner_solution"][k] for g in got]) for k in want["outer"]}
        close(joined, want["inner_solution"], rtol=1e-10 if name == "IMAML" else RTOL)
        # the upper loss is a mean over tasks; lower-level values are per-rank (docs)
        assert_infos_close(got[0]["info"], want["info"], ["upper_loss", "outer_grad_norm"],
                           rtol=1e-10 if name == "IMAML" else RTOL)
    else:
        close(got[0]["inner"], want["inner"])
        if want["inner_solution"] is not None:
            close(got[0]["inner_solution"], want["inner_solution"])
        assert_infos_close(got[0]["info"], want["info"])  # losses are full-batch means


@pytest.mark.slow
def test_the_example_gives_the_one_process_numbers(ranks):
    want = cases.example.run(steps=cases.STEPS)
    for r in ranks:
        close(r["checks"]["example"]["outer"], want["outer"])
        close(r["checks"]["example"]["inner"], want["inner"])


@pytest.mark.slow
def test_hypergrad_on_two_ranks_is_the_full_batch_hypergradient(ranks):
    want = cases.hypergrads(lambda b: b)
    for r in ranks:
        for name, (grads, info) in r["checks"]["hypergrad"].items():
            close(grads, want[name][0])
            for key, value in want[name][1].items():
                assert info[key] == pytest.approx(value, rel=RTOL, abs=1e-12), (name, key)


@pytest.mark.slow
def test_the_docs_script_gives_the_one_process_numbers(ranks, capsys):
    want = cases.docs_example()
    assert "1 rank(s)" in capsys.readouterr().out
    for r in ranks:
        close(r["checks"]["docs"]["alpha"], want["alpha"])
        assert r["checks"]["docs"]["info"]["upper_loss"] == pytest.approx(
            want["info"]["upper_loss"], rel=RTOL)


@pytest.mark.slow
def test_collectives_beside_the_solvers(ranks):
    for rank, r in enumerate(ranks):
        checks = r["checks"]
        assert checks["average"]["r"].item() == 0.5  # (0 + 1) / 2
        assert "5" in checks["shard_error"] and "equal shards" in checks["shard_error"]
        # a NaN in rank 1's g fails both ranks' step (none waits forever in a collective)
        assert "non-finite value" in checks["nan_error"]
        assert ("(nan)" in checks["nan_error"]) == (rank == 1)
        assert "different Indexed indices" in checks["saba_error"]
        assert checks["world_when_off"] == 1
        # distributed=False: each rank alone on its own shard
        want = cases.run("AID", lambda batch, r=rank: tuple(half(x, r) for x in batch))
        close(checks["alone"]["outer"], want["outer"])


@pytest.mark.slow
def test_fit_resumes_every_rank_from_rank_zeros_checkpoint(ranks):
    for r in ranks:
        close(r["resumed"]["outer"], r["BOME"]["outer"])
        close(r["resumed"]["inner"], r["BOME"]["inner"])
        assert len(r["resumed"]["info"]) == cases.STEPS


def test_without_a_process_group_data_parallelism_is_off_and_cannot_be_forced():
    assert bilevel.distributed.world_size() == 1 and not bilevel.distributed.is_data_parallel()
    batch = (torch.arange(5.0),)
    assert bilevel.distributed.shard(batch) is batch
    tree = {"a": torch.ones(2)}
    assert bilevel.distributed.average(tree)["a"] is tree["a"]
    with pytest.raises(RuntimeError, match="no torch.distributed process group"):
        with bilevel.distributed.data_parallel(True):
            pass
    outer, inner = cases._variables(False, 0)
    with pytest.raises(RuntimeError, match="init_process_group"):
        bilevel.fit(cases.PROBLEM, bilevel.BOME(1, 0.1), outer, inner, steps=1,
                    outer_optimizer=None, distributed=True, progress=False)
    with pytest.raises(TypeError, match="distributed must be None, True or False"):
        bilevel.fit(cases.PROBLEM, bilevel.BOME(1, 0.1), outer, inner, steps=1,
                    outer_optimizer=None, distributed="yes", progress=False)
