"""MX (OCP Microscaling) formats: MXFP8 (E4M3 or E5M2 elements) and MXFP4 (E2M1), blocks of 32
consecutive elements along the GEMM's reduction dimension, one E8M0 scale (a power of two,
``torch.float8_e8m0fnu``) per block.

Spec: OCP Microscaling Formats (MX) v1.0 (2023), section 6.3 (the conversion: the shared
exponent is floor(log2(amax)) minus the element format's largest exponent, 8 for E4M3, 15 for
E5M2, 2 for E2M1) and 5.4.1 (E8M0: bias 127, exponents -127..127, 0xFF is NaN). Two scale
roundings, as torchao's ``ScaleCalculationMode``:

- ``floor`` (the OCP spec): the shared exponent above. amax / scale lies in [2^emax, 2^(emax+1)),
  whose top lies past the element format's max: for E4M3 a block whose amax / scale reaches 464
  (of [256, 512), the top 3/16 of the binade) has its largest elements saturated.
- ``rceil`` (NVIDIA cuBLAS, "Computing scaling and conversion factors for FP8 with UE8M0 scales";
  Transformer Engine's MXFP8 quantization): the scale is amax / max (a correctly rounded FP32
  quotient) rounded *up* to a power of two (PTX ``cvt.rp.satfinite.ue8m0x2.f32``): nothing
  saturates.

Equal bit for bit to torchao 0.18's ``to_mx`` (mx_formats/mx_tensor.py) on the CPU, elements and
scales, with its conventions for the edges (tests/precision/test_blocks_torchao.py):

- an all-zero block gets scale 2^-127 (code 0) and zero elements;
- ``floor``: a block whose scale is 2^-127 (amax below 2^-118 for E4M3) is divided by 2^-126
  (torchao's clamp to FP32's smallest normal: Triton flushes 2^-127), so dequantized it comes out
  half the input; a NaN block gets code 255 (NaN), its finite elements 0; an inf block gets
  2^(128 - emax), its inf elements the format's max;
- ``rceil`` (as Transformer Engine): code 0 multiplies by 1 (the block is below 448 x 2^-127:
  all its elements round to zero), an inf amax gives code 254 and elements multiplied by 2^-127
  (inf saturates to max), a NaN amax code 255 and an all-NaN block.

One deliberate difference: torchao's eager ``rceil`` computes ceil(log2(amax / max)) with
``torch.log2``, which rounds to the integer for FP32 values up to ~22 ulps above a power of two,
so its scale for such a block is one binade too small (and the block's largest elements
saturate). Here the rounding up is exact, as in the PTX instruction torchao itself uses on
SM100 and in cuBLAS; the test measures how rare such blocks are.

``data * scale`` is what the GEMM multiplies (:meth:`BlockQuantized.dequantize`): exact in FP32
(down to 2^-136), which mptrain's emulation multiplies; where it is not in BF16:
docs/precisions.md, *Checked against torchao*.
"""

from __future__ import annotations

import torch

from mptrain.config.format_table import FORMAT_TABLE, MXFP8
from mptrain.precision.quant.blocked import (
    BlockQuantized,
    assemble,
    check_choice,
    element_max,
    finish,
    split_input,
)
from mptrain.precision.quant.e2m1 import E2M1
from mptrain.precision.quant.fp8 import E4M3, E5M2, pow2_floor

MX_BLOCK = FORMAT_TABLE[MXFP8].block  # 32
MX_ELEMENT_DTYPES = (E4M3, E5M2, E2M1)
SCALE_ROUNDINGS = ("floor", "rceil")
# The exponent of each element format's largest power of two: 448 = 1.75 x 2^8, 57344 = 1.75 x
# 2^15, 6 = 1.5 x 2^2 (OCP MX v1.0, table 2: emax_elem).
ELEMENT_EMAX = {E4M3: 8, E5M2: 15, E2M1: 2}
E8M0_NAN = 255
E8M0_MAX = 254  # 2^127
_FP32_MANTISSA_BITS = 23
_FP32_SMALLEST_NORMAL = 2.0**-126
_FP32_SMALLEST_NORMAL_BITS = 1 << _FP32_MANTISSA_BITS
_MANTISSA_MASK = (1 << _FP32_MANTISSA_BITS) - 1
_EXPONENT_BITS = 0x7F800000
# E8M0's smallest and largest values as FP32 bits: 2^-127 (an FP32 subnormal) and 2^127.
_E8M0_SMALLEST = 2.0**-127
_E8M0_SMALLEST_BITS = 1 << (_FP32_MANTISSA_BITS - 1)
_E8M0_LARGEST_BITS = E8M0_MAX << _FP32_MANTISSA_BITS
# 2^127's bits minus 1.0's: what turns rceil's reciprocal of 2^-127 into 1 (code 0)
_CODE0_MULTIPLIER_BITS = 0x7F000000 - 0x3F800000


