"""Hydra multiruns (``python -m mptrain -m ...``) run as a user runs them, and what they leave:
the job directories and their reports. Used by tests/commands/test_sweep.py and tests/e2e/test_cli.py."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from mptrain.rundir.layout import REPORT_JSON
from support.processes import SUBPROCESS_TIMEOUT_S, run_mptrain


def run_sweep(
    cwd: Path, *overrides: str, timeout: float = SUBPROCESS_TIMEOUT_S
) -> tuple[subprocess.CompletedProcess, Path]:
    """``python -m mptrain -m *overrides`` in ``cwd`` into the sweep directory ``cwd/sweep``:
    the finished process and that directory."""
    result = run_mptrain(cwd, "-m", *overrides, "hydra.sweep.dir=sweep", timeout=timeout)
    return result, cwd / "sweep"


def job_dirs(sweep_dir: Path) -> list[Path]:
    """Hydra's job directories (<number>_<overrides>), in job order."""
    jobs = [p for p in sweep_dir.iterdir() if (p / ".hydra").is_dir()]
    return sorted(jobs, key=lambda p: int(p.name.split("_", 1)[0]))


def read_report(directory: Path) -> dict:
    """The report.json in ``directory``, as JSON."""
    return json.loads((directory / REPORT_JSON).read_text(encoding="utf-8"))
