"""apps.study.shift: temperatures against closed forms and known generating temperatures; the
screen calls TS failed exactly where the shifted set's temperature differs from the domain's."""

import json

import numpy as np
import pytest
import torch

from apps import study as S
from apps.study import shift
from tests.numbers import assert_same_numbers


def test_scaled_is_softmax_of_the_logits_over_t_and_keeps_padded_options_empty():
    z = torch.tensor([[2.0, 0.5, -1.0, 0.0], [0.3, 0.1, -0.2, 0.0]], dtype=torch.float64)
    p = torch.softmax(z, -1)
    p[1, 3] = 0.0  # a 3-option question padded to 4
    p[1, :3] = torch.softmax(z[1, :3], -1)
    for t in (0.5, 1.0, 3.7):
        assert torch.allclose(shift.scaled(p, t)[0], torch.softmax(z[0] / t, -1), atol=1e-12)
        assert torch.allclose(shift.scaled(p, t)[1, :3], torch.softmax(z[1, :3] / t, -1), atol=1e-12)
        assert shift.scaled(p, t)[1, 3] == 0.0


def _draw(n, t_true, seed, k=4, scale=4.0):
    """Logits z, and labels drawn from softmax(z / t_true): the model's p = softmax(z) is
    calibrated after scaling by t_true."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, k, generator=g, dtype=torch.float64) * scale
    y = torch.multinomial(torch.softmax(z / t_true, -1), 1, generator=g).squeeze(1)
    return torch.softmax(z, -1), y


@pytest.mark.parametrize("t_true", [0.7, 2.0, 5.0])
def test_the_optimal_temperature_recovers_the_generating_one(t_true):
    p, y = _draw(20000, t_true, seed=1)
    assert shift.optimal_temperature(p, y) == pytest.approx(t_true, rel=0.05)
    cf, halves = shift.cross_fitted(p, y)
    assert halves == pytest.approx([t_true, t_true], rel=0.08)
    assert torch.allclose(cf.sum(-1), torch.ones(len(y), dtype=torch.float64))


STUDY = S.Study(name="shift-fake", description="", seeds=(0,),
                common=("--split-seed", "0", "--in-domain", "sciq", "--out-of-domain", "arc_easy"),
                variants=(S.Variant("paper", ("none", "ts"), ("--prompt-style", "paper")),
                          S.Variant("chat", ("none", "ts"), ("--prompt-style", "chat"))),
                step_s={}, question_s=0.0, run_s=0.0, questions=0)


def _cell(root, name, t_in, t_ood, seed):
    """A finished cell written by the run's writer: the untrained row on SciQ (labels drawn at
    temperature t_in) and ARC-Easy (t_ood), and TS at T_fit = t_in (what TS would fit)."""
    from apps.calm_llm import evaluate

    preds = {"none": {"sciq": _draw(3000, t_in, seed), "arc_easy": _draw(3000, t_ood, seed + 1)}}
    preds["ts"] = {ds: (shift.scaled(p, t_in), y.clone()) for ds, (p, y) in preds["none"].items()}
    preds["none"] = {ds: (p, y.clone()) for ds, (p, y) in preds["none"].items()}
    results = evaluate.evaluate_predictions(preds, {"sciq": "id", "arc_easy": "ood"}, n_bins=10, n_boot=0)
    for r in results["ts"].values():
        r["temperature"] = t_in
    evaluate.write_results(root / name, results, preds, n_bins=10, plots=False)
    (root / name / "config.json").write_text(json.dumps({"n_bins": 10}))


@pytest.mark.slow
def test_ts_fails_where_the_shifted_temperature_differs_and_transfers_where_it_does_not(tmp_path):
    # paper prompts: ARC-Easy needs T 5 where SciQ needs 2 (a domain shift TS cannot follow);
    # chat template: both sets need 2 (nothing shifts within it; the format shift from paper is
    # harmless on SciQ and harmful on ARC-Easy)
    _cell(tmp_path, "paper-seed0", 2.0, 5.0, seed=10)
    _cell(tmp_path, "chat-seed0", 2.0, 2.0, seed=20)
    rows = shift.screen(STUDY, tmp_path)
    by = {(r["fit_on"], r["fit_style"], r["test_set"], r["test_style"]): r for r in rows}
    ts_paper = "sciq calibration split"
    inside = by[(ts_paper, "paper", "sciq", "paper")]
    assert inside["shift"] == "none" and inside["verdict"] == "TS transfers"
    assert inside["t_opt"] == pytest.approx(2.0, rel=0.1)
    ood = by[(ts_paper, "paper", "arc_easy", "paper")]
    assert ood["shift"] == "domain sciq→arc_easy" and ood["verdict"] == "TS fails"
    assert ood["t_opt"] == pytest.approx(5.0, rel=0.1) and ood["gap_ci"][0] > 0
    assert ood["ece_t_fit"] == pytest.approx(
        json.loads((tmp_path / "paper-seed0" / "metrics.json").read_text())["results"]["ts"]
        ["arc_easy"]["conf_ece"], abs=1e-9)  # the TS row's own ECE: same scaling
    assert by[(ts_paper, "paper", "arc_easy", "chat")]["shift"] == "domain sciq→arc_easy, format paper→chat"
    assert by[(ts_paper, "paper", "arc_easy", "chat")]["verdict"] == "TS transfers"
    assert by[(ts_paper, "paper", "sciq", "chat")]["verdict"] == "TS transfers"
    assert by[(ts_paper, "chat", "arc_easy", "paper")]["verdict"] == "TS fails"
    # the reverse domain shift: ARC-Easy's own T_opt applied to SciQ
    back = by[("arc_easy test (its T_opt)", "paper", "sciq", "paper")]
    assert back["shift"] == "domain arc_easy→sciq" and back["verdict"] == "TS fails"
    assert back["t_fit"] == pytest.approx(ood["t_opt"])
    assert len(rows) == 2 * (2 + 2) + 2  # per cell: TS on its 2 sets and the other's 2; 1 reverse
    md = shift.markdown(rows)
    assert md.count("\n") == len(rows) + 2 and "| TS fails |" in md


def test_a_study_with_nothing_finished_is_named(tmp_path):
    with pytest.raises(ValueError, match="no finished cell of study shift-fake"):
        shift.screen(STUDY, tmp_path)
    assert shift.main(["--study", "laptop", "--root", str(tmp_path)]) == 2
    np.testing.assert_equal(list(tmp_path.iterdir()), [])


def test_nll_at_t_opt_is_the_minimum_over_temperatures():
    from calibration.metrics import nll

    p, y = _draw(2000, 3.0, seed=5)
    t = shift.optimal_temperature(p, y)
    best = nll(shift.scaled(p, t), y)
    assert all(best <= nll(shift.scaled(p, s), y) + 1e-12 for s in np.linspace(0.5, 10, 40))


@pytest.mark.slow
def test_the_published_screen_reproduces_from_its_raw_files():
    """docs/results/ts-shift-screen/shift.json is what the screen computes from the committed
    cells (docs/results.md, "Does temperature scaling fail ...")."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "docs" / "results" / "ts-shift-screen"
    rows = shift.screen(S.STUDIES["ts-shift-screen"], root)
    assert_same_numbers(rows, json.loads((root / "shift.json").read_text()))
    assert all(r["verdict"] == "TS transfers" for r in rows) and len(rows) == 10


