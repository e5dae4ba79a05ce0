"""mptrain jobs a CPU benchmark trains in its own process, and the head of its JSON document.

A job is composed from command-line overrides as ``mptrain`` composes them
(:func:`benchmarks.mptrain_api.compose`) and trained by mptrain's ``train`` (build, loop,
evaluations, report) in a temporary directory, the console silent. Used by
benchmarks/contention.py and benchmarks/bf16_update.py. mptrain, Hydra and torch are imported
when a function is called, not on import.
"""

from __future__ import annotations

import datetime as dt
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.mptrain_api import compose

# Every job of these benchmarks: on the CPU, no progress display, a length in steps (max_steps),
# no checkpoints (disk writes are not what they measure).
CPU_JOB = ("device=cpu", "progress=false", "epochs=null", "checkpoint.enabled=false")
# The small GPT (task=lm: the default GPT on the embedded text, 2 layers of width 64, 64-token
# windows, batch 16): a language model that trains in seconds on a CPU.
SMALL_GPT = (
    "task=lm",
    "model.layers=2",
    "model.heads=2",
    "model.width=64",
    "model.block_size=64",
    "batch_size=16",
)


def quiet_console():
    """A rich Console that prints nothing: the job's summary and lines stay off the table."""
    from rich.console import Console

    return Console(quiet=True)


def train_report(*overrides: str) -> dict[str, Any]:
    """The report (``to_dict``) of one whole job of ``overrides``, trained in a temporary
    directory that is gone afterwards."""
    from benchmarks.mptrain_api import train

    cfg = compose(*overrides)
    with tempfile.TemporaryDirectory() as tmp:
        return train(cfg, Path(tmp), console=quiet_console()).to_dict()


def cpu_document(args: dict[str, Any], started: float, **figures: Any) -> dict[str, Any]:
    """A CPU benchmark's JSON document: the date, ``args``, the CPU and the software versions,
    the wall time since ``started`` (a ``time.perf_counter()``), then ``figures``."""
    import torch

    from benchmarks.mptrain_api import hardware_info, software_versions

    return {
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "args": args,
        "hardware": hardware_info(torch.device("cpu")),
        "versions": software_versions(),
        "wall_s": time.perf_counter() - started,
        **figures,
    }
