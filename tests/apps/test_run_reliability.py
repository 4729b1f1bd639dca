"""Run reliability as a table of faults: each row is one fault a user or the machine can cause,
how to cause it, and the one-line message the run must end with (never a traceback, never a
silently wrong result). A new fault is one new row."""

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from apps.calm_llm import checkpoint
from apps.calm_llm.__main__ import main
from apps.calm_llm.methods import calm as calm_module
from apps.errors import Diverged

TINY = ["--config", "tiny", "--n-boot", "0", "--checkpoint-every", "1"]


@dataclass
class Fault:
    """``argv`` (``{out}`` is replaced by the run folder); ``inject(monkeypatch, tmp_path)``
    prepares the fault; the run exits with ``rc`` and stderr holds every string of ``needles``
    (``{out}`` replaced too); ``after(out)`` checks what the run left behind."""

    argv: list[str]
    needles: list[str]
    rc: int = 1
    inject: Callable[[Any, Path], None] | None = None
    after: Callable[[Path], None] | None = None


def _nan_grads_from_second_call(monkeypatch, tmp_path):
    original, calls = calm_module._accumulate, []

    def accumulate(params, grads, scale):
        calls.append(1)
        original(params, grads, scale * (math.nan if len(calls) > 2 else 1.0))

    monkeypatch.setattr(calm_module, "_accumulate", accumulate)


def _checkpoints_finite(out):
    for path in (out / "checkpoints").rglob("state.safetensors"):
        for name, t in load_file(path).items():
            assert not t.is_floating_point() or bool(t.isfinite().all()), (path, name)


FAULTS = {
    # a learning rate that makes LoRA's B explode: caught at the step, never checkpointed
    "lr 1e30": Fault(
        [*TINY, "--methods", "sft", "--lr", "1e30", "--steps", "8", "--out", "{out}"],
        ["[sft] training diverged: non-finite", "at step", "--lr 1e+30",
         "nothing of this step was checkpointed", "Lower the learning rate"],
        after=_checkpoints_finite),
    # the bilevel solver hands back a NaN direction (θ and α): named with CALM's two rates
    "calm NaN gradient": Fault(
        [*TINY, "--methods", "calm", "--steps", "3", "--out", "{out}"],
        ["[calm] training diverged: non-finite gradients at step 2", "--alpha-lr",
         "last good checkpoint: {out}/checkpoints/calm (step 1)"],
        inject=_nan_grads_from_second_call, after=_checkpoints_finite),
}


@pytest.mark.parametrize("name", list(FAULTS))
def test_fault_ends_in_one_line_naming_the_cause(name, tmp_path, monkeypatch, capsys):
    fault = FAULTS[name]
    out = tmp_path / "run"
    if fault.inject is not None:
        fault.inject(monkeypatch, tmp_path)
    rc = main([a.replace("{out}", str(out)) for a in fault.argv])
    err = capsys.readouterr().err
    assert rc == fault.rc, err
    assert "Traceback" not in err
    for needle in fault.needles:
        assert needle.replace("{out}", str(out)) in err, err
    if fault.after is not None:
        fault.after(out)


def _method():
    """What `checkpoint.save` reads of a method with no optimizer, stream or α."""
    return SimpleNamespace(name="sft", optimizers={}, schedulers={}, streams={},
                           outer_params=dict, tensors=dict)


def test_a_non_finite_state_is_never_checkpointed(tmp_path):
    d = tmp_path / "sft"
    checkpoint.save(d, method=_method(), lora={"w": torch.ones(4)}, step=1, config_hash="h",
                    history=[])
    before = (d / "state.safetensors").read_bytes()
    with pytest.raises(Diverged, match=r"not checkpointing 'sft' at step 2: non-finite values in lora\.w"):
        checkpoint.save(d, method=_method(), lora={"w": torch.tensor([1.0, math.inf])}, step=2,
                        config_hash="h", history=[])
    assert (d / "state.safetensors").read_bytes() == before
