"""How the block-scaled formats quantize in training (:func:`quantize_operand`, and
:func:`fake_quant_operand`: the same bits for an emulated GEMM), and what the report says about it
(:meth:`BlockQuantization.describe`).

Each of a Linear's three GEMMs (:mod:`.linear`) quantizes its two operands (``role``: input,
weight, grad) along its own reduction dimension (``dim``), so the backward re-quantizes the
high-precision input, weight and gradient the forward saved, as torchao's MXFP8 training and
Transformer Engine do. The formats' quantizers are :mod:`.mx`, :mod:`.nvfp4` and
:mod:`.blockwise`; their recipes and settings in words: docs/precisions.md, *Block-scaled formats*.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mptrain.config.format_table import FORMAT_TABLE, FP8_BLOCKWISE, MXFP8, NVFP4, NumberFormat
from mptrain.platform.dtypes import dtype_name
from mptrain.precision.quant import fake
from mptrain.precision.quant.blocked import BlockQuantized
from mptrain.precision.quant.blockwise import quantize_blockwise
from mptrain.precision.quant.fp8 import E4M3
from mptrain.precision.quant.mx import quantize_mx
from mptrain.precision.quant.nvfp4 import quantize_nvfp4

ROLES = ("input", "weight", "grad")


@dataclass(frozen=True)
class BlockQuantization:
    """How a :class:`~mptrain.precision.quant.block_linear.BlockLinear` quantizes (see module doc).
    Built from the ``mx``/``nvfp4``/``fp8`` config by the precision policy."""

    format: str  # one of mptrain.config.format_table.BLOCK_FORMATS
    real_gemm: bool = False  # torch's block-scaled scaled_mm (True) or the emulation: .gemm
    scale_rounding: str = "rceil"  # mxfp8: rceil | floor
    weight_tiles: bool = False  # nvfp4: 16x16 weight tiles; fp8_blockwise: always 128x128
    hadamard: bool = False  # nvfp4: RHT on dW's operands
    stochastic_rounding: bool = False  # nvfp4: of the output gradient
    grad_dtype: torch.dtype = E4M3  # fp8_blockwise: the gradients' element format
    keep_last_fraction: float = 0.0  # layer selection: the BF16 tail (nvfp4)
    min_features: int = 0  # layer selection: smaller layers stay in BF16
    seed: int = 0  # per-layer Hadamard signs and stochastic-rounding generators derive from it

    @property
    def row(self) -> NumberFormat:
        """The format's row of the table: label, block, scale dtype, config group, kernel."""
        return FORMAT_TABLE[self.format]

    @property
    def block_size(self) -> int:
        return self.row.block

    @property
    def tiled_weight(self) -> bool:
        """One quantization of the weight (2-D tiles) serves the forward and the dx GEMM."""
        return self.format == FP8_BLOCKWISE or (self.format == NVFP4 and self.weight_tiles)

    def element_dtype(self, role: str) -> torch.dtype | str:
        if self.format == NVFP4:
            return self.row.elements  # no torch dtype holds one E2M1 code
        return self.grad_dtype if role == "grad" else E4M3

    def block_shape(self, role: str) -> str:
        n = self.block_size
        return f"{n}x{n}" if role == "weight" and self.tiled_weight else f"1x{n}"

    def describe(self) -> dict[str, Any]:
        """The report's account of the quantization: element and scale formats and block shape per
        operand, and the format's settings."""
        operands = {
            role: {
                "element": dtype_name(element)
                if isinstance(element := self.element_dtype(role), torch.dtype)
                else element,
                "scale": self.row.scale,
                "block": self.block_shape(role),
            }
            for role in ROLES
        }
        settings: dict[str, Any] = {}
        if self.format == MXFP8:
            settings["scale_rounding"] = self.scale_rounding
        if self.format == NVFP4:
            settings.update(
                tensor_scale="float32",
                weight_tiles=self.weight_tiles,
                hadamard=self.hadamard,
                stochastic_rounding=self.stochastic_rounding,
                keep_last_fraction=self.keep_last_fraction,
            )
        return {"format": self.format, "operands": operands, **settings}


def quantize_operand(
    quantization: BlockQuantization,
    t: torch.Tensor,
    dim: int,
    role: str,
    *,
    generator: torch.Generator | None = None,
    stats: bool = False,
) -> BlockQuantized:
    """``t`` (an operand of role ``input``, ``weight`` or ``grad``) quantized along ``dim`` as
    the quantization says; ``generator`` rounds an NVFP4 gradient stochastically (when the quantization
    does); ``stats`` counts saturation, underflow, zero and non-finite blocks."""
    fmt = quantization.format
    if fmt == MXFP8:
        return quantize_mx(
            t, dim, elem_dtype=E4M3, rounding=quantization.scale_rounding, stats=stats
        )
    tiled = role == "weight" and quantization.tiled_weight
    if fmt == NVFP4:
        sr = generator if role == "grad" and quantization.stochastic_rounding else None
        return quantize_nvfp4(t, dim, tile_2d=tiled, generator=sr, stats=stats)
    elem = quantization.grad_dtype if role == "grad" else E4M3
    return quantize_blockwise(t, dim, tile_2d=tiled, elem_dtype=elem, stats=stats)


def fake_quant_operand(
    quantization: BlockQuantization,
    t: torch.Tensor,
    dim: int,
    role: str,
    *,
    generator: torch.Generator | None = None,
    out: str | None = None,
    keep_layout: bool = False,
) -> torch.Tensor:
    """``quantize_operand(quantization, t, dim, role, generator=generator).dequantize(torch.float32)``,
    the same bits, computed without leaving FP32 (:mod:`.fake`): what an emulated GEMM reads.
    ``out``: a scratch slot to write it into (valid until the slot's next use), else new memory;
    ``keep_layout``: in ``t``'s layout, ``dim`` quantized where it lies (no transposition; not
    for a tiled weight)."""
    fmt = quantization.format
    if fmt == MXFP8:
        return fake.fake_mx(t, dim, E4M3, quantization.scale_rounding, out, keep_layout)
    tiled = role == "weight" and quantization.tiled_weight
    if fmt == NVFP4:
        sr = generator if role == "grad" and quantization.stochastic_rounding else None
        return fake.fake_nvfp4(t, dim, tiled, sr, out, keep_layout)
    elem = quantization.grad_dtype if role == "grad" else E4M3
    return fake.fake_blockwise(t, dim, tiled, elem, out, keep_layout)
