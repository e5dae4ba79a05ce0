"""An ``mptrain`` command line read the way Hydra reads it, with nothing dropped: every argument is
one of Hydra's flags (``-m``, ``-cd DIR``, ``--cfg job``, ...) or an override (``key=value``,
``group=option``, ``+key=value``, ``~key``), in any order; anything else stops the command in one
line (:class:`~mptrain.config.base.ConfigError`, exit code 2) before an override is lost.
"""

from __future__ import annotations

import argparse
import difflib

from mptrain.config.base import ConfigError
from mptrain.config.spelling import suggest_setting

# Commands that are not a training run (mptrain.cli.app._SUBCOMMANDS runs them).
COMMANDS = ("advise", "bench", "eval", "sample")
# What users of other tools type for training itself.
_TRAINING_WORDS = ("fit", "train", "run", "start")


def parse_arguments(argv: list[str]) -> argparse.Namespace:
    """Hydra's parse of ``argv`` (its flags, and the overrides wherever they stand among them);
    ConfigError in one line for an argument that is neither."""
    from hydra._internal.utils import get_args_parser

    args, unknown = get_args_parser().parse_known_intermixed_args(argv)
    flags = [a for a in unknown if a.startswith("-")]
    if flags:
        raise ConfigError(not_an_option(flags[0], _next_value(argv, flags[0])))
    if unknown:  # argparse put aside a word it could not place
        raise ConfigError(f"{unknown[0]}: neither an option nor an override (key=value)")
    for position, override in enumerate(args.overrides):
        if "=" not in override and not override.startswith("~"):
            raise ConfigError(not_an_override(override, first=position == 0))
    return args


def hydra_argv(argv: list[str], overrides: list[str]) -> list[str]:
    """``argv`` with Hydra's flags first and the overrides after them, in their order: the order
    ``@hydra.main``'s own parse accepts (it refuses an override after ``--cfg job``)."""
    flags = list(argv)
    for override in overrides:
        flags.remove(override)
    return [*flags, *overrides]


def not_an_option(flag: str, value: str | None) -> str:
    """One line for ``flag``, which no option of mptrain's is: the override it probably means
    (``--epochs=1`` -> ``epochs=1``) or the option spelled like it (``--verison``)."""
    key, sep, inline = flag.partition("=")
    meant = suggest_setting(key, inline if sep else value)
    if meant is None:
        close = difflib.get_close_matches(key, _hydra_flags(), n=1, cutoff=0.75)
        meant = close[0] if close else None
    hint = f"did you mean {meant}?" if meant else "mptrain --help lists the options"
    return f"{flag}: not an option; {hint}"


def not_an_override(word: str, first: bool) -> str:
    """One line for ``word``, an argument without ``=``: an unknown command when it comes first
    (``mptrain fit``), else an override missing its value."""
    if not first:
        return f"{word}: not an override; give key=value (or ~key to delete a key)"
    if word.lower() in _TRAINING_WORDS:  # Lightning's fit, other tools' train: no word here
        return (
            f"unknown command '{word}'; mptrain trains without one: mptrain key=value ... "
            f"(e.g. mptrain model=mlp epochs=5); commands are {', '.join(COMMANDS)}"
        )
    if word.lower() in ("compare", "diff"):
        return (
            f"unknown command '{word}'; runs are compared by mptrain-compare RUN_OR_SWEEP_DIR ... "
            "(its own command); a sweep (mptrain -m) writes its comparison itself"
        )
    close = difflib.get_close_matches(word.lower(), COMMANDS, n=1, cutoff=0.6)
    meant = f"did you mean {close[0]}? " if close else ""
    return (
        f"unknown command '{word}'; {meant}commands are {', '.join(COMMANDS)} "
        "(training takes overrides: mptrain key=value ...)"
    )


def _next_value(argv: list[str], flag: str) -> str | None:
    """The word after ``flag`` when it reads as the flag's value (``--epochs 1``), else None."""
    if "=" in flag:
        return None
    following = argv[argv.index(flag) + 1 : argv.index(flag) + 2]
    if following and not following[0].startswith("-") and "=" not in following[0]:
        return following[0]
    return None


def _hydra_flags() -> list[str]:
    from hydra._internal.utils import get_args_parser

    return [o for action in get_args_parser()._actions for o in action.option_strings]
