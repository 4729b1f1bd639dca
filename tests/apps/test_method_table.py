"""The table of methods is the one source: the CLI's choices and help, validation, the
method classes and docs/calm.md's options table all say what it says."""

import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

from apps.calm_llm import config as C
from apps.calm_llm import methods

ROOT = Path(__file__).resolve().parents[2]


def test_the_table_loads_without_torch():
    code = ("import sys, apps.calm_llm.config as C; C.parse_args([]); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_cli_choices_help_and_docs_list_the_table():
    names = methods.names()
    assert C.METHODS == names
    assert set(names) >= {"none", "ts", "sft", "label_smoothing", "rcft", "calm", "calm_iterate",
                          "calm_regularization", "calm_scalar"}
    help_text = " ".join(C.build_parser().format_help().split())
    assert f"from {', '.join(names)}" in help_text
    doc = (ROOT / "docs" / "calm.md").read_text()
    row = next(line for line in doc.splitlines() if line.startswith("| `--methods` |"))
    assert row.rstrip(" |").endswith(f"from {', '.join(names)}")
    for name in names:  # every listed name validates; a name outside the table does not
        C.parse_args(["--methods", name])
    with pytest.raises(C.ConfigError, match="unknown method"):
        C.parse_args(["--methods", "not_a_method"])


@pytest.mark.parametrize("name", methods.names())
def test_each_class_points_back_to_its_entry(name):
    info = methods.info(name)
    cls = methods.get(name)
    assert cls.info is info and cls.name == name and cls.trains == info.trains
    # what the runner and export read off a method that learns α
    assert info.learns_alpha == hasattr(cls, "without_alpha")
    train_options = {f.name for f in fields(C.TrainConfig)}
    for group in info.sections:  # a config section, or a prefix of the train options
        assert group in C.SECTIONS or any(o.startswith(group) for o in train_options), group


def test_second_order_and_trained_methods_come_from_the_table():
    aid = ["--solver", "aid"]
    assert C.needs_second_order(C.parse_args([*aid, "--methods", "calm_scalar"]))
    assert not C.needs_second_order(C.parse_args([*aid, "--methods", "calm_iterate", "sft"]))
    assert not C.needs_second_order(C.parse_args(["--methods", "calm"]))
    cfg = C.parse_args(["--methods", "none", "ts", "sft", "rcft"])
    assert C.trained(cfg) == ["sft", "rcft"]
    with pytest.raises(C.ConfigError, match="no trained method"):
        C.parse_args(["--methods", "none", "ts", "--select", "lr=0.1,0.2"])


def test_select_applies_calm_options_to_the_calm_family_only():
    from apps.calm_llm.tasks.mcqa import selects

    calm_grid, train_grid = [{"calm.eta": 0.1}], [{"train.lr": 0.1}]
    assert selects(methods.info("calm_iterate"), calm_grid)
    assert not selects(methods.info("sft"), calm_grid)
    assert selects(methods.info("sft"), train_grid)
    assert not selects(methods.info("ts"), train_grid)


def test_an_upper_loss_declares_what_it_acts_on_and_the_config_is_checked_against_it():
    """A new upper loss is one registration; one that has no answer-token form is refused with
    --upper-objective answer_tokens (it used to fall back to entropy there, silently)."""
    from apps.calm_llm.methods.upper import UPPER_LOSSES, UpperLoss

    options_only = UpperLoss("brier_upper", on_options=lambda z, y: z.sum())
    assert options_only.acts_on == ("options",)
    with UPPER_LOSSES.registered(options_only):
        assert C.parse_args(["--upper-loss", "brier_upper"]).calm.upper_loss == "brier_upper"
        with pytest.raises(C.ConfigError, match="--upper-loss brier_upper acts on options only"):
            C.parse_args(["--upper-loss", "brier_upper", "--upper-objective", "answer_tokens"])
        with pytest.raises(C.ConfigError, match="--upper-loss brier_upper acts on options only"):
            C.parse_args(["--task", "open_qa", "--upper-loss", "brier_upper"])
    with pytest.raises(ValueError, match="on_options, on_answer_tokens or both"):
        UPPER_LOSSES.register(UpperLoss("nothing"))
    assert UPPER_LOSSES["soft_ece"].acts_on == ("options",)
    assert UPPER_LOSSES["entropy"].acts_on == UPPER_LOSSES["nll"].acts_on == (
        "options", "answer_tokens")


def test_one_table_of_calibration_losses_the_app_reads():
    """calibration.loss_table.LOSSES is the one table: objectives' CALIBRATION_LOSSES and the
    app's UPPER_LOSSES are it (the app adds only its answer-token forms), names unchanged."""
    import torch

    from apps.calm_llm.methods.upper import UPPER_LOSSES, UpperLoss
    from calibration import loss_table, objectives

    assert objectives.CALIBRATION_LOSSES is loss_table.LOSSES is UPPER_LOSSES
    assert UpperLoss is loss_table.CalibrationLoss is objectives.CalibrationLoss
    assert list(loss_table.LOSSES)[:3] == ["entropy", "nll", "soft_ece"]
    assert loss_table.LOSSES["soft_ece"].acts_on == ("options",)
    assert loss_table.LOSSES["nll"].acts_on == ("options", "answer_tokens")
    z, y = torch.tensor([[1.0, 0.0], [0.0, 2.0]]), torch.tensor([0, 1])
    assert loss_table.LOSSES["nll"].function("options") is objectives.label_nll
    torch.testing.assert_close(objectives.calibration_loss("soft_ece")(z, y),
                               objectives.soft_binned_ece(z, y), rtol=0, atol=0)
