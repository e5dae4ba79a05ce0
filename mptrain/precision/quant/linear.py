"""One quantized Linear (issue 40): :class:`QuantizedLinear`, an ``nn.Linear`` whose three GEMMs
each run in a format of the layer's :class:`GemmPlan`, and the one autograd function that computes
them. FP8 (:class:`~mptrain.precision.quant.fp8_linear.Float8Linear`) and the block-scaled formats
(:class:`~mptrain.precision.quant.block_linear.BlockLinear`) are this layer with the state their
quantizers keep; their GEMMs are formats of a plan, not functions of their own.

A Linear computes three GEMMs, each reducing over its own dimension:

- forward ``y = x Wᵀ``: the input and the weight, over in_features;
- input gradient ``dx = dy W``: the output gradient and the weight, over out_features;
- weight gradient ``dW = dyᵀ x``: the output gradient and the input, over the tokens.

A :class:`GemmFormat` runs one kind of GEMM: it quantizes its two operands along the GEMM's
reduction dimension and multiplies them with FP32 accumulation, on a real kernel or emulated.
The plan names the format of each GEMM: the same one for all three in a precision's own
quantization, else as ``precision.gemms`` says (:mod:`mptrain.precision.gemm_plans`).

What crosses from the forward to the backward: the high-precision input rows, unless the weight
gradient's format reuses the forward's quantization of them (FP8 tensorwise: delayed scaling must
not cast a tensor twice), the weight (a Parameter: no memory of its own), and what the forward's
format keeps for a backward GEMM of its own format (``kept``: FP8 tensorwise's casts, a tiled
weight's quantization). Within one backward the two GEMMs share a ``cache`` (FP8 tensorwise casts
the output gradient once for both).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

# The three GEMMs of a Linear, by their name in a plan and the report.
GEMMS = ("forward", "input_grad", "weight_grad")


@dataclass
class Backward:
    """What a backward GEMM is given: the ``layer``, the output gradient ``g`` (2-D), the forward's
    high-precision input ``rows`` (None when the weight gradient's format reuses the forward's
    quantization) and ``weight``, what the forward's format ``kept``, the input's dtype
    (``x_dtype``, the input gradient's) and a ``cache`` the two backward GEMMs share."""

    layer: nn.Module
    g: torch.Tensor
    rows: torch.Tensor | None
    weight: torch.Tensor
    kept: dict[str, Any]
    x_dtype: torch.dtype
    cache: dict[str, Any] = field(default_factory=dict)


class GemmFormat:
    """How one kind of GEMM runs (see the module doc). A subclass implements the three GEMMs;
    each quantizes what it is given along the GEMM's reduction dimension. ``layer`` holds the
    state a format's quantizers keep (FP8 scalers, block generators and counts)."""

    label = "?"  # the report's word for the format

    def check_features(self, in_features: int, out_features: int) -> None:
        """ValueError when a layer of these sizes cannot run this format's GEMMs."""

    def reuses_forward(self, forward: GemmFormat) -> bool:
        """A backward GEMM of this format reads what ``forward``'s format kept, not the
        high-precision tensors (the forward then need not save them)."""
        return False

    def forward(
        self,
        layer: nn.Module,
        rows: torch.Tensor,
        weight: torch.Tensor,
        out_dtype: torch.dtype,
        kept: dict[str, Any],
    ) -> torch.Tensor:
        """``y = rows Wᵀ`` in ``out_dtype``; what a backward GEMM of this format reuses goes into
        ``kept`` (tensors are saved for the backward, anything else travels on the context)."""
        raise NotImplementedError

    def input_grad(self, b: Backward) -> torch.Tensor:
        """``dx = g W`` in the input's dtype."""
        raise NotImplementedError

    def weight_grad(self, b: Backward) -> torch.Tensor:
        """``dW = gᵀ rows`` in FP32 (``b.rows`` is None when this format reuses the forward's)."""
        raise NotImplementedError


@dataclass(frozen=True)
class HighPrecisionGemm(GemmFormat):
    """A GEMM without quantization: both operands rounded to ``dtype`` (BF16 or FP32) and
    multiplied by ``torch.mm`` in it (FP32 accumulation inside the kernel), as an autocast
    ``nn.Linear`` computes; the output rounded to the caller's dtype, the weight gradient FP32."""

    dtype: torch.dtype = torch.bfloat16

    @property
    def label(self) -> str:  # type: ignore[override]  # a class attribute in the base
        return "bf16" if self.dtype == torch.bfloat16 else "fp32"

    def forward(
        self,
        layer: nn.Module,
        rows: torch.Tensor,
        weight: torch.Tensor,
        out_dtype: torch.dtype,
        kept: dict[str, Any],
    ) -> torch.Tensor:
        return torch.mm(rows.to(self.dtype), weight.to(self.dtype).t()).to(out_dtype)

    def input_grad(self, b: Backward) -> torch.Tensor:
        return torch.mm(b.g.to(self.dtype), b.weight.to(self.dtype)).to(b.x_dtype)

    def weight_grad(self, b: Backward) -> torch.Tensor:
        assert b.rows is not None  # a high-precision GEMM reuses nothing: the forward saved them
        return torch.mm(b.g.to(self.dtype).t(), b.rows.to(self.dtype)).float()


@dataclass(frozen=True)
class GemmPlan:
    """The format of each of a Linear's three GEMMs (see the module doc)."""

    forward: GemmFormat
    input_grad: GemmFormat
    weight_grad: GemmFormat

    @classmethod
    def uniform(cls, fmt: GemmFormat) -> GemmPlan:
        """One format for all three GEMMs: a precision's own quantization."""
        return cls(fmt, fmt, fmt)

    @property
    def formats(self) -> list[GemmFormat]:
        """The distinct formats, forward's first."""
        return list(dict.fromkeys((self.forward, self.input_grad, self.weight_grad)))

    @property
    def saves_input(self) -> bool:
        """The forward saves the high-precision input rows for the weight gradient."""
        return not self.weight_grad.reuses_forward(self.forward)

    def check_features(self, in_features: int, out_features: int) -> None:
        for fmt in self.formats:
            fmt.check_features(in_features, out_features)

    def describe(self) -> dict[str, str]:
        """The format of each GEMM, as the report's per-layer table shows it."""
        return {gemm: getattr(self, gemm).label for gemm in GEMMS}


@dataclass(frozen=True)
class LayerPlans:
    """A per-GEMM ``plan`` for the converted layers whose names match one of ``patterns``
    (fnmatch, ``*`` for all); the others keep their format's uniform plan."""

    plan: GemmPlan
    patterns: tuple[str, ...] = ("*",)

    def for_layer(self, name: str) -> GemmPlan | None:
        """The plan of layer ``name``; None: its format's own."""
        matched = any(fnmatch.fnmatchcase(name, p) for p in self.patterns)
        return self.plan if matched else None

    def describe(self, name: str) -> dict[str, str]:
        """The report row's ``gemms`` entry of layer ``name`` (empty: the format's own)."""
        plan = self.for_layer(name)
        return {} if plan is None else {"gemms": plan.describe()}


class _QuantizedLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        layer: QuantizedLinear,
        out_dtype: torch.dtype,
    ) -> torch.Tensor:
        plan = layer.plan
        rows = x.reshape(-1, x.shape[-1])
        kept: dict[str, Any] = {}
        out = plan.forward.forward(layer, rows, weight, out_dtype, kept)
        if bias is not None:
            out = out + bias.to(out_dtype)
        tensors = {k: v for k, v in kept.items() if v is None or isinstance(v, torch.Tensor)}
        ctx.kept_keys = tuple(tensors)
        ctx.kept_other = {k: v for k, v in kept.items() if k not in tensors}
        ctx.save_for_backward(rows if plan.saves_input else None, weight, *tensors.values())
        ctx.layer, ctx.x_shape, ctx.x_dtype = layer, x.shape, x.dtype
        ctx.has_bias = bias is not None
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        rows, weight, *values = ctx.saved_tensors
        kept = {**dict(zip(ctx.kept_keys, values, strict=True)), **ctx.kept_other}
        layer: QuantizedLinear = ctx.layer
        plan = layer.plan
        g = grad_out.reshape(-1, grad_out.shape[-1])
        if layer.contiguous_grad:
            g = g.contiguous()
        b = Backward(layer, g, rows, weight, kept, ctx.x_dtype)
        grad_x = plan.input_grad.input_grad(b)
        grad_w = plan.weight_grad.weight_grad(b)
        grad_b = g.float().sum(0) if ctx.has_bias else None
        return grad_x.reshape(ctx.x_shape), grad_w, grad_b, None, None


