"""The report's ``blocks`` section in words: the summary row of a block-scaled run (MXFP8, NVFP4,
blockwise FP8) and report.md's table of its layers' counts.

The section (:func:`mptrain.precision.quant.convert.apply_quantized`, with the counts of
:meth:`~mptrain.precision.quant.convert.BlockLayers.layer_stats` as ``final_layer_stats``) says
per operand role (input, weight, grad) the element and scale formats and the block shape; the
format's settings; the share of the Linear layers' FLOPs in each format; per Linear whether it
converted and why not; and per converted layer and role the quantizations counted on the metrics
rows with their saturated and underflowed elements and their zero and non-finite blocks.
"""

from __future__ import annotations

from typing import Any

_SETTINGS = ("scale_rounding", "weight_tiles", "hadamard", "stochastic_rounding")


def _pct(x: float) -> str:
    return f"{100 * x:.2f}%"


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
    shares = ", ".join(f"{fmt} {_pct(x)}" for fmt, x in section["linear_flops_share"].items())
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
                f"{_pct(c['saturated'] / elements)} | {_pct(c['underflows'] / elements)} | "
                f"{_pct(c['zero_blocks'] / blocks)} | {_pct(c['nonfinite_blocks'] / blocks)} |"
            )
    return lines
