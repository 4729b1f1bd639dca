"""Reliability-diagram PNGs and the package's import hygiene."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from calibration import plots

pytest.importorskip("matplotlib")

REPO = Path(__file__).resolve().parents[2]


def curves():
    g = torch.Generator().manual_seed(0)
    z = 2 * torch.randn(300, 4, generator=g, dtype=torch.float64)
    y = torch.multinomial(z.softmax(-1), 1, generator=g).squeeze(1)
    return {"calibrated": (z.softmax(-1), y), "overconfident": ((3 * z).softmax(-1).numpy(), y.numpy())}


@pytest.mark.parametrize("mode", ["top", "classwise"])
def test_reliability_diagram_writes_a_png(tmp_path, mode):
    out = plots.reliability_diagram(curves(), tmp_path / "sub" / f"{mode}.png", mode=mode, title=mode)
    assert out.exists()
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert out.stat().st_size > 5000


def test_reliability_diagram_errors():
    with pytest.raises(ValueError, match="empty"):
        plots.reliability_diagram({}, "x.png")
    with pytest.raises(ValueError, match="mode"):
        plots.reliability_diagram(curves(), "x.png", mode="pooled")
    with pytest.raises(ValueError, match="n_bins"):
        plots.reliability_diagram(curves(), "x.png", n_bins=0)


@pytest.mark.slow
def test_package_imports_neither_matplotlib_nor_transformers():
    # Block transformers outright: importing calibration must not need it, and matplotlib must
    # stay unimported until a plot is drawn.
    code = (
        "import sys; sys.modules['transformers'] = None\n"
        "import calibration\n"
        "from calibration import alpha, metrics, objectives, plots, posthoc\n"
        "bad = [m for m in ('matplotlib', 'transformers', 'bilevel', 'apps', 'scipy') "
        "if sys.modules.get(m) is not None]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)
