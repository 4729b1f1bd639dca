"""Tokenization and padding: examples -> `Batch` for the letter, cloze and instruction modes.

Every sequence is built the same way: the full token list ``ids`` (prompt followed by the
answer tokens) and the number ``n_ans`` of trailing answer tokens. The model input is
``ids[:-1]`` and the target at position t is ``ids[t + 1]`` (already shifted), kept only for
the answer tokens. Letter batches are LEFT-padded so the answer position is the last column
(a model may then be called with ``logits_to_keep=1``); cloze and instruction batches are
right-padded. Positions are ``cumsum(attention_mask) - 1`` so that padding never shifts them.

With ``share_prefix`` a cloze batch of all options encodes each question's context once, in one
of two layouts (``prefix_layout``). "packed" (`schema.Packed`): one row per question, its context
followed by every option's continuation, run in a single forward under a block attention mask.
"cache" (`schema.Prefix`): the G prefixes and the S option continuations are right-padded, and
`model.CausalLM.logits` runs the continuations against the prefixes' KV cache. The sequences are
cut exactly as in the unshared layout (the last ``max_length`` input tokens of each option), so
both layouts score every option on the same tokens: a question none of whose options is cut
shares one prefix; one whose options are cut (each at its own place) gets one prefix per option.

`budget_batches` groups examples by a token budget, longest first, instead of by count.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from ...errors import ConfigError, DataError
from .prompts import (
    LETTERS,
    alpaca_prompt,
    cloze_context,
    cloze_continuation,
    letter_body,
    letter_prompt,
)
from .schema import Batch, InstructionExample, MCQAExample, Packed, Prefix

IGNORE = -100
MODES = ("letter", "cloze")
PREFIX_LAYOUTS = ("packed", "cache")
PROMPT_STYLES = ("paper", "chat")


class Collator:
    """Turns a list of examples into a `Batch` for one forward pass.

    Args:
        tokenizer: a Hugging Face tokenizer (fast or slow).
        mode: "letter" (the papers' answer-letter scoring) or "cloze" (each option's text
            log-likelihood). Instruction examples are always collated as instruction batches.
        prompt_style: "paper" (the CFT paper's prompt, docs/data.md "Prompts and batches") or "chat" (``tokenizer.apply_chat_template``
            around the same question; needs a tokenizer with a chat template).
        max_length: cap on the model input length; longer prompts lose their *left* part (the
            answer tokens are always kept).
        max_options: K, the number of option slots; questions with more options are an error.
        letter_prefix: text placed between "### Answer:" and the letter. Default " " for the
            paper style (the letter as this text is written, "Answer: A", and the convention
            under which the default model was measured, docs/data.md) and "" for the chat
            style (after a generation prompt the bare letter is what the model emits). The
            letter token is what ``tok(prompt + prefix + letter)`` adds beyond
            ``tok(prompt)``; it must be exactly one token.
        share_prefix: cloze batches of all options (``options="all"``) encode each question's
            context once (in ``prefix_layout``); off, every option repeats it (the plain layout that
            a single Hugging Face forward consumes).
        prefix_layout: how a shared prefix is laid out: "packed" (one row per question under a
            block mask: no padding between options and no KV-cache copies; needs an attention
            kernel that takes a custom mask, SDPA or eager) or "cache" (prefixes run first, the
            continuations against their gathered KV cache; any attention kernel).
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        mode: str,
        prompt_style: str = "paper",
        max_length: int = 512,
        max_options: int = 5,
        letter_prefix: str | None = None,
        share_prefix: bool = False,
        prefix_layout: str = "packed",
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if prompt_style not in PROMPT_STYLES:
            raise ValueError(f"prompt_style must be one of {PROMPT_STYLES}, got {prompt_style!r}")
        if not 2 <= max_options <= len(LETTERS):
            raise ValueError(f"max_options must be in 2..{len(LETTERS)}, got {max_options}")
        if max_length < 2:
            raise ValueError(f"max_length must be >= 2, got {max_length}")
        if prefix_layout not in PREFIX_LAYOUTS:
            raise ValueError(f"prefix_layout must be one of {PREFIX_LAYOUTS}, got {prefix_layout!r}")
        if prompt_style == "chat" and not getattr(tokenizer, "chat_template", None):
            raise ConfigError(
                "prompt_style='chat' needs a tokenizer with a chat template; this one has none "
                "(use prompt_style='paper')"
            )
        self.tokenizer = tokenizer
        self.mode = mode
        self.prompt_style = prompt_style
        self.max_length = max_length
        self.max_options = max_options
        self.letter_prefix = (" " if prompt_style == "paper" else "") if letter_prefix is None else letter_prefix
        self.share_prefix = bool(share_prefix)
        self.prefix_layout = prefix_layout
        self._encoded: dict[tuple[str, str], tuple[list[int], int]] = {}
        self.pad_id = _pad_id(tokenizer)
        self.eos_id = tokenizer.eos_token_id
        self._lead = _leading_special_ids(tokenizer)
        self.option_token_ids = self._letter_ids()

    # ---- text -> ids -------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` with the tokenizer's leading special tokens (BOS) and no
        trailing ones, so that prefixes of the text give prefixes of the ids."""
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if self._lead and ids[: len(self._lead)] == self._lead:
            return list(ids)  # a chat template already wrote the BOS
        return self._lead + list(ids)

    def _chat(self, user: str) -> str:
        return self.tokenizer.apply_chat_template(
            [{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True
        )

    def letter_prompt_text(self, ex: MCQAExample) -> str:
        """The prompt up to (not including) ``letter_prefix`` and the letter."""
        if self.prompt_style == "chat":
            return self._chat(letter_body(ex.question, ex.options))
        return letter_prompt(ex.question, ex.options)

    def cloze_texts(self, ex: MCQAExample) -> tuple[str, list[str]]:
        """(context, continuations) for one question."""
        if self.prompt_style == "chat":
            return self._chat(ex.question), list(ex.options)
        return cloze_context(ex.question), [cloze_continuation(o) for o in ex.options]

    def instruction_texts(self, ex: InstructionExample) -> tuple[str, str]:
        if self.prompt_style == "chat":
            user = ex.instruction if not ex.input.strip() else f"{ex.instruction}\n\n{ex.input}"
            return self._chat(user), ex.output
        return alpaca_prompt(ex.instruction, ex.input), ex.output

    def continuation_ids(self, context: str, continuation: str) -> tuple[list[int], int]:
        """(ids of context+continuation, number of trailing tokens that the continuation adds).

        The continuation tokens are what ``tok(ctx + cont)`` adds beyond ``tok(ctx)``; where
        a merge crosses the boundary the shared prefix decides (lm-eval-harness convention).
        Memoized: evaluation collates the same questions once per method.
        """
        key = (context, continuation)
        if key in self._encoded:
            full, n_cont = self._encoded[key]
            return list(full), n_cont
        if len(self._encoded) >= 200_000:  # bound the memo on endless instruction streams
            self._encoded.clear()
        ctx = self.encode(context)
        full = self.encode(context + continuation)
        common = 0
        for a, b in zip(ctx, full):
            if a != b:
                break
            common += 1
        n_cont = len(full) - common
        if n_cont < 1:
            raise ValueError(f"continuation {continuation!r} adds no tokens after {context[-40:]!r}")
        self._encoded[key] = (full, n_cont)
        return list(full), n_cont

    def _letter_ids(self) -> torch.Tensor:
        ref = MCQAExample("ref", "q", tuple("ab"), 0, "ref")
        prompt = self.letter_prompt_text(ref)
        base = self.encode(prompt)
        ids = []
        for letter in LETTERS[: self.max_options]:
            full = self.encode(prompt + self.letter_prefix + letter)
            if len(full) != len(base) + 1 or full[: len(base)] != base:
                raise ValueError(
                    f"option letter {letter!r} after {prompt[-20:]!r} does not encode as one extra "
                    f"token with this tokenizer (got {full[len(base) - 1:]}); "
                    "try another letter_prefix"
                )
            ids.append(full[-1])
        if len(set(ids)) != len(ids):
            raise ValueError(f"option letters share token ids: {ids}")
        return torch.tensor(ids, dtype=torch.long)

    # ---- examples -> Batch ---------------------------------------------------------------
    def __call__(self, examples: Sequence[MCQAExample | InstructionExample], *, options: str = "all") -> Batch:
        if options not in ("all", "gold"):
            raise ValueError(f"options must be 'all' or 'gold', got {options!r}")
        if len(examples) == 0:
            raise ValueError("cannot collate an empty list of examples")
        kinds = {type(e) for e in examples}
        if kinds == {InstructionExample}:
            return self._instruction(examples)
        if kinds != {MCQAExample}:
            raise ValueError(f"a batch must hold only MCQAExample or only InstructionExample, got {kinds}")
        for ex in examples:
            if len(ex.options) > self.max_options:
                raise DataError(
                    f"question {ex.id!r} has {len(ex.options)} options > max_options={self.max_options}"
                )
        if self.mode == "letter":
            return self._letter(examples)
        return self._cloze(examples, options)

    def sequences(
        self, ex: MCQAExample | InstructionExample, options: str = "all"
    ) -> list[tuple[list[int], int]]:
        """(token ids, number of trailing answer tokens) of each sequence ``ex`` adds to a batch,
        before any cut to ``max_length``: one for a letter or instruction example, one per
        option in cloze mode (the gold option's alone with ``options="gold"``)."""
        if isinstance(ex, InstructionExample):
            prompt, response = self.instruction_texts(ex)
            full, n_resp = self.continuation_ids(prompt, response)
            if self.eos_id is not None:  # the model should also learn where to stop
                full, n_resp = full + [self.eos_id], n_resp + 1
            return [(full, n_resp)]
        if self.mode == "letter":
            return [(self.encode(self.letter_prompt_text(ex)) + [int(self.option_token_ids[ex.label])], 1)]
        context, conts = self.cloze_texts(ex)
        which = range(len(conts)) if options == "all" else [ex.label]
        return [self.continuation_ids(context, conts[j]) for j in which]

    def n_truncated(self, examples: Sequence[MCQAExample | InstructionExample]) -> int:
        """How many of ``examples`` have a sequence longer than ``max_length`` input tokens,
        i.e. a prompt that loses its left part (the question's start) when collated."""
        return sum(
            any(len(ids) - 1 > self.max_length for ids, _ in self.sequences(ex)) for ex in examples
        )

    def _letter(self, examples: Sequence[MCQAExample]) -> Batch:
        seqs = [self.sequences(ex)[0] for ex in examples]
        n = len(examples)
        return self._assemble(
            "letter",
            seqs,
            left_pad=True,
            labels=[ex.label for ex in examples],
            n_options=[len(ex.options) for ex in examples],
            seq_question=list(range(n)),
            seq_option=[-1] * n,
            cont_chars=[1] * n,
            option_token_ids=self.option_token_ids.clone(),
        )

    def _cloze(self, examples: Sequence[MCQAExample], options: str) -> Batch:
        seqs, seq_q, seq_o, chars = [], [], [], []
        for qi, ex in enumerate(examples):
            _, conts = self.cloze_texts(ex)
            which = range(len(conts)) if options == "all" else [ex.label]
            seqs.extend(self.sequences(ex, options))
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

    def _instruction(self, examples: Sequence[InstructionExample]) -> Batch:
        seqs = [self.sequences(ex)[0] for ex in examples]
        n = len(examples)
        return self._assemble(
            "instruction",
            seqs,
            left_pad=False,
            labels=[-1] * n,
            n_options=[0] * n,
            seq_question=list(range(n)),
            seq_option=[-1] * n,
            cont_chars=[0] * n,
        )

    def _cut(self, ids: list[int], n_ans: int) -> tuple[list[int], list[int], bool]:
        """(model input, aligned targets, whether the input was cut to ``max_length``)."""
        inp, tgt = ids[:-1], ids[1:]
        tgt = [IGNORE] * (len(tgt) - n_ans) + tgt[len(tgt) - n_ans :]
        if len(inp) <= self.max_length:
            return inp, tgt, False
        if n_ans > self.max_length:
            raise DataError(f"answer of {n_ans} tokens does not fit max_length={self.max_length}")
        return inp[-self.max_length :], tgt[-self.max_length :], True

    def _pad(
        self, rows: list[tuple[list[int], list[int]]], *, left_pad: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(input_ids, target_ids, attention_mask, position_ids), each (len(rows), longest)."""
        L = max(len(r[0]) for r in rows)
        S = len(rows)
        input_ids = torch.full((S, L), self.pad_id, dtype=torch.long)
        target_ids = torch.full((S, L), IGNORE, dtype=torch.long)
        mask = torch.zeros((S, L), dtype=torch.long)
        for s, (inp, tgt) in enumerate(rows):
            sl = slice(L - len(inp), L) if left_pad else slice(0, len(inp))
            input_ids[s, sl] = torch.tensor(inp, dtype=torch.long)
            target_ids[s, sl] = torch.tensor(tgt, dtype=torch.long)
            mask[s, sl] = 1
        position_ids = (mask.cumsum(dim=1) - 1).clamp(min=0)
        return input_ids, target_ids, mask, position_ids

    def _assemble(
        self, mode: str, seqs: list[tuple[list[int], int]], *, left_pad: bool, **meta: Any
    ) -> Batch:
        rows = [self._cut(ids, n_ans)[:2] for ids, n_ans in seqs]
        input_ids, target_ids, mask, position_ids = self._pad(rows, left_pad=left_pad)
        return self._batch(mode, input_ids, mask, position_ids, target_ids, **meta)

    def _batch(
        self,
        mode: str,
        input_ids: torch.Tensor,
        mask: torch.Tensor,
        position_ids: torch.Tensor,
        target_ids: torch.Tensor,
        *,
        labels: list[int],
        n_options: list[int],
        seq_question: list[int],
        seq_option: list[int],
        cont_chars: list[int],
        option_token_ids: torch.Tensor | None = None,
        prefix: Prefix | None = None,
        packed: Packed | None = None,
    ) -> Batch:
        return Batch(
            mode=mode,
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=position_ids,
            target_ids=target_ids,
            labels=torch.tensor(labels, dtype=torch.long),
            n_options=torch.tensor(n_options, dtype=torch.long),
            seq_question=torch.tensor(seq_question, dtype=torch.long),
            seq_option=torch.tensor(seq_option, dtype=torch.long),
            cont_chars=torch.tensor(cont_chars, dtype=torch.long),
            option_token_ids=option_token_ids,
            max_options=self.max_options,
            prefix=prefix,
            packed=packed,
        )


def warn_truncated(counts: dict[str, tuple[int, int]], max_length: int) -> int:
    """One warning for every split whose prompts ``--max-length`` cuts: ``counts`` maps a split
    name to (truncated examples, examples) (`Collator.n_truncated`). Returns the total cut.

    A cut prompt loses its left part, the question's start, and is scored anyway; without this
    warning a too small ``--max-length`` would lower every score without a trace."""
    cut = {name: (k, n) for name, (k, n) in counts.items() if k}
    total = sum(k for k, _ in cut.values())
    if total:
        parts = ", ".join(f"{name} {k} of {n}" for name, (k, n) in cut.items())
        warnings.warn(
            f"{total} examples are longer than --max-length {max_length} tokens ({parts}): their "
            "prompts lose their left part (the start of the question) and are scored that way; "
            "raise --max-length to keep them whole",
            UserWarning,
            stacklevel=2,
        )
    return total


def _pad_id(tokenizer: Any) -> int:
    for name in ("pad_token_id", "eos_token_id"):
        v = getattr(tokenizer, name, None)
        if v is not None:
            return int(v)
    return 0  # masked out everywhere; any valid id works


def _leading_special_ids(tokenizer: Any) -> list[int]:
    """The special ids the tokenizer puts in front of a text (e.g. BOS), found by comparison."""
    with_sp = list(tokenizer("a", add_special_tokens=True)["input_ids"])
    without = list(tokenizer("a", add_special_tokens=False)["input_ids"])
    for k in range(len(with_sp) - len(without) + 1):
        if with_sp[k : k + len(without)] == without:
            return with_sp[:k]
    return []


def budget_batches(
    examples: Sequence[MCQAExample | InstructionExample],
    collator: Collator,
    max_tokens: int,
    *,
    max_examples: int = 0,
    options: str = "all",
) -> Iterator[tuple[list[int], Batch]]:
    """Evaluation batches under a token budget: ``(indices into examples, batch)``.

    Examples are taken longest first (as lm-eval-harness orders its requests, so that the
    first batch is the largest one and padding stays small) and a batch grows while its padded
    size (`Batch.padded_terms`: R·W for R packed rows of width W, G·P + S·C for the cache
    layout's G prefixes of width P and S continuations of width C, S·L in the plain layout)
    stays within ``max_tokens``; one example always fits.
    ``max_examples`` > 0 also caps the questions per batch. Each example's size is measured on
    its own batch (the collator memoizes tokenization, so collating twice costs little).
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if len(examples) == 0:
        return
    batches = [collator([ex], options=options) for ex in examples]
    sizes = [b.padded_terms() for b in batches]
    # a question that falls back to the plain layout (its answer fills the input) makes the
    # whole batch plain: it is batched only with its own kind, so the budget counts true sizes
    kinds = [(b.packed is not None, b.prefix is not None) for b in batches]
    order = sorted(range(len(examples)), key=lambda i: (kinds[i], -sum(w for _, w in sizes[i])))
    idx: list[int] = []
    rows: list[int] = []  # per padded tensor of the batch so far: total rows and widest row
    widths: list[int] = []
    for i in order:
        terms = sizes[i]
        if idx and kinds[i] != kinds[idx[-1]]:
            yield idx, collator([examples[j] for j in idx], options=options)
            idx = []
        if not idx:
            rows, widths = [0] * len(terms), [0] * len(terms)
        cost = sum((r + t[0]) * max(w, t[1]) for r, w, t in zip(rows, widths, terms))
        if idx and (cost > max_tokens or (max_examples and len(idx) >= max_examples)):
            yield idx, collator([examples[j] for j in idx], options=options)
            idx, rows, widths = [], [0] * len(terms), [0] * len(terms)
        idx.append(i)
        rows = [r + t[0] for r, t in zip(rows, terms)]
        widths = [max(w, t[1]) for w, t in zip(widths, terms)]
    yield idx, collator([examples[j] for j in idx], options=options)


def batch_iterator(
    examples: Sequence[MCQAExample | InstructionExample],
    collator: Collator,
    batch_size: int,
    *,
    shuffle: bool,
    seed: int,
    options: str = "all",
    start: int = 0,
    epochs: int | None = None,
) -> Iterator[Batch]:
    """Batches of ``batch_size`` examples, deterministic for a given ``seed``.

    The example stream is the concatenation of per-epoch orders (epoch e is a permutation
    drawn from ``seed`` and e when ``shuffle``, else the given order); batch b holds stream
    positions ``[b*B, (b+1)*B)``, so batches wrap across epoch boundaries and
    ``start`` (batches already consumed, e.g. when resuming) is skipped in O(1).
    ``epochs=None`` means forever when ``shuffle`` (training) and one pass otherwise
    (evaluation); a finite stream ends with a possibly short batch.
    """
    n = len(examples)
    if n == 0:
        raise ValueError("batch_iterator needs at least one example")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if start < 0:
        raise ValueError(f"start must be >= 0, got {start}")
    if epochs is None:
        epochs = None if shuffle else 1
    total = math.inf if epochs is None else epochs * n

    cache: dict[int, list[int]] = {}

    def order(epoch: int) -> list[int]:
        if epoch not in cache:
            cache.clear()  # at most two epochs are touched by one batch
            if shuffle:
                g = torch.Generator().manual_seed(int(seed) * 1_000_003 + epoch)
                cache[epoch] = torch.randperm(n, generator=g).tolist()
            else:
                cache[epoch] = list(range(n))
        return cache[epoch]

    b = start
    while b * batch_size < total:
        lo = b * batch_size
        hi = min(lo + batch_size, total)
        idx = []
        for p in range(lo, int(hi)):
            idx.append(order(p // n)[p % n])
        yield collator([examples[i] for i in idx], options=options)
        b += 1
