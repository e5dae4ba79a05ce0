"""What command made a run, and the command that continues it.

Hydra records each run's overrides in ``<run dir>/.hydra/overrides.yaml`` (moved into place once
the run owns its directory: :mod:`mptrain.cli.record`). :func:`recorded_overrides` reads them
back; :func:`run_command` is what they say the run runs (the resume settings apart), and
:func:`continue_command` the line to type to continue it, from any directory.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from omegaconf import OmegaConf

HYDRA_RECORD = ".hydra"  # Hydra's hydra.output_subdir, as mptrain's config leaves it
OVERRIDES_YAML = "overrides.yaml"
# Not part of what a command runs: the same command with or without them is the same run.
RESUME_KEYS = ("resume", "resume_allow_changes", "overwrite")


def recorded_overrides(run_dir: Path) -> list[str] | None:
    """The overrides the run in ``run_dir`` was started with; None when Hydra left no record
    there, or one that does not read as YAML."""
    path = run_dir / HYDRA_RECORD / OVERRIDES_YAML
    if not path.is_file():
        return None
    try:
        return [str(o) for o in OmegaConf.load(path)]
    except Exception:  # unreadable or not YAML (OmegaConf's parser errors vary)
        return None


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


def continue_command(overrides: list[str], run_dir: Path) -> str:
    """The command that continues the run in ``run_dir`` started with ``overrides``, quoted for
    a POSIX shell, from any directory: the directory quoted for Hydra's override grammar too
    where it holds characters the grammar reads as structure (``(``, ``,``, ``=``, spaces,
    non-ASCII letters), inside the shell's quotes."""
    directory = hydra_quoted(str(run_dir.absolute()))
    words = [*run_command(overrides), "resume=auto", f"hydra.run.dir={directory}"]
    return " ".join(["mptrain", *map(shlex.quote, words)])


def hydra_quoted(value: str) -> str:
    """``value`` as one string in Hydra's override grammar: as it is when it holds only
    characters an unquoted value may (ASCII letters, digits, ``_ . / : + @ % -``), else in
    single quotes (double quotes, escaped, when it holds a single quote)."""
    if re.fullmatch(r"[\w./:+@%-]+", value, re.ASCII):
        return value
    if "'" not in value:
        return f"'{value}'"
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
