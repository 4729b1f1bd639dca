"""Cloze mode: each option's text log-likelihood after the question, one sequence per option.

The sequence of option j is the question's context followed by the option's continuation, the
continuation tokens being what ``tok(context + continuation)`` adds beyond ``tok(context)``
(lm-evaluation-harness' convention, Gao et al.). Batches are right-padded; ``options="gold"``
keeps the gold option's sequence alone (training: the loss falls on it only).

With ``share_prefix`` a batch of all options encodes each question's context once, in one of
two layouts (``prefix_layout``). "packed" (`schema.Packed`): one row per question, its context
followed by every option's continuation, run in a single forward under a block attention mask.
"cache" (`schema.Prefix`): the G prefixes and the S option continuations are right-padded, and
`model.CausalLM.logits` runs the continuations against the prefixes' KV cache. The sequences are
cut exactly as in the unshared layout (the last ``max_length`` input tokens of each option), so
both layouts score every option on the same tokens: a question none of whose options is cut
shares one prefix; one whose options are cut (each at its own place) gets one prefix per option.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .collate_base import IGNORE, CollatorBase
from .prompts import cloze_context, cloze_continuation
from .schema import Batch, MCQAExample, Packed, Prefix

PREFIX_LAYOUTS = ("packed", "cache")


class ClozeCollator(CollatorBase):
    """The cloze part of `collate.Collator` (a mixin: ``Collator`` sets ``share_prefix`` and
    ``prefix_layout``, which may be changed on an instance or a copy of it)."""

    share_prefix: bool
    prefix_layout: str

    def cloze_texts(self, ex: MCQAExample) -> tuple[str, list[str]]:
        """(context, continuations) for one question."""
        if self.prompt_style == "chat":
            return self._chat(ex.question), list(ex.options)
        return cloze_context(ex.question), [cloze_continuation(o) for o in ex.options]

    def cloze_sequences(self, ex: MCQAExample, options: str = "all") -> list[tuple[list[int], int]]:
        """(ids, continuation tokens) of every option, or of the gold one (``options="gold"``)."""
        context, conts = self.cloze_texts(ex)
        which = range(len(conts)) if options == "all" else [ex.label]
        return [self.continuation_ids(context, conts[j]) for j in which]

    def _cloze(self, examples: Sequence[MCQAExample], options: str) -> Batch:
        seqs, seq_q, seq_o, chars = [], [], [], []
        for qi, ex in enumerate(examples):
            _, conts = self.cloze_texts(ex)
            which = range(len(conts)) if options == "all" else [ex.label]
            seqs.extend(self.cloze_sequences(ex, options))
            for j in which:
                seq_q.append(qi)
                seq_o.append(j)
                chars.append(len(conts[j]))
        meta = dict(
            labels=[ex.label for ex in examples],
            n_options=[len(ex.options) for ex in examples],
            seq_question=seq_q,
            seq_option=seq_o,
            cont_chars=chars,
        )
        if self.share_prefix and options == "all":
            shared = self._shared_prefix(seqs, seq_q, **meta)
            if shared is not None:
                return shared
        return self._assemble("cloze", seqs, left_pad=False, **meta)

    def _shared_prefix(
        self, seqs: list[tuple[list[int], int]], seq_q: list[int], **meta: Any
    ) -> Batch | None:
        """The shared-prefix layout of cloze rows (module docstring); None where some row
        would keep no prefix at all (its answer fills the whole input): then the plain layout.
        """
        rows = [self._cut(ids, n) for ids, n in seqs]
        first = [next(t for t, y in enumerate(tgt) if y != IGNORE) for _, tgt, _ in rows]
        by_q: dict[int, list[int]] = {}
        for s, q in enumerate(seq_q):
            by_q.setdefault(q, []).append(s)
        prefixes: list[list[int]] = []
        row_group = [0] * len(rows)
        starts = [0] * len(rows)
        for members in by_q.values():
            c = min(first[s] for s in members)
            inps = [rows[s][0] for s in members]
            # one prefix per question when no option was cut (then all start with the context)
            if not any(rows[s][2] for s in members) and all(i[:c] == inps[0][:c] for i in inps):
                groups = [(members, c)]
            else:
                groups = [([s], first[s]) for s in members]
            for ss, cut in groups:
                if cut < 1:
                    return None
                for s in ss:
                    row_group[s], starts[s] = len(prefixes), cut
                prefixes.append(rows[ss[0]][0][:cut])
        conts = [(inp[c:], tgt[c:]) for (inp, tgt, _), c in zip(rows, starts)]
        ids, tgt, mask, _ = self._pad(conts, left_pad=False)
        # continuation positions go on from where the row's own prefix stopped
        pos = torch.tensor(starts, dtype=torch.long)[:, None] + (mask.cumsum(1) - 1).clamp(min=0)
        if self.prefix_layout == "packed":
            packed = self._packed(prefixes, row_group, [c for c, _ in conts], starts, ids.shape[1])
            return self._batch("cloze", ids, mask, pos, tgt, packed=packed, **meta)
        # right-padded like the continuations: a pad position then still sees real tokens, so no
        # attention row is fully masked (eager attention in float64 turns such rows into NaN,
        # which a zero attention weight does not cancel: 0 · NaN = NaN)
        pre_ids, _, pre_mask, pre_pos = self._pad([(p, p) for p in prefixes], left_pad=False)
        prefix = Prefix(input_ids=pre_ids, attention_mask=pre_mask, position_ids=pre_pos,
                        row_group=torch.tensor(row_group, dtype=torch.long))
        return self._batch("cloze", ids, mask, pos, tgt, prefix=prefix, **meta)

    def _packed(
        self, prefixes: list[list[int]], row_group: list[int], conts: list[list[int]],
        starts: list[int], width: int,
    ) -> Packed:
        """`schema.Packed` rows: prefix g, then the continuations of the rows s with
        ``row_group[s] == g`` in order; ``width`` is C, the continuation layout's width."""
        ids = [list(p) for p in prefixes]
        pos = [list(range(len(p))) for p in prefixes]
        seg = [[0] * len(p) for p in prefixes]
        where: list[tuple[int, int]] = []  # (packed row, column of the continuation's first token)
        for s, (g, cont) in enumerate(zip(row_group, conts)):
            where.append((g, len(ids[g])))
            ids[g] += cont
            pos[g] += range(starts[s], starts[s] + len(cont))
            seg[g] += [max(seg[g]) + 1] * len(cont)
        W = max(len(r) for r in ids)
        input_ids = torch.full((len(ids), W), self.pad_id, dtype=torch.long)
        position_ids = torch.zeros((len(ids), W), dtype=torch.long)
        segment_ids = torch.full((len(ids), W), -1, dtype=torch.long)
        for r in range(len(ids)):
            n = len(ids[r])
            input_ids[r, :n] = torch.tensor(ids[r], dtype=torch.long)
            position_ids[r, :n] = torch.tensor(pos[r], dtype=torch.long)
            segment_ids[r, :n] = torch.tensor(seg[r], dtype=torch.long)
        target_index = torch.full((len(conts), width), -1, dtype=torch.long)
        for s, ((g, col), cont) in enumerate(zip(where, conts)):
            target_index[s, : len(cont)] = g * W + col + torch.arange(len(cont))
        return Packed(input_ids=input_ids, position_ids=position_ids, segment_ids=segment_ids,
                      target_index=target_index)
