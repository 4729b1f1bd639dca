"""Using the calibrated model afterwards: the LoRA adapter, α, and α inside ``generate``.

``export_method(dir, lm, method)`` writes
  ``dir/adapter/``          peft ``save_pretrained`` (load with ``PeftModel.from_pretrained`` on the
                            same base model, or ``AutoPeftModelForCausalLM``),
  ``dir/alpha.safetensors`` α tensors, and ``dir/alpha.json`` (the parameterization's name and
                            its options, support, option ids, whether α applies at inference).
  ``dir/base.json``         the base model's name and a weights fingerprint
                            (`model.base_fingerprint`: vocabulary size, a hash of a few
                            embedding rows).
``AlphaLogitsProcessor.from_dir(dir)`` applies α to the next-token scores during ``generate``::

    model = load_adapter(dir, base)     # PeftModel.from_pretrained, after check_base
    out = model.generate(**inputs, logits_processor=LogitsProcessorList(
        [AlphaLogitsProcessor.from_dir(dir, model=base)]))

An adapter or α trained on one base means nothing on another: `check_base` refuses a base whose
fingerprint differs, and the processor refuses scores whose width is not the recorded vocabulary.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from transformers import LogitsProcessor

from ..errors import CalmError


def export_method(out_dir: str | Path, lm: Any, method: Any) -> Path:
    """Write the adapter and (when the method learned one) α of a trained method."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lm.model.save_pretrained(out / "adapter")
    write_base_record(out, lm, getattr(getattr(method, "ctx", None), "cfg", None))
    info = getattr(method, "info", None)  # the method table says whether it learns α
    alpha = method.alpha if info is not None and info.learns_alpha else None
    if alpha is not None:
        c = method.ctx.cfg.calm
        save_file({n: t.detach().cpu().contiguous() for n, t in alpha.params.items()},
                  str(out / "alpha.safetensors"))
        meta = {
            "param": alpha.param.name,
            "options": alpha.param.options(),  # calibration.alpha.get(param, **options) rebuilds it
            "support": c.alpha_support,
            "acts_on": alpha.on,
            "class_ids": None if alpha.class_ids is None else alpha.class_ids.tolist(),
            "alpha_at_inference": c.alpha_at_inference,
            "method": method.name,
        }
        (out / "alpha.json").write_text(json.dumps(meta, indent=2) + "\n")
    return out


class AlphaLogitsProcessor(LogitsProcessor):
    """Applies a learned α to the next-token scores (B, V) at every generation step.

    Args:
        param: a ``calibration.alpha`` parameterization.
        params: its tensors (as returned by ``param.init`` and trained).
        class_ids: the vocabulary columns α acts on (a support) or None (every column).
    """

    def __init__(self, param: Any, params: dict[str, torch.Tensor], class_ids: torch.Tensor | None = None,
                 vocab_size: int | None = None):
        self.param, self.params, self.class_ids = param, params, class_ids
        self.vocab_size = vocab_size  # the base's logit width (base.json); None = unchecked

    @classmethod
    def from_dir(
        cls, directory: str | Path, device: str | torch.device = "cpu", *, force: bool = False,
        model: Any = None,
    ) -> AlphaLogitsProcessor:
        """The processor of an exported method. A run made with ``--no-alpha-at-inference``
        evaluated the adapter without α, so applying α would not be the model it measured:
        that is refused unless ``force=True``. With ``model`` (the base it will run on) the
        base is checked first (`check_base`); the processor itself refuses scores whose width
        is not the vocabulary recorded in ``base.json``."""
        d = Path(directory)
        if model is not None:
            check_base(d, model)
        if not (d / "alpha.json").is_file():
            raise FileNotFoundError(f"{d}: no alpha.json (this method learned no α)")
        from calibration import alpha as calibration_alpha

        meta = json.loads((d / "alpha.json").read_text())
        if not meta.get("alpha_at_inference", True) and not force:
            raise ValueError(
                f"{d}: this run used --no-alpha-at-inference (α only shaped training), so the "
                "calibrated model is the adapter alone; pass force=True to apply α anyway"
            )
        if meta.get("acts_on", "vocab") != "vocab":
            raise ValueError(
                f"{d}: this α acts on the option scores (--alpha-acts options), not on the "
                "vocabulary logits, so it has no next-token form for generate(); apply it to "
                "the option scores with calibration.alpha"
            )
        param = calibration_alpha.get(meta["param"], **_recorded_options(meta))
        params = {n: t.to(device) for n, t in load_file(str(d / "alpha.safetensors")).items()}
        ids = meta.get("class_ids")
        record = read_base_record(d)
        return cls(param, params, None if ids is None else torch.tensor(ids, device=device),
                   vocab_size=None if record is None else int(record["vocab_size"]))

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.vocab_size is not None and scores.shape[-1] != self.vocab_size:
            # a scalar τ would apply to any width, and option-scope ids would pick other tokens
            raise ValueError(
                f"AlphaLogitsProcessor: α was exported for a base whose logits have "
                f"{self.vocab_size} entries, but these scores have {scores.shape[-1]}: this is "
                "another model than the one the run trained (see export.check_base)"
            )
        params = {n: t.to(scores.device) for n, t in self.params.items()}
        ids = None if self.class_ids is None else self.class_ids.to(scores.device)
        out = self.param.apply(params, scores.float(), class_ids=ids)
        return out.to(scores.dtype)


