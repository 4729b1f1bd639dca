"""Two CPU processes (gloo) stay identical and agree with one process on the combined batch."""

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

STEPS = 3
PER_RANK = 2
METHODS = ("sft", "calm")  # a plain backward, and the bilevel solver's autograd.grad calls


def _examples():
    from apps.calm_llm.data import MCQAExample

    words = ["red", "blue", "green", "cold", "warm", "tall", "short", "fast", "slow", "soft"]
    return [
        MCQAExample(f"d{i}", f"Question {i}: which word fits {words[i % 10]}?",
                    tuple(words[(i + j) % 10] for j in range(4)), i % 4, "synthetic")
        for i in range(24)
    ]


def _train(method: str, dist, per_rank: int, out: str) -> None:
    from apps.calm_llm import config as C
    from apps.calm_llm import methods
    from apps.calm_llm.data import Collator
    from apps.calm_llm.methods.base import Context
    from apps.calm_llm.model import load

    torch.manual_seed(0)
    cfg = C.parse_args(["--config", "tiny", "--mode", "letter", "--batch-size", str(per_rank),
                        "--calib-batch-size", str(per_rank), "--steps", str(STEPS),
                        "--max-grad-norm", "0", "--inner-steps", "2"])
    lm = load(cfg.model, device=torch.device("cpu"), seed=0)
    col = Collator(lm.tokenizer, mode="letter", max_length=96, max_options=5)
    ex = _examples()
    ctx = Context(cfg=cfg, lm=lm, collator=col, train_examples=ex[:16], calib_examples=ex[16:],
                  train_collator=col, option_token_ids=col.option_token_ids, dist=dist)
    m = methods.get(method)(ctx)
    with lm.mode(True):
        for k in range(STEPS):
            m.step(k)
    state = {f"lora.{n}": t for n, t in lm.inner_state().items()}
    state.update({f"alpha.{n}": t.detach().clone() for n, t in m.outer_params().items()})
    save_file(state, out)


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    from apps.calm_llm import distributed

    d = distributed.init("gloo")
    try:
        for method in METHODS:
            _train(method, d, PER_RANK, os.path.join(out_dir, f"{method}-rank{rank}.safetensors"))
    finally:
        torch.distributed.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from apps.calm_llm.distributed import Dist

    out = tmp_path_factory.mktemp("ddp")
    mp.spawn(_worker, args=(2, _free_port(), str(out)), nprocs=2, join=True)
    for method in METHODS:
        _train(method, Dist(), 2 * PER_RANK, str(out / f"{method}-single.safetensors"))
    return out


@pytest.mark.parametrize("method", METHODS)
def test_two_ranks_match_one_process_on_the_combined_batch(method, runs):
    r0, r1 = (load_file(str(runs / f"{method}-rank{r}.safetensors")) for r in (0, 1))
    single = load_file(str(runs / f"{method}-single.safetensors"))
    assert r0.keys() == r1.keys() == single.keys()
    moved = 0.0
    for k in r0:
        torch.testing.assert_close(r0[k], r1[k], rtol=0, atol=0)  # ranks stay identical
        torch.testing.assert_close(r0[k], single[k], rtol=1e-4, atol=1e-5)
        if "lora_B" in k:
            moved += float(r0[k].abs().sum())
    assert moved > 0  # training did something (LoRA B starts at zero)
