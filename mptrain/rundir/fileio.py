"""Atomic file writes: a reader sees the old file or the complete new one, never a part.

Every file written here gets the permissions an ordinary ``open(path, "w")`` would give it:
``0o666`` less the process umask (0644 under umask 022), not the 0600 of ``tempfile.mkstemp``.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

# The process umask. ``os.umask`` can only be read by setting it, so it is set and put back at
# once, here at import time (single-threaded) rather than on every write from any thread.
_UMASK = os.umask(0o022)
os.umask(_UMASK)
FILE_MODE = 0o666 & ~_UMASK  # what open() would create


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def _replacing(path: Path) -> Iterator[tuple[int, str]]:
    """Yield ``(fd, name)`` of a new temporary file in ``path``'s directory for the caller to fill;
    then rename it over ``path`` and fsync the directory. On any failure the temporary file is
    removed and ``path`` is untouched."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        # mkstemp's 0600, whatever the umask, becomes what open() gives (see the module doc).
        os.fchmod(fd, FILE_MODE)
        yield fd, tmp
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException:
        # Best effort: in a directory that became unwritable the removal fails too, and must
        # not hide why the write failed (a later save removes the stray: remove_stray_temporaries).
        with contextlib.suppress(OSError):
            Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write(path: Path, write: Callable[[IO[Any]], None], *, binary: bool = False) -> None:
    """Call ``write(file)`` on a temporary file in ``path``'s directory, fsync it, rename it over
    ``path`` and fsync the directory. On any failure the temporary file is removed and ``path``
    is untouched."""
    with (
        _replacing(path) as (fd, _),
        os.fdopen(fd, "wb" if binary else "w", **({} if binary else {"encoding": "utf-8"})) as f,
    ):
        write(f)
        f.flush()
        os.fsync(f.fileno())


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write(path, lambda f: f.write(text))


def atomic_link(source: Path, path: Path) -> None:
    """Make ``path`` a second name of ``source``'s bytes, replacing ``path`` atomically.

    A hard link costs no write and no space; where the file system has none (or ``source`` is on
    another one) the bytes are copied. Either way ``path`` survives ``source``'s later deletion
    and a reader sees the old ``path`` or the new one, never a part.
    """
    with _replacing(path) as (fd, tmp):
        os.close(fd)
        os.unlink(tmp)  # os.link refuses an existing name
        try:
            os.link(source, tmp)
        except OSError:
            shutil.copyfile(source, tmp)
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())


def clean_json(value: Any) -> Any:
    """Make a value strict-JSON: non-finite floats become strings ("nan", "inf")."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): clean_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [clean_json(v) for v in value]
    return value
