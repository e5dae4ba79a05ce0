"""The emulation's fake quantization: an operand quantized and dequantized in one pass of FP32
arithmetic, the same values, bit for bit, as ``quantize_<format>(...).dequantize(torch.float32)``
(tests/precision/test_block_training.py checks every format, rounding and edge case of
test_blocks_torchao.py) at a fraction of its cost.

Where the time goes otherwise: the CPU casts to and from FP8 element by element (FP8 -> FP32
alone costs more than the FP32 GEMM it feeds), and E2M1 codes are found by comparisons with each
midpoint (or a ``bucketize``). Here an element is rounded to its format's grid without leaving
FP32: for a magnitude ``m`` in the binade ``[2^e, 2^(e+1))`` (``e`` at least the format's smallest
normal exponent, where the subnormal spacing continues), ``(m + c) - c`` with ``c = 2^(e + 23 -
mantissa bits)`` is ``m`` rounded to nearest even at the format's spacing ``2^(e - mantissa
bits)``: the FP32 addition itself rounds (``c``'s ulp is that spacing, and the sum stays in
``c``'s binade). Saturation is a clamp first, as :func:`mptrain.precision.fp8.quant.quantize`
does. Stochastic rounding (NVFP4 gradients) draws the same ``torch.rand`` numbers, in the same
order, as :func:`mptrain.precision.blocks.e2m1.encode` and compares them with the same exact
fraction.

Temporaries live in a per-thread scratch space (:func:`scratch`), reused from call to call:
fresh memory costs a page fault per page, which on a CPU (a VM's above all) costs more than
the pass that fills it. The scratch holds the largest operand quantized so far, twice or three
times; only the dequantized operand each call returns is new memory.

The one difference: an element whose scaled value is NaN (possible only in a block or tensor
holding inf or NaN) stays NaN here, where E2M1 (no NaN) gives a signed zero; its block's
dequantization multiplies by an inf or NaN scale either way, so the dequantized values agree.
"""

from __future__ import annotations

import threading
from dataclasses import replace

import torch

from mptrain.precision.blocks.blocked import INPUT_DTYPES, Blocks, element_max, split_input
from mptrain.precision.blocks.blockwise import BLOCKWISE_BLOCK
from mptrain.precision.blocks.e2m1 import E2M1, E2M1_MAX
from mptrain.precision.blocks.hadamard import RHT_SIZE
from mptrain.precision.blocks.mx import (
    MX_BLOCK,
    scale_codes,
)
from mptrain.precision.blocks.nvfp4 import NVFP4_BLOCK, _to_e4m3, nvfp4_tensor_scale
from mptrain.precision.fp8.quant import E4M3, E5M2, scale_from_amax

_RHT_NORM = RHT_SIZE**-0.5  # 1/4, exact: hadamard.py's normalisation
_MANTISSA_BITS = 23
_EXPONENT_BITS = 0x7F800000
_MAGNITUDE_BITS = 0x7FFFFFFF
# (mantissa bits, smallest normal exponent) of each element format.
GRIDS = {E4M3: (3, -6), E5M2: (2, -14), E2M1: (1, 0)}


class _Scratch(threading.local):
    def __init__(self) -> None:
        self.buffers: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}


_SCRATCH = _Scratch()


