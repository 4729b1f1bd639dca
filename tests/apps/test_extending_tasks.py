"""docs/extending.md "Adding a task" runs as written: a task registered from a module of one's
own and loaded with --plugins runs on the tiny model through the same runner as the built-in
tasks, with no project file edited, and its numbers agree with the multiple-choice run's."""

import json
import sys

import pytest

from apps.calm_llm import tasks
from apps.calm_llm.__main__ import main
from tests.apps.test_extending import section_code

PLUGIN = "top_option_task"
TINY = ["--config", "tiny", "--n-boot", "0", "--steps", "1", "--checkpoint-every", "0"]


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """The doc's task module, importable as PLUGIN; unregistered and unloaded afterwards."""
    (tmp_path / f"{PLUGIN}.py").write_text(section_code("Adding a task"))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield PLUGIN
    tasks.unregister("top_option")
    sys.modules.pop(PLUGIN, None)


def test_a_plugin_task_runs_end_to_end(plugin, tmp_path, capsys):
    out, mc = tmp_path / "run", tmp_path / "mc"
    rows = ["none", "ts", "sft"]
    assert main([*TINY, "--plugins", plugin, "--task", "top_option", "--methods", *rows,
                 "--out", str(out)]) == 0
    printed, log = capsys.readouterr()
    assert "top_option" in tasks.names()  # the table is the CLI's list of tasks
    saved = json.loads((out / "metrics.json").read_text())
    assert saved["task"] == "top_option" and set(saved["results"]) == set(rows)
    assert saved["config_hash"] and set(saved["split_fingerprints"]) >= {"train", "calib"}
    for per_ds in saved["results"].values():
        assert set(per_ds) == {"sciq", "arc_easy"}
        for r in per_ds.values():
            assert r["n"] == 8 and 0 <= r["accuracy"] <= 1 and 0 < r["mean_confidence"] <= 1
            assert r["gap"] == pytest.approx(abs(r["mean_confidence"] - r["accuracy"]), abs=1e-12)
    assert "| none | sciq |" in printed  # the task's own table, printed by the runner
    assert "|conf-acc|" in log  # each row's summary line reads the task's ece_name
    assert not (out / "results.md").exists()  # the files are the task's: it writes none
    assert (out / "export" / "sft" / "adapter_config.json").is_file()  # export is the runner's
    assert json.loads((out / "config.json").read_text())["task"] == "top_option"

    # the rows that train nothing see the same questions and model as in a multiple-choice
    # run: the same accuracy and mean confidence (the oracle: the built-in task's metrics;
    # trained rows differ by their generator seed, `Task.row_seed` vs the mcqa task's)
    assert main([*TINY, "--methods", "none", "ts", "--out", str(mc)]) == 0
    want = json.loads((mc / "metrics.json").read_text())["results"]
    for row in ("none", "ts"):
        for ds, r in saved["results"][row].items():
            assert r["accuracy"] == pytest.approx(want[row][ds]["accuracy"], abs=1e-12), (row, ds)
            assert r["mean_confidence"] == pytest.approx(want[row][ds]["mean_confidence"],
                                                         rel=1e-6), (row, ds)


def test_an_unknown_task_lists_the_registered_ones(capsys):
    with pytest.raises(SystemExit) as exit_:  # argparse refuses it: the table is its choices
        main(["--config", "tiny", "--task", "no_such_task"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "no_such_task" in err and "mcqa" in err and "open_qa" in err
