"""Issue 29's data and config faults, one table row each: the fault, the expected message."""

from __future__ import annotations

import json
import warnings

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from apps.calm_llm.config import ConfigError, load_file, parse_args
from apps.calm_llm.data import InstructionExample, MCQAExample, make_splits
from apps.calm_llm.data.splits import (
    question_digest,
    question_key,
    split_fingerprint,
    split_fingerprints,
    split_question_digests,
)
from apps.calm_llm.io import CorruptFile
from apps.errors import DataError

# (file name, its text, words the refusal must contain). A new config-file fault is one line.
CONFIG_FILE_FAULTS = [
    ("twice.yaml", "train: {steps: 4}\ntrain: {steps: 8}\n", ["'train'", "line 1 and line 2"]),
    ("nested.yaml", "train:\n  steps: 4\n  lr: 0.1\n  steps: 8\n", ["'steps'", "line 2 and line 4"]),
    ("top.yaml", "seed: 1\nmethods: [none]\nseed: 2\n", ["'seed'", "line 1 and line 3"]),
    ("twice.json", '{"train": {"steps": 4},\n "train": {"steps": 8}}', ["'train'", "line 1 and line 2"]),
    ("nested.json", '{"data": {"steps": 1},\n "train": {\n "steps": 4,\n "lr": "a\\"steps\\": {",\n "steps": 8}}',
     ["'steps'", "line 3 and line 5"]),
]


@pytest.mark.parametrize(("name", "text", "words"), CONFIG_FILE_FAULTS, ids=[r[0] for r in CONFIG_FILE_FAULTS])
def test_config_file_key_given_twice_is_refused(tmp_path, name, text, words):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_file(path)
    assert str(path) in str(e.value) and "given twice" in str(e.value)
    for w in words:
        assert w in str(e.value)
    # the command line refuses it too (the issue's probe: 8 steps were run silently)
    with pytest.raises(ConfigError, match="given twice"):
        parse_args(["--config", str(path)])


def test_yaml_merge_key_may_be_overridden(tmp_path):
    """YAML's "<<" merge is meant to be overridden: not a key given twice."""
    path = tmp_path / "merge.yaml"
    path.write_text("train:\n  <<: {steps: 4, lr: 0.1}\n  steps: 8\n")
    assert load_file(path) == {"train": {"steps": 8, "lr": 0.1}}


def test_same_key_in_two_sections_is_fine(tmp_path):
    path = tmp_path / "ok.yaml"
    path.write_text("train: {steps: 4}\ncalm: {inner_steps: 4}\n")
    assert parse_args(["--config", str(path)]).train.steps == 4


# -- questions: repeated, shared between splits, unanswerable ---------------------------------
def _q(set_: str, i: int, *, text: str | None = None, options=None, label: int = 0, id_: str | None = None):
    return MCQAExample(id_ or f"{set_}:{i}", text or f"Question number {i} about {set_}?",
                       tuple(options or (f"{set_} right {i}", f"wrong {i}", f"other {i}")), label, set_)


def _sets(extra_in=(), extra_ood=(), extra_c=()):
    """Two in-domain sets (a, c) and one OOD set (b), 12 distinct questions each, plus faults."""
    a = [_q("a", i) for i in range(12)] + list(extra_in)
    c = [_q("c", i) for i in range(12)] + list(extra_c)
    b = [_q("b", i) for i in range(12)] + list(extra_ood)
    return {"a": a, "c": c}, {"b": b}


# (fault, in-domain a extras, c extras, OOD b extras, words the refusal names). One line a fault.
QUESTION_FAULTS = [
    ("same question under two ids", [_q("a", 3, id_="a:copy")], [], [],
     ["a: 1 repeated within the set (a:copy)"]),
    ("options reordered, case/spacing/punctuation changed",
     [_q("a", 5, id_="a:h1", text="question  NUMBER 5 about a", options=("other 5", "A right 5", "wrong 5"), label=1)],
     [], [], ["a: 1 repeated within the set (a:h1)"]),
    ("an OOD question in an in-domain set", [_q("b", 4, id_="a:from-b")], [], [],
     ["b & a: 1 in both sets, removed from the second (a:from-b)"]),
    ("one question in two in-domain sets", [], [_q("a", 7, id_="c:from-a")], [],
     ["a & c: 1 in both sets, removed from the second (c:from-a)"]),
    ("gold text repeated as a distractor", [_q("a", 20, options=("yes", "no", "yes"), label=2)], [], [],
     ["a: 1 unanswerable", "a:20"]),
    ("gold repeated up to spacing, in an OOD set", [], [], [_q("b", 20, options=("x  y", "z", "x y"), label=0)],
     ["b: 1 unanswerable", "b:20"]),
    ("a repeat inside the OOD set", [], [], [_q("b", 2, id_="b:again")], ["b: 1 repeated within the set (b:again)"]),
]


