"""The unified records every source maps to, and the tensor batch every model call consumes.

Shapes in `Batch`: S sequences, N questions, L tokens, K = max_options.
Letter mode: S = N (one left-padded sequence per question).
Cloze mode: S = sum of n_options (one right-padded sequence per (question, option)),
or S = N with ``options="gold"``.
Instruction mode: S = N (one right-padded sequence per instruction example).

Shared-prefix cloze batches (``Batch.prefix`` set): the K options of a question share its
context, which is encoded once. ``prefix`` holds G right-padded prefixes (G, P) and the batch's
own tensors hold only each option's continuation (S, C), right-padded: the model runs the
prefixes with a KV cache, gathers the cache to the S rows (``prefix.row_group``) and runs the
continuations against it. Targets are laid out exactly as in the unshared layout, only without
the prefix columns, so every scoring function works on either layout.

Packed shared-prefix batches (``Batch.packed`` set, the faster layout where the attention kernel
takes a custom mask): one row per question holds its context once followed by every option's
continuation, and a block mask lets each option see the context and itself only. The batch's
own tensors are the same (S, C) continuation layout as above; ``packed.target_index`` says where
each continuation position sits in the packed rows, so the output projection runs at the target
positions only.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from ...errors import DataError

if TYPE_CHECKING:  # the examples and the source table import this module without torch
    import torch


@dataclass(frozen=True)
class MCQAExample:
    """One multiple-choice question.

    ``label`` indexes ``options`` (0-based); ``id`` is stable across runs
    (``source:original_id`` or ``source:sha1(content)``) so splits can be recorded.
    """

    id: str
    question: str
    options: tuple[str, ...]
    label: int
    source: str

    def __post_init__(self) -> None:
        if len(self.options) < 2:
            raise DataError(f"MCQAExample {self.id!r}: needs at least 2 options, got {len(self.options)}")
        if not 0 <= self.label < len(self.options):
            raise DataError(
                f"MCQAExample {self.id!r}: label {self.label} outside 0..{len(self.options) - 1}"
            )

    def gold_repeated(self) -> bool:
        """Whether the gold option's text appears again as a distractor (up to spacing): such a
        question is unanswerable (a model choosing the twin is scored wrong). Case is kept:
        it carries meaning in the data (genotypes ``Cc``/``cc``, formal logic ``Sc``/``sC``)."""
        gold = " ".join(self.options[self.label].split())
        return sum(" ".join(o.split()) == gold for o in self.options) > 1


@dataclass(frozen=True)
class InstructionExample:
    """One Alpaca-format instruction: the loss falls on ``output`` only."""

    id: str
    instruction: str
    input: str
    output: str
    source: str


@dataclass
class Prefix:
    """The shared contexts of a shared-prefix batch (see the module docstring).

    ``input_ids``/``attention_mask``/``position_ids`` (G, P): G prefixes, right-padded;
    positions count from 0 at each prefix's first token (continuations go on from its length).
    ``row_group`` (S,): the prefix each continuation row extends.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    row_group: torch.Tensor

    @property
    def n_groups(self) -> int:
        return int(self.input_ids.shape[0])

    def to(self, device: torch.device | str) -> Prefix:
        return Prefix(*(getattr(self, f.name).to(device) for f in fields(self)))


