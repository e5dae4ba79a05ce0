"""Blockwise FP8 (DeepSeek-V3): FP8 elements with one FP32 scale per 1x128 tile of an activation
or gradient (128 consecutive elements along the GEMM's reduction dimension) or per 128x128
block of a weight.

Spec: DeepSeek-AI, "DeepSeek-V3 Technical Report" (arXiv 2412.19437), section 3.3.2 ("fine-grained
quantization": 1x128 activation tiles, 128x128 weight blocks, E4M3 everywhere, online scales from
each tile's amax). Transformer Engine's ``Float8BlockScaling`` and torchao's
``blockwise_fp8_training`` follow it; Hopper runs it with ``torch._scaled_mm``'s BlockWise1x128 /
BlockWise128x128 scaling.

Numerics, mptrain's FP8 quantization (:mod:`mptrain.precision.quant.fp8`) per block: the scale
is 448 / amax (``scale_from_amax``: a correctly rounded FP32 quotient, amax at least 1e-12),
elements x x scale saturated to ±448 and rounded to E4M3; the stored ``scale`` is its reciprocal
(the dequantization multiplier, what torchao and the GEMM read). Equal bit for bit to torchao
0.18's pure-torch references (``torch_blockwise_scale_act_quant_lhs`` / ``_rhs``,
``torch_blockwise_scale_weight_quant``, which divide in FP64 and round to FP32: the same
quotient), zero, inf and NaN blocks included: a zero block gets scale 448 / 1e-12, an inf block
scale 0 (its finite elements 0, its inf NaN), a NaN block NaN. The one exception, BF16 tiles
below 1e-12 in the ``_rhs`` reference (which clamps in the input's dtype; here FP32, as its
Triton kernels): docs/precisions.md, *Checked against torchao*.
"""

from __future__ import annotations

import torch

from mptrain.config.format_table import FORMAT_TABLE, FP8_BLOCKWISE
from mptrain.precision.quant.blocked import (
    BlockQuantized,
    assemble,
    check_choice,
    finish,
    split_input,
)
from mptrain.precision.quant.fp8 import E4M3, E5M2, scale_from_amax

BLOCKWISE_BLOCK = FORMAT_TABLE[FP8_BLOCKWISE].block  # 128
BLOCKWISE_ELEMENT_DTYPES = (E4M3, E5M2)


def quantize_blockwise(
    x: torch.Tensor,
    dim: int = -1,
    *,
    tile_2d: bool = False,
    elem_dtype: torch.dtype = E4M3,
    stats: bool = False,
) -> BlockQuantized:
    """``x`` (FP32, BF16 or FP16) in blockwise FP8 along ``dim``: 1x128 tiles (activations,
    gradients) or, with ``tile_2d``, 128x128 blocks of a 2-D ``x`` (weights); FP32 scales
    (the dequantization multipliers); with ``stats``, the counts. ``data`` and ``scale`` hold
    ``dim`` last (blocked.py); sizes must be multiples of 128 (ValueError otherwise, as torchao
    refuses them)."""
    fmt = "blockwise FP8"
    check_choice("elem_dtype", elem_dtype, BLOCKWISE_ELEMENT_DTYPES, fmt)
    block = (BLOCKWISE_BLOCK, BLOCKWISE_BLOCK) if tile_2d else (1, BLOCKWISE_BLOCK)
    blocks = split_input(x, dim, block, fmt)
    amax = blocks.amax()
    scale = scale_from_amax(amax, elem_dtype)
    data, counts = finish(blocks, scale, amax, elem_dtype, stats=stats)
    return assemble(blocks, data, scale.reciprocal(), counts)


def fake_quant_blockwise(
    x: torch.Tensor, dim: int = -1, *, tile_2d: bool = False, elem_dtype: torch.dtype = E4M3
) -> torch.Tensor:
    """``x`` quantized to blockwise FP8 along ``dim`` (:func:`quantize_blockwise`) and
    dequantized, in ``x``'s dtype and layout: the operand an emulated blockwise GEMM multiplies."""
    quantized = quantize_blockwise(x, dim, tile_2d=tile_2d, elem_dtype=elem_dtype)
    return quantized.dequantize(x.dtype)
