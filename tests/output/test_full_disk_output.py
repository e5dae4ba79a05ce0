"""A full disk between checkpoints (issue 39, item 21): it used to flood stderr with "--- Logging
error ---" blocks before the run's one-line error, and leave a cut row in metrics.jsonl."""

from __future__ import annotations

import contextlib
import io
import json
import logging

import pytest
from rich.console import Console

from mptrain.output.joblog import JobLog
from mptrain.output.metrics import MetricsLog


class ShortWrites(io.FileIO):
    """A file on a disk that fills mid-row: each write stores half of what it was given."""

    def write(self, data):
        return super().write(bytes(data)[: len(data) // 2])


def test_a_row_the_disk_cannot_hold_is_undone_not_cut(tmp_path):
    path = tmp_path / "metrics.jsonl"
    log = MetricsLog(path)
    log.on_log({"kind": "train", "step": 1, "loss": 0.5})
    log._file.close()
    log._file = ShortWrites(path, "ab")
    with pytest.raises(OSError, match="No space left on device"):
        log.on_log({"kind": "train", "step": 2, "loss": 0.25})
    log.close()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows == [{"kind": "train", "step": 1, "loss": 0.5}]


def test_a_log_file_that_cannot_be_written_is_said_once(capsys):
    """/dev/full: every write fails with ENOSPC, as on a full disk."""
    handler = logging.FileHandler("/dev/full")
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        with JobLog(Console(file=io.StringIO())) as log:
            for n in range(5):
                log.say(f"line {n}")
    finally:
        root.removeHandler(handler)
        with contextlib.suppress(OSError):  # its buffer still holds the first line
            handler.close()
    err = capsys.readouterr().err
    assert "Logging error" not in err
    assert err.splitlines() == [
        "mptrain: warning: /dev/full: no longer written (No space left on device)"
    ]