TRAINED = S.Study(name="trained-fake", description="", seeds=(0,),
                  common=("--split-seed", "0", "--in-domain", "sciq", "--out-of-domain", "arc_easy"),
                  variants=(S.Variant("sft_paper", ("sft",), ("--prompt-style", "paper")),
                            S.Variant("sft_chat", ("sft",), ("--prompt-style", "chat")),
                            S.Variant("instruct", ("sft",), ("--prompt-style", "chat", "--instruction-data",
                                                             "trivia_qa_sft"))),
                  step_s={}, question_s=0.0, run_s=0.0, questions=0)


def _trained_cell(root, name, t_in, t_ood, seed):
    """A finished cell of a trained row only (no TS row): SFT's answers on SciQ drawn at t_in,
    on ARC-Easy at t_ood."""
    from apps.calm_llm import evaluate

    preds = {"sft": {ds: (p.float(), y) for ds, (p, y) in  # float32, as a run saves them
                     (("sciq", _draw(3000, t_in, seed)), ("arc_easy", _draw(3000, t_ood, seed + 1)))}}
    results = evaluate.evaluate_predictions(preds, {"sciq": "id", "arc_easy": "ood"}, n_bins=10, n_boot=0)
    evaluate.write_results(root / name, results, preds, n_bins=10, plots=False)
    (root / name / "config.json").write_text(json.dumps({"n_bins": 10}))


