"""The checked command's jobs on Hydra: :func:`launch` starts them, :func:`run_job` is each job.

:func:`launch` runs the checked command on the preflight's Hydra instance the way ``@hydra.main``
runs it (Hydra's ``_run_app``), which would build a second instance and compose the config twice
more (once only to read ``hydra.mode``, which the preflight already knows).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from mptrain.cli.preflight import CONFIG_NAME, Preflight
from mptrain.cli.record import discard, promote, staged_record, staged_subdir
from mptrain.cli.registry import absolute_paths, to_run_config
from mptrain.config.base import ConfigError, launch_dir, set_launch_dir
from mptrain.rundir.command import continue_command
from mptrain.rundir.layout import CHECKPOINT_DIR, LATEST, REPORT_JSON


def fail(message: str, code: int = 2) -> None:
    """End the command with ``mptrain: error: message`` and exit code ``code``."""
    print(f"mptrain: error: {message}", file=sys.stderr)
    raise SystemExit(code)


def launch(
    hydra: Any,
    args: argparse.Namespace,
    checked: Preflight,
    sweeper_failed: Callable[[Exception], bool],
) -> Callable[[], None]:
    """The call that runs the checked command's jobs (:func:`run_job`) on ``hydra``, in the output
    directory the preflight checked (see the module doc). An error of a sweep for which
    ``sweeper_failed(error)`` returns True has been reported, and the call returns."""
    mode, key = ("MULTIRUN", "hydra.sweep.dir") if checked.multirun else ("RUN", "hydra.run.dir")
    # The output directory pinned to the one checked (Hydra would resolve ``${now:...}`` again).
    overrides = [*args.overrides, f"{key}={_quoted(checked.output_dir)}", f"hydra.mode={mode}"]
    if checked.record_subdir is not None:  # written where the run's job moves it (cli.record)
        overrides.append(f"hydra.output_subdir={_quoted(staged_subdir(checked.record_subdir))}")
    start = functools.partial(
        hydra.multirun if checked.multirun else hydra.run,
        config_name=args.config_name or CONFIG_NAME,
        task_function=run_job,
        overrides=overrides,
    )
    return functools.partial(_sweep, start, sweeper_failed) if checked.multirun else start


def _sweep(start: Callable[[], None], sweeper_failed: Callable[[Exception], bool]) -> None:
    try:
        start()
    except Exception as exc:
        if not sweeper_failed(exc):
            raise


def _quoted(value: str) -> str:
    """``value`` as a quoted override value (Hydra's grammar: backslash and quote escaped)."""
    escaped = value.replace("\\", "\\\\").replace("'", "\\'")
    return f"'{escaped}'"


def run_job(cfg: DictConfig) -> float | None:
    """One Hydra job: typed config in, report out. Returns the final value of the task's primary
    metric (what a sweeper such as Optuna optimises: validation accuracy, to maximise; for
    task=lm validation loss, to minimise), or None for a job that did not complete.

    A job of a sweep that fails says so and returns: the sweep goes on, and
    :func:`mptrain.cli.app.main` reads every job's report afterwards to set the exit code (a
    launcher may run jobs in other processes, so nothing is kept in this process's memory).
    """
    from hydra.core.hydra_config import HydraConfig

    from mptrain.checkpoint.resume import AlreadyCompleted
    from mptrain.output.joblog import record_error
    from mptrain.report.render import write_failure
    from mptrain.train.job import RunFailed, RunInterrupted, train
    from mptrain.train.threads import sweep_jobs

    hydra_cfg = HydraConfig.get()
    output_dir = Path(hydra_cfg.runtime.output_dir)
    multirun = hydra_cfg.mode.name == "MULTIRUN"
    # Hydra's record of the command, staged until the run owns the directory (cli.record).
    record = staged_record(output_dir, hydra_cfg.output_subdir)
    try:
        set_launch_dir(Path(hydra_cfg.runtime.cwd))
        run = absolute_paths(to_run_config(cfg), launch_dir())
        # joblib runs n_jobs jobs at once on this machine: threads=auto divides the cores
        jobs = sweep_jobs(hydra_cfg.launcher.get("n_jobs")) if multirun else 1
        report = train(run, output_dir, on_owned=lambda: promote(record), jobs=jobs)
    except ConfigError as exc:
        if record is None or not record.exists():  # the job owned the directory: its log
            record_error(str(exc))  # says why it holds no run (not an owner's log it was refused)
        if not multirun:
            fail(str(exc))
        print(f"mptrain: error: {output_dir}: {exc}", file=sys.stderr)
        write_failure(output_dir, str(exc))  # so the sweep summary shows the job and why
        return None
    except RunInterrupted as exc:
        _say_interrupted(exc, output_dir, multirun, list(hydra_cfg.overrides.task))
    except AlreadyCompleted as exc:
        return _already_completed(exc, output_dir)
    except RunFailed as exc:
        if not multirun:
            where = f" (report in {output_dir})" if exc.written else ""
            fail(f"run {exc.status}: {exc.reason}{where}", code=1)
        print(f"mptrain: error: {output_dir}: {exc.status}: {exc.reason}", file=sys.stderr)
        return None
    finally:
        discard(record)
    e = report.evaluation
    return getattr(e, f"final_{e.primary_metric}")  # final_val_accuracy | final_val_loss


def _say_interrupted(exc: Any, output_dir: Path, multirun: bool, overrides: list[str]) -> None:
    """The job was stopped by a signal: say where its report is, and (one run with a checkpoint)
    the command that continues it; exit with the signal's code."""
    print(f"mptrain: {exc.report.reason} (report in {output_dir})", file=sys.stderr)
    if not multirun and (output_dir / CHECKPOINT_DIR / LATEST).is_file():
        print(f"mptrain: to continue: {continue_command(overrides, output_dir)}", file=sys.stderr)
    raise SystemExit(exc.exit_code) from None


def _already_completed(exc: Any, output_dir: Path) -> float | None:
    """``resume=auto`` found the run complete: its report stands as this command's answer (a
    sweep's summary reads it as this sweep's), touched with its content unchanged."""
    print(f"mptrain: {exc}")
    with contextlib.suppress(OSError):
        os.utime(output_dir / REPORT_JSON)
    evaluation = exc.report.get("evaluation") or {}
    return evaluation.get(f"final_{evaluation.get('primary_metric')}")
