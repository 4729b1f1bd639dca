"""Shared-prefix cloze scoring equals the unshared layout: scores, gradients, batching, edges.

Both shared-prefix layouts are checked: "packed" (one row per question under a block mask)
and "cache" (prefixes first, continuations against their KV cache). The oracle is the plain layout (every option repeats its question; itself checked against
per-sequence unpadded forwards in test_scoring.py), in float64 on the tiny model, with LoRA
moved off its zero initialization and with α applied.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from apps.calm_llm import config as C
from apps.calm_llm import methods, scoring
from apps.calm_llm.data import Collator, MCQAExample, budget_batches
from apps.calm_llm.methods.base import Context
from apps.calm_llm.model import load
from apps.calm_llm.predict import predict_option_logits

WORDS = ["red", "blue", "green", "cold", "warm", "tall", "short", "fast", "slow", "soft"]
# questions of very different lengths, 2-5 options, one option much longer than the others
EXAMPLES = [
    MCQAExample(f"s{i}", f"Question {i}: " + "which word fits the clue? " * (1 + i % 4),
                tuple(WORDS[(i + j) % 10] + (" and a much longer tail" if j == 1 else "")
                      for j in range(2 + i % 4)), i % 2, "synthetic")
    for i in range(12)
]


LAYOUTS = ["packed", "cache"]


def _ctx(*extra: str, max_length: int = 96, share: bool = True, layout: str = "packed") -> Context:
    cfg = C.parse_args(["--config", "tiny", "--mode", "cloze", "--steps", "2", *extra])
    lm = load(cfg.model, device=torch.device("cpu"), seed=0)
    lm.model.double()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # LoRA B = 0 at init would make the adapters invisible
        for n, p in lm.inner().items():
            if "lora_B" in n:
                p.copy_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    col = Collator(lm.tokenizer, mode="cloze", max_length=max_length, max_options=5,
                   share_prefix=share, prefix_layout=layout)
    return Context(cfg=cfg, lm=lm, collator=col, train_examples=EXAMPLES[:8],
                   calib_examples=EXAMPLES[8:], train_collator=col, option_token_ids=None)


def _plain(col: Collator) -> Collator:
    c = copy.copy(col)
    c.share_prefix = False
    return c


@pytest.fixture(scope="module")
def ctx():
    return _ctx()


def test_layout_shares_one_prefix_per_question(ctx):
    col = copy.copy(ctx.collator)
    col.prefix_layout = "cache"
    b = col(EXAMPLES[:3])
    assert b.prefix is not None and b.prefix.n_groups == 3 and b.packed is None
    assert b.prefix.row_group.tolist() == [0, 0, 1, 1, 1, 2, 2, 2, 2]
    plain = _plain(ctx.collator)(EXAMPLES[:3])
    assert b.n_tokens < plain.n_tokens
    # gold-only (training CE) batches have one row per question: nothing to share
    assert ctx.collator(EXAMPLES[:3], options="gold").prefix is None
    assert ctx.collator(EXAMPLES[:3], options="gold").packed is None


def test_packed_rows_hold_the_prefix_once_then_every_option():
    c = _ctx()
    ex = EXAMPLES[:3]
    b, cache = c.collator(ex), copy.copy(c.collator)
    cache.prefix_layout = "cache"
    bc = cache(ex)
    pk = b.packed
    assert b.prefix is None and pk.input_ids.shape[0] == 3
    assert b.n_tokens == pk.input_ids.numel() < bc.n_tokens  # no padding between options
    W = pk.input_ids.shape[1]
    for r in range(3):
        seg, ids, pos = pk.segment_ids[r], pk.input_ids[r], pk.position_ids[r]
        P = int(bc.prefix.attention_mask[r].sum())
        assert ids[:P].tolist() == bc.prefix.input_ids[r, :P].tolist() and (seg[:P] == 0).all()
        rows = (bc.prefix.row_group == r).nonzero().flatten().tolist()
        assert int(seg.max()) == len(rows)
        for j, s in enumerate(rows):  # segment j + 1 is continuation s, at positions P, P + 1, ...
            n = int(bc.attention_mask[s].sum())
            at = pk.target_index[s, :n]
            assert (at // W == r).all() and (seg[at % W] == j + 1).all()
            assert ids[at % W].tolist() == bc.input_ids[s, :n].tolist()
            assert pos[at % W].tolist() == list(range(P, P + n))
            assert (pk.target_index[s, n:] == -1).all()
    m = pk.attention_mask(torch.float32)
    assert m.shape == (3, 1, W, W)
    allowed = m[:, 0] == 0
    assert allowed.any(-1).all()  # no fully masked row (padding sees itself)
    sq, sk = pk.segment_ids[:, :, None], pk.segment_ids[:, None, :]
    cross = (sq > 0) & (sk > 0) & (sq != sk)
    assert not (allowed & cross).any()  # an option never sees another option


def test_prefix_layout_follows_the_attention_kernel(ctx):
    assert ctx.lm.prefix_layout == "packed"  # SDPA takes the block mask
    base = ctx.lm.model.get_base_model()
    was = base.config._attn_implementation
    try:
        base.config._attn_implementation = "flash_attention_2"  # no custom 4D masks there
        assert ctx.lm.prefix_layout == "cache"
    finally:
        base.config._attn_implementation = was


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("max_length", [96, 12])
@pytest.mark.parametrize("norm", ["sum", "mean", "char"])
def test_option_scores_equal_the_plain_layout(max_length, norm, layout):
    c = _ctx(max_length=max_length, layout=layout)
    shared = c.collator(EXAMPLES)
    if max_length == 12:  # options cut at their own place: one prefix per option there
        assert shared.padded_terms()[0][0] > len(EXAMPLES)
    plain = _plain(c.collator)(EXAMPLES)
    with torch.no_grad():
        got = scoring.option_logits(c.lm.logits(None, shared), shared, cloze_norm=norm)
        want = scoring.option_logits(c.lm.logits(None, plain), plain, cloze_norm=norm)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_prediction_with_alpha_in_original_order_under_any_budget(layout):
    ctx = _ctx(layout=layout)
    calm = methods.get("calm")(ctx)
    with torch.no_grad():
        for t in calm.alpha.params.values():
            t.add_(0.1 * torch.randn_like(t))
    plain_ctx = dataclasses.replace(ctx, collator=_plain(ctx.collator))
    want, y = predict_option_logits(plain_ctx, calm, EXAMPLES)
    for budget in (1, 64, 10_000):
        cfg = dataclasses.replace(ctx.cfg, train=dataclasses.replace(ctx.cfg.train, eval_tokens=budget))
        got, y2 = predict_option_logits(dataclasses.replace(ctx, cfg=cfg), calm, EXAMPLES)
        assert torch.equal(y2, y) and y.tolist() == [ex.label for ex in EXAMPLES]
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)  # predictions are float32


def _upper_and_grads(c: Context, calm, batch):
    inner = {n: p.detach().clone().requires_grad_(True) for n, p in c.lm.inner().items()}
    outer = {n: a.detach().clone().requires_grad_(True) for n, a in calm.alpha.params.items()}
    f = calm.obj.upper(outer, inner, batch)
    grads = torch.autograd.grad(f, [*inner.values(), *outer.values()])
    return f, grads


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("objective", ["options", "answer_tokens"])
def test_training_forward_gradients_equal_the_plain_layout(objective, layout):
    c = _ctx("--upper-objective", objective, max_length=20, layout=layout)  # some options cut
    calm = methods.get("calm")(c)
    with torch.no_grad():
        for t in calm.alpha.params.values():
            t.add_(0.1 * torch.randn_like(t))
    with c.lm.mode(True):
        f1, g1 = _upper_and_grads(c, calm, c.collator(EXAMPLES[:6]))
        f2, g2 = _upper_and_grads(c, calm, _plain(c.collator)(EXAMPLES[:6]))
    torch.testing.assert_close(f1, f2, atol=1e-10, rtol=1e-10)
    assert any(float(g.abs().max()) > 0 for g in g1)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-7)


@pytest.mark.slow
@pytest.mark.parametrize("solver", ["itd", "aid"])
def test_second_order_solvers_differentiate_through_the_shared_prefix(solver):
    """ITD/AID take gradients of gradients through either layout (eager attention)."""
    outs = []
    for share, layout in ((True, "packed"), (True, "cache"), (False, "packed")):
        cfg = C.parse_args(["--config", "tiny", "--mode", "cloze", "--solver", solver,
                            "--inner-steps", "1"])
        lm = load(cfg.model, device=torch.device("cpu"), seed=0, eager=True)
        lm.model.double()
        col = Collator(lm.tokenizer, mode="cloze", max_length=96, share_prefix=share,
                       prefix_layout=layout)
        c = Context(cfg=cfg, lm=lm, collator=col, train_examples=EXAMPLES[:8],
                    calib_examples=EXAMPLES[8:], train_collator=col, option_token_ids=None)
        calm = methods.get("calm")(c)
        inner = {n: p.detach() for n, p in lm.inner().items()}
        outer = {n: a.detach() for n, a in calm.alpha.params.items()}
        res = calm.solver.step(calm.problem, outer, inner, upper_batch=col(EXAMPLES[8:]),
                               lower_batch=col(EXAMPLES[:4], options="gold"))
        outs.append(res)
    for got in outs[:2]:
        for name in outs[-1].outer_grad:
            torch.testing.assert_close(got.outer_grad[name], outs[-1].outer_grad[name],
                                       atol=1e-9, rtol=1e-6)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_rcft_step_equal_under_both_layouts(layout):
    losses, states = [], []
    for share in (True, False):
        c = _ctx(share=share, layout=layout)
        m = methods.get("rcft")(c)
        m.predict = lambda ex, _c=c, _m=m: predict_option_logits(_c, _m, ex)
        losses.append(m.step(0)["loss"])
        states.append(c.lm.inner_state())
    assert losses[0] == pytest.approx(losses[1], rel=1e-9)
    for n in states[0]:
        torch.testing.assert_close(states[0][n], states[1][n], atol=1e-9, rtol=1e-7)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_budget_batches_cover_every_example_once_longest_first(ctx, layout):
    col = copy.copy(ctx.collator)
    col.prefix_layout = layout
    for budget in (1, 50, 200, 10_000):
        seen, prev_len = [], None
        for idx, b in budget_batches(EXAMPLES, col, budget):
            seen += idx
            size = b.n_tokens
            assert len(idx) == 1 or size <= budget
            first = len(col.cloze_texts(EXAMPLES[idx[0]])[0])
            assert prev_len is None or first <= prev_len + 40  # roughly longest first
            prev_len = first
        assert sorted(seen) == list(range(len(EXAMPLES)))
    caps = [len(i) for i, _ in budget_batches(EXAMPLES, col, 10_000, max_examples=5)]
    assert caps == [5, 5, 2]
    with pytest.raises(ValueError, match="max_tokens"):
        next(budget_batches(EXAMPLES, col, 0))


def test_gradient_checkpointing_trains_the_cache_layout_unshared():
    c = _ctx("--gradient-checkpointing", layout="cache")
    c.lm.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    batch = c.collator(EXAMPLES[:3])
    with c.lm.mode(True), pytest.raises(ValueError, match="gradient checkpointing"):
        c.lm.logits(c.lm.inner(), batch)
    assert c.stream("calib").next().prefix is None  # the runner's streams fall back
    with torch.no_grad():  # evaluation keeps the cache (nothing is checkpointed without grad)
        c.lm.logits(None, batch)


def test_gradient_checkpointing_trains_the_packed_layout_shared():
    """The packed layout is one forward: checkpointed, it gives the unshared gradients."""
    c = _ctx("--gradient-checkpointing")
    assert c.stream("calib").next().packed is not None  # the runner keeps it shared
    packed, plain = c.collator(EXAMPLES[:4]), _plain(c.collator)(EXAMPLES[:4])

    def grads(batch) -> list[torch.Tensor]:
        inner = c.lm.inner()
        with c.lm.mode(True):
            f = scoring.option_logits(c.lm.logits(inner, batch), batch).logsumexp(-1).sum()
        return list(torch.autograd.grad(f, list(inner.values())))

    want = grads(plain)
    c.lm.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    # the two layouts run different SDPA kernels (explicit mask vs is_causal), whose float64
    # gradients agree to ~1e-7 of the largest entry here (eager vs SDPA on one layout differ as
    # much); the forwards agree to the last digit
    for a, b in zip(grads(packed), want):
        torch.testing.assert_close(a, b, atol=1e-6 * float(b.abs().max()), rtol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("shift", [0.0, 0.05])
def test_checkpointing_gives_the_gradient_at_the_parameters_passed(shift):
    """A checkpointed layer recomputes in the backward, after functional_call restored the
    live LoRA tensors: at other parameters (BOME's inner iterates, a detached θ) the call must
    run unchecked, or the gradient is taken at the live θ (or the recompute fails)."""
    c = _ctx()
    batch = _plain(c.collator)(EXAMPLES[:4])

    def grads(checkpointing: bool) -> dict[str, torch.Tensor]:
        if checkpointing:
            c.lm.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            c.lm.model.gradient_checkpointing_disable()
        inner = {n: (p.detach() + shift).requires_grad_() for n, p in c.lm.inner().items()}
        with c.lm.mode(True):
            loss = c.lm.logits(inner, batch).logsumexp(-1).mean()
        return dict(zip(inner, torch.autograd.grad(loss, list(inner.values()))))

    plain, checked = grads(False), grads(True)
    assert c.lm._checkpointing()  # still on after the call
    for n in plain:
        torch.testing.assert_close(checked[n], plain[n], rtol=1e-10, atol=1e-12)


def test_bf16_scores_close_to_fp32():
    cfg = C.parse_args(["--config", "tiny", "--mode", "cloze", "--dtype", "bf16"])
    lm16 = load(cfg.model, device=torch.device("cpu"), seed=0)
    lm32 = load(dataclasses.replace(cfg.model, dtype="fp32"), device=torch.device("cpu"), seed=0)
    col = Collator(lm16.tokenizer, mode="cloze", max_length=96, share_prefix=True)
    b = col(EXAMPLES)
    with torch.no_grad():
        s16 = scoring.option_logits(lm16.logits(None, b), b)
        s32 = scoring.option_logits(lm32.logits(None, b), b)
    assert s16.dtype == torch.float32  # logits are upcast before the log-softmax
    fin = torch.isfinite(s32)
    assert torch.equal(fin, torch.isfinite(s16))
    assert float((s16[fin] - s32[fin]).abs().max()) < 0.5


def test_prefix_layout_keeps_the_cache_where_the_block_mask_would_be_ignored():
    """Sliding windows, chunked attention and non-attention layers ignore or break a custom
    mask; a head the packed forward does not reproduce fails the probe: all use the cache."""
    c = _ctx()
    cfg = c.lm.model.get_base_model().config
    for name, value in (("sliding_window", 4096), ("attention_chunk_size", 8192),
                        ("layer_types", ["full_attention", "linear_attention"])):
        was = getattr(cfg, name, None)
        setattr(cfg, name, value)
        try:
            assert c.lm.prefix_layout == "cache", name
        finally:
            setattr(cfg, name, was)
    assert c.lm.prefix_layout == "packed"
    c2 = _ctx()  # a fresh model: the probe runs once per model
    # the packed forward applies soft-capping, this Llama head does not: the probe disagrees
    c2.lm.model.get_base_model().config.final_logit_softcapping = 1.0
    assert not c2.lm._packed_agrees and c2.lm.prefix_layout == "cache"
    with pytest.raises(ValueError, match="cache"):
        with torch.no_grad():
            c2.lm.logits(None, c2.collator(EXAMPLES[:2]))


def test_budget_batches_never_mix_a_plain_fallback_into_a_shared_batch():
    """A question whose answer fills max_length has no prefix and makes its batch plain: it is
    batched with its own kind only, so every batch keeps to the budget."""
    long_answer = MCQAExample("long", "Q?", ("short", "one two three four five six seven eight "
                                             "nine ten eleven twelve"), 0, "synthetic")
    for layout in LAYOUTS:
        c = _ctx(max_length=12, layout=layout)
        assert c.collator([long_answer]).prefix is None and c.collator([long_answer]).packed is None
        examples = [long_answer, *EXAMPLES]
        budget = 60
        seen = []
        for idx, b in budget_batches(examples, c.collator, budget):
            seen += idx
            assert len(idx) == 1 or b.n_tokens <= budget, (layout, idx, b.n_tokens)
            if 0 in idx:
                assert idx == [0] or all(
                    c.collator([examples[i]]).packed is None
                    and c.collator([examples[i]]).prefix is None for i in idx)
        assert sorted(seen) == list(range(len(examples)))
