"""docs/extending.md's worked examples run as written: a method added from a module of one's
own, registered through the public table and loaded with --plugins, trains and is evaluated
end to end on the tiny model without any project file edited."""

import dataclasses
import importlib
import json
import math
import re
import sys
from pathlib import Path

import pytest
import torch

from apps.calm_llm import config as C
from apps.calm_llm import methods
from apps.calm_llm.__main__ import main
from apps.calm_llm.history import read_history

DOC = Path(__file__).resolve().parents[2] / "docs" / "extending.md"
TINY = ["--config", "tiny", "--n-boot", "0"]
PLUGIN = "confidence_penalty_plugin"


def section_code(heading: str) -> str:
    """The first ```python block under ``## heading`` of docs/extending.md."""
    text = DOC.read_text()
    section = text.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """The doc's method module, importable as PLUGIN; unregistered and unloaded afterwards."""
    (tmp_path / f"{PLUGIN}.py").write_text(section_code("Adding a method"))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield PLUGIN
    methods.unregister("confidence_penalty")
    sys.modules.pop(PLUGIN, None)


@pytest.mark.slow
def test_a_plugin_method_runs_end_to_end(plugin, tmp_path):
    out = tmp_path / "run"
    argv = [*TINY, "--plugins", plugin, "--methods", "none", "confidence_penalty",
            "--steps", "2", "--out", str(out), "--confidence-penalty-beta", "0.3"]
    assert main(argv) == 0
    assert "confidence_penalty" in C.METHODS  # the table is the CLI's list of methods
    results = json.loads((out / "metrics.json").read_text())["results"]
    assert set(results) == {"none", "confidence_penalty"}
    assert results["confidence_penalty"]["sciq"]["n"] == 8
    history = read_history(out / "history_confidence_penalty.jsonl")
    assert [h["step"] for h in history] == [1, 2]
    assert all(h["loss"] == h["loss"] for h in history)  # finite, not NaN
    assert (out / "export" / "confidence_penalty" / "adapter_config.json").is_file()
    saved = json.loads((out / "config.json").read_text())
    assert saved["plugins"] == [plugin]
    assert saved["plugin_options"]["confidence_penalty"] == {"beta": 0.3}
    # the penalty moves the predictions away from the untrained model's
    assert results["confidence_penalty"]["sciq"]["nll"] != results["none"]["sciq"]["nll"]


def test_a_plugin_method_validates_its_own_options(plugin):
    with pytest.raises(C.ConfigError, match="confidence_penalty needs MCQA"):
        C.parse_args(["--plugins", plugin, "--methods", "confidence_penalty",
                      "--instruction-data", "alpaca", "--data-hub", "alpaca=org/alpaca"])


def test_a_plugin_methods_own_options_are_flags_file_entries_and_resume_checks(plugin, tmp_path, capsys):
    cfg = C.parse_args(["--plugins", plugin, "--methods", "confidence_penalty"])
    assert cfg.method_options("confidence_penalty").beta == 0.1  # the declared default
    assert C.parse_args(["--plugins", plugin, "--methods", "confidence_penalty",
                         "--confidence-penalty-beta", "0.25"]).method_options("confidence_penalty").beta == 0.25
    f = tmp_path / "c.yaml"
    f.write_text(f"plugins: [{plugin}]\nmethods: [confidence_penalty]\n"
                 "plugin_options: {confidence_penalty: {beta: 0.5}}\n")
    from_file = C.parse_args(["--config", str(f)])
    assert from_file.method_options("confidence_penalty").beta == 0.5
    # config.json round trip, and a changed value is a difference a resume refuses
    again = C.from_dict(json.loads(json.dumps(from_file.to_dict())))
    assert again.method_options("confidence_penalty").beta == 0.5
    assert again.hash() == from_file.hash()
    assert C.differences(from_file, cfg) == ["--confidence-penalty-beta: 0.5 (the run's) vs 0.1 (now)"]
    # a run that does not use the method keeps the hash it had without the plugin
    assert C.parse_args(["--plugins", plugin]).hash() == C.parse_args([]).hash()
    # checked like every option, then by the method's own validate
    with pytest.raises(C.ConfigError, match="--confidence-penalty-beta: must be a finite number"):
        C.parse_args(["--plugins", plugin, "--confidence-penalty-beta", "nan"])
    with pytest.raises(C.ConfigError, match="outweighs the SFT loss"):
        C.parse_args(["--plugins", plugin, "--methods", "confidence_penalty",
                      "--confidence-penalty-beta", "2"])
    with pytest.raises(C.ConfigError, match="unknown option plugin_options.confidence_penalty.'gamma'"):
        C.from_dict({"plugins": [plugin], "plugin_options": {"confidence_penalty": {"gamma": 1.0}}})
    with pytest.raises(C.ConfigError, match="expected float"):
        C.from_dict({"plugins": [plugin], "plugin_options": {"confidence_penalty": {"beta": "x"}}})
    with pytest.raises(SystemExit):
        C.parse_args(["--plugins", plugin, "--help"])
    assert "--confidence-penalty-beta" in capsys.readouterr().out


