"""Hydra's launcher and sweeper plugins by the option that selects them, and the package that
installs each: ``hydra/launcher=joblib`` without hydra-joblib-launcher installed is answered with
what to install, not with "choose one of basic" (Hydra lists only the plugins it finds).

Optuna (``hydra/sweeper=optuna``) colours its log lines on stderr whatever stderr is: optuna 2's
handler formats with a ``colorlog.ColoredFormatter`` that is not told its stream, so a pipe or a
file gets ANSI escape codes. Importing this module (the command line does, before Hydra starts a
sweeper) gives that formatter its handler's stream: colours on a terminal only (colorlog's
``NO_COLOR`` and ``FORCE_COLOR`` still apply). Optuna itself is not imported for it.
"""

from __future__ import annotations

import logging
import re

# (group, option) -> the PyPI package that provides it (the plugins of Hydra's own repository).
PLUGIN_PACKAGES = {
    ("hydra/launcher", "joblib"): "hydra-joblib-launcher",
    ("hydra/launcher", "submitit_local"): "hydra-submitit-launcher",
    ("hydra/launcher", "submitit_slurm"): "hydra-submitit-launcher",
    ("hydra/launcher", "ray"): "hydra-ray-launcher",
    ("hydra/launcher", "ray_aws"): "hydra-ray-launcher",
    ("hydra/launcher", "rq"): "hydra-rq-launcher",
    ("hydra/sweeper", "optuna"): "hydra-optuna-sweeper",
    ("hydra/sweeper", "ax"): "hydra-ax-sweeper",
    ("hydra/sweeper", "nevergrad"): "hydra-nevergrad-sweeper",
}
# Extras that bundle everything for working on mptrain, not a feature a user would ask for.
_DEVELOPER_EXTRAS = ("test", "dev")


def missing_plugin_hint(group: str, option: str) -> str | None:
    """What to install for ``group=option`` when it names a plugin Hydra did not find: the
    package, and mptrain's extra that installs it where there is one; None for any other option."""
    package = PLUGIN_PACKAGES.get((group, option))
    if package is None:
        return None
    kind = group.removeprefix("hydra/")
    hint = f"{group}={option}: Hydra's {option} {kind} is not installed; pip install {package}"
    extra = _extra_installing(package)
    return f'{hint} (or pip install "mptrain[{extra}]")' if extra else hint


def _extra_installing(package: str) -> str | None:
    """The extra of the installed mptrain whose requirements name ``package`` (developer extras
    left out), from the package's metadata (pyproject.toml's optional-dependencies)."""
    from importlib.metadata import PackageNotFoundError, requires

    try:
        requirements = requires("mptrain") or []
    except PackageNotFoundError:  # run from a source tree that was never installed
        return None
    for requirement in requirements:
        name = re.split(r"[\s;<>=!~\[]", requirement, maxsplit=1)[0]
        extra = re.search(r"""extra\s*==\s*["']([^"']+)["']""", requirement)
        if name.lower() == package and extra and extra[1] not in _DEVELOPER_EXTRAS:
            return extra[1]
    return None


# ---------------------------------------------------------------------- Optuna's colours in pipes
OPTUNA_LOGGER = "optuna"  # optuna's library root logger: its one handler is added here


def colour_on_terminals_only(handler: logging.Handler) -> None:
    """A colorlog formatter of ``handler`` that does not know its stream is told it: colorlog
    then writes no escape codes to a stream that is not a terminal. Other handlers: unchanged."""
    formatter, stream = handler.formatter, getattr(handler, "stream", None)
    is_colorlog = type(formatter).__module__.startswith("colorlog")
    if stream is not None and is_colorlog and getattr(formatter, "stream", False) is None:
        formatter.stream = stream  # type: ignore[union-attr]


class _OptunaRootLogger(logging.Logger):
    """Optuna's root logger: every handler added to it colours on a terminal only."""

    def addHandler(self, hdlr: logging.Handler) -> None:
        colour_on_terminals_only(hdlr)
        super().addHandler(hdlr)


def optuna_colour_on_terminals_only() -> None:
    """Have Optuna's log handler colour on a terminal only (see the module docstring): its
    logger is made an :class:`_OptunaRootLogger` before optuna makes it, or, when it already
    exists (optuna imported first), its handlers are mended now."""
    existing = logging.Logger.manager.loggerDict.get(OPTUNA_LOGGER)
    if isinstance(existing, logging.Logger):
        for handler in existing.handlers:
            colour_on_terminals_only(handler)
        return
    previous = logging.getLoggerClass()
    logging.setLoggerClass(_OptunaRootLogger)
    try:
        logging.getLogger(OPTUNA_LOGGER)
    finally:
        logging.setLoggerClass(previous)


optuna_colour_on_terminals_only()