@dataclass
class Packed:
    """The packed shared-prefix layout (see the module docstring).

    ``input_ids``/``position_ids`` (R, W): row r is a prefix followed by the continuations of
    the options that share it, right-padded; positions count from 0 at the prefix and every
    continuation goes on from the prefix's length.
    ``segment_ids`` (R, W): 0 on the prefix, j + 1 on the row's j-th continuation, -1 on padding.
    A packed training batch (`packing.pack_batch`) has no prefix: row r holds whole sequences
    as segments 1, 2, …, each with its own positions from 0, and ``target_index`` is (S, L),
    over the batch's padded layout.
    ``target_index`` (S, C): ``r * W + t``, where continuation position (s, c) sits in the packed
    rows; -1 on the continuations' padding.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    segment_ids: torch.Tensor
    target_index: torch.Tensor

    def to(self, device: torch.device | str) -> Packed:
        return Packed(*(getattr(self, f.name).to(device) for f in fields(self)))

    def attention_mask(self, dtype: torch.dtype) -> torch.Tensor:
        """(R, 1, W, W) additive mask: 0 where query q may attend to key k, the dtype's minimum
        elsewhere. q sees k ≤ q of the prefix and of its own segment; a padding position sees
        only itself, so no row is fully masked (a fully masked row is NaN in SDPA and eager)."""
        import torch

        seg = self.segment_ids
        W = seg.shape[1]
        pos = torch.arange(W, device=seg.device)
        causal = pos[None, :] <= pos[:, None]  # [q, k]
        sq, sk = seg[:, :, None], seg[:, None, :]
        allowed = causal & (sq >= 0) & (sk >= 0) & ((sk == 0) | (sk == sq))
        allowed |= torch.eye(W, dtype=torch.bool, device=seg.device)
        mask = torch.zeros(allowed.shape, dtype=dtype, device=seg.device)
        return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]


@dataclass
class Batch:
    """Tensors for one forward pass plus the bookkeeping that maps sequences to questions.

    ``target_ids[s, t]`` is the token that ``logits[s, t]`` should predict (already shifted);
    -100 where there is no loss. ``labels`` (N,) is the gold option (-1 for instructions).
    ``seq_question``/``seq_option`` (S,) say which question/option a sequence carries
    (letter and instruction: ``arange(N)`` and -1). ``cont_chars`` (S,) is the character count
    of each option continuation (cloze per-char normalization; letter: 1, instruction: 0).
    ``option_token_ids`` (K,) is set in letter mode: the vocabulary ids of the option letters.
    ``max_options`` is K, the width of the option-score matrix (the collator's setting).
    ``prefix`` (cache layout) or ``packed`` is set on shared-prefix cloze batches: then
    ``input_ids``, ``attention_mask``, ``position_ids`` and ``target_ids`` cover only the
    continuation columns (S, C). A packed batch's logits are (M, V), at the True entries of
    ``logit_rows`` (S, C) (None: ``target_ids != -100``), see `scoring`.
    """

    mode: str
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    target_ids: torch.Tensor
    labels: torch.Tensor
    n_options: torch.Tensor
    seq_question: torch.Tensor
    seq_option: torch.Tensor
    cont_chars: torch.Tensor
    option_token_ids: torch.Tensor | None = None
    max_options: int | None = None
    prefix: Prefix | None = None
    packed: Packed | None = None
    logit_rows: torch.Tensor | None = None

    @property
    def logit_positions(self) -> torch.Tensor:
        """(S, L) bool: where the (M, V) logits of a packed batch sit, row-major — ``logit_rows``
        when set, else the target positions."""
        return self.logit_rows if self.logit_rows is not None else self.target_ids != -100

    @property
    def n_questions(self) -> int:
        return int(self.labels.shape[0])

    def to(self, device: torch.device | str) -> Batch:
        """A copy with every tensor moved to ``device``."""
        import torch

        moved = {}
        for f in fields(self):
            v = getattr(self, f.name)
            moved[f.name] = v.to(device) if isinstance(v, (torch.Tensor, Prefix, Packed)) else v
        return Batch(**moved)

    @property
    def n_tokens(self) -> int:
        """Tokens fed to the model, padding included (prefix + continuation columns, or the
        packed rows)."""
        if self.packed is not None:
            return self.packed.input_ids.numel()
        n = self.input_ids.numel()
        return n + (self.prefix.input_ids.numel() if self.prefix is not None else 0)

    def padded_terms(self) -> list[tuple[int, int]]:
        """(rows, width) of each padded tensor the model is fed: [(S, L)] in the plain layout,
        [(G, P), (S, C)] in the cache layout, [(R, W)] packed (what a token budget counts)."""
        if self.packed is not None:
            return [tuple(self.packed.input_ids.shape)]
        terms = [tuple(self.prefix.input_ids.shape)] if self.prefix is not None else []
        return [*terms, tuple(self.input_ids.shape)]

    def model_inputs(self) -> dict[str, torch.Tensor]:
        """The keyword arguments for a Hugging Face causal LM forward (unshared layout)."""
        if self.prefix is not None or self.packed is not None:
            raise DataError("a shared-prefix batch is run by model.CausalLM.logits")
        return {
            "input_ids": self.input_ids,
            "attention_mask": self.attention_mask,
            "position_ids": self.position_ids,
        }
