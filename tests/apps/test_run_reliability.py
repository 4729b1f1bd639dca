"""Run reliability as a table of faults: each row is one fault a user or the machine can cause,
how to cause it, and the one-line message the run must end with (never a traceback, never a
silently wrong result). A new fault is one new row."""

import errno
import json
import math
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from apps import study
from apps.calm_llm import checkpoint
from apps.calm_llm import io as io_module
from apps.calm_llm import model as model_lib
from apps.calm_llm.__main__ import main
from apps.calm_llm.io import CorruptFile
from apps.calm_llm.methods import calm as calm_module
from apps.calm_llm.runner import prepare
from apps.errors import DataError, Diverged
from apps.study import __main__ as study_cli

TINY = ["--config", "tiny", "--n-boot", "0", "--checkpoint-every", "1"]


@dataclass
class Fault:
    """``argv`` (``{out}`` is replaced by the run folder, ``{other}`` by a second folder);
    with ``finished`` the run folder starts as a copy of a finished tiny run (sft, 2 steps);
    ``inject(monkeypatch, out)`` prepares the fault; the run exits with ``rc`` and stderr
    holds every string of ``needles`` (placeholders replaced too); ``after(out)`` checks what
    the run left behind."""

    argv: list[str]
    needles: list[str]
    rc: int = 1
    finished: bool = False
    inject: Callable[[Any, Path], None] | None = None
    after: Callable[[Path], None] | None = None


FINISHED = [*TINY, "--methods", "sft", "--steps", "2"]


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished tiny run (sft, 2 steps) and its config.json's bytes."""
    out = tmp_path_factory.mktemp("finished") / "run"
    assert main([*FINISHED, "--out", str(out)]) == 0
    return out


def _nan_grads_from_second_call(monkeypatch, out):
    original, calls = calm_module._accumulate, []

    def accumulate(params, grads, scale):
        calls.append(1)
        original(params, grads, scale * (math.nan if len(calls) > 2 else 1.0))

    monkeypatch.setattr(calm_module, "_accumulate", accumulate)


def _inf_alpha_grad_from_second_step(monkeypatch, out):
    """Only α's direction is +inf: CALM clamps α's gradient (--alpha-grad-clip), which would
    make it look finite after the clamp."""
    original, calls = calm_module._accumulate, []

    def accumulate(params, grads, scale):
        is_alpha = not any("lora" in n for n in params)
        calls.append(is_alpha)
        bad = is_alpha and calls.count(True) > 1
        original(params, {n: g * math.inf if bad else g for n, g in grads.items()}, scale)

    monkeypatch.setattr(calm_module, "_accumulate", accumulate)


def _config_unchanged(out):
    assert (out / "config.json").read_bytes() == (out.parent / "config.before").read_bytes()


def _no_cuda(monkeypatch, out):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


def _disk_refuses(name, code, strerror):
    """A disk that refuses files named `name` (any file of the run when "") with `code`."""
    def inject(monkeypatch, out):
        real = io_module.tempfile.mkstemp

        def mkstemp(*args, dir=None, prefix="", **kwargs):
            if dir is not None and str(dir).startswith(str(out)) and name in prefix:
                raise OSError(code, strerror, str(dir))
            return real(*args, dir=dir, prefix=prefix, **kwargs)

        monkeypatch.setattr(io_module.tempfile, "mkstemp", mkstemp)
    return inject


def _damaged_model_cache(monkeypatch, out):
    folder = out.parent / "cache" / "SmolLM2-135M-Instruct-fp32"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text('{"model_type": "llama", "hidden')
    (folder / "model.safetensors").write_bytes(b"\x00" * 64)
    monkeypatch.setenv("CALM_CACHE_DIR", str(out.parent / "cache"))


def _edit_metric(monkeypatch, out):
    path = out / "metrics.json"
    saved = json.loads(path.read_text())
    saved["results"]["sft"]["sciq"]["accuracy"] = 0.999
    path.write_text(json.dumps(saved))


