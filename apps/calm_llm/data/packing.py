"""The packed training layout: a batch's sequences back to back in rows without padding.

A right-padded batch of S sequences of lengths n_1..n_S costs the model S·L positions, L the
longest; the default run's 24 SFT batches hold 144–194 real tokens in 176–312 positions. Packed,
the sequences sit back to back in R rows of at most ``width`` tokens (first-fit decreasing,
so R is small: any two rows together overflow ``width``; a row shorter than the widest
is padded at its end), each sequence its own segment of the
`schema.Packed` layout the shared-prefix scoring uses: positions restart at 0 for every
sequence and the block mask (`Packed.attention_mask`) lets a token see the earlier tokens of
its own sequence only (segment ids 1, 2, … in a row; no shared segment 0). The forward
(`model.CausalLM._packed_logits`) runs the decoder once over the rows and the output
projection only at the target positions, so the logits are (M, V) for the M target tokens,
in the batch's row-major order: every loss of `scoring` reads them as it reads a padded
batch's, and equals it up to floating-point rounding (tests/apps/test_train_packing.py).

This is variable-length attention as a block mask (the "packing with position ids" of
Krell et al. 2021, "Efficient sequence packing without cross-contamination"); its attention
costs heads·W² per row of width W ≤ ``width`` (the padded layout: heads·L² per sequence),
so ``width`` = the collator's ``max_length`` keeps it no larger than a padded row's.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from .schema import Batch, Packed


def pack_rows(lengths: list[int], width: int) -> list[list[int]]:
    """Sequence indices per row: first-fit decreasing into rows of at most ``width`` tokens
    (the longest sequences placed first, each into the first row it fits). O(S·R)."""
    if width < max(lengths):
        raise ValueError(f"pack width {width} is below the longest sequence ({max(lengths)} "
                         "tokens); pack with width >= max_length")
    rows: list[list[int]] = []
    free: list[int] = []
    for s in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = next((r for r, f in enumerate(free) if f >= lengths[s]), len(rows))
        if r == len(rows):
            rows.append([])
            free.append(width)
        rows[r].append(s)
        free[r] -= lengths[s]
    return rows


def pack_batch(batch: Batch, width: int, pad_id: int) -> Batch:
    """``batch`` with ``packed`` set to its sequences packed into rows of at most ``width``
    tokens (module docstring); its own (S, L) tensors are kept, they say which target each
    logit row is.

    Args:
        batch: a right-padded plain batch (cloze or instruction; no ``prefix``/``packed``).
        width: the most tokens in a row (>= the longest sequence; the collator's max_length).
        pad_id: the token id at the padding of the last positions of a row.
    Returns:
        the batch with ``packed``: (R, W) ids, positions and segment ids (-1 on padding), and
        ``target_index`` (S, L): ``r·W + t`` of each real position, -1 on padding.
    """
    if batch.mode == "letter" or batch.prefix is not None or batch.packed is not None:
        raise ValueError(f"only plain right-padded cloze or instruction batches are packed, got a "
                         f"{batch.mode} batch (prefix={batch.prefix is not None}, "
                         f"packed={batch.packed is not None})")
    mask = batch.attention_mask.bool()
    lengths = mask.sum(1).tolist()
    if not bool((mask == (torch.arange(mask.shape[1]) < mask.sum(1, keepdim=True))).all()):
        raise ValueError("pack_batch needs right-padded sequences (real tokens first in each row)")
    rows = pack_rows(lengths, width)
    W = max(sum(lengths[s] for s in row) for row in rows)
    input_ids = torch.full((len(rows), W), pad_id, dtype=torch.long)
    position_ids = torch.zeros((len(rows), W), dtype=torch.long)
    segment_ids = torch.full((len(rows), W), -1, dtype=torch.long)
    target_index = torch.full(tuple(batch.input_ids.shape), -1, dtype=torch.long)
    for r, row in enumerate(rows):
        col = 0
        for j, s in enumerate(row):
            n = lengths[s]
            input_ids[r, col:col + n] = batch.input_ids[s, :n]
            position_ids[r, col:col + n] = batch.position_ids[s, :n]
            segment_ids[r, col:col + n] = j + 1
            target_index[s, :n] = r * W + col + torch.arange(n)
            col += n
    return replace(batch, packed=Packed(input_ids=input_ids, position_ids=position_ids,
                                        segment_ids=segment_ids, target_index=target_index))
