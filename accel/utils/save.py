"""Atomic writes: a crash mid-save never leaves a truncated file where a good one was.

The object is written to a temporary file in the destination's directory (same
filesystem), flushed to disk, then moved over the destination with `os.replace`, which
is atomic on POSIX and Windows.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from typing import Any

import torch


def atomic_save(obj: Any, path: str | os.PathLike, writer: Callable[[Any, Any], None] = torch.save) -> None:
    """Write `obj` to `path` with `writer(obj, file_object)`, atomically.

    A file-like `path` (anything with `write`) is written directly: there is no name to
    replace.
    """
    if hasattr(path, "write"):
        writer(obj, path)
        return
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as handle:
            writer(obj, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        # Leave the previous file (if any) untouched and no temporary behind.
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
