"""The console script: ``mptrain [overrides]``, ``python -m mptrain``, and the subcommands.

:func:`main` answers ``--version``, ``--help`` and ``COMMAND --help`` from the shipped files (no
config composed, no torch: :mod:`mptrain.cli.usage`), refuses any argument that is neither a Hydra
flag nor an override in one line (:mod:`mptrain.cli.arguments`), hands ``bench``, ``advise``,
``eval`` and ``sample`` to their command (:data:`_SUBCOMMANDS`), and otherwise checks every job
before any trains (:mod:`mptrain.cli.preflight`), runs them on the preflight's Hydra instance
(:mod:`mptrain.cli.launch`) and, after a sweep, reads every job's report: a job that did not
complete makes the exit code 1, whichever launcher ran it. The path from here to a training step:
ARCHITECTURE.md, "The path of a run".

Exit codes: 0 all jobs completed, 1 a job failed or diverged, 2 bad input, 130 interrupted (SIGINT),
143 terminated (SIGTERM, from the moment the process starts).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import importlib
import os
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import hydra
from hydra._internal.utils import run_and_report

from mptrain import __version__
from mptrain.cli.arguments import hydra_argv
from mptrain.cli.launch import fail, launch, run_job
from mptrain.cli.preflight import (
    CONFIG_MODULE,
    CONFIG_NAME,
    HYDRA_VERSION_BASE,
    check_jobs,
    hold_sweep_dir,
    hydra_like_main,
    parse_command_line,
)
from mptrain.cli.registry import register_configs
from mptrain.config.base import ConfigError
from mptrain.platform.launch import global_rank
from mptrain.platform.signals import Terminated, terminate_like_interrupt

# Hydra's own command line for what is not a run: --help, --hydra-help, --cfg, --info, completion.
hydra_app = hydra.main(
    config_path=f"pkg://{CONFIG_MODULE}", config_name=CONFIG_NAME, version_base=HYDRA_VERSION_BASE
)(run_job)


def main(argv: Sequence[str] | None = None) -> None:
    """Console-script entry point (``mptrain``) and ``python -m mptrain``; ``argv`` (instead of
    the process's command line) when called from Python."""
    with _exit_codes(final=argv is None):
        argv = list(sys.argv[1:] if argv is None else argv)
        terminate_like_interrupt()  # SIGTERM during setup ends the run like Ctrl-C (report, 143)
        if _answered_from_files(argv) or _ran_subcommand(argv):
            return
        args = _run_arguments(argv)
        if args.hydra_help or args.cfg or args.info or args.shell_completion:
            hydra_app()
            return
        launched = time.time()
        with hydra_like_main(args) as hydra, contextlib.ExitStack() as held:
            try:
                checked = check_jobs(hydra, args)
                if checked.multirun:  # held until this sweep's jobs are judged
                    note = held.enter_context(hold_sweep_dir(Path(checked.output_dir)))
                    if note:
                        print(f"mptrain: note: {note}", file=sys.stderr)
            except ConfigError as exc:
                fail(str(exc))
            sweep_dir = Path(checked.output_dir)
            failed = functools.partial(_every_job_failed, sweep_dir, launched)
            run_and_report(launch(hydra, args, checked, failed))  # Hydra's error report
            if checked.multirun:
                _exit_if_jobs_failed(sweep_dir, launched)


@contextlib.contextmanager
def _exit_codes(final: bool) -> Iterator[None]:
    """Ctrl-C or SIGTERM outside a run's own handling: one line and exit 130 (143). ``final``:
    the process ends next, without the interpreter's final garbage collections."""
    sys.stdout = _ClosedPipeSafe(sys.stdout)
    try:
        yield
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM (Terminated)
        print("mptrain: interrupted", file=sys.stderr)
        raise SystemExit(exc.exit_code if isinstance(exc, Terminated) else 130) from None
    finally:
        if final:  # out of the collector's reach: the OS takes the memory back (BENCHMARKS.md)
            gc.freeze()  # atexit handlers (logging, multiprocessing, finalizers) still run
    sys.stdout.flush()  # here, not at interpreter exit, where a closed pipe prints a traceback


def _run_arguments(argv: list[str]) -> argparse.Namespace:
    """Hydra's parse of a training command line (one line and exit 2 for a bad argument), with
    ``sys.argv`` set for Hydra's app, which parses it again and wants its flags first."""
    if global_rank() > 0:
        # Ranks other than 0 (torchrun, a SLURM job step): Hydra must not write a second
        # config/log copy.
        argv = [
            *argv,
            "hydra.output_subdir=null",
            "hydra/job_logging=disabled",
            "hydra/hydra_logging=disabled",
        ]
    try:
        args = parse_command_line(argv)
    except ConfigError as exc:
        fail(str(exc))
    sys.argv = [sys.argv[0], *hydra_argv(argv, args.overrides)]
    return args


class _ClosedPipeSafe:
    """stdout that goes quiet when its reader went away (``mptrain --help | head``, a ``| tee``
    that died): the rest of the output goes to /dev/null and the command carries on, so a run
    still finishes, checkpoints and writes its report (a BrokenPipeError would end it, or print a
    traceback from Hydra's handler)."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self.reader_gone = False  # what only produces output (mptrain sample) may stop then

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._give_up()
        return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._give_up()

    def _give_up(self) -> None:
        self.reader_gone = True
        os.dup2(os.open(os.devnull, os.O_WRONLY), self._stream.fileno())
        self._stream = open(os.devnull, "w")  # noqa: SIM115 (lives as long as the process)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


# Commands that are not a training run: name -> (module, function taking the remaining arguments),
# imported only when asked for.
_SUBCOMMANDS = {
    "bench": ("mptrain.commands.bench", "bench_main"),
    "advise": ("mptrain.commands.advise.run", "advise_main"),
    "eval": ("mptrain.commands.evaluate", "eval_main"),
    "sample": ("mptrain.commands.sample", "sample_main"),
}


def _positional_run(argv: list[str]) -> list[str]:
    """A command's arguments, ``mptrain eval RUN`` / ``mptrain sample RUN`` (the habit of most
    tools) read as ``resume=RUN``: a first word that is neither an override nor a flag."""
    command, rest = argv[0], argv[1:]
    takes_a_run = command in ("eval", "sample")
    if takes_a_run and rest and "=" not in rest[0] and not rest[0].startswith(("-", "+", "~")):
        return [f"resume={rest[0]}", *rest[1:]]
    return rest


def _ran_subcommand(argv: list[str]) -> bool:
    """Run ``mptrain COMMAND ...`` for a command of :data:`_SUBCOMMANDS` (True); False for a
    training command line. Bad input: one line and exit 2."""
    register_configs()
    if not (argv[:1] and argv[0] in _SUBCOMMANDS):
        return False
    module, function = _SUBCOMMANDS[argv[0]]
    try:
        getattr(importlib.import_module(module), function)(_positional_run(argv))
    except ConfigError as exc:
        fail(str(exc))
    return True


def _answered_from_files(argv: list[str]) -> bool:
    """Answer ``--version``, ``--help`` and ``COMMAND --help`` (True), without composing a config
    or importing torch (:mod:`mptrain.cli.usage`); False for any other command line."""
    from mptrain.cli.usage import command_help, usage_text

    if argv[:1] and argv[0] in _SUBCOMMANDS:
        if not {"-h", "--help"} & set(argv[1:]):
            return False
        print(command_help(argv[0]))
        return True
    if "--version" in argv:  # Hydra's parser would print Hydra's version
        print(f"mptrain {__version__} (Hydra {hydra.__version__})")
        return True
    if not {"-h", "--help"} & set(argv):
        return False
    try:
        args = parse_command_line(argv)  # an unknown argument is refused even here
    except ConfigError as exc:
        fail(str(exc))
    print(usage_text(args.config_dir))
    return True


def _every_job_failed(sweep_dir: Path, launched: float, exc: Exception) -> bool:
    """After the sweeper raised ``exc``: when every job of this sweep had failed (an Optuna
    search with no completed trial has no best value), say so in one line and write the sweep's
    summary, which Hydra's end-of-sweep callback never got to; True then (the jobs' failures
    follow). False for any other sweeper error, which Hydra reports with its traceback."""
    from mptrain.commands.sweep import write_sweep_summary

    runs = _this_sweeps_runs(sweep_dir, launched)
    if not runs or any(run.report and run.report.status == "completed" for run in runs):
        return False
    why = " ".join(str(exc).split()) or "no message"
    print(
        f"mptrain: error: every job of the sweep failed, and then the sweeper stopped "
        f"({type(exc).__name__}: {why})",
        file=sys.stderr,
    )
    write_sweep_summary(sweep_dir, launched)
    return True


def _exit_if_jobs_failed(sweep_dir: Path, launched: float) -> None:
    """Exit 1 naming each job of this launch that did not complete, as
    :func:`mptrain.commands.runs.this_sweeps_runs` judges the jobs written since ``launched``
    (a refused job is never credited with an earlier run's report)."""
    failed = [
        f"{run.directory}: {run.reason or f'{run.report.status}: {run.report.reason}'}"
        for run in _this_sweeps_runs(sweep_dir, launched)
        if run.report is None or run.report.status != "completed"
    ]
    if failed:
        print(f"mptrain: {len(failed)} job(s) did not complete:", file=sys.stderr)
        for line in failed:
            print(f"  {line}", file=sys.stderr)
        raise SystemExit(1)


def _this_sweeps_runs(sweep_dir: Path, launched: float) -> list[Any]:
    """:func:`mptrain.commands.runs.this_sweeps_runs`; none when no job wrote anything."""
    from mptrain.commands.runs import this_sweeps_runs

    try:
        return this_sweeps_runs(sweep_dir, launched)
    except FileNotFoundError:
        return []
