"""The command line: Hydra's app and the subcommands.

``mptrain [overrides]`` and ``python -m mptrain [overrides]`` run :func:`main`, which answers
``--version``, ``--help`` and ``COMMAND --help`` from the shipped files (no config composed, no
torch: :mod:`mptrain.compose.usage`), refuses any argument that is neither a Hydra flag nor an
override in one line (:mod:`mptrain.compose.arguments`), and otherwise

1. checks every job the command line describes, composed the way Hydra will compose it
   (:mod:`mptrain.compose.preflight`: the user's config directory and search path, each sweeper's jobs),
   so bad input stops before anything trains with one line naming the key and what is accepted
   (exit code 2), and pins the output directory it checked;
2. runs the jobs on the preflight's Hydra instance (:func:`mptrain.compose.preflight.launch`), whose task
   (:func:`run_job`) converts the composed config into a typed
   :class:`~mptrain.config.run.RunConfig` (relative paths taken from the launch directory) and calls
   :func:`mptrain.train.job.train` with the job's output directory;
3. after a sweep, reads every job's report: a job that did not complete makes the exit code 1,
   whichever launcher ran it (joblib's worker processes, a cluster).

Exit codes: 0 all jobs completed, 1 a job failed or diverged, 2 bad input, 130 interrupted (SIGINT),
143 terminated (SIGTERM, from the moment the process starts).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig

from mptrain import __version__
from mptrain.compose.arguments import hydra_argv
from mptrain.compose.preflight import (
    CONFIG_MODULE,
    CONFIG_NAME,
    HYDRA_VERSION_BASE,
    check_jobs,
    hold_sweep_dir,
    hydra_like_main,
    launch,
    parse_command_line,
)
from mptrain.compose.record import discard, promote, staged_record
from mptrain.compose.registry import absolute_paths, register_configs, to_run_config
from mptrain.config.base import ConfigError, launch_dir, set_launch_dir
from mptrain.platform.signals import Terminated, terminate_like_interrupt
from mptrain.rundir.command import continue_command
from mptrain.rundir.layout import CHECKPOINT_DIR, LATEST, REPORT_JSON


def _fail(message: str, code: int = 2) -> None:
    print(f"mptrain: error: {message}", file=sys.stderr)
    raise SystemExit(code)


def run_job(cfg: DictConfig) -> float | None:
    """One Hydra job: typed config in, report out. Returns the final value of the task's primary
    metric (what a sweeper such as Optuna optimises: validation accuracy, to maximise; for
    task=lm validation loss, to minimise), or None for a job that did not complete.

    A job of a sweep that fails says so and returns: the sweep goes on, and :func:`main` reads
    every job's report afterwards to set the exit code (a launcher may run jobs in other
    processes, so nothing is kept in this process's memory).
    """
    from hydra.core.hydra_config import HydraConfig

    hydra_cfg = HydraConfig.get()
    output_dir = Path(hydra_cfg.runtime.output_dir)
    multirun = hydra_cfg.mode.name == "MULTIRUN"
    # Hydra's record of the command, staged until the run owns the directory (compose.record).
    record = staged_record(output_dir, hydra_cfg.output_subdir)
    try:
        return _run_job(cfg, output_dir, multirun, record)
    finally:
        discard(record)  # still staged: the run never owned the directory


def _run_job(
    cfg: DictConfig, output_dir: Path, multirun: bool, record: Path | None
) -> float | None:
    """:func:`run_job`'s work: train, and turn each outcome into its exit (see there)."""
    from hydra.core.hydra_config import HydraConfig

    from mptrain.output.joblog import record_error
    from mptrain.output.render import write_failure
    from mptrain.platform.threads import sweep_jobs
    from mptrain.train.job import RunFailed, RunInterrupted, train
    from mptrain.train.resume import AlreadyCompleted

    hydra_cfg = HydraConfig.get()
    try:
        # Relative paths are the user's, from where mptrain was launched (hydra.job.chdir=true
        # moves the job into its output directory).
        set_launch_dir(Path(hydra_cfg.runtime.cwd))
        run = absolute_paths(to_run_config(cfg), launch_dir())
        # joblib runs n_jobs jobs at once on this machine: threads=auto divides the cores
        jobs = sweep_jobs(hydra_cfg.launcher.get("n_jobs")) if multirun else 1
        report = train(run, output_dir, on_owned=lambda: promote(record), jobs=jobs)
    except ConfigError as exc:
        if record is None or not record.exists():  # the job owned the directory: its log
            record_error(str(exc))  # says why it holds no run (not an owner's log it was refused)
        if not multirun:
            _fail(str(exc))
        print(f"mptrain: error: {output_dir}: {exc}", file=sys.stderr)
        write_failure(output_dir, str(exc))  # so the sweep summary shows the job and why
        return None
    except RunInterrupted as exc:
        print(f"mptrain: {exc.report.reason} (report in {output_dir})", file=sys.stderr)
        if not multirun and (output_dir / CHECKPOINT_DIR / LATEST).is_file():
            command = continue_command(list(hydra_cfg.overrides.task), output_dir)
            print(f"mptrain: to continue: {command}", file=sys.stderr)
        raise SystemExit(exc.exit_code) from None
    except AlreadyCompleted as exc:
        print(f"mptrain: {exc}")
        # Its report stands as this command's answer (a sweep's summary reads it as this
        # sweep's): touched, its content unchanged.
        with contextlib.suppress(OSError):
            os.utime(output_dir / REPORT_JSON)
        evaluation = exc.report.get("evaluation") or {}
        return evaluation.get(f"final_{evaluation.get('primary_metric')}")
    except RunFailed as exc:
        if not multirun:
            where = f" (report in {output_dir})" if exc.written else ""
            _fail(f"run {exc.status}: {exc.reason}{where}", code=1)
        print(f"mptrain: error: {output_dir}: {exc.status}: {exc.reason}", file=sys.stderr)
        return None
    e = report.evaluation
    return getattr(e, f"final_{e.primary_metric}")  # final_val_accuracy | final_val_loss


