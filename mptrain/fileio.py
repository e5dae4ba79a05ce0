"""Atomic file writes: a reader sees the old file or the complete new one, never a part."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, write: Callable[[IO[Any]], None], *, binary: bool = False) -> None:
    """Call ``write(file)`` on a temporary file in ``path``'s directory, fsync it, rename it over
    ``path`` and fsync the directory. On any failure the temporary file is removed and ``path``
    is untouched."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(
            fd, "wb" if binary else "w", **({} if binary else {"encoding": "utf-8"})
        ) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write(path, lambda f: f.write(text))
