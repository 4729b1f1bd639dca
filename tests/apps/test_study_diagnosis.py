"""calm-diagnosis's declared decision rule (apps/study/diagnosis.py): the pooled differences
against the study's own paired bootstrap, and every outcome of the rule on hand-made numbers."""

import numpy as np
import pytest

from apps.study import diagnosis as D
from apps.study.questions import Questions
from apps.study.stats import paired_difference


def _questions(gen: np.random.Generator, labels: np.ndarray, sharp: float) -> Questions:
    logits = gen.normal(size=(labels.size, 4)) * sharp
    logits[np.arange(labels.size), labels] += 1.0
    p = np.exp(logits - logits.max(1, keepdims=True))
    return Questions.options(p / p.sum(1, keepdims=True), labels)


def _cells(splits=(1, 2), seeds=(0, 1), n=60) -> D.Cells:
    gen = np.random.default_rng(0)
    cells: D.Cells = {}
    for split in splits:
        labels = gen.integers(0, 4, n)  # each split its own questions
        for variant in ("calm", "calib400"):
            for k in seeds:
                qs = {(row, ds): _questions(gen, labels, sharp)
                      for row, sharp in (("calm", 3.0), ("sft", 1.0)) for ds in (D.OOD, D.IN_DOMAIN)}
                cells[(variant, split, k)] = D.CellData({}, qs)
    return cells


def test_a_row_minus_itself_is_exactly_zero():
    d = D.difference(_cells(), ("calm", "calm"), ("calm", "calm"), n_boot=50)
    assert d["diff"] == 0.0 and d["ci"] == [0.0, 0.0] and d["splits"] == [1, 2] and d["n_cells"] == 4


def test_one_split_is_the_studys_own_paired_difference():
    # the oracle: stats.paired_difference, the summary's paired test, on the same rows and seeds
    cells = _cells(splits=(1,))
    rows = [[cells[("calm", 1, k)].questions[(r, D.OOD)] for k in (0, 1)] for r in ("calm", "sft")]
    ref = paired_difference(*rows, n_boot=200, seed=1, labels=([0, 1], [0, 1]),
                            keys=(("calm", "calm"), ("calm", "sft")))["conf_ece"]
    d = D.difference(cells, ("calm", "calm"), ("calm", "sft"), n_boot=200)
    assert d["diff"] == pytest.approx(ref["diff"], abs=1e-12)
    assert d["ci"] == pytest.approx(ref["ci"], abs=1e-12)


def test_split_seeds_pool_as_the_mean_of_their_paired_differences():
    cells = _cells()
    per = [D.difference({k: v for k, v in cells.items() if k[1] == s}, ("calib400", "calm"),
                        ("calm", "calm"), n_boot=200) for s in (1, 2)]
    d = D.difference(cells, ("calib400", "calm"), ("calm", "calm"), n_boot=200)
    assert d["diff"] == pytest.approx(np.mean([p["diff"] for p in per]), abs=1e-12)
    # an average of two independent resamplings: its interval is inside the hull of theirs
    assert min(p["ci"][0] for p in per) <= d["ci"][0] <= d["ci"][1] <= max(p["ci"][1] for p in per)


def test_a_split_enters_only_with_the_training_seeds_both_rows_have():
    cells = _cells()
    del cells[("calib400", 2, 1)]
    d = D.difference(cells, ("calib400", "calm"), ("calm", "calm"), n_boot=20)
    assert d["splits"] == [1, 2] and d["n_cells"] == 3
    with pytest.raises(ValueError, match="no split seed"):
        D.difference(cells, ("absent", "calm"), ("calm", "calm"), n_boot=20)


def _diffs() -> dict:
    """Every difference the rule reads, each lying above 0 (the row loses) and over 0.02."""
    names = [f"{v}: {r} − {b}" for v, r in D.CALM_ROW.items() for b in ("sft", "ts")]
    names += ["calib400 calm − calm calm", "calm: calm:no_alpha − calm"]
    return {n: {"diff": 0.05, "ci": [0.01, 0.09]} for n in names}


GAPS = {"calm": 0.10, "calib400": 0.04}


def test_c_needs_both_the_ece_win_and_the_halved_gap():
    win = {"calib400 calm − calm calm": {"diff": -0.05, "ci": [-0.08, -0.01]}}
    v = D.decide({**_diffs(), **win}, GAPS)
    assert v["outcome"] == "c"
    assert D.decide({**_diffs(), **win}, {"calm": 0.10, "calib400": 0.06})["outcome"] != "c"


