"""Using the calibrated model afterwards: the LoRA adapter, α, and α inside ``generate``.

``export_method(dir, lm, method)`` writes
  ``dir/adapter/``          peft ``save_pretrained`` (load with ``PeftModel.from_pretrained`` on the
                            same base model, or ``AutoPeftModelForCausalLM``),
  ``dir/alpha.safetensors`` α tensors, and ``dir/alpha.json`` (parameterization, form, positivity, support,
                            option ids, whether α applies at inference).
``AlphaLogitsProcessor.from_dir(dir)`` applies α to the next-token scores during ``generate``::

    model = PeftModel.from_pretrained(base, f"{dir}/adapter")
    out = model.generate(**inputs, logits_processor=LogitsProcessorList(
        [AlphaLogitsProcessor.from_dir(dir)]))
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from transformers import LogitsProcessor

from .methods.alpha_wiring import FORMS


def export_method(out_dir: str | Path, lm: Any, method: Any) -> Path:
    """Write the adapter and (when the method learned one) α of a trained method."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lm.model.save_pretrained(out / "adapter")
    alpha = getattr(method, "alpha", None)
    if alpha is not None:
        c = method.ctx.cfg.calm
        save_file({n: t.detach().cpu().contiguous() for n, t in alpha.params.items()},
                  str(out / "alpha.safetensors"))
        name = method.alpha_param or c.alpha_param
        meta = {
            "param": name,
            "form": c.alpha_form if name == "affine" else None,
            "positivity": None if name == "shift" else c.alpha_positivity,
            "tau_max": None if name == "shift" else c.alpha_tau_max,
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

    def __init__(self, param: Any, params: dict[str, torch.Tensor], class_ids: torch.Tensor | None = None):
        self.param, self.params, self.class_ids = param, params, class_ids

    @classmethod
    def from_dir(
        cls, directory: str | Path, device: str | torch.device = "cpu", *, force: bool = False
    ) -> AlphaLogitsProcessor:
        """The processor of an exported method. A run made with ``--no-alpha-at-inference``
        evaluated the adapter without α, so applying α would not be the model it measured:
        that is refused unless ``force=True``."""
        d = Path(directory)
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
        kwargs = {"form": FORMS[meta["form"]]} if meta.get("form") else {}
        for key in ("positivity", "tau_max"):
            if meta.get(key) is not None:
                kwargs[key] = meta[key]
        param = calibration_alpha.get(meta["param"], **kwargs)
        params = {n: t.to(device) for n, t in load_file(str(d / "alpha.safetensors")).items()}
        ids = meta.get("class_ids")
        return cls(param, params, None if ids is None else torch.tensor(ids, device=device))

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        params = {n: t.to(scores.device) for n, t in self.params.items()}
        ids = None if self.class_ids is None else self.class_ids.to(scores.device)
        out = self.param.apply(params, scores.float(), class_ids=ids)
        return out.to(scores.dtype)
