"""apps.study: cells are ordinary runs, finished cells are skipped, the summary pools seeds."""

import json

import numpy as np
import pytest
import torch

from apps import study as S
from calibration.metrics import conf_ece
from calibration.semantic import semantic_ece
from tests.numbers import assert_same_numbers

TINY = S.Study(
    name="tiny",
    description="tiny model",
    common=("--config", "tiny", "--n-boot", "0", "--split-seed", "0", "--steps", "2",
            "--eval-calib", "--no-zero-shot"),
    seeds=(0, 1),
    variants=(S.Variant("reference", ("none",), seeds=(0,)),
              S.Variant("sft", ("sft",), note="plain fine-tuning")),
    step_s={"sft": 1.0}, question_s=0.01, run_s=1.0, questions=24, baselines=("sft/sft",),
    chance_table=True,
    primary=(S.Comparison("reference/none", "sft/sft", "sciq", "error", "fine-tuning calibrates"),
             S.Comparison("sft/sft", "reference/none", "arc_easy", "accuracy", "it transfers")),
)


@pytest.mark.slow
def test_cells_run_skip_and_summarize(tmp_path, capsys):
    root = tmp_path / "study"
    assert [c.name for c in S.cells(TINY)] == ["reference-seed0", "sft-seed0", "sft-seed1"]
    assert S.run(TINY, root, dry_run=True) == 0
    assert "3 to run" in capsys.readouterr().out and not root.exists()

    assert S.run(TINY, root) == 0
    log = [json.loads(line) for line in (root / "cells.jsonl").read_text().splitlines()]
    assert [e["cell"] for e in log] == ["reference-seed0", "sft-seed0", "sft-seed1"]
    assert all(e["rc"] == 0 for e in log)
    # the split seed keeps the questions fixed across training seeds
    splits = [json.loads((root / c / "splits.json").read_text()) for c in ("sft-seed0", "sft-seed1")]
    assert splits[0]["splits"] == splits[1]["splits"]

    # a second run has nothing left to do
    assert S.run(TINY, root) == 0
    assert len((root / "cells.jsonl").read_text().splitlines()) == 3

    # a cell killed after it wrote its config is resumed, not restarted
    (root / "sft-seed1" / "metrics.json").unlink()
    assert not S.done(root / "sft-seed1", S.cells(TINY)[2])
    assert S.run(TINY, root) == 0
    last = json.loads((root / "cells.jsonl").read_text().splitlines()[-1])
    assert last["argv"] == ["--resume", str(root / "sft-seed1")] and last["rc"] == 0

    out = S.summarize(TINY, root, n_boot=50)
    # every cell's split fingerprints, as its run recorded them: the same questions in each
    fps = out["split_fingerprints"]
    assert sorted(fps) == ["reference-seed0", "sft-seed0", "sft-seed1"]
    assert fps["sft-seed0"] == fps["sft-seed1"] == fps["reference-seed0"] and "test/sciq" in fps["sft-seed0"]
    assert out["roles"]["ood"] == "development"
    row = out["rows"]["sft/sft"]
    assert row["seeds"] == [0, 1]
    per_seed = [json.loads((root / f"sft-seed{k}" / "metrics.json").read_text())["results"]["sft"]
                for k in (0, 1)]
    d = row["datasets"]["sciq"]
    assert d["mean"]["conf_ece"] == pytest.approx(np.mean([r["sciq"]["conf_ece"] for r in per_seed]))
    assert d["std"]["accuracy"] == pytest.approx(np.std([r["sciq"]["accuracy"] for r in per_seed], ddof=1))
    assert "calib_nll" in d["mean"]
    lo, hi = d["conf_ece_pooled_ci"]
    assert 0.0 <= lo <= hi <= 1.0
    assert "| sft/sft | 2 |" in (root / "study.md").read_text()
    c = d["vs_chance"]  # the first seed's prediction against picking at random
    assert c["n"] == 8 and c["accuracy"] == pytest.approx(per_seed[0]["sciq"]["accuracy"])
    assert "## Accuracy against chance" in (root / "study.md").read_text()
    none = out["rows"]["reference/none"]["datasets"]["sciq"]
    assert none["std"]["accuracy"] == 0.0
    vs = none["vs"]["sft/sft"]["conf_ece"]
    assert vs["diff"] == pytest.approx(none["mean"]["conf_ece"] - d["mean"]["conf_ece"])
    assert vs["ci"][0] <= vs["ci"][1] and 0.0 <= vs["p_not_better"] <= 1.0
    assert "sft/sft" not in d["vs"]  # a baseline is not compared with itself
    # the primary family: the same paired numbers, Holm-adjusted together
    first, second = out["primary"]
    assert first["diff"] == vs["diff"] and first["ci"] == vs["ci"] and first["p"] == vs["p"]
    from calibration.stats import holm

    assert [first["p_holm"], second["p_holm"]] == pytest.approx(list(holm([first["p"], second["p"]])))
    assert all(e["verdict"] in ("cannot tell", "row lower", "row higher") for e in out["primary"])
    assert "## Primary comparisons" in (root / "study.md").read_text()

    # figures pool the seeds' predictions: 2 seeds x 8 questions, in seed order
    from apps.study import figures as study_figures

    pooled = study_figures._pooled(TINY, root, "sft/sft")["sciq"]
    from safetensors.torch import load_file

    first = load_file(str(root / "sft-seed0" / "predictions.safetensors"))
    assert pooled[0].shape[0] == 16 and np.array_equal(pooled[1][:8], first["sft/sciq/labels"].numpy())
    assert np.allclose(pooled[0][:8], first["sft/sciq/probs"].double().numpy())
    figs = study_figures.reliability(TINY, root, tmp_path / "figs", ("reference/none", "sft/sft"))
    figs.append(study_figures.training_curves(TINY, root, tmp_path / "figs"))
    assert {p.name for p in figs} >= {"reliability_sciq.png", "training_loss.png"}
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in figs)

    # publishing copies the small files only; a published study summarises again without its
    # predictions, carrying the question-level numbers of the summary it was published with
    dest = tmp_path / "published"
    S.publish(TINY, root, dest)
    assert {p.name for p in (dest / "sft-seed0").iterdir()} == {
        "config.json", "metrics.json", "results.md", "predictions.safetensors", "history_sft.jsonl"}
    assert {p.name for p in dest.iterdir() if p.is_file()} == {"study.json", "study.md", "cells.jsonl"}
    for f in dest.glob("*/predictions.safetensors"):
        f.unlink()
    again = S.summarize(TINY, dest, n_boot=50)
    d2 = again["rows"]["sft/sft"]["datasets"]["sciq"]
    assert d2["mean"] == d["mean"] and d2["conf_ece_pooled_ci"] == list(d["conf_ece_pooled_ci"])
    assert d2["carried"] == ["conf_ece_pooled_ci"]
    assert again["rows"]["reference/none"]["datasets"]["sciq"]["vs"] == none["vs"]
    assert "†" in (dest / "study.md").read_text()
    # numbers carried from a summary of the earlier question-only bootstrap (no "procedure") are
    # marked as narrower (‡), and stay marked when carried again
    earlier = json.loads((dest / "study.json").read_text())
    del earlier["procedure"]
    (dest / "study.json").write_text(json.dumps(earlier))
    for _ in range(2):
        marked = S.summarize(TINY, dest, n_boot=50)["rows"]["sft/sft"]["datasets"]["sciq"]
        assert marked["carried_questions_only"] == ["conf_ece_pooled_ci"]
        assert "]‡" in (dest / "study.md").read_text()
    # with no earlier summary there is nothing to carry: the metrics alone
    (dest / "study.json").unlink()
    bare = S.summarize(TINY, dest, n_boot=50)["rows"]["sft/sft"]["datasets"]["sciq"]
    assert "conf_ece_pooled_ci" not in bare and bare["vs"] == {} and bare["mean"] == d["mean"]


