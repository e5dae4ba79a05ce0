"""Precision policy: which dtype autocast runs, whether the loss is scaled, and the TF32 flags.

A :class:`PrecisionPolicy` is decided once per run by :func:`resolve_precision` from the requested
config and the device, and never changes afterwards. The training loop has a single code path for
every precision: :meth:`PrecisionPolicy.autocast` is a no-op context for FP32 and the GradScaler is
built disabled for BF16/FP32 (its calls are then pass-throughs).

No silent fallbacks: :data:`PRECISIONS` is the one table of what each precision runs (configs
name a precision and tune only its scaler numbers and TF32); ``auto`` records why it chose; a
precision the device cannot run raises :class:`ConfigError` naming what to use instead; an FP16
scaler torch disabled raises (:func:`build_grad_scaler`).
"""

from __future__ import annotations

import contextlib
import fnmatch
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from mptrain.config.base import ConfigError
from mptrain.config.format_table import FORMAT_TABLE, FP8, FP8_BLOCKWISE, MXFP8, NVFP4
from mptrain.config.options import AUTO
from mptrain.config.precision import (
    FP8Config,
    MXConfig,
    NVFP4Config,
    PrecisionConfig,
    ScalerConfig,
)
from mptrain.platform import hardware
from mptrain.platform.distributed import DistContext, build_scaler_for
from mptrain.platform.dtypes import dtype_name
from mptrain.precision.quant.block_quant import BlockQuantization
from mptrain.precision.quant.fp8 import E4M3, E5M2, MIN_FP8_CAPABILITY, FP8Quantization
from mptrain.precision.quant.kernels import block_gemm_available, fp8_gemm_available


@dataclass(frozen=True)
class PrecisionSpec:
    """What a precision runs: the one table validation, resolution, bench and tests read."""

    autocast_dtype: torch.dtype | None  # None: no autocast
    param_dtype: torch.dtype  # float32: FP32 master weights; else "pure" low-precision training
    loss_scaling: bool  # dynamic loss scaling (torch.amp.GradScaler)
    family: str  # what the device must execute natively: fp32 | fp16 | bf16


F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
# Each in words: docs/precisions.md. fp8, mxfp8 and nvfp4 compute their Linear layers in a format
# of their own (mptrain.precision.formats.LAYER_FORMATS), under BF16 autocast elsewhere.
PRECISIONS: dict[str, PrecisionSpec] = {
    "fp32": PrecisionSpec(None, F32, False, "fp32"),
    "fp16": PrecisionSpec(F16, F32, True, "fp16"),
    "bf16": PrecisionSpec(BF16, F32, False, "bf16"),
    "fp8": PrecisionSpec(BF16, F32, False, "bf16"),
    MXFP8: PrecisionSpec(BF16, F32, False, "bf16"),
    NVFP4: PrecisionSpec(BF16, F32, False, "bf16"),
    "fp16_noscale": PrecisionSpec(F16, F32, False, "fp16"),
    "fp16_pure": PrecisionSpec(None, F16, False, "fp16"),
    "bf16_pure": PrecisionSpec(None, BF16, False, "bf16"),
}


