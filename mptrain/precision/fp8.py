"""FP8 training for nn.Linear layers: per-tensor scaled E4M3/E5M2 GEMMs, real or emulated.

The recipe follows Transformer Engine and torchao float8 training:

- Selected ``nn.Linear`` layers become :class:`Float8Linear`. Their three GEMMs (forward
  ``y = x Wᵀ``, backward ``dx = dy W`` and ``dW = dyᵀ x``) take FP8 operands, each with one scale per
  tensor, and accumulate in FP32. Activations and weights use E4M3 (max 448); gradients use E5M2
  (max 57344) in the ``hybrid`` format, or E4M3 everywhere in the ``e4m3`` format.
- Master weights, their gradients and the optimizer state stay FP32; the rest of the model runs
  under BF16 autocast.
- Scaling: ``dynamic`` ("current") scaling takes the scale from the tensor's absolute maximum at the
  moment of the cast; ``delayed`` scaling takes it from a history of earlier amax values (``max`` or
  ``most_recent`` of the history, divided by ``2**margin``). An amax that is zero or not finite
  gives no scale: the previous one is kept (as Transformer Engine does) and the cast is counted.
  Scales, amax histories, saturation and zero/non-finite amax counters are registered buffers:
  saved and restored with the model's state_dict.
- Power-of-two scales (``pow2_scales``, as torchao's ``round_scales_to_power_of_2``): every scale
  is rounded down to a power of two, so ``x * scale`` and the rescale of the product are exact and
  only the FP8 cast rounds; rounding down keeps ``amax * scale <= max`` (no new saturation), at the
  cost of up to one binade of the format's range.
- Layer selection (:func:`choose_layers`): every nn.Linear either converts or is kept in high
  precision with the reason (include/exclude patterns, first/last layer, the 16-alignment
  torch._scaled_mm needs, ``min_features``: layers too small to gain from FP8).

Two GEMM implementations share every layout and alignment rule (checked on every device, so code
that passes on the CPU cannot fail on the GPU because of a rule the CPU skipped):

- real: ``torch._scaled_mm`` on NVIDIA GPUs of compute capability >= 8.9 (Ada, Hopper);
- emulated: the same quantize -> FP8 cast happens, then the FP8 values (exact in FP32) are multiplied
  in FP32 and the product rescaled. Same numerics, no speed-up: reports label it "fp8 (emulated)".
"""

from __future__ import annotations

import fnmatch
import math
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mptrain.platform.dtypes import dtype_name

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
FP8_MAX = {E4M3: torch.finfo(E4M3).max, E5M2: torch.finfo(E5M2).max}  # 448, 57344


def saturation_boundary(dtype: torch.dtype) -> float:
    """The smallest FP32 magnitude that a round-to-nearest-even cast to ``dtype`` takes beyond the
    format's max: scaled values at or above it were clipped by saturation, those below it round to
    at most max anyway.

    Between max and the next step up (max + one ulp, past the format's range) values round to the
    nearer; the midpoint max + ulp/2 goes to the even mantissa. E4M3's max 448 (1.110b x 2^8) is
    even, so 464 lands on 448 and only what is above 464 saturates; E5M2's max 57344 (1.11b x 2^15)
    is odd, so 61440 itself rounds up, to 65536 (inf), and saturates.
    """
    info = torch.finfo(dtype)
    ulp_at_max = info.eps * 2.0 ** math.floor(math.log2(info.max))  # 32 (E4M3), 8192 (E5M2)
    midpoint = torch.tensor(info.max + ulp_at_max / 2)  # exact in FP32
    max_mantissa_is_odd = int(torch.tensor(info.max).to(dtype).view(torch.uint8)) & 1
    if max_mantissa_is_odd:
        return midpoint.item()
    return torch.nextafter(midpoint, torch.tensor(math.inf)).item()


SATURATION_BOUNDARY = {dtype: saturation_boundary(dtype) for dtype in (E4M3, E5M2)}
GEMM_ALIGNMENT = 16  # torch._scaled_mm: K and N multiples of 16
AMAX_EPS = 1e-12
MIN_FP8_CAPABILITY = (8, 9)