def test_cells_are_parsed_by_the_run_config_and_a_bad_one_names_itself():
    from apps.calm_llm.config import ConfigError

    cfg = S.cells(TINY)[1].config(TINY)
    assert cfg.train.steps == 2 and cfg.seed == 0 and list(cfg.methods) == ["sft"]
    with pytest.raises(ConfigError, match="study tiny, cell bad-seed0: .*--steps"):
        S.Cell(S.Variant("bad", ("sft",), ("--steps", "0")), 0).config(TINY)


def test_pooled_interval_resamples_questions_jointly():
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 3, 40)
    probs = [rng.dirichlet(np.ones(3), 40) for _ in range(3)]
    seeds = [S.Questions.options(p, labels) for p in probs]
    lo, hi = S.pooled_interval(seeds, n_boot=200)
    mean = np.mean([conf_ece(torch.from_numpy(p), torch.from_numpy(labels)) for p in probs])
    assert lo < mean < hi
    # identical seeds: the pooled interval is the single-seed bootstrap of the same resamples
    # (the seed draws come from their own stream, so the question draws are the same)
    same = S.pooled_interval(seeds[:1] * 3, n_boot=200)
    assert same == pytest.approx(S.pooled_interval(seeds[:1], n_boot=200))
    # one seed: exactly the per-run interval of calibration.metrics.bootstrap, same rng seed
    from calibration.metrics import bootstrap

    iv = bootstrap(conf_ece, probs[0], labels, n=200, seed=0)
    assert S.pooled_interval(seeds[:1], n_boot=200) == (iv.low, iv.high)


