"""The emulation's fake quantization: an operand quantized and dequantized in one pass of FP32
arithmetic, the same values, bit for bit, as ``quantize_<format>(...).dequantize(torch.float32)``
(tests/precision/test_block_training.py checks every format, rounding and edge case of
test_blocks_torchao.py) at a fraction of its cost: the CPU casts to and from FP8 element by
element (FP8 -> FP32 alone costs more than the FP32 GEMM it feeds).

Here an element is rounded to its format's grid without leaving FP32: for a magnitude ``m`` in
the binade ``[2^e, 2^(e+1))`` (``e`` at least the format's smallest normal exponent, where the
subnormal spacing continues), ``(m + c) - c`` with ``c = 2^(e + 23 - mantissa bits)`` is ``m``
rounded to nearest even at the format's spacing ``2^(e - mantissa bits)``: the FP32 addition
itself rounds (``c``'s ulp is that spacing, and the sum stays in ``c``'s binade). Saturation is a
clamp first, as :func:`mptrain.precision.quant.fp8.quantize` does. Stochastic rounding (NVFP4
gradients) draws the same ``torch.rand`` numbers, in the same order, as
:func:`mptrain.precision.quant.e2m1.encode` and compares them with the same exact fraction.

The time is in the passes over the operand (each elementwise torch operation is one, bound by
memory traffic on the CPU), so they are few: ``|x|`` is written once, into the buffer the result
is returned in, and everything after it happens there in place; a block's multiplier and scale
come from a few integer passes over the amaxes (MX:
:func:`mptrain.precision.quant.mx.scale_factors`). An operand whose quantized dimension is not
its last can be quantized where it lies (``keep_layout``, :func:`_split`): no transposed copy,
what the backward's dx and dW GEMMs use.

Temporaries live in a per-thread scratch space (:func:`scratch`), reused from call to call:
fresh memory costs a page fault per page, which on a CPU (a VM's above all) costs more than the
pass that fills it; only the dequantized operand each call returns is new memory.

The one difference: an element whose scaled value is NaN (possible only in a block or tensor
holding inf or NaN) stays NaN here, where E2M1 (no NaN) gives a signed zero; its block's
dequantization multiplies by an inf or NaN scale either way, so the dequantized values agree.
"""

from __future__ import annotations

import math
import threading
from dataclasses import replace

import torch

from mptrain.precision.quant.blocked import INPUT_DTYPES, Blocks, element_max, split_input
from mptrain.precision.quant.blockwise import BLOCKWISE_BLOCK
from mptrain.precision.quant.e2m1 import E2M1, E2M1_MAX
from mptrain.precision.quant.fp8 import E4M3, E5M2, scale_from_amax
from mptrain.precision.quant.hadamard import RHT_NORM, RHT_SIZE
from mptrain.precision.quant.mx import MX_BLOCK, scale_factors
from mptrain.precision.quant.nvfp4 import NVFP4_BLOCK, _to_e4m3, nvfp4_tensor_scale

_MANTISSA_BITS = 23
_EXPONENT_BITS = 0x7F800000
_MAGIC_CAP = 100  # the largest exponent of the rounding's power of two (module doc)
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
    numel = math.prod(shape)
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


def round_magnitude_(a: torch.Tensor, elem_dtype: torch.dtype) -> torch.Tensor:
    """The magnitudes ``a`` (FP32, contiguous, non-negative or NaN, at most the format's max
    unless inf) rounded to nearest even on the grid of ``elem_dtype``, in place (module doc):
    ``(a + c) - c``, ``c`` from ``a``'s exponent field. Returns ``a``."""
    mantissa, emin = GRIDS[elem_dtype]
    # 2^e from a's exponent field, e clamped to [the format's smallest normal exponent, 100]
    # (clamping the bits clamps the field; above the format's range only inf and NaN reach the
    # cap, and they stay themselves); c = 2^(23 - mantissa) x 2^e is exact, so add's alpha
    # rounds nothing: two passes for c instead of three.
    bits = (emin + 127) << _MANTISSA_BITS, (_MAGIC_CAP + 127) << _MANTISSA_BITS
    power = torch.clamp(
        a.view(torch.int32), *bits, out=scratch("magic", a.shape, torch.int32, a.device)
    ).bitwise_and_(_EXPONENT_BITS)
    c, alpha = power.view(torch.float32), 2.0 ** (_MANTISSA_BITS - mantissa)
    return a.add_(c, alpha=alpha).sub_(c, alpha=alpha)


