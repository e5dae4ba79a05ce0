"""What a config may name, and how a composed config becomes a checked :class:`RunConfig`.

:func:`register_configs` stores in Hydra's ConfigStore the run schema, one schema node per option
of :data:`mptrain.config.options.SCHEMAS` (``<option>_<group>_schema``, its ``name`` preset), which
each ``conf/<group>/<option>.yaml`` names in its defaults list, and the reference recipes as the
``recipe`` group. Registration is explicit: the CLI, the tests and the benchmarks call it before
composing; importing mptrain registers nothing.

:func:`to_run_config` is the CLI edge: it refuses keys no schema declares, converts the composed
OmegaConf config into plain dataclasses once, checks the names against the tables, and runs the
range rules of :mod:`mptrain.config`. A schema with ``accepts_extra_keys`` (``model=custom``,
``dataset=custom``) takes any key: its undeclared keys (``+model.width=64``) are moved into its
``kwargs`` dict, the arguments of its ``_target_``.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

from mptrain.config.base import ConfigError
from mptrain.config.models import EXTRA_KEYS_FIELD
from mptrain.config.options import PRECISION_ALIASES, SCHEMAS
from mptrain.config.recipes import load_recipes
from mptrain.config.run import RunConfig, validate
from mptrain.config.spelling import did_you_mean, suggest_key


def schema_node_name(group: str, option: str) -> str:
    """The ConfigStore name of an option's schema node, e.g. ``resnet18_model_schema``."""
    return f"{option}_{group}_schema"


def register_configs() -> None:
    """Store the run schema, every option's schema node and the recipes (idempotent)."""
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    store.store(name="run_schema", node=RunConfig)
    # At the root rather than in <group>/, so schemas are neither options nor listed as groups.
    for group, options in SCHEMAS.items():
        for option, schema in options.items():
            store.store(name=schema_node_name(group, option), node=schema(name=option))
    for name, node in load_recipes().items():
        store.store(group="recipe", name=name, node=node, package="_global_")


def to_run_config(cfg: Any) -> RunConfig:
    """Convert a composed OmegaConf config into plain dataclasses, check names and ranges."""
    from omegaconf import OmegaConf

    _reject_unknown_keys(cfg)
    cfg, extras = _take_extra_keys(cfg)
    run = OmegaConf.to_object(cfg)
    if not isinstance(run, RunConfig):
        raise ConfigError("config: the primary config must use run_schema in its defaults list")
    for group, values in extras.items():
        _add_extra_keys(getattr(run, group), group, values)
    check_names(run)
    validate(run)
    return run


def check_names(run: RunConfig) -> None:
    """Each group's ``name`` must be an option of its table, and the one its schema belongs to
    (``model.name=vit`` over ``model=cnn`` would build a ViT from a CNN's settings)."""
    for group, options in SCHEMAS.items():
        node = getattr(run, group)
        schema = options.get(node.name)
        if schema is None:
            raise ConfigError(f"{group}.name={node.name!r}: one of {', '.join(options)}")
        if type(node) is not schema:
            raise ConfigError(
                f"{group}.name={node.name!r}: names another option than this {group}'s "
                f"settings ({type(node).__name__}); choose it with {group}={node.name}"
            )
    _check_precision_alias(run.precision.alias, run.precision.name)


def _check_precision_alias(alias: str | None, name: str) -> None:
    """``precision.alias`` is set by an alias's own option (conf/precision/16-mixed.yaml) and must
    name the precision that runs: the report would otherwise record a request nobody made."""
    if alias is None or PRECISION_ALIASES.get(alias) == name:
        return
    aliases = ", ".join(f"{a} ({n})" for a, n in PRECISION_ALIASES.items())
    raise ConfigError(
        f"precision.alias={alias!r}: not another name for precision {name}; it is set by "
        f"choosing precision=ALIAS, one of {aliases}"
    )


def absolute_paths(run: Any, launch_dir: Path) -> Any:
    """``run`` (a RunConfig, or a section of one) with every relative path key
    (:data:`mptrain.config.base.PATH` metadata) joined to ``launch_dir``, the directory mptrain was
    started in (``hydra.runtime.cwd``): a job moved into its output directory
    (``hydra.job.chdir=true``) still finds the user's files."""
    for f in dataclasses.fields(run):
        value = getattr(run, f.name)
        if f.metadata.get("path") and isinstance(value, str) and value not in ("", "auto"):
            path = Path(value).expanduser()
            setattr(run, f.name, str(path if path.is_absolute() else launch_dir / path))
        elif dataclasses.is_dataclass(value):
            absolute_paths(value, launch_dir)
    return run