def quantize_mx(
    x: torch.Tensor,
    dim: int = -1,
    *,
    elem_dtype: torch.dtype = E4M3,
    rounding: str = "floor",
    stats: bool = False,
) -> BlockQuantized:
    """``x`` (FP32, BF16 or FP16) in MX format along ``dim``: blocks of 32, E8M0 scales rounded
    ``floor`` or ``rceil``, elements ``elem_dtype`` (E4M3, E5M2, or ``torch.float4_e2m1fn_x2``:
    MXFP4, packed two per byte); with ``stats``, the counts. ``data`` and ``scale`` hold ``dim``
    last (blocked.py); the size of ``dim`` must be a multiple of 32 (ValueError otherwise, as
    torchao refuses it)."""
    fmt = "MX"
    check_choice("elem_dtype", elem_dtype, MX_ELEMENT_DTYPES, fmt)
    check_choice("rounding", rounding, SCALE_ROUNDINGS, fmt)
    blocks = split_input(x, dim, (1, MX_BLOCK), fmt)
    amax = blocks.amax()
    codes, multiplier = scale_codes(amax, elem_dtype, rounding)
    data, counts = finish(blocks, multiplier, amax, elem_dtype, stats=stats)
    return assemble(blocks, data, codes.view(torch.float8_e8m0fnu), counts)


def fake_quant_mx(
    x: torch.Tensor, dim: int = -1, *, elem_dtype: torch.dtype = E4M3, rounding: str = "floor"
) -> torch.Tensor:
    """``x`` quantized to MX along ``dim`` (:func:`quantize_mx`) and dequantized, in ``x``'s
    dtype and layout: the operand an emulated MX GEMM multiplies (torchao's emulation too)."""
    return quantize_mx(x, dim, elem_dtype=elem_dtype, rounding=rounding).dequantize(x.dtype)