def scratch(
    slot: str, shape: torch.Size | tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """An uninitialised tensor of ``shape`` from this thread's scratch buffer ``slot``: valid
    until the next request of the same slot (the caller must be done with it by then)."""
    numel = 1
    for size in shape:
        numel *= size
    key = (slot, dtype, device)
    buffer = _SCRATCH.buffers.get(key)
    if buffer is None or buffer.numel() < numel:
        buffer = _SCRATCH.buffers[key] = torch.empty(numel, dtype=dtype, device=device)
    return buffer[:numel].view(shape)


def _result(like: torch.Tensor, out: str | None) -> torch.Tensor:
    """Where a function's FP32 result goes: scratch slot ``out``, or new memory."""
    if out is None:
        return torch.empty(like.shape, dtype=torch.float32, device=like.device)
    return scratch(out, like.shape, torch.float32, like.device)


def round_to_grid(v: torch.Tensor, elem_dtype: torch.dtype, out: str | None = None) -> torch.Tensor:
    """``v`` (FP32, contiguous, already clamped to the format's range; NaN stays NaN) rounded
    to nearest even on the grid of ``elem_dtype``, in FP32 (module doc), into new memory or
    the scratch slot ``out``."""
    mantissa, emin = GRIDS[elem_dtype]
    bits = v.view(torch.int32)
    # 2^(e + 23 - mantissa) from v's exponent field (at least the format's smallest normal's);
    # bit operations: a pass each, cheaper than abs() and shifts on the CPU.
    magic = torch.bitwise_and(
        bits, _EXPONENT_BITS, out=scratch("magic", v.shape, torch.int32, v.device)
    )
    magic.clamp_(min=(emin + 127) << _MANTISSA_BITS).add_((_MANTISSA_BITS - mantissa) << 23)
    rounded = _result(v, out)
    torch.bitwise_and(bits, _MAGNITUDE_BITS, out=rounded.view(torch.int32))
    return rounded.add_(magic.view(torch.float32)).sub_(magic.view(torch.float32)).copysign_(v)


def stochastic_round_e2m1(
    v: torch.Tensor, generator: torch.Generator, out: str | None = None
) -> torch.Tensor:
    """``v`` (FP32, contiguous, clamped to ±6) rounded to an E2M1 neighbour at random, up with
    probability (|v| - lower) / (upper - lower), against one ``torch.rand`` draw per element
    from ``generator``: :func:`mptrain.precision.blocks.e2m1.encode`'s draws and comparison.
    The spacing is 0.5 below 2, 1 below 4, 2 up to 6 (at 6 the fraction is 0: it stays)."""
    magnitude = torch.abs(v, out=scratch("magnitude", v.shape, torch.float32, v.device))
    exponent = torch.bitwise_right_shift(
        magnitude.view(torch.int32),
        _MANTISSA_BITS,
        out=scratch("magic", v.shape, torch.int32, v.device),
    )
    spacing = (
        exponent.clamp_(min=127).sub_(1).bitwise_left_shift_(_MANTISSA_BITS).view(torch.float32)
    )
    lower = torch.div(magnitude, spacing, out=_result(v, out)).floor_().mul_(spacing)  # exact
    fraction = magnitude.sub_(lower).div_(spacing)
    draw = torch.rand(
        v.shape,
        generator=generator,
        device=v.device,
        out=scratch("draw", v.shape, torch.float32, v.device),
    )
    return lower.add_(spacing.mul_(draw < fraction)).copysign_(v)


def hadamard_(t: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """:func:`mptrain.precision.blocks.hadamard.random_hadamard_transform` of the FP32,
    contiguous ``t`` along its last dimension (a multiple of 16), in place: the same additions
    (the same bits), written into ``t`` and one scratch buffer in turn instead of new tensors
    at every butterfly stage. Returns ``t``."""
    blocks = t.view(-1, RHT_SIZE).mul_(signs.to(t.device))
    spare = scratch("hadamard", blocks.shape, torch.float32, t.device)
    src, dst, half = blocks, spare, 1
    while half < RHT_SIZE:
        pairs, out = (b.view(-1, RHT_SIZE // (2 * half), 2, half) for b in (src, dst))
        torch.add(pairs[..., 0, :], pairs[..., 1, :], out=out[..., 0, :])
        torch.sub(pairs[..., 0, :], pairs[..., 1, :], out=out[..., 1, :])
        src, dst, half = dst, src, half * 2
    # four stages: the result is back in t
    return t.mul_(_RHT_NORM)


def _split(x: torch.Tensor, dim: int, block: tuple[int, int], fmt: str) -> Blocks:
    """:func:`split_input`, with the FP32 copy of a BF16 or FP16 input, or of one whose ``dim``
    is not contiguous, made in scratch (one pass: the conversion and the transposition)."""
    if x.dtype in INPUT_DTYPES and x.dim() and -x.dim() <= dim < x.dim():
        moved = x.movedim(dim, -1)
        if x.dtype != torch.float32 or not moved.is_contiguous():
            staged = scratch("input", moved.shape, torch.float32, x.device).copy_(moved)
            return replace(split_input(staged, -1, block, fmt), dim=dim % x.dim())
    return split_input(x, dim, block, fmt)


def _finish(
    blocks: Blocks,
    multiplier: torch.Tensor,
    scale: torch.Tensor,
    elem_dtype: torch.dtype,
    out: str | None,
    saturate: bool = True,
) -> torch.Tensor:
    """Scaled, saturated (unless the scales rule it out), rounded and multiplied back by
    ``scale`` (keepdim per block): the dequantized operand in the input's layout."""
    view = blocks.view
    scaled = torch.mul(
        view, multiplier, out=scratch("scaled", view.shape, torch.float32, view.device)
    )
    if saturate:
        limit = element_max(elem_dtype)
        scaled.clamp_(-limit, limit)
    return _back(blocks, round_to_grid(scaled, elem_dtype, out).mul_(scale))


def _amax(blocks: Blocks) -> torch.Tensor:
    """:meth:`Blocks.amax`, its absolute values in scratch (the "scaled" slot, whose next use
    overwrites them)."""
    view = blocks.view
    magnitudes = torch.abs(view, out=scratch("scaled", view.shape, torch.float32, view.device))
    return magnitudes.amax(dim=blocks.reduced, keepdim=True)


def _back(blocks: Blocks, values: torch.Tensor) -> torch.Tensor:
    """The blocks' view in the input's layout (as BlockQuantized.dequantize returns it)."""
    return values.reshape(blocks.shape).movedim(-1, blocks.dim)


def fake_mx(
    x: torch.Tensor, dim: int, elem_dtype: torch.dtype, rounding: str, out: str | None = None
) -> torch.Tensor:
    """``quantize_mx(x, dim, ...).dequantize(torch.float32)``, fast (module doc); into new
    memory, or the scratch slot ``out`` (valid until that slot's next use)."""
    blocks = _split(x, dim, (1, MX_BLOCK), "MX")
    amax = _amax(blocks)
    codes, multiplier = scale_codes(amax, elem_dtype, rounding)
    # rceil's scale is at least amax / max: no finite element saturates. An inf one rounds to
    # inf here and to max x 2^127 there, which is inf in FP32 too.
    scale = codes.view(torch.float8_e8m0fnu).float()
    return _finish(blocks, multiplier, scale, elem_dtype, out, saturate=rounding == "floor")


def fake_nvfp4(
    x: torch.Tensor,
    dim: int,
    tile_2d: bool,
    generator: torch.Generator | None,
    out: str | None = None,
) -> torch.Tensor:
    """``quantize_nvfp4(x, dim, tile_2d=..., generator=...).dequantize(torch.float32)`` (with
    the per-tensor scale), fast (module doc); into new memory or the scratch slot ``out``."""
    block = (NVFP4_BLOCK, NVFP4_BLOCK) if tile_2d else (1, NVFP4_BLOCK)
    blocks = _split(x, dim, block, "NVFP4")
    amax = _amax(blocks)
    tensor_scale = nvfp4_tensor_scale(amax.amax())
    scale_e4m3 = _to_e4m3(amax / torch.full_like(amax, E2M1_MAX) / tensor_scale).float()
    multiplier = tensor_scale.reciprocal() / scale_e4m3
    view = blocks.view
    scaled = torch.mul(
        view, multiplier, out=scratch("scaled", view.shape, torch.float32, view.device)
    )
    scaled.clamp_(-E2M1_MAX, E2M1_MAX)
    if generator is None:
        rounded = round_to_grid(scaled, E2M1, out)
    else:
        rounded = stochastic_round_e2m1(scaled, generator, out)
    return _back(blocks, rounded.mul_(tensor_scale * scale_e4m3))


def fake_blockwise(
    x: torch.Tensor, dim: int, tile_2d: bool, elem_dtype: torch.dtype, out: str | None = None
) -> torch.Tensor:
    """``quantize_blockwise(x, dim, ...).dequantize(torch.float32)``, fast (module doc); into
    new memory or the scratch slot ``out``."""
    block = (BLOCKWISE_BLOCK, BLOCKWISE_BLOCK) if tile_2d else (1, BLOCKWISE_BLOCK)
    blocks = _split(x, dim, block, "blockwise FP8")
    scale = scale_from_amax(_amax(blocks), elem_dtype)
    return _finish(blocks, scale, scale.reciprocal(), elem_dtype, out)
