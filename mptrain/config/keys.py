"""When two runs are comparable: the config keys that do not change what a run computes.

Sweep comparisons (:mod:`mptrain.commands.sweep`) pair each run with the FP32 run whose config is otherwise
identical, resume (:mod:`mptrain.checkpoint.checkpointer`) compares every training setting with the
checkpoint's, and recipe verdicts (:mod:`mptrain.train.recipe`) accept a run as the recipe's full
schedule when every key that matters has the recipe's value; all ignore the keys whose schema field
is marked :data:`~mptrain.config.base.NOT_TRAINING`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

from mptrain.config.options import SCHEMAS
from mptrain.config.run import RunConfig


def schema_fields(
    schema: type = RunConfig, groups: dict[str, dict[str, type]] = SCHEMAS, prefix: str = ""
) -> Iterator[tuple[str, dataclasses.Field]]:
    """Every field below ``schema`` with its dotted key, a node before the fields inside it:
    nested dataclasses and, for a config group (``model``, ``dataset``, ...), every option's schema
    in ``groups`` (a schema several options share, once)."""
    for f in dataclasses.fields(schema):
        key = prefix + f.name
        yield key, f
        nested = [*groups.get(f.name, {}).values()]
        if dataclasses.is_dataclass(f.default_factory):
            nested.append(f.default_factory)
        for cls in dict.fromkeys(nested):
            yield from schema_fields(cls, {}, f"{key}.")


def non_training_keys(
    schema: type = RunConfig, groups: dict[str, dict[str, type]] = SCHEMAS
) -> tuple[str, ...]:
    """The dotted keys (or key prefixes) of :func:`schema_fields` whose fields are marked
    :data:`~mptrain.config.base.NOT_TRAINING`, none below another. A new setting is a training
    setting unless its field says otherwise, so it is compared by default."""
    marked = [
        key for key, f in schema_fields(schema, groups) if f.metadata.get("training") is False
    ]
    return tuple(dict.fromkeys(k for k in marked if not any(k.startswith(f"{m}.") for m in marked)))


NON_TRAINING_KEYS = non_training_keys()


def is_non_training_key(key: str) -> bool:
    return any(key == k or key.startswith(k + ".") for k in NON_TRAINING_KEYS)


def flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    """{"a.b": value} for a nested dict."""
    if isinstance(node, dict):
        out: dict[str, Any] = {}
        for key, value in node.items():
            out.update(flatten(value, f"{prefix}{key}."))
        return out
    return {prefix.rstrip("."): node}
