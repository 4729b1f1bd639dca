"""The CLI's error contract (issue 27): an error raised on purpose (`apps.errors.CalmError`) is
one line; a plugin that fails to import is one line naming it and then its own traceback;
anything else (a bug) keeps its traceback instead of being flattened into one line."""

import sys

import pytest

from apps import errors
from apps.calm_llm import config as C
from apps.calm_llm.__main__ import main


def test_every_project_error_is_a_calm_error_and_keeps_its_old_base():
    from apps.calm_llm.export import BaseMismatch
    from apps.calm_llm.io import CorruptFile
    from apps.calm_llm.model import ModelLoadError
    from apps.errors import NonFiniteLoss, RunRefused

    for cls, old in [(C.ConfigError, ValueError), (errors.DataError, ValueError),
                     (errors.PluginError, ValueError), (RunRefused, ValueError),
                     (NonFiniteLoss, RuntimeError), (ModelLoadError, ValueError),
                     (BaseMismatch, ValueError), (CorruptFile, ValueError)]:
        assert issubclass(cls, errors.CalmError) and issubclass(cls, old), cls


def test_a_config_error_is_one_line(capsys):
    assert main(["--config", "tiny", "--lr", "-1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --lr: must be >= 0, got -1.0"]


@pytest.fixture
def broken_plugin(tmp_path, monkeypatch):
    name = "broken_plugin_for_errors"
    (tmp_path / f"{name}.py").write_text("def f():\n    a, b = (1, 2, 3)\n\n\nf()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def test_a_plugin_that_fails_to_import_shows_its_own_traceback(broken_plugin, capsys):
    assert main(["--config", "tiny", "--plugins", broken_plugin]) == 2
    err = capsys.readouterr().err
    first = err.splitlines()[0]
    assert first.startswith(f"error: --plugins {broken_plugin}: cannot import it (ValueError: "
                            "too many values to unpack")
    # the plugin's own frame and line are shown, so its bug can be found
    assert "Traceback" in err and f"{broken_plugin}.py\", line 2, in f" in err
    with pytest.raises(errors.PluginError) as e:
        C.load_plugins([broken_plugin])
    assert isinstance(e.value.__cause__, ValueError)


def test_a_plugin_that_is_not_there_is_one_line_without_a_traceback(capsys, tmp_path):
    assert main(["--config", "tiny", "--plugins", "no_such_plugin_module"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        "error: --plugins no_such_plugin_module: no module 'no_such_plugin_module' can be imported")
    # resuming a run whose plugin has since been deleted: its config.json names the plugin
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text('{"plugins": ["deleted_plugin_of_a_run"]}')
    assert main(["--resume", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--plugins deleted_plugin_of_a_run: no module" in err[0]


def test_a_plugin_whose_own_import_is_missing_names_it_and_keeps_its_traceback(
        tmp_path, monkeypatch, capsys):
    name = "plugin_needing_a_missing_dependency"
    (tmp_path / f"{name}.py").write_text("import not_installed_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["--config", "tiny", "--plugins", name]) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[0] == (
        f"error: --plugins {name}: cannot import it, it needs a module that is missing "
        "(ModuleNotFoundError: No module named 'not_installed_dependency_xyz')")
    assert f"{name}.py\", line 1" in err  # the plugin's own line, so the import can be found
    sys.modules.pop(name, None)


def test_an_unexpected_error_in_the_run_keeps_its_traceback(monkeypatch):
    from apps.calm_llm.runner import run

    def buggy(cfg, task):
        a, b = (1, 2, 3)  # noqa: F841 - the bug the old CLI flattened into one line

    monkeypatch.setattr(run, "run", buggy)
    with pytest.raises(ValueError, match="too many values to unpack"):
        main(["--config", "tiny", "--methods", "none"])


@pytest.mark.parametrize("body, cause", [
    ("def f(:\n    pass\n", "SyntaxError: invalid syntax"),
    ("from apps.calm_llm import methods\nmethods.register('sft')\n",
     "TypeError: the method table takes a MethodInfo, got str"),
    ("from apps.calm_llm.data import sources\nsources.register_source({'name': 'x'})\n",
     "TypeError: register_source takes a SourceInfo, got dict"),
    ("raise RuntimeError('the plugin refuses')\n", "RuntimeError: the plugin refuses"),
])
def test_a_plugin_that_breaks_or_registers_a_wrong_type_is_named_with_its_cause(
        body, cause, tmp_path, monkeypatch, capsys):
    """One line naming --plugins, the module and the cause; the plugin's traceback under it."""
    name = "plugin_broken_for_errors_" + str(abs(hash(body)) % 10**6)
    (tmp_path / f"{name}.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        assert main(["--config", "tiny", "--plugins", name]) == 2
    finally:
        sys.modules.pop(name, None)
    err = capsys.readouterr().err
    assert err.splitlines()[0].startswith(f"error: --plugins {name}: cannot import it ({cause}")
    assert f"{name}.py" in err  # the plugin's own file, where the fault is
