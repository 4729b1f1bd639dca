"""bench.gpu_smoke on the tiny model (CPU): every method's steps are read back from the run's
history, a failing run is reported, not hidden (no timing is asserted)."""

import json

import pytest


@pytest.mark.slow
def test_gpu_smoke_reads_every_methods_steps(tmp_path):
    from bench import gpu_smoke

    stem = tmp_path / "smoke"
    out = gpu_smoke.main(["--config", "tiny", "--methods", "sft", "calm", "--steps", "2",
                          "--device", "cpu", "--out", str(stem), "--keep", str(tmp_path / "run")])
    assert out["meta"]["returncode"] == 0
    for m in ("sft", "calm"):
        r = out["rows"][m]
        assert r["steps"] == 2 and r["max_memory_gib"] is None  # no GPU
        # the row is the summary of the run's own history (nothing is timed here)
        assert r == gpu_smoke.summarize(gpu_smoke.read_history(tmp_path / "run", m))
    saved = json.loads(stem.with_suffix(".json").read_text())
    assert [r["method"] for r in saved["records"]] == ["sft", "calm"]
    assert "| calm | 2 |" in stem.with_suffix(".md").read_text()


def test_summary_of_a_method_without_steps_says_it_failed():
    from bench import gpu_smoke

    assert gpu_smoke.summarize([]) == {"steps": 0}
    one = gpu_smoke.summarize([{"step": 1, "step_seconds": 2.0, "max_memory_gib": 3.5}])
    assert one == {"steps": 1, "first_step_s": 2.0, "step_s": 2.0, "max_memory_gib": 3.5}
    # the first step (warm-up) is reported apart; the median is of the steps after it
    three = gpu_smoke.summarize([{"step_seconds": x} for x in (9.0, 1.0, 3.0, 2.0)])
    assert three["steps"] == 4 and three["first_step_s"] == 9.0 and three["step_s"] == 2.0
    assert "| sft | 0 | failed |" in gpu_smoke.table({"sft": {"steps": 0}})
