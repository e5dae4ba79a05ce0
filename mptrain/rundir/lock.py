"""A run owns its directory: one run at a time (:class:`RunDirLock`, checked before Hydra writes
by :func:`check_run_dir_free`), and never over another run's work (:func:`check_no_other_run`).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import json
import os
import socket
import tempfile
from pathlib import Path

from mptrain.config.base import NAME_MAX, PATH_MAX, ConfigError
from mptrain.rundir.layout import (
    AUDIT_JSON,
    AUDIT_MD,
    BEST,
    CHECKPOINT_DIR,
    LATEST,
    LOCK_NAME,
    METRICS_JSONL,
    PROBE_JSON,
    PROBE_MD,
    REPORT_JSON,
    REPORT_MD,
    RUN_PNG,
    candidates,
)


class RunDirLock:
    """Exclusive ownership of a run directory for the life of a run: a second run there is refused
    in one line naming the holder; a lock left by a run that is gone is taken over.

    An ``flock`` on ``.mptrain.lock``, which the kernel releases when its holder exits, however it
    exits (kill -9 included): no pid guessing, no race between two runs taking over the same stale
    lock. The file names the holder (pid, host, start time) for the refusal message. It is deleted
    on release while still locked; a run that locked the deleted file notices and locks anew.
    ``stale_note`` says whose lock was left behind by a run that is gone, if any.

    A sweep holds its sweep directory the same way, on its own file (``name``; ``kind`` and ``key``
    word the refusal): a job whose directory is the sweep directory still takes its run lock.
    """

    def __init__(
        self,
        directory: Path,
        name: str = LOCK_NAME,
        kind: str = "run",
        key: str = "hydra.run.dir",
    ) -> None:
        self.path = directory / name
        self.kind, self.key = kind, key
        self.stale_note: str | None = None
        self._fd: int | None = None

    def __enter__(self) -> RunDirLock:
        while True:  # until the file we lock is the one at the path (see __exit__)
            fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise _in_use(self.path, self.kind, self.key) from None
            if _same_file(fd, self.path):
                break
            os.close(fd)  # its holder removed it as we opened it: lock the new one
        previous = _holder(self.path, missing="")
        if previous:
            self.stale_note = f"took over the lock of a {self.kind} that is gone ({previous})"
        owner = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started_at": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(owner).encode(), 0)
        self._fd = fd
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            # Removed while still locked (see the class doc). In a directory that became
            # unwritable it stays (the next run takes it over as stale): a failed removal must
            # not hide how the run ended.
            with contextlib.suppress(OSError):
                self.path.unlink(missing_ok=True)
            os.close(self._fd)  # releases the flock
            self._fd = None


def _in_use(path: Path, kind: str, key: str) -> ConfigError:
    return ConfigError(
        f"{kind} directory {path.parent}: in use by another {kind} ({_holder(path)}); choose "
        f"another {key} or wait for it to finish"
    )


def refuse_if_held(path: Path, kind: str = "run", key: str = "hydra.run.dir") -> None:
    """ConfigError naming the holder while another process holds the lock file ``path``. Takes
    nothing and changes nothing: a lock left by a run that is gone stays as it is, for the run
    that takes it over to say so (:attr:`RunDirLock.stale_note`)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise _in_use(path, kind, key) from None
    finally:
        os.close(fd)  # releases the flock if it was taken


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.fstat(fd).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        return False


def _holder(path: Path, missing: str = "holder unknown") -> str:
    """The lock file's owner in words, or ``missing`` when it names none."""
    try:
        owner = json.loads(path.read_text() or "null")
        return f"pid {owner['pid']} on {owner['host']}, since {owner['started_at']}"
    except (OSError, ValueError, KeyError, TypeError):
        return missing


def check_run_dir_free(output_dir: Path, resume: str | None, overwrite: bool) -> None:
    """Before Hydra writes into ``output_dir`` (its .hydra/ record): refuse a directory another
    run holds, or another run's checkpoints a fresh run would overwrite. Takes nothing."""
    if not output_dir.is_dir():
        return
    refuse_if_held(output_dir / LOCK_NAME)
    check_no_other_run(output_dir, resume, overwrite, dry_run=True)


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
    try:
        exists = path.exists()
    except OSError as exc:  # an ancestor that cannot be searched
        raise ConfigError(f"{key}={_short(path)}: cannot look into it ({exc.strerror})") from exc
    if exists:
        if not path.is_dir():
            raise ConfigError(f"{key}={_short(path)}: exists and is not a directory")
        ancestor = path
    else:
        ancestor = next(p for p in path.absolute().parents if os.path.lexists(p))
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


def check_no_other_run(
    output_dir: Path, resume: str | None, overwrite: bool, dry_run: bool = False
) -> str | None:
    """Refuse to start fresh (no ``resume``) over another run's work, unless ``overwrite=true``.

    Another run's work is any of :func:`earlier_run_files`: its checkpoints, ``best.pt`` (a run
    killed before its first periodic checkpoint leaves only that), ``metrics.jsonl`` or its
    report. Returns a note when ``overwrite=true`` deleted them, so the new run's log and report
    hold only its own steps; else None. ``dry_run``: check only, delete nothing.
    """
    found = earlier_run_files(output_dir)
    if resume or not found:
        return None
    if not overwrite:
        names = ", ".join(str(p.relative_to(output_dir)) for p in found[:3])
        more = f" and {len(found) - 3} more" if len(found) > 3 else ""
        raise ConfigError(
            f"run directory {output_dir}: holds another run's checkpoints or results ({names}"
            f"{more}); continue it with resume=auto, or start over with overwrite=true"
        )
    if dry_run:
        return None
    directory = output_dir / CHECKPOINT_DIR
    # Also what the earlier run's diagnostics and quarantine left: a fresh run's audit=false
    # would otherwise leave the old audit.md beside its own report.
    leftovers = [output_dir / name for name in (AUDIT_JSON, AUDIT_MD, PROBE_JSON, PROBE_MD)]
    leftovers += sorted(directory.glob("*.corrupt")) if directory.is_dir() else []
    found += [path for path in leftovers if path.is_file()]
    for path in [*found, directory / LATEST]:
        path.unlink(missing_ok=True)
    steps = [p for p in found if p.parent == directory and p.suffix == ".pt" and p.name != BEST]
    others = [p.name for p in found if p not in steps]
    return (
        f"overwrite=true: deleted {len(steps)} checkpoint(s) of the previous run in {directory}"
        + (f" and its {', '.join(others)}" if others else "")
    )


def earlier_run_files(output_dir: Path) -> list[Path]:
    """What an earlier run left in ``output_dir`` that a fresh run would overwrite or mix with its
    own: step checkpoints (newest first), best.pt, metrics.jsonl, the report and its figure.
    (failure.json is not: a refused job writes only that, and may be run again.)"""
    directory = output_dir / CHECKPOINT_DIR
    found = candidates(directory) if directory.is_dir() else []
    others = (output_dir / name for name in (METRICS_JSONL, REPORT_JSON, REPORT_MD, RUN_PNG))
    return found + [path for path in (directory / BEST, *others) if path.is_file()]


def check_output_dir(output_dir: Path) -> None:
    """Fail before training, not at the first save, when the run directory is not writable."""
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"output directory {output_dir}: cannot create it ({exc.strerror})"
        ) from exc
    if not os.access(output_dir, os.W_OK | os.X_OK):
        raise ConfigError(f"output directory {output_dir}: not writable by this user")