# Hydra's own command line for what is not a run: --help, --hydra-help, --cfg, --info, completion.
hydra_app = hydra.main(
    config_path=f"pkg://{CONFIG_MODULE}", config_name=CONFIG_NAME, version_base=HYDRA_VERSION_BASE
)(run_job)


def main(argv: Sequence[str] | None = None) -> None:
    """Console-script entry point (``mptrain``) and ``python -m mptrain``; ``argv`` (instead of
    the process's command line) when called from Python."""
    sys.stdout = _ClosedPipeSafe(sys.stdout)
    try:
        _main(argv)
    except (
        KeyboardInterrupt
    ) as exc:  # Ctrl-C, or SIGTERM (Terminated), outside a run's own handling
        print("mptrain: interrupted", file=sys.stderr)
        raise SystemExit(exc.exit_code if isinstance(exc, Terminated) else 130) from None
    finally:
        if argv is None:  # the process ends next
            _exit_without_final_collections()
    sys.stdout.flush()  # here, not at interpreter exit, where a closed pipe prints a traceback


def _exit_without_final_collections() -> None:
    """Move every live object out of the garbage collector's reach before the interpreter ends.

    Finalising the interpreter runs cyclic collections over every object torch._dynamo and the
    rest created: ~0.8 s of a one-step run here, for memory the OS takes back anyway. atexit
    handlers (logging, multiprocessing, weakref finalizers) still run; files are closed by then.
    """
    import gc

    gc.freeze()


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


def _main(argv: Sequence[str] | None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    terminate_like_interrupt()  # SIGTERM during setup ends the run like Ctrl-C (report, 143)
    if _answered_from_files(argv):
        return
    register_configs()
    if argv[:1] and argv[0] in _SUBCOMMANDS:
        module, function = _SUBCOMMANDS[argv[0]]
        try:
            getattr(importlib.import_module(module), function)(_positional_run(argv))
        except ConfigError as exc:
            _fail(str(exc))
        return
    if int(os.environ.get("RANK", "0")) > 0:
        # torchrun workers other than rank 0: Hydra must not write a second config/log copy.
        argv += [
            "hydra.output_subdir=null",
            "hydra/job_logging=disabled",
            "hydra/hydra_logging=disabled",
        ]
    try:
        args = parse_command_line(argv)
    except ConfigError as exc:
        _fail(str(exc))
    # Hydra's app parses sys.argv again, and wants its flags before the overrides.
    sys.argv = [sys.argv[0], *hydra_argv(argv, args.overrides)]
    if args.hydra_help or args.cfg or args.info or args.shell_completion:
        hydra_app()
        return
    launched = time.time()
    with hydra_like_main(args) as hydra, contextlib.ExitStack() as held:
        try:
            checked = check_jobs(hydra, args)
            if checked.multirun:  # held until this sweep's jobs are judged
                _say_note(held.enter_context(hold_sweep_dir(Path(checked.output_dir))))
        except ConfigError as exc:
            _fail(str(exc))
        if not checked.multirun:
            launch(hydra, args, checked, run_job)
            return
        sweep_dir = Path(checked.output_dir)
        launch(
            hydra, args, checked, run_job, lambda exc: _every_job_failed(sweep_dir, launched, exc)
        )
        _exit_if_jobs_failed(sweep_dir, launched)


def _answered_from_files(argv: list[str]) -> bool:
    """Answer ``--version``, ``--help`` and ``COMMAND --help`` (True), without composing a config
    or importing torch (:mod:`mptrain.compose.usage`); False for any other command line."""
    from mptrain.compose.usage import command_help, usage_text

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
        _fail(str(exc))
    print(usage_text(args.config_dir))
    return True


def _every_job_failed(sweep_dir: Path, launched: float, exc: Exception) -> bool:
    """After the sweeper raised ``exc``: when every job of this sweep had failed (an Optuna
    search with no completed trial has no best value), say so in one line and write the sweep's
    summary, which Hydra's end-of-sweep callback never got to; True then (the jobs' failures
    follow). False for any other sweeper error, which Hydra reports with its traceback."""
    from mptrain.commands.runs import this_sweeps_runs
    from mptrain.commands.sweep import write_sweep_summary

    try:
        runs = this_sweeps_runs(sweep_dir, launched)
    except FileNotFoundError:  # no job wrote anything
        return False
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


def _say_note(note: str | None) -> None:
    if note:
        print(f"mptrain: note: {note}", file=sys.stderr)


def _exit_if_jobs_failed(sweep_dir: Path, launched: float) -> None:
    """Exit 1 naming each job of this launch that did not complete, as
    :func:`mptrain.commands.sweep.this_sweeps_runs` judges the jobs written since ``launched``
    (a refused job is never credited with an earlier run's report)."""
    from mptrain.commands.runs import this_sweeps_runs

    try:
        runs = this_sweeps_runs(sweep_dir, launched)
    except FileNotFoundError:  # no job wrote anything
        runs = []
    failed = [
        f"{run.directory}: {run.reason or f'{run.report.status}: {run.report.reason}'}"
        for run in runs
        if run.report is None or run.report.status != "completed"
    ]
    if failed:
        print(f"mptrain: {len(failed)} job(s) did not complete:", file=sys.stderr)
        for line in failed:
            print(f"  {line}", file=sys.stderr)
        raise SystemExit(1)
