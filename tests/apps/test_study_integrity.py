"""apps.study.integrity: a damaged cell stops the summary naming its file; a metrics.json that
contradicts its saved predictions is refused; nothing is dropped silently.

The faults are a table: a new fault is one line (name, study kind, how to damage the study root,
a fragment the one-line error must contain)."""

import json
import os
import shutil
import sys

import numpy as np
import pytest
import torch

from apps import study as S
from apps.study.integrity import DamagedCell

MC = S.Study(name="faults-mc", description="multiple choice", common=(), seeds=(0, 1),
             variants=(S.Variant("v", ("none", "sft")),), step_s={}, question_s=0.0, run_s=0.0,
             questions=0, baselines=("{variant}/none",))
OQ = S.Study(name="faults-oq", description="open QA", common=(), seeds=(0, 1),
             variants=(S.Variant("v", ("ts", "sft")),), step_s={}, question_s=0.0, run_s=0.0,
             questions=0, baselines=("{variant}/ts",))


def _finish(root, cell):
    """What a run directory and the study's log hold besides the results."""
    (root / cell / "config.json").write_text(json.dumps({"n_bins": 10}))
    (root / cell / "splits.json").write_text(json.dumps({"splits": {}}))
    with open(root / "cells.jsonl", "a") as f:
        f.write(json.dumps({"cell": cell, "rc": 0, "seconds": 1.0, "argv": []}) + "\n")


def _multiple_choice(root):
    """Two seeds of rows none and sft on an in-domain and an out-of-domain set, written by the
    run's own writer (evaluate.write_results) from random probabilities on fixed questions."""
    from apps.calm_llm import evaluate

    rng = np.random.default_rng(0)
    labels = {"sciq": torch.from_numpy(rng.integers(0, 4, 40)),
              "arc_easy": torch.from_numpy(rng.integers(0, 4, 30))}
    for k in (0, 1):
        preds = {row: {ds: (torch.softmax(torch.from_numpy(rng.normal(size=(len(y), 4)) * 2), -1)
                            .float(), y.clone()) for ds, y in labels.items()} for row in ("none", "sft")}
        results = evaluate.evaluate_predictions(preds, {"sciq": "id", "arc_easy": "ood"},
                                                n_bins=10, n_boot=0)
        evaluate.write_results(root / f"v-seed{k}", results, preds, n_bins=10, plots=False)
        _finish(root, f"v-seed{k}")


def _open_qa(root):
    """Two seeds of rows ts and sft on TriviaQA, written by the open-QA writer."""
    from apps.calm_llm.open_qa import score

    rng = np.random.default_rng(1)
    for k in (0, 1):
        records, results = {}, {}
        for row, agree in (("ts", 4), ("sft", 2)):
            recs = [score.QuestionRecord(
                id=f"q{i}", question=f"question {i}?", answers=["a"],
                samples=["s"] * 5, cluster_ids=[0] * agree + list(range(1, 6 - agree)),
                modal_answer="a", modal_correct=bool(rng.uniform() < 0.5), greedy="a",
                greedy_logprobs=[-float(rng.uniform())], greedy_correct=bool(rng.uniform() < 0.5))
                for i in range(20)]
            records[row] = {"trivia_qa": recs}
            results[row] = {"trivia_qa": score.dataset_metrics(recs, domain="id", n_bins=10, n_boot=0)}
        score.write_results(root / f"v-seed{k}", results, records, n_bins=10, plots=False)
        _finish(root, f"v-seed{k}")


def _edit(cell, edit):
    """Change metrics.json through ``edit(results)``."""
    def damage(root):
        f = root / cell / "metrics.json"
        payload = json.loads(f.read_text())
        edit(payload["results"])
        f.write_text(json.dumps(payload))
    return damage


def _set(row, ds, key, value):
    def edit(results):
        results[row][ds][key] = value
    return edit


def _write(name, data):
    return lambda root: (root / name).write_bytes(data)


def _cut(name):
    return lambda root: (root / name).write_bytes((root / name).read_bytes()[:40])


def _tensors(cell, change):
    """Rewrite a cell's predictions.safetensors through ``change(tensors)``."""
    def damage(root):
        from safetensors.torch import load_file, save_file

        f = root / cell / "predictions.safetensors"
        t = load_file(str(f))
        change(t)
        save_file(t, str(f))
    return damage


def _from_other_seed(root):
    shutil.copy(root / "v-seed0" / "predictions.safetensors", root / "v-seed1" / "predictions.safetensors")


