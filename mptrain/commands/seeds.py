"""Jobs that differ only in their seed, summarised: the mean ± sample standard deviation of their
final metrics, one row per group with its n (docs/sweeps.md shows the table).

A group is the completed runs whose configs are identical but for ``seed`` (the keys that do not
change the computation aside: :func:`~mptrain.config.keys.is_non_training_key`), with at least
two seeds. A run of the group that did not complete is left out, and so is a second run of a
seed already counted (a repeat is no new sample); each is named in a note under the table. The
differences to FP32 are averaged as the comparison's rows give them: each job against the FP32
job of its own seed.
"""

from __future__ import annotations

import json
import math
import statistics
from typing import Any

from mptrain.commands.readable import visible
from mptrain.commands.runs import RunRecord
from mptrain.config.keys import flatten, is_non_training_key
from mptrain.report.schema import RunReport

# The final metrics summarised, by their key in a comparison row, with their column header
# (the comparison's columns too: mptrain.commands.sweep).
LOSS_COLUMNS = (
    ("final_val_loss", "val loss"),
    ("loss_delta", "Δ loss vs fp32"),
    ("final_val_perplexity", "perplexity"),
)
ACCURACY_COLUMNS = (("final_val_accuracy", "val acc"), ("accuracy_delta", "Δ acc vs fp32"))
METRICS = dict((*LOSS_COLUMNS, *ACCURACY_COLUMNS))
# A language model's primary metric is its loss; a classifier's, its accuracy: it comes first.
LM_ORDER = tuple(METRICS)
CLASSIFY_ORDER = ("final_val_accuracy", "accuracy_delta", "final_val_loss", "loss_delta")

NOTE = (
    "Over seeds: the mean ± sample standard deviation (n − 1 in the denominator) of the final "
    "metrics of each group of completed jobs that differ only in seed; n: the jobs counted. "
    "Δ: each job against the FP32 job of its own seed."
)


def config_key(report: RunReport, dropped: tuple[str, ...] = (), seed: bool = False) -> str:
    """``report``'s config minus the keys that do not change the computation (the seed among
    them, unless ``seed``) and the keys starting with one of ``dropped``."""
    config = flatten(report.config)
    kept = {
        k: v
        for k, v in config.items()
        if (seed and k == "seed") or not (is_non_training_key(k) or k.startswith(dropped))
    }
    return json.dumps(kept, sort_keys=True, default=str)


def seed_groups(runs: list[RunRecord], rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One summary per group of ``runs`` that differ only in seed (see the module docstring), in
    the order of each group's first run; ``rows`` are the comparison's rows of ``runs``, in the
    same order. None when no two completed runs differ only in seed."""
    groups: dict[str, list[tuple[RunRecord, dict[str, Any]]]] = {}
    for run, row in zip(runs, rows, strict=True):
        if run.report is not None:
            groups.setdefault(config_key(run.report), []).append((run, row))
    summaries = [_summary(members) for members in groups.values()]
    return [s for s in summaries if s is not None]


def _summary(members: list[tuple[RunRecord, dict[str, Any]]]) -> dict[str, Any] | None:
    """The group's summary; None when fewer than two of its seeds completed."""
    counted: dict[Any, dict[str, Any]] = {}
    left_out = []
    for run, row in members:
        seed = run.report.config.get("seed") if run.report else None
        if row.get("status") != "completed":
            left_out.append(f"{row['run']}: {row.get('status')}, not counted")
        elif seed in counted:
            left_out.append(f"{row['run']}: seed {seed} again (a repeat, not counted)")
        else:
            counted[seed] = row
    if len(counted) < 2:
        return None
    used = list(counted.values())
    summary: dict[str, Any] = {
        "group": _group_label([run.label for run, _ in members]) or used[0]["precision"],
        "n": len(used),
        "seeds": list(counted),
        "runs": [row["run"] for row in used],
        "task": used[0].get("task"),
    }
    for key in METRICS:
        summary[key] = _mean_sd([row.get(key) for row in used])
    summary["left_out"] = left_out
    return summary


def _group_label(labels: list[str]) -> str:
    """The overrides every run of the group shares, its seed aside (``precision=bf16``); ""
    when they share none (a sweep over seeds alone, runs labelled by their directories)."""
    split = [label.split(" ") for label in labels]
    common = set.intersection(*(set(parts) for parts in split))
    return " ".join(p for p in split[0] if p in common and not p.startswith("seed="))


def _mean_sd(values: list[Any]) -> dict[str, float] | None:
    """{"mean", "sd"} (sample standard deviation) of ``values``; None unless every one is a
    number (a metric a run lacks, or a difference without its FP32 twin, is not averaged)."""
    if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
        return None
    return {"mean": statistics.fmean(values), "sd": statistics.stdev(values)}


# ---------------------------------------------------------------------------------- rendering
def _columns(groups: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """The group, its n and seeds, then the metrics some group has, the primary metric first."""
    lm = any(g.get("task") == "lm" for g in groups)
    order = LM_ORDER if lm else CLASSIFY_ORDER
    metrics = [(k, METRICS[k]) for k in order if any(g.get(k) is not None for g in groups)]
    return [("group", "group"), ("n", "n"), ("seeds", "seeds"), *metrics]


def _cell(group: dict[str, Any], key: str) -> str:
    value = group.get(key)
    if key == "seeds":
        return visible(", ".join(str(s) for s in value))
    if value is None:
        return "—"
    if key in ("group", "n"):
        return visible(str(value))
    mean, sd = value["mean"], value["sd"]
    if not (math.isfinite(mean) and math.isfinite(sd)):
        return f"{mean} ± {sd}"
    if key == "final_val_accuracy":
        return f"{100 * mean:.2f}% ± {100 * sd:.2f} pt"
    if key == "accuracy_delta":
        return f"{100 * mean:+.2f} ± {100 * sd:.2f} pt"
    if key == "final_val_perplexity":
        return f"{mean:.2f} ± {sd:.2f}"
    return f"{mean:{'+' if key == 'loss_delta' else ''}.4f} ± {sd:.4f}"


def seed_table(groups: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """The headers and text cells of the over-seeds table (control characters escaped)."""
    columns = _columns(groups)
    return [h for _, h in columns], [[_cell(g, k) for k, _ in columns] for g in groups]


def seed_notes(groups: list[dict[str, Any]]) -> list[str]:
    """What the table means, then the runs each group left out (nothing without groups)."""
    if not groups:
        return []
    return [NOTE] + [visible(f"{g['group']}: {line}") for g in groups for line in g["left_out"]]
