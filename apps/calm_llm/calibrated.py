"""An export loaded with its calibration: score options and generate as the run did.

``load_export(dir)`` puts the export's adapter on its base (the one ``base.json`` names, or the
``base`` given, checked by `export.check_base`) and reads what the method applies after the
model (``calibration.json``):

  α on the vocabulary logits:  z' = α(z) (S, L, V) before every softmax (CALM, Algorithm 1 of
                               the CALM paper; `calibration.alpha`), in scoring and generation;
  α on the option scores:      s' = α(s) (N, K) (``--alpha-acts options``, letter mode);
  a temperature T:             p = softmax(s / T), s the (N, K) option scores (post-hoc
                               temperature scaling, Guo et al. 2017); in open QA T divides the
                               next-token logits (B, V) instead.

`CalibratedModel.option_scores` runs the run's own scoring code (`predict.predict_option_logits`
with the run's collator: prompt style, letter or cloze mode, cloze normalization), so its
``softmax`` is the run's predicted distribution; `CalibratedModel.generate` is
``PeftModel.generate`` with the calibration as logits processors. Cost: one forward per batch
of questions (cloze: one per question's options, context shared), as in the run.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import CalmError
from . import export


class CalibrationError(CalmError, ValueError):
    """A calibration asked of an export where it has no meaning (named, with the fix)."""


@dataclass
class _Transforms:
    """The method-side of a prediction (`methods.base.Method`'s two transforms), rebuilt from
    the export: what `predict.predict_option_logits` and `predict.probabilities` call."""

    vocab: Any = None  # callable (…, V) -> (…, V), or None
    options: Any = None  # callable (N, K) -> (N, K), or None

    def vocab_transform(self, logits: torch.Tensor) -> torch.Tensor:
        return logits if self.vocab is None else self.vocab(logits)

    def option_transform(self, option_logits: torch.Tensor) -> torch.Tensor:
        return option_logits if self.options is None else self.options(option_logits)


@dataclass
class CalibratedModel:
    """An export on its base, with its calibration (module docstring).

    Attributes:
        model: the ``PeftModel`` (eval mode; adapter-only scores come from it directly).
        tokenizer: the base's tokenizer.
        calibration: ``calibration.json`` (what ``applies``, on what, T and what it divides).
        cfg: the run's options (``config.json``; the scoring options are the ones read).
        directory: the export folder.
    """

    model: Any
    tokenizer: Any
    calibration: dict[str, Any]
    cfg: Any
    directory: Path
    alpha: Any = None  # export.AlphaLogitsProcessor when α applies
    _ctx: Any = field(default=None, repr=False)

    @property
    def temperature(self) -> float | None:
        """T of a ``ts`` export (None for any other)."""
        return self.calibration.get("temperature") if self.calibration["applies"] == "temperature" else None

    def transforms(self, calibrated: bool = True) -> _Transforms:
        """The vocabulary and option transforms the run predicted with (identity when not
        ``calibrated``: the adapter alone)."""
        cal = self.calibration
        if not calibrated or cal["applies"] == "none":
            return _Transforms()
        if cal["applies"] == "temperature":
            t = float(cal["temperature"])
            if cal["acts_on"] == "vocab":
                return _Transforms(vocab=lambda z: z / t)
            return _Transforms(options=lambda s: s / t)
        p = self.alpha

        def apply(z: torch.Tensor) -> torch.Tensor:  # α as the run applied it, on z's device
            return p.param.apply({n: v.to(z.device) for n, v in p.params.items()}, z,
                                 class_ids=None if p.class_ids is None else p.class_ids.to(z.device))

        return _Transforms(vocab=apply) if cal["acts_on"] == "vocab" else _Transforms(options=apply)

    def option_scores(self, question: str | Sequence[Any], options: Sequence[str] | None = None, *,
                      calibrated: bool = True) -> torch.Tensor:
        """(N, K) option scores s whose ``softmax(s, -1)`` is the run's answer distribution
        (α or T applied; ``calibrated=False``: the adapter alone): for one question K is its
        number of options, for a list K is the run's ``--max-options`` (absent ones -inf).

        ``question``: one question's text with ``options`` (then N = 1), or a list of
        ``data.MCQAExample`` (their labels are not read). Cloze mode: s_j is option j's
        continuation log-likelihood (``cloze_norm``-normalized) under α, then / T; letter mode:
        the letters' logits at the answer position.
        """
        from .data import MCQAExample
        from .predict import predict_option_logits

        if self.calibration["task"] != "mcqa":
            raise CalibrationError(
                f"{self.directory}: an export of a --task {self.calibration['task']} run has no "
                "option scores (its run sampled answers); use generate(...)")
        if isinstance(question, str):
            if not options or len(options) < 2:
                raise CalibrationError(f"option_scores({question[:40]!r}, options={options!r}): give "
                                       "the question's options, at least two texts")
            examples = [MCQAExample("q0", question, tuple(options), 0, "user")]
        else:
            examples = [MCQAExample(e.id, e.question, tuple(e.options), 0, e.source) for e in question]
        t = self.transforms(calibrated)
        scores, _ = predict_option_logits(self._context(), t, examples, "export")
        scores = t.option_transform(scores)
        # one question: its own K options; a list: the run's K = --max-options slots
        return scores[:, : len(examples[0].options)] if isinstance(question, str) else scores

    def logits_processors(self, calibrated: bool = True) -> list:
        """transformers ``LogitsProcessor``s that make ``generate`` sample from the calibrated
        model: α on the next-token scores, or 1/T where T has a next-token form."""
        from .methods.ts import ScoreTemperature

        cal = self.calibration
        if not calibrated or cal["applies"] == "none":
            return []
        if cal["applies"] == "alpha":
            if cal["acts_on"] != "vocab":
                raise CalibrationError(
                    f"{self.directory}: α acts on the option scores (--alpha-acts options), it has "
                    "no next-token form; generate with calibrated=False (the adapter alone)")
            return [self.alpha]
        if cal["acts_on"] == "vocab" or cal["scoring"]["mode"] == "letter":
            # letter mode: the option scores are next-token logits, so 1/T is the same there
            return [ScoreTemperature(float(cal["temperature"]))]
        raise CalibrationError(
            f"{self.directory}: T = {cal['temperature']:.4g} divides summed option "
            "log-likelihoods (cloze mode), not next-token logits, so it has no generation form; "
            "generate with calibrated=False (the adapter alone) or score options with option_scores")

    def generate(self, *args: Any, calibrated: bool = True, **kwargs: Any) -> Any:
        """``model.generate(...)`` with `logits_processors` added to any given."""
        from transformers import LogitsProcessorList

        procs = LogitsProcessorList(list(kwargs.pop("logits_processor", None) or []))
        procs.extend(self.logits_processors(calibrated))
        kwargs.setdefault("pad_token_id", self.tokenizer.pad_token_id)
        with torch.no_grad():
            return self.model.generate(*args, logits_processor=procs, **kwargs)

    def _context(self) -> Any:
        """The run's scoring context (collator, token budget) around this model, built once."""
        if self._ctx is None:
            from .causal_lm import CausalLM
            from .data import Collator
            from .methods.base import Context

            lm = CausalLM(self.model, self.tokenizer, next(self.model.parameters()).device)
            d = self.cfg.data
            col = Collator(self.tokenizer, mode=d.mode, prompt_style=d.prompt_style,
                           max_length=self.cfg.model.max_length, max_options=d.max_options,
                           share_prefix=d.share_prefix, prefix_layout=lm.prefix_layout)
            self._ctx = Context(cfg=self.cfg, lm=lm, collator=col, train_examples=[], calib_examples=[],
                                train_collator=col, option_token_ids=(
                                    col.option_token_ids.to(lm.device) if d.mode == "letter" else None))
        return self._ctx


def load_base_of(export_dir: str | Path, *, device: str | torch.device = "cpu",
                 dtype: str | None = None) -> tuple[Any, Any]:
    """The base ``base.json`` names (``model_option``: ``tiny``, ``smollm2``, a hub name), loaded
    as the run loaded it (`model.load_base` with the run's model options); an export trained on
    a local folder names only the folder, so that base must be passed."""
    from . import config as C
    from .model import load_base

    d = Path(export_dir)
    record = export.read_base_record(d) or {}
    option = record.get("model_option")
    if not option:
        raise CalibrationError(
            f"{d}: its base is the local folder {record.get('name_or_path')!r} of the training "
            "machine; load that model and pass it as base= (load_export(dir, base=model, "
            "tokenizer=tok)), or lm-eval's --model_args export=DIR,base=PATH")
    cfg = C.from_dict(json.loads((d / "config.json").read_text()))
    mc = cfg.model
    mc.name_or_path = option
    if dtype is not None:
        mc.dtype = dtype
    base, tok = load_base(mc, seed=cfg.seed)
    return base.to(device), tok


def load_export(export_dir: str | Path, base: Any = None, tokenizer: Any = None, *,
                in_place: bool = False, device: str | torch.device | None = None) -> CalibratedModel:
    """The export in ``export_dir`` on its base, with its calibration (module docstring).

    Args:
        export_dir: ``export/<method>`` of a run.
        base: the base model (a Hugging Face causal LM); default: the one ``base.json`` names,
            loaded here (`load_base_of`). Checked against the recorded fingerprint.
        tokenizer: the base's tokenizer (needed with ``base``).
        in_place: with ``base``, wrap it itself (peft injects the LoRA layers into its
            modules: afterwards ``base`` is the adapter's base, not the plain model) rather
            than a deep copy. A base loaded here is always wrapped in place.
        device: where to run (default: where ``base`` is, or the CPU).
    """
    from . import config as C

    d = Path(export_dir)
    if not (d / "calibration.json").is_file():
        raise FileNotFoundError(f"{d}: no calibration.json: not an export folder, or one written "
                                "before every export recorded its calibration (export it again)")
    if base is None:
        base, tokenizer = load_base_of(d, device=device or "cpu")
        in_place = True
    elif tokenizer is None:
        raise CalibrationError("load_export(dir, base=...): pass the base's tokenizer= too")
    model = export.load_adapter(d, base, in_place=in_place).eval()
    if device is not None:
        model.to(device)
    cal = json.loads((d / "calibration.json").read_text())
    cfg = C.from_dict(json.loads((d / "config.json").read_text()))
    alpha = None
    if cal["applies"] == "alpha":
        alpha = export.AlphaLogitsProcessor.from_dir(d, next(model.parameters()).device) \
            if cal["acts_on"] == "vocab" else _option_alpha(d)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return CalibratedModel(model, tokenizer, cal, cfg, d, alpha)


def _option_alpha(d: Path) -> Any:
    """α that acts on the option scores, as an `export.AlphaLogitsProcessor` (its ``param``,
    ``params`` and ``class_ids`` are what the option transform reads)."""
    from safetensors.torch import load_file

    from calibration import alpha as calibration_alpha

    meta = json.loads((d / "alpha.json").read_text())
    param = calibration_alpha.get(meta["param"], **export.recorded_options(meta))
    ids = meta.get("class_ids")
    return export.AlphaLogitsProcessor(param, load_file(str(d / "alpha.safetensors")),
                                       None if ids is None else torch.tensor(ids))
