"""The number formats every table uses (the report's and the commands': ``fmt_pct``,
``fmt_num``, ``fmt_bytes``, ``plural``), and the summary's rows of a run's optional sections, in
words: a block-scaled run's formats and layers (the ``blocks`` section), one training step's
accounted memory, and a precision switch.

The ``blocks`` section is :func:`mptrain.precision.quant.convert.apply_quantized`'s, with the
counts of :meth:`~mptrain.precision.quant.convert.BlockLayers.layer_stats` as
``final_layer_stats`` (docs/precisions.md, "What is reported"); the memory accounting is
:mod:`mptrain.train.memory`'s; the switch is ``precision.switch``'s.
"""

from __future__ import annotations

import math
from typing import Any

from mptrain.report.schema import MemorySection


def fmt_pct(x: float | None) -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{100 * x:.2f}%"


def fmt_num(x: float | None, spec: str = ".4g") -> str:
    return "n/a" if x is None else format(x, spec)


def plural(count: int, word: str, many: str | None = None) -> str:
    """``1 epoch``, ``2 epochs``, ``0 steps``: a count with its noun in the right number
    (``many`` where the plural is not ``word + "s"``)."""
    return f"{count} {word if count == 1 else many or word + 's'}"


def fmt_bytes(n: int | None) -> str:
    if n is None:
        return "n/a"
    if abs(n) < 1024:
        return f"{n} B"
    for unit in ("KiB", "MiB"):
        n /= 1024
        if abs(n) < 1024:
            return f"{n:.1f} {unit}"
    return f"{n / 1024:.1f} GiB"


# The block format's settings its summary row names (``blocks``).
_SETTINGS = ("scale_rounding", "weight_tiles", "hadamard", "stochastic_rounding")


def _formats(section: dict[str, Any]) -> str:
    """``input float8_e4m3fn/float8_e8m0fnu 1x32, ...``: element/scale format and block per role."""
    return ", ".join(
        f"{role} {o['element']}/{o['scale']} {o['block']}"
        for role, o in section["operands"].items()
    )


def blocks_rows(section: dict[str, Any] | None) -> list[tuple[str, str]]:
    """The summary rows of a block-scaled run: its formats and settings, the GEMM, the layers
    converted, the share of the Linear FLOPs per format and, with a precision switch, the steps
    the format ran; none for other runs."""
    if section is None:
        return []
    layers = section["layers"]
    converted = sum(layer["converted"] for layer in layers)
    settings = [f"{k}={section[k]}" for k in _SETTINGS if k in section]
    if "keep_last_fraction" in section:
        settings.append(f"keep_last_fraction={section['keep_last_fraction']:g}")
    shares = ", ".join(f"{fmt} {fmt_pct(x)}" for fmt, x in section["linear_flops_share"].items())
    words = f"{section['name']}: {_formats(section)}"
    if "tensor_scale" in section:
        words += f", {section['tensor_scale']} tensor scale"
    if settings:
        words += f"; {', '.join(settings)}"
    words += (
        f"; {section['gemm']}; {converted} of {len(layers)} Linear layers (Linear FLOPs: {shares})"
    )
    if "steps" in section:  # a precision switch into or out of the format: the steps it ran
        words += f"; steps {section['steps'][0]}-{section['steps'][1]}"
    return [("block format", words)]


