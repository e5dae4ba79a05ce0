"""Reference recipes: loading them for ``recipe=NAME`` and judging whether a run reproduced one
(recipes in words: docs/sweeps.md#recipes).

A run reproduces its recipe only when it ran the recipe's full schedule: every key the recipe
sets still has the recipe's value (:func:`schedule_differences`), apart from settings that do not
change the computation (:data:`~mptrain.config.keys.NON_TRAINING_KEYS`) and the precision, which
a recipe names as its default but which runs are meant to vary and compare; and on the data the
recipe names (``recipe.data``: :func:`mptrain.config.recipes.check_recipe_source` before anything
is read, :func:`check_recipe_data` what was read). Otherwise the verdict is "not comparable" and
says why; a strict recipe (``recipe.strict``) refuses other data instead.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

from mptrain.config.base import ConfigError
from mptrain.config.keys import flatten, is_non_training_key
from mptrain.config.recipes import (
    Mismatch,
    configured_mismatch,
    data_refusal,
    path_fix,
    recipe_data_text,
    recipe_files,
    short_sha256,
)
from mptrain.config.run import RunConfig
from mptrain.models.task import lower_is_better
from mptrain.report.schema import EvaluationSection, RecipeSection

if TYPE_CHECKING:
    from mptrain.data.batches import DataBundle


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


def read_mismatch(cfg: RunConfig, data: DataBundle) -> Mismatch | None:
    """What the data read shows against ``cfg.recipe.data``: the config's mismatch first
    (:func:`~mptrain.config.recipes.configured_mismatch`), then the text's size and sha256
    (dataset=text), then the sample counts. None when it is the recipe's data, or when the recipe
    names nothing to check."""
    found = configured_mismatch(cfg)
    if found is not None:
        return found
    want = cfg.recipe.data
    if want.file and data.text is not None:
        corpus, where = data.text.corpus, f"dataset.path={cfg.dataset.path}"
        if want.bytes is not None and corpus.bytes != want.bytes:
            return Mismatch(f"{where} has {corpus.bytes:,} bytes", path_fix(want))
        if want.sha256 and corpus.content_sha256 != want.sha256:
            sha = short_sha256(corpus.content_sha256)
            return Mismatch(f"{where} has sha256 {sha}", path_fix(want))
    counts = ((want.train_samples, data.num_train), (want.val_samples, data.num_val))
    if any(wanted is not None and wanted != got for wanted, got in counts):
        root = getattr(cfg.dataset, "root", None)
        where = f"dataset.root={root}" if root else f"dataset={cfg.dataset.name}"
        return Mismatch(
            f"{where} holds {data.num_train:,} train / {data.num_val:,} val samples",
            f"dataset.root=DIR holding the whole {want.dataset or cfg.dataset.name}",
        )
    return None


def check_recipe_data(cfg: RunConfig, data: DataBundle) -> None:
    """Once the data is read, before the model is built: ConfigError with the recipe's one-line
    refusal when a strict recipe's run read other data than ``recipe.data`` names (the checksum
    a stat could not see). Nothing without a recipe or under ``recipe.strict=false``."""
    if cfg.recipe.name is None or not cfg.recipe.strict:
        return
    mismatch = read_mismatch(cfg, data)
    if mismatch is not None:
        raise ConfigError(data_refusal(cfg, mismatch))


def recipe_verdict(
    cfg: RunConfig,
    status: str,
    evaluation: EvaluationSection,
    data: DataBundle | None = None,
) -> RecipeSection | None:
    """The report's ``recipe`` section: expected result, actual, and met / not met / not
    comparable. ``data``: what the run read (None: the run got no data; only the config is
    compared with ``recipe.data``)."""
    if cfg.recipe.name is None:
        return None
    from omegaconf import OmegaConf

    expected = cfg.recipe.expected
    actual = getattr(evaluation, expected.metric, None)
    path = recipe_files().get(cfg.recipe.name)
    recipe = OmegaConf.to_container(OmegaConf.create(path.read_text())) if path else {}
    reasons = _not_comparable(cfg, recipe, data)
    if status != "completed":
        verdict = f"not comparable: the run {status}"
    elif reasons:
        verdict = "not comparable: " + "; ".join(reasons)
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


def _not_comparable(cfg: RunConfig, recipe: dict[str, Any], data: DataBundle | None) -> list[str]:
    """Why a completed run does not reproduce its recipe: other data, another schedule."""
    reasons = []
    mismatch = configured_mismatch(cfg) if data is None else read_mismatch(cfg, data)
    if mismatch is not None:
        wanted = recipe_data_text(cfg.recipe.data)
        reasons.append(f"other data: {mismatch.found} (recipe: {wanted})")
    differences = schedule_differences(cfg, recipe)
    if differences:
        reasons.append("not the recipe's full schedule: " + "; ".join(differences))
    return reasons
