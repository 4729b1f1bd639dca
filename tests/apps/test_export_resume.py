"""Exports as a resumable stage (issue 29): an export is renamed into place only when whole, and
a resume redoes every kept row's missing or incomplete export from its final checkpoint, equal to
the one the run wrote; a row whose final state was not checkpointed is named with why."""

import json
import logging
import shutil

import pytest
import torch
from safetensors.torch import load_file

from apps.calm_llm.__main__ import main
from apps.calm_llm.export import is_complete

TINY = ["--config", "tiny", "--n-boot", "0", "--no-zero-shot", "--steps", "2"]


def _tensors(path):
    return {k: v.clone() for k, v in load_file(str(path)).items()}


@pytest.mark.slow
def test_a_resume_redoes_missing_and_cut_exports_from_the_final_checkpoint(tmp_path):
    run = tmp_path / "run"
    argv = [*TINY, "--methods", "none", "ts", "sft", "calm", "--checkpoint-every", "1"]
    assert main([*argv, "--out", str(run)]) == 0
    ex = run / "export"
    assert all(is_complete(ex / m) for m in ("ts", "sft", "calm")) and not (ex / "none").exists()
    before = {"sft": _tensors(ex / "sft" / "adapter_model.safetensors"),
              "calm": _tensors(ex / "calm" / "alpha.safetensors"),
              "calm_adapter": _tensors(ex / "calm" / "adapter_model.safetensors")}
    t_before = json.loads((ex / "ts" / "calibration.json").read_text())
    # what a kill or a full disk leaves: a row with no export, one cut short, a partial folder
    shutil.rmtree(ex / "sft")
    (ex / "calm" / "alpha.safetensors").unlink()
    shutil.rmtree(ex / "ts")
    (ex / ".sft.partial").mkdir()
    (ex / ".sft.partial" / "adapter_config.json").write_text("{")
    assert not is_complete(ex / "calm")

    assert main([*argv, "--resume", str(run)]) == 0
    assert all(is_complete(ex / m) for m in ("ts", "sft", "calm"))
    assert not (ex / ".sft.partial").exists()
    for name, path in (("sft", ex / "sft" / "adapter_model.safetensors"),
                       ("calm", ex / "calm" / "alpha.safetensors"),
                       ("calm_adapter", ex / "calm" / "adapter_model.safetensors")):
        after = _tensors(path)
        assert after.keys() == before[name].keys()
        assert all(torch.equal(after[k], before[name][k]) for k in after), name
    assert json.loads((ex / "ts" / "calibration.json").read_text()) == t_before


@pytest.mark.slow
def test_a_row_without_a_final_checkpoint_is_named(tmp_path, caplog):
    run, argv = tmp_path / "run", [*TINY, "--methods", "sft", "--checkpoint-every", "0"]
    assert main([*argv, "--out", str(run)]) == 0
    shutil.rmtree(run / "export" / "sft")
    with caplog.at_level(logging.INFO, logger="apps.calm_llm"):
        assert main([*argv, "--resume", str(run)]) == 0
    assert "[sft] its export" in caplog.text and "cannot be redone" in caplog.text
    assert "--checkpoint-every 0" in caplog.text
