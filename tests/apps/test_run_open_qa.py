"""``--task open_qa`` end to end on the tiny model: every open-QA method, determinism under a
fixed seed, a killed-and-resumed run equal to an uninterrupted one, clear errors."""

from __future__ import annotations

import json

import pytest

from apps.calm_llm.__main__ import main
from apps.calm_llm.methods.calm import Calm
from apps.calm_llm.open_qa import score

ALL = ["none", "ts", "sft", "label_smoothing", "calm", "calm_iterate", "calm_regularization",
       "calm_scalar"]
BASE = ["--config", "tiny_open_qa", "--n-boot", "0"]


def _metrics(run):
    return json.loads((run / "metrics.json").read_text())


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("open_qa") / "run"
    assert main([*BASE, "--methods", *ALL, "--out", str(out)]) == 0
    return out


@pytest.mark.slow
def test_every_method_is_evaluated_in_the_open_qa_shape(full_run):
    m = _metrics(full_run)
    assert m["task"] == "open_qa"
    learns_alpha = ["calm", "calm_iterate", "calm_regularization", "calm_scalar"]
    assert set(m["results"]) == set(ALL) | {f"{x}:no_alpha" for x in learns_alpha}
    records = score.read_records(full_run)
    for row, per_ds in m["results"].items():
        assert set(per_ds) == {"trivia_qa", "nq_open"}
        for ds, r in per_ds.items():
            assert r["domain"] == ("id" if ds == "trivia_qa" else "ood")
            assert r["n"] == 6 and 0 <= r["semantic_ece"] <= 1 and 0 <= r["accuracy"] <= 1
            assert set(r["confidences"]) == set(score.KINDS)
            assert r["calib_nll"] > 0
            recs = records[row][ds]
            assert len(recs) == 6 and all(len(x.samples) == 4 for x in recs)
            # the saved records reproduce the saved metrics
            again = score.dataset_metrics(recs, domain=r["domain"], n_bins=10, n_boot=0)
            assert again["semantic_ece"] == pytest.approx(r["semantic_ece"])
    assert m["results"]["ts"]["trivia_qa"]["temperature"] > 0
    for row in ["sft", *learns_alpha]:
        assert (full_run / "export" / row / "adapter_config.json").is_file()
    assert (full_run / "export" / "calm" / "alpha.safetensors").is_file()
    ts = json.loads((full_run / "export" / "ts" / "calibration.json").read_text())  # T exports too
    assert ts["acts_on"] == "vocab" and ts["temperature"] == m["results"]["ts"]["trivia_qa"]["temperature"]
    assert (full_run / "reliability_nq_open.png").is_file()
    assert "Semantic-ECE" in (full_run / "results.md").read_text()


@pytest.mark.slow
def test_a_fixed_seed_gives_the_same_answers(full_run, tmp_path):
    assert main([*BASE, "--methods", "ts", "--out", str(tmp_path)]) == 0
    assert score.read_records(tmp_path)["ts"] == score.read_records(full_run)["ts"]


@pytest.mark.slow
def test_killed_and_resumed_run_matches_uninterrupted(full_run, tmp_path, monkeypatch):
    # the rows' seeds do not depend on the other methods: sft and calm here are the full run's
    args = [*BASE, "--methods", "sft", "calm", "--out", str(tmp_path)]
    original = Calm.step

    def killed(self, k):
        if k == 2:
            raise KeyboardInterrupt("simulated kill at step 3")
        return original(self, k)

    monkeypatch.setattr(Calm, "step", killed)
    with pytest.raises(KeyboardInterrupt):
        main(args)
    assert set(_metrics(tmp_path)["results"]) == {"sft"}
    monkeypatch.setattr(Calm, "step", original)
    assert main(["--resume", str(tmp_path)]) == 0
    a, b = score.read_records(full_run), score.read_records(tmp_path)
    assert b.keys() == {"sft", "calm", "calm:no_alpha"}
    for row in b:
        for ds in a[row]:
            assert [r.samples for r in b[row][ds]] == [r.samples for r in a[row][ds]], (row, ds)


@pytest.mark.parametrize("args, message", [
    (["--methods", "rcft"], "does not apply to --task open_qa"),
    (["--in-domain", "sciq"], "not an open-QA source"),
    (["--n-samples", "1"], "--n-samples"),
    (["--alpha-acts", "options"], "answers have no options"),
    (["--top-p", "0"], "--top-p"),
    (["--match", "judge"], "--match judge needs --judge-model"),
    (["--judge-model", "tiny"], "--judge-model is read only with --match judge"),
])
def test_bad_open_qa_options_are_named(args, message, capsys):
    assert main([*BASE, *args]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_an_llm_judge_decides_what_alias_matching_does_not(full_run, tmp_path):
    """--match judge on the tiny model: the same samples as the alias-matched run; an answer
    equal to an alias is right, and every other verdict is the judge's."""
    from apps.calm_llm.open_qa.judge import LLMJudge, judge_answers

    assert main([*BASE, "--methods", "ts", "--match", "judge", "--judge-model", "tiny",
                 "--out", str(tmp_path)]) == 0
    got, ref = score.read_records(tmp_path)["ts"], score.read_records(full_run)["ts"]
    judge = LLMJudge.load("tiny")
    for ds in ref:
        assert [r.samples for r in got[ds]] == [r.samples for r in ref[ds]]
        items = [(r.question, r.modal_answer, r.answers) for r in got[ds]]
        assert [r.modal_correct for r in got[ds]] == judge_answers(items, "judge", judge)


@pytest.mark.slow
def test_a_kept_row_edited_in_metrics_json_is_refused_on_resume(tmp_path, capsys):
    args = [*BASE, "--methods", "ts", "--out", str(tmp_path)]
    assert main(args) == 0
    m = _metrics(tmp_path)
    ds = next(iter(m["results"]["ts"]))
    m["results"]["ts"][ds]["confidences"]["semantic"]["semantic_ece"] += 0.01
    (tmp_path / "metrics.json").write_text(json.dumps(m))
    assert main(["--resume", str(tmp_path)]) != 0
    err = capsys.readouterr().err
    assert f"ts on {ds}: confidences semantic semantic_ece is" in err
    assert "the saved answers give" in err and "Traceback" not in err
