"""Resuming a run: a checkpoint is restored only if it fits the run built now, and a resume that
finds nothing says which earlier run it may have meant (the job: :mod:`mptrain.train.job`)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from mptrain.checkpoint.checkpointer import restore, run_signature
from mptrain.checkpoint.file import Found, check_compatible
from mptrain.config.base import ConfigError
from mptrain.config.run import RunConfig
from mptrain.output.joblog import JobLog
from mptrain.output.metrics import last_step, truncate_after
from mptrain.platform.seeding import seed_everything
from mptrain.rundir.command import HYDRA_RECORD, continue_command, recorded_overrides
from mptrain.rundir.layout import (
    CHECKPOINT_DIR,
    LATEST,
    METRICS_JSONL,
    REPORT_JSON,
    REPORT_MD,
    RESTARTS_JSONL,
)
from mptrain.rundir.lock import check_no_other_run
from mptrain.train.components import Run


def record_restart(output_dir: Path, restart: int, resumed_from: int) -> list[dict[str, Any]]:
    """Append attempt ``restart``'s row to the run directory's restart history (where it resumed,
    the last step the attempt before it logged, the steps lost between: at least that many, as
    rows come every ``log_every``); every row so far. Rank 0, before the metrics are cut back."""
    path = output_dir / RESTARTS_JSONL
    logged = last_step(output_dir / METRICS_JSONL)
    row = {
        "restart": restart,
        "resumed_from_step": resumed_from,
        "last_logged_step": logged,
        "steps_lost_at_least": max(logged - resumed_from, 0),
    }
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]


def _restarted(
    dist: Any, output_dir: Path, found: Found | None, log: JobLog
) -> list[dict[str, Any]] | None:
    """Rank 0 of a restarted attempt: its row of the restart history, said; every row so far
    (None on a first attempt, or another rank)."""
    restart = dist.launch.restart
    if not restart or not dist.is_main:
        return None
    restarts = record_restart(output_dir, restart, found[1]["loop"]["step"] if found else 0)
    last = restarts[-1]
    log.say(
        f"restart {restart} of the job: the attempt before logged up to step "
        f"{last['last_logged_step']}; continuing from step {last['resumed_from_step']} "
        f"(at least {last['steps_lost_at_least']} steps lost)",
        "restart",
    )
    return restarts


def resume_job(
    found: Found | None, cfg: RunConfig, run: Run, output_dir: Path, log: JobLog
) -> dict[str, Any]:
    """Restore ``found`` into ``run``, or say that ``resume=auto`` found nothing (ConfigError for
    a checkpoint that does not fit, or a run that has nothing left to train); the report's
    resume section."""
    dist = run.dist
    restarts = _restarted(dist, output_dir, found, log)
    if found is None:
        # overwrite=true: what resolve_resume found unreadable, or in the way, is deleted
        over = cfg.overwrite and dist.is_main and start_over(output_dir, log.say)
        note = (
            f"no checkpoint loaded in {output_dir}; started over (overwrite=true)"
            if over
            else f"{no_checkpoint_hint(output_dir, cfg)}; started fresh"
        )
        if dist.is_main:  # a fresh start logs from step 1 again
            truncate_after(output_dir / METRICS_JSONL, 0)
        log.say(note, "resume=auto")
        return {"requested": cfg.resume, "from": None, "note": note, "restarts": restarts}
    path, payload, notes = found
    signature = run_signature(cfg, run.precision, run.data.identity)
    allowed = check_compatible(
        payload, signature, path, cfg.resume_allow_changes, data_key=data_key(cfg)
    )
    if not allowed:  # the same settings: nothing left to train (changes: applied below)
        check_not_completed(output_dir, path, payload, run.settings.total_steps, log.say)
    saved_world = payload.get("world_size", 1)
    if saved_world != dist.world_size:
        notes.append(
            f"saved at world size {saved_world}, resumed at {dist.world_size}: weights, "
            "optimizer and scaler state load as saved; the data position is placed by step count"
        )
    notes += restore_or_refuse(payload, run, path)
    if dist.is_main:  # the steps after the checkpoint will be logged again
        dropped = truncate_after(output_dir / METRICS_JSONL, run.state.step)
        if dropped:
            notes.append(f"metrics.jsonl: {dropped} row(s) after step {run.state.step} removed")
    if dist.enabled:  # rank 0's RNG was saved: give each rank its own stream again
        seed_everything(cfg.seed + dist.rank + run.state.step)
    for note in notes:
        log.say(note, "resume")
    log.say(f"resumed from {path} at step {run.state.step}")
    return {
        "requested": cfg.resume,
        "from": str(path),
        "step": run.state.step,
        "allowed_differences": allowed,
        "notes": notes,
        "restarts": restarts,  # restarted attempts (torchrun --max-restarts, SLURM's requeue)
    }


def restore_or_refuse(payload: dict[str, Any], run: Run, path: Path) -> list[str]:
    """:func:`restore`, with a checkpoint that does not fit the model built now (its weights'
    shapes or names, e.g. a text with another vocabulary under resume_allow_changes=true) refused
    as bad input in one line: a resume that cannot start must not end in a failed report written
    over the run's own (a finished run's report, curves and metrics stay as they were)."""
    try:
        return restore(payload, run, path)
    except ConfigError:
        raise
    except (RuntimeError, KeyError, ValueError) as exc:
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        raise ConfigError(
            f"resume: {path} does not fit the run built now ({': '.join(lines[:2])})"
        ) from exc


def data_key(cfg: RunConfig) -> str:
    """The setting that names where the data comes from, with its value, for messages."""
    for key in ("path", "root"):
        value = getattr(cfg.dataset, key, None)
        if value:
            return f"dataset.{key}={value!r}"
    return f"dataset={cfg.dataset.name}"


def no_checkpoint_hint(output_dir: Path, cfg: RunConfig) -> str:
    """Why resume=auto found nothing, and the run it may have meant: resume=auto continues the run
    of the directory it is given, and without hydra.run.dir each command gets a new one. Only a
    run of the same model, precision and task is named (another's command would be refused),
    with the command that continues it (its own overrides)."""
    found = sorted(
        (p.parent.parent for p in output_dir.parent.parent.glob(f"*/*/{CHECKPOINT_DIR}/{LATEST}")),
        key=lambda run_dir: (run_dir / CHECKPOINT_DIR / LATEST).stat().st_mtime,
    )
    wanted = (cfg.model.name, cfg.precision.name, cfg.task)
    matching = [d for d in found if d != output_dir and _run_kind(d) == wanted]
    message = f"no checkpoint in {output_dir}"
    if matching:
        run_dir = matching[-1]
        command = continue_command(recorded_overrides(run_dir) or [], run_dir)
        message += (
            f" (a new run directory); the most recent resumable run of {cfg.model.name} "
            f"{cfg.precision.name} is {run_dir}: {command}"
        )
    return message


def _run_kind(run_dir: Path) -> tuple[str, str, str] | None:
    """(model, precision, task) of the run in ``run_dir``, from its report or Hydra's record."""
    report = _read_report(run_dir / REPORT_JSON) or {}
    if "config" in report:
        config = report["config"]
    else:
        try:
            config = OmegaConf.to_container(OmegaConf.load(run_dir / HYDRA_RECORD / "config.yaml"))
        except Exception:  # unreadable or not YAML (OmegaConf's parser errors vary): not this run
            return None
    try:
        return config["model"]["name"], config["precision"]["name"], config.get("task", "classify")
    except (KeyError, TypeError):
        return None


class AlreadyCompleted(RuntimeError):
    """Raised by :func:`train` for a resume of a run that already completed in this directory
    (its checkpoint at the last step, its report ``completed``): nothing to train, nothing
    written, the report kept as it is (``report``: report.json's content). Exit 0."""

    def __init__(self, message: str, report: dict[str, Any]) -> None:
        super().__init__(message)
        self.report = report


def check_not_completed(
    output_dir: Path,
    path: Path,
    payload: dict[str, Any],
    total: int,
    say: Callable[[str, str], None],
) -> None:
    """:class:`AlreadyCompleted` when ``path`` (the checkpoint resumed, ``payload`` its content, at
    a step of the run's ``total``) ends the run and ``output_dir``'s report says it completed: training again for 0
    steps would replace its measured throughput, times and estimate with nothing. A finished
    checkpoint resumed into another directory is said (``say``) and goes on (0 steps there)."""
    step = payload["loop"]["step"]
    if step < total:
        return
    report = _read_report(output_dir / REPORT_JSON)
    own = path.resolve().is_relative_to(output_dir.resolve())
    if own and report is not None and report.get("status") == "completed":
        raise AlreadyCompleted(
            f"{output_dir}: already completed (step {step} of {total}); nothing to train, its "
            f"report is kept ({REPORT_MD})",
            report,
        )
    say(
        f"{path} is at step {step} of {total}: nothing left to train; evaluating and reporting it",
        "resume",
    )


def _read_report(path: Path) -> dict[str, Any] | None:
    """report.json's content; None when it is missing or unreadable."""
    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return report if isinstance(report, dict) else None


def start_over(output_dir: Path, say: Callable[[str, str], None]) -> bool:
    """resume=auto overwrite=true where no checkpoint loads: the earlier run's files go, as for a
    fresh overwrite=true run (a ``checkpoints`` file in the way included), each deletion said.
    Whether anything was deleted."""
    directory = output_dir / CHECKPOINT_DIR
    in_the_way = directory.exists() and not directory.is_dir()
    if in_the_way:
        directory.unlink()
        say(f"overwrite=true: deleted {directory} (a file, not a directory)", "note")
    deleted = check_no_other_run(output_dir, None, overwrite=True)
    if deleted:
        say(deleted, "note")
    return in_the_way or deleted is not None
