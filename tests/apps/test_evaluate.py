"""evaluate: metrics per (method, dataset), the metrics.json shape, tables and files."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from safetensors.torch import load_file

from apps.calm_llm.evaluate import (
    dataset_metrics,
    evaluate_predictions,
    render_table,
    write_results,
)
from apps.calm_llm.tables import fmt
from calibration import metrics

HAS_PLOTS = importlib.util.find_spec("calibration.plots") is not None and importlib.util.find_spec("matplotlib")
REQUIRED = {"domain", "n", "accuracy", "conf_ece", "cw_ece", "brier", "nll", "mean_confidence"}


def _constant(conf: float, n: int, n_correct: int, k: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row puts ``conf`` on option 0 and spreads the rest; the first n_correct are right."""
    p = torch.full((n, k), (1 - conf) / (k - 1), dtype=torch.float64)
    p[:, 0] = conf
    y = torch.tensor([0] * n_correct + [1] * (n - n_correct))
    return p, y


def test_closed_form_conf_ece_and_accuracy():
    p, y = _constant(0.7, 100, 50)
    m = dataset_metrics(p, y, domain="ood", n_boot=50)
    assert REQUIRED <= set(m) and m["domain"] == "ood" and m["n"] == 100
    assert m["accuracy"] == pytest.approx(0.5) and m["mean_confidence"] == pytest.approx(0.7)
    assert m["conf_ece"] == pytest.approx(0.2)  # one bin, |0.5 - 0.7|
    lo, hi = m["conf_ece_ci"]
    assert lo <= m["conf_ece"] <= hi
    assert m["nll"] == pytest.approx(-(0.5 * torch.log(torch.tensor(0.7)) + 0.5 * torch.log(torch.tensor(0.1))).item())


def test_matches_calibration_metrics_and_trims_absent_slots():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(200, 4, generator=g, dtype=torch.float64) * 2
    y = torch.randint(0, 4, (200,), generator=g)
    p4 = logits.softmax(-1)
    p5 = torch.cat([p4, torch.zeros(200, 1, dtype=torch.float64)], 1)  # a 5th, never-present slot
    m = dataset_metrics(p5, y, domain="id", n_boot=0)
    want = metrics.summary(p4, y, n_bins=10)
    for key, v in want.items():
        assert m[key] == pytest.approx(v, rel=1e-12, abs=1e-12), key
    assert m["n_options"] == 4 and m["conf_ece_ci"] is None


def test_json_shape_table_and_files(tmp_path):
    preds = {
        "none": {"mmlu": _constant(0.9, 40, 20), "arc_challenge": _constant(0.8, 30, 12)},
        "calm": {"mmlu": _constant(0.6, 40, 22), "arc_challenge": _constant(0.5, 30, 14)},
    }
    results = evaluate_predictions(preds, {"mmlu": "id", "arc_challenge": "ood"}, n_boot=20)
    table = render_table(results)
    assert "### In-domain" in table and "### Out-of-domain" in table
    assert table.index("### In-domain") < table.index("### Out-of-domain")
    papers = table.split("#### ")[0] + table.split("### Out-of-domain")[1].split("#### ")[0]
    calm_row = [line for line in papers.splitlines() if line.startswith("| calm |")]
    assert len(calm_row) == 2 and "**" in calm_row[0]  # calm has the lower ECE: bold
    assert "0.400 [" in table  # none on mmlu: |0.5 - 0.9|
    write_results(tmp_path, results, preds, extra={"zero_shot_accuracy": 0.5}, plots=False)
    data = json.loads((tmp_path / "metrics.json").read_text())
    assert set(data) == {"results", "zero_shot_accuracy"}
    assert set(data["results"]) == {"none", "calm"}
    for per_ds in data["results"].values():
        assert set(per_ds) == {"mmlu", "arc_challenge"}
        for m in per_ds.values():
            assert REQUIRED <= set(m) and m["domain"] in ("id", "ood")
    assert (tmp_path / "results.md").read_text().count("| none |") == 4  # papers' + every-metric
    saved = load_file(str(tmp_path / "predictions.safetensors"))
    torch.testing.assert_close(saved["calm/mmlu/probs"], preds["calm"]["mmlu"][0].float())
    assert torch.equal(saved["calm/mmlu/labels"], preds["calm"]["mmlu"][1])


@pytest.mark.skipif(not HAS_PLOTS, reason="calibration.plots / matplotlib not available")
def test_reliability_pngs(tmp_path):
    preds = {"none": {"sciq": _constant(0.9, 40, 20)}, "ts": {"sciq": _constant(0.6, 40, 22)}}
    results = evaluate_predictions(preds, {"sciq": "ood"}, n_boot=0)
    write_results(tmp_path, results, preds)
    png = tmp_path / "reliability_sciq.png"
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_errors():
    p, y = _constant(0.7, 10, 5)
    with pytest.raises(ValueError, match="domain"):
        dataset_metrics(p, y, domain="test")
    with pytest.raises(ValueError, match="no domain"):
        evaluate_predictions({"none": {"x": (p, y)}}, {}, n_boot=0)
    with pytest.raises(ValueError, match=r"\(N, K\)"):
        dataset_metrics(p[0], y, domain="id")


def test_a_metric_added_to_the_summary_table_reaches_metrics_json_and_the_results_table(
        tmp_path, monkeypatch):
    # the one edit a new metric needs: an entry in calibration.metrics.SUMMARY
    extra = metrics.SummaryMetric("top2_acc", "top-2 acc", "max",
                                  lambda p, y, b: float((p.topk(2, -1).indices == y[:, None])
                                                        .any(-1).double().mean()))
    monkeypatch.setattr(metrics, "SUMMARY", (*metrics.SUMMARY, extra))
    preds = {"none": {"mmlu": _constant(0.9, 40, 20)}, "calm": {"mmlu": _constant(0.6, 40, 22)}}
    results = evaluate_predictions(preds, {"mmlu": "id"}, n_boot=0)
    write_results(tmp_path, results, preds, plots=False)
    saved = json.loads((tmp_path / "metrics.json").read_text())["results"]
    p, y = preds["calm"]["mmlu"]
    assert saved["calm"]["mmlu"]["top2_acc"] == pytest.approx(extra.fn(p.double(), y, 10), abs=1e-12)
    md = (tmp_path / "results.md").read_text()
    assert "top-2 acc ↑" in md
    assert "| calm | mmlu |" in md and fmt(saved["calm"]["mmlu"]["top2_acc"]) in md
