"""Under CI a skip for any reason but a missing CUDA device fails the run; outside CI skips
are reported as usual."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run(tmp_path, reason, ci, workers=0):
    (tmp_path / "test_one.py").write_text(
        "import pytest\n\n"
        f"@pytest.mark.skipif(True, reason={reason!r})\n"
        "def test_skipped():\n    pass\n\n"
        "def test_passes():\n    pass\n")
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["PYTHONPATH"] = str(ROOT)
    if ci:
        env["CI"] = "true"
    xdist = ["-n", str(workers)] if workers else []  # the README's command runs under xdist
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tests.skip_policy",
                           "-p", "no:cacheprovider", *xdist, str(tmp_path / "test_one.py")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.slow
@pytest.mark.parametrize("reason, ci, rc, workers", [
    ("statsmodels is not installed", True, 1, 0),
    ("needs a CUDA device", True, 0, 0),
    ("statsmodels is not installed", False, 0, 0),
    ("statsmodels is not installed", True, 1, 2),
    ("needs a CUDA device", True, 0, 2),
])
def test_only_the_cuda_skip_is_allowed_under_ci(tmp_path, reason, ci, rc, workers):
    done = run(tmp_path, reason, ci, workers)
    assert done.returncode == rc, done.stdout + done.stderr
    if rc:
        assert "skips not allowed under CI" in done.stdout and "statsmodels" in done.stdout
