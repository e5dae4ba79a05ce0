"""The run directories a comparison reads: each run's report (or why it has none), and which jobs
of a sweep directory are the sweep's that is running there.

A run directory holds ``report.json``, or ``failure.json`` when the job stopped before training,
and ``.hydra/overrides.yaml`` when Hydra made it (its label). A sweep directory holds one run
directory per job; a later sweep into it adds its own beside them, or reuses a job's directory
(:func:`this_sweeps_runs` tells them apart).
"""

from __future__ import annotations

import datetime as dt
import json
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from mptrain.report.schema import ReportError, RunReport, load_report
from mptrain.rundir.command import HYDRA_RECORD, OVERRIDES_YAML, recorded_overrides
from mptrain.rundir.layout import FAILURE_JSON, REPORT_JSON


@dataclass
class RunRecord:
    """One run directory as the comparison sees it."""

    directory: Path
    label: str  # the job's overrides, or the directory name
    report: RunReport | None
    reason: str | None = None  # why there is no usable report


def load_run(directory: Path) -> RunRecord:
    overrides = recorded_overrides(directory)
    label = " ".join(overrides) if overrides else directory.name
    path = directory / REPORT_JSON
    if not path.is_file():
        failure = directory / FAILURE_JSON
        if failure.is_file():
            return RunRecord(directory, label, None, reason=_failure_reason(failure))
        return RunRecord(
            directory, label, None, reason="no report.json (the job ended before training)"
        )
    try:
        return RunRecord(directory, label, load_report(path))
    except (OSError, json.JSONDecodeError, ReportError) as exc:
        return RunRecord(directory, label, None, reason=f"unreadable report.json: {exc}")


def _job_order(directory: Path) -> tuple[int, str]:
    """Hydra names sweep jobs <number>_<overrides>: order by that number, then by name."""
    number, _, _ = directory.name.partition("_")
    return (int(number) if number.isdigit() else sys.maxsize, directory.name)


def _shorten_labels(runs: list[RunRecord]) -> None:
    """Keep only the overrides that differ between runs (what the comparison is about), and
    prefix labels that would still collide (two sweeps of the same jobs) with their directory."""
    split = [run.label.split(" ") for run in runs]
    common = set.intersection(*(set(s) for s in split)) if len(split) > 1 else set()
    for run, parts in zip(runs, split, strict=True):
        run.label = " ".join(p for p in parts if p not in common) or run.label
    counts = Counter(run.label for run in runs)
    for run in runs:
        if counts[run.label] > 1:
            where = f"{run.directory.parent.name}/{run.directory.name}"
            run.label = where if run.label == run.directory.name else f"{where}: {run.label}"


# How many directory levels below a path that is neither a run nor a sweep are searched for runs:
# outputs/<date>/<time>_<name> is 2, multirun/<date>/<time>/<job> 3.
SEARCH_DEPTH = 3


def find_runs(paths: list[Path]) -> list[RunRecord]:
    """The runs of :func:`run_dirs_in` each of ``paths``, loaded and labelled; a directory found
    twice (a folder and a run inside it) counts once. FileNotFoundError when a path holds none."""
    found: dict[Path, None] = {}
    for path in paths:
        directories = run_dirs_in(path)
        if not directories:
            raise FileNotFoundError(NO_RUNS.format(path=path))
        found.update(dict.fromkeys(directories))
    runs = [load_run(directory) for directory in found]
    _shorten_labels(runs)
    return runs


NO_RUNS = (
    f"{{path}}: neither a run directory nor a sweep of runs, and no run within {SEARCH_DEPTH} "
    "levels below it"
)


def run_dirs_in(path: Path) -> list[Path]:
    """``path`` when it is a run directory; else the run directories in it, a sweep's in job order;
    else those found up to :data:`SEARCH_DEPTH` levels down (``outputs`` holds dated runs:
    outputs/<date>/<time>_<name>), each folder's in job order; [] when there are none."""
    if _is_run_dir(path):
        return [path]
    return _search(path, SEARCH_DEPTH)


