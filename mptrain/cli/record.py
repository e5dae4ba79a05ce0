"""The run's Hydra record (``.hydra/``: config.yaml, hydra.yaml, overrides.yaml), written only
once the run owns its directory.

Hydra writes the record before it calls the job, so a run refused there (another run holds the
directory, a resume with other settings) would overwrite the record of the run that does own it:
the one place a user looks to rebuild that run's command. The launch therefore has Hydra write it
under a staged name (:func:`staged_subdir`: ``.hydra.pending``), and the job moves it into place
when it owns the directory (:func:`promote`: a fresh run once it holds the lock and no other run's
work is there, a resumed one once its checkpoint was accepted) or removes it when it is refused
(:func:`discard`).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from omegaconf import OmegaConf

_PENDING = ".pending"


def staged_subdir(subdir: str | None) -> str | None:
    """The name Hydra writes the record under, for the ``hydra.output_subdir`` the user has
    (``.hydra`` by default); None when the user asked for no record."""
    return None if subdir is None else f"{subdir}{_PENDING}"


def staged_record(output_dir: Path, subdir: str | None) -> Path | None:
    """The staged record of this job (``hydra.output_subdir`` as the job sees it), if staged."""
    if subdir is None or not subdir.endswith(_PENDING):
        return None
    return output_dir / subdir


def promote(staged: Path | None) -> None:
    """Move the staged record into place, replacing an earlier run's (this run owns the directory
    now); hydra.yaml gets the user's ``output_subdir`` back. Idempotent."""
    if staged is None or not staged.is_dir():
        return
    final = staged.with_name(staged.name.removesuffix(_PENDING))
    hydra_yaml = staged / "hydra.yaml"
    if hydra_yaml.is_file():
        record = OmegaConf.load(hydra_yaml)
        record.hydra.output_subdir = final.name
        OmegaConf.save(record, hydra_yaml)
    old = final.with_name(f"{final.name}.old-{os.getpid()}")
    if final.exists():
        final.replace(old)
    staged.replace(final)
    shutil.rmtree(old, ignore_errors=True)


def discard(staged: Path | None) -> None:
    """Remove a record still staged: the job never owned the directory."""
    if staged is not None:
        shutil.rmtree(staged, ignore_errors=True)