def unknown_key_message(key: str, schema: type | None, typed: str | None = None) -> str:
    """One line for ``key``, unknown where ``schema`` (a dataclass, or None when not known) is
    the node's: the key the user probably meant, then the keys accepted there. ``typed`` is the
    whole key the user gave when longer (``trainer.max_epochs`` for the unknown ``trainer``)."""
    if schema is None:
        return f"{key}: unknown key{did_you_mean(suggest_key(typed or key))}"
    parent = key.rpartition(".")[0]
    names = [f.name for f in dataclasses.fields(schema)]
    meant = suggest_key(typed or key, [f"{parent}.{n}" if parent else n for n in names])
    return f"{key}: unknown key{did_you_mean(meant)}; accepted keys: {', '.join(names)}"


def _reject_unknown_keys(node: Any, path: str = "") -> None:
    """Refuse keys a schema does not declare. Hydra's ``+key=value`` adds them past the schema."""
    from omegaconf import DictConfig, OmegaConf

    schema = OmegaConf.get_type(node)
    declared = (
        {f.name for f in dataclasses.fields(schema)} if dataclasses.is_dataclass(schema) else None
    )
    open_schema = getattr(schema, "accepts_extra_keys", False)
    for key in node:
        if declared is not None and key not in declared and not open_schema:
            raise ConfigError(
                unknown_key_message(f"{path}{key}", schema, _first_leaf(node, key, path))
            )
        child = node._get_node(key)
        if isinstance(child, DictConfig) and not child._is_none() and not child._is_missing():
            _reject_unknown_keys(child, f"{path}{key}.")


def _first_leaf(node: Any, key: str, path: str) -> str:
    """The dotted path of the first value under ``node[key]`` (``+trainer.max_epochs=3`` adds the
    node ``trainer``; the suggestion needs ``trainer.max_epochs``)."""
    from omegaconf import DictConfig

    child = node._get_node(key)
    while isinstance(child, DictConfig) and not child._is_none() and len(child) > 0:
        inner = next(iter(child))
        path, key, child = f"{path}{key}.", inner, child._get_node(inner)
    return f"{path}{key}"


def _take_extra_keys(cfg: Any) -> tuple[Any, dict[str, dict[str, Any]]]:
    """(a copy of ``cfg`` without the undeclared keys of the groups whose schema accepts them,
    those keys as plain values per group)."""
    from omegaconf import DictConfig, OmegaConf, open_dict

    extras: dict[str, dict[str, Any]] = {}
    for group in SCHEMAS:
        node = cfg.get(group) if isinstance(cfg, DictConfig) else None
        schema = OmegaConf.get_type(node) if isinstance(node, DictConfig) else None
        if not getattr(schema, "accepts_extra_keys", False):
            continue
        declared = {f.name for f in dataclasses.fields(schema)}
        undeclared = [key for key in node if key not in declared]
        if not undeclared:
            continue
        if not extras:
            cfg = copy.deepcopy(cfg)  # the caller's config stays as Hydra composed it
            node = cfg[group]
        with open_dict(node):
            extras[group] = {key: _plain(node, key) for key in undeclared}
            for key in undeclared:
                node.pop(key)
    return cfg, extras


def _plain(node: Any, key: str) -> Any:
    """The value at ``node[key]`` as plain Python (dicts, lists, scalars), interpolations resolved."""
    from omegaconf import Container, OmegaConf

    value = node[key]
    return OmegaConf.to_container(value, resolve=True) if isinstance(value, Container) else value


def _add_extra_keys(group_config: Any, group: str, values: dict[str, Any]) -> None:
    """Merge the ``+group.key`` values into the schema's kwargs; a key set both ways is refused."""
    kwargs = getattr(group_config, EXTRA_KEYS_FIELD)
    for key, value in values.items():
        if key in kwargs:
            raise ConfigError(
                f"{group}.{key}: set twice, as {group}.{key} and {group}.{EXTRA_KEYS_FIELD}.{key}"
            )
        kwargs[key] = value
