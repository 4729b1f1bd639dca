"""What the runner guarantees: nothing lost (atomic results files, named corrupt files, checks
before loading) and nothing mixed (run folders, resume against the saved config and splits)."""

import errno
import io
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from apps.calm_llm import checkpoint, evaluate
from apps.calm_llm import config as C
from apps.calm_llm.__main__ import main
from apps.calm_llm.io import CorruptFile
from apps.calm_llm.methods.calm import CalmObjectives
from apps.calm_llm.tasks import mcqa as runner_load


def _write_source(path, name, n, label_of=lambda i: i % 4):
    rows = [{"id": f"{name}{i}", "question": f"Which {name} thing number {i} is right?",
             "options": [f"alpha {i}", f"beta {i}", f"gamma {i}", f"delta {i}"],
             "label": label_of(i)} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# relative paths (run from the folder holding data/), so a copied run reads its copied data
ARGS = ["--config", "tiny", "--methods", "none", "sft", "--steps", "2", "--checkpoint-every", "2",
        "--n-boot", "0", "--data-files", "sciq=data/sciq.jsonl", "arc_easy=data/arc.jsonl"]


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """One finished tiny run (none + sft) on local data files; tests work on copies of it."""
    root = tmp_path_factory.mktemp("finished")
    (root / "data").mkdir()
    _write_source(root / "data" / "sciq.jsonl", "sciq", 40)
    _write_source(root / "data" / "arc.jsonl", "arc", 12)
    cwd = os.getcwd()
    os.chdir(root)
    try:
        assert main([*ARGS, "--out", "run"]) == 0
    finally:
        os.chdir(cwd)
    return root


@pytest.fixture
def run_copy(finished, tmp_path, monkeypatch):
    """(run, data) copied into tmp_path, which is the working directory."""
    shutil.copytree(finished / "run", tmp_path / "run")
    shutil.copytree(finished / "data", tmp_path / "data")
    monkeypatch.chdir(tmp_path)
    return tmp_path / "run", tmp_path / "data"


def _metrics(run):
    return json.loads((run / "metrics.json").read_text())


# -- run directories -----------------------------------------------------------------------------
@pytest.mark.slow
def test_a_new_run_does_not_write_into_a_finished_run(run_copy, capsys):
    run, _ = run_copy
    before = (run / "metrics.json").read_bytes()
    assert main([*ARGS, "--out", str(run)]) == 1
    err = capsys.readouterr().err
    assert f"--out {run} already holds a run" in err and f"--resume {run}" in err
    assert (run / "metrics.json").read_bytes() == before


def test_runs_started_in_the_same_second_get_their_own_folders(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    from apps.calm_llm.runner import prepare

    monkeypatch.setattr(prepare.time, "strftime", lambda fmt: "20250101-120000")
    cfg = C.parse_args(["--config", "tiny"])
    first, second = prepare.make_run_dir(cfg), prepare.make_run_dir(cfg)
    assert first != second and first.is_dir() and second.is_dir()
    assert second.name == "20250101-120000-2"


# -- resume --------------------------------------------------------------------------------------
@pytest.mark.slow
def test_resume_refuses_data_that_give_other_splits(run_copy, capsys):
    run, data = run_copy
    saved = (run / "splits.json").read_text()
    _write_source(data / "sciq.jsonl", "sciq", 40, label_of=lambda i: (i + 1) % 4)  # every label
    capsys.readouterr()
    assert main(["--resume", str(run)]) == 1
    err = capsys.readouterr().err
    assert "no longer give the splits" in err and "test/sciq: 8 of 8 examples differ (sources: sciq)" in err
    assert "--force-resume" in err
    assert (run / "splits.json").read_text() == saved  # the record is not overwritten
    # forced: it continues, and keeps the old record beside the new one
    assert main(["--resume", str(run), "--force-resume"]) == 0
    assert (run / "splits.before-resume.json").read_text() == saved
    assert (run / "splits.json").read_text() != saved


def test_resume_refusal_names_the_option_and_both_values(run_copy, capsys):
    run, _ = run_copy
    assert main(["--resume", str(run), "--lr", "0.5"]) == 1
    err = capsys.readouterr().err
    assert "--lr: 0.001 (the run's) vs 0.5 (now)" in err


@pytest.mark.slow
def test_evaluation_options_may_change_on_resume(run_copy, capsys):
    run, _ = run_copy
    assert _metrics(run)["results"]["sft"]["sciq"]["n_bins"] == 10
    assert main(["--resume", str(run), "--n-bins", "5", "--n-boot", "20"]) == 0
    err = capsys.readouterr().err
    assert "[sft] already evaluated" in err and "re-evaluated the kept methods" in err
    for per_ds in _metrics(run)["results"].values():
        for r in per_ds.values():
            assert r["n_bins"] == 5 and r["n_boot"] == 20 and r["conf_ece_ci"] is not None


@pytest.mark.parametrize("name", ["metrics.json", "predictions.safetensors"])
def test_a_cut_results_file_is_named_on_resume(run_copy, capsys, name):
    run, _ = run_copy
    path = run / name
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    assert main(["--resume", str(run)]) == 1
    err = capsys.readouterr().err
    assert str(path) in err and "Delete metrics.json and predictions.safetensors" in err


# -- atomic results files ------------------------------------------------------------------------
def test_a_full_disk_while_writing_keeps_the_previous_results(tmp_path, monkeypatch):
    probs, labels = torch.tensor([[0.7, 0.3], [0.4, 0.6]]), torch.tensor([0, 1])
    res = {"none": {"d": evaluate.dataset_metrics(probs, labels, domain="id", n_boot=0)}}
    preds = {"none": {"d": (probs, labels)}}
    evaluate.write_results(tmp_path, res, preds, plots=False)
    before = (tmp_path / "metrics.json").read_text()
    real_open = io.open

    class HalfWritten:
        """A file on a full disk: half of the first write lands, then ENOSPC."""

        def __init__(self, fh):
            self.fh = fh

        def write(self, data):
            self.fh.write(data[: len(data) // 2])
            self.fh.flush()
            raise OSError(errno.ENOSPC, "No space left on device")

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.fh.close()

        def __getattr__(self, name):
            return getattr(self.fh, name)

    def full_disk_open(file, mode="r", *args, **kwargs):
        fh = real_open(file, mode, *args, **kwargs)
        return HalfWritten(fh) if any(c in mode for c in "wax") else fh

    monkeypatch.setattr(io, "open", full_disk_open)
    other = {"none": {"d": {**res["none"]["d"], "accuracy": 0.0}}}
    with pytest.raises(OSError, match="No space left"):
        evaluate.write_results(tmp_path, other, preds, plots=False)
    monkeypatch.setattr(io, "open", real_open)
    assert (tmp_path / "metrics.json").read_text() == before
    assert not list(tmp_path.glob(".*.tmp"))  # the cut temporary file is removed


# -- checkpoints ---------------------------------------------------------------------------------
class _Lm:
    def load_inner(self, state):
        self.state = state


class _Method:
    name = "sft"
    optimizers: dict = {}
    schedulers: dict = {}
    streams: dict = {}

    def outer_params(self):
        return {}

    def tensors(self):
        return {}

    def load_tensors(self, tensors):
        pass


def _saved_checkpoint(tmp_path):
    d = tmp_path / "sft"
    checkpoint.save(d, method=_Method(), lora={"w": torch.arange(64.0)}, step=2, config_hash="h",
                    history=[])
    return d


def test_a_checkpoint_whose_tensors_changed_is_refused_by_name(tmp_path):
    d = _saved_checkpoint(tmp_path)
    path = d / "state.safetensors"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF  # one flipped byte inside a tensor: it would load, with another value
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptFile, match="do not match the checksum") as e:
        checkpoint.restore(d, method=_Method(), lm=_Lm(), config_hash="h")
    assert str(path) in str(e.value) and f"Delete the folder {d}" in str(e.value)


@pytest.mark.parametrize("name", ["state.json", "state.safetensors"])
def test_a_cut_checkpoint_file_is_named(tmp_path, name):
    d = _saved_checkpoint(tmp_path)
    path = d / name
    path.write_bytes(path.read_bytes()[:20])
    with pytest.raises(CorruptFile) as e:
        checkpoint.restore(d, method=_Method(), lm=_Lm(), config_hash="h")
    assert str(d) in str(e.value) and "Delete the folder" in str(e.value)


# -- a NaN inside the bilevel solver ---------------------------------------------------------------
def test_a_nan_during_calm_names_method_step_and_checkpoint(tmp_path, monkeypatch, capsys):
    original, calls = CalmObjectives.upper, []

    def upper(self, outer, inner, batch):
        calls.append(1)
        value = original(self, outer, inner, batch)
        return value * math.nan if len(calls) > 2 else value

    monkeypatch.setattr(CalmObjectives, "upper", upper)
    rc = main(["--config", "tiny", "--methods", "calm", "--steps", "3", "--checkpoint-every", "1",
               "--n-boot", "0", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 1
    assert "[calm] non-finite loss at step" in err and "last good checkpoint" in err
    assert "checkpoints/calm (step" in err


# -- values that could only fail later are refused before any loading ------------------------------
@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--n-bins", "0"], "--n-bins: must be at least 1"),
        (["--n-boot", "1"], "--n-boot: must be 0 (no intervals) or at least 2"),
        (["--eta", "nan"], "--eta: must be a finite number, got nan"),
        (["--lr", "inf"], "--lr: must be a finite number, got inf"),
        (["--max-grad-norm", "nan"], "--max-grad-norm: must be a finite number"),
        (["--solver", "itd", "--itd-truncate", "9"], "--itd-truncate 9: more than the 2 inner steps"),
        (["--device", "tpu"], "--device: 'tpu' is not one of"),
        (["--model", "/nonexistent"], "--model /nonexistent: no such folder"),
        (["--model", "not a repo"], "neither a folder nor a hub name"),
        (["--data-files", "sciq=/nonexistent.jsonl"], "no such file '/nonexistent.jsonl'"),
        (["--force-resume"], "--force-resume: only with --resume"),
    ],
)
def test_values_that_fail_later_are_refused_first(argv, needle):
    with pytest.raises(C.ConfigError) as e:
        C.parse_args(["--config", "tiny", *argv])
    assert needle in str(e.value)


def test_out_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(C.ConfigError, match="a file is there, not a run directory"):
        C.parse_args(["--out", str(tmp_path / "f")])


@pytest.mark.parametrize(("name", "text", "needle"), [
    ("bad.yaml", "model:\n  name_or_path: [tiny\n", "not valid YAML"),
    ("bad.json", '{"model": {"name_or_path": "tiny",}}', "not valid JSON (Expecting property name"),
])
def test_a_broken_config_file_is_named_with_the_line(tmp_path, name, text, needle, capsys):
    (tmp_path / name).write_text(text)
    assert main(["--config", str(tmp_path / name)]) == 2
    err = capsys.readouterr().err
    assert f"--config {tmp_path / name}: {needle}" in err and "line " in err


# -- data the model sees differently from the file -------------------------------------------------
@pytest.mark.slow
def test_a_max_length_that_cuts_prompts_is_warned_about_with_the_count(finished, tmp_path, monkeypatch):
    shutil.copytree(finished / "data", tmp_path / "data")
    monkeypatch.chdir(tmp_path)
    argv = ["--config", "tiny", "--methods", "none", "--n-boot", "0", "--max-length", "12",
            "--data-files", "sciq=data/sciq.jsonl", "arc_easy=data/arc.jsonl"]
    with pytest.warns(UserWarning, match=r"examples are longer than --max-length 12 tokens \("
                                         r"train \d+ of \d+, calib \d+ of \d+, test/sciq 8 of 8"):
        assert main([*argv, "--out", "cut"]) == 0


# -- a --model this machine cannot load ------------------------------------------------------------
def _no_data_loading(monkeypatch):
    def refuse(cfg):
        raise AssertionError("the data were loaded before the model was checked")

    monkeypatch.setattr(runner_load, "load_data", refuse)


def test_a_hub_model_offline_and_not_cached_fails_in_one_line_before_the_data(tmp_path, monkeypatch,
                                                                              capsys):
    import huggingface_hub.constants

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    _no_data_loading(monkeypatch)
    assert main(["--config", "tiny", "--model", "someorg/no-such-model-here", "--methods", "none"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0] and "Repo id" not in err[0]
    assert err[0].startswith("error: --model someorg/no-such-model-here: not a local folder and "
                             "not in the Hugging Face cache")
    assert "huggingface-cli download someorg/no-such-model-here" in err[0]
    assert not (tmp_path / "runs").exists()  # and no empty run folder is left behind
    # nor an --out folder (the run directory's lock is taken only after the model check)
    argv = ["--config", "tiny", "--model", "someorg/no-such-model-here", "--out", "named"]
    assert main(argv) == 1 and not (tmp_path / "named").exists()


def test_a_hub_model_that_cannot_be_downloaded_is_one_line_naming_the_option(monkeypatch):
    from transformers import AutoModelForCausalLM

    from apps.calm_llm.model import ModelLoadError, load_base

    def unreachable(*args, **kwargs):  # what transformers raises after its retries, offline
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files, and "
                      "couldn't find them in the cached files.\nCheck your internet connection.")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", unreachable)
    with pytest.raises(ModelLoadError) as e:
        load_base(C.ModelConfig(name_or_path="someorg/no-such-model-here"))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("--model someorg/no-such-model-here: cannot load it "
                                              "(We couldn't connect to 'https://huggingface.co'")
    assert "HF_HUB_OFFLINE=1" in msg


@pytest.mark.parametrize(("make", "needle"), [
    (lambda d: str(d / "missing"), "no such folder"),
    (lambda d: str(d), "the folder holds no config.json"),
    (lambda d: "not a repo", "neither a local folder nor a hub name of the form ORG/NAME"),
])
def test_load_base_names_a_model_it_cannot_load(tmp_path, make, needle):
    from apps.calm_llm.model import ModelLoadError, load_base

    with pytest.raises(ModelLoadError, match=needle):
        load_base(C.ModelConfig(name_or_path=make(tmp_path)))


def test_logits_with_no_finite_entry_in_calms_upper_level_name_method_step_and_checkpoint(
        tmp_path, monkeypatch, capsys):
    """calibration.objectives.entropy refuses such rows with NonFiniteLogits, which is also a
    FloatingPointError: the runner still reports it as a non-finite loss with its checkpoint."""
    from apps.calm_llm import scoring

    original, calls = scoring.answer_logits, []

    def answer_logits(logits, batch):
        calls.append(1)
        out = original(logits, batch)
        return torch.full_like(out, float("-inf")) if len(calls) > 2 else out

    monkeypatch.setattr(scoring, "answer_logits", answer_logits)
    rc = main(["--config", "tiny", "--methods", "calm", "--upper-objective", "answer_tokens",
               "--steps", "3", "--checkpoint-every", "1", "--n-boot", "0", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 1
    assert "[calm] non-finite loss at step" in err and "has no finite logit" in err
    assert "last good checkpoint" in err


@pytest.mark.slow
def test_questions_removed_for_overlapping_an_ood_test_set_are_said_on_the_console(tmp_path):
    """In-domain questions that repeat out-of-domain test questions are removed (splits.json's
    overlap_removed) and the console says so in one line: how many, from which set, which
    flag governs it — not a Python warning with a source line under it. Run as a user runs it
    (a subprocess), since pytest records the warnings of code it runs in-process."""
    (tmp_path / "data").mkdir()
    _write_source(tmp_path / "data" / "arc.jsonl", "arc", 12)
    sciq = _write_source(tmp_path / "data" / "sciq.jsonl", "sciq", 40)
    copies = [{"id": f"copy{i}", "question": f"Which arc thing number {i} is right?",
               "options": [f"alpha {i}", f"beta {i}", f"gamma {i}", f"delta {i}"], "label": i % 4}
              for i in range(5)]
    sciq.write_text(sciq.read_text() + "".join(json.dumps(r) + "\n" for r in copies))
    args = [*ARGS[:ARGS.index("--methods")], "--methods", "none", *ARGS[ARGS.index("--n-boot"):]]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
           "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "apps.calm_llm", *args, "--out", "run"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    line = next(x for x in done.stderr.splitlines() if "arc_easy & sciq" in x)
    assert line.startswith("warning: questions dropped before the splits were carved (--dedup drop")
    assert "5 in both sets, removed from the second" in line
    assert "UserWarning" not in done.stderr
    manifest = json.loads((tmp_path / "run" / "splits.json").read_text())
    assert manifest["overlap_removed"] == {"arc_easy & sciq": 5}
