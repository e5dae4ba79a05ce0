"""What every block-scaled format shares: the layout (the quantized dimension last, split into
blocks), the result of a quantization (:class:`BlockQuantized`) and its dequantization, the last
step of every quantizer (multiply by the block's multiplier, saturate, cast to the element format)
and the statistics counted on the way (:class:`BlockStats`).

Layout. A GEMM reduces over one dimension of each operand; a block format scales blocks along
it. ``dim`` names that dimension of the input; the quantized ``data`` and ``scale`` hold it last
(the input's ``movedim(dim, -1)``, contiguous: K-major, what a block-scaled GEMM reads), and
:meth:`BlockQuantized.dequantize` returns the input's own layout. A block is ``(1, n)`` (n
consecutive elements along ``dim``; any number of leading dimensions) or an ``(n, n)`` tile of a
2-D tensor (one scale shared by a tile, so the transposed tensor quantizes to the same values).
A size that is not a multiple of the block is refused, as torchao refuses it: padding belongs to
the caller (or the layer stays in high precision).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from mptrain.precision.quant import e2m1
from mptrain.precision.quant.fp8 import FP8_MAX, SATURATION_BOUNDARY, quantize

INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class BlockStats:
    """Counts of one quantization, each a 0-d int64 tensor on the input's device (reading one
    synchronises). Non-finite blocks are counted whole in ``nonfinite_blocks`` and their
    elements nowhere else: their values are not numbers to saturate or underflow.

    - ``saturated``: elements whose scaled magnitude saturation clipped (at or above the format's
      saturation boundary: more than rounding to the largest value would have taken off);
    - ``underflows``: nonzero inputs that quantized to zero;
    - ``zero_blocks``: blocks whose every quantized element is zero (all-zero input included);
    - ``nonfinite_blocks``: blocks whose input holds inf or NaN, or whose multiplier is not a
      positive number (NVFP4: an inf or NaN elsewhere in the tensor, through the per-tensor scale).
    """

    elements: int
    blocks: int
    saturated: torch.Tensor
    underflows: torch.Tensor
    zero_blocks: torch.Tensor
    nonfinite_blocks: torch.Tensor

    def as_dict(self) -> dict[str, int]:
        """Every count as a Python int (synchronises with the device)."""
        return {f.name: int(getattr(self, f.name)) for f in fields(self)}


@dataclass(frozen=True)
class BlockQuantized:
    """One tensor in a block-scaled format (the layout: this module's docstring).

    - ``data``: the elements, quantized dimension last: an FP8 dtype, or ``uint8`` holding two
      E2M1 codes per byte (:mod:`.e2m1`; the last dimension is then half the input's);
    - ``scale``: one per block, shape ``data``'s with each blocked dimension divided by its block
      size: ``float8_e8m0fnu`` (MX), ``float8_e4m3fn`` (NVFP4) or ``float32`` (blockwise FP8);
      the value a block's elements are multiplied by to dequantize;
    - ``block``: (rows, columns) of a block in ``data``'s layout: (1, n) or (n, n);
    - ``dim``: the input's dimension that was quantized (non-negative), where dequantize puts it;
    - ``tensor_scale``: NVFP4's FP32 per-tensor scale, multiplying every block scale, or None;
    - ``stats``: :class:`BlockStats` if the quantizer was asked for them (``stats=True``: a few
      more passes over the tensor), else None.
    """

    data: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int]
    dim: int
    tensor_scale: torch.Tensor | None
    stats: BlockStats | None

    def values(self) -> torch.Tensor:
        """The elements' values in FP32, in ``data``'s layout (FP4 unpacked)."""
        if self.data.dtype == torch.uint8:
            return e2m1.decode(e2m1.unpack(self.data))
        return self.data.float()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The real values the quantized tensor stands for, in the input's layout and ``dtype``:
        each element times its block's scale (times the per-tensor scale first, as torchao's
        NVFP4 does: ``element * (tensor_scale * scale)``), computed in FP32 and then cast. A NaN
        scale (E8M0 code 255, E4M3 NaN) makes its block NaN. What an emulated GEMM multiplies."""
        values = self.values()
        blocks, reduced = split(values, self.block)
        multiplier = self.scale.float()
        if self.tensor_scale is not None:
            multiplier = self.tensor_scale * multiplier
        for d in reduced:
            multiplier = multiplier.unsqueeze(d)
        return (blocks * multiplier).reshape(values.shape).movedim(-1, self.dim).to(dtype)


@dataclass(frozen=True)
class Blocks:
    """An input on its way through a quantizer: ``view`` is the input in FP32 with the quantized
    dimension last (``shape``), split so that each block has its own dimensions (``reduced``,
    :func:`split`); ``dim`` is the input's quantized dimension, ``block`` the block's shape."""

    view: torch.Tensor
    shape: torch.Size
    block: tuple[int, int]
    dim: int
    reduced: tuple[int, ...]

    def amax(self) -> torch.Tensor:
        """Each block's largest magnitude, keepdim (NaN if the block holds a NaN)."""
        return self.view.abs().amax(dim=self.reduced, keepdim=True)


def split_input(x: torch.Tensor, dim: int, block: tuple[int, int], fmt: str) -> Blocks:
    """``x`` as :class:`Blocks`. Raises ValueError (naming ``fmt``) for an input dtype other than
    FP32/BF16/FP16, a ``dim`` out of range, a tile of a tensor that is not 2-D, or a size that
    is not a multiple of the block."""
    if x.dtype not in INPUT_DTYPES:
        raise ValueError(f"{fmt}: input dtype {x.dtype} is not one of {INPUT_DTYPES}")
    if x.dim() == 0 or not -x.dim() <= dim < x.dim():
        raise ValueError(f"{fmt}: dim={dim} is out of range for a {x.dim()}-D tensor")
    dim = dim % x.dim()
    moved = x.movedim(dim, -1)
    rows, cols = block
    if rows > 1 and moved.dim() != 2:
        raise ValueError(f"{fmt}: {rows}x{cols} tiles need a 2-D tensor, got {x.dim()}-D")
    sizes = [(moved.shape[-1], cols, dim)] + ([(moved.shape[0], rows, 1 - dim)] if rows > 1 else [])
    for size, n, d in sizes:
        if size % n:
            raise ValueError(
                f"{fmt}: the size {size} of dim {d} is not a multiple of the block size {n} "
                "(pad it, or keep this tensor in high precision)"
            )
    view, reduced = split(moved.float().contiguous(), block)
    return Blocks(view, moved.shape, block, dim, reduced)


def split(t: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, tuple[int, ...]]:
    """A view of ``t`` (block dimension last) with each block along its own dimensions, and
    those dimensions: (..., C/n, n) and (last,) for (1, n) blocks, (R/n, n, C/n, n) and (1, 3)
    for (n, n) tiles. An amax over them with ``keepdim`` broadcasts back against the view."""
    rows, cols = block
    if rows == 1:
        return t.reshape(*t.shape[:-1], t.shape[-1] // cols, cols), (t.dim(),)
    return t.reshape(t.shape[0] // rows, rows, t.shape[1] // cols, cols), (1, 3)


def finish(
    blocks: Blocks,
    multiplier: torch.Tensor,
    amax: torch.Tensor,
    elem_dtype: torch.dtype,
    generator: torch.Generator | None = None,
    stats: bool = False,
) -> tuple[torch.Tensor, BlockStats | None]:
    """The last step of every block quantizer: ``blocks * multiplier`` (FP32, one multiplier per
    block, keepdim) saturated to the element format's largest value and cast to it (FP8: round
    to nearest even, NaN kept; E2M1: :func:`e2m1.encode`, stochastic with ``generator``). Returns
    the elements in the blocks' view (E2M1: one code per element) and, with ``stats``, the
    counts (``amax``, the blocks' keepdim amax, says which blocks are not finite)."""
    x = blocks.view
    if elem_dtype == e2m1.E2M1:
        data = e2m1.encode((x * multiplier).clamp(-e2m1.E2M1_MAX, e2m1.E2M1_MAX), generator)
        nonzero = (data & 7) != 0
    else:
        data = quantize(x, multiplier, elem_dtype)  # mptrain's saturating FP8 cast
        nonzero = (data.view(torch.uint8) & 0x7F) != 0  # the bits below the sign
    if not stats:
        return data, None
    return data, count(blocks, multiplier, amax, nonzero, elem_dtype)


def count(
    blocks: Blocks,
    multiplier: torch.Tensor,
    amax: torch.Tensor,
    nonzero: torch.Tensor,
    elem_dtype: torch.dtype,
) -> BlockStats:
    """The :class:`BlockStats` of a quantization: ``nonzero`` marks the elements that did not
    quantize to zero. Counted per block first, so that non-finite blocks drop out whole."""
    x, reduced = blocks.view, blocks.reduced
    finite = torch.isfinite(amax) & torch.isfinite(multiplier) & (multiplier > 0)
    boundary = (
        e2m1.E2M1_SATURATION_BOUNDARY
        if elem_dtype == e2m1.E2M1
        else SATURATION_BOUNDARY[elem_dtype]
    )

    def in_finite_blocks(mask: torch.Tensor) -> torch.Tensor:
        return (mask.sum(dim=reduced, keepdim=True) * finite).sum()

    return BlockStats(
        elements=x.numel(),
        blocks=amax.numel(),
        saturated=in_finite_blocks(x.abs() * multiplier >= boundary),
        underflows=in_finite_blocks((x != 0) & ~nonzero),
        zero_blocks=(~nonzero.any(dim=reduced, keepdim=True) & finite).sum(),
        nonfinite_blocks=(~finite).sum(),
    )


def assemble(
    blocks: Blocks,
    data: torch.Tensor,
    scale: torch.Tensor,
    stats: BlockStats | None,
    tensor_scale: torch.Tensor | None = None,
) -> BlockQuantized:
    """The :class:`BlockQuantized` of a quantizer's elements (in the blocks' view) and keepdim
    scales: elements in the moved shape (E2M1 codes packed two per byte), scales without the
    blocks' singleton dimensions."""
    elements = data.reshape(blocks.shape)
    if elements.dtype == torch.uint8:
        elements = e2m1.pack(elements)
    return BlockQuantized(
        elements, scale.squeeze(blocks.reduced), blocks.block, blocks.dim, tensor_scale, stats
    )


def element_max(elem_dtype: torch.dtype) -> float:
    """The largest finite magnitude of an element format: 448 (E4M3), 57344 (E5M2), 6 (E2M1)."""
    return e2m1.E2M1_MAX if elem_dtype == e2m1.E2M1 else FP8_MAX[elem_dtype]


def check_choice(name: str, value: object, accepted: tuple, fmt: str) -> None:
    """ValueError naming ``name`` unless ``value`` is one of ``accepted``."""
    if value not in accepted:
        raise ValueError(f"{fmt}: {name}={value!r} is not one of {accepted}")
