"""The reference recipes shipped with mptrain (``recipes/*.yaml``, the package ``mptrain.recipes``):
found by name, and loaded as OmegaConf overlays for the ``recipe`` config group. Judging a run
against its recipe is :mod:`mptrain.train.recipe`."""

from __future__ import annotations

from importlib.resources import files
from typing import Any


def recipe_files() -> dict[str, Any]:
    """recipes/*.yaml shipped in the package mptrain.recipes, by recipe name."""
    root = files("mptrain.recipes")
    return {p.name.removesuffix(".yaml"): p for p in root.iterdir() if p.name.endswith(".yaml")}


def load_recipes() -> dict[str, Any]:
    """Each recipe as an OmegaConf node: an overlay (package _global_) selected by recipe=NAME."""
    from omegaconf import OmegaConf

    return {name: OmegaConf.create(path.read_text()) for name, path in recipe_files().items()}
