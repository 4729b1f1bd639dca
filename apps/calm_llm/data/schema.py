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
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

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
            raise ValueError(f"MCQAExample {self.id!r}: needs at least 2 options, got {len(self.options)}")
        if not 0 <= self.label < len(self.options):
            raise ValueError(
                f"MCQAExample {self.id!r}: label {self.label} outside 0..{len(self.options) - 1}"
            )


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
class Batch:
    """Tensors for one forward pass plus the bookkeeping that maps sequences to questions.

    ``target_ids[s, t]`` is the token that ``logits[s, t]`` should predict (already shifted);
    -100 where there is no loss. ``labels`` (N,) is the gold option (-1 for instructions).
    ``seq_question``/``seq_option`` (S,) say which question/option a sequence carries
    (letter and instruction: ``arange(N)`` and -1). ``cont_chars`` (S,) is the character count
    of each option continuation (cloze per-char normalization; letter: 1, instruction: 0).
    ``option_token_ids`` (K,) is set in letter mode: the vocabulary ids of the option letters.
    ``max_options`` is K, the width of the option-score matrix (the collator's setting).
    ``prefix`` is set on shared-prefix cloze batches: then ``input_ids``, ``attention_mask``,
    ``position_ids`` and ``target_ids`` cover only the continuation columns (S, C).
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

    @property
    def n_questions(self) -> int:
        return int(self.labels.shape[0])

    @property
    def n_sequences(self) -> int:
        return int(self.input_ids.shape[0])

    def to(self, device: torch.device | str) -> Batch:
        """A copy with every tensor moved to ``device``."""
        import torch

        moved = {}
        for f in fields(self):
            v = getattr(self, f.name)
            moved[f.name] = v.to(device) if isinstance(v, (torch.Tensor, Prefix)) else v
        return Batch(**moved)

    @property
    def n_tokens(self) -> int:
        """Tokens fed to the model, padding included (prefix + continuation columns)."""
        n = self.input_ids.numel()
        return n + (self.prefix.input_ids.numel() if self.prefix is not None else 0)

    def model_inputs(self) -> dict[str, torch.Tensor]:
        """The keyword arguments for a Hugging Face causal LM forward (unshared layout)."""
        if self.prefix is not None:
            raise ValueError("a shared-prefix batch needs two forwards (model.CausalLM.logits)")
        return {
            "input_ids": self.input_ids,
            "attention_mask": self.attention_mask,
            "position_ids": self.position_ids,
        }
