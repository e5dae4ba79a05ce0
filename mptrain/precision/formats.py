"""The precisions that compute Linear layers in a format of their own: :data:`LAYER_FORMATS`,
what each format's layers are, keyed by layer format (:func:`format_of`), the one conversion into
them (:func:`convert_layers`) and back (:func:`to_plain_linear`).

A layer format is a subclass of ``nn.Linear`` that shares the converted layer's Parameter objects
(``weight``, ``bias``), so an optimizer built on the model, its FP32 state and a data-parallel
wrapper keep working across a conversion either way (a precision schedule:
:mod:`mptrain.train.switch`); it may add buffers of its own (scales, histories) and generators.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from mptrain.config.base import ConfigError
from mptrain.config.format_table import BLOCK_FORMATS, FORMAT_TABLE, FP8, FP8_BLOCKWISE
from mptrain.config.run import RunConfig
from mptrain.data.batches import DataBundle
from mptrain.platform.distributed import DistContext
from mptrain.precision.gemm_plans import check_matched, gemm_plans
from mptrain.precision.policy import PrecisionPolicy
from mptrain.precision.quant.block_linear import BlockGemm, BlockLinear
from mptrain.precision.quant.block_quant import BlockQuantization
from mptrain.precision.quant.convert import (
    BlockLayers,
    Quantization,
    apply_quantized,
    fp8_layer_stats,
    layer_rules,
)
from mptrain.precision.quant.dist import FP8Sync, build_fp8_sync
from mptrain.precision.quant.fp8_linear import Float8Linear, fp8_gemm_format
from mptrain.precision.selection import skip_summary


@dataclass(frozen=True)
class LayerFormat:
    """What a format's Linear layers are: ``layer_types`` (subclasses of ``nn.Linear`` sharing the
    converted layers' Parameters), ``final_stats(model)``: the per-layer figures the report shows
    at the end of the format's use (the section's ``final_layer_stats``; reads device values), and
    ``report``: the report section the format's section is (``fp8`` or ``blocks``;
    :func:`run_sections`). All convert through :func:`convert_layers`."""

    layer_types: tuple[type[nn.Linear], ...]
    final_stats: Callable[[nn.Module], list[dict[str, Any]]]
    report: str


def _require_converted(
    cfg: RunConfig, precision: str, fmt: str, layers: list[dict[str, Any]], key: str
) -> None:
    """ConfigError when no Linear layer converted: the run would compute in plain layers."""
    if not any(layer["converted"] for layer in layers):
        raise ConfigError(
            f"precision={precision}: no Linear layer of model={cfg.model.name} can run in {fmt} "
            f"({skip_summary(layers)}); see {key}.include/exclude/keep_first_last/min_features"
        )


def _quantization(policy: PrecisionPolicy, cfg: RunConfig, fsdp: bool) -> Quantization:
    """``policy``'s quantization as the build applies it: FP8's with torchao's FP8
    all-gather under FSDP2, a block format's seeded from the run's ``seed`` (its layers' Hadamard
    signs and stochastic-rounding generators: the same at the build and at a switch, so a resume
    finds them alike)."""
    if policy.blocks is not None:
        return replace(policy.blocks, seed=cfg.seed)
    assert policy.fp8 is not None  # format_of: a precision with a layer format has a quantization
    return replace(policy.fp8, fsdp_float8_all_gather=fsdp)


def _block_stats(model: nn.Module) -> list[dict[str, Any]]:
    return BlockLayers.of(model).layer_stats()


# The one registry: a layer format's name (format_of) -> its layers and report section.
# Precisions without an entry compute with plain nn.Linear layers (under their autocast dtype).
LAYER_FORMATS: dict[str, LayerFormat] = {
    FP8: LayerFormat((Float8Linear,), fp8_layer_stats, "fp8"),
    **dict.fromkeys(BLOCK_FORMATS, LayerFormat((BlockLinear,), _block_stats, "blocks")),
}


def format_of(policy: PrecisionPolicy) -> str | None:
    """The key of :data:`LAYER_FORMATS` that ``policy``'s Linear layers compute in: the block
    quantization's format (mxfp8, nvfp4, fp8_blockwise) for a block-scaled precision, else the
    precision's name; None for a precision of plain nn.Linear layers."""
    name = policy.blocks.format if policy.blocks is not None else policy.name
    return name if name in LAYER_FORMATS else None