def test_b_needs_the_option_temperature_to_work_where_per_token_calm_does_not():
    opt = {"option_temperature: calm − ts": {"diff": 0.015, "ci": [-0.01, 0.04]}}  # within 0.02
    v = D.decide({**_diffs(), **opt}, GAPS)
    assert v["outcome"] == "b" and v["confirmatory"] == []  # does not beat its SFT
    calm_ok = {"calm: calm − sft": {"diff": -0.03, "ci": [-0.05, -0.01]}}
    assert D.decide({**_diffs(), **opt, **calm_ok}, GAPS)["outcome"] != "b"


def test_a_needs_alpha_off_no_better_and_the_vocabulary_temperature_losing():
    v = D.decide(_diffs(), GAPS)  # nothing works; no_alpha − calm lies above 0; vocab loses
    assert v["outcome"] == "a"
    no_alpha_better = {"calm: calm:no_alpha − calm": {"diff": -0.03, "ci": [-0.05, -0.01]}}
    assert D.decide({**_diffs(), **no_alpha_better}, GAPS)["outcome"] == "undecided"
    vocab_unclear = {"vocab_temperature: calm_scalar − sft": {"diff": 0.02, "ci": [-0.01, 0.05]}}
    assert D.decide({**_diffs(), **vocab_unclear}, GAPS)["outcome"] == "undecided"
    calm_unclear = {"calm: calm − sft": {"diff": 0.02, "ci": [-0.01, 0.05]}}  # "loses ... as calm does"
    assert D.decide({**_diffs(), **calm_unclear}, GAPS)["outcome"] == "undecided"


def test_a_confirmatory_test_is_earned_only_by_beating_sft_and_coming_within_002_of_ts():
    earn = {"value_gap: calm − sft": {"diff": -0.04, "ci": [-0.07, -0.01]},
            "value_gap: calm − ts": {"diff": 0.01, "ci": [-0.02, 0.04]}}
    assert D.decide({**_diffs(), **earn}, GAPS)["confirmatory"] == ["value_gap"]
    near_only = {"value_gap: calm − ts": {"diff": 0.01, "ci": [-0.02, 0.04]}}
    assert D.decide({**_diffs(), **near_only}, GAPS)["confirmatory"] == []


def test_the_exploratory_sft_ts_row_is_sft_at_its_sciq_nll_temperature():
    cells = _cells(splits=(1,), seeds=(0,))
    for c in cells.values():  # pad a fifth option that does not exist (probability 0)
        for key, q in list(c.questions.items()):
            c.questions[key] = Questions.options(np.pad(q.x, ((0, 0), (0, 1))), q.y)
    D.add_sft_ts(cells)
    c = cells[("calm", 1, 0)]
    t = c.last["sft+ts"]["temperature"]
    sciq, scaled = c.questions[("sft", D.IN_DOMAIN)], c.questions[("sft+ts", D.IN_DOMAIN)]
    np.testing.assert_allclose(scaled.x.sum(1), 1.0, atol=1e-12)
    assert (scaled.x[:, -1] == 0).all()  # the padded option stays impossible

    def nll(temp):
        z = np.log(sciq.x[:, :4]) / temp
        z -= z.max(1, keepdims=True)
        return float(np.mean(np.log(np.exp(z).sum(1)) - z[np.arange(sciq.n), sciq.y]))

    assert nll(t) <= min(nll(t * 1.05), nll(t / 1.05)) + 1e-12  # a minimum of the SciQ NLL
    expected = np.exp(np.log(c.questions[("sft", D.OOD)].x[:, :4]) / t)
    np.testing.assert_allclose(c.questions[("sft+ts", D.OOD)].x[:, :4],
                               expected / expected.sum(1, keepdims=True), atol=1e-10)


def test_the_published_verdict_is_what_the_published_cells_give():
    # docs/results/calm-diagnosis/verdict.json, recomputed from the 16 published cells (their
    # predictions, metrics and histories) with the same resamples: the rule's outcome and every
    # number; docs/results.md quotes this file
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "docs" / "results" / "calm-diagnosis"
    published = json.loads((root / "verdict.json").read_text())
    again = json.loads(json.dumps(D.verdict(root, n_boot=published["n_boot"])))
    assert again["n_cells"] == 16
    assert (again["outcome"], again["confirmatory"], again["clauses"]) == (
        published["outcome"], published["confirmatory"], published["clauses"])

    def close(a, b, path=""):
        if isinstance(a, dict):
            assert a.keys() == b.keys(), path
            for k in a:
                close(a[k], b[k], f"{path}/{k}")
        elif isinstance(a, list):
            assert len(a) == len(b), path
            for i, (x, y) in enumerate(zip(a, b)):
                close(x, y, f"{path}/{i}")
        elif isinstance(a, float):
            assert a == pytest.approx(b, abs=1e-9), path
        else:
            assert a == b, path

    close(again, published)
