"""FP8 numbers: the formats (E4M3, E5M2) and their saturation, the quantization, scales from amaxes
(power-of-two rounding included), quantize/dequantize, and :class:`TensorScaler`, the per-tensor
scale with its amax history and counters kept as buffers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mptrain.config.format_table import FORMAT_TABLE, FP8

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
MIN_FP8_CAPABILITY = FORMAT_TABLE[FP8].kernel.least  # (8, 9): Ada, Hopper and later


@dataclass(frozen=True)
class FP8Quantization:
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
    # Layer selection, read by quant.convert.layer_rules (not by the layers): a Linear with
    # in_features or out_features below it stays in high precision. 0: off.
    min_features: int = 0
    # torchao backend, read by quant.torchao_bridge.torchao_config: the model will be FSDP2-sharded;
    # weights all-gather in FP8.
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
    amax: torch.Tensor, current: torch.Tensor, dtype: torch.dtype, quantization: FP8Quantization
) -> torch.Tensor:
    """Elementwise, the scale for each ``amax`` (rounded down to a power of two with
    ``quantization.pow2_scales``), or ``current`` where amax is zero or not finite: one TensorScaler's,
    or those of many scalers of ``dtype`` and ``quantization`` at once (mptrain.precision.quant.dist)."""
    usable = torch.isfinite(amax) & (amax > 0)
    scale = scale_from_amax(amax, dtype, quantization.margin)
    if quantization.pow2_scales:
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

    def __init__(self, dtype: torch.dtype, quantization: FP8Quantization) -> None:
        super().__init__()
        self.dtype = dtype
        self.quantization = quantization
        self.register_buffer("scale", torch.ones((), dtype=torch.float32))
        self.register_buffer("amax_history", torch.zeros(quantization.amax_history_len))
        self.register_buffer("saturated", torch.zeros((), dtype=torch.float64))
        self.register_buffer("seen", torch.zeros((), dtype=torch.float64))
        for name in AMAX_EVENT_COUNTERS:
            self.register_buffer(name, torch.zeros((), dtype=torch.float64))
        # Delayed scaling under data parallelism: the scale is computed once the amaxes of every
        # rank are in the history (update_scale, called by mptrain.precision.quant.dist), not after each cast.
        self.defer_scale_update = False

    @torch.no_grad()
    def update_scale(self) -> None:
        """Delayed scaling: the scale from the current amax history (a zero or non-finite amax
        keeps the current scale). On the device: no host synchronisation."""
        amax = history_amax(self.amax_history, self.quantization.amax_compute_algo)
        self.scale.copy_(self._scale_for(amax))

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
        return scale_or_current(amax, self.scale, self.dtype, self.quantization)

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
        dynamic = self.quantization.scaling == "dynamic"
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
        scale = scale_from_amax(amax, self.dtype, self.quantization.margin)
        if self.quantization.pow2_scales:
            scale = pow2_floor(scale)
        if update:
            tensor_amax = amax.max()
            self._count(magnitude, tensor_amax, scale)
            self._push_amax(tensor_amax)
            self.scale.copy_(self._scale_for(tensor_amax))
        return quantize(x, scale, self.dtype), scale
