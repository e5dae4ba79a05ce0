""":class:`BlockLinear`: an nn.Linear whose three GEMMs take block-scaled operands (MXFP8, NVFP4,
blockwise FP8: :mod:`.block_quant`), and their GEMM format, :class:`BlockGemm`. Each operand is
quantized once per GEMM, the same way on the real and the emulated path; only the matmul differs
(:func:`~.kernels.block_gemm`). How this compares with torchao's ``MXFP8Linear``:
docs/precisions.md, *Checked against torchao*.

Counts (:class:`~mptrain.precision.quant.blocked.BlockStats`) cost more than the quantization,
so a layer counts only while ``sampling`` is set (the loop sets it for its log rows: see
:class:`~mptrain.precision.quant.convert.BlockLayers`); they add up per role in non-persistent
buffers (not in the state_dict: a checkpoint of one precision loads into any other).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mptrain.precision.quant.block_quant import (
    ROLES,
    BlockQuantization,
    fake_quant_operand,
    quantize_operand,
)
from mptrain.precision.quant.blocked import BlockStats
from mptrain.precision.quant.fake import hadamard_, hadamard_rows, scratch
from mptrain.precision.quant.hadamard import rht_signs
from mptrain.precision.quant.kernels import Operand, block_gemm, transposed
from mptrain.precision.quant.linear import Backward, GemmFormat, GemmPlan, QuantizedLinear

COUNTS = ("saturated", "underflows", "zero_blocks", "nonfinite_blocks")
SHAPES = ("elements", "blocks")


def _whole_blocks(t: torch.Tensor, multiple: int, slot: str) -> torch.Tensor:
    """The 2-D ``t`` (tokens x features) with its tokens padded with zeros to a multiple of
    ``multiple`` (a copy in the scratch ``slot``, FP32), or ``t`` itself when they need none:
    dW = dyᵀ x reduces over the tokens (zeros add nothing to it, nor to any block's amax)."""
    tokens, features = t.shape
    if not tokens % multiple:
        return t
    out = scratch(slot, (tokens + -tokens % multiple, features), torch.float32, t.device)
    out[:tokens].copy_(t)
    out[tokens:].zero_()
    return out


def _tokens_last(t: torch.Tensor, multiple: int, slot: str) -> torch.Tensor:
    """The 2-D ``t`` (tokens x features) transposed into a contiguous FP32 tensor (the scratch
    ``slot``), its tokens padded with zeros to a multiple of ``multiple``, in one copy: the
    layout a real block-scaled GEMM reads dW's operands in (tokens, its K, contiguous)."""
    tokens, features = t.shape
    shape = (features, tokens + -tokens % multiple)
    out = scratch(slot, shape, torch.float32, t.device)
    out[:, :tokens].copy_(t.t())
    out[:, tokens:].zero_()
    return out


@dataclass(frozen=True)
class BlockGemm(GemmFormat):
    """A block-scaled GEMM of ``quantization``'s format: each operand quantized once per GEMM along its
    reduction dimension, the same way on both paths (see the module doc); a tiled weight's
    forward quantization (the same along both dimensions) serves the input gradient's GEMM of
    this format."""

    quantization: BlockQuantization

    @property
    def label(self) -> str:  # type: ignore[override]  # a class attribute in the base
        return self.quantization.format

    def check_features(self, in_features: int, out_features: int) -> None:
        for name, size in (("in_features", in_features), ("out_features", out_features)):
            if size % self.quantization.block_size:
                raise ValueError(
                    f"BlockLinear ({self.quantization.format}): {name}={size} is not a multiple of "
                    f"the block size {self.quantization.block_size}"
                )

    @property
    def _tiles_key(self) -> str:
        return f"{self.quantization.format}_w_tiles"

    def forward(
        self,
        layer: nn.Module,
        rows: torch.Tensor,
        weight: torch.Tensor,
        out_dtype: torch.dtype,
        kept: dict[str, Any],
    ) -> torch.Tensor:
        quantization = self.quantization
        tiled = quantization.tiled_weight  # kept for the backward: not in scratch
        x_q = layer.operand(quantization, rows, 1, "input", "a")
        w_q = layer.operand(quantization, weight, 1, "weight", None if tiled else "b")
        out = block_gemm(x_q, transposed(w_q), out_dtype, quantization)
        # A tiled weight is the same along both dimensions: its quantization is kept for dx
        # (the emulation's FP32 tensor is saved; the real GEMM's elements and scales travel on
        # the context). Other operands are quantized again from the high-precision tensors.
        if tiled and layer.plan.input_grad == self:  # nothing else reads them
            kept[self._tiles_key] = w_q
        return out

    def input_grad(self, b: Backward) -> torch.Tensor:
        quantization, layer = self.quantization, b.layer
        # dx = dy W: both along out_features, the weight quantized where it lies (row-major,
        # as an FP32 Linear's backward reads it: no transposed copy).
        g_q = layer.operand(quantization, b.g, 1, "grad", "a")
        w_q = b.kept.get(self._tiles_key)
        if w_q is None and quantization.tiled_weight:  # the forward ran in another format: tile now
            w_q = layer.operand(quantization, b.weight, 1, "weight", None)
        elif w_q is None:
            w_q = layer.operand(quantization, b.weight, 0, "weight", "b", True)
        return block_gemm(g_q, w_q, b.x_dtype, quantization)

    def weight_grad(self, b: Backward) -> torch.Tensor:
        """dW = dyᵀ x, both along the tokens, padded to whole blocks (zeros add nothing to it, nor
        to any block's amax); in FP32: the Hadamard transform is not rounded to BF16 before it
        is quantized. Emulated: quantized where they lie (tokens x features: no transposed copy;
        the GEMM reads dyᵀ as a view, as an FP32 Linear's backward does). Real: transposed once
        so that the tokens are the contiguous dimension (K-major, what the kernel reads)."""
        assert b.rows is not None  # re-quantized along the tokens: the forward saved them
        layer, quantization, g, rows = b.layer, self.quantization, b.g, b.rows
        if not quantization.real_gemm:
            g_t = _whole_blocks(g, quantization.block_size, "dy_t")
            x_t = _whole_blocks(rows, quantization.block_size, "x_t")
            if quantization.hadamard:  # into scratch: random_hadamard_transform's bits
                g_t = hadamard_rows(g_t, layer.rht_signs, "dy_h")
                x_t = hadamard_rows(x_t, layer.rht_signs, "x_h")
            g_q = layer.operand(quantization, g_t, 0, "grad", "a", True)
            x_q = layer.operand(quantization, x_t, 0, "input", "b", True)
            return block_gemm(g_q.t(), x_q, torch.float32, quantization)
        g_t = _tokens_last(g, quantization.block_size, "dy_t")
        x_t = _tokens_last(rows, quantization.block_size, "x_t")
        if quantization.hadamard:  # in place, in their scratch: random_hadamard_transform's bits
            hadamard_(g_t, layer.rht_signs)
            hadamard_(x_t, layer.rht_signs)
        g_q = layer.operand(quantization, g_t, 1, "grad", "a")
        x_q = layer.operand(quantization, x_t, 1, "input", "b")
        return block_gemm(g_q, transposed(x_q), torch.float32, quantization)


class BlockLinear(QuantizedLinear):
    """A :class:`~mptrain.precision.quant.linear.QuantizedLinear` whose GEMMs run in
    block-scaled formats (``plan``: by default ``quantization``'s for all three; a GEMM of the plan
    may be in another block format or in high precision). Parameters stay FP32 and are the
    wrapped layer's own (:meth:`from_linear`); ``in_features`` and ``out_features`` must be
    multiples of each format's block size (ValueError otherwise).

    It holds the block formats' state: ``seed`` gives the layer its random Hadamard signs and its
    stochastic-rounding generator (on the weight's device; its state is what a checkpoint saves
    to resume the draws), and the quantizations' counts (not in the state_dict).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        quantization: BlockQuantization,
        seed: int = 0,
        plan: GemmPlan | None = None,
    ) -> None:
        super().__init__(
            in_features, out_features, bias, plan or GemmPlan.uniform(BlockGemm(quantization))
        )
        self.quantization = quantization
        self.sampling = False  # count the next quantizations (BlockStats) while set
        self.sizes = {role: dict.fromkeys(("samples", *SHAPES), 0) for role in ROLES}
        self._seed(seed, self.weight.device)

    def _seed(self, seed: int, device: torch.device) -> None:
        """The layer's Hadamard signs, generator and counters, on ``device``."""
        self.seed = seed
        with torch.device("cpu"):  # rht_signs draws on the CPU, whatever the default device
            signs = rht_signs(seed)
        self.register_buffer("rht_signs", signs.to(device), persistent=False)
        counts = torch.zeros(len(ROLES), len(COUNTS), dtype=torch.int64, device=device)
        self.register_buffer("counts", counts, persistent=False)
        # A format of the plan rounds gradients stochastically (NVFP4's quantization).
        quantizations = [f.quantization for f in self.plan.formats if isinstance(f, BlockGemm)]
        self.generator: torch.Generator | None = None
        if any(r.stochastic_rounding for r in quantizations) and device.type != "meta":
            self.generator = torch.Generator(device).manual_seed(seed)

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        quantization: BlockQuantization,
        seed: int = 0,
        plan: GemmPlan | None = None,
    ) -> BlockLinear:
        """Wrap an existing layer, sharing its Parameter objects (optimizers keep working)."""
        with torch.device("meta"):
            bias = linear.bias is not None
            new = cls(linear.in_features, linear.out_features, bias, quantization, plan=plan)
        new.weight, new.bias = linear.weight, linear.bias
        new._seed(seed, linear.weight.device)
        return new

    def operand(
        self,
        quantization: BlockQuantization,
        t: torch.Tensor,
        dim: int,
        role: str,
        slot: str | None,
        keep_layout: bool = False,
    ) -> Operand:
        """``t`` quantized along ``dim`` as ``quantization`` says, for one GEMM, counted while
        ``sampling``. For the real GEMM the quantization itself (elements and scales); for the
        emulated one dequantized to FP32: through the quantizer while counting (new memory), else
        the fast path (the same bits) into the scratch ``slot`` when given
        (:func:`mptrain.precision.quant.fake.scratch`: the GEMM reads it at once), in ``t``'s
        layout with ``keep_layout``."""
        real = quantization.real_gemm
        if not self.sampling and not real:
            return fake_quant_operand(
                quantization,
                t,
                dim,
                role,
                generator=self.generator,
                out=slot,
                keep_layout=keep_layout,
            )
        quantized = quantize_operand(
            quantization, t, dim, role, generator=self.generator, stats=self.sampling
        )
        if self.sampling:
            self._count(role, quantized.stats)
        return quantized if real else quantized.dequantize(torch.float32)

    def _count(self, role: str, stats: BlockStats) -> None:
        """Add one quantization's counts (device tensors: no host read)."""
        index = ROLES.index(role)
        self.counts[index] += torch.stack([getattr(stats, c) for c in COUNTS])
        sizes = self.sizes[role]
        sizes["samples"] += 1
        sizes["elements"] += stats.elements
        sizes["blocks"] += stats.blocks

    def layer_stats(self) -> dict[str, dict[str, int]]:
        """Per role, the quantizations counted and their sums (reads device values)."""
        counts = self.counts.tolist()
        return {
            role: {**self.sizes[role], **dict(zip(COUNTS, counts[i], strict=True))}
            for i, role in enumerate(ROLES)
        }

    def extra_repr(self) -> str:
        gemm = "scaled_mm" if self.quantization.real_gemm else "emulated"
        return f"{super().extra_repr()}, format={self.quantization.format}, gemm={gemm}"
