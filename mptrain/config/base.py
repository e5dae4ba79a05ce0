"""What every schema uses: :func:`setting` (a field with its default, help text and range rule,
the one place each lives), the range rules (:class:`Accepts` and the ``*_rule`` makers;
:func:`check_settings` applies them), :class:`ConfigError`, the helpers of the cross-key rules that
stay in each module's ``validate``, the launch directory relative paths are taken from, and
:class:`Option`, the row type of the builder tables.

A value a rule refuses raises :class:`ConfigError` with one line, ``key=value: what is accepted``.
This package imports no torch, and from OmegaConf only its ``MISSING`` marker.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import MISSING as NO_DEFAULT
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A configuration value the user must change. The message is one line naming the key."""


PATH = {"path": True}
# Field metadata of a setting that does not change what a run computes: where the data lives, what
# is shown or logged (trackers too), checkpoint and resume mechanics, diagnostics, the commands
# beside training (comparisons leave such keys out: mptrain.config.keys).
NOT_TRAINING = {"training": False}


@dataclass(frozen=True)
class Accepts:
    """A setting's range rule, on its field: ``test`` of a value that is not None, ``words`` for
    what is accepted (the error's ``key=value: words`` and docs/configuration.md's "accepted"
    column), and whether None (null) is accepted too."""

    test: Callable[[Any], bool]
    words: str
    optional: bool = False

    def check(self, key: str, value: Any) -> None:
        if value is None and self.optional:
            return
        require(value is not None and self.test(value), key, value, self.words)

    def described(self) -> str:
        """What is accepted, for the docs: ``an integer >= 1``, ``> 0 and finite, or null``."""
        words = self.words.removeprefix("must be ")
        return f"{words}, or null" if self.optional and not words.startswith("null") else words


def at_least_rule(minimum: int, *, optional: bool = False) -> Accepts:
    """An integer of at least ``minimum``."""
    return Accepts(lambda v: v >= minimum, f"must be an integer >= {minimum}", optional)


def non_negative_rule(*, optional: bool = False) -> Accepts:
    """A number of at least zero."""
    return Accepts(lambda v: v >= 0, "must be >= 0", optional)


def positive_rule(*, optional: bool = False) -> Accepts:
    """A finite number above zero."""
    return Accepts(lambda v: v > 0 and math.isfinite(v), "must be > 0 and finite", optional)


def in_range_rule(interval: str, more: str = "") -> Accepts:
    """A number in ``interval``, written as in mathematics (``[0, 1)``: 0 included, 1 not); the
    words are ``must be in [0, 1)``, then ``: more`` where given."""
    low, high = (float(end) for end in interval[1:-1].split(","))
    with_low, with_high = interval[0] == "[", interval[-1] == "]"
    return Accepts(
        lambda v: (low < v or (with_low and v == low)) and (v < high or (with_high and v == high)),
        f"must be in {interval}" + (f": {more}" if more else ""),
    )


def one_of_rule(values: tuple[Any, ...], words: str | None = None) -> Accepts:
    """One of ``values`` (``words``: how the error names them; default, listed with commas)."""
    return Accepts(lambda v: v in values, words or f"one of {', '.join(map(str, values))}")


def auto_or_count_rule(words: str) -> Accepts:
    """``auto``, or a whole number of at least 1 (as text: the field is a string)."""
    return Accepts(lambda v: re.fullmatch(r"auto|0*[1-9]\d*", str(v).strip()) is not None, words)


def check_settings(schema: Any, prefix: str = "") -> None:
    """Every field's range rule (:class:`Accepts`, ``setting(..., accepts=...)``) on ``schema``'s
    values, in field order: ConfigError naming ``prefix`` + the field for the first that fails."""
    for f in fields(schema):
        rule = f.metadata.get("accepts")
        if rule is not None:
            rule.check(prefix + f.name, getattr(schema, f.name))


def setting(
    default: Any = NO_DEFAULT,
    help: str = "",
    *,
    accepts: Accepts | None = None,
    factory: Callable[[], Any] | None = None,
    metadata: dict[str, Any] | None = None,
) -> Any:
    """A dataclass field that is a user's setting: its ``default`` (or ``factory`` for a mutable
    one), its ``help``, one line for people, and its range rule (``accepts``, applied by
    :func:`check_settings`), in the field's metadata beside ``metadata`` (:data:`PATH`,
    :data:`NOT_TRAINING`). The help is what ``mptrain COMMAND --help`` prints and
    docs/configuration.md's key table lists with the rule (:mod:`mptrain.config.help`);
    conf/config.yaml holds no default of its own."""
    facts = {"help": help, **(metadata or {})}
    if accepts is not None:
        facts["accepts"] = accepts
    if factory is not None:
        return field(default_factory=factory, metadata=facts)
    return field(default=default, metadata=facts)


_launch_dir: Path | None = None


def set_launch_dir(path: Path) -> None:
    """Record the directory mptrain was launched in (a Hydra job: ``hydra.runtime.cwd``, which
    stays the user's directory when ``hydra.job.chdir=true`` moves the job into its output)."""
    global _launch_dir
    _launch_dir = path


def launch_dir() -> Path:
    """Where relative paths, ``_target_`` modules and the default ``./mlruns`` are looked up: the
    recorded launch directory, else the current one (mptrain used from Python)."""
    return _launch_dir if _launch_dir is not None else Path.cwd()


# ---------------------------------------------------------------------------------- group options
@dataclass(frozen=True)
class Option:
    """A config-group option as a registry lists it: its schema and what builds from it."""

    schema: type
    build: Callable[..., Any]


# ------------------------------------------------------------------------------------- validation
FP32_MAX = 3.4028234663852886e38  # the loss scale is an FP32 tensor
NAME_MAX, PATH_MAX = 255, 4096  # Linux limits on one path component and on a whole path (bytes)


def check_path(key: str, path: str) -> None:
    """A path the file system could hold: no name over NAME_MAX bytes, at most PATH_MAX bytes."""
    longest = max((len(part.encode()) for part in path.split("/")), default=0)
    require(
        longest <= NAME_MAX and len(path.encode()) <= PATH_MAX,
        key,
        path if len(path) <= 80 else f"{path[:40]}...({len(path)} characters)",
        f"longer than the file system allows ({NAME_MAX} bytes per name, {PATH_MAX} per path)",
    )


# A ``_target_``: a dotted import path, ``package.module.Name``.
IMPORT_PATH = Accepts(
    lambda v: re.fullmatch(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)+", v) is not None,
    "a dotted import path such as my_pkg.MyNet (module, then the name in it)",
)


def require(ok: bool, key: str, value: object, accepted: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r}: {accepted}")