def test_seed_variance_widens_the_pooled_interval_and_shared_seeds_pair_rows():
    rng = np.random.default_rng(4)
    labels = rng.integers(0, 2, 200)

    def seed_probs(shift: float) -> np.ndarray:  # a seed's confidence offset: seed variance
        p = np.clip(0.6 + shift + 0.1 * rng.standard_normal(200), 0.5, 0.99)
        return np.stack([np.where(labels == 0, p, 1 - p), np.where(labels == 0, 1 - p, p)], 1)

    varied = [S.Questions.options(seed_probs(s), labels) for s in (-0.15, 0.0, 0.15)]
    lo, hi = S.pooled_interval(varied, n_boot=200)
    draws = S.DatasetDraws(200, n_boot=200)
    fixed = [draws.values(("row", k), [q], [0])["error"] for k, q in enumerate(varied)]
    # the question-only interval of the seed mean: the same question draws, seeds held fixed
    question_only = np.quantile(np.mean(fixed, axis=0), [0.025, 0.975])
    assert hi - lo > 1.5 * (question_only[1] - question_only[0])
    # a row against a copy of itself run with the same seeds: identical draws, exactly 0
    same = S.paired_difference(varied, varied, n_boot=50, labels=((0, 1, 2), (0, 1, 2)))
    assert same["conf_ece"]["ci"] == [0.0, 0.0] and same["conf_ece"]["p"] == 1.0
    # the same predictions under other seed labels: independent seed draws, no longer 0
    other = S.paired_difference(varied, varied, n_boot=50, labels=((0, 1, 2), (3, 4, 5)))
    assert other["conf_ece"]["diff"] == 0.0 and other["conf_ece"]["ci"][1] > 0.0


def test_paired_difference_of_a_row_with_itself_is_exactly_zero():
    rng = np.random.default_rng(1)
    labels = rng.integers(0, 4, 30)
    probs = [rng.dirichlet(np.ones(4), 30) for _ in range(2)]
    rows = [S.Questions.options(p, labels) for p in probs]
    same = S.paired_difference(rows, rows, n_boot=50)
    for m in ("conf_ece", "accuracy"):
        assert same[m]["diff"] == 0.0 and same[m]["ci"] == [0.0, 0.0]
        assert same[m]["p_not_better"] == 1.0  # never better than itself
    # a perfect row beats a uniform one in accuracy on every resample
    perfect = [S.Questions.options(np.eye(4)[labels], labels)]
    uniform = np.full((30, 4), 0.25)
    acc = S.paired_difference(perfect, [S.Questions.options(uniform, labels)], n_boot=50)["accuracy"]
    assert acc["diff"] == pytest.approx(1.0 - np.mean(np.argmax(uniform, 1) == labels))
    assert acc["p_not_better"] == 0.0


