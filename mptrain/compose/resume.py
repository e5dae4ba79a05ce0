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

from omegaconf import OmegaConf

from mptrain.config.base import ConfigError
from mptrain.rundir.layout import BEST, CHECKPOINT_DIR, LATEST, REPORT_JSON

# Not part of what a command runs: the same command with or without them is the same run.
RESUME_KEYS = ("resume", "resume_allow_changes", "overwrite")


def resume_auto_dir(pattern: str, overrides: list[str]) -> Path | None:
    """The run directory ``resume=auto`` continues (see the module doc), or None when
    ``pattern`` (``hydra.run.dir`` before interpolation) names one fixed directory: that one.
    ConfigError, one line, when no unfinished run of this command is found, or several are."""
    if "${" not in pattern:
        return None
    root, depth = _pattern_root(pattern)
    command = run_command(overrides)
    runs = [d for d in _run_dirs(root, depth) if run_command(_recorded(d)) == command]
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


def continue_command(overrides: list[str], run_dir: Path) -> str:
    """The command that continues the run in ``run_dir`` started with ``overrides``, quoted for
    a POSIX shell, from any directory."""
    words = [*run_command(overrides), "resume=auto", f"hydra.run.dir={run_dir.absolute()}"]
    return " ".join(["mptrain", *map(shlex.quote, words)])


def run_command(overrides: list[str]) -> list[str]:
    """The overrides that say what a command runs, sorted: all but Hydra's own and
    :data:`RESUME_KEYS`."""
    kept = []
    for override in overrides:
        key = override.split("=", 1)[0].lstrip("+~")
        if key.startswith(("hydra.", "hydra/")) or key in RESUME_KEYS:
            continue
        kept.append(override)
    return sorted(kept)


def _pattern_root(pattern: str) -> tuple[Path, int]:
    """(the directory before the pattern's first interpolation, how many levels below it the run
    directories are): ``outputs/${now:...}/${now:...}_...`` -> (outputs, 2)."""
    head, _, tail = pattern.partition("${")
    root = Path(head) if head.endswith("/") or not head else Path(head).parent
    return root, ("${" + tail).count("/") + 1


def _run_dirs(root: Path, depth: int) -> list[Path]:
    if not root.is_dir():
        return []
    return [
        p.parent.parent for p in root.glob("/".join(["*"] * depth + [".hydra", "overrides.yaml"]))
    ]


def _recorded(run_dir: Path) -> list[str]:
    try:
        return [str(o) for o in OmegaConf.load(run_dir / ".hydra" / "overrides.yaml")]
    except Exception:  # unreadable or not YAML (OmegaConf's parser errors vary): not a match
        return ["<unreadable>"]


def _has_checkpoint(run_dir: Path) -> bool:
    checkpoints = run_dir / CHECKPOINT_DIR
    return (checkpoints / LATEST).is_file() or (checkpoints / BEST).is_file()


def _completed(run_dir: Path) -> bool:
    try:
        return json.loads((run_dir / REPORT_JSON).read_text())["status"] == "completed"
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _age(run_dir: Path) -> float:
    return (run_dir / ".hydra" / "overrides.yaml").stat().st_mtime