def test_options_of_a_method_that_is_not_loaded_are_refused():
    with pytest.raises(C.ConfigError, match="no registered method, solver, linear solver or upper loss 'nope' declares options"):
        C.from_dict({"plugin_options": {"nope": {"x": 1}}})
    with pytest.raises(C.ConfigError, match="declares no options"):
        C.Config().method_options("sft")


def test_an_unknown_plugin_or_a_taken_name_is_refused():
    with pytest.raises(C.ConfigError, match="--plugins no_such_module_here"):
        C.parse_args(["--plugins", "no_such_module_here"])
    taken = methods.MethodInfo("sft", "somewhere:Else", trains=True)
    with pytest.raises(ValueError, match="already registered"):
        methods.register(taken)
    assert methods.info("sft").target.endswith("sft:SFT")


def test_the_method_is_unknown_without_its_plugin():
    with pytest.raises(C.ConfigError, match="unknown method 'confidence_penalty'"):
        C.parse_args(["--methods", "confidence_penalty"])


@pytest.mark.slow
def test_a_plugin_linear_solver_runs_aid_end_to_end(tmp_path, monkeypatch):
    from apps.calm_llm import solvers

    text = DOC.read_text()
    code = re.search(r"```python\n(# richardson_solver\.py\n.*?)```", text, re.S).group(1)
    (tmp_path / "richardson_solver.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "richardson_solver", raising=False)
    mod = importlib.import_module("richardson_solver")  # --plugins finds it imported already
    calls = []

    def counted(matvec, b, init=None, steps=20, lr=0.5):
        calls.append((len(b), steps, lr))
        return mod.__dict__["_original"](matvec, b, init, steps, lr)

    monkeypatch.setitem(mod.__dict__, "_original", mod.richardson)
    monkeypatch.setattr(mod, "richardson", counted)  # the registered factory reads it on use
    try:
        out = tmp_path / "run"
        argv = [*TINY, "--plugins", "richardson_solver", "--methods", "calm", "--solver", "aid",
                "--linear-solver", "richardson", "--richardson-steps", "7", "--steps", "2",
                "--out", str(out)]
        assert main(argv) == 0
        # one linear solve per outer step, by the user's function, with its own option
        assert [c[1:] for c in calls] == [(7, 0.5), (7, 0.5)]
        x, info = mod.__dict__["_original"](lambda v: [2.0 * t for t in v], [torch.ones(3)],
                                            steps=50)
        assert torch.allclose(x[0], torch.full((3,), 0.5)) and info["residual"] < 1e-6
        results = json.loads((out / "metrics.json").read_text())["results"]
        assert {"calm", "calm:no_alpha"} <= set(results)
        assert math.isfinite(results["calm"]["sciq"]["nll"])
        saved = json.loads((out / "config.json").read_text())
        assert saved["calm"]["linear_solver"] == "richardson"
        assert saved["plugin_options"]["richardson"] == {"steps": 7, "lr": 0.5}
        # its options are validated like the built-in ones, and hashed only when it is used
        with pytest.raises(C.ConfigError, match="--richardson-lr: must be a finite number"):
            C.parse_args(["--richardson-lr", "nan"])
        assert C.parse_args(["--richardson-steps", "3"]).hash() == C.parse_args([]).hash()
    finally:
        solvers.LINEAR_SOLVERS.unregister("richardson")
        sys.modules.pop("richardson_solver", None)


@pytest.mark.slow
def test_a_plugin_upper_loss_trains_calm_and_is_refused_where_it_cannot_act(tmp_path,
                                                                              monkeypatch):
    from apps.calm_llm.methods.upper import UPPER_LOSSES

    code = re.search(r"```python\n(# brier_upper\.py\n.*?)```", DOC.read_text(), re.S).group(1)
    (tmp_path / "brier_upper.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "brier_upper", raising=False)
    mod = importlib.import_module("brier_upper")
    calls = []

    def counted(option_logits, labels):
        calls.append(tuple(option_logits.shape))
        return brier(option_logits, labels)

    brier = mod.brier
    try:
        info = UPPER_LOSSES.get("brier")
        assert info.acts_on == ("options",)
        z = torch.tensor([[2.0, 0.0, -1.0], [0.0, 0.0, 0.0]])
        p = torch.softmax(z, -1)
        want = ((p - torch.eye(3)[[0, 2]]) ** 2).sum(-1).mean()
        torch.testing.assert_close(info.function("options")(z, torch.tensor([0, 2])), want)
        with UPPER_LOSSES.registered(dataclasses.replace(info, on_options=counted), replace=True):
            out = tmp_path / "run"
            assert main([*TINY, "--plugins", "brier_upper", "--methods", "calm", "--upper-loss",
                         "brier", "--steps", "2", "--out", str(out)]) == 0
        assert len(calls) >= 2 and all(len(s) == 2 for s in calls)  # (N, K) option scores
        results = json.loads((out / "metrics.json").read_text())["results"]
        assert math.isfinite(results["calm"]["sciq"]["nll"])
        with pytest.raises(C.ConfigError, match="--upper-loss brier acts on options only"):
            C.parse_args(["--plugins", "brier_upper", "--upper-loss", "brier",
                          "--upper-objective", "answer_tokens"])
    finally:
        UPPER_LOSSES.unregister("brier")
        sys.modules.pop("brier_upper", None)
