"""User code named by ``_target_``: import it, and call it with the keys its signature takes.

Custom models (``model=custom model._target_=my_pkg.MyNet``) and datasets
(``dataset=custom dataset._target_=my_pkg.make_data``) are built by ``hydra.utils.instantiate``,
as in any Hydra app, except that:

- The launch directory is importable, whichever way mptrain was started (:func:`locate`;
  docs/custom-code.md, "Imports").
- Mistakes are one line: an import that fails, a name that is not there, keys the callable does
  not take, or an exception raised while it runs each become a
  :class:`~mptrain.config.base.ConfigError` naming ``key`` (``model._target_``, ``dataset._target_``).
- Instantiation is not recursive: a ``{_target_: ...}`` node inside the keys is passed as the dict
  it is, never called. A config value is data; only the top ``_target_`` names code.
- A ``_target_`` read from a checkpoint (anyone can write one) is not imported or called unless
  the command line gives it or ``trust_checkpoint_code=true`` (:func:`refuse_checkpoint_code`).
"""

from __future__ import annotations

import importlib
import inspect
import sys
from collections.abc import Callable
from typing import Any

from mptrain.config import base as config
from mptrain.config.base import ConfigError


def first_line(exc: BaseException) -> str:
    """``Type: first line of the message`` (the message alone may be empty)."""
    text = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def locate(key: str, target: str) -> Any:
    """The object ``target`` names (``package.module.Name``), importable from the launch
    directory too (:func:`mptrain.config.base.launch_dir`, appended to ``sys.path``: a local file
    never shadows an installed package); ConfigError naming ``key`` when no module of it imports,
    when importing it fails inside (the user's error, named), or when the module lacks the name."""
    launch_dir = str(config.launch_dir())
    if launch_dir not in sys.path and "" not in sys.path:
        sys.path.append(launch_dir)
    parts = target.split(".")
    for split in range(len(parts) - 1, 0, -1):  # the longest importable module prefix
        module_name = ".".join(parts[:split])
        try:
            found: Any = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name is not None and (
                exc.name == module_name or module_name.startswith(f"{exc.name}.")
            ):
                continue  # this prefix is no module: try a shorter one
            raise _import_error(key, target, exc, launch_dir) from exc
        except Exception as exc:  # the module's own code failed while importing
            raise _import_error(key, target, exc, launch_dir) from exc
        for depth, attribute in enumerate(parts[split:], start=split):
            if not hasattr(found, attribute):
                raise ConfigError(
                    f"{key}={target!r}: {'.'.join(parts[:depth])} has no attribute {attribute!r}"
                )
            found = getattr(found, attribute)
        return found
    raise _import_error(
        key, target, ModuleNotFoundError(f"No module named {parts[0]!r}"), launch_dir
    )


def _import_error(key: str, target: str, exc: BaseException, launch_dir: str) -> ConfigError:
    """Where to put a module that was not found; the error itself for one that failed inside."""
    where = (
        f"; the module must be installed or lie in the launch directory {launch_dir}"
        if isinstance(exc, ModuleNotFoundError)
        else ""
    )
    return ConfigError(f"{key}={target!r}: cannot import it ({first_line(exc)}){where}")


def accepted(call: Callable[..., Any]) -> set[str]:
    """The keyword names ``call`` takes (none known for a builtin without a signature)."""
    try:
        parameters = inspect.signature(call).parameters.values()
    except (TypeError, ValueError):
        return set()
    return {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def offered(
    call: Callable[..., Any], user: dict[str, Any], facts: dict[str, Any]
) -> dict[str, Any]:
    """The arguments ``call`` gets: every ``user`` key, plus each of ``facts`` (the dataset's
    ``num_classes``, ``in_channels``, ...) that its signature names and the user did not set."""
    names = accepted(call)
    return {**user, **{n: v for n, v in facts.items() if n in names and n not in user}}


def check_keys(key: str, target: str, call: Callable[..., Any], kwargs: dict[str, Any]) -> None:
    """ConfigError naming ``key`` when ``call`` cannot take ``kwargs`` (unknown or missing)."""
    try:
        inspect.signature(call).bind(**kwargs)
    except ValueError:  # no signature to check against
        return
    except TypeError as exc:
        names = accepted(call)
        takes = ", ".join(sorted(names)) or "no keyword arguments"
        # Only the keys it does not take: naming in_channels and num_classes beside depth read as
        # if the constructor refused the data's facts it does take.
        unknown = sorted(k for k in kwargs if k not in names) or sorted(kwargs)
        raise ConfigError(
            f"{key}={target!r}: does not take the given keys {unknown} ({exc}); it takes: {takes}"
        ) from exc


def call_target(key: str, target: str, kwargs: dict[str, Any]) -> Any:
    """``hydra.utils.instantiate({'_target_': target, **kwargs})``, not recursive (a nested
    ``_target_`` node in the keys stays a dict); any exception it raises becomes ConfigError
    naming ``key``."""
    from hydra.utils import instantiate

    try:
        return instantiate({"_target_": target, **kwargs}, _convert_="all", _recursive_=False)
    except Exception as exc:
        cause = exc.__cause__ or exc
        raise ConfigError(f"{key}={target!r}: raised {first_line(cause)}") from exc


# --------------------------------------------------------------------------- code a checkpoint names
TRUST_KEY = "trust_checkpoint_code"


def checkpoint_targets(saved: dict[str, Any]) -> dict[str, str]:
    """Every ``_target_`` in the model and dataset sections of a checkpoint's config, by dotted
    key (``model._target_``, ``model.kwargs.norm._target_``): code a rebuild would import."""
    found: dict[str, str] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict):
            for name, value in node.items():
                key = f"{prefix}.{name}"
                if name == "_target_":
                    found[key] = str(value)
                walk(value, key)
        elif isinstance(node, list | tuple):
            for index, value in enumerate(node):
                walk(value, f"{prefix}.{index}")

    for section in ("model", "dataset"):  # the parts of the config mptrain rebuilds objects from
        walk(saved.get(section), section)
    return found


def refuse_checkpoint_code(
    saved: dict[str, Any], source: str, given: set[str] | None = None, trusted: bool = False
) -> None:
    """ConfigError (before anything is imported) when the checkpoint config ``saved``, read from
    ``source``, names code to rebuild its model or data (a ``_target_``) that the command line
    does not replace, unless ``trusted`` (``trust_checkpoint_code``). ``given``: the command
    line's keys and groups (``model``, ``model._target_``) where it can replace the checkpoint's
    values (``mptrain eval``); None where it cannot (``mptrain sample``, :func:`load_model`).
    The message names the key, the target, and how to run it anyway."""
    if trusted:
        return
    for key, target in checkpoint_targets(saved).items():
        if any(key == g or key.startswith(f"{g}.") for g in given or ()):
            continue
        how = (
            f"give {key}={target} on the command line, or {TRUST_KEY}=true"
            if given is not None
            else f"add {TRUST_KEY}=true (mptrain sample) or pass {TRUST_KEY}=True (load_model)"
        )
        raise ConfigError(
            f"{key}={target!r} comes from the checkpoint {source}: mptrain does not import or "
            f"call code a checkpoint names (anyone can write one); if you trust it, {how}"
        )
