"""Fixtures shared by the apps tests."""

import os
import signal
import subprocess
import sys
import textwrap

import pytest

HOLD = textwrap.dedent("""
    import sys, time
    from apps.lock import locked
    with locked(sys.argv[1], what=sys.argv[2]):
        print("held", flush=True)
        time.sleep(120)
""")


@pytest.fixture
def hold_lock():
    """``hold_lock(directory, what="run directory")``: a child process holding the lock of
    ``directory`` (returned once it holds it); every holder still alive is killed afterwards."""
    held = []

    def start(directory, what="run directory"):
        p = subprocess.Popen([sys.executable, "-c", HOLD, str(directory), what],
                             stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
        held.append(p)
        assert p.stdout.readline().strip() == "held"
        return p

    yield start
    for p in held:
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
        p.wait()