def test_open_qa_rows_resample_semantic_ece_of_each_seeds_own_answers():
    rng = np.random.default_rng(2)
    ids = [f"q{i}" for i in range(50)]
    # open QA: each seed answers for itself, so correctness differs between seeds
    a = [S.Questions.binary(rng.uniform(0, 1, 50), rng.uniform(0, 1, 50) < 0.3, ids) for _ in range(3)]
    b = [S.Questions.binary(rng.uniform(0, 0.2, 50), rng.uniform(0, 1, 50) < 0.1, ids) for _ in range(3)]
    exact = [semantic_ece(torch.from_numpy(q.x), torch.from_numpy(q.y), 10) for q in a]
    lo, hi = S.pooled_interval(a, n_boot=200)
    assert lo < np.mean(exact) < hi
    diff = S.paired_difference(a, b, n_boot=100)
    assert set(diff) == {"semantic_ece", "accuracy"}
    exact_b = [semantic_ece(torch.from_numpy(q.x), torch.from_numpy(q.y), 10) for q in b]
    assert diff["semantic_ece"]["diff"] == pytest.approx(np.mean(exact) - np.mean(exact_b))
    assert diff["accuracy"]["diff"] == pytest.approx(
        np.mean([q.y.mean() for q in a]) - np.mean([q.y.mean() for q in b]))
    # a row against itself is exactly 0; identical seeds pool to the single-seed interval
    same = S.paired_difference(a, a, n_boot=50)
    assert all(same[m]["diff"] == 0.0 and same[m]["ci"] == [0.0, 0.0] for m in same)
    assert S.pooled_interval(a[:1] * 3, n_boot=100) == pytest.approx(S.pooled_interval(a[:1], n_boot=100))
    # rows are only paired on the same questions, and only with rows of their own kind
    other = [S.Questions.binary(q.x, q.y, [f"r{i}" for i in range(50)]) for q in b]
    with pytest.raises(ValueError, match="different questions"):
        S.paired_difference(a, other, n_boot=10)
    with pytest.raises(ValueError, match="disagree"):
        S.pooled_interval([a[0], S.Questions.options(np.full((50, 2), 0.5), np.zeros(50, int))])
    # multiple choice saves no ids: its seeds must at least share the labels
    p = np.full((50, 2), 0.5)
    with pytest.raises(ValueError, match="different questions"):
        S.pooled_interval([S.Questions.options(p, np.zeros(50, int)), S.Questions.options(p, np.ones(50, int))])


def test_dynamics_average_the_steps_and_keep_alphas_last_range(tmp_path):
    f = tmp_path / "history_calm.jsonl"
    steps = [{"step": k, "lambda": 0.1 * k, "cos": -0.5 + k, "cos_outer": 0.0, "cos_inner": 1.0,
              "calib_entropy": 2.0, "alpha_tau_min": 1.0 - 0.1 * k, "alpha_tau_max": 1.0 + 0.1 * k,
              "alpha_l_min": -k, "alpha_l_max": k, "alpha_moved": 10 * k} for k in (1, 2, 3)]
    f.write_text("\n".join(json.dumps(s) for s in steps) + "\n")
    d = S.dynamics(f)
    assert d["mean_lambda"] == pytest.approx(0.2) and d["mean_cos"] == pytest.approx(1.5)
    assert d["last_alpha_tau_max"] == pytest.approx(1.3) and d["last_alpha_moved"] == 30
    # an SFT history (loss only) has no BOME dynamics
    (tmp_path / "h.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n")
    assert S.dynamics(tmp_path / "h.jsonl") == {}


@pytest.mark.parametrize("name", sorted(S.STUDIES))
def test_every_cell_of_a_shipped_study_is_a_valid_run(name):
    from apps.calm_llm import config as C

    study = S.STUDIES[name]
    for cell in S.cells(study):
        cfg = C.parse_args(cell.argv(study))  # raises ConfigError naming a bad option
        assert cfg.seed == cell.seed and list(cfg.methods) == list(cell.variant.methods)
    assert S.estimate_s(study, S.cells(study)[0]) > 0


def test_against_chance_counts_each_questions_options():
    # two questions with 2 options, two with 4 (zero-padded); three of four right
    probs = np.array([[0.9, 0.1, 0, 0], [0.3, 0.7, 0, 0], [0.1, 0.2, 0.3, 0.4], [0.7, 0.1, 0.1, 0.1]])
    labels = np.array([0, 0, 3, 0])
    c = S.against_chance(probs, labels)
    p = np.array([0.5, 0.5, 0.25, 0.25])
    assert c["n"] == 4 and c["accuracy"] == 0.75 and c["chance"] == pytest.approx(p.mean())
    assert c["z"] == pytest.approx((3 - p.sum()) / np.sqrt(np.sum(p * (1 - p))))
    # at chance on average: z = 0
    assert S.against_chance(np.full((4, 2), 0.5) * [[1, 0.9]], np.array([0, 1, 0, 1]))["z"] == 0.0


