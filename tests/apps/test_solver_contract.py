"""The app reads solvers through bilevel's public contract (`bilevel.Solver`, `StepResult`,
`apps.calm_llm.solvers.REQUIRED_INFO`): a solver that breaks it is refused by name; the
built-in solvers' options are their entries' own, and no run's hash moved with them."""

import dataclasses
import json
import re
import warnings

import pytest
import torch

import bilevel
from apps.calm_llm import config as C
from apps.calm_llm import methods, solvers
from apps.calm_llm.data import Collator, MCQAExample
from apps.calm_llm.methods.base import Context
from apps.calm_llm.model import load
from apps.errors import CalmError

WORDS = ["red", "blue", "green", "cold", "warm", "tall", "short", "fast", "slow", "soft"]
EXAMPLES = [MCQAExample(f"m{i}", f"Question {i}: which word fits {WORDS[i % 10]}?",
                        tuple(WORDS[(i + j) % 10] for j in range(3)), i % 3, "synthetic")
            for i in range(12)]


def make_ctx(*extra: str, eager: bool = False) -> Context:
    cfg = C.parse_args(["--config", "tiny", "--mode", "cloze", "--steps", "2", *extra])
    lm = load(cfg.model, device=torch.device("cpu"), seed=0, eager=eager)
    col = Collator(lm.tokenizer, mode="cloze", max_length=96, max_options=5)
    return Context(cfg=cfg, lm=lm, collator=col, train_examples=EXAMPLES[:8],
                   calib_examples=EXAMPLES[8:], train_collator=col, option_token_ids=None)


class Dropping:
    """A plugin-style solver: BOME's step with ``info`` rewritten by ``edit``."""

    def __init__(self, edit):
        self.inner, self.edit = bilevel.BOME(inner_steps=1, inner_lr=0.05), edit

    def step(self, problem, outer, inner, *, upper_batch, lower_batch):
        res = self.inner.step(problem, outer, inner, upper_batch=upper_batch,
                              lower_batch=lower_batch)
        return dataclasses.replace(res, info=self.edit(dict(res.info)))


def _drop_lower(info):
    info.pop("lower_loss")
    return info


def _stringify(info):
    return {**info, "lower_loss": "0.5"}


@pytest.mark.parametrize("name, edit, needle", [
    ("no_lower_loss", _drop_lower, r"info without \['lower_loss'\]"),
    ("string_lower_loss", _stringify, r"'lower_loss' \(str\)"),
])
def test_a_plugin_solver_breaking_the_contract_is_refused_by_name(name, edit, needle):
    with solvers.SOLVERS.registered(solvers.SolverInfo(name, lambda cfg: Dropping(edit), False)):
        ctx = make_ctx("--solver", name)
        m = methods.get("calm")(ctx)
        with ctx.lm.mode(True), pytest.raises(solvers.SolverContractError) as e:
            m.step(0)
    msg = str(e.value)
    assert f"--solver {name}" in msg and "lower_loss" in msg and "the app needs" in msg
    assert re.search(needle, msg), msg
    # a CalmError: the CLI prints it in one line (not a "non-finite loss" with a traceback)
    assert isinstance(e.value, CalmError)


def test_a_factory_returning_no_solver_is_refused_up_front():
    with solvers.SOLVERS.registered(solvers.SolverInfo("not_a_solver", lambda cfg: 42, False)):
        cfg = C.parse_args(["--config", "tiny", "--solver", "not_a_solver"])
        with pytest.raises(solvers.SolverContractError, match="--solver not_a_solver: .* int, "
                                                              "which has no step"):
            solvers.build_solver(cfg)


def test_check_step_names_missing_directions():
    res = bilevel.StepResult(outer_grad={"a": torch.zeros(1)}, inner_grad={},
                             info={"lower_loss": torch.tensor(1.0)})
    with pytest.raises(solvers.SolverContractError, match=r"inner_grad without \['w'\]"):
        solvers.check_step("mine", res, {"a": torch.zeros(1)}, {"w": torch.zeros(2)})
    with pytest.raises(solvers.SolverContractError, match="tuple, without outer_grad"):
        solvers.check_step("mine", (1, 2), {}, {})


