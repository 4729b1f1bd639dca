"""Open-QA records → confidences and metrics, against direct computations (no model)."""

from __future__ import annotations

import json
import lzma
import math

import pytest
import torch

from apps.calm_llm.io import CorruptFile
from apps.calm_llm.open_qa import score
from calibration import semantic


def record(i: int, samples: list[str], gold: list[str], greedy: str, logprobs: list[float],
           reply: str | None = "80") -> score.QuestionRecord:
    ids = semantic.ExactMatch().cluster(samples)
    modal = semantic.modal_answer(samples, ids)
    return score.QuestionRecord(
        id=f"q{i}", question=f"question {i}?", answers=gold, samples=samples, cluster_ids=ids,
        modal_answer=modal, modal_correct=semantic.matches(modal, gold), greedy=greedy,
        greedy_logprobs=logprobs, greedy_correct=semantic.matches(greedy, gold),
        verbalized_reply=reply,
        verbalized=None if reply is None else semantic.parse_verbalized_confidence(reply))


@pytest.fixture
def records() -> list[score.QuestionRecord]:
    return [
        record(0, ["Paris", "paris", "Lyon", "Paris."], ["Paris"], "Paris", [-0.1, -0.2], "90"),
        record(1, ["1969", "1968", "1970", "1969"], ["1969"], "1968", [-1.0, -0.5, -0.1], "oops"),
        record(2, ["Mars", "Venus", "Venus", "Venus"], ["Mars"], "Venus", [-0.3], "60%"),
        record(3, ["Nile", "Amazon", "Nile", "Nile"], ["Nile", "River Nile"], "The Nile", [-2.0, -0.01]),
    ]


def test_confidence_kinds_by_hand(records):
    conf, correct = score.confidence_pairs(records, "semantic")
    assert conf.tolist() == [0.75, 0.5, 0.75, 0.75]
    assert correct.tolist() == [True, True, False, True]
    conf, correct = score.confidence_pairs(records, "sequence_probability")
    assert conf.tolist() == pytest.approx([math.exp(-0.15), math.exp(-1.6 / 3), math.exp(-0.3),
                                           math.exp(-2.01 / 2)])
    assert correct.tolist() == [True, False, False, True]  # the greedy answers, judged
    conf, _ = score.confidence_pairs(records, "min_token_probability")
    assert conf.tolist() == pytest.approx([math.exp(-0.2), math.exp(-1.0), math.exp(-0.3),
                                           math.exp(-2.0)])
    conf, correct = score.confidence_pairs(records, "verbalized")  # "oops" does not parse
    assert conf.tolist() == pytest.approx([0.9, 0.6, 0.8]) and correct.tolist() == [True, False, True]
    conf, _ = score.confidence_pairs(records, "split_half", n_splits=7)
    direct = [semantic.split_half_confidence(r.cluster_ids, n_splits=7, seed=0) for r in records]
    assert conf.tolist() == pytest.approx(direct)


def test_dataset_metrics_match_brute_force(records):
    out = score.dataset_metrics(records, domain="id", n_bins=10, n_boot=50, n_splits=10)
    conf = torch.tensor([0.75, 0.5, 0.75, 0.75])
    correct = torch.tensor([1.0, 1.0, 0.0, 1.0])
    # brute force: bins [0.5, 0.6) and [0.7, 0.8) with 1 and 3 questions
    ece = 0.25 * abs(1.0 - 0.5) + 0.75 * abs(2 / 3 - 0.75)
    assert out["semantic_ece"] == pytest.approx(ece)
    assert out["accuracy"] == pytest.approx(0.75)
    assert out["brier"] == pytest.approx(float(((conf - correct) ** 2).mean()))
    assert out["greedy_accuracy"] == pytest.approx(0.5)
    assert out["parse_failures"] == 1
    assert out["confidences"]["verbalized"]["n"] == 3
    lo, hi = out["semantic_ece_ci"]
    assert lo <= hi
    assert out["mean_clusters"] == pytest.approx((2 + 3 + 2 + 2) / 4)


def test_verbalized_off_counts_no_failures(records):
    for r in records:
        r.verbalized_reply, r.verbalized = None, None
    out = score.dataset_metrics(records, domain="ood", n_bins=10, n_boot=0)
    assert out["parse_failures"] == 0 and out["confidences"]["verbalized"] == {"n": 0}
    assert "verbalized" in score.render_table({"none": {"nq_open": out}})


def test_write_and_read_back(tmp_path, records):
    results = {"none": {"trivia_qa": score.dataset_metrics(records, domain="id", n_bins=10,
                                                            n_boot=0)}}
    score.write_results(tmp_path, results, {"none": {"trivia_qa": records}}, n_bins=10,
                        extra={"config_hash": "x"})
    saved = json.loads((tmp_path / "metrics.json").read_text())
    assert saved["task"] == "open_qa" and saved["config_hash"] == "x"
    assert saved["results"]["none"]["trivia_qa"]["semantic_ece"] == pytest.approx(
        results["none"]["trivia_qa"]["semantic_ece"])
    assert score.read_records(tmp_path) == {"none": {"trivia_qa": records}}
    assert (tmp_path / "reliability_trivia_qa.png").stat().st_size > 0
    assert "| none |" in (tmp_path / "results.md").read_text()
    # the xz a published study keeps reads back the same; a cut or damaged one is named
    raw = (tmp_path / score.PREDICTIONS).read_bytes()
    (tmp_path / score.PREDICTIONS).unlink()
    packed = tmp_path / (score.PREDICTIONS + ".xz")
    packed.write_bytes(lzma.compress(raw))
    assert score.read_records(tmp_path) == {"none": {"trivia_qa": records}}
    whole = lzma.compress(raw)
    middle = len(whole) // 2
    flipped = whole[:middle] + bytes([whole[middle] ^ 0xFF]) + whole[middle + 1:]
    for bad in (whole[:40], flipped):  # cut short; damaged inside the stream
        packed.write_bytes(bad)
        with pytest.raises(CorruptFile, match="open_qa_predictions.json.xz"):
            score.read_records(tmp_path)


def test_unknown_kind_is_named(records):
    with pytest.raises(ValueError, match="unknown confidence kind"):
        score.confidence_pairs(records, "entropy")
