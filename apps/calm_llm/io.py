"""Results files written whole or not at all, and read back with errors that name the file.

Every file of a run directory (``config.json``, ``splits.json``, ``metrics.json``, ``results.md``,
``predictions.safetensors``, a checkpoint's files) goes through `atomic_write_bytes`: the bytes
go to a temporary file in the same folder, are flushed to disk, and the temporary file is renamed
over the target with `os.replace` (atomic on POSIX and Windows). A full disk or a kill while
writing leaves the previous file intact and at most a stray ``.*.tmp`` file, never a cut one.
"""

from __future__ import annotations

import errno
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as safetensors_load
from safetensors.torch import save as safetensors_save

from ..errors import CalmError


class CorruptFile(CalmError, ValueError):
    """A file of a run directory that cannot be read back; the message names it and the fix."""


class Unwritable(CalmError, OSError):
    """A file of the run that the disk refuses (full, read-only, no permission); the message
    names it and what to do. An `OSError` too, so callers that caught the raw error still do."""


# the write errors that are the machine's state, not a bug: {errno: what to do}
WRITE_FIXES = {
    errno.ENOSPC: "the disk is full: free space, then continue the run with --resume DIR "
                  "(every file is replaced whole, so nothing written before is lost)",
    errno.EDQUOT: "the disk quota is used up: free space, then continue the run with --resume DIR",
    errno.EROFS: "it is on a read-only file system: give an --out (or --root) on a writable disk",
    errno.EACCES: "no permission to write there: give an --out (or --root) you may write to",
}


def unwritable(path: str | Path | None, e: OSError) -> Unwritable:
    """The one-line error for a write the disk refused (``e.errno`` in `WRITE_FIXES`)."""
    where = path if path is not None else (e.filename or "a file of the run")
    return Unwritable(f"cannot write {where} ({e.strerror or e}); {WRITE_FIXES[e.errno]}")


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    """Write `data` to `path` through a temporary file renamed into place; returns `path`.

    Raises:
        Unwritable: the disk is full or read-only, or the folder not writable (`WRITE_FIXES`).
    """
    try:
        return _atomic_write_bytes(Path(path), data)
    except OSError as e:
        if e.errno in WRITE_FIXES and not isinstance(e, CalmError):
            raise unwritable(path, e) from e
        raise


def _atomic_write_bytes(path: Path, data: bytes) -> Path:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())  # the rename must not reach the disk before the bytes do
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def atomic_write_text(path: str | Path, text: str) -> Path:
    """`atomic_write_bytes` of UTF-8 text."""
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_save_tensors(path: str | Path, tensors: dict[str, torch.Tensor]) -> bytes:
    """Write `tensors` as safetensors atomically; returns the bytes written (for a checksum)."""
    data = safetensors_save(tensors)
    atomic_write_bytes(path, data)
    return data


def read_json(path: str | Path, fix: str) -> Any:
    """The JSON in `path`; a file that does not parse raises `CorruptFile` naming it and `fix`."""
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptFile(f"{path} is unreadable ({e}); it was probably cut short by a full disk "
                          f"or a kill. {fix}") from e


def read_tensors(path: str | Path, fix: str, data: bytes | None = None) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file (its bytes `data` when already read); a cut or garbled
    one raises `CorruptFile`."""
    path = Path(path)
    try:
        return safetensors_load(path.read_bytes() if data is None else data)
    except Exception as e:  # safetensors raises its own SafetensorError (not exported by name)
        raise CorruptFile(f"{path} is unreadable ({e}); it was probably cut short by a full disk "
                          f"or a kill. {fix}") from e