def test_open_qa_cells_summarize_semantic_ece_of_every_confidence(tmp_path):
    study = S.Study(name="oq", description="open QA", common=(), seeds=(0, 1),
                    variants=(S.Variant("v", ("sft",)),), step_s={}, question_s=0.0, run_s=0.0,
                    questions=0)
    for k, ece in ((0, 0.1), (1, 0.3)):  # the shape open_qa.score.write_results gives
        r = {"domain": "id", "n": 5, "accuracy": 0.2, "greedy_accuracy": 0.4, "semantic_ece": ece,
             "semantic_ece_ci": [0.0, 0.5], "brier": 0.2, "auroc": 0.5, "parse_failures": 1,
             "confidences": {"semantic": {"semantic_ece": ece, "mean_confidence": 0.3},
                             "verbalized": {"semantic_ece": 0.5, "mean_confidence": 0.9}}}
        (tmp_path / f"v-seed{k}").mkdir()
        (tmp_path / f"v-seed{k}" / "metrics.json").write_text(
            json.dumps({"task": "open_qa", "results": {"sft": {"trivia_qa": r}}}))
    d = S.summarize(study, tmp_path, n_boot=10)["rows"]["v/sft"]["datasets"]["trivia_qa"]
    assert d["mean"]["semantic_ece"] == pytest.approx(0.2)
    assert d["mean"]["semantic_ece/verbalized"] == 0.5 and d["mean"]["mean_confidence"] == 0.3
    assert "semantic_ece_pooled_ci" not in d and d["vs"] == {}  # no saved answers
    md = (tmp_path / "study.md").read_text()
    assert "Semantic-ECE (semantic) | pooled 95% CI of Semantic-ECE (semantic) | Semantic-ECE (verbalized)" in md
    assert "0.200 ± 0.141" in md


def _record(i: int, clusters: list[int], right: bool):
    from apps.calm_llm.open_qa import score

    return score.QuestionRecord(id=f"q{i}", question=f"question {i}?", answers=["a"],
                                samples=[f"s{c}" for c in clusters], cluster_ids=clusters,
                                modal_answer="a" if right else "b", modal_correct=right,
                                greedy="a", greedy_logprobs=[-0.5], greedy_correct=True)


def test_open_qa_cells_pair_rows_on_their_saved_records(tmp_path):
    """Cells written by the open-QA writer: the study reads each row's records back, so open QA
    gets the pooled Semantic-ECE interval and the paired tests multiple choice has."""
    from apps.calm_llm.open_qa import score

    study = S.Study(name="oq", description="open QA", common=(), seeds=(0, 1),
                    variants=(S.Variant("v", ("ts", "sft")),), step_s={}, question_s=0.0,
                    run_s=0.0, questions=0, baselines=("{variant}/ts",))
    rng = np.random.default_rng(3)
    expected = {"ts": [], "sft": []}
    for k in (0, 1):
        records, results = {}, {}
        for row, agree in (("ts", 4), ("sft", 1)):  # ts's samples agree more: higher confidence
            recs = [_record(i, [0] * agree + list(range(1, 5 - agree)),
                            bool(rng.uniform() < 0.5)) for i in range(20)]
            records[row] = {"trivia_qa": recs}
            results[row] = {"trivia_qa": score.dataset_metrics(recs, domain="id", n_bins=10, n_boot=0)}
            conf, correct = score.confidence_pairs(recs, "semantic")
            expected[row].append(semantic_ece(conf, correct, 10))
        score.write_results(tmp_path / f"v-seed{k}", results, records, n_bins=10, plots=False)
    out = S.summarize(study, tmp_path, n_boot=50)
    sft = out["rows"]["v/sft"]["datasets"]["trivia_qa"]
    assert sft["mean"]["semantic_ece"] == pytest.approx(np.mean(expected["sft"]))
    assert sft["mean"]["mean_clusters"] == 4.0  # 4 samples in 4 clusters, confidence 1/4
    lo, hi = sft["semantic_ece_pooled_ci"]
    assert 0.0 <= lo <= hi <= 1.0
    vs = sft["vs"]["v/ts"]["semantic_ece"]
    assert vs["diff"] == pytest.approx(np.mean(expected["sft"]) - np.mean(expected["ts"]))
    md = (tmp_path / "study.md").read_text()
    assert "Δ Semantic-ECE vs VARIANT/ts" in md and f"{vs['diff']:+.3f}" in md
    # the pooled diagram draws open QA's rows by their semantic-cluster confidence
    from apps.study import figures as study_figures

    x, y, n_seeds, kind = study_figures._pooled(study, tmp_path, "v/sft")["trivia_qa"]
    assert kind == "binary" and n_seeds == 2 and x.shape == y.shape == (40,)
    fig = study_figures.reliability(study, tmp_path, tmp_path / "figs", ("v/ts", "v/sft"))
    assert [p.name for p in fig] == ["reliability_trivia_qa.png"]
    # published, the records travel xz-compressed and give the same question-level numbers
    dest = tmp_path / "published"
    S.publish(study, tmp_path, dest)
    assert {p.name for p in (dest / "v-seed0").iterdir()} == {
        "metrics.json", "results.md", "open_qa_predictions.json.xz"}
    (dest / "study.json").unlink()  # nothing to carry: recomputed from the records
    again = S.summarize(study, dest, n_boot=50)["rows"]["v/sft"]["datasets"]["trivia_qa"]
    assert again["semantic_ece_pooled_ci"] == pytest.approx(sft["semantic_ece_pooled_ci"])
    assert again["vs"] == sft["vs"]
    # without the answers, the numbers of the summary it was published with are carried (†)
    for f in dest.glob("*/open_qa_predictions.json.xz"):
        f.unlink()
    carried = S.summarize(study, dest, n_boot=50)["rows"]["v/sft"]["datasets"]["trivia_qa"]
    assert carried["semantic_ece_pooled_ci"] == again["semantic_ece_pooled_ci"]
    assert carried["vs"] == again["vs"]
    assert set(carried["carried"]) == {"semantic_ece_pooled_ci", "vs v/ts"}
    assert "]†" in (dest / "study.md").read_text()


