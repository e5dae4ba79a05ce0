"""A run owns its directory: one run at a time, and never over another run's checkpoints.

- :class:`RunDirLock`: ``<run dir>/.mptrain.lock`` holds the owner's pid, host and start time,
  created with ``O_CREAT | O_EXCL`` (atomic). A second run in the directory is refused with one
  line naming the holder; a lock left by a process that no longer exists on this host is stale:
  it is reported and taken over. A lock held from another host cannot be checked and is refused.
- :func:`check_no_other_run`: a fresh run (no ``resume``) refuses a directory that holds another
  run's checkpoints, unless ``overwrite=true`` (then those checkpoints are deleted, and the run
  says so).
"""

from __future__ import annotations

import datetime as dt
import errno
import json
import os
import socket
import tempfile
from pathlib import Path
from types import TracebackType

from mptrain.checkpoint import CHECKPOINT_DIR, LATEST, candidates
from mptrain.config import ConfigError

LOCK_NAME = ".mptrain.lock"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


class RunDirLock:
    """Exclusive ownership of a run directory for the life of a run (see the module doc).

    ``stale_note`` says whose stale lock was taken over, if any.
    """

    def __init__(self, directory: Path) -> None:
        self.path = directory / LOCK_NAME
        self.stale_note: str | None = None
        self._held = False

    def __enter__(self) -> RunDirLock:
        owner = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started_at": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        }
        for _ in range(2):  # a second try after removing a stale lock
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                self._refuse_or_clear_stale()
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(owner, f)
            self._held = True
            return self
        raise ConfigError(f"run directory {self.path.parent}: could not take the lock {self.path}")

    def _refuse_or_clear_stale(self) -> None:
        try:
            holder = json.loads(self.path.read_text())
            pid, host = int(holder["pid"]), str(holder["host"])
        except (OSError, ValueError, KeyError, TypeError):
            holder, pid, host = {}, None, None
        described = f"pid {pid} on {host}, since {holder.get('started_at', '?')}"
        if pid is not None and host == socket.gethostname() and not _alive(pid):
            self.stale_note = f"took over a stale lock of a run that is gone ({described})"
            self.path.unlink(missing_ok=True)
            return
        if pid is None:
            raise ConfigError(
                f"run directory {self.path.parent}: unreadable lock {self.path}; if no run uses "
                "this directory, delete the file"
            )
        raise ConfigError(
            f"run directory {self.path.parent}: in use by another run ({described}); "
            "choose another hydra.run.dir or wait for it to finish"
        )

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._held:
            self.path.unlink(missing_ok=True)
            self._held = False


NAME_MAX, PATH_MAX = 255, 4096  # Linux limits on one path component and a whole path (bytes)


def check_creatable(path: Path, key: str) -> None:
    """Refuse, before anything runs, a directory that cannot be created or written: an existing
    file, a component or path longer than the file system allows, a read-only or virtual file
    system (/proc). Creates nothing (a probe directory is made and removed in the nearest
    existing ancestor)."""
    too_long = next((p for p in path.parts if len(os.fsencode(p)) > NAME_MAX), None)
    if too_long is not None or len(os.fsencode(str(path.absolute()))) > PATH_MAX:
        what = f"a name of {len(os.fsencode(too_long))} bytes" if too_long else "the path"
        raise ConfigError(
            f"{key}={_short(path)}: {what} is longer than the file system allows "
            f"({NAME_MAX} bytes per name, {PATH_MAX} per path)"
        )
    if path.exists():
        if not path.is_dir():
            raise ConfigError(f"{key}={_short(path)}: exists and is not a directory")
        ancestor = path
    else:
        ancestor = next(p for p in path.absolute().parents if p.exists())
        if not ancestor.is_dir():
            raise ConfigError(f"{key}={_short(path)}: {ancestor} is not a directory")
    try:
        probe = tempfile.mkdtemp(prefix=".mptrain-probe-", dir=ancestor)
        os.rmdir(probe)
    except OSError as exc:
        raise ConfigError(
            f"{key}={_short(path)}: cannot create directories in {ancestor} ({exc.strerror})"
        ) from exc


def _short(path: Path) -> str:
    text = str(path)
    return text if len(text) <= 120 else f"{text[:60]}...{text[-40:]} ({len(text)} characters)"


def check_no_other_run(output_dir: Path, resume: str | None, overwrite: bool) -> str | None:
    """Refuse to start fresh over another run's checkpoints (see the module doc).

    Returns a note when ``overwrite=true`` deleted them, else None.
    """
    directory = output_dir / CHECKPOINT_DIR
    found = candidates(directory) if directory.is_dir() else []
    if resume or not found:
        return None
    if not overwrite:
        raise ConfigError(
            f"run directory {output_dir}: holds another run's checkpoints (newest {found[0].name}); "
            "continue it with resume=auto, or start over with overwrite=true"
        )
    for path in [*found, directory / LATEST, directory / "best.pt"]:
        try:
            path.unlink(missing_ok=True)
        except OSError as exc:
            if exc.errno != errno.ENOENT:
                raise
    return f"overwrite=true: deleted {len(found)} checkpoint(s) of the previous run in {directory}"
