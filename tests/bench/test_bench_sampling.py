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
                                                 "n_calls", "hf_generate"]
    for r in records:
        assert math.isfinite(r["s_per_question"]) and r["s_per_question"] > 0
        assert 1 <= r["mean_answer_tokens"] <= 4 and 0 <= r["share_at_max_new_tokens"] <= 1
    assert 1 <= out["meta"]["hf_generate_mean_generated_tokens"] <= 4
    if out["meta"]["hf_generate_same_prompt_ids"]:  # then the plain peer drew the app's samples
        assert out["meta"]["hf_generate_same_answers"] is True
    assert out["meta"]["questions"] == 4 and out["meta"]["n"] == 4
    assert 1 <= out["meta"]["mean_answer_tokens"] <= 4
    assert records[0]["ratio_vs_shared"] == 1.0
    peer = records[-1]
    assert peer["speedup_vs_hf_generate"] == 1.0 == peer["speedup_round_median"]
    for r in records:
        assert r["speedup_round_min"] <= r["speedup_round_median"] <= r["speedup_round_max"]


def test_stop_answers_cut_each_row_after_its_first_stop_token():
    import torch

    from bench.sampling import stop_answers

    stop = torch.zeros(10, dtype=torch.bool)
    stop[[2, 7]] = True
    rows = torch.tensor([[5, 2, 7, 1], [7, 5, 5, 5], [1, 1, 1, 1]])
    assert stop_answers(rows, stop) == [[5, 2], [7], [1, 1, 1, 1]]
