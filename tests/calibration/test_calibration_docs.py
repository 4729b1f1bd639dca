"""The examples in docs/calibration.md run, and the figure script produces its PNG."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[2] / "docs"


def test_calibration_md_python_blocks_run(capsys):
    text = (DOCS / "calibration.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, "docs/calibration.md has no python example"
    for block in blocks:
        exec(compile(block, "docs/calibration.md", "exec"), {})
    assert "conf_ece" in capsys.readouterr().out


def test_figure_script_writes_the_png(tmp_path):
    pytest.importorskip("matplotlib")
    spec = importlib.util.spec_from_file_location("calibration_figures", DOCS / "calibration_figures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = module.main(tmp_path / "alpha.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
