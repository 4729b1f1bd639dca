"""The open-QA rows that train nothing (none, ts) share one forward over the calibration split
(`tasks.open_qa.gold_token_logits`), and a row is the same whether it shared it or not."""

from __future__ import annotations

import json

import pytest
import torch

from apps.calm_llm import distributed
from apps.calm_llm.__main__ import main
from apps.calm_llm.open_qa import score
from apps.calm_llm.tasks import open_qa as R

BASE = ["--config", "tiny_open_qa", "--n-boot", "0"]


@pytest.mark.slow
def test_untrained_rows_share_the_calibration_forward(tmp_path, monkeypatch):
    calls = []
    real = R.gold_token_logits

    def counted(ctx, examples):
        calls.append(len(examples))
        return real(ctx, examples)

    monkeypatch.setattr(R, "gold_token_logits", counted)
    shared, alone = tmp_path / "shared", tmp_path / "alone"
    assert main([*BASE, "--methods", "none", "ts", "sft", "--out", str(shared)]) == 0
    assert len(calls) == 2  # none and ts: one forward; sft (trained): its own
    calls.clear()
    assert main([*BASE, "--methods", "ts", "--out", str(alone)]) == 0
    assert len(calls) == 1
    got = json.loads((shared / "metrics.json").read_text())["results"]["ts"]
    want = json.loads((alone / "metrics.json").read_text())["results"]["ts"]
    for ds in want:  # T, its fit and calib_nll, bit for bit, and so every sampled answer
        for key in ("temperature", "nll_before", "nll_after", "calib_nll"):
            assert got[ds][key] == want[ds][key], (ds, key)
    assert score.read_records(shared)["ts"] == score.read_records(alone)["ts"]


def test_a_changed_model_is_not_taken_for_the_initial_one(tmp_path):
    """`Evaluation.at_init` compares the trained tensors, so a non-training row that loaded other weights
    gets its own forward."""
    from apps.calm_llm.config import parse_args

    cfg = parse_args([*BASE, "--out", str(tmp_path)])
    ev = R.build_open_qa(cfg, distributed.init(fsdp=False), R.load_open_qa_splits(cfg))
    assert ev.at_init()
    name, p = next(iter(ev.ctx.lm.inner().items()))
    with torch.no_grad():
        p.add_(1.0)
    assert not ev.at_init()
    ev.ctx.lm.load_inner(ev.init_lora)
    assert ev.at_init(), name
