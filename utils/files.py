"""Writing files so that nothing is lost: the one atomic writer of the package.

A reader (a notebook, the grader, a resumed run, a second rank) sees the old file or the new one,
never half of one: the bytes go to a temporary file in the same folder, are flushed to disk, and
the temporary file is renamed onto the target (``os.replace`` is atomic on one file system). A
failure on the way leaves the old file and no temporary file behind.

One deliberate exception: ``data.fetch`` downloads to ``NAME.partPID`` and renames only after the
whole file's MD5 matched, trying the next mirror on a mismatch.

Also the room left in shared memory (``shm_free_bytes``), which DataLoader workers and NCCL's
ranks on one node write through: ``data.make_loader`` and ``parallel.setup`` check it first.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

__all__ = ["atomic_open", "atomic_write", "atomic_write_json", "atomic_save", "SHM_DIR", "shm_free_bytes"]


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, *, fsync: bool = True) -> Iterator[BinaryIO]:
    """A binary file to write ``path`` through, for writers that stream (a tar or gzip archive):
    the target appears, whole, only when the block ends without an exception; an exception leaves
    the old file and no temporary file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            if fsync:
                f.flush()
                os.fsync(f.fileno())  # the bytes are on disk before the rename
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def atomic_write(path: str | os.PathLike, data: bytes | str, *, fsync: bool = True) -> Path:
    """Write ``data`` (bytes, or text as UTF-8 with newlines kept as given) to ``path`` atomically,
    making its folder first; returns the path."""
    if isinstance(data, str):
        data = data.encode("utf-8")
    with atomic_open(path, fsync=fsync) as f:
        f.write(data)
    return Path(path)


def atomic_write_json(path: str | os.PathLike, obj: Any, *, indent: int = 1) -> Path:
    """``obj`` as JSON (values JSON cannot hold are written with ``str``), one trailing newline."""
    return atomic_write(path, json.dumps(obj, indent=indent, default=str) + "\n")


def atomic_save(obj: Any, path: str | os.PathLike) -> Path:
    """``torch.save(obj)`` to ``path`` atomically (serialised in memory first, then written)."""
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    return atomic_write(path, buf.getvalue())


SHM_DIR = "/dev/shm"


def shm_free_bytes(path: str = SHM_DIR) -> int | None:
    """Bytes free in shared memory (Docker gives a container 64 MB unless told otherwise); None
    where there is no such folder (not Linux): nothing to check."""
    try:
        st = os.statvfs(path)
    except (AttributeError, OSError):
        return None
    return st.f_bavail * st.f_frsize
