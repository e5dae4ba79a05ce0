"""FP8 GEMMs and :class:`Float8Linear`: the layout and alignment rules ``torch._scaled_mm`` needs
(checked on every device), the real and emulated GEMMs, and the tensorwise and rowwise autograd
functions whose three GEMMs take FP8 operands and accumulate in FP32.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mptrain.platform.dtypes import dtype_name
from mptrain.precision.fp8.quant import (
    E5M2,
    GEMM_ALIGNMENT,
    FP8Recipe,
    TensorScaler,
)


# ------------------------------------------------------------------------------------ GEMM
def _is_row_major(t: torch.Tensor) -> bool:
    return t.stride(1) == 1 and t.stride(0) == t.shape[1]


def _is_column_major(t: torch.Tensor) -> bool:
    return t.stride(0) == 1 and t.stride(1) == t.shape[0]


def check_gemm_operands(
    a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor
) -> None:
    """The torch._scaled_mm contract, enforced on every device.

    ``a`` (M×K) row-major, ``b`` (K×N) column-major, K and N multiples of 16, not both E5M2;
    scales either both per tensor (shape ()) or both rowwise: (M, 1) for ``a``, (1, N) for ``b``.
    """
    (m, k), (k_b, n) = a.shape, b.shape
    tensorwise = a_scale.shape == b_scale.shape == ()
    rowwise = a_scale.shape == (m, 1) and b_scale.shape == (1, n)
    if not (tensorwise or rowwise):
        raise ValueError(
            f"FP8 GEMM: scales {tuple(a_scale.shape)} and {tuple(b_scale.shape)} are neither "
            f"both per tensor nor rowwise ({m}, 1) and (1, {n})"
        )
    if k != k_b:
        raise ValueError(f"FP8 GEMM: inner dimensions differ ({k} vs {k_b})")
    if k % GEMM_ALIGNMENT or n % GEMM_ALIGNMENT:
        raise ValueError(f"FP8 GEMM: K={k} and N={n} must be multiples of {GEMM_ALIGNMENT}")
    if not _is_row_major(a):
        raise ValueError("FP8 GEMM: the first operand must be row-major")
    if not _is_column_major(b):
        raise ValueError("FP8 GEMM: the second operand must be column-major")
    if a.dtype == E5M2 and b.dtype == E5M2:
        raise ValueError("FP8 GEMM: E5M2 x E5M2 is not supported; one operand must be E4M3")


def fp8_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    out_dtype: torch.dtype,
    real: bool,
) -> torch.Tensor:
    """``dequantize(a) @ dequantize(b)`` with FP32 accumulation, as ``torch._scaled_mm`` computes it
    (scales per tensor or rowwise: see :func:`check_gemm_operands`)."""
    check_gemm_operands(a, a_scale, b, b_scale)
    a_inv, b_inv = a_scale.reciprocal(), b_scale.reciprocal()
    if real:
        return torch._scaled_mm(a, b, scale_a=a_inv, scale_b=b_inv, out_dtype=out_dtype)
    # FP8 values are exact in FP32: multiply them exactly-rounded in FP32, rescale once.
    # autocast off: torch.compile traces the backward under the forward's autocast (torch 2.14
    # default backward_pass_autocast="same_as_forward"), which would run this mm in BF16.
    with torch.autocast(a.device.type, enabled=False):
        return (torch.mm(a.float(), b.float()) * (a_inv * b_inv)).to(out_dtype)


def _pad_rows(t: torch.Tensor, multiple: int) -> torch.Tensor:
    """Zero rows up to a multiple (they add nothing to dW = dyᵀ x, whose K is the row count)."""
    extra = -t.shape[0] % multiple
    return F.pad(t, (0, 0, 0, extra)) if extra else t


def _remember_call(ctx: Any, module: Float8Linear, x: torch.Tensor, bias: Any) -> None:
    """What a backward needs besides its saved tensors: the layer, the input's shape and dtype
    (the input gradient takes them) and whether there is a bias to give a gradient."""
    ctx.module, ctx.x_shape, ctx.x_dtype, ctx.has_bias = module, x.shape, x.dtype, bias is not None


class _Float8LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        module: Float8Linear,
        out_dtype: torch.dtype,
    ) -> torch.Tensor:
        # Row-major operands whatever the caller's layout (a transposed input, a batch-of-one
        # view): the GEMM rules below hold for every input nn.Linear accepts.
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        update = module.training
        x_fp8, x_scale = module.input_scaler.cast(rows, update)
        w_fp8, w_scale = module.weight_scaler.cast(weight.contiguous(), update)
        real = module.recipe.real_gemm
        # y = x Wᵀ: x row-major (M×K), Wᵀ column-major (K×N) is W stored row-major.
        out = fp8_gemm(x_fp8, x_scale, w_fp8.t(), w_scale, out_dtype, real)
        if bias is not None:
            out = out + bias.to(out_dtype)
        ctx.save_for_backward(x_fp8, x_scale, w_fp8, w_scale)
        _remember_call(ctx, module, x, bias)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        x_fp8, x_scale, w_fp8, w_scale = ctx.saved_tensors
        module: Float8Linear = ctx.module
        real = module.recipe.real_gemm
        g = grad_out.reshape(-1, grad_out.shape[-1]).contiguous()
        g_fp8, g_scale = module.grad_scaler.cast(g)
        # dx = dy W: dy row-major (M×N), W column-major (N×K).
        w_col = w_fp8.t().contiguous().t()
        grad_x = fp8_gemm(g_fp8, g_scale, w_col, w_scale, ctx.x_dtype, real)
        # dW = dyᵀ x: dyᵀ row-major (N×M), x column-major (M×K); M padded to the alignment.
        g_t = _pad_rows(g_fp8.float(), GEMM_ALIGNMENT).to(g_fp8.dtype).t().contiguous()
        x_col = _pad_rows(x_fp8.float(), GEMM_ALIGNMENT).to(x_fp8.dtype).t().contiguous().t()
        grad_w = fp8_gemm(g_t, g_scale, x_col, x_scale, torch.float32, real)
        grad_b = g.float().sum(0) if ctx.has_bias else None
        return grad_x.reshape(ctx.x_shape), grad_w, grad_b, None, None


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


class _RowwiseFloat8LinearFunction(torch.autograd.Function):
    """Rowwise scaling, as torchao's rowwise recipe: every GEMM operand gets one scale per row
    (left operand) or per column (right operand), the slices that do not meet in the sum, so
    ``_scaled_mm`` can apply them to the product. Each GEMM needs its operands scaled along its
    own outer dimension, so the input and the weight are quantized again in the backward (along
    the other axis) from their high-precision values, which the forward saves."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        module: Float8Linear,
        out_dtype: torch.dtype,
    ) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        update = module.training
        x_fp8, x_scale = module.input_scaler.cast_along(rows, -1, update)  # (M, 1)
        w_fp8, w_scale = module.weight_scaler.cast_along(weight.contiguous(), -1, update)  # (N, 1)
        # y = x Wᵀ: one scale per row of x and per column of Wᵀ (= per row of W).
        out = _rowwise_gemm(
            x_fp8, x_scale, w_fp8.t(), w_scale.t(), out_dtype, module.recipe.real_gemm
        )
        if bias is not None:
            out = out + bias.to(out_dtype)
        ctx.save_for_backward(rows, weight)
        _remember_call(ctx, module, x, bias)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        rows, weight = ctx.saved_tensors
        module: Float8Linear = ctx.module
        real = module.recipe.real_gemm
        g = grad_out.reshape(-1, grad_out.shape[-1]).contiguous()
        # The counted casts are the forward's (input, weight) and this one (grad); the casts
        # along the other axis below quantize the same tensors again and are not counted twice.
        g_rows, g_row_scale = module.grad_scaler.cast_along(g, -1)  # (M, 1)
        w_cols, w_col_scale = module.weight_scaler.cast_along(weight.contiguous(), 0, False)
        # dx = dy W: per row of dy, per column of W (N×K, column-major).
        w_col_major = w_cols.t().contiguous().t()
        grad_x = _rowwise_gemm(g_rows, g_row_scale, w_col_major, w_col_scale, ctx.x_dtype, real)
        # dW = dyᵀ x: per column of dy (a row of dyᵀ) and per column of x; M padded to 16.
        g_cols, g_col_scale = module.grad_scaler.cast_along(g, 0, False)  # (1, N)
        x_cols, x_col_scale = module.input_scaler.cast_along(rows, 0, False)  # (1, K)
        g_t = _pad_rows(g_cols.float(), GEMM_ALIGNMENT).to(g_cols.dtype).t().contiguous()
        x_col = _pad_rows(x_cols.float(), GEMM_ALIGNMENT).to(x_cols.dtype).t().contiguous().t()
        grad_w = _rowwise_gemm(g_t, g_col_scale.t(), x_col, x_col_scale, torch.float32, real)
        grad_b = g.float().sum(0) if ctx.has_bias else None
        return grad_x.reshape(ctx.x_shape), grad_w, grad_b, None, None