def stochastic_round_e2m1_(a: torch.Tensor, draw: torch.Tensor) -> torch.Tensor:
    """The magnitudes ``a`` (FP32, contiguous, in [0, 6] or NaN) rounded to an E2M1 neighbour
    at random, in place: up with probability (a - lower) / (upper - lower), against ``draw``
    (one ``torch.rand`` number per element, :func:`_draws`), as
    :func:`mptrain.precision.quant.e2m1.encode` compares. The spacing is 0.5 below 2, 1 below
    4, 2 up to 6 (at 6 the fraction is 0: it stays). Returns ``a``."""
    exponent = torch.bitwise_right_shift(
        a.view(torch.int32), _MANTISSA_BITS, out=scratch("magic", a.shape, torch.int32, a.device)
    )
    spacing = (
        exponent.clamp_(min=127).sub_(1).bitwise_left_shift_(_MANTISSA_BITS).view(torch.float32)
    )
    # a / spacing is exact (spacing 1/2 below 2, 2 only from 4 up), so its fractional part is
    # (a - lower) / spacing exactly, encode's fraction.
    fraction = torch.div(a, spacing, out=scratch("fraction", a.shape, torch.float32, a.device))
    lower = torch.floor(fraction, out=a)
    fraction.sub_(lower)
    return lower.mul_(spacing).add_(spacing.mul_(draw < fraction))


def _draws(blocks: Blocks, generator: torch.Generator, moved: torch.Size) -> torch.Tensor:
    """One ``torch.rand`` draw per element from ``generator``, in the order of the quantizer's
    ``data`` layout (``moved``: the input with its quantized dimension last), as a view that
    lines up with ``blocks.view``."""
    view = blocks.view
    draw = torch.rand(
        moved, generator=generator, device=view.device,
        out=scratch("draw", moved, torch.float32, view.device),
    )  # fmt: skip
    if blocks.reduced[-1] == view.dim() - 1:  # the blocks were split in that order
        return draw.view(view.shape)
    # kept in place (_split's keep_layout): the quantized dimension precedes the reduced one
    return draw.movedim(-1, blocks.reduced[0] - 1).reshape(view.shape)


