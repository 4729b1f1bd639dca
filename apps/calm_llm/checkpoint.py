"""Checkpoints of a method's training: safetensors for tensors, JSON for everything else.

A checkpoint (``<run>/checkpoints/<method>/``) holds ``state.safetensors`` — LoRA tensors
(``lora.*``), α (``alpha.*``), the method's extra tensors (``extra.*``), optimizer state tensors
(``opt.<name>.<param index>.<key>``) and torch RNG states (``rng.*``) — and ``state.json`` — step,
config hash, data-stream positions, optimizer param groups and scalar state, scheduler states,
Python/NumPy RNG states and the loss history — the sha256 of ``state.safetensors`` and one of
``state.json``'s own content, both checked on loading, so a corrupted checkpoint is refused by name instead of resuming into silently
different metrics. Nothing is unpickled when loading, so a downloaded run directory cannot run
code. Writes go to a temporary folder renamed into place, so a run killed while saving keeps its
previous checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import Diverged, RunRefused
from .io import CorruptFile, atomic_save_tensors, atomic_write_text, read_json, read_tensors

FORMAT = 1


def _tensor(x: torch.Tensor) -> torch.Tensor:
    return x.detach().to("cpu").contiguous().clone()


def rng_state() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """All RNG states: torch (CPU + every CUDA device) as tensors, Python and NumPy as JSON."""
    tensors = {"rng.torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"rng.cuda.{i}"] = s
    version, state, gauss = random.getstate()
    np_state = np.random.get_state()  # noqa: NPY002 (the global state is what third-party code draws from)
    meta = {
        "python": [version, list(state), gauss],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]),
                  float(np_state[4])],
    }
    return tensors, meta


def set_rng_state(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    torch.set_rng_state(tensors["rng.torch"])
    cuda = sorted((k for k in tensors if k.startswith("rng.cuda.")), key=lambda k: int(k.split(".")[-1]))
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([tensors[k] for k in cuda])
    version, state, gauss = meta["python"]
    random.setstate((version, tuple(state), gauss))
    name, keys, pos, has_gauss, cached = meta["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))  # noqa: NPY002


def _optimizer_state(name: str, opt: torch.optim.Optimizer) -> tuple[dict, dict]:
    sd = opt.state_dict()
    tensors, scalars = {}, {}
    for idx, state in sd["state"].items():
        for key, value in state.items():
            if torch.is_tensor(value):
                tensors[f"opt.{name}.{idx}.{key}"] = _tensor(value)
            else:
                scalars.setdefault(str(idx), {})[key] = value
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def _load_optimizer(name: str, opt: torch.optim.Optimizer, tensors: dict, meta: dict) -> None:
    state: dict[int, dict[str, Any]] = {}
    prefix = f"opt.{name}."
    for key, value in tensors.items():
        if key.startswith(prefix):
            idx, field = key[len(prefix):].split(".", 1)
            state.setdefault(int(idx), {})[field] = value
    for idx, scalars in meta["scalars"].items():
        state.setdefault(int(idx), {}).update(scalars)
    opt.load_state_dict({"state": state, "param_groups": meta["param_groups"]})


def _scheduler_state(s: torch.optim.lr_scheduler.LRScheduler) -> dict:
    # lr_lambdas are functions (rebuilt from the config), not state
    return {k: v for k, v in s.state_dict().items() if k != "lr_lambdas"}


def save(
    directory: str | Path,
    *,
    method: Any,
    lora: dict[str, torch.Tensor],
    step: int,
    config_hash: str,
    history: list[dict[str, float]],
) -> Path:
    """Write the checkpoint of `method` after `step` optimizer steps; returns its folder."""
    directory = Path(directory)
    tensors: dict[str, torch.Tensor] = {f"lora.{n}": _tensor(t) for n, t in lora.items()}
    tensors.update({f"alpha.{n}": _tensor(t) for n, t in method.outer_params().items()})
    tensors.update({f"extra.{n}": _tensor(t) for n, t in method.tensors().items()})
    bad = [n for n, t in tensors.items() if t.is_floating_point() and not bool(t.isfinite().all())]
    if bad:  # the runner stops a diverged step first; this keeps any other caller honest
        raise Diverged(f"{directory}: not checkpointing {method.name!r} at step {step}: "
                       f"non-finite values in {', '.join(bad[:3])}{' ...' if len(bad) > 3 else ''}"
                       "; the previous checkpoint is kept. Lower the learning rate")
    opt_meta = {}
    for name, opt in method.optimizers.items():
        t, m = _optimizer_state(name, opt)
        tensors.update(t)
        opt_meta[name] = m
    rng_t, rng_m = rng_state()
    tensors.update(rng_t)
    meta = {
        "format": FORMAT,
        "method": method.name,
        "step": step,
        "config_hash": config_hash,
        "streams": {k: s.position for k, s in method.streams.items()},
        "optimizers": opt_meta,
        "schedulers": {k: _scheduler_state(s) for k, s in method.schedulers.items()},
        "rng": rng_m,
        "history": history,
    }
    tmp = directory.with_name(directory.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    data = atomic_save_tensors(tmp / "state.safetensors", tensors)
    meta["sha256"] = hashlib.sha256(data).hexdigest()
    meta["state_sha256"] = _state_checksum(json.loads(json.dumps(meta)))
    # atomic, so a complete-looking tmp folder never holds a truncated state.json
    atomic_write_text(tmp / "state.json", json.dumps(meta))
    if directory.exists():
        old = directory.with_name(directory.name + ".old")
        if old.exists():
            shutil.rmtree(old)
        directory.rename(old)
        tmp.rename(directory)
        shutil.rmtree(old)
    else:
        tmp.rename(directory)
    return directory


def _state_checksum(meta: dict[str, Any]) -> str:
    """sha256 of state.json's content (everything but this checksum; it includes the tensors'
    sha256, so it covers both files): an edited step, stream position or history is refused
    like a damaged tensor. Computed on the JSON-parsed dict with sorted keys, so it is the same
    before writing and after reading back."""
    rest = {k: v for k, v in meta.items() if k != "state_sha256"}
    return hashlib.sha256(json.dumps(rest, sort_keys=True).encode("utf-8")).hexdigest()


def _complete(d: Path) -> bool:
    return (d / "state.json").is_file() and (d / "state.safetensors").is_file()


def _recover(d: Path) -> None:
    """Finish a `save` killed between its two renames (``d`` gone, ``d.tmp`` and ``d.old`` there).

    ``d.tmp`` is complete by then (the renames come after both files are written), so it is the
    newer checkpoint; ``d.old`` is the fallback.
    """
    if d.exists():
        return
    for cand in (d.with_name(d.name + ".tmp"), d.with_name(d.name + ".old")):
        if _complete(cand):
            cand.rename(d)
            return


def exists(directory: str | Path) -> bool:
    """Whether a complete checkpoint is there (after recovering from a save killed mid-rename)."""
    d = Path(directory)
    _recover(d)
    return _complete(d)


def load(directory: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors, meta) of a checkpoint; safetensors + JSON only.

    Raises:
        CorruptFile: a file that does not parse, or tensors whose sha256 is not the one saved
            with them (checkpoints written before the checksum existed are read unchecked).
    """
    d = Path(directory)
    _recover(d)
    fix = f"Delete the folder {d} to train this method again from its start."
    meta = read_json(d / "state.json", fix)
    if not isinstance(meta, dict):  # valid JSON of another shape is as damaged as a cut file
        raise CorruptFile(f"{d / 'state.json'} holds a JSON {type(meta).__name__}, not the "
                          f"checkpoint's object of step, history and checksums. {fix}")
    if meta.get("format") != FORMAT:
        raise RunRefused(f"{d}: checkpoint format {meta.get('format')} (this code reads {FORMAT})")
    if "state_sha256" in meta and _state_checksum(meta) != meta["state_sha256"]:
        raise CorruptFile(f"{d / 'state.json'}: its content does not match the checksum saved "
                          f"with it (the file was edited or damaged after it was written). {fix}")
    path = d / "state.safetensors"
    data = path.read_bytes()
    if "sha256" in meta and hashlib.sha256(data).hexdigest() != meta["sha256"]:
        raise CorruptFile(f"{path}: its tensors do not match the checksum saved in state.json "
                          f"(the file was changed or damaged after it was written). {fix}")
    return read_tensors(path, fix, data), meta


