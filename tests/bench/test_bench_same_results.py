"""bench.same_results: identical run folders compare equal; one changed number, one flipped
tensor bit, a changed history value or byte, a missing file, and a changed bench rel_error each
count as a difference, with the right max |Δ|; timings are left out."""

import json
import math
import shutil

import pytest
import torch
from safetensors.torch import save_file

from bench import same_results as sr


def _run(path, acc=0.5, probs=None, step_seconds=1.0, results_md="| a |\n"):
    path.mkdir(parents=True)
    metrics = {"config_hash": "h", "results": {"ts": {"sciq": {"accuracy": acc, "n": 8,
                                                               "seconds_per_question": step_seconds}}}}
    (path / "metrics.json").write_text(json.dumps(metrics))
    save_file({"ts/sciq/probs": probs if probs is not None else torch.full((2, 3), 1 / 3),
               "ts/sciq/labels": torch.tensor([0, 2])}, str(path / "predictions.safetensors"))
    (path / "history_sft.jsonl").write_text(
        json.dumps({"step": 1, "loss": 0.25, "step_seconds": step_seconds}) + "\n")
    (path / "splits.json").write_text('{"train": ["a"]}')
    (path / "results.md").write_text(results_md)
    return path


def _differ(rows):
    return {r["what"]: r["differ"] for r in rows}


def test_identical_runs_compare_equal_whatever_their_timings(tmp_path):
    a, b = _run(tmp_path / "a"), _run(tmp_path / "b", step_seconds=9.0)
    rows = sr.compare_folders(a, b)
    assert set(_differ(rows)) == {"metrics.json", "predictions.safetensors", "splits.json",
                                  "results.md", "history_sft.jsonl"}
    assert not any(_differ(rows).values()) and all(r["max_abs"] == 0 for r in rows)
    assert sr.main([str(a), str(b)]) == 0


def test_each_kind_of_change_is_one_difference_with_its_size(tmp_path):
    a = _run(tmp_path / "a")
    probs = torch.full((2, 3), 1 / 3)
    probs[1, 2] = torch.nextafter(probs[1, 2], torch.tensor(1.0))  # one bit
    b = _run(tmp_path / "b", acc=0.625, probs=probs, results_md="| b |\n")
    rows = {r["what"]: r for r in sr.compare_folders(a, b)}
    assert rows["metrics.json"]["differ"] == 1 and rows["metrics.json"]["max_abs"] == 0.125
    assert rows["predictions.safetensors"]["differ"] == 1
    assert 0 < rows["predictions.safetensors"]["max_abs"] < 1e-7
    assert rows["results.md"]["differ"] == 1 and rows["splits.json"]["differ"] == 0
    (b / "splits.json").unlink()
    assert _differ(sr.compare_folders(a, b))["splits.json"] == 1
    assert sr.main([str(a), str(b)]) == 1


def test_folders_of_runs_are_matched_by_their_relative_path(tmp_path):
    _run(tmp_path / "a" / "paper-seed0"), _run(tmp_path / "a" / "chat-seed0")
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    rows = sr.compare_folders(tmp_path / "a", tmp_path / "b")
    assert {r["what"].split("/")[0] for r in rows} == {"paper-seed0", "chat-seed0"}
    shutil.rmtree(tmp_path / "b" / "chat-seed0")
    assert _differ(sr.compare_folders(tmp_path / "a", tmp_path / "b"))["chat-seed0/metrics.json"] == 1


def test_bench_rel_errors_are_matched_by_record_and_compared(tmp_path):
    recs = [{"problem": "quadratic", "size": 100, "method": "aid", "library": "bilevel",
             "rel_error": 1e-6, "seconds_median": 0.1},
            {"problem": "quadratic", "size": 100, "method": "itd", "library": "bilevel",
             "rel_error": None}]
    (tmp_path / "a.json").write_text(json.dumps({"records": recs}))
    (tmp_path / "b.json").write_text(json.dumps({"records": recs[::-1]}))  # order is not identity
    (row,) = sr.compare_bench(tmp_path / "a.json", tmp_path / "b.json")
    assert row["differ"] == 0 and row["compared"] == "1 numbers over 2 records"
    recs[0]["rel_error"] = 3e-6
    (tmp_path / "b.json").write_text(json.dumps({"records": recs}))
    (row,) = sr.compare_bench(tmp_path / "a.json", tmp_path / "b.json")
    assert row["differ"] == 1 and row["max_abs"] == pytest.approx(2e-6)


def test_nan_equals_nan_and_a_value_of_another_type_is_infinitely_far():
    assert sr._delta(math.nan, math.nan) == 0.0
    assert sr._delta("a", "b") == math.inf and sr._delta("a", "a") == 0.0


def test_a_missing_folder_is_named(tmp_path, capsys):
    with pytest.raises(SystemExit):
        sr.main([str(tmp_path / "nope"), str(tmp_path)])
    assert "nope does not exist" in capsys.readouterr().err
