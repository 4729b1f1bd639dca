"""Two CPU processes (gloo) stay identical and agree with one process on the combined batch.

Both data-parallel modes: DDP (whole model per rank) and FSDP (frozen base weights sharded with
FSDP2, LoRA replicated; run with gradient checkpointing on, which recomputes blocks under FSDP).
"""

import dataclasses
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

STEPS = 3
PER_RANK = 2
METHODS = ("sft", "calm")  # a plain backward, and the bilevel solver's autograd.grad calls
# The FSDP runs also recompute activations (checkpointed blocks re-gather their weights). Their
# reference is a single process with the same flag: checkpointing alone moves CALM's α by
# rounding (BOME's ∇q̂ is a difference of two nearly equal gradients, and Adam scales the tiny
# vocabulary-α gradients up to full steps), so only like may be compared with like.
FSDP_FLAGS = ("--gradient-checkpointing",)


def _examples():
    from apps.calm_llm.data import MCQAExample

    words = ["red", "blue", "green", "cold", "warm", "tall", "short", "fast", "slow", "soft"]
    return [
        MCQAExample(f"d{i}", f"Question {i}: which word fits {words[i % 10]}?",
                    tuple(words[(i + j) % 10] for j in range(4)), i % 4, "synthetic")
        for i in range(24)
    ]


def _train(method: str, dist, per_rank: int, out: str, extra: tuple[str, ...] = ()) -> None:
    from apps.calm_llm import config as C
    from apps.calm_llm import methods
    from apps.calm_llm.data import Collator
    from apps.calm_llm.methods.base import Context
    from apps.calm_llm.model import load

    torch.manual_seed(0)
    cfg = C.parse_args(["--config", "tiny", "--mode", "letter", "--batch-size", str(per_rank),
                        "--calib-batch-size", str(per_rank), "--steps", str(STEPS),
                        "--max-grad-norm", "0", "--inner-steps", "2", *extra])
    lm = load(cfg.model, device=torch.device("cpu"), seed=0, dist=dist)
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
    if dist.fsdp:
        _fsdp_facts(lm, m, dist, state, out)
    save_file(state, out)


def _predict_cloze(dist, out: str) -> None:
    """Shared-prefix cloze predictions under this process layout: under FSDP the cache layout
    (two forwards; every block's weights are gathered for each of the two calls)."""
    from apps.calm_llm import config as C
    from apps.calm_llm import methods
    from apps.calm_llm.data import Collator
    from apps.calm_llm.methods.base import Context
    from apps.calm_llm.model import load
    from apps.calm_llm.predict import predict_option_logits

    cfg = C.parse_args(["--config", "tiny", "--mode", "cloze"])
    lm = load(cfg.model, device=torch.device("cpu"), seed=0, dist=dist)
    # the layout the runner picks: packed in one process, the KV cache under FSDP
    col = Collator(lm.tokenizer, mode="cloze", max_length=96, max_options=5, share_prefix=True,
                   prefix_layout=lm.prefix_layout)
    ex = _examples()
    ctx = Context(cfg=cfg, lm=lm, collator=col, train_examples=ex[:4], calib_examples=ex[4:8],
                  train_collator=col, option_token_ids=None, dist=dist)
    ol, _ = predict_option_logits(ctx, methods.get("none")(ctx), ex[:12])
    save_file({"option_logits": ol.contiguous()}, out)


