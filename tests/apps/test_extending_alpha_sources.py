"""docs/extending.md's examples, run as a user would: each code block becomes a module in a
temporary folder, is imported (registering at import time, no project file edited) and then used
end to end by the CLI on the tiny model."""

from __future__ import annotations

import importlib
import json
import re
import sys
from pathlib import Path

import pytest
import torch

from apps.calm_llm import config as C
from apps.calm_llm.__main__ import main
from apps.calm_llm.data import sources
from calibration import alpha, alpha_table

DOC = Path(__file__).resolve().parents[2] / "docs" / "extending.md"
TINY = ["--config", "tiny", "--n-boot", "0", "--checkpoint-every", "0"]


def doc_module(filename: str) -> str:
    """The python block of docs/extending.md whose first line is ``# <filename>``."""
    text = DOC.read_text()
    found = re.findall(rf"```python\n(# {re.escape(filename)}\n.*?)```", text, flags=re.S)
    assert len(found) == 1, f"docs/extending.md has no single block for {filename}"
    return found[0]


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """Import a doc block as a user's module from tmp_path; every registry it touches is
    restored afterwards."""
    before = [(reg, set(reg)) for reg in (alpha_table.SPECS, sources.SOURCES)]
    monkeypatch.syspath_prepend(str(tmp_path))
    imported = []

    def load(filename: str, *, import_it: bool = True):
        (tmp_path / filename).write_text(doc_module(filename))
        name = filename.removesuffix(".py")
        imported.append(name)
        return importlib.import_module(name) if import_it else name

    yield load
    for name in imported:
        sys.modules.pop(name, None)
    for reg, names in before:
        for name in set(reg) - names:
            reg.unregister(name)


def test_the_doc_parameterization_is_registered_and_inverts(user_module):
    mod = user_module("temperature_shift.py")
    assert "temperature_shift" in alpha.NAMES and "temperature_shift" in alpha_table.NAMES
    assert "temperature_shift" in C.CalmConfig.__dataclass_fields__["alpha_param"].metadata["choices"]
    p = alpha.get("temperature_shift", positivity="softplus")
    assert isinstance(p, mod.TemperatureShift) and p.options() == {"positivity": "softplus", "tau_max": 20.0}
    params = p.init(3, dtype=torch.float64)
    assert params["tau_raw"].shape == () and params["shift"].shape == (3,)
    z = torch.randn(4, 10, dtype=torch.float64)
    ids = torch.tensor([7, 1, 4])
    assert torch.equal(p.apply(params, z, ids), z)  # identity at init
    moved = {"tau_raw": torch.tensor(0.7, dtype=torch.float64),
             "shift": torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64)}
    out = p.apply(moved, z, ids)
    tau = torch.nn.functional.softplus(moved["tau_raw"])
    torch.testing.assert_close(out[:, ids], z[:, ids] / tau + moved["shift"])
    torch.testing.assert_close(p.invert(moved, out, ids), z)
    with pytest.raises(ValueError, match="takes options"):
        alpha.get("temperature_shift", form="scale_shift")


