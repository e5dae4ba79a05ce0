"""The command line: the only place that knows about Hydra.

``mptrain [overrides]`` and ``python -m mptrain [overrides]`` run :func:`main`, which

1. composes the config for every job the command line describes (one, or each job of a ``-m``
   sweep) and validates it, so bad input stops before anything trains with one line naming the
   key and what is accepted (exit code 2);
2. hands over to the Hydra app, whose task converts the composed config into a typed
   :class:`~mptrain.config.RunConfig` and calls :func:`mptrain.run.train` with the job's output
   directory.

Exit codes: 0 all jobs completed, 1 a job failed or diverged, 2 bad input, 130 interrupted (SIGINT),
143 terminated (SIGTERM, from the moment the process starts).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import is_dataclass
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig

from mptrain.config import ConfigError
from mptrain.registry import accepted_keys, register_configs, to_run_config
from mptrain.rundir import check_creatable, check_run_dir_free
from mptrain.signals import Terminated, terminate_like_interrupt

CONFIG_MODULE = "mptrain.conf"
CONFIG_NAME = "config"
HYDRA_VERSION_BASE = "1.3"


def _fail(message: str, code: int = 2) -> None:
    print(f"mptrain: error: {message}", file=sys.stderr)
    raise SystemExit(code)


def describe_compose_error(exc: Exception) -> str:
    """One line for a Hydra/OmegaConf composition error, naming the key and what is accepted."""
    from hydra.errors import MissingConfigException, OverrideParseException
    from omegaconf.errors import (
        ConfigAttributeError,
        ConfigKeyError,
        OmegaConfBaseException,
        ValidationError,
    )

    if isinstance(exc, MissingConfigException) and exc.options is not None:
        missing = exc.missing_cfg_file or "?"
        group, _, option = missing.rpartition("/")
        choices = ", ".join(o for o in sorted(exc.options) if not o.endswith("_schema"))
        return f"{group}={option}: unknown option; choose one of {choices}"
    if isinstance(exc, OverrideParseException):
        return f"cannot parse override: {str(exc).splitlines()[0]}"
    cause = exc.__cause__ if isinstance(exc.__cause__, OmegaConfBaseException) else exc
    if isinstance(cause, OmegaConfBaseException):
        key = getattr(cause, "full_key", None) or "?"
        if isinstance(cause, ConfigKeyError | ConfigAttributeError):
            schema = getattr(cause, "object_type", None)
            accepted = f"; accepted keys: {accepted_keys(schema)}" if is_dataclass(schema) else ""
            return f"{key}: unknown key{accepted}"
        if isinstance(cause, ValidationError):
            message = str(cause.msg).splitlines()[0] if hasattr(cause, "msg") else str(cause)
            return f"{key}: {message}"
        return f"{key}: {str(cause).splitlines()[0]}"
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return " ".join(lines) if lines else type(exc).__name__


def job_overrides(overrides: Sequence[str], multirun: bool) -> list[list[str]]:
    """The override list of every job the command line describes (expanding -m sweeps)."""
    if not multirun:
        return [list(overrides)]
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(list(overrides))
    batches = BasicSweeper.split_arguments(parsed, max_batch_size=None)
    return [job for batch in batches for job in batch]


def preflight(overrides: Sequence[str], multirun: bool) -> int:
    """Compose and validate every job's config, and check that the output directory can be
    created; raise ConfigError for the first bad one. Returns the number of jobs."""
    from hydra import compose, initialize_config_module
    from omegaconf import open_dict

    try:
        jobs = job_overrides(overrides, multirun)
    except Exception as exc:  # parse errors of the sweep syntax
        raise ConfigError(describe_compose_error(exc)) from exc
    with initialize_config_module(config_module=CONFIG_MODULE, version_base=HYDRA_VERSION_BASE):
        for number, job in enumerate(jobs):
            try:
                cfg = compose(config_name=CONFIG_NAME, overrides=job, return_hydra_config=True)
                output = cfg.hydra.sweep.dir if multirun else cfg.hydra.run.dir
                with open_dict(cfg):
                    del cfg["hydra"]
            except Exception as exc:
                raise ConfigError(describe_compose_error(exc)) from exc
            if number == 0:  # Hydra creates it next, with a traceback if it cannot
                key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
                check_creatable(Path(output), key)
            try:
                run = to_run_config(cfg)
            except ConfigError:
                raise
            except Exception as exc:
                raise ConfigError(describe_compose_error(exc)) from exc
            if number == 0 and not multirun and int(os.environ.get("RANK", "0")) == 0:
                # Before Hydra rewrites the directory's .hydra/ record of another run.
                check_run_dir_free(Path(output), run.resume, run.overwrite)
    return len(jobs)


_failed_jobs: list[str] = []


@hydra.main(
    config_path=f"pkg://{CONFIG_MODULE}", config_name=CONFIG_NAME, version_base=HYDRA_VERSION_BASE
)
def hydra_app(cfg: DictConfig) -> float | None:
    """One Hydra job: typed config in, report out. Returns the final validation accuracy."""
    from hydra.core.hydra_config import HydraConfig

    from mptrain.report import write_failure
    from mptrain.run import RunFailed, RunInterrupted, train

    hydra_cfg = HydraConfig.get()
    output_dir = Path(hydra_cfg.runtime.output_dir)
    multirun = hydra_cfg.mode.name == "MULTIRUN"
    try:
        report = train(to_run_config(cfg), output_dir)
    except ConfigError as exc:
        if not multirun:
            _fail(str(exc))
        _failed_jobs.append(f"{output_dir}: {exc}")
        print(f"mptrain: error: {exc}", file=sys.stderr)
        write_failure(output_dir, str(exc))  # so the sweep summary shows the job and why
        return None
    except RunInterrupted as exc:
        print(f"mptrain: {exc.report.reason} (report in {output_dir})", file=sys.stderr)
        raise SystemExit(exc.exit_code) from None
    except RunFailed as exc:
        if not multirun:
            _fail(f"run {exc.status}: {exc.reason} (report in {output_dir})", code=1)
        _failed_jobs.append(f"{output_dir}: {exc.status}: {exc.reason}")
        return None
    return report.evaluation.final_val_accuracy


def _parse_command_line(argv: Sequence[str]) -> tuple[list[str], bool, bool]:
    """(overrides, multirun, handled by Hydra alone: --help, --cfg, --info, ...)."""
    from hydra._internal.utils import get_args_parser

    args, _ = get_args_parser().parse_known_args(list(argv))
    informational = bool(
        args.help or args.hydra_help or args.cfg or args.info or args.shell_completion
    )
    return list(args.overrides), bool(args.multirun), informational


def bench_main(overrides: list[str]) -> None:
    """``mptrain bench [overrides]``: time every precision for the configured model and data.

    Writes bench.md and bench.json to ``outputs/bench/<date>/<time>_<model>_<dataset>``, or to
    ``hydra.run.dir=DIR`` when given (parsed and resolved by Hydra: quotes, ``${now:...}``).
    """
    import datetime as dt

    from hydra import compose, initialize_config_module
    from omegaconf import open_dict
    from rich.console import Console

    from mptrain.bench import run_bench

    try:
        _refuse_hydra_options(overrides)
        config_overrides = [o for o in overrides if not o.startswith(_RUN_DIR)]
        preflight(config_overrides, multirun=False)
        with initialize_config_module(config_module=CONFIG_MODULE, version_base=HYDRA_VERSION_BASE):
            composed = compose(
                config_name=CONFIG_NAME, overrides=overrides, return_hydra_config=True
            )
        run_dir = composed.hydra.run.dir if len(config_overrides) < len(overrides) else None
        if run_dir == "":
            raise ConfigError("hydra.run.dir=: empty; give the directory bench should write to")
        with open_dict(composed):
            del composed["hydra"]
        cfg = to_run_config(composed)
        stamp = dt.datetime.now().strftime("%Y-%m-%d/%H-%M-%S")
        default_dir = Path("outputs") / "bench" / f"{stamp}_{cfg.model.name}_{cfg.dataset.name}"
        output_dir = Path(run_dir) if run_dir is not None else default_dir
        run_bench(cfg, output_dir, cfg.bench.warmup_steps, cfg.bench.steps, Console())
    except ConfigError as exc:
        _fail(str(exc))


_RUN_DIR = "hydra.run.dir="


def _refuse_hydra_options(overrides: list[str]) -> None:
    """bench is one job without Hydra's launcher: any Hydra option or flag other than
    ``hydra.run.dir`` would be ignored, so it is refused."""
    for override in overrides:
        key = override.partition("=")[0]
        if override.startswith(_RUN_DIR):
            continue
        if key.startswith("-") or key.lstrip("+~").startswith("hydra"):
            raise ConfigError(
                f"{override}: mptrain bench takes config overrides (key=value) and "
                "hydra.run.dir=DIR only"
            )


def main(argv: Sequence[str] | None = None) -> None:
    """Console-script entry point (``mptrain``) and ``python -m mptrain``."""
    sys.stdout = _ClosedPipeSafe(sys.stdout)
    try:
        _main(argv)
    except (
        KeyboardInterrupt
    ) as exc:  # Ctrl-C, or SIGTERM (Terminated), outside a run's own handling
        print("mptrain: interrupted", file=sys.stderr)
        raise SystemExit(exc.exit_code if isinstance(exc, Terminated) else 130) from None
    sys.stdout.flush()  # here, not at interpreter exit, where a closed pipe prints a traceback


class _ClosedPipeSafe:
    """stdout that goes quiet when its reader went away (``mptrain --help | head``, a ``| tee``
    that died): the rest of the output goes to /dev/null and the command carries on, so a run
    still finishes, checkpoints and writes its report (a BrokenPipeError would end it, or print a
    traceback from Hydra's handler)."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

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
        os.dup2(os.open(os.devnull, os.O_WRONLY), self._stream.fileno())
        self._stream = open(os.devnull, "w")  # noqa: SIM115 (lives as long as the process)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _main(argv: Sequence[str] | None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    terminate_like_interrupt()  # SIGTERM during setup ends the run like Ctrl-C (report, 143)
    register_configs()
    if argv[:1] == ["bench"]:
        bench_main(argv[1:])
        return
    if argv[:1] == ["eval"]:
        from mptrain.evaluation import eval_main

        try:
            eval_main(argv[1:], describe_compose_error)
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
    overrides, multirun, informational = _parse_command_line(argv)
    if not informational:
        try:
            preflight(overrides, multirun)
        except ConfigError as exc:
            _fail(str(exc))
    sys.argv = [sys.argv[0], *argv]
    hydra_app()
    if _failed_jobs:
        print(f"mptrain: {len(_failed_jobs)} job(s) did not complete:", file=sys.stderr)
        for line in _failed_jobs:
            print(f"  {line}", file=sys.stderr)
        raise SystemExit(1)
