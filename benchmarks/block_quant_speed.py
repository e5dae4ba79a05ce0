"""The emulated block formats' cost on a CPU, per part: one Linear's forward and backward in each
format against FP32's, and what it spends on quantizing and on its GEMMs.

    python -m benchmarks.block_quant_speed [--tokens 4096] [--shapes 128x384,128x128,128x512,512x128]
        [--formats mxfp8,nvfp4,fp8_blockwise] [--rounds 20] [--out FILE]

Shapes are ``in_features x out_features``, multiples of every format's block (128 for
blockwise FP8), as are the tokens. Defaults: the default GPT's four Linears (``task=lm``: width 128, batch 32 x 128 tokens; qkv,
attention projection, MLP up and down). Per format, summed over the shapes:

- ``step``: ``BlockLinear`` forward and backward (the emulation a training step runs: six
  quantizations, three FP32 GEMMs, the bias) against ``nn.Linear``'s;
- ``quantize``: the six fast fake quantizations alone (each operand along its GEMM's
  reduction dimension, as ``BlockLinear`` calls them; a tiled weight's once);
- ``gemm``: the three FP32 GEMMs of the dequantized operands alone (``nn.Linear``'s three
  products cost the same).

Timed in one process on one thread (``torch.set_num_threads(1)``), the variants alternating
round after round so that the load others put on a shared machine falls on all of them alike;
each figure is the minimum and the median over ``--rounds`` of the thread's CPU time (steadier
than wall time when others share the cores) with the wall time's minimum beside it. Prints a
table and writes the figures with ``--out``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks.jsondoc import write_json
from benchmarks.mptrain_api import (
    BlockLinear,
    BlockQuantization,
    fake_quant_operand,
    hardware_info,
    software_versions,
)

RECIPES = {
    "mxfp8": BlockQuantization("mxfp8"),
    "nvfp4": BlockQuantization("nvfp4", weight_tiles=True, hadamard=True, stochastic_rounding=True),
    "fp8_blockwise": BlockQuantization("fp8_blockwise"),
}


def layer_step(layer: nn.Module, x: torch.Tensor, dy: torch.Tensor) -> Callable[[], None]:
    """One forward and backward of ``layer`` (gradients set to None first, as a training step)."""

    def run() -> None:
        layer.zero_grad(set_to_none=True)
        layer(x.detach().requires_grad_()).backward(dy)

    return run


def quantizations(recipe: BlockQuantization, x, w, dy) -> Callable[[], None]:
    """BlockLinear's six fake quantizations (linear.py's dims, slots and layouts; NVFP4's
    gradients stochastically rounded where the recipe says so; its Hadamard transform not
    included: the step's figure has it)."""
    generator = torch.Generator().manual_seed(0)

    def run() -> None:
        for t, dim, role, slot, keep in (
            (x, 1, "input", "a", False),
            (w, 1, "weight", "b", False),
            (dy, 1, "grad", "a", False),
            (w, 0, "weight", "b", True),
            (dy, 0, "grad", "a", True),
            (x, 0, "input", "b", True),
        ):
            if role == "weight" and keep and recipe.tiled_weight:
                continue  # the forward's tiles serve the backward
            fake_quant_operand(
                recipe, t, dim, role, generator=generator, out=slot, keep_layout=keep
            )

    return run


def gemms(x, w, dy) -> Callable[[], None]:
    """The three FP32 GEMMs of a Linear's step on operands in BlockLinear's layouts."""

    def run() -> None:
        torch.mm(x, w.t())
        torch.mm(dy, w)
        torch.mm(dy.t(), x)

    return run


def variants(args: argparse.Namespace) -> dict[str, list[Callable[[], None]]]:
    """Per variant name, its callables (one per shape), on seeded data."""
    generator = torch.Generator().manual_seed(0)
    runs: dict[str, list[Callable[[], None]]] = {"fp32 step": [], "fp32 gemm": []}
    for shape in args.shapes.split(","):
        fan_in, fan_out = (int(n) for n in shape.split("x"))
        x = torch.randn(args.tokens, fan_in, generator=generator)
        dy = torch.randn(args.tokens, fan_out, generator=generator)
        linear = nn.Linear(fan_in, fan_out)
        w = linear.weight.detach()
        runs["fp32 step"].append(layer_step(linear, x, dy))
        runs["fp32 gemm"].append(gemms(x, w, dy))
        for fmt in args.formats.split(","):
            recipe = RECIPES[fmt]
            block = BlockLinear.from_linear(nn.Linear(fan_in, fan_out), recipe)
            runs.setdefault(f"{fmt} step", []).append(layer_step(block, x, dy))
            runs.setdefault(f"{fmt} quantize", []).append(quantizations(recipe, x, w, dy))
    return runs


def measure(runs: dict[str, list[Callable[[], None]]], rounds: int) -> dict[str, dict[str, float]]:
    """Per variant: CPU and wall milliseconds (min, median) over alternating rounds."""
    cpu: dict[str, list[float]] = {name: [] for name in runs}
    wall: dict[str, list[float]] = {name: [] for name in runs}
    for round_ in range(rounds + 2):  # two warm-up rounds (scratch buffers, caches)
        for name, calls in runs.items():
            start_wall, start_cpu = time.perf_counter(), time.thread_time()
            for call in calls:
                call()
            if round_ >= 2:
                cpu[name].append(1000 * (time.thread_time() - start_cpu))
                wall[name].append(1000 * (time.perf_counter() - start_wall))
    return {
        name: {
            "cpu_ms_min": min(cpu[name]),
            "cpu_ms_median": statistics.median(cpu[name]),
            "wall_ms_min": min(wall[name]),
        }
        for name in runs
    }


def markdown(figures: dict[str, dict[str, float]]) -> str:
    base = figures["fp32 step"]
    lines = [
        "| variant | CPU ms min | CPU ms median | wall ms min | × FP32 step (min) | × (median) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, f in figures.items():
        lines.append(
            f"| {name} | {f['cpu_ms_min']:.1f} | {f['cpu_ms_median']:.1f} | {f['wall_ms_min']:.1f} "
            f"| {f['cpu_ms_min'] / base['cpu_ms_min']:.2f} "
            f"| {f['cpu_ms_median'] / base['cpu_ms_median']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--shapes", default="128x384,128x128,128x512,512x128")
    parser.add_argument("--formats", default=",".join(RECIPES))
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    unknown = [f for f in args.formats.split(",") if f not in RECIPES]
    if unknown:
        parser.error(f"--formats: any of {', '.join(RECIPES)}; got {unknown}")
    if args.tokens % 128:  # every format's block divides it: the quantizations need no padding
        parser.error(f"--tokens: a multiple of 128, got {args.tokens}")
    torch.set_num_threads(1)
    load_before = os.getloadavg()[0]
    figures = measure(variants(args), args.rounds)
    doc: dict[str, Any] = {
        "hardware": hardware_info(torch.device("cpu")),
        "versions": software_versions(),
        "args": {k: str(v) for k, v in vars(args).items()},
        "load": [load_before, os.getloadavg()[0]],
        "figures": figures,
        "markdown": markdown(figures),
    }
    write_json(args.out, doc)
    print(doc["markdown"])
    print(f"load average {load_before:.1f}–{doc['load'][1]:.1f}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
