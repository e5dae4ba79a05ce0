"""A benchmark's JSON document, written so that a kill at any moment leaves a whole one behind.

Every script in benchmarks/ that benchmarks/gpu_all.py runs writes its document with
:func:`write_json` after every row (or part) it measures: a step stopped at its time limit
leaves everything it measured so far, never half a file. Standard library only: gpu_all.py
imports it before mptrain's dependencies are installed.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

ERROR_CHARS = 300


def write_text(path: Path, text: str) -> None:
    """``text`` into ``path`` atomically: a temporary file in the same directory, flushed, then
    renamed over ``path`` (os.replace), so a reader sees the previous text or this one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as sink:
            sink.write(text)
            sink.flush()
            os.fsync(sink.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json(path: Path | None, doc: Any) -> None:
    """``doc`` as indented JSON into ``path`` (nothing when None), atomically (:func:`write_text`).
    Values JSON lacks (paths, dtypes) are written as strings."""
    if path is not None:
        write_text(path, json.dumps(doc, indent=2, default=str) + "\n")


def first_line(text: object, chars: int = ERROR_CHARS) -> str:
    """The first line of ``str(text)``, at most ``chars`` characters ("" when there is none)."""
    lines = str(text).strip().splitlines()
    return lines[0][:chars] if lines else ""


def error_text(exc: BaseException) -> str:
    """A failed row's ``error``: the exception's type and the first line of its message."""
    message = first_line(exc)
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__