def _records(cell, change):
    def damage(root):
        f = root / cell / "open_qa_predictions.json"
        data = json.loads(f.read_text())
        change(data)
        f.write_text(json.dumps(data))
    return damage


FAULTS = [
    # name, study, damage(root), what the error says
    ("metrics garbage", MC, _write("v-seed1/metrics.json", b"\x00\xffgarbage"),
     "v-seed1/metrics.json is unreadable"),
    ("metrics empty", MC, _write("v-seed1/metrics.json", b""), "v-seed1/metrics.json is unreadable"),
    ("metrics cut short", MC, _cut("v-seed1/metrics.json"), "v-seed1/metrics.json is unreadable"),
    ("metrics not a run's", MC, _write("v-seed0/metrics.json", b"[1, 2]"),
     "v-seed0/metrics.json is not a run's metrics.json"),
    ("conf_ece edited", MC, _edit("v-seed1", _set("sft", "sciq", "conf_ece", 0.05)),
     "metrics.json: conf_ece of sft on sciq is 0.05 but its saved predictions give 0."),
    ("accuracy edited", MC, _edit("v-seed0", _set("none", "arc_easy", "accuracy", 0.9)),
     "v-seed0/metrics.json: accuracy of none on arc_easy is 0.9 but"),
    ("nll edited slightly", MC, _edit("v-seed0", lambda r: r["sft"]["sciq"].update(
        nll=r["sft"]["sciq"]["nll"] + 1e-6)), "nll of sft on sciq is"),
    ("question count edited", MC, _edit("v-seed0", _set("sft", "sciq", "n", 41)), "n of sft on sciq is 41"),
    ("metric deleted", MC, _edit("v-seed1", lambda r: r["sft"]["sciq"].pop("brier")),
     "brier of sft on sciq is None"),
    ("metric made a string", MC, _edit("v-seed1", _set("none", "sciq", "cw_ece", "0.1")),
     "cw_ece of none on sciq is '0.1'"),
    ("metrics deleted, log says finished", MC, lambda root: (root / "v-seed1" / "metrics.json").unlink(),
     "records cell v-seed1 as finished"),
    ("row deleted, log says finished", MC, _edit("v-seed1", lambda r: r.pop("sft")),
     "lacks a row of ['none', 'sft'], but"),
    ("predictions garbage", MC, _write("v-seed0/predictions.safetensors", b"garbage" * 10),
     "v-seed0/predictions.safetensors is unreadable"),
    ("predictions cut short", MC, _cut("v-seed0/predictions.safetensors"),
     "v-seed0/predictions.safetensors is unreadable"),
    ("predictions deleted", MC, lambda root: (root / "v-seed1" / "predictions.safetensors").unlink(),
     "v-seed1/predictions.safetensors is missing although"),
    ("predictions lack a row", MC, _tensors("v-seed1", lambda t: t.pop("sft/arc_easy/probs")),
     "holds no predictions of sft on arc_easy"),
    ("predictions of another seed", MC, _from_other_seed, "v-seed1/metrics.json: accuracy of none on sciq is"),
    ("labels edited", MC, _tensors("v-seed0", lambda t: t["none/sciq/labels"].__setitem__(
        slice(0, 10), (t["none/sciq/labels"][:10] + 1) % 4)), "of none on sciq is"),
    ("config garbage", MC, _write("v-seed0/config.json", b"{n_bins"), "v-seed0/config.json is unreadable"),
    ("log line garbage", MC, lambda root: open(root / "cells.jsonl", "a").write("{oops\n"),
     "cells.jsonl line 3 is not a cell record"),
    ("earlier summary garbage", MC, _write("study.json", b"{"), "study.json is unreadable"),
    ("open-QA semantic_ece edited", OQ, _edit("v-seed1", _set("sft", "trivia_qa", "semantic_ece", 0.5)),
     "semantic_ece of sft on trivia_qa is 0.5 but"),
    ("open-QA kind's ECE edited", OQ, _edit("v-seed0", lambda r: r["ts"]["trivia_qa"]["confidences"]
                                            ["split_half"].update(semantic_ece=0.0)),
     "confidences/split_half/semantic_ece of ts on trivia_qa is 0.0"),
    ("open-QA answers garbage", OQ, _write("v-seed0/open_qa_predictions.json", b"[[["),
     "v-seed0/open_qa_predictions.json is unreadable"),
    ("open-QA answers lack a row", OQ, _records("v-seed1", lambda d: d.pop("sft")),
     "open_qa_predictions.json holds no answers for it"),
    ("open-QA answer flipped", OQ, _records("v-seed1", lambda d: d["ts"]["trivia_qa"][0].update(
        modal_correct=not d["ts"]["trivia_qa"][0]["modal_correct"])), "of ts on trivia_qa is"),
]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The undamaged study roots, built once and copied per fault."""
    out = {}
    for study, build in ((MC, _multiple_choice), (OQ, _open_qa)):
        root = tmp_path_factory.mktemp(study.name)
        build(root)
        S.summarize(study, root, n_boot=20)  # leaves a study.json, as a real root has
        out[study.name] = root
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name,study,damage,message", FAULTS, ids=[f[0] for f in FAULTS])
def test_a_damaged_cell_stops_the_summary_naming_its_file(built, tmp_path, name, study, damage, message):
    root = tmp_path / "root"
    shutil.copytree(built[study.name], root)
    damage(root)
    with pytest.raises(DamagedCell) as e:
        S.summarize(study, root, n_boot=20)
    assert message in str(e.value) and "\n" not in str(e.value)
    assert str(root) in str(e.value)  # the path, whole
    assert any(fix in str(e.value) for fix in ("delete", "restore", "run the study again"))


def test_undamaged_roots_summarize_every_seed_checked(built, tmp_path):
    for study in (MC, OQ):
        root = tmp_path / study.name
        shutil.copytree(built[study.name], root)
        out = S.summarize(study, root, n_boot=20)
        assert all(r["seeds"] == [0, 1] for r in out["rows"].values())
        assert out["unchecked_cells"] == [] and out["unfinished_cells"] == []


def test_an_unfinished_cell_is_listed_and_a_published_copy_without_predictions_is_unchecked(built, tmp_path):
    root = tmp_path / "root"
    shutil.copytree(built[MC.name], root)
    # a cell begun but not finished (interrupted before its first result): left out, listed
    (root / "v-seed1" / "metrics.json").unlink()
    (root / "cells.jsonl").write_text(json.dumps({"cell": "v-seed0", "rc": 0}) + "\n" +
                                      json.dumps({"cell": "v-seed1", "rc": -9}) + "\n")
    out = S.summarize(MC, root, n_boot=20)
    assert out["rows"]["v/sft"]["seeds"] == [0] and out["unfinished_cells"] == ["v-seed1"]
    # published copies keep no splits.json: without predictions their metrics are used unchecked
    dest = tmp_path / "published"
    S.publish(MC, built[MC.name], dest)
    for f in dest.glob("*/predictions.safetensors"):
        f.unlink()
    again = S.summarize(MC, dest, n_boot=20)
    assert again["unchecked_cells"] == ["v-seed0", "v-seed1"]
    assert again["rows"]["v/sft"]["seeds"] == [0, 1]


def test_the_command_line_prints_one_line_and_exits_2(built, tmp_path, monkeypatch, capsys):
    from apps.study.__main__ import main

    monkeypatch.setitem(S.STUDIES, MC.name, MC)
    root = tmp_path / "root"
    shutil.copytree(built[MC.name], root)
    (root / "v-seed1" / "metrics.json").write_text("garbage")
    assert main([MC.name, "--root", str(root), "--summarize", "--n-boot", "20"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{root}/v-seed1/metrics.json is unreadable" in err
    assert main([MC.name, "--root", str(root), "--dry-run"]) == 2  # the runner refuses it too
    assert "v-seed1/metrics.json is unreadable" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("name", ["laptop", "laptop-screen", "calm-dynamics", "laptop-open-qa", "final"])
def test_every_published_cell_agrees_with_its_saved_predictions(name):
    """docs/results/<study>: each finished cell's metrics.json is what its own predictions give;
    only the calm-dynamics cells published before predictions were kept go unchecked."""
    from pathlib import Path

    from apps.study.integrity import cross_check, finished_in_log, read_results

    root = Path(__file__).resolve().parents[2] / "docs" / "results" / name
    study = S.STUDIES[name]
    checked, unchecked = 0, []
    for c in S.cells(study):
        if S.done(root / c.name, c):
            n = cross_check(root / c.name, read_results(root / c.name))
            checked += n
            if n == 0:
                unchecked.append(c.name)
        else:
            assert c.name not in finished_in_log(root)
    expected = {"laptop": 82, "laptop-screen": 7, "calm-dynamics": 50, "laptop-open-qa": 60, "final": 81}
    assert checked == expected[name]
    assert all(c.split("-seed")[0] in ("nll", "old", "sgd", "upper") for c in unchecked)
    assert len(unchecked) == (12 if name == "calm-dynamics" else 0)


def test_the_published_default_run_is_what_its_predictions_and_the_docs_say():
    """docs/results/default-run (the README's run from a fresh clone): every row's metrics.json
    numbers are what its saved option probabilities give, and docs/results.md's table of the
    embedded default run prints them."""
    import re
    from pathlib import Path

    from apps.study.integrity import cross_check, read_results

    repo = Path(__file__).resolve().parents[2]
    run = repo / "docs" / "results" / "default-run"
    results = read_results(run)
    assert cross_check(run, results) == 10  # 5 rows x 2 sets, none left unchecked
    doc = (repo / "docs" / "results.md").read_text()
    for row, sets in results.items():
        for ds, r in sets.items():
            line = re.search(rf"^\| {re.escape(row)} \| {ds} \((?:id|ood)\) \| ([0-9.]+) \| ([0-9.]+) ",
                             doc, re.M)
            assert line, f"docs/results.md has no default-run line for {row} on {ds}"
            assert (float(line[1]), float(line[2])) == (round(r["accuracy"], 3), round(r["conf_ece"], 3))


def test_a_damaged_cell_is_not_published(built, tmp_path):
    root = tmp_path / "root"
    shutil.copytree(built[MC.name], root)
    _edit("v-seed1", _set("sft", "sciq", "conf_ece", 0.05))(root)
    with pytest.raises(DamagedCell, match="conf_ece of sft on sciq is 0.05"):
        S.publish(MC, root, tmp_path / "published")
    assert not (tmp_path / "published" / "v-seed1").exists()


def test_study_md_names_the_unfinished_and_unchecked_cells(built, tmp_path):
    root = tmp_path / "root"
    shutil.copytree(built[MC.name], root)
    (root / "v-seed1" / "metrics.json").unlink()
    (root / "cells.jsonl").unlink()
    S.summarize(MC, root, n_boot=20)
    assert "Left out, not finished: v-seed1." in (root / "study.md").read_text()
    (root / "v-seed0" / "predictions.safetensors").unlink()
    (root / "v-seed0" / "splits.json").unlink()  # as published
    S.summarize(MC, root, n_boot=20)
    assert "(none kept): v-seed0." in (root / "study.md").read_text()


@pytest.mark.parametrize("study", [MC, OQ], ids=["multiple-choice", "open-qa"])
def test_a_published_study_restores_into_an_empty_root_and_resumes_after_its_cells(built, tmp_path, study):
    # a fresh machine has no runs/: restoring the published folder must make every published
    # cell count as finished again (so `run` skips it), with the same numbers and answers
    published = tmp_path / "published"
    S.publish(study, built[study.name], published)
    root = tmp_path / "fresh"
    restored = S.restore(study, published, root)
    assert restored == ["v-seed0", "v-seed1"]
    for c in S.cells(study):
        assert S.done(root / c.name, c)
        assert (json.loads((root / c.name / "metrics.json").read_text())
                == json.loads((built[study.name] / c.name / "metrics.json").read_text()))
    if study is OQ:  # the answers come back decompressed, byte for byte
        from apps.calm_llm.open_qa.score import PREDICTIONS
        assert ((root / "v-seed0" / PREDICTIONS).read_bytes()
                == (built[study.name] / "v-seed0" / PREDICTIONS).read_bytes())
        assert not (root / "v-seed0" / f"{PREDICTIONS}.xz").exists()
    from apps.study.integrity import finished_in_log
    assert finished_in_log(root) == {"v-seed0", "v-seed1"}
    assert S.run(study, root, python="false") == 0  # nothing left to run: no subprocess at all
    # restoring again changes nothing: a cell already in the root is never overwritten
    (root / "v-seed0" / "marker").write_text("kept")
    assert S.restore(study, published, root) == []
    assert (root / "v-seed0" / "marker").read_text() == "kept"


def test_publish_each_publishes_a_cell_as_soon_as_it_finishes(built, tmp_path):
    # `run` calls after_cell for each cell that exited 0, before the next one starts; a run with
    # one cell already finished calls it for the other only
    root = tmp_path / "root"
    shutil.copytree(built[MC.name], root)
    metrics = (root / "v-seed1" / "metrics.json").read_bytes()
    (root / "v-seed1" / "metrics.json").unlink()
    fake = tmp_path / "fake_python"  # "runs" the cell by putting its metrics.json back
    fake.write_text(f"#!/bin/sh\ncp {tmp_path / 'metrics.json'} {root / 'v-seed1' / 'metrics.json'}\n")
    fake.chmod(0o755)
    (tmp_path / "metrics.json").write_bytes(metrics)
    seen = []
    dest = tmp_path / "published"
    rc = S.run(MC, root, python=str(fake),
               after_cell=lambda c: seen.append((c.name, len(S.publish_cell(root, dest, c.name)))))
    assert rc == 0 and [name for name, _ in seen] == ["v-seed1"] and seen[0][1] >= 3
    assert (dest / "v-seed1" / "metrics.json").read_bytes() == metrics
    assert not (dest / "v-seed0").exists()


def test_jobs_run_cells_at_once_each_on_its_own_share_of_the_cpus(built, tmp_path):
    # two unfinished cells, --jobs 2: each fake cell waits until the other has started (so the
    # test fails, after a timeout, unless they really run at once), records the threads and cores
    # it was given, and "finishes" by putting its metrics.json back
    root = tmp_path / "root"
    shutil.copytree(built[MC.name], root)
    saved = tmp_path / "saved"
    saved.mkdir()
    for k in (0, 1):
        (root / f"v-seed{k}" / "metrics.json").rename(saved / f"v-seed{k}.json")
    (root / "cells.jsonl").unlink()
    fake = tmp_path / "fake_python"
    fake.write_text(f"""#!{sys.executable}
import os, pathlib, sys, time
run_dir = pathlib.Path(sys.argv[-1])
(run_dir.parent / ("started-" + run_dir.name)).touch()
deadline = time.time() + 60
while len(list(run_dir.parent.glob("started-*"))) < 2:
    if time.time() > deadline:
        sys.exit(3)
    time.sleep(0.05)
cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
(run_dir.parent / ("env-" + run_dir.name)).write_text(
    os.environ.get("OMP_NUM_THREADS", "") + " " + ",".join(map(str, cores)))
(run_dir / "metrics.json").write_bytes((pathlib.Path({str(saved)!r}) / (run_dir.name + ".json")).read_bytes())
""")
    fake.chmod(0o755)
    published = []
    rc = S.run(MC, root, python=str(fake), jobs=2, after_cell=lambda c: published.append(c.name))
    assert rc == 0 and sorted(published) == ["v-seed0", "v-seed1"]
    assert all(S.done(root / c.name, c) for c in S.cells(MC))
    log = [json.loads(line) for line in (root / "cells.jsonl").read_text().splitlines()]
    assert sorted(e["cell"] for e in log) == ["v-seed0", "v-seed1"] and {e["rc"] for e in log} == {0}
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    seen = [(root / f"env-v-seed{k}").read_text().split(" ") for k in (0, 1)]
    assert [threads for threads, _ in seen] == [str(max(1, cpus // 2))] * 2
    if hasattr(os, "sched_setaffinity") and cpus >= 2:  # disjoint cores, half each
        shares = [set(map(int, cores.split(","))) for _, cores in seen]
        assert not shares[0] & shares[1] and all(len(x) == cpus // 2 for x in shares)


def test_jobs_below_one_is_refused_naming_the_option(tmp_path):
    with pytest.raises(ValueError, match="jobs"):
        S.run(MC, tmp_path, jobs=0)
    from apps.study.__main__ import main
    with pytest.raises(SystemExit):
        main(["calm-diagnosis", "--jobs", "0", "--root", str(tmp_path / "r")])


def test_a_metric_added_to_the_summary_table_reaches_the_study_summary(tmp_path, monkeypatch):
    # one entry in calibration.metrics.SUMMARY: the runs write it (evaluate.dataset_metrics),
    # the study pools it over seeds into study.json and shows it as a study.md column
    from calibration import metrics
    extra = metrics.SummaryMetric("top2_acc", "top-2 acc", "max",
                                  lambda p, y, b: float((p.topk(2, -1).indices == y[:, None])
                                                        .any(-1).double().mean()))
    monkeypatch.setattr(metrics, "SUMMARY", (*metrics.SUMMARY, extra))
    root = tmp_path / "root"
    _multiple_choice(root)
    summary = S.summarize(MC, root, n_boot=20)
    runs = [json.loads((root / f"v-seed{k}" / "metrics.json").read_text())["results"]["sft"]["sciq"]
            for k in (0, 1)]
    pooled = summary["rows"]["v/sft"]["datasets"]["sciq"]["mean"]["top2_acc"]
    assert pooled == pytest.approx(np.mean([r["top2_acc"] for r in runs]), abs=1e-12)
    assert "| top-2 acc |" in (root / "study.md").read_text()
