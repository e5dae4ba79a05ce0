"""Resuming a run: a checkpoint is restored only if it fits the run built now, and a resume that
finds nothing says which earlier run it may have meant (the job: :mod:`mptrain.train.job`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from mptrain.config.base import ConfigError
from mptrain.config.run import RunConfig
from mptrain.rundir.command import HYDRA_RECORD, continue_command, recorded_overrides
from mptrain.rundir.layout import CHECKPOINT_DIR, LATEST, REPORT_JSON
from mptrain.train.checkpointer import restore
from mptrain.train.components import Run


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
    try:
        config = json.loads((run_dir / REPORT_JSON).read_text())["config"]
    except (OSError, ValueError, KeyError, TypeError):
        try:
            config = OmegaConf.to_container(OmegaConf.load(run_dir / HYDRA_RECORD / "config.yaml"))
        except Exception:  # unreadable or not YAML (OmegaConf's parser errors vary): not this run
            return None
    try:
        return config["model"]["name"], config["precision"]["name"], config.get("task", "classify")
    except (KeyError, TypeError):
        return None
