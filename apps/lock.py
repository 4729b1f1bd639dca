"""An exclusive lock on a directory, held for a process's lifetime: two runs, resumes or study
summaries writing into one folder at once would mix their files silently, so the second is
refused, naming the process that holds the folder.

    with locked(run_dir, what="run directory"):
        ...  # only this process writes into run_dir

The lock is ``fcntl.flock`` on ``<dir>/.lock``, which the kernel releases when its holder exits
in any way (an exception, ``sys.exit``, ``kill -9``, a crash), so a lock left by a killed process
is never in the way: the next holder takes it over and reports the dead holder in
``Lock.stale``. The file records the holder's pid, host and start time for the refusal message
only; the kernel lock, not the file's contents, decides who holds it (so a reused pid cannot
fake a holder). A clean release removes the file, so a left-over ``.lock`` names a killed holder.

POSIX only (``fcntl``). On NFS, Linux (since 2.6.12) emulates flock with a byte-range lock
on the whole file, which is exclusive across hosts; the recorded pid then names a process on
the host the message gives. The lock is not re-entrant: a second ``locked`` of the same folder
in the same process is refused too. Forked children (``multiprocessing`` with fork) share the holder's lock; subprocesses do not
inherit it (Python opens files non-inheritable).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from .errors import CalmError

LOCK_NAME = ".lock"


class LockedError(CalmError, ValueError):
    """A directory already locked by another live process (or another ``locked`` in this one);
    the message names the folder, the holder's pid, host and start time, and what to do."""


@dataclasses.dataclass(frozen=True)
class Lock:
    """A held lock: its file, and what the file said about a previous holder that died holding
    it (``stale``: its pid, host and start time; None when the folder was free)."""

    path: Path
    stale: dict[str, object] | None


def _holder(path: Path) -> dict[str, object] | None:
    """The pid/host/started/what record in a lock file, or None when it is empty or unreadable
    (being written by a holder that has just taken it)."""
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return d if isinstance(d, dict) else None


def _describe(h: dict[str, object] | None) -> str:
    if h is None:
        return "a process that is just starting (its pid is not written yet)"
    started = h.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(started)) \
        if isinstance(started, (int, float)) else "an unknown time"
    return f"pid {h.get('pid')} on {h.get('host')}, started {when}"


def _open_locked(path: Path, what: str) -> int:
    """A descriptor of ``path`` holding its exclusive flock. A holder that released the lock
    removes the file; if that happened between our open and our flock we locked an unlinked
    inode, so we check that ``path`` is still the inode we hold and retry otherwise."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            holder = _holder(path)  # its own word for the folder's role, where it wrote one
            role = holder.get("what", what) if holder else what
            raise LockedError(
                f"{path.parent} is in use as a {role} by {_describe(holder)}; wait for it "
                f"to finish, or stop that process (a killed one releases the lock by itself), "
                f"or use another folder") from None
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(path))
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)  # the previous holder removed the file after our open: lock the new one


@contextlib.contextmanager
def locked(directory: str | Path, *, what: str = "directory") -> Iterator[Lock]:
    """Hold the exclusive lock of ``directory`` (created if missing) for the ``with`` block.

    Raises ``LockedError`` naming the holder when another live process holds it; a lock file
    left by a dead holder is taken over and described in the yielded ``Lock.stale``. ``what``
    names the folder's role in the message ("run directory", "study root"). Cost: two system
    calls and a small write; the lock never blocks (a second holder is refused at once).
    """
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise LockedError(f"cannot lock {directory} as a {what}: {e.strerror} ({e.filename}); "
                          f"choose a writable folder") from e
    path = directory / LOCK_NAME
    try:
        fd = _open_locked(path, what)
    except OSError as e:
        raise LockedError(f"cannot lock {directory} as a {what}: {e.strerror} ({path}); "
                          f"choose a writable folder") from e
    try:
        # contents left behind mean the previous holder never released it: it died holding it
        stale = _holder(path)
        record = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(),
                  "what": what}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
        yield Lock(path, stale)
    finally:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()  # still holding the lock, so no one else can have replaced the file
        os.close(fd)  # releases the flock