def layer_format(precision: str, granularity: str | None = None) -> str | None:
    """:func:`format_of` from names alone, before any policy is resolved (the roofline's
    accounting): the key of :data:`LAYER_FORMATS` precision ``precision`` computes its Linear
    layers in, FP8 scaled per ``granularity`` (``blockwise``: fp8_blockwise); None for a
    precision of plain nn.Linear layers (tf32 included)."""
    name = FP8_BLOCKWISE if precision == FP8 and granularity == "blockwise" else precision
    return name if name in LAYER_FORMATS else None


def convert_layers(
    model: nn.Module,
    policy: PrecisionPolicy,
    cfg: RunConfig,
    data: DataBundle,
    fsdp: bool = False,
) -> dict[str, Any] | None:
    """Convert ``model``'s layers into ``policy``'s format, if it has one (see
    :class:`LayerFormat`); its report section, or None for a precision of plain layers. The one
    conversion of every layer format: the eligible Linear layers, selected by the format's config
    group (fp8.*, mx.*, nvfp4.*), become its layers, with the plan of ``precision.gemms``."""
    name = format_of(policy)
    if name is None:
        return None
    quantization = _quantization(policy, cfg, fsdp)
    key = FORMAT_TABLE[name].config_group
    rules = getattr(cfg, key)  # the format's settings group: its layer selection
    blocks = isinstance(quantization, BlockQuantization)  # else FP8 per tensor or row
    own = BlockGemm(quantization) if blocks else fp8_gemm_format(quantization)
    device = next(model.parameters()).device  # the per-GEMM formats' real-or-emulated choice
    plans = gemm_plans(cfg, policy, own, device)
    sample, _ = next(iter(data.val.batches(0)))  # each Linear's FLOPs: counted on two samples
    section = apply_quantized(
        model,
        quantization,
        sample[:2],
        layer_rules(quantization, list(rules.include), list(rules.exclude), rules.keep_first_last),
        plans=plans,
        backend="builtin" if blocks else cfg.fp8.backend,
    )
    if not blocks:
        section["compile"] = cfg.compile  # the report's model section counts graphs and breaks
    label = quantization.row.label if blocks else FORMAT_TABLE[FP8].label
    _require_converted(cfg, policy.name, label, section["layers"], key)
    if plans is not None:
        section.update(check_matched(plans, section["layers"]))
    return section


def run_sections(
    model: nn.Module, *placed: tuple[PrecisionPolicy, dict[str, Any] | None]
) -> tuple[dict[str, Any] | None, BlockLayers]:
    """Where a run keeps its formats' report sections: (the ``fp8`` section, ``model``'s
    BlockLinear layers with the ``blocks`` section), from (policy, the section of its format)
    pairs — a precision switch passes the left format's and the entered one's. A format's
    section goes to its entry's ``report``; a plain precision's (None) goes nowhere."""
    sections: dict[str, dict[str, Any] | None] = {"fp8": None, "blocks": None}
    for policy, section in placed:
        name = format_of(policy)
        if name is not None and section is not None:
            sections[LAYER_FORMATS[name].report] = section
    return sections["fp8"], BlockLayers.of(model, sections["blocks"])


def to_plain_linear(model: nn.Module) -> list[str]:
    """Replace, in place, every layer of a registered format by an ``nn.Linear`` holding the same
    Parameter objects (so optimizer state and wrappers carry on); return the names replaced.

    The new layers are made on the meta device: no initialisation runs, no random number is
    drawn, so a run switched here and one resumed past this point stay bit for bit alike. The
    format's own buffers (scales, amax histories) and generators go with the old layers.
    """
    formats = tuple(t for f in LAYER_FORMATS.values() for t in f.layer_types)
    replaced = []
    for name, layer in list(model.named_modules()):
        if not isinstance(layer, formats):
            continue
        with torch.device("meta"):
            plain = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None)
        plain.weight, plain.bias = layer.weight, layer.bias
        plain.train(layer.training)
        model.set_submodule(name, plain)
        replaced.append(name)
    return replaced


def layer_sync(
    model: nn.Module,
    dist: DistContext,
    cfg: RunConfig,
    policy: PrecisionPolicy,
    section: dict[str, Any] | None,
) -> tuple[FP8Sync, dict[str, Any] | None]:
    """What the ranks agree on for the wrapped ``model``'s FP8 layers (nothing for other formats,
    block-scaled FP8 included: no delayed state, or a single process), and the format's
    ``section`` with a record of it."""
    if section is None or format_of(policy) != "fp8":
        return FP8Sync(), section
    fp8_sync = build_fp8_sync(model, dist, cfg.fp8.backend, policy.fp8)
    return fp8_sync, {**section, **fp8_sync.describe()}