def scale_codes(
    amax: torch.Tensor, elem_dtype: torch.dtype, rounding: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(E8M0 codes, the multiplier that scales a block's elements) of blocks with ``amax``
    under ``rounding`` (floor | rceil): what the quantizer and the fast fake quantization share."""
    if rounding == "floor":
        codes = floor_codes(amax, ELEMENT_EMAX[elem_dtype])
        # torchao divides by the scale, clamped to FP32's smallest normal (code 0 divides by
        # 2^-126); dividing by a power of two is multiplying by its exact reciprocal, and
        # code 255 (an FP32 inf) by 0.
        return codes, code_value(codes).clamp(min=_FP32_SMALLEST_NORMAL).reciprocal()
    codes = rceil_codes(amax, element_max(elem_dtype))
    multiplier = torch.where(codes == 0, 1.0, code_value(codes).reciprocal())
    return codes, torch.where(codes == E8M0_NAN, torch.nan, multiplier)


def scale_factors(
    amax: torch.Tensor, elem_dtype: torch.dtype, rounding: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the multiplier of :func:`scale_codes`, the value its code stands for in E8M0: code 0
    2^-127), both FP32, of blocks with the FP32 amaxes ``amax``; a NaN block gets NaN for both
    (its dequantized elements are NaN either way). What the fast fake quantization multiplies
    by: the same values computed from FP32 bits, without the uint8 codes, the E8M0 cast or any
    boolean mask (a few integer passes over the amaxes: masks cost ten times more on the CPU)."""
    if rounding == "floor":
        # floor_codes's code as FP32 bits: amax's exponent field minus emax (code 0 at or below
        # zero, where the E8M0 value is 2^-127 and torchao's divisor 2^-126)
        bits = (amax.view(torch.int32) & _EXPONENT_BITS) - (ELEMENT_EMAX[elem_dtype] << 23)
        multiplier = bits.clamp(min=_FP32_SMALLEST_NORMAL_BITS).view(torch.float32).reciprocal()
        scale = bits.clamp_(min=_E8M0_SMALLEST_BITS).view(torch.float32)
    else:
        # rceil_codes's code: amax / max rounded up to a power of two, clamped to [2^-127,
        # 2^127]; adding an all-ones mantissa carries into the exponent unless it is zero.
        descale = amax / torch.full_like(amax, element_max(elem_dtype))
        bits = descale.view(torch.int32).clamp(_E8M0_SMALLEST_BITS, _E8M0_LARGEST_BITS)
        # code 0 (descale at most 2^-127): 1 there, else 0
        code0 = bits.clamp(max=_E8M0_SMALLEST_BITS + 1).neg_().add_(_E8M0_SMALLEST_BITS + 1)
        bits.add_(_MANTISSA_MASK).bitwise_and_(_EXPONENT_BITS)  # 2^-126 for code 0: halved
        scale = bits.sub_(code0.bitwise_left_shift(_FP32_MANTISSA_BITS - 1)).view(torch.float32)
        multiplier = scale.reciprocal()  # 2^127 for code 0, where it multiplies by 1
        multiplier.view(torch.int32).sub_(code0.mul_(_CODE0_MULTIPLIER_BITS))
    # NaN (amax NaN) into both: maximum propagates it and leaves the rest (all at least 2^-127)
    nan = amax.clamp(max=_E8M0_SMALLEST)
    return torch.maximum(multiplier, nan), torch.maximum(scale, nan)


def floor_codes(amax: torch.Tensor, emax: int) -> torch.Tensor:
    """E8M0 codes (uint8) of the OCP spec's scales 2^(floor(log2(amax)) - emax) for the FP32
    amaxes ``amax``: clamped to [2^-127, 2^127] (amax zero or subnormal: code 0), inf gives
    2^(128 - emax), NaN code 255."""
    # pow2_floor clears the mantissa: its exponent field is floor(log2(amax)) + 127 for a normal
    # amax, 0 for zero and subnormals, 255 for inf and NaN.
    exponent = pow2_floor(amax).view(torch.int32) >> _FP32_MANTISSA_BITS
    codes = (exponent - emax).clamp(0, E8M0_NAN)
    return torch.where(torch.isnan(amax), E8M0_NAN, codes).to(torch.uint8)


def rceil_codes(amax: torch.Tensor, elem_max: float) -> torch.Tensor:
    """E8M0 codes (uint8) of amax / ``elem_max`` rounded up to a power of two, saturating at
    2^127 (inf included: code 254), zero and up to 2^-127 giving code 0, NaN code 255."""
    # A tensor divisor: an FP32 division on every device (CUDA turns a Python divisor into a
    # multiplication by its rounded reciprocal).
    descale = amax / torch.full_like(amax, elem_max)
    bits = descale.view(torch.int32)
    exponent = bits >> _FP32_MANTISSA_BITS
    mantissa = bits & _MANTISSA_MASK
    # Normal: the exponent, one up if any mantissa bit is set. Subnormal (exponent field 0): above
    # 2^-127 (mantissa above its half) rounds up to 2^-126, code 1; the rest to code 0.
    codes = torch.where(
        exponent == 0, mantissa > (1 << (_FP32_MANTISSA_BITS - 1)), exponent + (mantissa != 0)
    )
    codes = torch.where(torch.isnan(descale), E8M0_NAN, codes.clamp(max=E8M0_MAX))
    return codes.to(torch.uint8)


def code_value(codes: torch.Tensor) -> torch.Tensor:
    """2^(code - 127) in FP32 for E8M0 codes 1-254, as the FP32 bits with ``code`` as exponent:
    code 0 gives 0.0 and code 255 inf (not E8M0's 2^-127 and NaN: the callers' conventions)."""
    return (codes.to(torch.int32) << _FP32_MANTISSA_BITS).view(torch.float32)
