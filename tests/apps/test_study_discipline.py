"""apps.study.discipline: a study refuses to test on another study's development questions (and
to develop on another's test questions), checked before any cell runs, on tiny synthetic cells:
one study's splits recorded in its cells' splits.json, the other's carved from its declaration
by the run's own loader over local data files. The expected overlaps are counted independently
(set intersections of the examples' texts)."""

import json

import pytest

from apps import study as S
from apps.calm_llm.data import make_splits
from apps.calm_llm.data.sources import load_source
from apps.study import discipline as D
from apps.study.__main__ import main

FINAL_ROLES = {"train": "training", "calib": "development", "test": "development", "ood": "test"}


def _write(path, name, n, start=0):
    rows = [{"id": f"q{i}", "question": f"{name} question number {i}?",
             "options": [f"yes {i}", f"no {i}", f"maybe {i}"], "label": i % 3} for i in range(start, start + n)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


@pytest.fixture(autouse=True)
def _own_runs_folder(tmp_path, monkeypatch):
    """The other studies' cells are looked up under ``runs/study-NAME`` of the working directory:
    a checkout where a real study ran (``runs/study-final``) must not stand in for the fakes."""
    monkeypatch.chdir(tmp_path)


@pytest.fixture
def data(tmp_path):
    """Three small sets: an in-domain one, and two out-of-domain ones (``shared`` also read by
    the development study, ``fresh`` by nobody else)."""
    return {n: _write(tmp_path / f"{n}.jsonl", n, k) for n, k in
            (("dom", 60), ("shared", 40), ("fresh", 40))}


def _args(data, ood, *, n_ood=12, split_seed=0):
    return ("--config", "tiny", "--split-seed", str(split_seed), "--in-domain", "dom",
            "--out-of-domain", *ood, "--data-files", *(f"{n}={data[n]}" for n in ("dom", *ood)),
            "--n-train", "8", "--n-calib", "6", "--n-test", "10", "--n-ood", str(n_ood))


def _study(name, data, ood, roles=None, **kw):
    extra = {"roles": roles} if roles else {}
    return S.Study(name=name, common=_args(data, ood, **kw), seeds=(0,),
                   variants=(S.Variant("reference", ("none",)),), step_s={}, question_s=0.0,
                   run_s=0.0, questions=0, **extra)


def _record(root, study, data, ood, split_seed):
    """A finished development cell: the splits.json its run would write (``Splits.manifest``)."""
    sets = {n: load_source(n, path=str(data[n])) for n in ("dom", *ood)}
    splits = make_splits({"dom": sets["dom"]}, {n: sets[n] for n in ood}, n_train=8, n_calib=6,
                         n_test=10, n_ood=12, seed=split_seed)
    cell = root / S.cells(study)[0].name
    cell.mkdir(parents=True)
    (cell / "splits.json").write_text(json.dumps(splits.manifest()))
    return splits


def _texts(exs):
    return {e.question for e in exs}


def test_a_final_study_refuses_questions_a_development_study_evaluated(tmp_path, data):
    dev = _study("dev", data, ["shared"])
    dev_splits = _record(tmp_path / "dev", dev, data, ["shared"], split_seed=3)
    final = _study("final", data, ["shared"], roles=FINAL_ROLES)
    # the final study's own ood split, carved independently from the same files and seed
    sets = {n: load_source(n, path=str(data[n])) for n in ("dom", "shared")}
    mine = make_splits({"dom": sets["dom"]}, {"shared": sets["shared"]}, n_train=8, n_calib=6,
                       n_test=10, n_ood=12, seed=0)
    shared = len(_texts(mine.ood["shared"]) & _texts(dev_splits.ood["shared"]))
    assert shared > 0  # 12 of 40 questions drawn twice with other seeds: an overlap is certain
    with pytest.raises(D.DisciplineError) as e:
        D.check(final, tmp_path / "final", {"dev": dev, "final": final},
                roots={"dev": tmp_path / "dev"})
    msg = str(e.value)
    assert "study final would test on questions study dev used for development" in msg
    assert f"its ood/shared split shares {shared} questions with dev's ood/shared split" in msg
    assert "Fix:" in msg and "test documents" in msg
    # nothing ran: the check reads and carves only
    assert not (tmp_path / "final").exists()


def test_test_questions_no_development_study_read_pass(tmp_path, data):
    dev = _study("dev", data, ["shared"])
    _record(tmp_path / "dev", dev, data, ["shared"], split_seed=3)
    final = _study("final", data, ["fresh"], roles=FINAL_ROLES)
    # the final study's in-domain test meets the dev study's questions, but it is declared
    # development (exploratory): only its ood split is a final test
    assert D.check(final, tmp_path / "final", {"dev": dev, "final": final},
                   roots={"dev": tmp_path / "dev"}) == 1


def test_a_development_study_refuses_to_read_a_final_studys_test_questions(tmp_path, data):
    final = _study("final", data, ["fresh"], roles=FINAL_ROLES)
    peek = _study("peek", data, ["fresh"], split_seed=5)
    with pytest.raises(D.DisciplineError, match="study peek would develop on final-test questions "
                                                 "of study final: its ood/fresh split shares"):
        D.check(peek, tmp_path / "peek", {"final": final, "peek": peek})
    # development studies among themselves share questions freely (the default roles)
    other = _study("other", data, ["fresh"], split_seed=7)
    assert D.check(peek, tmp_path / "peek", {"other": other, "peek": peek}) == 0


def test_a_question_under_another_id_with_its_options_reordered_is_the_same(tmp_path, data):
    rows = [json.loads(x) for x in data["fresh"].read_text().splitlines()]
    for r in rows:  # a copy of the set: new ids, options rotated, the label following its option
        r["id"] = "copy-" + r["id"]
        gold = r["options"][r["label"]]
        r["options"] = r["options"][1:] + r["options"][:1]
        r["label"] = r["options"].index(gold)
    copy = tmp_path / "copy.jsonl"
    copy.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    data = {**data, "fresh": copy}
    dev = _study("dev", data, ["fresh"], n_ood=40)
    orig = {**data, "fresh": tmp_path / "fresh.jsonl"}
    final = _study("final", orig, ["fresh"], roles=FINAL_ROLES)
    with pytest.raises(D.DisciplineError, match="shares 12 questions with dev's ood/fresh split"):
        D.check(final, tmp_path / "final", {"dev": dev, "final": final})


def test_roles_are_declared_for_every_split_kind():
    assert S.STUDIES["laptop"].roles == {"train": "training", "calib": "development",
                                         "test": "development", "ood": "development"}
    assert S.STUDIES["final"].roles["ood"] == "test"
    with pytest.raises(ValueError, match="roles must give each split kind"):
        S.Study(name="x", common=(), seeds=(0,), variants=(), step_s={}, question_s=0.0, run_s=0.0,
                questions=0, roles={"train": "training", "ood": "final"})
    with pytest.raises(ValueError, match="split 'dev/x': not one of"):
        D.split_kind("dev/x")


def test_the_cli_refuses_before_any_cell_runs(tmp_path, data, monkeypatch, capsys):
    import apps.study.__main__ as cli

    dev = _study("dev", data, ["shared"])
    _record(tmp_path / "runs" / "study-dev", dev, data, ["shared"], split_seed=3)
    final = _study("final", data, ["shared"], roles=FINAL_ROLES)
    monkeypatch.setattr(cli, "STUDIES", {"dev": dev, "final": final})
    monkeypatch.chdir(tmp_path)  # the other studies' cells under runs/study-NAME
    assert main(["final", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "study final would test on questions study dev used for development" in err
    assert main(["final"]) == 2
    assert not any((tmp_path / "runs" / "study-final").glob("*-seed*"))  # no cell started


def test_the_arc_test_documents_share_no_question_with_the_validation_documents():
    """The final study's out-of-domain sets: the ARC test documents, which no earlier study read
    (they all used the validation split), and which carry no copy of a validation question."""
    from apps.calm_llm.data.splits import question_digest

    near = {}
    for name in ("arc_easy", "arc_challenge"):
        val, test = load_source(name), load_source(f"{name}_test")
        assert len(test) > 1000
        assert not {question_digest(e) for e in val} & {question_digest(e) for e in test}
        near[name] = {D.near_digest(e) for e in val} & {D.near_digest(e) for e in test}
    # the one near-duplicate (options "structural adaptation(s)", "behavioral adaptation(s)"),
    # acknowledged by the final study
    assert {k: len(v) for k, v in near.items()} == {"arc_easy": 0, "arc_challenge": 1}
    assert S.STUDIES["final"].acknowledged_shared == {"laptop-screen: ood/arc_challenge_test": 1}
    assert set(S.STUDIES["final"].common) >= {"arc_easy_test", "arc_challenge_test"}


def test_a_declared_study_the_data_cannot_carve_is_named_and_left_out(tmp_path, data, capsys):
    final = _study("final", data, ["fresh"], roles=FINAL_ROLES)
    # asks for 50 in-domain test questions of a 60-question set after 10 training: cannot carve,
    # so it never ran on these data and used no question here
    big = S.Study(name="big", common=(*_args(data, ["fresh"]), "--n-test", "59"), seeds=(0, 1),
                  variants=(S.Variant("reference", ("none",)),), step_s={}, question_s=0.0,
                  run_s=0.0, questions=0)
    assert D.check(final, tmp_path / "final", {"big": big, "final": final}) == 1
    err = capsys.readouterr().err
    assert "split discipline: 2 cells of big left out" in err and "fewer than n_train" in err


def _plural_copy(tmp_path, data):
    """A copy of ``fresh`` under new ids whose options differ only in inflection."""
    rows = [json.loads(x) for x in data["fresh"].read_text().splitlines()]
    for r in rows:
        r["id"] = "plural-" + r["id"]
        r["options"] = [o.replace("yes", "yeses").replace("maybe", "maybes") for o in r["options"]]
    copy = tmp_path / "plural.jsonl"
    copy.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return {**data, "fresh": copy}


def test_a_copy_whose_options_differ_only_in_inflection_is_the_same(tmp_path, data):
    assert D.near_key(load_source("fresh", path=str(_plural_copy(tmp_path, data)["fresh"]))[0]) \
        == D.near_key(load_source("fresh", path=str(data["fresh"]))[0])
    words = ("adaptations", "bodies", "boxes", "maybes", "yeses", "gas", "glass", "is")
    assert [D._fold(w) for w in words] == \
        ["adaptation", "body", "box", "maybe", "yes", "gas", "glass", "is"]
    dev = _study("dev", _plural_copy(tmp_path, data), ["fresh"], n_ood=40)
    final = _study("final", data, ["fresh"], roles=FINAL_ROLES)
    with pytest.raises(D.DisciplineError, match="shares 12 questions with dev's ood/fresh split"):
        D.check(final, tmp_path / "final", {"dev": dev, "final": final})


def test_shared_questions_a_study_acknowledges_pass_and_one_more_is_refused(tmp_path, data, capsys):
    import dataclasses

    dev = _study("dev", _plural_copy(tmp_path, data), ["fresh"], n_ood=40)
    final = _study("final", data, ["fresh"], roles=FINAL_ROLES)
    known = dataclasses.replace(final, acknowledged_shared={"dev: ood/fresh": 12})
    assert D.check(known, tmp_path / "final", {"dev": dev, "final": known}) >= 1
    assert "shares 12 questions with dev's ood/fresh split, acknowledged" in capsys.readouterr().err
    fewer = dataclasses.replace(final, acknowledged_shared={"dev: ood/fresh": 11})
    with pytest.raises(D.DisciplineError, match="shares 12 questions"):
        D.check(fewer, tmp_path / "final", {"dev": dev, "final": fewer})


def test_a_recorded_cell_is_matched_by_near_duplicates_when_its_carving_is_what_ran(tmp_path, data):
    """dev ran (its splits.json recorded, the same seed its declaration carves): its recorded
    questions still meet a plural copy in the final study's test split."""
    plural = _plural_copy(tmp_path, data)
    dev = _study("dev", data, ["fresh"], n_ood=12)
    _record(tmp_path / "runs" / "study-dev", dev, data, ["fresh"], split_seed=0)
    final = _study("final", plural, ["fresh"], roles=FINAL_ROLES, n_ood=40)
    with pytest.raises(D.DisciplineError, match="shares 12 questions with dev's ood/fresh split"):
        D.check(final, tmp_path / "final", {"dev": dev, "final": final})