@pytest.mark.parametrize(("fault", "a", "c", "b", "words"), QUESTION_FAULTS, ids=[r[0] for r in QUESTION_FAULTS])
def test_question_fault_is_refused_or_dropped_and_counted(fault, a, c, b, words):
    ind, ood = _sets(a, b, c)
    kw = dict(n_train=8, n_calib=4, n_test=4, n_ood=20, seed=0)
    with pytest.raises(DataError) as e:
        make_splits(ind, ood, dedup="refuse", **kw)
    assert "--dedup refuse" in str(e.value) and "--dedup drop" in str(e.value)
    for w in words:
        assert w in str(e.value)
    with pytest.warns(UserWarning, match="--dedup drop"):
        s = make_splits(ind, ood, dedup="drop", **kw)
    # after dropping: every question once, in one split only, none unanswerable
    keys = [question_key(x) for exs in s.named().values() for x in exs]
    assert len(keys) == len(set(keys))
    assert not any(x.gold_repeated() for exs in s.named().values() for x in exs)
    m = s.manifest()
    dropped = (sum(m["overlap_removed"].values()) + sum(m["repeated_removed"].values())
               + sum(len(v) for v in m["unanswerable_removed"].values()))
    assert dropped == 1


def test_clean_data_is_accepted_by_refuse_and_unchanged_by_drop():
    ind, ood = _sets()
    kw = dict(n_train=8, n_calib=4, n_test=4, n_ood=12, seed=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert make_splits(ind, ood, dedup="refuse", **kw).manifest() == \
            {**make_splits(ind, ood, **kw).manifest(), "dedup": "refuse"}


def test_meaningful_differences_are_not_duplicates():
    """Case and signs carry meaning in option texts (measured in the offline sets: ARC's
    genotypes, MMLU's "1"/"-1"): such questions are neither unanswerable nor merged."""
    assert not _q("a", 0, options=("Cc or cc", "CC or Cc", "CC only"), label=0).gold_repeated()
    assert not _q("a", 0, options=("1", "-1", "i", "-i"), label=1).gold_repeated()
    x = _q("a", 0, options=("1", "-1"))
    assert question_key(x) != question_key(_q("a", 0, options=("1", "+1")))
    assert question_key(x) == question_key(_q("a", 0, text="QUESTION number 0, about a.", options=("-1", "1")))


def test_the_issue_probe_no_test_question_is_trained_on():
    """Issue 29's probe: 6 of 8 test questions also in training under other ids or with their
    options reordered and no id. After the default drop, train/calib share no question with
    test or OOD, and each repeated question counts once."""
    base = [_q("a", i) for i in range(40)]
    copies = [_q("a", i, id_=f"a:dup{i}", options=tuple(reversed(base[i].options)), label=2) for i in range(0, 40, 2)]
    ood = {"b": [_q("b", i) for i in range(10)] + [_q("a", 1, id_="b:a1")]}
    with pytest.warns(UserWarning):
        s = make_splits({"a": base + copies}, ood, n_train=16, n_calib=4, n_test=8, n_ood=11, seed=0)
    seen = {question_key(x) for x in s.train + s.calib}
    tested = {question_key(x) for x in s.test["a"] + s.ood["b"]}
    assert not seen & tested
    assert s.repeated == {"a": 20} and s.overlap == {"b & a": 1}
    assert len(s.test["a"]) == 8 and len(s.ood["b"]) == 11


def test_dropping_k_questions_moves_only_k():
    """The set is shuffled as read and the dropped question's place goes to the next one drawn:
    with a repeat in place of a fresh question, each split changes by at most that one."""
    ind, ood = _sets()
    kw = dict(n_train=12, n_calib=4, n_test=4, n_ood=12, seed=1)
    victim = ind["a"][5]
    fresh = _q("a", 99, id_="a:last")
    twin = MCQAExample("a:last", victim.question, victim.options[::-1], len(victim.options) - 1 - victim.label, "a")
    before = make_splits({"a": [*ind["a"], fresh], "c": ind["c"]}, ood, **kw)
    with pytest.warns(UserWarning, match="a: 1 repeated"):
        after = make_splits({"a": [*ind["a"], twin], "c": ind["c"]}, ood, **kw)
    moved = {name: {x.id for x in exs} - {x.id for x in after.named()[name]} for name, exs in before.named().items()}
    assert all(v <= {"a:last"} for v in moved.values()), moved


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 11), st.booleans()), max_size=12),
       st.integers(0, 5))
