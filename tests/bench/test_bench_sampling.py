"""bench.sampling --quick on the tiny model: every candidate is timed and recorded (no timing
is asserted)."""

import json
import math

import pytest


@pytest.mark.slow
def test_sampling_quick_tiny(tmp_path):
    from bench import sampling

    stem = tmp_path / "sampling"
    out = sampling.main(["--quick", "--model", "tiny", "--max-new-tokens", "4", "--out", str(stem)])
    records = json.loads(stem.with_suffix(".json").read_text())["records"]
    assert [r["candidate"] for r in records] == ["shared", "shared_generate", "num_return_sequences",
                                                 "n_calls"]
    for r in records:
        assert math.isfinite(r["s_per_question"]) and r["s_per_question"] > 0
    assert out["meta"]["questions"] == 4 and out["meta"]["n"] == 4
    assert 1 <= out["meta"]["mean_answer_tokens"] <= 4
    assert records[0]["ratio_vs_shared"] == 1.0
