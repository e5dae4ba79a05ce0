"""The FP16 range probe (:func:`range_probe`, :func:`render_probe`): measures, in FP32, how far
activations sit below FP16's maximum and how many gradient values FP16 would flush to zero. The
model is left as it was found. How modules are named:
:func:`~mptrain.precision.diagnostics.hooks.module_label`.
"""

from __future__ import annotations

import copy
import functools
import itertools
import math
from typing import Any

import torch
from torch import nn

from mptrain.models.task import cross_entropy
from mptrain.precision.diagnostics.hooks import (
    FP16_MAX,
    FP16_MIN_SUBNORMAL,
    installed,
    leaf_modules,
    max_finite,
    on_output_gradient,
    row_label,
    tensors_in,
)


# ------------------------------------------------------------------------------ FP16 range probe
class _RangeStats:
    """Per leaf module, running over all probed batches: the largest activation and gradient
    magnitudes, how many non-zero gradient values were seen, and how many of them would flush to
    zero in FP16 unscaled and at ``loss_scale``. Entries appear in first-forward order;
    ``types`` holds each leaf's class name."""

    def __init__(self, loss_scale: float, types: dict[str, str]) -> None:
        self.loss_scale = loss_scale
        self.types = types
        self.stats: dict[str, dict[str, float]] = {}

    def entry(self, name: str) -> dict[str, float]:
        return self.stats.setdefault(
            name,
            {
                "act_max": 0.0,
                "grad_max": 0.0,
                "grad_values": 0,
                "under_unscaled": 0,
                "under_scaled": 0,
            },
        )

    def activation(self, name: str, module: nn.Module, inputs: Any, output: Any) -> None:
        e = self.entry(name)
        e["act_max"] = max(e["act_max"], max_finite(tensors_in(output)))

    def gradient(self, name: str, grad: torch.Tensor) -> None:
        e = self.entry(name)
        nonzero = grad.detach().abs()[grad.detach() != 0]
        e["grad_max"] = max(e["grad_max"], float(nonzero.max()) if nonzero.numel() else 0.0)
        e["grad_values"] += nonzero.numel()
        e["under_unscaled"] += int((nonzero < FP16_MIN_SUBNORMAL).sum())
        e["under_scaled"] += int((nonzero * self.loss_scale < FP16_MIN_SUBNORMAL).sum())


def _measure_ranges(
    model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], loss_scale: float
) -> _RangeStats:
    """Forward + backward each batch through an FP32 copy of ``model``; return the per-leaf stats.

    The model itself is not touched; the torch RNG state is restored afterwards.
    """
    rng = torch.get_rng_state()
    # Probe an FP32 copy: the true magnitudes, whatever dtype the run keeps its weights in.
    probe_model = copy.deepcopy(model).float()
    leaves = leaf_modules(probe_model)
    ranges = _RangeStats(loss_scale, {n: type(m).__name__ for n, m in leaves})
    registrations = itertools.chain(
        (m.register_forward_hook(functools.partial(ranges.activation, n)) for n, m in leaves),
        (
            m.register_forward_hook(on_output_gradient(functools.partial(ranges.gradient, n)))
            for n, m in leaves
        ),
    )
    try:
        with installed(registrations):
            for images, labels in batches:
                probe_model.zero_grad(set_to_none=True)
                inputs = images.float() if images.is_floating_point() else images  # token ids stay
                loss = cross_entropy(probe_model(inputs), labels)
                loss.backward()
    finally:
        torch.set_rng_state(rng)
    return ranges


def _layer_row(name: str, module_type: str | None, e: dict[str, float]) -> dict[str, Any]:
    """One ``layers`` row of the probe: maxima, headroom to 65504 and underflow fractions."""
    n = e["grad_values"]
    return {
        "module": name,
        "module_type": module_type,
        "activation_max": e["act_max"],
        "headroom_to_fp16_max": FP16_MAX / e["act_max"] if e["act_max"] else math.inf,
        "gradient_max": e["grad_max"],
        "underflow_unscaled_fraction": e["under_unscaled"] / n if n else 0.0,
        "underflow_at_scale_fraction": e["under_scaled"] / n if n else 0.0,
    }


def _probe_verdict(overflow: list[str], unscaled: float, scaled: float, loss_scale: float) -> str:
    """Forward overflow first (scaling cannot fix it), then underflow needing scaling, else safe."""
    if overflow:
        return (
            f"FP16 overflows in the forward at {', '.join(overflow)} → use BF16, or keep those "
            "layers in FP32 (numerics.fp32_modules)"
        )
    if unscaled > 1e-3:
        return (
            f"FP16 needs loss scaling: {unscaled:.2%} of gradient values would flush to zero "
            f"unscaled, {scaled:.2%} at scale {loss_scale:g}"
        )
    return "FP16 safe: activations below 65504 and gradients above FP16's smallest subnormal"


def _summarise_ranges(ranges: _RangeStats) -> dict[str, Any]:
    """Turn the per-leaf stats into the probe result: totals over all leaves and a verdict."""
    stats, loss_scale = ranges.stats, ranges.loss_scale
    layers = [_layer_row(name, ranges.types.get(name), e) for name, e in stats.items()]
    total = sum(e["grad_values"] for e in stats.values())
    under = sum(e["under_unscaled"] for e in stats.values())
    under_scaled = sum(e["under_scaled"] for e in stats.values())
    overflow = [layer for layer in layers if layer["activation_max"] > FP16_MAX]
    unscaled = under / total if total else 0.0
    scaled = under_scaled / total if total else 0.0
    return {
        "verdict": _probe_verdict([row_label(x) for x in overflow], unscaled, scaled, loss_scale),
        "loss_scale": loss_scale,
        "underflow_unscaled_fraction": unscaled,
        "underflow_at_scale_fraction": scaled,
        "overflow_modules": [layer["module"] for layer in overflow],
        "layers": layers,
    }


def range_probe(
    model: nn.Module,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    loss_scale: float,
) -> dict[str, Any]:
    """Per leaf module, over ``batches`` in FP32: activation and gradient magnitudes, the share of
    non-zero gradient values FP16 would flush to zero unscaled and at ``loss_scale``, and the
    headroom of activations below 65504. Ends with a verdict. Model state is restored.

    Returns ``{"verdict", "loss_scale", "underflow_unscaled_fraction",
    "underflow_at_scale_fraction", "overflow_modules", "layers"}``; the fractions are over all
    non-zero gradient values of all leaves. Each ``layers`` row names its module by path
    (``module``) and class (``module_type``); ``overflow_modules`` holds plain paths.
    """
    return _summarise_ranges(_measure_ranges(model, batches, loss_scale))


def render_probe(probe: dict[str, Any]) -> str:
    """Markdown for a :func:`range_probe` result: the verdict, then one table row per layer."""
    lines = [
        "# FP16 range probe",
        "",
        f"**Verdict:** {probe['verdict']}",
        "",
        "| module | activation max | headroom to 65504 | gradient max | underflow unscaled | "
        f"underflow at scale {probe['loss_scale']:g} |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for layer in probe["layers"]:
        lines.append(
            f"| {row_label(layer)} | {layer['activation_max']:.4g} | "
            f"{layer['headroom_to_fp16_max']:.4g} | {layer['gradient_max']:.4g} | "
            f"{layer['underflow_unscaled_fraction']:.2%} | {layer['underflow_at_scale_fraction']:.2%} |"
        )
    return "\n".join(lines) + "\n"
