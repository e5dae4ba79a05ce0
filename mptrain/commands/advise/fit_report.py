"""advise.md's "What fits" section, from advise.json's ``memory`` (:mod:`.footprint`): one step's
accounted bytes per precision and checkpointing mode at the configured micro-batch, the
optimizer-state choices' bytes, and on ``advise.target``'s GPU the largest micro-batch of each
and the recommendation for ``advise.batch_size``, every figure labelled predicted, and what the
recommendation measured where advise ran on that GPU."""

from __future__ import annotations

from typing import Any

from mptrain.commands.advise import fits
from mptrain.commands.advise.choices import CHOICES
from mptrain.report.rows import fmt_bytes, plural


def _label(precision: str) -> str:
    return CHOICES[precision].label if precision in CHOICES else precision


def _largest(target: dict[str, Any], precision: str, state: str, mode: str) -> str:
    for row in target["largest_batch"]:
        if (row["precision"], row["state"], row["checkpointing"]) == (precision, state, mode):
            n = row["largest_batch"]
            return "any" if n < 0 else f"{n:,}"
    return ""


def fit_lines(memory: dict[str, Any] | None) -> list[str]:
    """The recommendation for ``advise.batch_size`` (or why none) and its command; nothing
    when no batch was asked for or no GPU named."""
    fit = ((memory or {}).get("target") or {}).get("fit")
    if not fit:
        return []
    gpu = memory["target"]["gpu"]
    if "none" in fit:
        return [f"What fits {gpu} (predicted): {fit['none']}."]  # considered: as below
    precision, state, mode = fit["combination"]
    what = f"{_label(precision)}, {fits.state_label(state)}, checkpointing {mode}"
    line = (
        f"What fits {gpu} at micro-batch {fit['batch_size']:,} (predicted): {what}: "
        f"{fmt_bytes(fit['bytes'])} of {fmt_bytes(memory['target']['usable_bytes'])} usable; "
        f"largest micro-batch {fit['largest_batch']:,}."
    )
    cost = fit.get("speed_cost")
    if cost and cost.get("step_time_vs_alone"):
        low, high = cost["range"]
        line += (
            f" What it adds ({' '.join(fit['overrides'])}) costs "
            f"{cost['step_time_vs_alone']:.2f}× the step of {_label(precision)} alone "
            f"({low:.2f}–{high:.2f}, {cost['reps']} repetitions, measured here on the "
            f"{cost['on']})."
        )
    elif fit["overrides"]:
        why = memory["skipped"].get("speed cost", "not measured")
        line += f" What it adds ({' '.join(fit['overrides'])}) costs in speed: {why}."
    line += _measured(fit.get("measured"), gpu)
    left_out = [f"{_label(p)} ({why})" for p, why in fit.get("not_considered", {}).items()]
    if left_out:
        line += f" Not considered, their numerics not vouched for: {'; '.join(left_out)}."
    return [line, *(["", "    " + fit["command"]] if fit.get("command") else [])]


def _measured(measured: dict[str, Any] | None, gpu: str) -> str:
    """What the combination measured on the target GPU itself (:mod:`.fit_measure`), if it ran."""
    if not measured:
        return ""
    at = f"micro-batch {measured['batch_size']:,}"
    if "out_of_memory" in measured:
        return f" Measured on this {gpu}: out of memory at {at} ({measured['out_of_memory']})."
    return (
        f" Measured on this {gpu}: peak {fmt_bytes(measured['peak_bytes'])} at {at} "
        f"over {plural(measured['steps'], 'step')} (CUDA's max allocated)."
    )


def section(memory: dict[str, Any] | None) -> list[str]:
    """advise.md's "What fits" section (nothing when the part was not asked for and did not
    run; why not when a batch was asked for)."""
    if not memory:
        return []
    reasons = [f"- {part}: {why}" for part, why in memory.get("skipped", {}).items()]
    if not memory.get("rows"):
        return ["## What fits", "", "Not accounted:", *reasons, ""] if reasons else []
    target = memory.get("target")
    modes = [m for m in fits.CHECKPOINTING if any(m in r for r in memory["rows"].values())]
    states = list(memory["states"])
    users = memory.get("user_state")
    head = ["precision", "checkpointing", f"one step at batch {memory['batch_size']:,}"]
    if target:
        head += [f"largest batch, {fits.state_label(s)}" for s in states]
    lines = [
        "## What fits",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for precision, by_mode in memory["rows"].items():
        for mode in modes:
            if mode not in by_mode:
                continue
            cells = [_label(precision), mode, fmt_bytes(by_mode[mode]["at_batch_size_bytes"])]
            if target:
                cells += [_largest(target, precision, s, mode) for s in states]
            lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines.append(
        "Optimizer states: "
        + ", ".join(f"{fits.state_label(s)} {fmt_bytes(n)}" for s, n in memory["states"].items())
        + (f" (the run's own: {fits.state_label(users)})." if users else ".")
    )
    if target:
        lines.append(
            f"On {target['gpu']}: {fmt_bytes(target['usable_bytes'])} usable of "
            f"{fmt_bytes(target['memory_bytes'])}."
        )
    lines.append(f"Basis: {memory['basis']}.")
    lines += fit_lines(memory)
    if reasons:
        lines += ["", "Not accounted:", *reasons]
    return [*lines, ""]
