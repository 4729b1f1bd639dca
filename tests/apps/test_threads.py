"""``--threads`` and the OpenMP wait policy (apps/calm_llm/threads.py): the flag parses and is
validated, is left out of the run hash, sets torch's pools, and the CLI entry sets
OMP_WAIT_POLICY before torch is imported (libgomp reads it only when torch loads it)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from apps.calm_llm import config as C
from apps.calm_llm import threads

ROOT = Path(__file__).resolve().parents[2]


def test_flag_parses_and_stays_out_of_the_hash():
    assert C.parse_args([]).threads == 0
    cfg = C.parse_args(["--threads", "1"])
    assert cfg.threads == 1
    # a resume on another machine may pick another count: the hash (checkpoints, resume) ignores it
    assert cfg.hash() == C.parse_args([]).hash()


def test_negative_threads_is_refused_naming_the_flag():
    with pytest.raises(C.ConfigError, match="--threads: must be >= 0, got -2"):
        C.parse_args(["--threads", "-2"])
    with pytest.raises(ValueError, match="threads must be >= 0"):
        threads.apply_threads(-1)


def test_apply_threads_sets_torch_and_zero_leaves_torch_alone():
    before = torch.get_num_threads()
    try:
        assert threads.apply_threads(1)[0] == 1 and torch.get_num_threads() == 1
        torch.set_num_threads(2)  # what OMP_NUM_THREADS or the caller chose stays
        assert threads.apply_threads(0)[0] == 2 and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    if hasattr(os, "sched_getaffinity"):
        assert threads.usable_cpus() == len(os.sched_getaffinity(0))


def test_wait_policy_default_user_value_and_empty():
    env: dict[str, str] = {}
    assert threads.set_wait_policy(env) == "PASSIVE" and env == {"OMP_WAIT_POLICY": "PASSIVE"}
    env = {"OMP_WAIT_POLICY": "ACTIVE"}
    assert threads.set_wait_policy(env) == "ACTIVE" and env["OMP_WAIT_POLICY"] == "ACTIVE"
    env = {"OMP_WAIT_POLICY": " "}  # exported empty: libgomp's own default, so the key goes
    assert threads.set_wait_policy(env) is None and "OMP_WAIT_POLICY" not in env


def test_cli_entry_sets_the_policy_before_torch_loads():
    code = ("import os, sys; import apps.calm_llm.__main__; "
            "print('torch' in sys.modules, os.environ.get('OMP_WAIT_POLICY'))")
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True, cwd=ROOT).stdout.split()
    assert out == ["False", "PASSIVE"]  # torch not loaded yet, so libgomp will read PASSIVE
