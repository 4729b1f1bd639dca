"""Splits: disjoint by id, deterministic per seed, balanced, recorded in a manifest."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from apps.calm_llm.data import InstructionExample, MCQAExample, make_splits
from apps.calm_llm.data.splits import allocate, split_digest


def _set(name: str, n: int) -> list[MCQAExample]:
    return [MCQAExample(f"{name}:{i}", f"{name} question {i}", ("a", "b", "c", "d"), i % 4, name) for i in range(n)]


IN = {"mmlu": _set("mmlu", 400), "medmcqa": _set("medmcqa", 120), "openbookqa": _set("openbookqa", 40)}
OOD = {"arc_challenge": _set("arc_challenge", 30), "sciq": _set("sciq", 80)}


def _all_ids(s):
    return [e.id for exs in s.named().values() for e in exs]


def test_disjoint_sizes_and_balance():
    s = make_splits(IN, OOD, n_train=150, n_calib=60, n_test=20, n_ood=50, seed=0)
    ids = _all_ids(s)
    assert len(ids) == len(set(ids)), "splits overlap"
    assert len(s.train) == 150 and len(s.calib) == 60
    assert {k: len(v) for k, v in s.test.items()} == {"mmlu": 20, "medmcqa": 20, "openbookqa": 20}
    assert {k: len(v) for k, v in s.ood.items()} == {"arc_challenge": 30, "sciq": 50}  # n_ood caps
    # calibration is spread evenly (20 each), training takes what each set still holds
    calib_by_set = {k: sum(e.source == k for e in s.calib) for k in IN}
    assert calib_by_set == {"mmlu": 20, "medmcqa": 20, "openbookqa": 20}
    train_by_set = {k: sum(e.source == k for e in s.train) for k in IN}
    assert train_by_set["openbookqa"] == 0 and train_by_set["mmlu"] == train_by_set["medmcqa"] == 75
    # test sets hold only their own set's questions
    assert all(e.source == k for k, v in s.test.items() for e in v)


def test_deterministic_and_seed_dependent():
    kw = dict(n_train=100, n_calib=30, n_test=10, n_ood=20)
    a = make_splits(IN, OOD, seed=7, **kw).manifest()
    b = make_splits({k: list(v) for k, v in IN.items()}, dict(OOD), seed=7, **kw).manifest()
    c = make_splits(IN, OOD, seed=8, **kw).manifest()
    assert a == b
    assert a["splits"]["train"]["ids"] != c["splits"]["train"]["ids"]
    assert a["splits"]["train"]["sha256"] != c["splits"]["train"]["sha256"]


def test_adding_an_ood_set_does_not_move_other_draws():
    kw = dict(n_train=100, n_calib=30, n_test=10, n_ood=20, seed=3)
    a = make_splits(IN, {"sciq": OOD["sciq"]}, **kw)
    b = make_splits(IN, OOD, **kw)
    assert [e.id for e in a.ood["sciq"]] == [e.id for e in b.ood["sciq"]]
    assert [e.id for e in a.train] == [e.id for e in b.train]


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 60), min_size=1, max_size=4),
    n_test=st.integers(0, 5),
    n_train=st.integers(0, 80),
    n_calib=st.integers(0, 40),
    seed=st.integers(0, 10_000),
)
def test_property_disjoint_or_clear_error(sizes, n_test, n_train, n_calib, seed):
    in_domain = {f"s{i}": _set(f"s{i}", n) for i, n in enumerate(sizes)}
    too_small = any(n < n_test for n in sizes) or sum(sizes) - n_test * len(sizes) < n_train + n_calib
    if too_small:
        with pytest.raises(ValueError):
            make_splits(in_domain, {}, n_train=n_train, n_calib=n_calib, n_test=n_test, n_ood=0, seed=seed)
        return
    s = make_splits(in_domain, {}, n_train=n_train, n_calib=n_calib, n_test=n_test, n_ood=0, seed=seed)
    ids = _all_ids(s)
    assert len(ids) == len(set(ids)) and len(s.train) == n_train and len(s.calib) == n_calib


@given(total=st.integers(0, 100), available=st.lists(st.integers(0, 50), min_size=1, max_size=6))
def test_allocate_is_even_and_feasible(total, available):
    if total > sum(available):
        with pytest.raises(ValueError):
            allocate(total, available)
        return
    take = allocate(total, available)
    assert sum(take) == total and all(0 <= t <= a for t, a in zip(take, available))
    # even: a group below another's share is full
    for i, t in enumerate(take):
        assert t == available[i] or t >= max(take) - 1


def test_instruction_training_protocol():
    instr = [InstructionExample(f"alpaca:{i}", f"do {i}", "", f"done {i}", "alpaca") for i in range(50)]
    s = make_splits(IN, OOD, n_train=30, n_calib=40, n_test=10, n_ood=10, seed=0, instruction_train=instr)
    assert len(s.train) == 30 and all(isinstance(e, InstructionExample) for e in s.train)
    assert len(s.calib) == 40 and all(isinstance(e, MCQAExample) for e in s.calib)
    assert len(set(_all_ids(s))) == len(_all_ids(s))


def test_manifest_is_json_and_hash_tracks_content():
    s = make_splits(IN, OOD, n_train=20, n_calib=10, n_test=5, n_ood=5, seed=0)
    m = json.loads(json.dumps(s.manifest()))
    assert set(m["splits"]) == {"train", "calib", "test/mmlu", "test/medmcqa", "test/openbookqa",
                                "ood/arc_challenge", "ood/sciq"}
    assert m["splits"]["calib"]["n"] == 10 and len(m["splits"]["calib"]["ids"]) == 10
    ex = s.calib[0]
    changed = MCQAExample(ex.id, ex.question + "!", ex.options, ex.label, ex.source)
    assert split_digest([changed, *s.calib[1:]]) != m["splits"]["calib"]["sha256"]
    assert split_digest(s.calib) == m["splits"]["calib"]["sha256"]


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="fewer than n_test"):
        make_splits(IN, {}, n_train=0, n_calib=0, n_test=41, n_ood=0, seed=0)
    with pytest.raises(ValueError, match="both in-domain and out-of-domain"):
        make_splits(IN, {"mmlu": IN["mmlu"]}, n_train=0, n_calib=0, n_test=1, n_ood=0, seed=0)
    with pytest.raises(ValueError, match="duplicate example id"):
        make_splits({"a": _set("x", 5), "b": _set("x", 5)}, {}, n_train=0, n_calib=0, n_test=1, n_ood=0, seed=0)
    with pytest.raises(ValueError, match="n_train \\+ n_calib"):
        make_splits(IN, {}, n_train=600, n_calib=0, n_test=1, n_ood=0, seed=0)
    with pytest.raises(ValueError, match="n_calib must be >= 0"):
        make_splits(IN, {}, n_train=0, n_calib=-1, n_test=1, n_ood=0, seed=0)


def test_a_question_copied_into_an_in_domain_file_never_meets_its_ood_copy(tmp_path):
    """ARC-Easy questions copied into a local in-domain file (other ids, another source name, the
    options reordered) while arc_easy is out-of-domain: no OOD test question may be trained or
    calibrated on, and the removal is reported (a warning, and the manifest's overlap_removed)."""
    from apps.calm_llm.data import load_source
    from apps.calm_llm.data.splits import content_key

    ood_rows = [{"id": f"Mercury_{i}", "question": f"Which planet is number {i} from the sun?",
                 "options": [f"p{i}", f"q{i}", f"r{i}", f"s{i}"], "label": i % 4} for i in range(20)]
    own = [{"id": f"own{i}", "question": f"Local question {i}?", "options": ["yes", "no"],
            "label": i % 2} for i in range(30)]
    copied = [{"id": f"copy{i}", "question": r["question"].upper(),
               "options": list(reversed(r["options"])), "label": 3 - r["label"]}
              for i, r in enumerate(ood_rows[:9])]
    (tmp_path / "arc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ood_rows))
    (tmp_path / "mine.jsonl").write_text("".join(json.dumps(r) + "\n" for r in own + copied))
    arc = load_source("arc_easy", path=tmp_path / "arc.jsonl")
    mine = load_source("mine", path=tmp_path / "mine.jsonl")
    assert len(mine) == 39
    with pytest.warns(UserWarning, match=r"arc_easy & mine: 9"):
        s = make_splits({"mine": mine}, {"arc_easy": arc}, n_train=12, n_calib=9, n_test=9,
                        n_ood=20, seed=0)
    ood_keys = {content_key(e) for e in s.ood["arc_easy"]}
    assert len(ood_keys) == 20
    trained = [e for name, exs in s.named().items() if not name.startswith("ood/") for e in exs]
    assert not ood_keys & {content_key(e) for e in trained}
    assert s.manifest()["overlap_removed"] == {"arc_easy & mine": 9}
    assert sum(len(v) for n, v in s.named().items() if not n.startswith("ood/")) == 39 - 9


def test_a_size_refusal_after_dropped_duplicates_says_how_many_and_which_flags():
    """Questions repeated under other ids are dropped by --dedup drop; when the set is then too
    small, the refusal says that they were dropped, how many, and what to change."""
    base = _set("quiz", 20)
    repeats = [MCQAExample(f"quiz:again{i}", e.question, e.options, e.label, "quiz")
               for i, e in enumerate(base[:12])]
    with pytest.warns(UserWarning, match="repeated within the set"):
        with pytest.raises(ValueError) as e:
            make_splits({"quiz": base + repeats}, {}, n_train=20, n_calib=4, n_test=2, n_ood=0,
                        seed=0)
    text = str(e.value)
    assert "fewer than n_train + n_calib = 24" in text
    assert "--dedup drop removed 12 questions before the splits were carved: 12 repeated" in text
    assert "--dedup refuse lists them instead" in text and "lower --n-train / --n-calib" in text