def test_property_every_question_once_and_every_drop_counted(copies, seed):
    """Copies (any set, reordered options, shouted) of random questions: after the default drop
    no key occurs twice over all splits, and kept + dropped = the questions given."""
    ind, ood = _sets()
    sets = {**ind, **ood}
    names = ["a", "c", "b"]
    for j, (k, i, shout) in enumerate(copies):
        src = sets[names[(k + j) % 3]][i]
        text = src.question.upper() if shout else src.question
        sets[names[k]].append(MCQAExample(f"{names[k]}:copy{j}", text, src.options[::-1],
                                          len(src.options) - 1 - src.label, names[k]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        s = make_splits({"a": sets["a"], "c": sets["c"]}, {"b": sets["b"]}, n_train=4, n_calib=2,
                        n_test=2, n_ood=100, seed=seed)
    keys = [question_key(x) for exs in s.named().values() for x in exs]
    assert len(keys) == len(set(keys))
    # the oracle: distinct keys counted directly
    ood_keys = {question_key(x) for x in sets["b"]}
    in_keys = {question_key(x) for n in ("a", "c") for x in sets[n]} - ood_keys
    assert len(s.ood["b"]) == len(ood_keys) == len(sets["b"]) - s.repeated.get("b", 0)
    dropped_in = sum(s.overlap.values()) + s.repeated.get("a", 0) + s.repeated.get("c", 0)
    assert dropped_in == len(sets["a"]) + len(sets["c"]) - len(in_keys)


def test_dedup_option_is_checked_and_outside_the_hash():
    cfg = parse_args(["--config", "tiny"])
    assert cfg.data.dedup == "drop"
    assert parse_args(["--config", "tiny", "--dedup", "refuse"]).hash() == cfg.hash()
    with pytest.raises((ConfigError, SystemExit)):
        parse_args(["--config", "tiny", "--dedup", "off"])


# -- split fingerprints ---------------------------------------------------------------------------
def test_fingerprint_ignores_ids_order_and_option_order_but_not_content():
    exs = [_q("a", i) for i in range(6)]
    fp = split_fingerprint(exs)
    renamed = [MCQAExample(f"z:{i}", x.question, x.options[::-1], len(x.options) - 1 - x.label, "z")
               for i, x in enumerate(reversed(exs))]
    assert split_fingerprint(renamed) == fp
    assert split_fingerprint(exs[:5] + [_q("a", 6)]) != fp
    assert split_fingerprint(exs[:5]) != fp
    instr = [InstructionExample(f"i:{i}", f"Do task {i}.", "", "done", "i") for i in range(3)]
    assert split_fingerprint(instr) == split_fingerprint(instr[::-1]) != split_fingerprint(instr[:2])
    with pytest.raises(ConfigError, match="--dedup.*'off'"):
        make_splits(*_sets(), n_train=8, n_calib=4, n_test=4, n_ood=12, seed=0, dedup="off")


def _record(tmp_path, **kw):
    ind, ood = _sets()
    s = make_splits(ind, ood, n_train=8, n_calib=4, n_test=4, n_ood=12, seed=0)
    m = s.manifest()
    (tmp_path / "splits.json").write_text(json.dumps(m))
    return s, m


# (fault in a run's splits.json, expected error type, words). A new fault is one line.
RECORD_FAULTS = [
    ("edited question digest", lambda m: m["splits"]["train"]["questions"].__setitem__(0, "0" * 16),
     CorruptFile, "does not match its question digests"),
    ("record without fingerprints", lambda m: m["splits"]["calib"].pop("fingerprint"),
     DataError, "predates split fingerprints"),
    ("not JSON", None, CorruptFile, "is unreadable"),
]


@pytest.mark.parametrize(("fault", "edit", "err", "words"), RECORD_FAULTS, ids=[r[0] for r in RECORD_FAULTS])
def test_split_fingerprints_reads_a_run_and_refuses_a_damaged_record(tmp_path, fault, edit, err, words):
    s, m = _record(tmp_path)
    assert split_fingerprints(tmp_path) == s.fingerprints()
    assert split_question_digests(tmp_path)["test/a"] == {question_digest(x) for x in s.test["a"]}
    if edit is None:
        (tmp_path / "splits.json").write_text('{"splits": {')
    else:
        edit(m)
        (tmp_path / "splits.json").write_text(json.dumps(m))
    with pytest.raises(err, match=words) as e:
        split_fingerprints(tmp_path)
    assert str(tmp_path / "splits.json") in str(e.value)


def test_run_records_fingerprints_in_splits_json_and_metrics_extra(tmp_path):
    """The runner's prepare stage writes splits.json with the fingerprints and puts them in the
    run-level record that metrics.json is written from."""
    from apps.calm_llm import distributed, tasks
    from apps.calm_llm.runner.run import prepare

    cfg = parse_args(["--config", "tiny", "--out", str(tmp_path / "run")])
    state, splits = prepare(cfg, distributed.init(fsdp=False), tasks.get("mcqa"))
    assert state.extra["split_fingerprints"] == splits.fingerprints() == split_fingerprints(state.run_dir)
    assert set(state.extra["split_fingerprints"]) == {"train", "calib", "test/sciq", "ood/arc_easy"}
