"""The real entry point under ``accelerate launch`` with the shipped configs, two CPU processes.

``python -m apps.calm_llm`` launched by accelerate with ``configs/accelerate-ddp.yaml`` and
``configs/accelerate-fsdp.yaml`` (gloo on a machine without GPUs) must write the metrics that
one process writes on the combined batch (the global batch is processes × --batch-size). The
runner itself checks that the ranks hold identical LoRA and α tensors after every method and
exits non-zero otherwise; only rank 0 writes results and prints the table.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from apps.calm_llm.__main__ import main

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "apps" / "calm_llm" / "configs"
PER_RANK = 2
# letter mode: every rank's loss is a mean over the same number of answer tokens, so the mean of
# the per-rank means is the combined-batch mean (cloze continuations differ in length)
FLAGS = ["--config", "tiny", "--mode", "letter", "--methods", "calm", "--steps", "2",
         "--inner-steps", "2", "--n-boot", "10", "--checkpoint-every", "0", "--device", "cpu"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("single")
    assert main([*FLAGS, "--batch-size", str(2 * PER_RANK), "--calib-batch-size",
                 str(2 * PER_RANK), "--out", str(out)]) == 0
    return json.loads((out / "metrics.json").read_text())


# ~20 s each on 2 cores, mostly two fresh interpreters importing torch/transformers/peft; the FSDP
# math itself is also checked in-process by test_distributed.py, this run checks the shipped
# accelerate-fsdp.yaml turns it on through the environment
@pytest.mark.slow
@pytest.mark.parametrize("engine", ["ddp", "fsdp"])
def test_accelerate_launch_two_processes_writes_the_single_process_metrics(
    engine, single, tmp_path
):
    launcher = Path(sys.executable).parent / "accelerate"
    cmd = [str(launcher), "launch", "--config_file", str(CONFIGS / f"accelerate-{engine}.yaml"),
           "--num_processes", "2", "--main_process_port", str(_free_port()),
           "-m", "apps.calm_llm", *FLAGS, "--batch-size", str(PER_RANK),
           "--calib-batch-size", str(PER_RANK), "--out", str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    if engine == "fsdp":
        assert "FSDP: base weights sharded over 2 processes" in proc.stderr
    assert proc.stdout.count("In-domain") == 1  # rank 0 alone prints the table
    got = json.loads((tmp_path / "metrics.json").read_text())
    assert got["zero_shot_accuracy"] == single["zero_shot_accuracy"]
    assert got["results"].keys() == single["results"].keys() == {"calm", "calm:no_alpha"}
    for method, per_ds in single["results"].items():
        assert got["results"][method].keys() == per_ds.keys()
        for ds, ref in per_ds.items():
            m = got["results"][method][ds]
            assert m["n"] == ref["n"] and m["accuracy"] == ref["accuracy"], (method, ds)
            for key in ("conf_ece", "cw_ece", "brier", "nll", "mean_confidence"):
                assert m[key] == pytest.approx(ref[key], rel=1e-4, abs=1e-5), (method, ds, key)
    assert (tmp_path / "export" / "calm" / "adapter_config.json").is_file()
