"""FP8 GEMMs and :class:`Float8Linear`: the layout and alignment rules ``torch._scaled_mm`` needs
(checked on every device), the real and emulated GEMMs, and the tensorwise and rowwise GEMM
formats (:class:`FP8TensorwiseGemm`, :class:`FP8RowwiseGemm`) whose GEMMs take FP8 operands and
accumulate in FP32, run by the one quantized Linear (:mod:`mptrain.precision.quant.linear`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mptrain.platform.dtypes import dtype_name
from mptrain.precision.quant.fp8 import GEMM_ALIGNMENT, FP8Quantization, TensorScaler
from mptrain.precision.quant.kernels import fp8_gemm
from mptrain.precision.quant.linear import Backward, GemmFormat, GemmPlan, QuantizedLinear


def _padded_t(t: torch.Tensor) -> torch.Tensor:
    """The FP8 ``t`` (M×N) transposed into a row-major (N×M') copy, M padded with zero rows to
    the alignment (they add nothing to dW = dyᵀ x, whose K is the row count): dW's left operand;
    its ``.t()``, column-major, is dW's right operand."""
    t32, extra = t.float(), -t.shape[0] % GEMM_ALIGNMENT
    return (F.pad(t32, (0, 0, 0, extra)) if extra else t32).to(t.dtype).t().contiguous()


class _FP8Gemm(GemmFormat):
    """What both FP8 granularities share: the quantization, and the alignment torch._scaled_mm needs."""

    quantization: FP8Quantization

    def check_features(self, in_features: int, out_features: int) -> None:
        for name, size in (("in_features", in_features), ("out_features", out_features)):
            if size % GEMM_ALIGNMENT:
                raise ValueError(
                    f"Float8Linear: {name}={size} is not a multiple of {GEMM_ALIGNMENT}"
                )


@dataclass(frozen=True)
class FP8TensorwiseGemm(_FP8Gemm):
    """One scale per tensor, from the layer's scaler of each role (dynamic or delayed). The
    forward's casts of the input and weight serve the backward GEMMs of this format (a tensor
    scale is the same along either axis; delayed scaling must not cast a tensor twice), and the
    output gradient is cast once for both backward GEMMs."""

    quantization: FP8Quantization
    label = "fp8 tensorwise"

    def reuses_forward(self, forward: GemmFormat) -> bool:
        return forward == self

    def forward(
        self,
        layer: nn.Module,
        rows: torch.Tensor,
        weight: torch.Tensor,
        out_dtype: torch.dtype,
        kept: dict[str, Any],
    ) -> torch.Tensor:
        # Row-major operands whatever the caller's layout (a transposed input, a batch-of-one
        # view): the GEMM rules hold for every input nn.Linear accepts.
        update = layer.training
        x_fp8, x_scale = layer.input_scaler.cast(rows.contiguous(), update)
        w_fp8, w_scale = layer.weight_scaler.cast(weight.contiguous(), update)
        # y = x Wᵀ: x row-major (M×K), Wᵀ column-major (K×N) is W stored row-major.
        out = fp8_gemm(x_fp8, x_scale, w_fp8.t(), w_scale, out_dtype, self.quantization.real_gemm)
        # Kept only for a backward GEMM of this format (the input's cast: exactly when the plan
        # saves no input rows, GemmPlan.saves_input).
        if layer.plan.weight_grad.reuses_forward(self):
            kept.update(fp8_x=x_fp8, fp8_x_scale=x_scale)
        if layer.plan.input_grad == self:
            kept.update(fp8_w=w_fp8, fp8_w_scale=w_scale)
        return out

    @staticmethod
    def _cast(kept: dict[str, Any], key: str, scaler: nn.Module, t: torch.Tensor) -> Any:
        """The forward's cast of ``t`` when the forward ran in this format, else one now."""
        if key in kept:
            return kept[key], kept[f"{key}_scale"]
        return scaler.cast(t.contiguous())

    @staticmethod
    def _grad(b: Backward) -> Any:
        """The output gradient's one cast, shared by both backward GEMMs of this format."""
        if "fp8_g" not in b.cache:
            b.cache["fp8_g"] = b.layer.grad_scaler.cast(b.g)
        return b.cache["fp8_g"]

    def input_grad(self, b: Backward) -> torch.Tensor:
        g_fp8, g_scale = self._grad(b)
        w_fp8, w_scale = self._cast(b.kept, "fp8_w", b.layer.weight_scaler, b.weight)
        # dx = dy W: dy row-major (M×N), W column-major (N×K).
        w_col = w_fp8.t().contiguous().t()
        return fp8_gemm(g_fp8, g_scale, w_col, w_scale, b.x_dtype, self.quantization.real_gemm)

    def weight_grad(self, b: Backward) -> torch.Tensor:
        g_fp8, g_scale = self._grad(b)
        x_fp8, x_scale = self._cast(b.kept, "fp8_x", b.layer.input_scaler, b.rows)
        # dW = dyᵀ x: dyᵀ row-major (N×M), x column-major (M×K); M padded to the alignment.
        g_t, x_col = _padded_t(g_fp8), _padded_t(x_fp8).t()
        return fp8_gemm(g_t, g_scale, x_col, x_scale, torch.float32, self.quantization.real_gemm)


# torch's rowwise-scaled FP8 GEMM kernels write BF16 only; the emulation rounds the same way.
ROWWISE_GEMM_OUT = torch.bfloat16


def _rowwise_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    out_dtype: torch.dtype,
    real: bool,
) -> torch.Tensor:
    """A rowwise-scaled FP8 GEMM: BF16 out of the GEMM (real or emulated), then ``out_dtype``."""
    return fp8_gemm(a, a_scale, b, b_scale, ROWWISE_GEMM_OUT, real).to(out_dtype)


