"""When two runs are comparable: the config keys that do not change what a run computes.

Sweep comparisons (:mod:`mptrain.commands.sweep`) pair each run with the FP32 run whose config is otherwise
identical, and recipe verdicts (:mod:`mptrain.train.recipe`) accept a run as the recipe's full schedule
when every key that matters has the recipe's value; both ignore the keys listed here.
"""

from __future__ import annotations

from typing import Any

# Dotted config keys (or key prefixes) that do not change what a run computes: where the data
# lives, what is displayed or logged (trackers too), checkpoint and resume mechanics, diagnostics, benchmarks.
# Comparisons (sweeps, recipe verdicts) ignore them.
NON_TRAINING_KEYS = (
    "seed",
    "device",
    "progress",
    "log_every",
    "probe_every",
    "eval_every",
    "eval_every_minutes",
    "throughput_warmup_steps",
    "num_workers",
    "compile",
    "audit",
    "probe",
    "probe_batches",
    "resume",
    "resume_allow_changes",
    "overwrite",
    "checkpoint",
    "bench",
    "advise",
    "eval",
    "sample",
    "debug",
    "recipe",
    "dataset.root",
    "dataset.download",
    "numerics.find_culprit",
    "numerics.warn_consecutive_backoffs",
    "numerics.warn_skip_rate",
    "numerics.warn_window",
    # experiment trackers: where the run is reported, not what it computes
    "logger",
    "tensorboard",
    "mlflow",
)


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