@pytest.mark.parametrize("argv", [
    ["--solver", "bome"], ["--solver", "itd", "--itd-truncate", "1"],
    ["--solver", "aid"], ["--solver", "aid", "--linear-solver", "neumann", "--neumann-terms", "2"],
    ["--solver", "aid", "--linear-solver", "dense"],
])
def test_the_built_in_solvers_meet_the_contract(argv):
    ctx = make_ctx(*argv, eager=argv[1] != "bome")
    m = methods.get("calm")(ctx)
    with ctx.lm.mode(True):
        info = m.step(0)  # check_step ran on the result
    assert torch.isfinite(torch.tensor(info["loss"])) and info["loss"] == info["lower_loss"]


def test_solver_options_are_their_entries_own_and_old_hashes_hold():
    cfg = C.parse_args(["--eta", "0.1", "--phi", "value_gap", "--c", "0.9", "--itd-truncate", "1",
                        "--cg-maxiter", "7", "--neumann-terms", "3"])
    assert (cfg.options_of("bome").eta, cfg.options_of("bome").phi) == (0.1, "value_gap")
    assert cfg.options_of("itd").truncate == 1 and cfg.options_of("cg").maxiter == 7
    assert cfg.options_of("neumann").terms == 3
    assert not hasattr(cfg.calm, "eta") and not hasattr(cfg.calm, "cg_maxiter")
    # hashes of these command lines at commit 9c55db6, before the options moved
    old_hashes = {
        (): "4e446f2d2d56498a",
        ("--eta", "0.1"): "b01d9014fe256f07",
        ("--phi", "value_gap", "--c", "0.9"): "e2c250e1224436fc",
        ("--solver", "itd", "--itd-truncate", "1"): "d576a9f1479adc7c",
        ("--solver", "aid", "--cg-maxiter", "7", "--cg-tol", "1e-4"): "11a780c23c413d07",
        ("--solver", "aid", "--linear-solver", "neumann"): "19a621ebd591d567",
        ("--solver", "aid", "--linear-solver", "neumann", "--cg-maxiter", "9", "--cg-tol",
         "0.001"): "81137fcda1046d6b",
        ("--config", "tiny", "--select", "eta=0.1,0.5,0.9"): "3a288a46491958d9",
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        for argv, h in old_hashes.items():
            assert C.parse_args(list(argv)).hash() == h, argv
    # the old spelling of a Neumann run is its own flags now: same options, same hash
    with pytest.warns(DeprecationWarning, match="--cg-maxiter with neumann: read as "
                                                "--neumann-terms 9"):
        old = C.parse_args(["--solver", "aid", "--linear-solver", "neumann", "--cg-maxiter", "9"])
    new = C.parse_args(["--solver", "aid", "--linear-solver", "neumann", "--neumann-terms", "9"])
    assert old.options_of("neumann").terms == 9 and old.hash() == new.hash()
    with pytest.raises(C.ConfigError, match="--eta: must be >= 0, got -1.0"):
        C.parse_args(["--eta", "-1"])
    with pytest.raises(C.ConfigError, match="--itd-truncate 3: more than the 2 inner steps"):
        C.parse_args(["--solver", "itd", "--itd-truncate", "3"])
    grid = C.select_grid(C.parse_args(["--select", "eta=0.1,0.9"]))
    assert grid == [{"calm.eta": 0.1}, {"calm.eta": 0.9}]
    assert C.with_overrides(C.parse_args([]), grid[1]).options_of("bome").eta == 0.9


def test_an_old_config_json_with_the_solver_options_in_calm_loads_and_resumes(tmp_path):
    """A config.json written at 9c55db6 (neumann read cg_maxiter then) loads into the entries'
    options, trains what it trained and keeps its hash."""
    cfg = C.parse_args(["--config", "tiny", "--solver", "aid", "--linear-solver", "neumann",
                        "--neumann-terms", "3"])
    old = cfg.to_dict()
    plugin = old["plugin_options"]
    for entry in ("bome", "itd", "cg", "neumann"):
        plugin.pop(entry)
    old["calm"].update({"eta": 0.5, "phi": "grad_norm", "c": 0.5, "cg_maxiter": 3,
                        "cg_tol": 1e-6, "itd_truncate": 0})
    path = tmp_path / "config.json"
    path.write_text(json.dumps(old))
    again = C.parse_args(["--config", str(path)])
    assert again.options_of("neumann").terms == 3 and again.options_of("neumann").tol == 1e-6
    assert again.options_of("bome").eta == 0.5 and again.options_of("cg").maxiter == 3
    # the hash 9c55db6 gave `--config tiny --solver aid --linear-solver neumann --cg-maxiter 3`
    assert again.hash() == cfg.hash() == "0cfdade8e3effdf2"
    assert C.differences(again, cfg) == []