def _fsdp_facts(lm, method, dist, state: dict, out: str) -> None:
    """Record how much of the frozen base this rank holds, and export on rank 0 alone."""
    from torch.distributed.tensor import DTensor

    from apps.calm_llm.export import export_method

    local = total = 0
    for p in lm.model.parameters():
        if not p.requires_grad:
            assert isinstance(p, DTensor), "a frozen base weight was left unsharded"
            local += p.to_local().numel()
            total += p.numel()
        else:
            assert not isinstance(p, DTensor), "a LoRA tensor was sharded"
    state["meta.base_fraction_held"] = torch.tensor([local / total], dtype=torch.float64)
    if dist.main:  # only rank 0 writes exports in the runner: must not need the other ranks
        export_method(out + ".export", lm, method)
    dist.barrier()


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    from apps.calm_llm import distributed

    d = distributed.init("gloo")
    try:
        for method in METHODS:
            _train(method, d, PER_RANK, os.path.join(out_dir, f"{method}-rank{rank}.safetensors"))
        _probe_identity_check(d, out_dir)
        fsdp = dataclasses.replace(d, fsdp=True)
        for method in METHODS:
            _train(method, fsdp, PER_RANK,
                   os.path.join(out_dir, f"{method}-fsdp-rank{rank}.safetensors"), FSDP_FLAGS)
        _predict_cloze(fsdp, os.path.join(out_dir, f"cloze-fsdp-rank{rank}.safetensors"))
    finally:
        torch.distributed.destroy_process_group()


def _probe_identity_check(d, out_dir: str) -> None:
    """Equal tensors pass `check_identical`; one element off on one rank raises on every rank."""
    same = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.ones(4)}
    d.check_identical(same, "probe")
    drift = {"a": same["a"].clone(), "b": same["b"].clone()}
    drift["b"][2] += 1e-6 * d.rank
    try:
        d.check_identical(drift, "probe")
        outcome = "passed"
    except RuntimeError as e:
        outcome = str(e)
    with open(os.path.join(out_dir, f"probe-rank{d.rank}.txt"), "w") as f:
        f.write(outcome)


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
        _train(method, Dist(), 2 * PER_RANK, str(out / f"{method}-fsdp-single.safetensors"),
               FSDP_FLAGS)
    _predict_cloze(Dist(), str(out / "cloze-single.safetensors"))
    return out


@pytest.mark.slow
def test_shared_prefix_prediction_under_fsdp_equals_one_process(runs):
    want = load_file(str(runs / "cloze-single.safetensors"))["option_logits"]
    assert torch.isfinite(want).any()
    for rank in range(2):
        got = load_file(str(runs / f"cloze-fsdp-rank{rank}.safetensors"))["option_logits"]
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
@pytest.mark.parametrize("method", METHODS)
def test_two_ranks_match_one_process_on_the_combined_batch(method, mode, runs):
    tag = "" if mode == "ddp" else "-fsdp"
    r0, r1 = (load_file(str(runs / f"{method}{tag}-rank{r}.safetensors")) for r in (0, 1))
    single = load_file(str(runs / f"{method}{tag}-single.safetensors"))
    if mode == "fsdp":
        for r in (r0, r1):  # each rank holds half of the frozen base (the tiny dims are even)
            assert float(r.pop("meta.base_fraction_held")) == pytest.approx(0.5, abs=0.01)
    assert r0.keys() == r1.keys() == single.keys()
    moved = 0.0
    for k in r0:
        torch.testing.assert_close(r0[k], r1[k], rtol=0, atol=0)  # ranks stay identical
        torch.testing.assert_close(r0[k], single[k], rtol=1e-4, atol=1e-5)
        if "lora_B" in k:
            moved += float(r0[k].abs().sum())
    assert moved > 0  # training did something (LoRA B starts at zero)


@pytest.mark.parametrize("method", METHODS)
def test_fsdp_export_on_rank_zero_alone_holds_the_trained_adapter(method, runs):
    from peft import load_peft_weights

    r0 = load_file(str(runs / f"{method}-fsdp-rank0.safetensors"))
    exported = load_peft_weights(str(runs / f"{method}-fsdp-rank0.safetensors.export"))
    lora = {k[len("lora."):]: v for k, v in r0.items() if k.startswith("lora.")}
    assert len(exported) == len(lora) > 0
    for k, v in exported.items():  # peft drops the adapter name ("default") from the keys
        match = [t for n, t in lora.items() if n.replace(".default", "") == k]
        assert len(match) == 1, k
        torch.testing.assert_close(v, match[0], rtol=0, atol=0)


def test_drifted_ranks_are_caught_on_every_rank(runs):
    for r in (0, 1):
        msg = (runs / f"probe-rank{r}.txt").read_text()
        assert "probe: the 2 ranks hold different values of 1 tensor(s), e.g. ['b']" in msg
