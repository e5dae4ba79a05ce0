"""Which run ``resume=auto`` continues when the command names no run directory.

Without ``hydra.run.dir`` each command gets a new dated directory, so ``resume=auto`` alone would
find nothing there and start over (exit 0, progress thrown away). Instead the same command with
``resume=auto`` continues the run it started: :func:`resume_auto_dir` looks, under the root of
the configured run-directory pattern (``outputs/`` by default), for runs whose overrides (Hydra's
``.hydra/overrides.yaml``) are this command's, apart from the resume settings, that hold a
checkpoint and did not complete. One such run is continued in its own directory; none, or
several, is one line naming what was found and what to type.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from mptrain.config.base import ConfigError
from mptrain.rundir.command import (
    HYDRA_RECORD,
    OVERRIDES_YAML,
    recorded_overrides,
    run_command,
)
from mptrain.rundir.layout import BEST, CHECKPOINT_DIR, LATEST, REPORT_JSON


def resume_auto_dir(pattern: str, overrides: list[str]) -> Path | None:
    """The run directory ``resume=auto`` continues (see the module doc), or None when
    ``pattern`` (``hydra.run.dir`` before interpolation) names one fixed directory: that one.
    ConfigError, one line, when no unfinished run of this command is found, or several are."""
    if "${" not in pattern:
        return None
    root, depth = _pattern_root(pattern)
    command = run_command(overrides)
    runs = [d for d in _run_dirs(root, depth) if _recorded_command(d) == command]
    resumable = [d for d in runs if _has_checkpoint(d)]
    unfinished = sorted((d for d in resumable if not _completed(d)), key=_age)
    typed = " ".join(["mptrain", *map(shlex.quote, command), "resume=auto"])
    if len(unfinished) == 1:
        return unfinished[0]
    if unfinished:
        listed = ", ".join(str(d) for d in unfinished[:3])
        raise ConfigError(
            f"resume=auto: {len(unfinished)} unfinished runs of this command under {root} "
            f"({listed}); name one: {typed} hydra.run.dir=DIR"
        )
    if resumable:
        raise ConfigError(
            f"resume=auto: the run of this command in {resumable[-1]} completed; nothing to "
            "continue (run it without resume=auto to start another)"
        )
    raise ConfigError(
        f"resume=auto: no run of this command to continue under {root} (runs are matched by their "
        "overrides, apart from resume settings); run it without resume=auto to start one, or "
        "name the run with hydra.run.dir=DIR"
    )


def _pattern_root(pattern: str) -> tuple[Path, int]:
    """(the directory before the pattern's first interpolation, how many levels below it the run
    directories are): ``outputs/${now:...}/${now:...}_...`` -> (outputs, 2)."""
    head, _, tail = pattern.partition("${")
    root = Path(head) if head.endswith("/") or not head else Path(head).parent
    return root, ("${" + tail).count("/") + 1


def _run_dirs(root: Path, depth: int) -> list[Path]:
    record = ["*"] * depth + [HYDRA_RECORD, OVERRIDES_YAML]
    return [p.parent.parent for p in root.glob("/".join(record))]


def _recorded_command(run_dir: Path) -> list[str] | None:
    """What the run in ``run_dir`` runs, from Hydra's record; None without a readable one."""
    overrides = recorded_overrides(run_dir)
    return None if overrides is None else run_command(overrides)


def _has_checkpoint(run_dir: Path) -> bool:
    checkpoints = run_dir / CHECKPOINT_DIR
    return (checkpoints / LATEST).is_file() or (checkpoints / BEST).is_file()


def _completed(run_dir: Path) -> bool:
    try:
        return json.loads((run_dir / REPORT_JSON).read_text())["status"] == "completed"
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _age(run_dir: Path) -> float:
    return (run_dir / HYDRA_RECORD / OVERRIDES_YAML).stat().st_mtime
