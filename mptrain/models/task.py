"""What a run learns: the task's loss, its evaluation figures, and which figure ranks runs.

Two tasks share the one training loop (:mod:`mptrain.train.loop`); they differ only here:

- ``classify``: one label per sample; logits ``(batch, classes)``. Primary metric: validation
  accuracy (higher is better).
- ``lm``: next-token prediction; logits ``(batch, length, vocabulary)`` against the next tokens
  ``(batch, length)``. Every position is one prediction, so the loss and the accuracy are per
  token. Primary metric: validation loss (lower is better); perplexity is ``exp(loss)``.

Both losses are :func:`cross_entropy` of the logits (:func:`logits_of`). Best checkpoints, sweep
tables, recipe verdicts and ``mptrain-compare`` rank by :attr:`Task.primary_metric` in the
direction it states.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

# Report keys whose smaller values are better; every other metric is better larger.
_LOWER_IS_BETTER_SUFFIXES = ("loss", "perplexity")


def lower_is_better(metric: str) -> bool:
    """Whether a smaller value of ``metric`` (a report or eval-row key) is better."""
    return metric.endswith(_LOWER_IS_BETTER_SUFFIXES)


def cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean", **kwargs: Any
) -> torch.Tensor:
    """Cross-entropy of ``logits (..., classes)`` against ``targets (...)`` in FP32.

    Logits go to FP32 first: CPU autocast would run the log-softmax in BF16, and "pure"
    low-precision runs would too (a no-op in FP32). Flattening makes a language model's
    ``(batch, length, vocab)`` the same problem as a classifier's ``(batch, classes)``.
    """
    flat = logits.float().reshape(-1, logits.shape[-1])
    return F.cross_entropy(flat, targets.reshape(-1), reduction=reduction, **kwargs)


def logits_of(output: Any) -> torch.Tensor:
    """The logits a model returned: the tensor itself, or the ``.logits`` tensor of an output
    object (what Hugging Face models return: ``CausalLMOutputWithPast`` and the like).
    TypeError naming the type for anything else (the dry forward of
    :func:`mptrain.models.build.build_model` turns it into a ConfigError before training)."""
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    raise TypeError(
        f"the model returned a {type(output).__name__}; mptrain takes a logits tensor "
        "or an object with a .logits tensor"
    )


def correct_predictions(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """How many argmax predictions equal their targets (a device tensor)."""
    return (logits.argmax(dim=-1) == targets).sum()


@dataclass(frozen=True)
class Task:
    """The task's name, its primary metric and direction, and tokens per sample (LM only)."""

    name: str = "classify"
    tokens_per_sample: int | None = None  # lm: the training window's length

    @property
    def primary_metric(self) -> str:
        """The eval-row key that ranks evaluations and runs."""
        return "val_loss" if self.name == "lm" else "val_accuracy"

    @property
    def lower_is_better(self) -> bool:
        return lower_is_better(self.primary_metric)

    def eval_row(self, loss: float, accuracy: float) -> dict[str, float]:
        """An evaluation's figures: mean loss and accuracy per prediction (per token for
        ``lm``, which adds the perplexity)."""
        row = {"val_loss": loss, "val_accuracy": accuracy}
        if self.name == "lm":
            row["val_perplexity"] = perplexity(loss)
        return row

    def better(self, value: float, than: float) -> bool:
        """Whether primary-metric ``value`` beats ``than`` (ties do not)."""
        return value < than if self.lower_is_better else value > than

    def best(self, evals: Iterable[dict[str, Any]]) -> dict[str, Any] | None:
        """The evaluation with the best primary metric (the earliest among equals); NaN never wins."""
        best = None
        for row in evals:
            value = row.get(self.primary_metric)
            if value is None or math.isnan(value):
                continue
            if best is None or self.better(value, best[self.primary_metric]):
                best = row
        return best


def perplexity(loss: float) -> float:
    """``exp(loss)``, inf where that overflows."""
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf
