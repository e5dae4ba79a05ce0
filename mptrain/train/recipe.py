"""Reference recipes: loading them for ``recipe=NAME`` and judging whether a run reproduced one.

A recipe is ``recipes/NAME.yaml``: an overlay on the defaults (Hydra package ``_global_``) whose
``recipe`` block names its source, the exact command and the expected result. A run reproduces the
recipe only when it ran the recipe's full schedule: every key the recipe sets still has the
recipe's value. Exceptions: settings that do not change the computation
(:data:`~mptrain.config.keys.NON_TRAINING_KEYS`: seed, device, display, data location, checkpoints) and
the precision, which a recipe names as its default but which runs are meant to vary and compare.
Otherwise the verdict is "not comparable" and says which keys differ.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from mptrain.config.keys import flatten, is_non_training_key
from mptrain.config.recipes import recipe_files
from mptrain.config.run import RunConfig
from mptrain.models.task import lower_is_better
from mptrain.output.report import EvaluationSection, RecipeSection


def _group_choices(defaults: list[Any]) -> dict[str, str]:
    """{'model.name': 'resnet18', ...} from entries like {'override /model': 'resnet18'}."""
    choices = {}
    for entry in defaults:
        if isinstance(entry, dict):
            for key, value in entry.items():
                group = key.replace("override", "").strip().lstrip("/")
                if group in ("model", "dataset", "optimizer", "scheduler"):
                    choices[f"{group}.name"] = value
    return choices


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        try:
            return math.isclose(float(a), float(b), rel_tol=1e-9)
        except (TypeError, ValueError):
            return False
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def schedule_differences(cfg: RunConfig, recipe: dict[str, Any]) -> list[str]:
    """``key=value (recipe: value)`` for every recipe key the run changed."""
    wanted = _group_choices(recipe.get("defaults", []))
    wanted.update(
        flatten({k: v for k, v in recipe.items() if k not in ("defaults", "recipe", "hydra")})
    )
    wanted.setdefault("max_steps", None)  # a step limit the recipe does not set cuts it short
    actual = flatten(dataclasses.asdict(cfg))
    return [
        f"{key}={actual.get(key)!r} (recipe: {value!r})"
        for key, value in wanted.items()
        if key != "precision.name"
        and value != "???"  # a value the user supplies (a data path): any is the recipe's
        and not is_non_training_key(key)
        and not _same(actual.get(key), value)
    ]


def _within(actual: float, value: float, tolerance: float, lower: bool) -> bool:
    """Met: at most ``value + tolerance`` for a loss-like metric, else at least ``value -
    tolerance``."""
    return actual <= value + tolerance if lower else actual >= value - tolerance


def recipe_verdict(
    cfg: RunConfig, status: str, evaluation: EvaluationSection
) -> RecipeSection | None:
    """The report's ``recipe`` section: expected result, actual, and met / not met / not comparable."""
    if cfg.recipe.name is None:
        return None
    from omegaconf import OmegaConf

    expected = cfg.recipe.expected
    actual = getattr(evaluation, expected.metric, None)
    path = recipe_files().get(cfg.recipe.name)
    recipe = OmegaConf.to_container(OmegaConf.create(path.read_text())) if path else {}
    differences = schedule_differences(cfg, recipe)
    if status != "completed":
        verdict = f"not comparable: the run {status}"
    elif differences:
        verdict = "not comparable: not the recipe's full schedule: " + "; ".join(differences)
    elif expected.value is None or actual is None:
        verdict = "not comparable: no expected value"
    elif _within(actual, expected.value, expected.tolerance, lower_is_better(expected.metric)):
        verdict = "met"
    else:
        verdict = "not met"
    return RecipeSection(
        name=cfg.recipe.name,
        source=cfg.recipe.source,
        command=cfg.recipe.command,
        expected=dataclasses.asdict(expected),
        actual=actual,
        note=cfg.recipe.note,
        verdict=verdict,
        met=verdict == "met" if not verdict.startswith("not comparable") else None,
    )