@pytest.mark.slow
def test_a_trained_row_is_screened_with_its_in_domain_temperature(tmp_path):
    # SFT under the paper prompt: ARC-Easy needs T 4 where SciQ needs 1.5 (TS fails); under the
    # chat template both need 1.5; the instruction-trained model needs 0.8 on ARC-Easy
    _trained_cell(tmp_path, "sft_paper-seed0", 1.5, 4.0, seed=30)
    _trained_cell(tmp_path, "sft_chat-seed0", 1.5, 1.5, seed=40)
    _trained_cell(tmp_path, "instruct-seed0", 1.5, 0.8, seed=50)
    rows = shift.screen(TRAINED, tmp_path)
    assert {r["model"] for r in rows} == {"sft"}
    by = {(r["variant"], r["fit_on"], r["fit_style"], r["test_set"]): r for r in rows}
    fit = by[("sft_paper", "sciq test (its T_opt)", "paper", "arc_easy")]
    # T_fit: the row's own NLL-optimal T on the in-domain test set, never applied to that set
    assert fit["t_fit"] == pytest.approx(1.5, rel=0.1) and fit["t_opt"] == pytest.approx(4.0, rel=0.1)
    assert fit["verdict"] == "TS fails" and fit["shift"] == "domain sciq→arc_easy"
    # in TS's own objective too: the NLL gap is the difference of the two NLLs, its interval above 0
    assert fit["nll_gap"] == pytest.approx(fit["nll_t_fit"] - fit["nll_cross_fit"], abs=1e-12)
    assert fit["nll_gap_ci"][0] > 0 and fit["nll_verdict"] == "TS fails"
    chat = by[("sft_chat", "sciq test (its T_opt)", "chat", "arc_easy")]
    assert chat["nll_gap_ci"][0] <= 0 <= chat["nll_gap_ci"][1] + 0.01
    assert ("sft_paper", "sciq test (its T_opt)", "paper", "sciq") not in by
    assert by[("sft_chat", "sciq test (its T_opt)", "chat", "arc_easy")]["verdict"] == "TS transfers"
    assert by[("instruct", "sciq test (its T_opt)", "chat", "arc_easy")]["verdict"] == "TS fails"
    # the format shift pairs only cells that differ in the prompt alone: paper SFT <-> chat SFT,
    # never SFT <-> the instruction-trained model
    fmt = [r for r in rows if "format" in r["shift"]]
    assert {(r["fit_style"], r["variant"]) for r in fmt} == {("paper", "sft_chat"), ("chat", "sft_paper")}
    # per cell: in-domain T on ARC-Easy, ARC-Easy's T on SciQ; 2 × 2 format rows
    assert len(rows) == 3 * 2 + 4
    assert "| sft (sft_paper, seed 0) | sciq test (its T_opt), paper |" in shift.markdown(rows)


@pytest.mark.slow
def test_the_published_trained_screen_reproduces_from_its_raw_files():
    """docs/results/ts-shift-trained/shift.json is what the screen computes from the committed
    cells (docs/results.md, "After fine-tuning")."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "docs" / "results" / "ts-shift-trained"
    rows = shift.screen(S.STUDIES["ts-shift-trained"], root)
    assert_same_numbers(rows, json.loads((root / "shift.json").read_text()))
    # SciQ -> ARC-Easy transfers in ECE after SFT; ARC-Easy's T applied to SciQ does not
    for r in rows:
        reverse = r["fit_on"].startswith("arc_easy")
        assert r["verdict"] == ("TS fails" if reverse else "TS transfers")


@pytest.mark.slow
def test_the_published_final_screen_reproduces_from_its_raw_files():
    """docs/results/final/shift.json (docs/results.md, "The final study"): seed 0's untrained and
    fine-tuned rows recomputed from the committed cells (the whole screen, 5 seeds and every CALM
    variant, takes minutes); and the premise as published: the temperature fitted on SciQ
    transfers to ARC-Easy's test documents in conf-ECE for every model and seed."""
    import dataclasses
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "docs" / "results" / "final"
    final = S.STUDIES["final"]
    seed0 = dataclasses.replace(final, seeds=(0,), variants=tuple(v for v in final.variants
                                                                  if v.name in ("reference", "sft")))
    published = json.loads((root / "shift.json").read_text())
    again = shift.screen(seed0, root)
    assert_same_numbers(again, [r for r in published if r["seed"] == 0
                                and r["variant"] in ("reference", "sft")])
    to_arc_easy = [r for r in published if r["fit_on"] in ("sciq calibration split", "sciq test (its T_opt)")
                   and r["test_set"] == "arc_easy_test"]
    assert len(to_arc_easy) == 1 + 5 * 5  # none; sft, label smoothing and the 3 CALM rows at 5 seeds
    assert all(r["verdict"] == "TS transfers" for r in to_arc_easy)