class QuantizedLinear(nn.Linear):
    """An nn.Linear whose three GEMMs run in the formats of ``plan`` (see the module doc).
    Parameters stay FP32 and, through ``from_linear`` of a subclass, are the wrapped layer's own
    (optimizers keep working). Subclasses hold what their formats' quantizers keep: FP8's
    per-role scalers (:class:`~mptrain.precision.quant.fp8_linear.Float8Linear`), the block formats'
    generator, Hadamard signs and counts (:class:`~mptrain.precision.quant.block_linear.BlockLinear`).

    ``contiguous_grad``: the output gradient is made contiguous before the backward GEMMs (the
    FP8 formats' operand layouts need it; the block formats read it where it lies).
    """

    contiguous_grad = False

    def __init__(self, in_features: int, out_features: int, bias: bool, plan: GemmPlan) -> None:
        super().__init__(in_features, out_features, bias=bias)
        plan.check_features(in_features, out_features)
        self.plan = plan

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The three GEMMs' function with autocast off inside, its output in the autocast dtype
        when autocast is on (the surrounding model computes in it), else in ``x``'s; reshaped to
        ``x``'s leading dimensions outside the function."""
        device_type = x.device.type
        autocast = torch.is_autocast_enabled(device_type)
        out_dtype = torch.get_autocast_dtype(device_type) if autocast else x.dtype
        with torch.autocast(device_type, enabled=False):
            out = _QuantizedLinearFunction.apply(x, self.weight, self.bias, self, out_dtype)
        # Reshape outside the function: a view returned by it could not be modified in place.
        # A 2-D input needs none: FSDP2 warns of a view output, whose in-place change (the next
        # ReLU(inplace=True)) would drop its pre-backward hook.
        if x.dim() == 2:
            return out
        return out.reshape(*x.shape[:-1], self.out_features)
