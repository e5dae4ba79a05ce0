"""NVFP4: E2M1 elements in blocks of 16 along the GEMM's reduction dimension, one E4M3 scale per
block, and an FP32 scale per tensor that brings the block scales into E4M3's range.

Spec: NVIDIA, "Pretraining Large Language Models with NVFP4" (arXiv 2509.25149), section 2 and
appendix (the format and its two-level scaling) and section 4 (the training quantization: 16x16
weight blocks, the random Hadamard transform on the weight-gradient GEMM's inputs, stochastic
rounding of gradients); the E2M1 element format is OCP MX v1.0's (:mod:`.e2m1`).

Quantization, as torchao 0.18's ``NVFP4Tensor.to_nvfp4`` (mx_formats/nvfp4_tensor.py,
``nvfp4_quantize``), equal to it bit for bit on the CPU (tests/precision/test_blocks_torchao.py):

- per-tensor scale (``tensor_scale=True``; torchao's ``per_tensor_amax_to_scale``): amax / (448 x 6),
  so the largest block scale lands near E4M3's max; each block scale is (block amax / 6) / that,
  rounded to E4M3 (clamped to [2^-6, 448]); elements are x x ((1 / tensor scale) / block scale),
  clipped to ±6 and rounded to E2M1. Without it the block scale is block amax / 6 itself and
  elements x x (1 / block scale).
- Dequantized: element x (tensor scale x block scale) (FP32).

Where torchao's arithmetic breaks down this module departs from it, on purpose:

- a tensor whose amax is below 448 x 6 x 2^-121 (about 1e-33; zero included) gets the per-tensor
  scale 2^-121 instead of amax / 2688: torchao divides by a zero or tiny per-tensor scale and
  turns an all-zero tensor into NaN (and a tiny one into inf or saturated elements); here it
  quantizes to zeros (and tiny values underflow, counted). Above that amax nothing changes.
- NaN input (torchao: NaN block scale, elements garbage): a NaN block scale, element codes zero.

An inf in the tensor: with the per-tensor scale every block dequantizes to NaN (the per-tensor
scale is inf), as torchao; without it the inf saturates to its block's max (6 x 448), as torchao.
:class:`BlockStats` counts such blocks (``nonfinite_blocks``), which the caller should check.

Options of the training quantization: ``tile_2d`` (one scale per 16x16 tile of a 2-D weight, so
the forward and the backward GEMM see the same quantized weight) and ``generator`` (stochastic
rounding of the elements, for gradients: :func:`.e2m1.encode`'s draws, in the order of
``data``'s layout; the scales still round to nearest). The random Hadamard transform is
:mod:`.hadamard`, applied by the caller before quantizing. torchao's GPU training kernels
(Triton, ``nvfp4_training``) compute the two-level scale in another order and are not compared.
"""

from __future__ import annotations

import torch

from mptrain.config.format_table import FORMAT_TABLE, NVFP4
from mptrain.precision.quant.blocked import BlockQuantized, assemble, finish, split_input
from mptrain.precision.quant.e2m1 import E2M1, E2M1_MAX
from mptrain.precision.quant.fp8 import E4M3, FP8_MAX

NVFP4_BLOCK = FORMAT_TABLE[NVFP4].block  # 16
E4M3_SMALLEST_NORMAL = torch.finfo(E4M3).tiny  # 2^-6: torchao's floor for a block scale
TENSOR_SCALE_DIVISOR = FP8_MAX[E4M3] * E2M1_MAX  # 2688
# The smallest per-tensor scale: (1 / 2^-121) / 2^-6 = 2^127, the largest element multiplier,
# stays finite.
MIN_TENSOR_SCALE = 2.0**-121


def quantize_nvfp4(
    x: torch.Tensor,
    dim: int = -1,
    *,
    tensor_scale: bool = True,
    tile_2d: bool = False,
    generator: torch.Generator | None = None,
    stats: bool = False,
) -> BlockQuantized:
    """``x`` (FP32, BF16 or FP16) in NVFP4 along ``dim``: blocks of 16 (or 16x16 tiles of a 2-D
    ``x`` with ``tile_2d``), E4M3 block scales, with an FP32 per-tensor scale from ``x``'s amax
    (``tensor_scale``), E2M1 elements packed two per byte, rounded to nearest even or
    stochastically from ``generator``; with ``stats``, the counts. ``data`` and ``scale`` hold
    ``dim`` last (blocked.py); sizes must be multiples of 16 (ValueError otherwise, as torchao
    refuses them)."""
    block = (NVFP4_BLOCK, NVFP4_BLOCK) if tile_2d else (1, NVFP4_BLOCK)
    blocks = split_input(x, dim, block, "NVFP4")
    amax = blocks.amax()
    block_scale = amax / torch.full_like(amax, E2M1_MAX)  # an FP32 division on every device
    if tensor_scale:
        scale = nvfp4_tensor_scale(amax.amax())
        scale_e4m3 = _to_e4m3(block_scale / scale)
        multiplier = scale.reciprocal() / scale_e4m3.float()
    else:
        scale = None
        scale_e4m3 = _to_e4m3(block_scale)
        multiplier = scale_e4m3.float().reciprocal()
    data, counts = finish(blocks, multiplier, amax, E2M1, generator, stats)
    return assemble(blocks, data, scale_e4m3, counts, scale)


def fake_quant_nvfp4(
    x: torch.Tensor,
    dim: int = -1,
    *,
    tensor_scale: bool = True,
    tile_2d: bool = False,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """``x`` quantized to NVFP4 along ``dim`` (:func:`quantize_nvfp4`) and dequantized, in
    ``x``'s dtype and layout: the operand an emulated NVFP4 GEMM multiplies."""
    quantized = quantize_nvfp4(
        x, dim, tensor_scale=tensor_scale, tile_2d=tile_2d, generator=generator
    )
    return quantized.dequantize(x.dtype)


def nvfp4_tensor_scale(amax: torch.Tensor) -> torch.Tensor:
    """The FP32 per-tensor scale of a tensor whose amax is ``amax``: amax / (448 x 6) (torchao's
    ``per_tensor_amax_to_scale``), at least 2^-121 (see the module docstring); NaN for NaN."""
    amax = amax.float()
    return (amax / torch.full_like(amax, TENSOR_SCALE_DIVISOR)).clamp(min=MIN_TENSOR_SCALE)


def _to_e4m3(block_scale: torch.Tensor) -> torch.Tensor:
    """Block scales rounded to E4M3, clamped to [2^-6, 448] first (a zero block gets 2^-6)."""
    return block_scale.clamp(min=E4M3_SMALLEST_NORMAL, max=FP8_MAX[E4M3]).to(E4M3)