def _foreign_predictions(monkeypatch, out):
    save_file({"sft/sciq/probs": torch.ones(2, 2) / 2}, out / "predictions.safetensors")


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
    "calm inf α gradient, clamped": Fault(
        [*TINY, "--methods", "calm", "--steps", "3", "--alpha-grad-clip", "1", "--out", "{out}"],
        ["[calm] training diverged: non-finite gradients at step 2"],
        inject=_inf_alpha_grad_from_second_step, after=_checkpoints_finite),
    # --resume continues in its own folder and never rewrites the run's record
    "resume with another --out": Fault(
        ["--resume", "{out}", "--out", "{other}"],
        ["--resume {out} --out {other}: a resumed run continues in its own folder",
         "drop --out"], finished=True, after=_config_unchanged),
    "resume changing a result option": Fault(
        ["--resume", "{out}", "--lr", "0.5"], ["--resume {out}: options differ", "lr"],
        finished=True, after=_config_unchanged),
    # a kept result must be what its saved predictions give
    "resume after metrics.json was edited": Fault(
        ["--resume", "{out}"],
        ["{out}/metrics.json: sft on sciq: accuracy is 0.999 there, but the saved predictions",
         "Delete metrics.json and predictions.safetensors"],
        finished=True, inject=_edit_metric, after=_config_unchanged),
    "resume with predictions lacking labels": Fault(
        ["--resume", "{out}"],
        ["{out}/predictions.safetensors: not a predictions file of this project",
         "Delete metrics.json and predictions.safetensors"],
        finished=True, inject=_foreign_predictions),
    "resume of a finished run": Fault(["--resume", "{out}", "--n-bins", "7"], [], rc=0,
                                      finished=True, after=_config_unchanged),
    # sizes that cannot work are refused before anything loads (exit 2: the configuration)
    "tiny model of odd width": Fault(
        [*TINY, "--tiny-hidden", "12", "--out", "{out}"],
        ["--tiny-hidden: must be a multiple of 8", "got 12"], rc=2),
    "absurd --n-bins": Fault([*TINY, "--n-bins", "1000000000000", "--out", "{out}"],
                             ["--n-bins: at most 100,000"], rc=2),
    "absurd --n-boot": Fault([*TINY, "--n-boot", "1000000000000", "--out", "{out}"],
                             ["--n-boot: at most 1,000,000 resamples"], rc=2),
    "--device cuda without CUDA": Fault(
        [*TINY, "--device", "cuda", "--out", "{out}"],
        ["--device cuda: this machine has no CUDA device", "use --device cpu"], rc=2,
        inject=_no_cuda),
    # the disk refuses a write: the file and what to do, in one line
    "read-only --out": Fault(
        [*TINY, "--methods", "none", "--out", "{out}"],
        ["cannot write {out}/", "read-only file system: give an --out"],
        inject=_disk_refuses("", errno.EROFS, "Read-only file system")),
    "disk full at metrics.json": Fault(
        [*TINY, "--methods", "none", "--out", "{out}"],
        ["cannot write {out}/metrics.json (No space left on device)", "--resume DIR"],
        inject=_disk_refuses("metrics.json", errno.ENOSPC, "No space left on device")),
    "damaged converted model cache": Fault(
        [*TINY, "--methods", "none", "--model", "smollm2", "--out", "{out}"],
        ["the converted model cache is damaged", "Delete that folder and rerun"],
        inject=_damaged_model_cache),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FAULTS))
def test_fault_ends_in_one_line_naming_the_cause(name, finished, tmp_path, monkeypatch, capsys):
    fault = FAULTS[name]
    out, other = tmp_path / "run", tmp_path / "other"
    if fault.finished:
        shutil.copytree(finished, out)
        shutil.copy(out / "config.json", tmp_path / "config.before")
    if fault.inject is not None:
        fault.inject(monkeypatch, out)

    def fill(text):
        return text.replace("{out}", str(out)).replace("{other}", str(other))

    rc = main([fill(a) for a in fault.argv])
    err = capsys.readouterr().err
    assert rc == fault.rc, err
    assert "Traceback" not in err
    for needle in fault.needles:
        assert fill(needle) in err, err
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


