"""The whole CLI on the tiny preset: every method, run-directory contents, metrics.json shape."""

import json

import pytest

from apps.calm_llm import config as C
from apps.calm_llm.__main__ import main

KEYS = {"domain", "n", "accuracy", "conf_ece", "cw_ece", "brier", "nll", "mean_confidence"}


@pytest.mark.slow
def test_every_method_end_to_end(tmp_path, capsys):
    rc = main(["--config", "tiny", "--methods", *C.METHODS, "--steps", "2", "--n-boot", "10",
               "--checkpoint-every", "0", "--out", str(tmp_path)])
    assert rc == 0
    out, err = capsys.readouterr()
    assert "zero-shot accuracy on sciq" in err and "zero-shot accuracy on arc_easy" in err
    assert "In-domain" in out and "Out-of-domain" in out  # the printed table
    for f in ("config.json", "metrics.json", "results.md", "splits.json", "predictions.safetensors",
              "reliability_sciq.png", "reliability_arc_easy.png"):
        assert (tmp_path / f).is_file(), f
    saved = C.from_dict(json.loads((tmp_path / "config.json").read_text()))
    assert saved.methods == list(C.METHODS)
    results = json.loads((tmp_path / "metrics.json").read_text())["results"]
    assert [r for r in results if ":" not in r] == list(C.METHODS)
    # each trained CALM variant is also evaluated without α
    assert {r for r in results if ":" in r} == {f"{m}:no_alpha" for m in C.METHODS if m.startswith("calm")}
    for method, per_ds in results.items():
        assert set(per_ds) == {"sciq", "arc_easy"}
        assert per_ds["sciq"]["domain"] == "id" and per_ds["arc_easy"]["domain"] == "ood"
        for m in per_ds.values():
            assert KEYS <= set(m), method
            assert 0 <= m["accuracy"] <= 1 and 0 <= m["conf_ece"] <= 1
    assert results["ts"]["sciq"]["temperature"] > 0
    # untouched model and TS share predictions (accuracy is invariant to a temperature)
    assert results["ts"]["sciq"]["accuracy"] == results["none"]["sciq"]["accuracy"]
    for m in ("sft", "calm", "calm_scalar"):
        assert (tmp_path / "export" / m / "adapter_config.json").is_file()
    assert (tmp_path / "export" / "calm" / "alpha.json").is_file()
    assert not (tmp_path / "export" / "sft" / "alpha.json").exists()


def test_bad_config_fails_before_loading_anything(capsys):
    assert main(["--alpha-support", "options", "--mode", "cloze"]) == 2
    assert "--alpha-support options needs --mode letter" in capsys.readouterr().err


@pytest.mark.slow
def test_every_trained_method_runs_under_gradient_checkpointing(tmp_path):
    """The paper-7b preset checkpoints activations; the forwards at parameters other than the
    live LoRA tensors (BOME's inner iterates, calm_iterate's detached θ) must still train."""
    trained = [m for m in C.METHODS if m not in ("none", "ts")]
    rc = main(["--config", "tiny", "--gradient-checkpointing", "--methods", *trained, "--steps", "1",
               "--n-boot", "0", "--no-zero-shot", "--no-eval-without-alpha",
               "--checkpoint-every", "0", "--out", str(tmp_path)])
    assert rc == 0
    results = json.loads((tmp_path / "metrics.json").read_text())["results"]
    assert list(results) == trained