@pytest.mark.slow
def test_calm_trains_and_exports_the_doc_parameterization(user_module, tmp_path, capsys):
    # the CLI imports the user's module itself (--plugins), before it checks --alpha-param
    plugin = user_module("temperature_shift.py", import_it=False)
    out = tmp_path / "run"
    rc = main([*TINY, "--plugins", plugin, "--methods", "calm", "--alpha-param", "temperature_shift",
               "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    results = json.loads((out / "metrics.json").read_text())["results"]
    assert 0 <= results["calm"]["sciq"]["conf_ece"] <= 1
    meta = json.loads((out / "export" / "calm" / "alpha.json").read_text())
    assert meta["param"] == "temperature_shift"
    assert meta["options"] == {"positivity": "bounded", "tau_max": 20.0}  # the tiny preset's α options
    from apps.calm_llm.export import AlphaLogitsProcessor

    proc = AlphaLogitsProcessor.from_dir(out / "export" / "calm")
    assert proc.param == alpha.get("temperature_shift", positivity="bounded")
    assert proc.params["tau_raw"].shape == () and proc.params["shift"].shape == proc.class_ids.shape
    assert bool((proc.params["shift"] != 0).any())  # CALM moved α away from the identity
    scores = torch.randn(2, int(proc.vocab_size))
    adjusted = proc(torch.zeros(2, 1, dtype=torch.long), scores)
    outside = torch.ones(scores.shape[-1], dtype=torch.bool)
    outside[proc.class_ids] = False
    assert torch.equal(adjusted[:, outside], scores[:, outside])
    torch.testing.assert_close(proc.param.invert(proc.params, adjusted, proc.class_ids), scores)


def quiz_rows(n: int) -> list[dict]:
    words = ["red", "blue", "green", "cold", "warm", "tall", "short", "fast", "slow", "soft"]
    return [
        {"id": i, "q": f"Quiz {i}: which word comes after {words[i % 10]} in the list?",
         "answers": [words[(i + j) % 10] for j in range(4)], "correct": 1}
        for i in range(n)
    ]


def write_quiz(folder: Path, rows: list[dict]) -> None:
    (folder / "quiz.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_the_doc_source_loads_and_validates(user_module, tmp_path):
    write_quiz(tmp_path, quiz_rows(5) + [{"id": 99, "q": "no answers"}])
    with pytest.raises(ValueError, match="unknown MCQA source 'quiz'"):
        C.parse_args(["--config", "tiny", "--in-domain", "quiz"])
    user_module("quiz_source.py")
    assert "quiz" in sources.source_names("mcqa")
    assert C.parse_args(["--config", "tiny", "--in-domain", "quiz"]).data.in_domain == ["quiz"]
    with pytest.raises(ValueError, match=r"quiz.jsonl line 6: missing field 'answers'"):
        sources.load_source("quiz")
    write_quiz(tmp_path, quiz_rows(5))
    exs = sources.load_source("quiz")
    assert [e.id for e in exs] == [f"quiz:{i}" for i in range(5)]
    assert exs[2].options[exs[2].label] == "cold" and exs[2].source == "quiz"


@pytest.mark.slow
def test_a_run_trains_and_evaluates_on_the_doc_source(user_module, tmp_path, capsys):
    write_quiz(tmp_path, quiz_rows(40))
    user_module("quiz_source.py")
    out = tmp_path / "run"
    rc = main([*TINY, "--methods", "none", "sft", "--in-domain", "quiz", "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    results = json.loads((out / "metrics.json").read_text())["results"]
    for method in ("none", "sft"):
        assert results[method]["quiz"]["domain"] == "id" and results[method]["quiz"]["n"] == 8
        assert results[method]["arc_easy"]["domain"] == "ood"
    splits = (out / "splits.json").read_text()
    assert "quiz:" in splits


def test_a_plugin_parameterizations_own_options_become_flags():
    """An α option beyond form / positivity / tau_max gets ``--<name>-<option>``, checked against
    its choices, hashed only when that parameterization is used, and reaches the transform."""
    from dataclasses import dataclass

    from apps.calm_llm.methods.alpha_wiring import make_alpha

    @dataclass(frozen=True)
    class SignedShift(alpha.Shift):
        sign: str = "plus"

        def forward(self, params, z):
            return z + (1 if self.sign == "plus" else -1) * params["shift"]

    alpha.register("signed_shift", SignedShift,
                   options={"sign": alpha_table.Option("plus", choices=("plus", "minus"))})
    try:
        cfg = C.parse_args(["--alpha-param", "signed_shift", "--signed-shift-sign", "minus"])
        assert cfg.options_of("signed_shift").sign == "minus"
        assert "--signed-shift-sign" in cfg.comparable()
        assert "--signed-shift-sign" not in C.parse_args([]).comparable()
        with pytest.raises(SystemExit):  # argparse names the choices
            C.parse_args(["--signed-shift-sign", "sideways"])
        a = make_alpha("signed_shift", "z/tau+l", "vocab", vocab_size=4, option_token_ids=None,
                       device=torch.device("cpu"), extra_options={"sign": "minus"})
        assert a.param.options() == {"sign": "minus"} and a.param.name == "signed_shift"
        z = torch.zeros(1, 4)
        assert torch.equal(a.param.apply({"shift": torch.ones(4)}, z), -torch.ones(1, 4))
    finally:
        alpha_table.SPECS.unregister("signed_shift")