@pytest.mark.slow
def test_a_run_that_failed_before_training_is_taken_over_by_its_rerun(tmp_path, monkeypatch,
                                                                     capsys):
    out, real_load = tmp_path / "run", model_lib.load

    def unloadable(*args, **kwargs):
        raise CorruptFile("the model cannot be loaded (a damaged cache, say)")

    monkeypatch.setattr(model_lib, "load", unloadable)
    argv = [*TINY, "--methods", "sft", "--steps", "1", "--out", str(out)]
    assert main([*argv, "--n-test", "4"]) == 1
    assert (out / "config.json").is_file() and (out / prepare.NOT_STARTED).is_file()
    monkeypatch.setattr(model_lib, "load", real_load)
    assert main(argv) == 0  # not "already holds a run": nothing there was trained or evaluated
    assert "failed before training" in capsys.readouterr().err
    # the failed run's record is replaced by the rerun's (other options, other splits)
    assert json.loads((out / "config.json").read_text())["data"]["n_test"] == 8
    assert json.loads((out / "splits.json").read_text())["requested"]["n_test"] == 8
    assert (out / "metrics.json").is_file() and not (out / prepare.NOT_STARTED).exists()
    assert main(argv) == 1  # a run that trained is never taken over
    assert f"--out {out} already holds a run" in capsys.readouterr().err


# the study runner: (argv after the study's name, message, whether --root {root} is a
# regular file rather than a folder)
STUDY_FAULTS = {
    "--root naming a file": (["--summarize"], "--root {root}: a file is there, not a folder", True),
    "absurd --n-boot": (["--summarize", "--n-boot", "1000000000000"],
                        "--n-boot: between 2 and 1,000,000 resamples", False),
}


@pytest.mark.parametrize("name", list(STUDY_FAULTS))
def test_study_fault_is_one_line(name, tmp_path, capsys):
    argv, needle, root_is_file = STUDY_FAULTS[name]
    root = tmp_path / "root"
    if root_is_file:
        root.write_text("not a folder")
    with pytest.raises(SystemExit) as e:
        study_cli.main(["laptop", "--root", str(root), *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err
    assert needle.replace("{root}", str(root)) in err, err


def test_a_damaged_history_file_is_named_with_the_fix(tmp_path):
    path = tmp_path / "history_sft.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo')
    with pytest.raises(DataError) as e:
        study.dynamics(path)
    assert f"{path}: line 2 is not JSON" in str(e.value) and "delete it" in str(e.value)


@pytest.mark.parametrize(("key", "value"), [("step", 1), ("streams", {"train": 0}),
                                            ("history", [{"step": 1, "loss": 0.0}])])
def test_an_edited_state_json_is_refused_by_name(tmp_path, key, value):
    d = tmp_path / "sft"
    checkpoint.save(d, method=_method(), lora={"w": torch.ones(4)}, step=2, config_hash="h",
                    history=[{"step": 1, "loss": 1.5}, {"step": 2, "loss": 1.25}])
    assert checkpoint.load(d)[1]["step"] == 2  # as written, it loads
    meta = json.loads((d / "state.json").read_text())
    meta[key] = value
    (d / "state.json").write_text(json.dumps(meta))
    with pytest.raises(CorruptFile, match="does not match the checksum") as e:
        checkpoint.load(d)
    assert str(d / "state.json") in str(e.value) and f"Delete the folder {d}" in str(e.value)


@pytest.mark.parametrize("content", ["[1, 2]", '"step 2"', "null"])
def test_a_state_json_of_the_wrong_shape_is_refused_as_damaged(tmp_path, content):
    d = tmp_path / "sft"
    checkpoint.save(d, method=_method(), lora={"w": torch.ones(4)}, step=2, config_hash="h",
                    history=[{"step": 1, "loss": 1.5}])
    (d / "state.json").write_text(content)  # valid JSON, not the checkpoint's object
    with pytest.raises(CorruptFile, match="holds a JSON") as e:
        checkpoint.load(d)
    assert str(d / "state.json") in str(e.value) and f"Delete the folder {d}" in str(e.value)
