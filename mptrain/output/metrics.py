"""metrics.jsonl: one JSON row per logged training step and one per evaluation, flushed as written."""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
from pathlib import Path
from typing import Any, Protocol

from mptrain.rundir.fileio import atomic_write_text


def _jsonable(value: Any) -> Any:
    # JSON has no inf/NaN literals; strings keep them readable and the file parseable everywhere.
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


class StepCounters(Protocol):
    """What observers read of the loop's counters (:class:`mptrain.train.state.LoopState` has
    them): the output layer sees the counters, never the loop's state object."""

    step: int
    epoch: int


class MetricsLog:
    """Appends rows to ``path``; each row is written whole or not at all, at once (unbuffered), so
    a killed run keeps what it logged and a full disk never leaves a cut row: a failed write is
    undone (the file truncated back to its last whole row) before the OSError propagates."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file = path.open("ab", buffering=0)

    def _write(self, row: dict[str, Any]) -> None:
        line = (json.dumps({k: _jsonable(v) for k, v in row.items()}) + "\n").encode("utf-8")
        end = self._file.tell()
        try:
            written = self._file.write(line)
            if written != len(line):  # a raw write may stop short of a full disk
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path))
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(self._file.fileno(), end)
            raise

    def on_step(self, state: StepCounters) -> None:
        pass

    def on_log(self, row: dict[str, Any]) -> None:
        self._write(row)

    def on_eval(self, row: dict[str, Any]) -> None:
        self._write(row)

    def on_warning(self, message: str) -> None:
        self._write({"kind": "warning", "message": message})

    def close(self) -> None:
        self._file.close()


def truncate_after(path: Path, step: int) -> int:
    """Drop every row from the first one past ``step`` on (a resumed run logs those steps again);
    rows are chronological, so warnings logged after that point go too. Atomic. Returns the number
    of rows dropped. A partly written row (a kill, a full disk) counts as past ``step``."""
    if not path.is_file():
        return 0
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    keep = next((i for i, line in enumerate(lines) if _past(line, step)), len(lines))
    if keep < len(lines):
        atomic_write_text(path, "".join(line + "\n" for line in lines[:keep]))
    return len(lines) - keep


def _past(line: str, step: int) -> bool:
    try:
        return json.loads(line).get("step", 0) > step
    except ValueError:  # a row cut short by a kill or a full disk: never complete, dropped
        return True


def last_step(path: Path) -> int:
    """The last step ``path`` logged (0 when none: no file, no complete row)."""
    if not path.is_file():
        return 0
    steps = [0]
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            steps.append(int(json.loads(line).get("step", 0)))
        except (ValueError, AttributeError, TypeError):  # a row cut short by a kill
            continue
    return max(steps)


def read_metrics(path: Path) -> list[dict[str, Any]]:
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
