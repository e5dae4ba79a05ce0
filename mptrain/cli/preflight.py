"""Check every job a command line describes before anything trains, the way Hydra will run it.

:func:`check_command_line` builds the same Hydra instance ``@hydra.main`` builds for mptrain's
app (the packaged configs, ``-cp``/``--config-path``, ``-cn``, ``-cd``/``--config-dir``, and the
``hydra.searchpath`` of the composed config, which Hydra's config loader reads itself), composes
the master config as Hydra does, and then each job's config with Hydra's own
``load_sweep_config``:

- under the basic sweeper (the default), every job it will launch: the ``hydra.sweeper.params``
  of the config and the command line's sweeps, expanded by ``BasicSweeper.split_arguments`` with a
  parser that has the config loader (``glob(...)`` lists the options of the user's search path);
- under any other sweeper (Optuna, Ax, Nevergrad, ...), which chooses its jobs while it runs, the
  config with the sweep's fixed values only. Each job is checked again in the task
  (:func:`mptrain.cli.launch.run_job`), and a bad one fails that job, not the sweep.

Bad input raises :class:`~mptrain.config.base.ConfigError` with one line naming the key, so it stops
the command before a job has trained (exit code 2).
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mptrain.cli.arguments import parse_arguments
from mptrain.cli.plugins import missing_plugin_hint
from mptrain.cli.registry import to_run_config
from mptrain.cli.resume import resume_auto_dir
from mptrain.config.base import ConfigError
from mptrain.config.options import PRECISION_ALIASES
from mptrain.config.recipes import check_recipe_source
from mptrain.config.spelling import did_you_mean, suggest_option
from mptrain.output.trackers import check_tracking_server
from mptrain.platform.launch import global_rank, launch_tasks, restart_count, resume_after_restart
from mptrain.rundir.layout import SWEEP_LOCK_NAME
from mptrain.rundir.lock import RunDirLock, check_creatable, check_run_dir_free

CONFIG_MODULE = "mptrain.conf"
CONFIG_NAME = "config"
HYDRA_VERSION_BASE = "1.3"
BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"
# The module of the task function: Hydra resolves a relative --config-path against it.
APP_MODULE = "mptrain.cli.launch"


@dataclass(frozen=True)
class Preflight:
    """What the checks found: the overrides of each job checked, and whether Hydra will sweep."""

    jobs: list[list[str]]
    multirun: bool
    output_dir: str  # hydra.run.dir, or hydra.sweep.dir of a multirun, as composed here
    record_subdir: str | None = ".hydra"  # hydra.output_subdir: the run's record (cli.record)


def parse_command_line(argv: list[str]) -> argparse.Namespace:
    """Hydra's own parse of an mptrain command line (overrides, -m, -cd, --cfg, ...); ConfigError
    in one line for an argument that is neither a flag nor an override
    (:func:`mptrain.cli.arguments.parse_arguments`)."""
    refuse_huge_numbers(argv)
    return parse_arguments(argv)


def check_command_line(argv: list[str]) -> Preflight:
    """Compose and check every job of a command line as ``mptrain`` receives it (see the module
    doc); ConfigError for the first bad one."""
    args = parse_command_line(argv)
    with hydra_like_main(args) as hydra:
        return check_jobs(hydra, args)


@contextmanager
def hydra_like_main(args: argparse.Namespace) -> Iterator[Any]:
    """The Hydra instance ``@hydra.main`` would create for ``args`` (Hydra's parsed command line);
    cleared again on exit so the app can create its own."""
    from hydra._internal.hydra import Hydra
    from hydra._internal.utils import create_automatic_config_search_path
    from hydra.core.config_search_path import SearchPathQuery
    from hydra.core.global_hydra import GlobalHydra

    config_path = args.config_path if args.config_path is not None else f"pkg://{CONFIG_MODULE}"
    search_path = create_automatic_config_search_path(None, APP_MODULE, config_path)
    if args.config_dir is not None:
        config_dir = os.path.abspath(args.config_dir)
        if not os.path.isdir(config_dir):
            raise ConfigError(f"--config-dir {args.config_dir}: no such directory")
        search_path.prepend(
            provider="command-line",
            path=f"file://{config_dir}",
            anchor=SearchPathQuery(provider="schema"),
        )
    try:
        yield Hydra.create_main_hydra2(task_name="mptrain", config_search_path=search_path)
    finally:
        GlobalHydra.instance().clear()


# Longer numbers than any setting takes; Python refuses to parse integers past 4,300 digits with
# a message that names no key (sys.get_int_max_str_digits), so they are refused here first.
MAX_NUMBER_DIGITS = 100


def refuse_huge_numbers(overrides: list[str]) -> None:
    """ConfigError naming the key of an override whose value is a number of more than
    MAX_NUMBER_DIGITS digits."""
    for override in overrides:
        key, sep, value = override.partition("=")
        digits = value.strip().lstrip("+-")
        if sep and len(digits) > MAX_NUMBER_DIGITS and digits.isdigit():
            raise ConfigError(
                f"{key.lstrip('+~')}={value.strip()[:12]}...: a number of {len(digits):,} digits, "
                f"beyond any setting's range"
            )


def _resolved(master: Any, key: str) -> str:
    """``master``'s value at ``key`` (``hydra.run.dir``), interpolations resolved; an
    interpolation that does not resolve (``${nope}``, ``${oc.env:UNSET}``) is a ConfigError
    naming the key, as for any other key, not OmegaConf's traceback."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        return str(OmegaConf.select(master, key, throw_on_missing=True))
    except OmegaConfBaseException as exc:
        raise ConfigError(f"{key}: {str(exc).splitlines()[0]}") from exc


def _check_one_dir_for_all_ranks(pattern: str) -> None:
    """Several ranks (torchrun, a SLURM job step) must write into one run directory, and a
    restarted attempt must find it again: a dated ``hydra.run.dir`` would give each its own."""
    if "${" in pattern and launch_tasks() > 1:
        raise ConfigError(
            f"hydra.run.dir={pattern}: {launch_tasks()} ranks need one run directory they all "
            "agree on (and a restarted attempt finds again); give hydra.run.dir=DIR"
        )


def _check_launcher_needs_sweep(overrides: list[str]) -> None:
    """Hydra uses a launcher for sweeps only: without ``-m`` it would run one process here and
    say nothing (a SLURM job never submitted)."""
    named = next((o for o in overrides if o.lstrip("+~").startswith("hydra/launcher=")), None)
    if named is not None:
        raise ConfigError(
            f"{named}: Hydra's launchers start the jobs of a sweep; add -m (a sweep of one job "
            f"is fine: mptrain -m {named} ...)"
        )


def check_jobs(hydra: Any, args: argparse.Namespace) -> Preflight:
    """:func:`check_command_line` on ``hydra``, the instance :func:`hydra_like_main` made for
    ``args``."""
    from omegaconf import OmegaConf

    overrides = list(args.overrides)
    config_name = args.config_name or CONFIG_NAME
    master, multirun = _master_config(hydra, config_name, overrides, bool(args.multirun))
    key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    output = Path(_resolved(master, key))
    record = master.hydra.output_subdir  # read first: the checks below drop hydra's node
    pattern = str(OmegaConf.to_container(master.hydra.run, resolve=False)["dir"])
    check_creatable(output, key)  # Hydra creates it next, with a traceback if it cannot
    if not multirun:
        _check_launcher_needs_sweep(overrides)
        run = checked_run_config(master)
        check_recipe_source(run)  # a recipe given other data: refused before Hydra's directory
        _check_one_dir_for_all_ranks(pattern)
        # A restarted attempt (torchrun --max-restarts, SLURM's requeue) continues its own run.
        resume = resume_after_restart(run.resume, restart_count())
        if resume == "auto":  # the same command continues the run it started
            try:
                output = resume_auto_dir(pattern, overrides) or output
            except ConfigError:  # a restart that finds none (no checkpoint yet) starts over here
                if run.resume is not None:  # the user's own resume=auto
                    raise
        check_tracking_server(run)  # before the run directory is touched (seconds, not minutes)
        if global_rank() == 0:
            # Before Hydra rewrites the directory's .hydra/ record of another run.
            check_run_dir_free(output, resume, run.overwrite)
        return Preflight([overrides], False, str(output), record)
    _check_sweeper(master.hydra.sweeper, str(master.get("task", "classify")))
    jobs = _job_overrides(hydra, master, overrides)
    # Only the basic sweeper's job directories are known before it runs (see the module doc).
    known_dirs = master.hydra.sweeper._target_ == BASIC_SWEEPER
    for number, job in enumerate(jobs):
        composed = _composed(lambda job=job: hydra.config_loader.load_sweep_config(master, job))
        job_dir = _check_job_dir(composed, output, number)  # first: the next drops hydra's node
        run = checked_run_config(composed)
        check_recipe_source(run)
        check_tracking_server(run)
        if known_dirs and global_rank() == 0:
            # A sweep into a directory an earlier sweep used: each job's directory follows the
            # rules of a run's, before Hydra rewrites an earlier job's .hydra/ record there.
            try:
                resume = resume_after_restart(run.resume, restart_count())
                check_run_dir_free(job_dir, resume, run.overwrite)
            except ConfigError as exc:
                raise ConfigError(f"{exc}; or give this sweep its own hydra.sweep.dir") from exc
    return Preflight(jobs, True, str(output), record)


@contextmanager
def hold_sweep_dir(sweep_dir: Path) -> Iterator[str | None]:
    """Hold ``sweep_dir`` for a sweep's life (a :class:`~mptrain.rundir.lock.RunDirLock` on its
    own file, created with the directory): a second sweep into it while this one runs is refused
    (ConfigError naming the holder), so neither can take the other's jobs for its own. Yields the
    note of a lock taken over from a sweep that is gone, or None. torchrun ranks other than 0 run
    the same sweep as rank 0 and take nothing."""
    if global_rank() > 0:
        yield None
        return
    sweep_dir.mkdir(parents=True, exist_ok=True)  # check_jobs found it creatable
    with RunDirLock(sweep_dir, SWEEP_LOCK_NAME, kind="sweep", key="hydra.sweep.dir") as lock:
        yield lock.stale_note


def _check_job_dir(composed: Any, sweep_dir: Path, number: int) -> Path:
    """The job's directory (``hydra.sweep.subdir``, by default its number and overrides), which
    must lie below ``sweep_dir`` (:func:`_check_inside_sweep`) and be one the file system can
    hold: many overrides make a name over 255 bytes, and Hydra would stop the sweep with a
    traceback when it creates it."""
    from omegaconf import open_dict

    with open_dict(composed):
        composed.hydra.job.num = number
    subdir = str(composed.hydra.sweep.subdir)
    job_dir = sweep_dir / subdir
    _check_inside_sweep(job_dir, sweep_dir, subdir, list(composed.hydra.overrides.task), number)
    try:
        check_creatable(job_dir, "hydra.sweep.subdir")
    except ConfigError as exc:
        raise ConfigError(
            f"{exc}; shorten it: 'hydra.sweep.subdir=${{hydra.job.num}}' (quoted for the shell), "
            "or name keys to leave out in hydra.job.config.override_dirname.exclude_keys"
        ) from exc
    return job_dir


def _check_inside_sweep(
    job_dir: Path, sweep_dir: Path, subdir: str, overrides: list[str], number: int
) -> None:
    """ConfigError naming the override and the directory when ``job_dir`` resolves (``..``, an
    absolute ``hydra.sweep.subdir``, symbolic links) to anywhere but below ``sweep_dir``.

    Refused rather than renamed: Hydra names a job's directory after the overrides' text, so a
    value such as ``../../x`` climbs out of the sweep, where the job would write over whatever is
    there and its sweep's comparison would never see it; a rename would pick a directory the
    user did not ask for, and the user knows best which key to leave out of the name."""
    # realpath, not Path.resolve: it never raises (a symlink loop, an unreadable ancestor).
    inside, where = Path(os.path.realpath(sweep_dir)), Path(os.path.realpath(job_dir))
    if where != inside and where.is_relative_to(inside):
        return
    culprit = next((o for o in overrides if _climbs(o.partition("=")[2])), None)
    here = Path(os.path.realpath(os.getcwd()))  # shown from here when below it, as a user types
    shown = where.relative_to(here) if where.is_relative_to(here) else where
    if where == inside:
        place = f"hydra.sweep.dir={sweep_dir} itself"
    else:
        place = f"{shown}, outside hydra.sweep.dir={sweep_dir}"
    raise ConfigError(
        f"{culprit or f'hydra.sweep.subdir={subdir}'}: job {number}'s directory would be {place}; "
        "leave the key out of the directory name (hydra.job.config.override_dirname.exclude_keys) "
        "or set 'hydra.sweep.subdir=${hydra.job.num}' (quoted for the shell)"
    )


def _climbs(value: str) -> bool:
    """Whether an override's value, read as a path, leaves the directory it is joined to."""
    return value.startswith("/") or ".." in Path(value).parts


def _master_config(
    hydra: Any, config_name: str, overrides: list[str], multirun: bool
) -> tuple[Any, bool]:
    """(the config Hydra composes before launching, whether it will sweep): ``multirun`` (``-m``),
    or ``hydra.mode: MULTIRUN`` set in a config."""
    from hydra.types import RunMode

    mode = RunMode.MULTIRUN if multirun else RunMode.RUN
    master = _composed(
        lambda: hydra.compose_config(
            config_name, overrides, run_mode=mode, validate_sweep_overrides=False
        )
    )
    if not multirun and master.hydra.mode == RunMode.MULTIRUN:
        return _master_config(hydra, config_name, overrides, multirun=True)
    if not multirun:
        for override in _composed(lambda: _parser(hydra).parse_overrides(overrides)):
            if override.is_sweep_override():
                raise ConfigError(f"{override.input_line}: a sweep; run it with -m (--multirun)")
    return master, multirun


def _parser(hydra: Any) -> Any:
    """Hydra's override parser with the config loader (which ``glob(...)`` needs)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return OverridesParser.create(config_loader=hydra.config_loader)


def _job_overrides(hydra: Any, master: Any, overrides: list[str]) -> list[list[str]]:
    """Each job's overrides as the configured sweeper will launch them (see the module doc)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

    sweeper = master.hydra.sweeper
    params = [f"{k}={v}" for k, v in (sweeper.get("params") or {}).items()]
    parsed = _composed(lambda: _parser(hydra).parse_overrides([*params, *overrides]))
    if sweeper._target_ != BASIC_SWEEPER:
        return [[o.input_line for o in parsed if not o.is_sweep_override()]]
    batches = _composed(lambda: BasicSweeper.split_arguments(parsed, max_batch_size=None))
    return [job for batch in batches for job in batch]


# ------------------------------------------------------------------ one job without Hydra's app
RUN_DIR_OVERRIDE = "hydra.run.dir="


def refuse_hydra_options(overrides: list[str], command: str) -> None:
    """``mptrain bench`` and ``mptrain eval`` are one job without Hydra's launcher: any Hydra
    option or flag other than ``hydra.run.dir`` would be ignored, so it is refused."""
    for override in overrides:
        key = override.partition("=")[0]
        hydra_key = key.startswith("-") or key.lstrip("+~").startswith("hydra")
        if hydra_key and not override.startswith(RUN_DIR_OVERRIDE):
            raise ConfigError(
                f"{override}: mptrain {command} takes config overrides (key=value) and "
                "hydra.run.dir=DIR only"
            )


def subcommand_job(overrides: list[str], command: str) -> tuple[Any, Path]:
    """The checked RunConfig of ``mptrain <command> [overrides]`` (one job, no launcher) and the
    directory it writes to: ``hydra.run.dir=DIR`` when given (parsed and resolved by Hydra:
    quotes, ``${now:...}``), else ``outputs/<command>/<date>/<time>_<model>_<dataset>``."""
    import datetime as dt

    refuse_hydra_options(overrides, command)
    config_overrides = [o for o in overrides if not o.startswith(RUN_DIR_OVERRIDE)]
    check_command_line(config_overrides)
    composed = compose_job(overrides)
    run_dir = composed.hydra.run.dir if len(config_overrides) < len(overrides) else None
    if run_dir == "":
        raise ConfigError(f"hydra.run.dir=: empty; give the directory {command} should write to")
    cfg = checked_run_config(composed)
    if run_dir is not None:
        return cfg, Path(run_dir)
    stamp = dt.datetime.now().strftime("%Y-%m-%d/%H-%M-%S")
    return cfg, Path("outputs") / command / f"{stamp}_{cfg.model.name}_{cfg.dataset.name}"


def compose_job(overrides: list[str]) -> Any:
    """The packaged config composed with ``overrides``, Hydra's node included (for
    ``hydra.run.dir``); ConfigError in one line."""
    from hydra import compose, initialize_config_module

    def composed() -> Any:
        with initialize_config_module(config_module=CONFIG_MODULE, version_base=HYDRA_VERSION_BASE):
            return compose(config_name=CONFIG_NAME, overrides=overrides, return_hydra_config=True)

    return _composed(composed)


# --------------------------------------------------------------------------------- helpers
def _check_sweeper(sweeper: Any, task: str) -> None:
    """An Optuna search must go the way the job's result is better: a job returns its task's
    primary metric (:class:`mptrain.models.task.Task`: classify, the final validation accuracy,
    to maximise; lm, the final validation loss, to minimise)."""
    if "optuna" not in str(sweeper.get("_target_", "")).lower():
        return
    from mptrain.models.task import Task  # torch: only when an Optuna search is checked

    best = Task(task)
    wanted = "minimize" if best.lower_is_better else "maximize"
    direction = sweeper.get("direction")
    single = isinstance(direction, str) or not isinstance(direction, Sequence)
    directions = [direction] if single else list(direction)  # a multi-objective list
    names = [str(getattr(d, "name", d)).lower() for d in directions]  # Direction enums or strings
    if names != [wanted]:
        raise ConfigError(
            f"hydra.sweeper.direction={','.join(names)}: an mptrain job of task={task} returns its "
            f"{best.primary_metric.replace('_', ' ')} ({'lower' if best.lower_is_better else 'higher'}"
            f" is better); add hydra.sweeper.direction={wanted}"
        )


def checked_run_config(cfg: Any) -> Any:
    """The job's typed RunConfig (Hydra's own node removed), or ConfigError in one line."""
    from omegaconf import open_dict

    with open_dict(cfg):
        del cfg["hydra"]
    return _composed(lambda: to_run_config(cfg))


def _composed(compose: Any) -> Any:
    """``compose()``, with any Hydra/OmegaConf error turned into a one-line ConfigError."""
    try:
        return compose()
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError(describe_compose_error(exc)) from exc


def describe_compose_error(exc: Exception) -> str:
    """One line for a Hydra/OmegaConf composition error, naming the key and what is accepted."""
    from dataclasses import is_dataclass

    from hydra.errors import MissingConfigException, OverrideParseException
    from omegaconf.errors import (
        ConfigAttributeError,
        ConfigKeyError,
        OmegaConfBaseException,
        ValidationError,
    )

    from mptrain.cli.registry import unknown_key_message

    if isinstance(exc, MissingConfigException) and exc.options is not None:
        group, _, option = (exc.missing_cfg_file or "?").rpartition("/")
        return _unknown_option(group, option, [o for o in exc.options if not o.endswith("_schema")])
    if isinstance(exc, OverrideParseException):
        return f"cannot parse override: {str(exc).splitlines()[0]}{_quoting_hint(exc.override)}"
    cause = exc.__cause__ if isinstance(exc.__cause__, OmegaConfBaseException) else exc
    if isinstance(cause, OmegaConfBaseException):
        key = getattr(cause, "full_key", None) or "?"
        if isinstance(cause, ConfigKeyError | ConfigAttributeError):
            schema = getattr(cause, "object_type", None)
            # Hydra names the override ("Could not override 'trainer.max_epochs'") where
            # OmegaConf names only its first unknown part (trainer): the suggestion needs it all.
            typed = re.search(r"Could not override '([^']+)'", str(exc))
            return unknown_key_message(
                key, schema if is_dataclass(schema) else None, typed[1] if typed else key
            )
        if isinstance(cause, ValidationError):
            message = str(cause.msg).splitlines()[0] if hasattr(cause, "msg") else str(cause)
            return f"{key}: {message}"
        return f"{key}: {str(cause).splitlines()[0]}"
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return " ".join(lines) if lines else type(exc).__name__


def _unknown_option(group: str, option: str, options: list[str]) -> str:
    """One line for ``group=option`` that Hydra found no config for: the plugin to install
    (``hydra/launcher=joblib``), or the nearest spelling and the options (aliases, such as
    Lightning's precision names, are suggested but not listed)."""
    hint = missing_plugin_hint(group, option)
    if hint is not None:
        return hint
    listed = ", ".join(sorted(o for o in options if o not in PRECISION_ALIASES))
    suggestion = did_you_mean(suggest_option(option, options))
    return f"{group}={option}: unknown option{suggestion}; choose one of {listed}"


def _quoting_hint(override: str) -> str:
    """How to quote ``override`` when Hydra's lexer refused it for its non-ASCII characters
    (Hydra reads unquoted values as ASCII only); "" otherwise."""
    key, sep, value = override.partition("=")
    if not sep or value.isascii() or value[:1] in ("'", '"'):
        return ""
    quoted = value.replace("\\", "\\\\").replace('"', '\\"')
    return (
        f"; a value with non-ASCII characters must be quoted for Hydra, and the quotes for the "
        f"shell: '{key}=\"{quoted}\"'"
    )
