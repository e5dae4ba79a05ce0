"""Per-GEMM quantizations (``precision.gemms.forward``, ``.input_grad``, ``.weight_grad``,
``.layers``): the :class:`~mptrain.precision.quant.linear.GemmPlan` of a run's converted Linear
layers. What each key takes, with examples: docs/precisions.md, *A format per GEMM*.

Each key is null (the precision's own format, bit for bit), ``bf16`` or ``fp32`` (that GEMM
unquantized: :class:`~mptrain.precision.quant.linear.HighPrecisionGemm`), or a format of the
precision's family: a layer holds one family's quantizer state (FP8 scalers, or block generators
and counts). Refused (ConfigError, one line naming the key): a key set for a precision without
quantized Linear layers, a format of the other family, delayed FP8 scaling with a mixed plan (its
amax history is one per tensor across the three GEMMs), and the torchao backend (its own Linear).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from mptrain.config.base import ConfigError
from mptrain.config.format_table import BF16, BLOCK_FORMATS, FP8, FP8_BLOCKWISE, FP32
from mptrain.config.run import RunConfig
from mptrain.precision.policy import PrecisionPolicy, block_quantization
from mptrain.precision.quant.block_linear import BlockGemm
from mptrain.precision.quant.fp8_linear import fp8_gemm_format
from mptrain.precision.quant.linear import (
    GEMMS,
    GemmFormat,
    GemmPlan,
    HighPrecisionGemm,
    LayerPlans,
)

HIGH_PRECISION = {FP32: torch.float32, BF16: torch.bfloat16}


def requested(cfg: RunConfig) -> dict[str, str]:
    """The GEMMs ``precision.gemms`` sets, by GEMM name (empty: the precision's own quantization)."""
    gemms = cfg.precision.gemms
    return {g: getattr(gemms, g) for g in GEMMS if getattr(gemms, g) is not None}


def check_gemms(cfg: RunConfig, converting: bool) -> None:
    """ConfigError when ``precision.gemms`` is set but no phase of the run converts its Linear
    layers (``converting``: the precision, or a schedule's other one, has a layer format:
    :func:`own_format` of its policy)."""
    chosen = requested(cfg)
    if chosen and not converting:
        gemm, value = next(iter(chosen.items()))
        raise ConfigError(
            f"precision.gemms.{gemm}={value}: precision={cfg.precision.name} computes no Linear "
            f"layers in a format of its own; per-GEMM formats need precision=fp8, "
            f"{', '.join(BLOCK_FORMATS[1:])} or fp8 with fp8.granularity=blockwise"
        )


def gemm_plans(
    cfg: RunConfig, policy: PrecisionPolicy, own: GemmFormat, device: torch.device
) -> LayerPlans | None:
    """The plan of ``policy``'s converted layers matching ``precision.gemms.layers``, whose own
    GEMM format is ``own``; None when ``precision.gemms`` sets no GEMM (every layer then takes
    its format's uniform plan)."""
    chosen = requested(cfg)
    if not chosen:
        return None
    if cfg.fp8.backend == "torchao" and policy.fp8 is not None:
        raise ConfigError(
            "precision.gemms: not with fp8.backend=torchao (its Float8Linear has one quantization for "
            "all three GEMMs); use fp8.backend=builtin"
        )
    formats = {
        gemm: _format(cfg, gemm, chosen[gemm], own, device) if gemm in chosen else own
        for gemm in GEMMS
    }
    plan = GemmPlan(**formats)
    if policy.fp8 is not None and policy.fp8.scaling == "delayed" and len(plan.formats) > 1:
        gemm, value = next(iter(chosen.items()))
        raise ConfigError(
            f"precision.gemms.{gemm}={value}: fp8.scaling=delayed keeps one amax history per "
            "tensor across the three GEMMs; use fp8.scaling=dynamic with per-GEMM formats"
        )
    return LayerPlans(plan, tuple(cfg.precision.gemms.layers))


def check_matched(plans: LayerPlans, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The format section's ``gemms`` and ``gemm_layers`` entries, once the layers converted
    (``rows``: the section's per-Linear rows); ConfigError when no converted layer matches
    ``precision.gemms.layers``."""
    converted = [row["name"] for row in rows if row["converted"]]
    if not any(plans.for_layer(name) for name in converted):
        raise ConfigError(
            f"precision.gemms.layers={list(plans.patterns)}: no converted layer matches; the "
            f"converted layers are {', '.join(converted)}"
        )
    return {"gemms": plans.plan.describe(), "gemm_layers": list(plans.patterns)}


def own_format(policy: PrecisionPolicy) -> GemmFormat | None:
    """The GEMM format ``policy``'s converted layers run in (None: it converts none)."""
    if policy.blocks is not None:
        return BlockGemm(policy.blocks)
    if policy.fp8 is not None:
        return fp8_gemm_format(policy.fp8)
    return None


def check_switched_gemms(
    cfg: RunConfig, first: PrecisionPolicy, to: PrecisionPolicy, device: torch.device
) -> None:
    """Before training, for a precision schedule: ``precision.gemms`` applies to the one phase
    that converts layers (refused when both do: one plan cannot serve two formats), and that
    phase's plan is checked now, not at the switch (its layer patterns still are: the layers
    are known once they convert)."""
    chosen = requested(cfg)
    if not chosen:
        return
    own = own_format(to)
    if own_format(first) is not None and own is not None:
        gemm, value = next(iter(chosen.items()))
        raise ConfigError(
            f"precision.gemms.{gemm}={value}: precision={first.name} and "
            f"precision.switch.to={to.name} both convert Linear layers; per-GEMM formats apply "
            "to one of them: switch between a converting precision and fp32, bf16 or fp16"
        )
    if own is not None:
        gemm_plans(cfg, to, own, device)


def format_name(cfg: RunConfig, gemm: str, value: str, own: str) -> str:
    """The table's name of the format ``precision.gemms.<gemm>=value`` gives a GEMM of a layer
    converted to ``own`` (a format's name): bf16, fp32, ``own``, or a format of ``own``'s family
    (``fp8`` as ``fp8.*`` sets it: blockwise FP8 under ``fp8.granularity=blockwise``);
    ConfigError for a format of the other family. The run's plan and the roofline's read it."""
    if value == FP8 and cfg.fp8.granularity == "blockwise":
        value = FP8_BLOCKWISE
    block_family = own in BLOCK_FORMATS
    if value in HIGH_PRECISION or value == own or (block_family and value in BLOCK_FORMATS):
        return value
    family = ", ".join(BLOCK_FORMATS) if block_family else FP8
    raise ConfigError(
        f"precision.gemms.{gemm}={value}: precision={cfg.precision.name} converts its layers "
        f"into {own}; a GEMM may run in {family}, {BF16} or {FP32} (a layer holds one family's "
        "quantizer state)"
    )


def _format(
    cfg: RunConfig, gemm: str, value: str, own: GemmFormat, device: torch.device
) -> GemmFormat:
    """The GEMM format ``value`` names for ``gemm`` (see the module doc)."""
    own_name = own.quantization.format if isinstance(own, BlockGemm) else FP8  # the table's name
    value = format_name(cfg, gemm, value, own_name)
    if value in HIGH_PRECISION:
        return HighPrecisionGemm(HIGH_PRECISION[value])
    if value == own_name:
        return own
    fp8 = replace(cfg.fp8, granularity="blockwise")  # fp8_blockwise's own settings group
    name = FP8 if value == FP8_BLOCKWISE else value
    quantization, _ = block_quantization(name, device, fp8, cfg.mx, cfg.nvfp4)
    assert quantization is not None  # every block format has a quantization
    return BlockGemm(replace(quantization, seed=cfg.seed))
