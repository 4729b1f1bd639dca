"""The CALM paper's OOD protocol end to end on the tiny model: train on a local Alpaca-format
JSONL file (instruction data, loss on the response tokens), calibrate and test on MCQA."""

import json

import pytest

from apps.calm_llm.__main__ import main
from apps.calm_llm.data import InstructionExample, load_source
from apps.calm_llm.methods.base import Stream

ROWS = [
    {"instruction": f"Name a colour number {i}.", "input": "" if i % 2 else f"hint {i}",
     "output": f"Colour {i} is {'red' if i % 3 else 'blue'}."}
    for i in range(12)
]


@pytest.fixture()
def alpaca_file(tmp_path):
    path = tmp_path / "my_instructions.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return path


def test_any_name_reads_alpaca_rows_when_asked(alpaca_file):
    # --instruction-data NAME need not start with "alpaca": the runner says what the rows are
    exs = load_source("mine", path=alpaca_file, instruction=True)
    assert len(exs) == 12 and all(isinstance(e, InstructionExample) for e in exs)
    assert exs[0].id.startswith("mine:") and exs[1].input == ""
    with pytest.raises(ValueError, match="'question'"):  # as MCQA rows it names the missing field
        load_source("mine", path=alpaca_file)


@pytest.mark.slow
def test_instruction_training_run(tmp_path, alpaca_file, monkeypatch):
    batches: list = []
    original = Stream.next

    def spy(self):
        b = original(self)
        batches.append(b.mode)
        return b

    monkeypatch.setattr(Stream, "next", spy)
    out = tmp_path / "run"
    rc = main(["--config", "tiny", "--methods", "sft", "calm", "--steps", "2", "--n-boot", "0",
               "--checkpoint-every", "0", "--n-train", "8", "--instruction-data", "mine",
               "--data-files", f"mine={alpaca_file}", "--out", str(out)])
    assert rc == 0
    splits = json.loads((out / "splits.json").read_text())["splits"]
    assert splits["train"]["n"] == 8 and all(i.startswith("mine:") for i in splits["train"]["ids"])
    assert splits["calib"]["n"] == 8 and all(i.startswith("sciq:") for i in splits["calib"]["ids"])
    # sft: 2 instruction batches; calm: per step one instruction (lower) + one MCQA (upper) batch
    assert batches == ["instruction"] * 2 + ["instruction", "cloze"] * 2
    results = json.loads((out / "metrics.json").read_text())["results"]
    assert set(results) == {"sft", "calm", "calm:no_alpha"}
    for per_ds in results.values():
        assert set(per_ds) == {"sciq", "arc_easy"}
        assert all(0 <= m["accuracy"] <= 1 for m in per_ds.values())
    assert (out / "export" / "calm" / "alpha.json").is_file()