_COUNTED = "fp8_rowwise_counted"  # kept / cache: this step's casts of a role were counted


@dataclass(frozen=True)
class FP8RowwiseGemm(_FP8Gemm):
    """Rowwise scaling, as torchao's rowwise quantization: every GEMM operand gets one scale per row
    (left operand) or per column (right operand), the slices that do not meet in the sum, so
    ``_scaled_mm`` can apply them to the product. Each GEMM needs its operands scaled along its
    own outer dimension, so the input and the weight are quantized again in the backward (along
    the other axis) from their high-precision values, which the forward saves. The counted
    casts are the forward's (input, weight) and the input gradient's (grad); the later GEMMs
    quantize the same tensors again and are not counted twice — unless, in a per-GEMM plan, the
    GEMM that counts a role ran in another format: then the next rowwise GEMM counts it."""

    quantization: FP8Quantization
    label = "fp8 rowwise"

    def forward(
        self,
        layer: nn.Module,
        rows: torch.Tensor,
        weight: torch.Tensor,
        out_dtype: torch.dtype,
        kept: dict[str, Any],
    ) -> torch.Tensor:
        update = layer.training
        x_fp8, x_scale = layer.input_scaler.cast_along(rows.contiguous(), -1, update)  # (M, 1)
        w_fp8, w_scale = layer.weight_scaler.cast_along(weight.contiguous(), -1, update)  # (N, 1)
        kept[_COUNTED] = True  # the input and weight casts of this step are counted
        # y = x Wᵀ: one scale per row of x and per column of Wᵀ (= per row of W).
        real = self.quantization.real_gemm
        return _rowwise_gemm(x_fp8, x_scale, w_fp8.t(), w_scale.t(), out_dtype, real)

    def input_grad(self, b: Backward) -> torch.Tensor:
        g_rows, g_row_scale = b.layer.grad_scaler.cast_along(b.g, -1)  # (M, 1)
        b.cache[_COUNTED] = True  # the grad cast of this step is counted
        counted = b.kept.get(_COUNTED, False)  # the forward ran in another format: count it here
        w_cols, w_col_scale = b.layer.weight_scaler.cast_along(
            b.weight.contiguous(), 0, not counted
        )
        # dx = dy W: per row of dy, per column of W (N×K, column-major).
        w_col_major = w_cols.t().contiguous().t()
        real = self.quantization.real_gemm
        return _rowwise_gemm(g_rows, g_row_scale, w_col_major, w_col_scale, b.x_dtype, real)

    def weight_grad(self, b: Backward) -> torch.Tensor:
        assert b.rows is not None  # rowwise re-quantizes: the forward saved them
        # dW = dyᵀ x: per column of dy (a row of dyᵀ), (1, N), and of x, (1, K); M padded to 16.
        g_cols, g_col_scale = b.layer.grad_scaler.cast_along(
            b.g, 0, not b.cache.get(_COUNTED, False)
        )
        x_cols, x_col_scale = b.layer.input_scaler.cast_along(
            b.rows.contiguous(), 0, not b.kept.get(_COUNTED, False)
        )
        g_t, x_col = _padded_t(g_cols), _padded_t(x_cols).t()
        real = self.quantization.real_gemm
        return _rowwise_gemm(g_t, g_col_scale.t(), x_col, x_col_scale, torch.float32, real)


def fp8_gemm_format(quantization: FP8Quantization) -> _FP8Gemm:
    """The GEMM format of ``quantization``'s granularity (tensorwise or rowwise)."""
    if quantization.granularity == "rowwise":
        return FP8RowwiseGemm(quantization)
    return FP8TensorwiseGemm(quantization)


class Float8Linear(QuantizedLinear):
    """A :class:`~mptrain.precision.quant.linear.QuantizedLinear` whose GEMMs run in FP8
    (``plan``: by default ``quantization``'s granularity for all three; a GEMM of the plan may be in
    high precision instead). Parameters stay FP32. It holds the FP8 formats' state: a
    :class:`TensorScaler` per role (input, weight, grad), in its state_dict.
    """

    contiguous_grad = True

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        quantization: FP8Quantization,
        plan: GemmPlan | None = None,
    ) -> None:
        plan = plan or GemmPlan.uniform(fp8_gemm_format(quantization))
        super().__init__(in_features, out_features, bias, plan)
        self.quantization = quantization
        self.input_scaler = TensorScaler(quantization.forward_dtype, quantization)
        self.weight_scaler = TensorScaler(quantization.forward_dtype, quantization)
        self.grad_scaler = TensorScaler(quantization.backward_dtype, quantization)

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, quantization: FP8Quantization, plan: GemmPlan | None = None
    ) -> Float8Linear:
        """Wrap an existing layer, sharing its Parameter objects (optimizers keep working)."""
        with torch.device("meta"):
            bias = linear.bias is not None
            new = cls(linear.in_features, linear.out_features, bias, quantization, plan)
        new.weight, new.bias = linear.weight, linear.bias
        device = linear.weight.device
        for scaler in (new.input_scaler, new.weight_scaler, new.grad_scaler):
            scaler.to_empty(device=device)
            scaler.reset()
        return new

    def extra_repr(self) -> str:
        fmt = f"{dtype_name(self.quantization.forward_dtype)}/{dtype_name(self.quantization.backward_dtype)}"
        gemm = "scaled_mm" if self.quantization.real_gemm else "emulated"
        scaling = f"{self.quantization.scaling} {self.quantization.granularity}"
        return f"{super().extra_repr()}, fp8={fmt}, scaling={scaling}, gemm={gemm}"