def test_flop_scaled_estimate_of_a_gpu_study():
    f = S.FlopScale(params=1e9, questions_per_step=2, train_tokens=100.0,
                    eval_tokens={"a": (10, 50.0)}, step_ratio={"sft": 1.0, "calm": 4.0},
                    peak_flops=1e12, utilization=0.5)
    # 6N per token with checkpointing: 6e9 * 200 tokens / 5e11 FLOP/s
    assert f.step_s("sft") == pytest.approx(2.4) and f.step_s("calm") == pytest.approx(9.6)
    assert f.step_s("none") == 0.0
    assert f.prediction_s() == pytest.approx(2e9 * 500 / 5e11)
    study = S.Study(name="g", description="", common=("--steps", "10"), seeds=(0,),
                    variants=(S.Variant("m", ("none", "sft", "calm")),), step_s={},
                    question_s=0.0, run_s=1.0, questions=0, flops=f)
    # load + 10 steps of sft and calm + predictions: none, sft, calm twice (with and without α)
    assert S.estimate_s(study, S.cells(study)[0]) == pytest.approx(
        1.0 + 10 * (2.4 + 9.6) + 4 * f.prediction_s())


def test_smoothing_keeps_the_length_and_skips_missing_steps():
    from apps.study.figures import _smooth

    assert np.allclose(_smooth(np.array([3.0, 1.0]), 5), [2.0, 2.0])  # shorter than the window
    y = np.array([1.0, np.nan, 3.0, 5.0, np.nan, np.nan, np.nan])
    out = _smooth(y, 3)
    assert out.shape == y.shape
    assert np.allclose(out[:4], [1.0, 2.0, 4.0, 4.0]) and np.isnan(out[5])


def test_rcft_e_steps_are_counted_in_the_estimate():
    base = S.Study(name="e", description="", common=("--steps", "60", "--n-train", "100"),
                   seeds=(0,), variants=(S.Variant("once", ("rcft",)),
                                         S.Variant("every10", ("rcft",), ("--rcft-reestimate-every", "10"))),
                   step_s={"rcft": 1.0}, question_s=0.1, run_s=0.0, questions=0)
    once, every10 = (S.estimate_s(base, S.Cell(v, 0)) for v in base.variants)
    # E-steps at k = 0, 10, ..., 50: six passes over 100 questions at 0.1 s against one
    assert every10 - once == pytest.approx(5 * 100 * 0.1)


