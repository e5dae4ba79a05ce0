"""Optuna's log lines (``hydra/sweeper=optuna``) carry ANSI colour codes on a terminal only: a
pipe or a file gets plain text (mptrain.cli.plugins gives optuna's colorlog formatter its
stream)."""

from __future__ import annotations

import io
import logging
import os
import pty
import subprocess
import sys

import pytest
from support.processes import describe, run_mptrain

from mptrain.cli.plugins import colour_on_terminals_only

ESC = "\x1b["
STUDY = "import optuna; optuna.create_study()"


def stderr_of(code: str, stderr: int = subprocess.PIPE) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code],
        stderr=stderr,
        text=True,
        timeout=120,
        check=True,
        env={k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "NO_COLOR")},
    )
    return done.stderr or ""


def test_a_colorlog_formatter_learns_its_handler_s_stream():
    colorlog = pytest.importorskip("colorlog")
    pipe = io.StringIO()  # not a terminal
    handler = logging.StreamHandler(pipe)
    handler.setFormatter(colorlog.ColoredFormatter("%(log_color)s%(message)s%(reset)s"))
    colour_on_terminals_only(handler)
    handler.emit(logging.makeLogRecord({"msg": "plain", "levelno": logging.INFO}))
    assert pipe.getvalue() == "plain\n"
    other = logging.StreamHandler(io.StringIO())
    other.setFormatter(logging.Formatter("%(message)s"))
    colour_on_terminals_only(other)  # not colorlog's: left alone
    assert not hasattr(other.formatter, "stream")


def test_optuna_writes_no_escape_codes_into_a_pipe_whichever_imports_first():
    pytest.importorskip("optuna")
    if ESC not in stderr_of(STUDY):
        pytest.skip("this optuna does not colour pipes")
    for first in ("mptrain.cli.plugins", "optuna, mptrain.cli.plugins"):
        logged = stderr_of(f"import {first}; {STUDY}")
        assert "A new study created" in logged and ESC not in logged, logged


def test_optuna_keeps_its_colours_on_a_terminal():
    pytest.importorskip("optuna")
    main, terminal = pty.openpty()
    try:
        stderr_of(f"import mptrain.cli.plugins; {STUDY}", stderr=terminal)
        written = os.read(main, 65536).decode()
    finally:
        os.close(main)
        os.close(terminal)
    assert "A new study created" in written and ESC in written, written


@pytest.mark.slow
def test_an_optuna_sweep_piped_has_no_escape_codes(tmp_path):
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    search = ("-m", "hydra/sweeper=optuna", "hydra.sweeper.direction=maximize")
    search += ("hydra.sweeper.n_trials=1", "optimizer.lr=interval(1e-4,1e-2)")
    run = ("model=mlp", "max_steps=2", "device=cpu", "progress=false")
    result = run_mptrain(tmp_path, *search, *run)
    assert result.returncode == 0, describe(result)
    assert "A new study created" in result.stderr, describe(result)
    assert ESC not in result.stdout + result.stderr, describe(result)
