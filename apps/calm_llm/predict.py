"""Predictions of a method: (N, K) option logits over a list of questions, batched by tokens."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import torch

from .data import budget_batches

if TYPE_CHECKING:
    from .methods.base import Context, Method


@torch.no_grad()
def predict_option_logits(
    ctx: Context, method: Method, examples: list, desc: str = ""
) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) option logits after the method's vocabulary transform, and the (N,) labels, in
    the order of ``examples``.

    Batches follow a token budget (``--eval-tokens``, longest questions first), so long
    questions do not pad short ones; in cloze mode each question's context is encoded once
    (``--share-prefix``).
    """
    from tqdm.auto import tqdm

    n = len(examples)
    out: torch.Tensor | None = None
    labels = torch.empty(n, dtype=torch.long)
    t = ctx.cfg.train
    batches = budget_batches(examples, ctx.collator, t.eval_tokens, max_examples=t.eval_batch_size)
    # no autograd graph: the LoRA tensors require grad, and prediction never differentiates
    with ctx.lm.mode(False), torch.no_grad(), tqdm(
        total=n, desc=f"predict {desc}", unit="q", leave=False, disable=not ctx.dist.main,
        file=sys.stderr,
    ) as bar:
        for idx, batch in batches:
            batch = batch.to(ctx.lm.device)
            logits, batch = ctx.forward(None, batch)
            ol = ctx.option_logits(method.vocab_transform(logits), batch).float().cpu()
            if out is None:
                out = torch.full((n, ol.shape[1]), float("-inf"))
            where = torch.tensor(idx, dtype=torch.long)
            out[where] = ol
            labels[where] = batch.labels.cpu()
            bar.update(len(idx))
    if out is None:
        raise ValueError(f"predict {desc}: no examples")
    return out, labels


def probabilities(method: Method, option_logits: torch.Tensor) -> torch.Tensor:
    """(N, K) answer probabilities: softmax of the method's option transform."""
    return torch.softmax(method.option_transform(option_logits), dim=-1)