@dataclass(frozen=True)
class FP8Recipe:
    """How Float8Linear quantizes, and which layers convert. Built from the ``fp8`` config by the
    precision policy; the model build sets ``pow2_scales`` and ``min_features`` from it."""

    forward_dtype: torch.dtype = E4M3
    backward_dtype: torch.dtype = E5M2
    scaling: str = "dynamic"  # dynamic | delayed
    granularity: str = "tensorwise"  # tensorwise: one scale per tensor | rowwise (dynamic only)
    amax_history_len: int = 16
    amax_compute_algo: str = "max"  # max | most_recent
    margin: int = 0
    real_gemm: bool = False  # torch._scaled_mm (True) or emulation (False)
    pow2_scales: bool = False  # every computed scale rounded down to a power of two
    # Layer selection, read by apply_fp8 (not by the layers): a Linear with in_features or
    # out_features below it stays in high precision. 0: off.
    min_features: int = 0
    # torchao backend, read by apply_fp8: the model will be FSDP2-sharded; weights all-gather in FP8.
    fsdp_float8_all_gather: bool = False


# ------------------------------------------------------------------------------ quantization
def scale_from_amax(amax: torch.Tensor, dtype: torch.dtype, margin: int = 0) -> torch.Tensor:
    """The multiplier that maps ``amax`` onto the format's largest value, divided by ``2**margin``:
    an FP32 tensor of ``amax``'s shape, each element the correctly rounded FP32 quotient.

    An amax below AMAX_EPS (zero included) is taken as AMAX_EPS: a finite, huge scale. An inf amax
    gives 0 and a NaN one NaN; TensorScaler keeps its previous scale for those and for zero.
    """
    amax = amax.float().clamp(min=AMAX_EPS)
    # One true FP32 division of an exact numerator (max times a power of two). Not ``max / amax``
    # with a Python number: torch computes that as amax.reciprocal() * max, two roundings, one ulp
    # off the quotient for about a quarter of amaxes. Same on every device: neither operand is a
    # CPU scalar, which CUDA would also turn into a reciprocal.
    return torch.full_like(amax, FP8_MAX[dtype] * 2.0**-margin) / amax


_FP32_EXPONENT_BITS = 0x7F800000


def pow2_floor(x: torch.Tensor) -> torch.Tensor:
    """The largest power of two <= each element of the FP32 tensor ``x``, exactly: the mantissa bits
    cleared (not ``2**floor(log2(x))``: log2 of a value just below a power of two rounds up to it).

    Defined for positive normal values: every scale of a finite nonzero amax (about 1e-36 to
    6e16) unless a huge margin divides it below FP32's smallest normal (1.2e-38).
    """
    return (x.view(torch.int32) & _FP32_EXPONENT_BITS).view(torch.float32)


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x * scale`` saturated to ±max of ``dtype`` and cast to FP8 (never inf/NaN from finite x)."""
    limit = FP8_MAX[dtype]
    return (x.float() * scale).clamp(-limit, limit).to(dtype)


def dequantize(x_fp8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The real values an FP8 tensor stands for: the definition :func:`fp8_gemm` computes with
    (folded into one rescale of the product there) and the reference the tests compare with."""
    return x_fp8.float() / scale