def _search(path: Path, depth: int) -> list[Path]:
    """Run directories below ``path``, at most ``depth`` levels down; a run's own folders
    (checkpoints, tensorboard) are not searched, nor hidden ones (.git, .hydra)."""
    if depth == 0:
        return []
    found: list[Path] = []
    children = (c for c in path.iterdir() if c.is_dir() and not c.name.startswith("."))
    for child in sorted(children, key=_job_order):
        found += [child] if _is_run_dir(child) else _search(child, depth - 1)
    return found


def _run_dirs(path: Path) -> list[Path]:
    """``path`` when it is a run directory, else the run directories in it in job order (a
    sweep's jobs: not searched deeper); FileNotFoundError when neither."""
    if _is_run_dir(path):
        return [path]
    children = sorted((c for c in path.iterdir() if c.is_dir() and _is_run_dir(c)), key=_job_order)
    if not children:
        raise FileNotFoundError(f"{path}: neither a run directory nor a sweep of runs")
    return children


def _is_run_dir(path: Path) -> bool:
    """A job's directory: its report, the failure of a job refused at run time (which never
    owned the directory, so Hydra's record of it was not kept: mptrain.cli.record), or the
    record of a job that ended before writing either."""
    return (
        any((path / name).is_file() for name in (REPORT_JSON, FAILURE_JSON))
        or (path / HYDRA_RECORD).is_dir()
    )


def this_sweeps_runs(sweep_dir: Path, started: float) -> list[RunRecord]:
    """The jobs of the sweep that started at ``started`` (a ``time.time()``) in ``sweep_dir``, as
    that sweep left them; a sweep directory may hold earlier sweeps' jobs, and a job directory
    an earlier run's report:

    - a job directory is this sweep's when Hydra's ``.hydra/overrides.yaml``, report.json or
      failure.json was written there since ``started``;
    - a job that stopped before training in this sweep (failure.json written since: refused, bad
      data) did not complete, whatever report.json an earlier run left beside it;
    - a report.json of a run that started before ``started`` is not this job's: the job did not
      complete ("no report.json from this sweep").

    FileNotFoundError when ``sweep_dir`` holds no run directory.
    """
    runs = [
        _as_of(load_run(d), started) for d in _run_dirs(sweep_dir) if _touched_since(d, started)
    ]
    if runs:
        _shorten_labels(runs)
    return runs


def _written_since(path: Path, started: float) -> bool:
    return path.is_file() and path.stat().st_mtime >= started


def _touched_since(directory: Path, started: float) -> bool:
    marks = (Path(HYDRA_RECORD, OVERRIDES_YAML), Path(REPORT_JSON), Path(FAILURE_JSON))
    return any(_written_since(directory / mark, started) for mark in marks)


def _as_of(run: RunRecord, started: float) -> RunRecord:
    """``run`` as the sweep that started at ``started`` left it (see :func:`this_sweeps_runs`)."""
    failure = run.directory / FAILURE_JSON
    if _written_since(failure, started):
        return RunRecord(run.directory, run.label, None, reason=_failure_reason(failure))
    report = run.report
    # A report older than the sweep is another run's, unless this sweep's job confirmed it (a
    # finished job resumed again: "already completed" touches it, its content unchanged).
    if (
        report is not None
        and _started_before(report, started)
        and not _written_since(run.directory / REPORT_JSON, started)
    ):
        reason = (
            f"no report.json from this sweep (the one there: a run started {report.started_at})"
        )
        return RunRecord(run.directory, run.label, None, reason=reason)
    return run


def _started_before(report: RunReport, started: float) -> bool:
    """Whether ``report``'s run started before ``started``; a started_at that is no timestamp
    (a report.json anyone edited) counts as not (the comparison names what is wrong with it)."""
    try:
        return dt.datetime.fromisoformat(report.started_at).timestamp() < started
    except (TypeError, ValueError):
        return False


def _failure_reason(path: Path) -> str:
    try:
        return str(json.loads(path.read_text())["reason"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"unreadable {FAILURE_JSON}: {exc}"