@pytest.mark.slow
def test_the_published_open_qa_study_reproduces_from_its_raw_files(tmp_path):
    """docs/results/laptop-open-qa: the committed summary is what --summarize computes from the
    committed cells (every interval, p-value and Holm decision), so the published numbers are
    the procedure's, not edited ones."""
    import shutil
    from pathlib import Path

    src = Path(__file__).resolve().parents[2] / "docs" / "results" / "laptop-open-qa"
    published = json.loads((src / "study.json").read_text())
    root = tmp_path / "oq"
    shutil.copytree(src, root)
    (root / "study.json").unlink()  # nothing carried: recomputed from the sampled answers
    again = S.summarize(S.STUDIES["laptop-open-qa"], root, n_boot=published["n_boot"])
    # recomputed floats within round-off of another CPU's summation order; an undefined AUROC
    # is NaN on both sides (tests/numbers.py)
    assert_same_numbers(again["procedure"], published["procedure"])
    assert_same_numbers(again["primary"], published["primary"])
    assert_same_numbers(again["rows"], published["rows"])


def test_open_qa_answers_are_scored_without_question_echoes_and_by_em_and_f1(tmp_path):
    from apps.calm_llm.open_qa import score

    def rec(i, question, answers, modal, right):
        return score.QuestionRecord(id=f"q{i}", question=question, answers=answers,
                                    samples=[modal] * 4, cluster_ids=[0] * 4, modal_answer=modal,
                                    modal_correct=right, greedy=modal, greedy_logprobs=[-0.5],
                                    greedy_correct=right)

    recs = [rec(0, "Which Cuban city is Havana's rival?", ["Havana", "Santiago de Cuba"],
                "the city of Havana", True),  # right by `contains` only through the echo
            rec(1, "Capital of France?", ["Paris"], "Paris", True),
            rec(2, "Largest planet?", ["Jupiter"], "Saturn", False)]
    results = {"none": {"trivia_qa": score.dataset_metrics(recs, domain="id", n_bins=10, n_boot=0)}}
    score.write_results(tmp_path / "v-seed0", results, {"none": {"trivia_qa": recs}}, n_bins=10,
                        plots=False)
    study = S.Study(name="oq", description="open QA", common=(), seeds=(0,),
                    variants=(S.Variant("v", ("none",)),), step_s={}, question_s=0.0, run_s=0.0,
                    questions=0)
    d = S.summarize(study, tmp_path, n_boot=20)["rows"]["v/none"]["datasets"]["trivia_qa"]["mean"]
    assert d["accuracy"] == pytest.approx(2 / 3)  # the run's own `contains`
    assert d["accuracy_no_echo"] == pytest.approx(1 / 3) and d["echo_credited"] == pytest.approx(1 / 3)
    assert d["exact_match"] == pytest.approx(1 / 3)
    # F1 of "city of havana" against "havana": P = 1/3, R = 1 -> 0.5; then 1 and 0
    assert d["token_f1"] == pytest.approx((0.5 + 1.0 + 0.0) / 3)
    assert "| accuracy, no question echo | EM | token F1 |" in (tmp_path / "study.md").read_text()


def test_published_per_run_intervals_are_the_one_seed_bootstrap_bit_for_bit():
    """The conf-ECE and cw-ECE intervals a laptop run wrote into metrics.json (before the
    hierarchical bootstrap existed) are recomputed exactly from its saved probabilities: the
    one-seed case draws what the per-run bootstrap drew."""
    from pathlib import Path

    from safetensors.torch import load_file

    from apps.calm_llm.evaluate import dataset_metrics

    cell = Path(__file__).resolve().parents[2] / "docs" / "results" / "laptop" / "reference-seed0"
    saved = json.loads((cell / "metrics.json").read_text())["results"]
    preds = load_file(str(cell / "predictions.safetensors"))
    for row in ("none", "ts"):
        for ds, r in saved[row].items():
            out = dataset_metrics(preds[f"{row}/{ds}/probs"].double(), preds[f"{row}/{ds}/labels"],
                                  domain=r["domain"], n_bins=r["n_bins"], n_boot=r["n_boot"], seed=0)
            assert out["conf_ece_ci"] == r["conf_ece_ci"] and out["cw_ece_ci"] == r["cw_ece_ci"]