@torch.library.custom_op("mptrain::snapshot", mutates_args=())
def snapshot(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` that torch.compile saves for the backward instead of recomputing it there:
    AOTAutograd (torch 2.14) recomputes a plain ``clone()`` of a buffer in the backward, after the
    forward has updated the buffer in place, so the backward would see the new value."""
    return t.clone()


@snapshot.register_fake
def _(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(t)


def scale_or_current(
    amax: torch.Tensor, current: torch.Tensor, dtype: torch.dtype, recipe: FP8Recipe
) -> torch.Tensor:
    """Elementwise, the scale for each ``amax`` (rounded down to a power of two with
    ``recipe.pow2_scales``), or ``current`` where amax is zero or not finite: one TensorScaler's,
    or those of many scalers of ``dtype`` and ``recipe`` at once (mptrain.precision.fp8_dist)."""
    usable = torch.isfinite(amax) & (amax > 0)
    scale = scale_from_amax(amax, dtype, recipe.margin)
    if recipe.pow2_scales:
        scale = pow2_floor(scale)
    return torch.where(usable, scale, current)


def history_amax(history: torch.Tensor, algo: str) -> torch.Tensor:
    """The amax delayed scaling takes from ``history`` (newest first along its last dimension):
    the largest (``max``; a NaN propagates, and holds the scale) or the newest (``most_recent``)."""
    return history.amax(-1) if algo == "max" else history[..., 0]


# Casts (training) whose tensor's amax was zero / inf or NaN: TensorScaler buffers since version 2.
AMAX_EVENT_COUNTERS = ("zero_amax_casts", "nonfinite_amax_casts")


class TensorScaler(nn.Module):
    """Scale, amax history and counters of one tensor role (input, weight or grad).

    An amax that is zero or not finite says nothing about the range of the values to come: the
    scale it would give (huge, 0 or NaN) is never used, the previous scale is kept instead, as
    Transformer Engine does, and the cast is counted in ``zero_amax_casts`` or
    ``nonfinite_amax_casts``. Delayed scaling with ``max`` keeps the scale while a non-finite amax
    is in the history (``amax_history_len`` casts); with ``most_recent``, until the next cast.
    """

    _version = 2  # 2: the amax event counters (state dicts of version 1 load without them)

    def __init__(self, dtype: torch.dtype, recipe: FP8Recipe) -> None:
        super().__init__()
        self.dtype = dtype
        self.recipe = recipe
        self.register_buffer("scale", torch.ones((), dtype=torch.float32))
        self.register_buffer("amax_history", torch.zeros(recipe.amax_history_len))
        self.register_buffer("saturated", torch.zeros((), dtype=torch.float64))
        self.register_buffer("seen", torch.zeros((), dtype=torch.float64))
        for name in AMAX_EVENT_COUNTERS:
            self.register_buffer(name, torch.zeros((), dtype=torch.float64))
        # Delayed scaling under data parallelism: the scale is computed once the amaxes of every
        # rank are in the history (update_scale, called by mptrain.precision.fp8_dist), not after each cast.
        self.defer_scale_update = False

    @torch.no_grad()
    def update_scale(self) -> None:
        """Delayed scaling: the scale from the current amax history (a zero or non-finite amax
        keeps the current scale). On the device: no host synchronisation."""
        self.scale.copy_(self._scale_for(self._history_amax()))

    @torch.no_grad()
    def reset(self) -> None:
        """The state of a new scaler: scale 1, an empty (zero) history, every counter zero."""
        for name, buffer in self.named_buffers(recurse=False):
            buffer.fill_(1.0 if name == "scale" else 0.0)

    def _load_from_state_dict(
        self, state_dict: dict[str, Any], prefix: str, local_metadata: dict, *args: Any, **kw: Any
    ) -> None:
        # Checkpoints written before version 2 have no amax event counters: they load with the
        # counters at zero (nothing counted), so older runs still resume and evaluate. A state of
        # this version without them is incomplete like any state missing a key: loading fails.
        version = local_metadata.get("version")
        if version is None or version < 2:
            for name in AMAX_EVENT_COUNTERS:
                state_dict.setdefault(prefix + name, torch.zeros_like(getattr(self, name)))
        super()._load_from_state_dict(state_dict, prefix, local_metadata, *args, **kw)

    def _scale_for(self, amax: torch.Tensor) -> torch.Tensor:
        """The scale for ``amax``, or the current one where amax is zero or not finite."""
        return scale_or_current(amax, self.scale, self.dtype, self.recipe)

    def _history_amax(self) -> torch.Tensor:
        return history_amax(self.amax_history, self.recipe.amax_compute_algo)

    def _count(self, magnitude: torch.Tensor, amax: torch.Tensor, scale: torch.Tensor) -> None:
        """Add one training cast of ``magnitude`` (|x|) at ``scale`` to the counters."""
        self.saturated.add_((magnitude * scale >= SATURATION_BOUNDARY[self.dtype]).sum())
        self.seen.add_(magnitude.numel())
        self.zero_amax_casts.add_(amax == 0)
        self.nonfinite_amax_casts.add_(~torch.isfinite(amax))

    def _push_amax(self, amax: torch.Tensor) -> None:
        """The history takes ``amax`` as its most recent entry; the oldest drops out."""
        self.amax_history.copy_(torch.roll(self.amax_history, 1))
        self.amax_history[0] = amax

    @torch.no_grad()
    def cast(self, x: torch.Tensor, update: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Quantize ``x``; return (FP8 tensor, the scale used).

        Dynamic: scale from this tensor's amax. Delayed: the scale computed from earlier amaxes is
        used now, then the history takes this amax (whatever it is) and the next scale is computed.
        Either way a zero or non-finite amax keeps the previous scale (see the class doc). With
        ``defer_scale_update`` the delayed scale waits for :meth:`update_scale`. With
        ``update=False`` (evaluation) history, counters and the scale are left alone.
        Everything stays on the device: no host synchronisation.
        """
        magnitude = x.detach().abs().float()
        amax = magnitude.max()
        dynamic = self.recipe.scaling == "dynamic"
        scale = self._scale_for(amax) if dynamic else snapshot(self.scale)
        if not update:
            return quantize(x, scale, self.dtype), scale
        self._count(magnitude, amax, scale)
        self._push_amax(amax)
        if dynamic:
            self.scale.copy_(scale)
        elif not self.defer_scale_update:
            self.update_scale()
        return quantize(x, scale, self.dtype), scale

    @torch.no_grad()
    def cast_along(
        self, x: torch.Tensor, dim: int, update: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Quantize the 2-D ``x`` with one dynamic scale per slice along ``dim`` (rowwise scaling:
        ``dim=-1`` gives one scale per row, shape (rows, 1); ``dim=0`` one per column, (1, cols)).

        Each scale comes from its own row's (column's) amax, so an outlier row no longer shrinks
        every other row's scale. An all-zero row gets a huge finite scale (it quantizes to zeros);
        a row holding inf/NaN gets a 0/NaN scale and quantizes to NaN, as its product would be in
        high precision. With ``update`` the cast is counted like :meth:`cast` (saturation, zero or
        non-finite amax of the whole tensor), the history takes the tensor's amax and ``scale``
        becomes the tensor-level scale (the smallest row scale): what the report shows.
        """
        magnitude = x.detach().abs().float()
        amax = magnitude.amax(dim=dim, keepdim=True)
        scale = scale_from_amax(amax, self.dtype, self.recipe.margin)
        if self.recipe.pow2_scales:
            scale = pow2_floor(scale)
        if update:
            tensor_amax = amax.max()
            self._count(magnitude, tensor_amax, scale)
            self._push_amax(tensor_amax)
            self.scale.copy_(self._scale_for(tensor_amax))
        return quantize(x, scale, self.dtype), scale


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
        # Under autocast the surrounding model computes in BF16; the FP8 GEMM output takes that dtype.
        if torch.is_autocast_enabled(x.device.type):
            out_dtype = torch.get_autocast_dtype(x.device.type)
        else:
            out_dtype = x.dtype
        with torch.autocast(x.device.type, enabled=False):
            function = (
                _RowwiseFloat8LinearFunction
                if self.recipe.granularity == "rowwise"
                else _Float8LinearFunction
            )
            out = function.apply(x, self.weight, self.bias, self, out_dtype)
        # Reshape outside the Function: a view returned by it could not be modified in place.
        # A 2-D input needs none: FSDP2 warns of a view output, whose in-place change (the next
        # ReLU(inplace=True)) would drop its pre-backward hook.
        if x.dim() == 2:
            return out
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        fmt = f"{dtype_name(self.recipe.forward_dtype)}/{dtype_name(self.recipe.backward_dtype)}"
        gemm = "scaled_mm" if self.recipe.real_gemm else "emulated"
        scaling = f"{self.recipe.scaling} {self.recipe.granularity}"
        return f"{super().extra_repr()}, fp8={fmt}, scaling={scaling}, gemm={gemm}"


# ------------------------------------------------------------------------------ conversion
@dataclass
class LayerChoice:
    name: str
    in_features: int
    out_features: int
    converted: bool
    reason: str


def _skip_reason(
    name: str,
    layer: nn.Linear,
    include: list[str],
    exclude: list[str],
    first_or_last_kept: bool,
    min_features: int,
) -> str | None:
    """Why ``layer`` stays in high precision, or None when it converts (see choose_layers)."""
    if include and not any(fnmatch.fnmatchcase(name, p) for p in include):
        return "not matched by fp8.include"
    matched = [p for p in exclude if fnmatch.fnmatchcase(name, p)]
    if matched:
        return f"excluded by fp8.exclude pattern {matched[0]!r}"
    if first_or_last_kept:
        return "first/last layer kept in BF16"
    if layer.in_features % GEMM_ALIGNMENT or layer.out_features % GEMM_ALIGNMENT:
        return f"in/out features not multiples of {GEMM_ALIGNMENT} (torch._scaled_mm alignment)"
    if min(layer.in_features, layer.out_features) < min_features:
        return f"smaller than fp8.min_features={min_features}"
    return None


def choose_layers(
    model: nn.Module,
    include: list[str],
    exclude: list[str],
    keep_first_last: bool,
    min_features: int = 0,
) -> list[LayerChoice]:
    """Decide, for every nn.Linear in registration order, whether it converts and why not.

    In this order: a layer not matched by ``include`` (when given) or matched by ``exclude`` is
    kept; so are the first and last Linear with ``keep_first_last`` (unless ``include`` names
    layers), layers whose in/out features are not multiples of 16 (torch._scaled_mm) and, with
    ``min_features`` > 0, those whose in_features or out_features is below it.
    """
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    choices = []
    for i, (name, layer) in enumerate(linears):
        first_or_last_kept = keep_first_last and not include and i in (0, len(linears) - 1)
        reason = _skip_reason(name, layer, include, exclude, first_or_last_kept, min_features)
        choices.append(
            LayerChoice(
                name, layer.in_features, layer.out_features, reason is None, reason or "converted"
            )
        )
    return choices


def skip_summary(layers: list[dict[str, Any]]) -> str:
    """Why the unconverted layers of an fp8 section were kept, each reason once with its count
    ("2 layers: first/last layer kept in BF16; 1 layer: ..."); "no nn.Linear layer" if none."""
    counts = Counter(row["reason"] for row in layers if not row["converted"])
    if not counts:
        return "no nn.Linear layer"
    return "; ".join(f"{n} layer{'s' if n > 1 else ''}: {why}" for why, n in counts.items())


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


def convert_to_fp8(model: nn.Module, choices: list[LayerChoice], recipe: FP8Recipe) -> nn.Module:
    """Replace the chosen nn.Linear layers in place by Float8Linear. Returns ``model``."""
    for choice in choices:
        if choice.converted:
            layer = model.get_submodule(choice.name)
            _set_submodule(model, choice.name, Float8Linear.from_linear(layer, recipe))
    return model


@torch.no_grad()
def linear_flops(model: nn.Module, sample: torch.Tensor) -> dict[str, int]:
    """FLOPs of each nn.Linear (by name) for one forward pass of ``sample``."""
    flops: dict[str, int] = {}
    hooks = []
    for name, layer in model.named_modules():
        if isinstance(layer, nn.Linear):

            def hook(mod: nn.Module, args: tuple, out: torch.Tensor, name: str = name) -> None:
                rows = args[0].numel() // mod.in_features
                flops[name] = flops.get(name, 0) + 2 * rows * mod.in_features * mod.out_features

            hooks.append(layer.register_forward_hook(hook))
    was_training = model.training
    model.eval()
    try:
        model(sample)
    finally:
        model.train(was_training)
        for h in hooks:
            h.remove()
    return flops


def fp8_layer_stats(model: nn.Module) -> list[dict[str, Any]]:
    """Per Float8Linear and role (input, weight, grad): final scale and amax, saturated fraction,
    and ``<role>_zero_amax_casts`` / ``<role>_nonfinite_amax_casts``: the training casts whose
    amax was zero / inf or NaN, from which no scale was taken (reads device values)."""
    stats = []
    for name, layer in model.named_modules():
        if isinstance(layer, Float8Linear):
            row: dict[str, Any] = {"name": name}
            for role in ("input", "weight", "grad"):
                scaler: TensorScaler = getattr(layer, f"{role}_scaler")
                seen = float(scaler.seen)
                row[f"{role}_scale"] = float(scaler.scale)
                row[f"{role}_amax"] = float(scaler.amax_history[0])
                row[f"{role}_saturated_fraction"] = float(scaler.saturated) / seen if seen else 0.0
                for counter in AMAX_EVENT_COUNTERS:
                    row[f"{role}_{counter}"] = int(getattr(scaler, counter))
            stats.append(row)
    return stats


# ------------------------------------------------------------------------------ hardware
def fp8_gemm_available(device: torch.device) -> bool:
    """True on NVIDIA GPUs of compute capability >= 8.9 with torch._scaled_mm."""
    if device.type != "cuda" or not hasattr(torch, "_scaled_mm"):
        return False
    return torch.cuda.get_device_capability(device) >= MIN_FP8_CAPABILITY


# ------------------------------------------------------------------------------ run glue
def torchao_config(recipe: FP8Recipe) -> Any:
    """torchao's ``Float8LinearConfig`` doing what ``recipe`` says (dynamic scaling only): its
    tensorwise or rowwise recipe, with this recipe's formats (E5M2 gradients in the hybrid format;
    torchao's rowwise recipe alone would use E4M3), power-of-two scales and GEMM (emulated when
    ``recipe.real_gemm`` is false); with ``recipe.fsdp_float8_all_gather`` and tensorwise scales
    (torchao has no rowwise FP8 all-gather), FSDP2 all-gathers the weights in FP8, their scales
    precomputed by mptrain.precision.fp8_dist."""
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.config import CastConfig, ScalingGranularity

    rowwise = recipe.granularity == "rowwise"
    granularity = ScalingGranularity.AXISWISE if rowwise else ScalingGranularity.TENSORWISE
    forward = CastConfig(scaling_granularity=granularity, target_dtype=recipe.forward_dtype)
    backward = CastConfig(scaling_granularity=granularity, target_dtype=recipe.backward_dtype)
    return replace(
        Float8LinearConfig.from_recipe_name(recipe.granularity),
        cast_config_input=forward,
        cast_config_input_for_grad_weight=forward,
        cast_config_weight=forward,
        cast_config_weight_for_grad_input=forward,
        cast_config_grad_output=backward,
        cast_config_grad_output_for_grad_weight=backward,
        round_scales_to_power_of_2=recipe.pow2_scales,
        emulate=not recipe.real_gemm,
        enable_fsdp_float8_all_gather=recipe.fsdp_float8_all_gather and not rowwise,
    )


def _torchao_convert(model: nn.Module, converted: set[str], recipe: FP8Recipe) -> None:
    """Convert the chosen layers with torchao's float8 training (:func:`torchao_config`)."""
    from torchao.float8 import convert_to_float8_training

    convert_to_float8_training(
        model,
        config=torchao_config(recipe),
        module_filter_fn=lambda module, name: name in converted,
    )


def apply_fp8(
    model: nn.Module,
    recipe: FP8Recipe,
    sample: torch.Tensor,
    *,
    include: list[str],
    exclude: list[str],
    keep_first_last: bool,
    backend: str = "builtin",
) -> dict[str, Any]:
    """Convert the model's eligible Linear layers in place; return the report's ``fp8`` section:
    the recipe's settings, and per Linear whether it converted and, if not, why.

    ``sample`` is one input batch, used only to count each Linear's FLOPs. Layers with in or out
    features below ``recipe.min_features`` stay in high precision.
    """
    choices = choose_layers(model, include, exclude, keep_first_last, recipe.min_features)
    flops = linear_flops(model, sample)
    total = sum(flops.values())
    converted = {c.name for c in choices if c.converted}
    if backend == "torchao":
        if recipe.scaling != "dynamic":
            raise ValueError("fp8.backend=torchao supports fp8.scaling=dynamic only")
        _torchao_convert(model, converted, recipe)
    else:
        convert_to_fp8(model, choices, recipe)
    share = sum(flops.get(n, 0) for n in converted) / total if total else 0.0
    return {
        "backend": backend,
        "gemm": "torch._scaled_mm" if recipe.real_gemm else "emulated (FP8 cast, FP32 matmul)",
        "emulated": not recipe.real_gemm,
        "forward_dtype": dtype_name(recipe.forward_dtype),
        "backward_dtype": dtype_name(recipe.backward_dtype),
        "scaling": recipe.scaling,
        "granularity": recipe.granularity,
        "amax_history_len": recipe.amax_history_len,
        "amax_compute_algo": recipe.amax_compute_algo,
        "margin": recipe.margin,
        "pow2_scales": recipe.pow2_scales,
        "min_features": recipe.min_features,
        "converted_linear_flops_share": share,
        "layers": [
            {
                "name": c.name,
                "shape": [c.in_features, c.out_features],
                "converted": c.converted,
                "reason": c.reason,
                "flops_share": flops.get(c.name, 0) / total if total else 0.0,
            }
            for c in choices
        ],
    }
