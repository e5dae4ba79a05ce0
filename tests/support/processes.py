"""The ``mptrain`` command line as a subprocess (:func:`run_mptrain`, :func:`run_command`), what
it printed (:func:`describe`), and signals sent to a process at a chosen call
(:func:`signals_on_call`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

SUBPROCESS_TIMEOUT_S = 180


def run_command(
    cwd: Path, *command: str, timeout: float = SUBPROCESS_TIMEOUT_S, env: dict | None = None
) -> subprocess.CompletedProcess:
    """Run a command in ``cwd``; no HYDRA_FULL_ERROR (tracebacks) and no inherited terminal size;
    ``env``: variables set on top of this process's environment."""
    drop = ("HYDRA_FULL_ERROR", "COLUMNS", "LINES")
    env = {k: v for k, v in os.environ.items() if k not in drop} | (env or {})
    return subprocess.run(
        list(command),
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,  # no terminal anywhere: rich's default width, not the tty's
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_mptrain(
    cwd: Path, *args: str, timeout: float = SUBPROCESS_TIMEOUT_S
) -> subprocess.CompletedProcess:
    """``python -m mptrain *args`` in ``cwd`` (see :func:`run_command`)."""
    return run_command(cwd, sys.executable, "-m", "mptrain", *args, timeout=timeout)


def describe(result: subprocess.CompletedProcess) -> str:
    return f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"


# ------------------------------------------------------------------- signals, in-process
def signals_on_call(monkeypatch, owner, name: str, at_call: int, *sigs: int) -> list[int]:
    """Raise ``sigs`` (real signals, to this process) inside ``owner.name`` on its
    ``at_call``-th call, before it does its work; returns the list its calls are counted in."""
    real, calls = getattr(owner, name), []

    def signalled(*args, **kwargs):
        calls.append(1)
        if len(calls) == at_call:
            for sig in sigs:
                signal.raise_signal(sig)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, signalled)
    return calls
