"""The reference recipes shipped with mptrain (``recipes/*.yaml``, the package ``mptrain.recipes``):
found by name, and loaded as OmegaConf overlays for the ``recipe`` config group; and the check,
before anything is read, that a run of one is given the data it reproduces (``recipe.data``).
Judging a run against its recipe, and checking the data once read, is :mod:`mptrain.train.recipe`."""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path
from typing import Any, NamedTuple

from mptrain.config.base import ConfigError
from mptrain.config.run import RunConfig
from mptrain.config.sections import RecipeData


def recipe_files() -> dict[str, Any]:
    """recipes/*.yaml shipped in the package mptrain.recipes, by recipe name."""
    root = files("mptrain.recipes")
    return {p.name.removesuffix(".yaml"): p for p in root.iterdir() if p.name.endswith(".yaml")}


def load_recipes() -> dict[str, Any]:
    """Each recipe as an OmegaConf node: an overlay (package _global_) selected by recipe=NAME."""
    from omegaconf import OmegaConf

    return {name: OmegaConf.create(path.read_text()) for name, path in recipe_files().items()}


# ------------------------------------------------------------------------------- the recipe's data
class Mismatch(NamedTuple):
    """Data a run would train on that is not its recipe's: what was found (``dataset.path is the
    standard library's sources``) and what to give instead (``dataset.path=/path/to/input.txt``)."""

    found: str
    fix: str


def short_sha256(hexdigest: str) -> str:
    """The first six hex digits and an ellipsis: enough to tell two files apart in a message."""
    return f"{hexdigest[:6]}…"


def recipe_data_text(data: RecipeData) -> str:
    """What a recipe trains on, for messages: ``input.txt (1,115,394 bytes, sha256 86c4e6…)`` or
    ``cifar10 (50,000 train / 10,000 val samples)``."""
    facts = []
    if data.bytes is not None:
        facts.append(f"{data.bytes:,} bytes")
    if data.sha256:
        facts.append(f"sha256 {short_sha256(data.sha256)}")
    if data.train_samples is not None:
        val = f" / {data.val_samples:,} val" if data.val_samples is not None else ""
        facts.append(f"{data.train_samples:,} train{val} samples")
    name = data.file or data.dataset
    return f"{name} ({', '.join(facts)})" if facts else name


def path_fix(data: RecipeData) -> str:
    """What to give a text recipe: its file, by the name its source publishes."""
    return f"dataset.path=/path/to/{data.file}"


def configured_mismatch(run: RunConfig) -> Mismatch | None:
    """What the config alone shows against ``run.recipe.data`` (no file is touched): another
    dataset option, or a text recipe given no ``dataset.path`` (the embedded standard library)."""
    data = run.recipe.data
    if data.dataset and run.dataset.name != data.dataset:
        return Mismatch(f"dataset is {run.dataset.name}", f"dataset={data.dataset}")
    if data.file and not getattr(run.dataset, "path", ""):
        return Mismatch("dataset.path is the standard library's sources", path_fix(data))
    return None


def source_mismatch(run: RunConfig) -> Mismatch | None:
    """:func:`configured_mismatch`, then one stat of a text recipe's ``dataset.path`` (no byte is
    read): a path that does not exist, or a file of another size than ``recipe.data.bytes``. A
    directory passes: only reading it tells what it holds (mptrain.train.recipe.check_recipe_data).
    Relative paths are the caller's working directory's."""
    found = configured_mismatch(run)
    data = run.recipe.data
    if found is not None or not data.file:
        return found
    given = run.dataset.path  # a text dataset: configured_mismatch saw its name
    path = Path(given)
    if not path.exists():
        return Mismatch(f"dataset.path={given} does not exist", path_fix(data))
    if path.is_file() and data.bytes is not None and (size := path.stat().st_size) != data.bytes:
        return Mismatch(f"dataset.path={given} has {size:,} bytes", path_fix(data))
    return None


def data_refusal(run: RunConfig, mismatch: Mismatch) -> str:
    """The one line that refuses a strict recipe's run on other data (exit 2)."""
    return (
        f"recipe={run.recipe.name}: trains on {recipe_data_text(run.recipe.data)}; "
        f"{mismatch.found} — give {mismatch.fix}, or recipe.strict=false to run it on other "
        "data (its verdict then says not comparable)"
    )


def check_recipe_source(run: RunConfig) -> None:
    """Before anything is read (the preflight, and mptrain.train.build.build_run): ConfigError
    with :func:`data_refusal`'s line when a strict recipe's run would train on other data than
    ``recipe.data`` names, as far as the config and a stat of ``dataset.path`` tell. Nothing for
    a run without a recipe or with ``recipe.strict=false`` (its verdict records the difference)."""
    if run.recipe.name is None or not run.recipe.strict:
        return
    mismatch = source_mismatch(run)
    if mismatch is not None:
        raise ConfigError(data_refusal(run, mismatch))
