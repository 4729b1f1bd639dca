"""A run killed mid-way and resumed ends with the same metrics as an uninterrupted one;
a non-finite loss stops the run naming the step and the last good checkpoint."""

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from apps.calm_llm import checkpoint
from apps.calm_llm.__main__ import main
from apps.calm_llm.methods.calm import Calm
from apps.calm_llm.methods.sft import SFT

ARGS = ["--config", "tiny", "--methods", "sft", "calm", "--steps", "4", "--checkpoint-every", "2",
        "--n-boot", "0"]


def _results(run):
    return json.loads((run / "metrics.json").read_text())["results"]


@pytest.mark.slow
def test_killed_and_resumed_run_matches_uninterrupted(tmp_path, monkeypatch, capsys):
    assert main([*ARGS, "--out", str(tmp_path / "a")]) == 0
    original = Calm.step

    def killed(self, k):
        if k == 3:
            raise KeyboardInterrupt("simulated kill at step 4")
        return original(self, k)

    monkeypatch.setattr(Calm, "step", killed)
    with pytest.raises(KeyboardInterrupt):
        main([*ARGS, "--out", str(tmp_path / "b")])
    assert set(_results(tmp_path / "b")) == {"sft"}  # sft was evaluated before the kill
    assert (tmp_path / "b" / "checkpoints" / "calm" / "state.safetensors").is_file()
    monkeypatch.setattr(Calm, "step", original)
    capsys.readouterr()
    assert main(["--resume", str(tmp_path / "b")]) == 0
    err = capsys.readouterr().err
    assert "[sft] already evaluated" in err and "resumed from" in err and "at step 2" in err
    # the trained state itself (far more sensitive than rounded metrics) is the same
    for f in ("adapter_model.safetensors", "alpha.safetensors"):
        ta = load_file(str(tmp_path / "a" / "export" / "calm" / f))
        tb = load_file(str(tmp_path / "b" / "export" / "calm" / f))
        assert ta.keys() == tb.keys()
        for k in ta:
            torch.testing.assert_close(tb[k], ta[k], rtol=1e-6, atol=1e-8)
    a, b = _results(tmp_path / "a"), _results(tmp_path / "b")
    assert a.keys() == b.keys() == {"sft", "calm", "calm:no_alpha"}
    for m in a:
        for ds in a[m]:
            for key in ("accuracy", "conf_ece", "nll", "brier"):
                assert b[m][ds][key] == pytest.approx(a[m][ds][key], rel=1e-5, abs=1e-7)


@pytest.mark.slow
def test_resume_refuses_changed_options(tmp_path, capsys):
    assert main([*ARGS[:-4], "--methods", "none", "--n-boot", "0", "--out", str(tmp_path)]) == 0
    assert main(["--resume", str(tmp_path), "--lr", "0.5"]) != 0
    assert "differ" in capsys.readouterr().err


@pytest.mark.slow
def test_non_finite_loss_names_step_and_checkpoint(tmp_path, monkeypatch, capsys):
    original = SFT.step

    def blows_up(self, k):
        info = original(self, k)
        return {**info, "loss": math.nan} if k == 2 else info

    monkeypatch.setattr(SFT, "step", blows_up)
    rc = main(["--config", "tiny", "--methods", "none", "sft", "--steps", "4",
               "--checkpoint-every", "2", "--n-boot", "0", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 1
    assert "non-finite loss" in err and "at step 3" in err
    assert "checkpoints/sft (step 2)" in err
    assert set(_results(tmp_path)) == {"none"}  # what was evaluated is kept


class _Lm:
    def __init__(self):
        self.state = {}

    def load_inner(self, state):
        self.state = state


class _Method:
    """The least a method shows `checkpoint`: a name and (here empty) trained state."""

    name = "sft"
    optimizers: dict = {}
    schedulers: dict = {}
    streams: dict = {}

    def outer_params(self):
        return {}

    def tensors(self):
        return {}

    def load_tensors(self, tensors):
        pass


@pytest.mark.parametrize("left", [".tmp", ".old"])
def test_a_save_killed_between_its_renames_keeps_a_checkpoint(tmp_path, left):
    d = tmp_path / "sft"
    for step in (2, 4):
        checkpoint.save(d, method=_Method(), lora={"w": torch.full((2,), float(step))}, step=step,
                        config_hash="h", history=[])
    # save renames d -> d.old, then d.tmp -> d; a kill in between leaves both (d.tmp is newer)
    d.rename(tmp_path / "sft.old")
    if left == ".tmp":
        checkpoint.save(tmp_path / "x", method=_Method(), lora={"w": torch.full((2,), 6.0)}, step=6,
                        config_hash="h", history=[])
        (tmp_path / "x").rename(tmp_path / "sft.tmp")
    assert checkpoint.exists(d)
    lm = _Lm()
    step, _ = checkpoint.restore(d, method=_Method(), lm=lm, config_hash="h")
    assert step == (6 if left == ".tmp" else 4)
    assert torch.equal(lm.state["w"], torch.full((2,), float(step)))
