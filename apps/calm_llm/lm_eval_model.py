"""lm-evaluation-harness model ``calm``: an export on its base, with α or T applied as the app does.

lm-eval (0.4.x, optional: the ``dev`` extra installs it) finds models by name in its registry,
which holds only what has been imported, and its ``--include_path`` adds *tasks*, not models.
So the honest ways are to import this module first:

  command line   ``python -m apps.calm_llm.lm_eval_model --model calm --model_args
                 export=runs/X/export/calm --tasks arc_easy`` (this module's ``__main__``
                 imports itself, which registers ``calm``, then runs lm-eval's own CLI with the
                 same arguments; ``lm_eval --model calm`` alone does not know ``calm``);
  Python         ``import apps.calm_llm.lm_eval_model`` then ``lm_eval.simple_evaluate(
                 model="calm", model_args="export=DIR", tasks=[...])``, or pass
                 ``CalmLM(export=DIR)`` as ``model=``.

``model_args``: ``export=DIR`` (required), ``base=NAME_OR_PATH`` (the base, where
``base.json`` names a folder of the training machine; checked against its fingerprint),
``dtype=fp32|bf16``, ``calibrated=false`` (the adapter alone), and HFLM's own (``batch_size``,
``max_length``...).

What is applied, as `calibrated.CalibratedModel` (the app's predictions) does:

  α on the vocabulary (CALM)    every forward's logits z (B, L, V) become α(z) before lm-eval's
                                log-softmax: every ``loglikelihood``, ``loglikelihood_rolling``
                                and, through a logits processor, every ``generate_until`` step;
  T of ``ts`` in open QA        z / T on every forward and generation step (T divides the
                                next-token logits there);
  T of ``ts`` in multiple choice  each ``loglikelihood`` request's value is divided by T: with
                                ``cloze_norm=sum`` lm-eval's per-option log-likelihood *is* the
                                app's option score, so softmax over a question's options of
                                ll / T is the app's distribution (acc is unchanged; letter mode:
                                log p(letter) / T gives softmax(z_letters / T) over the letters).
                                It has no per-token form: ``loglikelihood_rolling`` is refused,
                                and ``generate_until`` too in cloze mode;
  α on the option scores        a transform of a question's whole (K,) score vector, which
                                lm-eval never hands a model (it scores one option per request):
                                refused, with the fix.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

from .calibrated import CalibrationError, load_export


def _flag(value: Any) -> bool:
    """lm-eval passes model_args as strings (``calibrated=false``) or Python values."""
    if isinstance(value, str):
        if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
            raise CalibrationError(f"--model_args calibrated={value!r}: use true or false")
        return value.lower() in ("true", "1", "yes")
    return bool(value)


@register_model("calm")
class CalmLM(HFLM):
    """lm-eval's Hugging Face model around `calibrated.load_export` (module docstring)."""

    def __init__(self, export: str, base: str | None = None, dtype: str | None = None,
                 calibrated: bool | str = True, device: str | None = None, **kwargs: Any) -> None:
        model, tok = None, None
        if base:
            from transformers import AutoModelForCausalLM, AutoTokenizer

            dt = {"fp32": torch.float32, "bf16": torch.bfloat16, None: "auto"}[dtype]
            model = AutoModelForCausalLM.from_pretrained(base, dtype=dt)
            tok = AutoTokenizer.from_pretrained(base)
        self.calibrated_model = load_export(export, model, tok, in_place=True, device=device or "cpu")
        self.apply_calibration = _flag(calibrated)
        self._vocab = self.calibrated_model.transforms(self.apply_calibration).vocab
        cal = self.calibrated_model.calibration
        self._option_t = (float(cal["temperature"]) if self.apply_calibration
                          and cal["applies"] == "temperature" and cal["acts_on"] == "options" else None)
        if self.apply_calibration and cal["applies"] == "alpha" and cal["acts_on"] == "options":
            raise CalibrationError(
                f"{export}: α acts on a question's (K,) option scores (--alpha-acts options), which "
                "lm-eval never gives a model (one option per request); evaluate with the app, or "
                "pass calibrated=false for the adapter alone")
        kwargs.pop("pretrained", None)
        super().__init__(pretrained=self.calibrated_model.model, tokenizer=self.calibrated_model.tokenizer,
                         **kwargs)

    def _model_call(self, inps: torch.Tensor, attn_mask: torch.Tensor | None = None,
                    labels: torch.Tensor | None = None) -> torch.Tensor:
        """The model's logits (B, L, V) with α (or 1/T of open QA) applied to every position."""
        logits = super()._model_call(inps, attn_mask, labels)
        return logits if self._vocab is None else self._vocab(logits.float())

    def loglikelihood(self, requests: list, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """HFLM's (log-likelihood, is-greedy) per request (α inside `_model_call`), divided by
        T for a multiple-choice ``ts`` export."""
        out = super().loglikelihood(requests, disable_tqdm=disable_tqdm)
        if self._option_t is None:
            return out
        return [(ll / self._option_t, greedy) for ll, greedy in out]

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        if self._option_t is not None:
            raise CalibrationError(
                f"{self.calibrated_model.directory}: T divides multiple-choice option scores; a "
                "rolling (perplexity) log-likelihood has no such form; pass calibrated=false")
        return super().loglikelihood_rolling(requests, disable_tqdm=disable_tqdm)

    def _model_generate(self, context: torch.Tensor, max_length: int, stop: list[str],
                        **generation_kwargs: Any) -> torch.Tensor:
        """HFLM's ``generate`` with the export's logits processors (`CalibratedModel`)."""
        from transformers import LogitsProcessorList

        procs = LogitsProcessorList(list(generation_kwargs.pop("logits_processor", None) or []))
        procs.extend(self.calibrated_model.logits_processors(self.apply_calibration))
        return super()._model_generate(context, max_length, stop, logits_processor=procs,
                                       **generation_kwargs)


def main(argv: list[str] | None = None) -> None:
    """lm-eval's command line, with ``calm`` registered (this module is imported by now)."""
    from lm_eval.__main__ import cli_evaluate

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    cli_evaluate()


if __name__ == "__main__":
    main()