def _recorded_options(meta: dict[str, Any]) -> dict[str, Any]:
    """The parameterization's options as ``alpha.json`` records them; an export written before
    ``options`` was recorded has ``form`` (the CLI spelling, an alias the table maps),
    ``positivity`` and ``tau_max`` keys, None where the parameterization has no such option."""
    if "options" in meta:
        return dict(meta["options"])
    return {k: meta[k] for k in ("form", "positivity", "tau_max") if meta.get(k) is not None}


# -- which base an export belongs to ---------------------------------------------------------------
class BaseMismatch(CalmError, ValueError):
    """An export applied to another base model than the one it was trained on."""


def write_base_record(out_dir: str | Path, lm: Any, cfg: Any = None) -> Path:
    """Write ``base.json``: the base's name and `model.base_fingerprint` (taken at load time
    when ``lm.base`` has it, else now; the name from ``cfg.model`` when the load did not say)."""
    from .io import atomic_write_text
    from .model import base_fingerprint

    name = cfg.model.name_or_path if cfg is not None else ""
    record = getattr(lm, "base", None) or base_fingerprint(lm.model, name)
    if not record.get("name_or_path"):
        record = {**record, "name_or_path": name}
    return atomic_write_text(Path(out_dir) / "base.json", json.dumps(record, indent=2) + "\n")


def read_base_record(export_dir: str | Path) -> dict[str, Any] | None:
    """The export's ``base.json``, or None for an export written before it was recorded."""
    path = Path(export_dir) / "base.json"
    if not path.is_file():
        return None
    from .io import read_json

    return read_json(path, "Export the method again (its run's final checkpoint has the adapter).")


def check_base(export_dir: str | Path, model: Any) -> None:
    """Refuse ``model`` (a Hugging Face or peft model, or a `model.CausalLM`) as the base of the
    export in ``export_dir`` unless its vocabulary and embedding fingerprint are those recorded.

    Raises:
        BaseMismatch: another base, naming both and what differs.
        FileNotFoundError: the export has no ``base.json`` (written before it was recorded).
    """
    from .model import CausalLM, base_fingerprint

    d = Path(export_dir)
    saved = read_base_record(d)
    if saved is None:
        raise FileNotFoundError(f"{d}: no base.json, so the base it was trained on is unknown; "
                                "export it again from its run to record it")
    if isinstance(model, CausalLM):  # its fingerprint was taken before any sharding
        now = model.base or base_fingerprint(model.model)
    else:
        now = base_fingerprint(model)
    trained_on = f"{saved.get('name_or_path') or 'a base'!r}"
    if now["vocab_size"] != saved["vocab_size"]:
        raise BaseMismatch(
            f"{d} was trained on {trained_on}, whose logits have {saved['vocab_size']} entries; "
            f"this model's have {now['vocab_size']}: load the adapter and α onto {trained_on}"
        )
    if now["embedding_shape"] != saved["embedding_shape"] or now["embedding_sha256"] != saved["embedding_sha256"]:
        raise BaseMismatch(
            f"{d} was trained on {trained_on} (embedding {saved['embedding_shape']}, fingerprint "
            f"{saved['embedding_sha256'][:12]}); this model has other weights (embedding "
            f"{now['embedding_shape']}, fingerprint {now['embedding_sha256'][:12]}): load the "
            f"adapter and α onto {trained_on}"
        )


def load_adapter(export_dir: str | Path, base: Any, **kwargs: Any) -> Any:
    """``PeftModel.from_pretrained(base, export_dir/adapter, **kwargs)`` after `check_base`."""
    from peft import PeftModel

    check_base(export_dir, base)
    return PeftModel.from_pretrained(base, str(Path(export_dir) / "adapter"), **kwargs)
