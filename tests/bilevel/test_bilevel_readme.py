"""The README's bilevel snippet runs as printed and improves the validation loss."""

import re
from pathlib import Path

import torch


def test_readme_python_block_runs():
    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert blocks, "README.md lost its python example"
    namespace: dict = {}
    exec(compile(blocks[0], "README.md", "exec"), namespace)
    upper, alpha, inner = namespace["upper"], namespace["alpha"], namespace["inner"]
    Xv, yv = namespace["Xv"], namespace["yv"]
    fresh = upper(alpha, {"w": torch.zeros(5)}, (Xv, yv))
    assert upper(alpha, inner, (Xv, yv)) < fresh  # fit moved θ (and α) towards a better fit