@dataclass(frozen=True)
class PrecisionPolicy:
    """The precision a run actually uses. ``requested`` is what the user asked for."""

    requested: str
    name: str  # a key of PRECISIONS: what runs
    autocast_dtype: torch.dtype | None
    loss_scaling: bool
    scaler: ScalerConfig  # the loss scaler's numbers (used when loss_scaling)
    allow_tf32: bool
    device_type: str
    reason: str  # why this precision: the user's choice, or how auto decided
    notes: tuple[str, ...] = ()
    fp8: FP8Quantization | None = None  # set for precision=fp8
    # set for precision=mxfp8, nvfp4 and fp8 with fp8.granularity=blockwise (mptrain.precision.quant)
    blocks: BlockQuantization | None = None
    param_dtype: torch.dtype = torch.float32  # float32 = master weights; else "pure" training
    # precision=auto timed on the model (mptrain.train.autoprecision): s/step per candidate, ...
    auto_timing: dict[str, Any] | None = field(default=None, compare=False)

    @property
    def master_weights(self) -> bool:
        return self.param_dtype == torch.float32

    @property
    def emulated(self) -> bool:
        """True when FP8 or block-scaled numerics run without their hardware GEMMs (no speed-up
        to compare)."""
        quantization = self.blocks or self.fp8
        return quantization is not None and not quantization.real_gemm

    @property
    def label(self) -> str:
        """What ran, for people: "fp8 (emulated)", "mxfp8 (emulated)" when the low-precision
        GEMMs were emulated."""
        return f"{self.name} (emulated)" if self.emulated else self.name

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """Context for forward and loss: torch.autocast with the policy dtype, or nothing (FP32)."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.autocast_dtype)

    def describe(self) -> str:
        scaling = "dynamic loss scaling" if self.loss_scaling else "no loss scaling"
        dtype = dtype_name(self.autocast_dtype) or "none"
        if self.blocks is not None:
            gemm = "scaled_mm" if self.blocks.real_gemm else "emulated GEMMs"
            layers = self.blocks.row.label
            return f"{self.label} ({layers} Linear layers via {gemm}, autocast {dtype} elsewhere)"
        if self.fp8 is not None:
            gemm = "torch._scaled_mm" if self.fp8.real_gemm else "emulated GEMMs"
            return f"{self.label} (FP8 Linear layers via {gemm}, autocast {dtype} elsewhere)"
        return f"{self.name} (autocast {dtype}, {scaling})"


def _auto_choice(device: torch.device) -> tuple[str, str]:
    """(precision, reason) of ``precision=auto`` on ``device``: a rule, stated as one."""
    if device.type == "cuda":
        major, minor = hardware.cuda_capability(device)
        if hardware.cuda_has_native_bf16(device):
            return "bf16", (
                f"rule: GPU compute capability {major}.{minor} >= 8.0 has BF16 tensor cores"
            )
        return "fp16", (
            f"rule: GPU compute capability {major}.{minor} < 8.0 has no BF16: FP16 + loss scaling"
        )
    if hardware.cpu_has_native_bf16():
        return "bf16", "rule: the CPU executes BF16 natively (AVX512-BF16/AMX-BF16)"
    return "fp32", "rule: the CPU has no native BF16 and FP16 CPU kernels are slow"


def _check_family(family: str, name: str, device: torch.device) -> tuple[str, ...]:
    if device.type == "cuda" and family == "bf16" and not hardware.cuda_has_native_bf16(device):
        major, minor = hardware.cuda_capability(device)
        raise ConfigError(
            f"precision={name}: GPU {torch.cuda.get_device_name(device)} (compute capability "
            f"{major}.{minor}) has no native BF16 (needs >= 8.0); use precision=fp16 or precision=fp32"
        )
    if device.type == "cpu" and family == "fp16":
        return ("FP16 on CPU: matmuls may use AVX512-FP16, convolutions take a very slow path",)
    if device.type == "cpu" and family == "bf16" and not hardware.cpu_has_native_bf16():
        return ("BF16 on a CPU without native BF16: emulated in FP32 units, expect it slower",)
    return ()


def _device_words(device: torch.device) -> str:
    if device.type != "cuda":
        return f"the {device.type.upper()}"
    major, minor = hardware.cuda_capability(device)
    return f"GPU compute capability {major}.{minor}"


def resolve_fp8(cfg: FP8Config, device: torch.device) -> tuple[FP8Quantization, tuple[str, ...]]:
    """The FP8 quantization per tensor or row for ``device``: real GEMMs where possible, emulation
    only where allowed (blockwise FP8's GEMMs are :func:`block_quantization`'s)."""
    available = fp8_gemm_available(device)
    required = ".".join(map(str, MIN_FP8_CAPABILITY))
    if cfg.emulate is False and not available:
        raise ConfigError(
            f"fp8.emulate=false: real FP8 GEMMs need an NVIDIA GPU of compute capability >= "
            f"{required}; found {_device_words(device)}. Use fp8.emulate=null to emulate, or bf16"
        )
    if cfg.backend == "torchao":
        if cfg.emulate:
            raise ConfigError(
                "fp8.emulate=true: the torchao backend always runs real FP8 GEMMs; "
                "use fp8.backend=builtin to emulate"
            )
        _check_torchao(available, device, required)
    real = available and cfg.emulate is not True
    quantization = _fp8_quantization(cfg, real)
    notes = ()
    if not real:
        why = "fp8.emulate=true" if cfg.emulate else f"no FP8 GEMMs on {_device_words(device)}"
        notes = (
            f"fp8 (emulated): {why}; FP8 numerics with FP32 matmuls, no speed-up, "
            "throughput not comparable",
        )
    return quantization, notes


def _fp8_quantization(cfg: FP8Config, real: bool) -> FP8Quantization:
    return FP8Quantization(
        forward_dtype=E4M3,
        backward_dtype=blockwise_grad_dtype(cfg),
        scaling=cfg.scaling,
        granularity=cfg.granularity,
        amax_history_len=cfg.amax_history_len,
        amax_compute_algo=cfg.amax_compute_algo,
        margin=cfg.margin,
        real_gemm=real,
        pow2_scales=cfg.pow2_scales,
        min_features=cfg.min_features,
    )


def blockwise_grad_dtype(cfg: FP8Config) -> torch.dtype:
    """The element format of FP8's gradients, blockwise FP8's included: E5M2 with
    ``fp8.format=hybrid``."""
    return E5M2 if cfg.format == "hybrid" else E4M3


def resolve_blocks(
    fmt: str,
    emulate: bool | None,
    device: torch.device,
    grad_dtype: torch.dtype = E4M3,
) -> tuple[BlockQuantization, tuple[str, ...]]:
    """Real or emulated GEMMs for the block-scaled format ``fmt`` on ``device`` (the settings
    come with :func:`block_quantization`; ``grad_dtype``: the gradients' elements, which blockwise
    FP8's real GEMM restricts to E4M3): real where the device has them unless ``<key>.emulate``
    is true, the choice recorded in the quantization (``real_gemm``: the report's ``gemm`` and
    ``emulated``, the label) and, when emulated, in a note with the reason;
    ``<key>.emulate=false`` without them raises ConfigError with the reason (``key``: the
    format's config group)."""
    row = FORMAT_TABLE[fmt]
    key = row.config_group
    available, why_not = block_gemm_available(device, fmt, grad_dtype)
    if emulate is False and not available:
        raise ConfigError(
            f"{key}.emulate=false: {why_not}; found {_device_words(device)}. "
            f"Use {key}.emulate=null to emulate"
        )
    real = available and emulate is not True
    notes = ()
    if not real:
        why = f"{key}.emulate=true" if emulate else why_not
        notes = (
            f"{row.label} (emulated): {why}; block-scaled numerics with FP32 matmuls, "
            "no speed-up, throughput not comparable",
        )
    return BlockQuantization(fmt, real_gemm=real), notes


def block_quantization(
    name: str, device: torch.device, fp8: FP8Config, mx: MXConfig, nvfp4: NVFP4Config
) -> tuple[BlockQuantization | None, tuple[str, ...]]:
    """The block-scaled quantization of precision ``name`` (mxfp8, nvfp4, fp8 with
    ``fp8.granularity=blockwise``; None for the others) with the notes of its GEMM choice."""
    if name == MXFP8:
        quantization, notes = resolve_blocks(MXFP8, mx.emulate, device)
        settings = {"scale_rounding": mx.scale_rounding, "min_features": mx.min_features}
    elif name == NVFP4:
        quantization, notes = resolve_blocks(NVFP4, nvfp4.emulate, device)
        settings = {
            "weight_tiles": nvfp4.weight_tiles,
            "hadamard": nvfp4.hadamard,
            "stochastic_rounding": nvfp4.stochastic_rounding,
            "keep_last_fraction": nvfp4.keep_last_fraction,
            "min_features": nvfp4.min_features,
        }
    elif name == FP8 and fp8.granularity == "blockwise":
        grad_dtype = blockwise_grad_dtype(fp8)
        quantization, notes = resolve_blocks(FP8_BLOCKWISE, fp8.emulate, device, grad_dtype)
        settings = {"grad_dtype": grad_dtype, "min_features": fp8.min_features}
    else:
        return None, ()
    return replace(quantization, **settings), notes


def _check_torchao(available: bool, device: torch.device, required: str) -> None:
    import importlib.util

    if importlib.util.find_spec("torchao") is None:
        raise ConfigError("fp8.backend=torchao: torchao is not installed; pip install torchao")
    if not available:
        raise ConfigError(
            f"fp8.backend=torchao: torchao float8 training needs compute capability >= {required}; "
            f"found {_device_words(device)}. Use fp8.backend=builtin (emulates there)"
        )


def resolve_precision(
    cfg: PrecisionConfig,
    device: torch.device,
    fp8: FP8Config | None = None,
    mx: MXConfig | None = None,
    nvfp4: NVFP4Config | None = None,
) -> PrecisionPolicy:
    """Decide the run's precision for ``device``. Raises ConfigError if it cannot run there."""
    if cfg.name == AUTO:
        name, reason = _auto_choice(device)
    elif cfg.alias is not None:  # precision=16-mixed: requested as the alias, recorded as such
        name, reason = cfg.name, f"PyTorch Lightning's name for {cfg.name}"
    else:
        name, reason = cfg.name, "requested"
    spec = PRECISIONS[name]
    notes = _check_family(spec.family, name, device)
    fp8 = fp8 or FP8Config()
    blocks, block_notes = block_quantization(
        name, device, fp8, mx or MXConfig(), nvfp4 or NVFP4Config()
    )
    notes += block_notes
    quantization = None
    if name == "fp8" and blocks is not None:  # blockwise FP8: real as its block format's GEMMs
        quantization = _fp8_quantization(fp8, blocks.real_gemm)
    elif name == "fp8":
        quantization, fp8_notes = resolve_fp8(fp8, device)
        notes += fp8_notes
    if spec.autocast_dtype == torch.float16 and not spec.loss_scaling:
        notes += ("FP16 without loss scaling: small gradients may underflow to zero",)
    if spec.param_dtype != torch.float32:
        notes += (
            f"pure {spec.family.upper()}: no FP32 master weights; parameters, updates and "
            "optimizer state are low precision",
        )
    return PrecisionPolicy(
        requested=cfg.alias or cfg.name,
        name=name,
        autocast_dtype=spec.autocast_dtype,
        loss_scaling=spec.loss_scaling,
        scaler=cfg.scaler,
        allow_tf32=cfg.allow_tf32,
        device_type=device.type,
        reason=reason,
        notes=notes,
        fp8=quantization,
        blocks=blocks,
        param_dtype=spec.param_dtype,
    )


def to_model_input(
    images: torch.Tensor, policy: PrecisionPolicy, channels_last: bool
) -> torch.Tensor:
    """Float inputs in the parameters' dtype ("pure" low precision) and memory format; token
    ids stay integers."""
    if policy.param_dtype != torch.float32 and images.is_floating_point():
        images = images.to(policy.param_dtype)
    if channels_last:
        images = images.contiguous(memory_format=torch.channels_last)
    return images


def build_grad_scaler(
    policy: PrecisionPolicy, dist: DistContext | None = None
) -> torch.amp.GradScaler:
    """A GradScaler for the policy's real device type; enabled exactly when the policy scales.

    Under FSDP the sharded variant (inf flag all-reduced across ranks). Raises RuntimeError if
    torch disabled a scaler that was asked for (the warn-and-disable path).
    """
    s = policy.scaler
    enabled = policy.loss_scaling
    scaler = build_scaler_for(
        dist or DistContext(),
        policy.device_type,
        init_scale=s.init_scale,
        growth_factor=s.growth_factor,
        backoff_factor=s.backoff_factor,
        growth_interval=s.growth_interval,
        enabled=enabled,
    )
    if enabled and not scaler.is_enabled():
        raise RuntimeError(
            f"torch disabled the loss scaler for device type {policy.device_type!r}; "
            "FP16 would run unscaled. Use precision=bf16 or fp32."
        )
    return scaler


def apply_tf32(allow_tf32: bool) -> dict[str, Any]:
    """Set the TF32 flags for FP32 matmuls/convs (CUDA only) and return them as they now read.

    Both APIs are set and agree, so every getter reads without raising: torch's legacy ones
    (``cudnn.allow_tf32``, ``cuda.matmul.allow_tf32``, ``get_float32_matmul_precision``), which
    torch internals and user code still call, and the ``fp32_precision`` ones. Where torch has no
    ``fp32_precision`` API (before ~2.9, which also brought its ``"ieee"`` value; pyproject admits
    2.6) only the legacy flags exist and are set. CPU (mkldnn) matmuls are left alone: after a
    ``torch.set_float32_matmul_precision("high")`` elsewhere, ``apply_tf32(False)`` leaves CPU and
    CUDA matmul precisions apart and ``get_float32_matmul_precision`` raises.
    """
    # Legacy flags first: after the new API alone the legacy getters raise ("a mix of the legacy
    # and new APIs"), and a legacy setter run after the new API resets cudnn conv/rnn to "none".
    torch.backends.cuda.matmul.allow_tf32 = allow_tf32
    torch.backends.cudnn.allow_tf32 = allow_tf32
    if hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        mode = "tf32" if allow_tf32 else "ieee"
        torch.backends.cuda.matmul.fp32_precision = mode
        torch.backends.cudnn.conv.fp32_precision = mode
        torch.backends.cudnn.rnn.fp32_precision = mode
        return {
            "allow_tf32": allow_tf32,
            "api": "fp32_precision",
            "cuda_matmul": torch.backends.cuda.matmul.fp32_precision,
            "cudnn_conv": torch.backends.cudnn.conv.fp32_precision,
            "cudnn_rnn": torch.backends.cudnn.rnn.fp32_precision,
            "mkldnn_matmul": torch.backends.mkldnn.matmul.fp32_precision,
        }
    return {
        "allow_tf32": allow_tf32,
        "api": "allow_tf32",
        "cuda_matmul": "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee",
        "cudnn_conv": "tf32" if torch.backends.cudnn.allow_tf32 else "ieee",
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }


def keep_in_fp32(model: nn.Module, patterns: list[str], device_type: str) -> list[str]:
    """Run the modules matching ``patterns`` outside autocast, in FP32. Returns their names.

    The module's own forward is wrapped on the instance: parameters and state_dict keys are
    unchanged. Floating-point inputs are cast to FP32; the output stays FP32.
    """
    matched = []
    for name, module in model.named_modules():
        if name and any(fnmatch.fnmatchcase(name, p) for p in patterns):
            original = module.forward

            def forward(*args: Any, _original: Callable[..., Any] = original, **kwargs: Any) -> Any:
                args = tuple(
                    a.float() if torch.is_tensor(a) and a.is_floating_point() else a for a in args
                )
                with torch.autocast(device_type, enabled=False):
                    return _original(*args, **kwargs)

            module.forward = forward  # type: ignore[method-assign]
            matched.append(name)
    return matched