def hadamard_(t: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """:func:`mptrain.precision.quant.hadamard.random_hadamard_transform` of the FP32,
    contiguous ``t`` along its last dimension (a multiple of 16), in place: the same additions
    (the same bits), written into ``t`` and one scratch buffer in turn instead of new tensors
    at every butterfly stage. Returns ``t``."""
    blocks = t.view(-1, RHT_SIZE, 1).mul_(signs.to(t.device).view(RHT_SIZE, 1))
    _butterflies(blocks)
    return t.mul_(RHT_NORM)


def hadamard_rows(t: torch.Tensor, signs: torch.Tensor, out: str) -> torch.Tensor:
    """:func:`mptrain.precision.quant.hadamard.random_hadamard_transform` of the 2-D ``t``
    (FP32, BF16 or FP16) along its first dimension (a multiple of 16), in FP32 into the scratch
    slot ``out`` (``t`` is left alone): :func:`hadamard_`'s additions on blocks of 16 rows, the
    same bits as the transform of ``t``'s transpose."""
    rows, cols = t.shape
    shape = (rows // RHT_SIZE, RHT_SIZE, cols)
    result = scratch(out, shape, torch.float32, t.device)
    torch.mul(t.reshape(shape), signs.to(t.device).view(RHT_SIZE, 1), out=result)
    return _butterflies(result).mul_(RHT_NORM).view(rows, cols)


def _butterflies(blocks: torch.Tensor) -> torch.Tensor:
    """The Walsh-Hadamard butterflies (hadamard.walsh_hadamard's additions) along the middle
    dimension (16) of the FP32, contiguous ``blocks`` (n, 16, inner), in place: each stage
    written into a scratch buffer and back in turn. Returns ``blocks``."""
    n, size, inner = blocks.shape
    spare = scratch("hadamard", blocks.shape, torch.float32, blocks.device)
    src, dst, half = blocks, spare, 1
    while half < size:
        pairs, into = (b.view(n, size // (2 * half), 2, half, inner) for b in (src, dst))
        torch.add(pairs[:, :, 0], pairs[:, :, 1], out=into[:, :, 0])
        torch.sub(pairs[:, :, 0], pairs[:, :, 1], out=into[:, :, 1])
        src, dst, half = dst, src, half * 2
    return blocks  # an even number of stages (four): the result is back in blocks


def _split(
    x: torch.Tensor, dim: int, block: tuple[int, int], fmt: str, keep_layout: bool = False
) -> Blocks:
    """:func:`split_input`, with the FP32 copy of a BF16 or FP16 input, or of one whose ``dim``
    is not contiguous, made in scratch (one pass: the conversion and the transposition).

    ``keep_layout`` (``(1, n)`` blocks only): the blocks are split where they lie, ``dim`` not
    moved (the dimensions after it stay innermost; no transposition), so the result keeps
    ``x``'s layout: ``shape`` is ``x``'s and ``dim`` its last, as if nothing had moved."""
    if keep_layout and block[0] == 1 and x.dim() and -x.dim() <= dim < x.dim() - 1:
        split_input(torch.empty(x.shape, dtype=x.dtype, device="meta"), dim, block, fmt)  # checks
        dim %= x.dim()
        if x.dtype != torch.float32 or not x.is_contiguous():
            x = scratch("input", x.shape, torch.float32, x.device).copy_(x)
        view = x.view(*x.shape[:dim], x.shape[dim] // block[1], block[1], -1)
        return Blocks(view, x.shape, block, x.dim() - 1, (dim + 1,))
    if keep_layout and block[0] > 1:
        raise ValueError(f"{fmt}: keep_layout takes (1, n) blocks, not {block[0]}x{block[1]} tiles")
    if x.dtype in INPUT_DTYPES and x.dim() and -x.dim() <= dim < x.dim():
        moved = x.movedim(dim, -1)
        if x.dtype != torch.float32 or not moved.is_contiguous():
            staged = scratch("input", moved.shape, torch.float32, x.device).copy_(moved)
            return replace(split_input(staged, -1, block, fmt), dim=dim % x.dim())
    return split_input(x, dim, block, fmt)


def _magnitudes(blocks: Blocks, out: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(``|x|`` of the blocks' view, in new memory or the scratch slot ``out``; each block's
    amax, keepdim, NaN if it holds a NaN): the buffer the quantization then works in, in place,
    to the dequantized result."""
    view = blocks.view
    magnitude = torch.abs(view, out=_result(view, out))
    return magnitude, magnitude.amax(dim=blocks.reduced, keepdim=True)


def _finish(
    blocks: Blocks,
    magnitude: torch.Tensor,
    multiplier: torch.Tensor,
    scale: torch.Tensor,
    elem_dtype: torch.dtype,
    saturate: bool = True,
) -> torch.Tensor:
    """``magnitude`` (:func:`_magnitudes`) scaled, saturated (unless the scales rule it out),
    rounded, signed and multiplied back by ``scale`` (keepdim per block), in place: the
    dequantized operand in the input's layout. Working on magnitudes is the same arithmetic:
    every multiplier is positive (or NaN, zero, inf: a NaN block either way), and rounding is
    symmetric."""
    magnitude.mul_(multiplier)
    if saturate:
        magnitude.clamp_(max=element_max(elem_dtype))
    rounded = round_magnitude_(magnitude, elem_dtype)
    return _back(blocks, rounded.copysign_(blocks.view).mul_(scale))


def _back(blocks: Blocks, values: torch.Tensor) -> torch.Tensor:
    """The blocks' view in the input's layout (as BlockQuantized.dequantize returns it)."""
    return values.reshape(blocks.shape).movedim(-1, blocks.dim)


def fake_mx(
    x: torch.Tensor,
    dim: int,
    elem_dtype: torch.dtype,
    rounding: str,
    out: str | None = None,
    keep_layout: bool = False,
) -> torch.Tensor:
    """``quantize_mx(x, dim, ...).dequantize(torch.float32)``, fast (module doc); into new
    memory, or the scratch slot ``out`` (valid until that slot's next use; not ``x``'s); in
    ``x``'s layout (contiguous) with ``keep_layout`` (:func:`_split`), else in the
    dequantization's."""
    blocks = _split(x, dim, (1, MX_BLOCK), "MX", keep_layout)
    magnitude, amax = _magnitudes(blocks, out)
    multiplier, scale = scale_factors(amax, elem_dtype, rounding)
    # rceil's scale is at least amax / max: no finite element saturates. An inf one rounds to
    # inf here and to max x 2^127 there, which is inf in FP32 too.
    return _finish(blocks, magnitude, multiplier, scale, elem_dtype, saturate=rounding == "floor")


def fake_nvfp4(
    x: torch.Tensor,
    dim: int,
    tile_2d: bool,
    generator: torch.Generator | None,
    out: str | None = None,
    keep_layout: bool = False,
) -> torch.Tensor:
    """``quantize_nvfp4(x, dim, tile_2d=..., generator=...).dequantize(torch.float32)`` (with
    the per-tensor scale), fast (module doc); into new memory or the scratch slot ``out``
    (not ``x``'s); ``keep_layout`` as :func:`fake_mx`'s."""
    block = (NVFP4_BLOCK, NVFP4_BLOCK) if tile_2d else (1, NVFP4_BLOCK)
    blocks = _split(x, dim, block, "NVFP4", keep_layout)
    magnitude, amax = _magnitudes(blocks, out)
    tensor_scale = nvfp4_tensor_scale(amax.amax())
    scale_e4m3 = _to_e4m3(amax / torch.full_like(amax, E2M1_MAX) / tensor_scale).float()
    multiplier = tensor_scale.reciprocal() / scale_e4m3
    magnitude.mul_(multiplier).clamp_(max=E2M1_MAX)
    if generator is None:
        rounded = round_magnitude_(magnitude, E2M1)
    else:
        moved = x.movedim(dim, -1).shape
        rounded = stochastic_round_e2m1_(magnitude, _draws(blocks, generator, moved))
    return _back(blocks, rounded.copysign_(blocks.view).mul_(tensor_scale * scale_e4m3))


def fake_blockwise(
    x: torch.Tensor,
    dim: int,
    tile_2d: bool,
    elem_dtype: torch.dtype,
    out: str | None = None,
    keep_layout: bool = False,
) -> torch.Tensor:
    """``quantize_blockwise(x, dim, ...).dequantize(torch.float32)``, fast (module doc); into
    new memory or the scratch slot ``out`` (not ``x``'s); ``keep_layout`` as
    :func:`fake_mx`'s."""
    block = (BLOCKWISE_BLOCK, BLOCKWISE_BLOCK) if tile_2d else (1, BLOCKWISE_BLOCK)
    blocks = _split(x, dim, block, "blockwise FP8", keep_layout)
    magnitude, amax = _magnitudes(blocks, out)
    scale = scale_from_amax(amax, elem_dtype)
    return _finish(blocks, magnitude, scale, scale.reciprocal(), elem_dtype)
