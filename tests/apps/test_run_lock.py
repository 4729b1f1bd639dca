"""The run directory is locked for the run's lifetime (issue 29): a second run or resume into a
folder that a live run holds is refused in one line naming the holder; a killed holder's lock
is taken over; a finished run leaves no lock behind."""

import signal

import pytest

from apps.calm_llm.__main__ import main
from apps.lock import LOCK_NAME

TINY = ["--config", "tiny", "--n-boot", "0", "--checkpoint-every", "1", "--methods", "sft",
        "--steps", "1", "--no-zero-shot"]
@pytest.mark.slow
@pytest.mark.parametrize("flag", ["--out", "--resume"])
def test_a_folder_held_by_a_live_run_is_refused_naming_it(tmp_path, capsys, flag, hold_lock):
    out = tmp_path / "run"
    assert main([*TINY, "--out", str(out)]) == 0
    assert not (out / LOCK_NAME).exists()  # released with the run
    p = hold_lock(out)
    try:
        assert main([*TINY, flag, str(out)]) != 0
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    err = capsys.readouterr().err
    assert f"{out} is in use as a run directory by pid {p.pid}" in err and "Traceback" not in err
    # the killed holder's lock is taken over: the resume goes through
    assert main([*TINY, "--resume", str(out)]) == 0
    assert not (out / LOCK_NAME).exists()
