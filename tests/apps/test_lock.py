"""apps.lock: one holder per folder across processes, released on any exit, stale locks taken over."""

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from apps.lock import LOCK_NAME, LockedError, locked


def test_a_second_process_is_refused_with_the_holders_pid_then_takes_over_after_kill_9(
        tmp_path, hold_lock):
    p = hold_lock(tmp_path)
    try:
        with pytest.raises(LockedError, match=rf"{tmp_path} is in use as a run directory by "
                                              rf"pid {p.pid} on .+, started 20\d\d-"):
            with locked(tmp_path, what="run directory"):
                pass
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    assert (tmp_path / LOCK_NAME).is_file()  # a killed holder cannot clean up
    with locked(tmp_path) as lock:  # the kernel released its flock: taken over
        assert lock.stale is not None and lock.stale["pid"] == p.pid
    assert not (tmp_path / LOCK_NAME).exists()
    with locked(tmp_path) as lock:  # released cleanly: nothing stale
        assert lock.stale is None


def test_released_on_an_exception_and_not_reentrant(tmp_path):
    with pytest.raises(RuntimeError, match="boom"):
        with locked(tmp_path):
            with pytest.raises(LockedError, match=f"pid {os.getpid()}"):
                with locked(tmp_path):  # the same process again: refused, not re-entered
                    pass
            raise RuntimeError("boom")
    assert not (tmp_path / LOCK_NAME).exists()
    with locked(tmp_path / "new" / "folder") as lock:  # made when missing
        assert lock.path.parent.is_dir() and lock.stale is None


def test_a_child_process_is_refused_while_this_one_holds_it(tmp_path):
    with locked(tmp_path, what="study root"):
        take = "import sys\nfrom apps.lock import locked\nwith locked(sys.argv[1]):\n    print('held')"
        r = subprocess.run([sys.executable, "-c", take, str(tmp_path)], capture_output=True, text=True,
                           env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}, timeout=60)
    assert r.returncode == 1 and "held" not in r.stdout
    assert f"LockedError: {tmp_path} is in use as a study root by pid {os.getpid()}" in r.stderr


CONTEND = textwrap.dedent("""
    import os, sys, time
    from apps.lock import LockedError, locked
    done = 0
    while done < 15:
        try:
            with locked(sys.argv[1]):
                with open(sys.argv[2], "a") as f:
                    f.write(f"in {os.getpid()}\\n"); f.flush(); time.sleep(0.002)
                    f.write(f"out {os.getpid()}\\n")
                done += 1
        except LockedError:
            time.sleep(0.001)
""")


def test_contending_processes_never_hold_it_together(tmp_path):
    """Four processes take and release the lock 15 times each: every 'in' is followed by the same
    process's 'out' (the release removes the file; a process that opened the removed file retries)."""
    log = tmp_path / "log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    procs = [subprocess.Popen([sys.executable, "-c", CONTEND, str(tmp_path / "d"), str(log)], env=env)
             for _ in range(4)]
    codes = [p.wait(timeout=120) for p in procs]  # the timeout only guards against a hang
    assert codes == [0, 0, 0, 0]
    lines = log.read_text().splitlines()
    assert len(lines) == 4 * 15 * 2
    for enter, leave in zip(lines[::2], lines[1::2]):
        assert enter.startswith("in ") and leave == "out " + enter[3:]


def test_an_unwritable_folder_is_named(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(LockedError, match=r"cannot lock .*file.* as a study root: .*choose a writable"):
        with locked(tmp_path / "file", what="study root"):
            pass


def test_a_study_root_in_use_is_refused_by_summarize_and_publish(tmp_path, capsys, hold_lock):
    from apps.study.__main__ import main

    root, dest = tmp_path / "root", tmp_path / "published"
    root.mkdir()
    p = hold_lock(root)
    try:
        for extra in (["--summarize"], ["--publish", str(dest)]):
            assert main(["laptop", "--root", str(root), *extra]) == 2
            err = capsys.readouterr().err
            assert f"{root} is in use as a run directory by pid {p.pid}" in err
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    assert not dest.exists() or not any(dest.iterdir())  # refused before anything was written
    assert main(["laptop", "--root", str(tmp_path / "none"), "--summarize"]) == 2
    assert "no study at" in capsys.readouterr().err and not (tmp_path / "none").exists()
    assert main(["laptop", "--root", str(root), "--publish", str(root)]) == 2
    assert "is the study root itself" in capsys.readouterr().err