def apply_linear_function(
    function: type[torch.autograd.Function], layer: nn.Linear, x: torch.Tensor
) -> torch.Tensor:
    """``function.apply(x, weight, bias, layer, out_dtype)`` for a Linear whose GEMMs run in a
    format of their own (FP8 here, the block-scaled formats' BlockLinear): autocast off inside,
    the output in the autocast dtype when autocast is on (the surrounding model computes in it),
    else in ``x``'s; reshaped to ``x``'s leading dimensions outside the Function."""
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        out_dtype = torch.get_autocast_dtype(device_type)
    else:
        out_dtype = x.dtype
    with torch.autocast(device_type, enabled=False):
        out = function.apply(x, layer.weight, layer.bias, layer, out_dtype)
    # Reshape outside the Function: a view returned by it could not be modified in place.
    # A 2-D input needs none: FSDP2 warns of a view output, whose in-place change (the next
    # ReLU(inplace=True)) would drop its pre-backward hook.
    if x.dim() == 2:
        return out
    return out.reshape(*x.shape[:-1], layer.out_features)


class Float8Linear(nn.Linear):
    """An nn.Linear whose GEMMs run in FP8 (see module doc). Parameters stay FP32.

    Subclasses nn.Linear so state_dict keys, ``in_features``/``out_features`` and code that checks
    ``isinstance(m, nn.Linear)`` keep working; it adds the scalers' buffers.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, recipe: FP8Recipe) -> None:
        super().__init__(in_features, out_features, bias=bias)
        for name, size in (("in_features", in_features), ("out_features", out_features)):
            if size % GEMM_ALIGNMENT:
                raise ValueError(
                    f"Float8Linear: {name}={size} is not a multiple of {GEMM_ALIGNMENT}"
                )
        self.recipe = recipe
        self.input_scaler = TensorScaler(recipe.forward_dtype, recipe)
        self.weight_scaler = TensorScaler(recipe.forward_dtype, recipe)
        self.grad_scaler = TensorScaler(recipe.backward_dtype, recipe)

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: FP8Recipe) -> Float8Linear:
        """Wrap an existing layer, sharing its Parameter objects (optimizers keep working)."""
        with torch.device("meta"):
            new = cls(linear.in_features, linear.out_features, linear.bias is not None, recipe)
        new.weight = linear.weight
        new.bias = linear.bias
        device = linear.weight.device
        for scaler in (new.input_scaler, new.weight_scaler, new.grad_scaler):
            scaler.to_empty(device=device)
            scaler.reset()
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        function = (
            _RowwiseFloat8LinearFunction
            if self.recipe.granularity == "rowwise"
            else _Float8LinearFunction
        )
        return apply_linear_function(function, self, x)

    def extra_repr(self) -> str:
        fmt = f"{dtype_name(self.recipe.forward_dtype)}/{dtype_name(self.recipe.backward_dtype)}"
        gemm = "scaled_mm" if self.recipe.real_gemm else "emulated"
        scaling = f"{self.recipe.scaling} {self.recipe.granularity}"
        return f"{super().extra_repr()}, fp8={fmt}, scaling={scaling}, gemm={gemm}"