def blocks_lines(section: dict[str, Any] | None) -> list[str]:
    """report.md's section: per converted layer and role, the counts of its quantizations on
    the metrics rows (fractions of the elements or blocks counted); nothing for other runs."""
    if section is None or not section.get("final_layer_stats"):
        return []
    lines = [
        "",
        f"## {section['name']} layers",
        "",
        f"Counted: {section['counted']}. Saturated and underflowed (nonzero to zero): shares of "
        "the elements; zero and non-finite: shares of the blocks.",
        "",
        "| layer | operand | block | quantizations | saturated | underflows | zero blocks "
        "| non-finite blocks |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in section["final_layer_stats"]:
        for role, operand in section["operands"].items():
            c = row[role]
            if not c["samples"]:
                lines.append(f"| {row['name']} | {role} | {operand['block']} | 0 | | | | |")
                continue
            elements, blocks = c["elements"], c["blocks"]
            lines.append(
                f"| {row['name']} | {role} | {operand['block']} | {c['samples']} | "
                f"{fmt_pct(c['saturated'] / elements)} | {fmt_pct(c['underflows'] / elements)} | "
                f"{fmt_pct(c['zero_blocks'] / blocks)} | "
                f"{fmt_pct(c['nonfinite_blocks'] / blocks)} |"
            )
    return lines


# What a peak holds besides one step's accounted tensors, by what the peak measures.
_UNACCOUNTED = {
    "cuda_max_allocated": "the forward's temporaries autograd did not save, the optimizer's "
    "scratch, the evaluation's batches, and the copies the accounting step made",
    None: "the interpreter, torch's libraries and threads, the data in memory, the "
    "allocator's caches, temporaries that are never saved, and the accounting step's copies",
}


def memory_rows(memory: MemorySection) -> list[tuple[str, str]]:
    """One row per kind of one training step's accounted bytes, by dtype, then the total beside
    the measured peak (mptrain.train.memory)."""
    accounted = memory.accounted
    if not accounted:
        return []
    if "not_counted" in accounted:
        return [("memory", f"not accounted: {accounted['not_counted']}")]
    rows = []
    for kind, by_dtype in accounted["bytes"].items():
        if by_dtype:
            parts = ", ".join(f"{fmt_bytes(n)} {dtype}" for dtype, n in by_dtype.items())
            rows.append((f"  {kind.replace('_', ' ')}", parts))
    total = f"{fmt_bytes(accounted['total_bytes'])} in one step"
    if accounted.get("recomputed_blocks"):
        total += f", {accounted['recomputed_blocks']} blocks recomputed in the backward"
    if memory.peak_bytes is not None:
        rest = memory.peak_bytes - accounted["total_bytes"]
        why = _UNACCOUNTED.get(memory.kind or "", _UNACCOUNTED[None])
        total += f" (peak {fmt_bytes(memory.peak_bytes)}: {fmt_bytes(rest)} more, {why})"
    return [("memory accounted", total), *rows]


def switch_rows(switch: dict[str, Any] | None) -> list[tuple[str, str]]:
    """A precision schedule's switch in one row: when, into what, and the loss either side."""
    if switch is None:
        return []
    to = (
        f"{switch['to_label']} (autocast {switch['to_autocast_dtype'] or 'none'}, loss scaling "
        f"{'on' if switch['to_loss_scaling'] else 'off'})"
    )
    words = f"{switch['from_label']} -> {to} after step {switch['step']}"
    if switch["switched_after_step"] is None:
        return [("precision switch", f"{words}: not reached")]
    if switch["switched_after_step"] != switch["step"]:
        words = words.replace(f"step {switch['step']}", f"step {switch['switched_after_step']}")
    return [("precision switch", "; ".join([words, *_switch_effect(switch)]))]


def _switch_effect(switch: dict[str, Any]) -> list[str]:
    """The train loss over the steps either side of the switch and the evaluations around it."""
    parts = []
    before, after = switch["train_loss_before"], switch["train_loss_after"]
    if before and after:
        change = f"train loss {_span(before)} -> {_span(after)}: {switch['loss_change']:+.4f}"
        earlier = switch["train_loss_earlier"]
        if earlier:  # how the loss moved over as many steps without a switch
            steps = f"steps {earlier['steps'][0]}-{earlier['steps'][1]} -> {before['steps'][0]}-"
            change += f"; before it, {steps}{before['steps'][1]}: {switch['trend_before']:+.4f}"
        parts.append(change)
    ev_before, ev_after = switch["eval_before"], switch["eval_after"]
    if ev_before and ev_after:
        parts.append(
            f"val loss {fmt_num(ev_before['val_loss'])} (step {ev_before['step']}) -> "
            f"{fmt_num(ev_after['val_loss'])} (step {ev_after['step']})"
        )
    return parts


def _span(window: dict[str, Any]) -> str:
    """``2.3100 (steps 81-100)``: a mean train loss and the steps it is over."""
    return f"{window['mean']:.4f} (steps {window['steps'][0]}-{window['steps'][1]})"