def restore(directory: str | Path, *, method: Any, lm: Any, config_hash: str) -> tuple[int, list]:
    """Load a checkpoint into `method` and the model; returns (step, history).

    Refuses a checkpoint written under a different configuration (results would silently mix).
    """
    tensors, meta = load(directory)
    if meta["config_hash"] != config_hash:
        raise RunRefused(
            f"{directory}: written by a run with config hash {meta['config_hash']}, this run's "
            f"is {config_hash}; resume with the run's own config.json"
        )
    if meta["method"] != method.name:
        raise RunRefused(f"{directory}: a checkpoint of {meta['method']!r}, not {method.name!r}")
    lm.load_inner({k[5:]: v for k, v in tensors.items() if k.startswith("lora.")})
    with torch.no_grad():
        for n, p in method.outer_params().items():
            p.copy_(tensors[f"alpha.{n}"].to(p.device, p.dtype))
    method.load_tensors(
        {k[6:]: v.to(lm.device) for k, v in tensors.items() if k.startswith("extra.")}
    )
    for name, opt in method.optimizers.items():
        _load_optimizer(name, opt, tensors, meta["optimizers"][name])
    for name, sched in method.schedulers.items():
        sched.load_state_dict({**meta["schedulers"][name], "lr_lambdas": [None] * len(sched.lr_lambdas)})
    for name, stream in method.streams.items():
        stream.seek(meta["streams"][name])
    set_rng_state(tensors, meta["rng"])
    return int(meta["step"]), list(meta["history"])
