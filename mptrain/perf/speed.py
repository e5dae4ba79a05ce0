"""A configured run's predicted speed on a named GPU, and its model FLOPs by format (MFU's
FLOP-weighted peak): the glue from a :class:`~mptrain.config.run.RunConfig` to
:mod:`mptrain.perf.roofline`.

The model is built on the meta device (no memory, no weights initialised) from the same config
and data shape a run would use; the converted layers are the ones the precision would convert
(:func:`converted_layer_names`, by the format's layer keys), unless the caller names those that
did, and a per-GEMM plan gives their GEMMs the formats a run would (:func:`gemm_plan`,
:func:`planned_layers`). ``advise``, the run report and ``benchmarks/roofline.py`` call this.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

import torch
from torch import nn

from mptrain.config.data import SyntheticConfig
from mptrain.config.format_table import (
    FORMAT_TABLE,
    FP8_BLOCKWISE,
    NVFP4,
)
from mptrain.config.models import lm_block_size
from mptrain.config.run import RunConfig
from mptrain.data.batches import BatchLayout, DataBundle
from mptrain.data.build import build_data
from mptrain.models.build import build_model
from mptrain.perf.gemms import SAMPLES, Accounting, account
from mptrain.perf.gpus import GPU, mixed_peak_flops
from mptrain.perf.roofline import (
    Arithmetic,
    Prediction,
    Step,
    arithmetic_for,
    model_flops_by_format,
    optimizer_passes,
    predict,
)
from mptrain.precision.formats import layer_format
from mptrain.precision.gemm_plans import format_name, requested
from mptrain.precision.quant.block_quant import BlockQuantization
from mptrain.precision.quant.convert import choose_layers, layer_rules
from mptrain.precision.quant.linear import GEMMS
from mptrain.precision.selection import LayerChoice, choose, skip_summary


@dataclass(frozen=True)
class DataShape:
    """What the model builder needs of the data: image channels and side, classes (a language
    model: the vocabulary) and, for token data, the window length."""

    in_channels: int
    image_size: int
    num_classes: int
    sequence_length: int | None = None

    @classmethod
    def of(cls, data: DataBundle) -> DataShape:
        return cls(data.in_channels, data.image_size, data.num_classes, data.sequence_length)


def data_shape(cfg: RunConfig) -> DataShape:
    """The data's shape for ``cfg``: the synthetic dataset's from its config (no images made);
    any other dataset loaded as a run loads it (on the CPU; ConfigError as a run's would be)."""
    d = cfg.dataset
    if isinstance(d, SyntheticConfig):
        return DataShape(d.channels, d.image_size, d.num_classes)
    sequence = lm_block_size(cfg.model) if cfg.task == "lm" else None
    layout = BatchLayout(
        cfg.batch_size,
        cfg.eval_batch_size,
        torch.device("cpu"),
        cfg.seed,
        0,
        sequence_length=sequence,
    )
    return DataShape.of(build_data(d, layout))


def meta_model(cfg: RunConfig, shape: DataShape, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The configured model on the meta device, its parameters in ``dtype``."""
    with torch.device("meta"):
        model = build_model(
            cfg.model,
            shape.in_channels,
            shape.image_size,
            shape.num_classes,
            "meta",
            shape.sequence_length,
        )
    return model if dtype == torch.float32 else model.to(dtype)


def meta_sample(shape: DataShape) -> torch.Tensor:
    """A meta batch of :data:`~mptrain.perf.gemms.SAMPLES` inputs: token ids or images."""
    if shape.sequence_length is not None:
        return torch.zeros(SAMPLES, shape.sequence_length, dtype=torch.long, device="meta")
    size = (SAMPLES, shape.in_channels, shape.image_size, shape.image_size)
    return torch.zeros(size, device="meta")


def converted_layer_names(model: nn.Module, cfg: RunConfig, fmt: str) -> list[str]:
    """The Linears the run would convert to ``fmt`` (a :func:`~mptrain.precision.formats.layer_format`) in ``model``, by
    the format's layer rules and config keys; ValueError, as the run's ConfigError says, when
    there are none."""
    if fmt == "fp8":
        f = cfg.fp8
        chosen = choose_layers(
            model, list(f.include), list(f.exclude), f.keep_first_last, f.min_features
        )
    else:
        chosen = _block_choices(model, cfg, fmt)
    names = [c.name for c in chosen if c.converted]
    if not names:
        why = skip_summary([{"converted": c.converted, "reason": c.reason} for c in chosen])
        raise ValueError(f"no Linear layer of model={cfg.model.name} can run in {fmt} ({why})")
    return names


def _block_choices(model: nn.Module, cfg: RunConfig, fmt: str) -> list[LayerChoice]:
    """The layer choice of a block-scaled format: the rules apply_quantized applies at run time."""
    _, include, exclude, keep_first_last, min_features, tail = _choice_key(cfg, fmt)
    arithmetic = BlockQuantization(fmt, keep_last_fraction=tail, min_features=min_features)
    return choose(model, layer_rules(arithmetic, list(include), list(exclude), keep_first_last))


def run_step(cfg: RunConfig, shape: DataShape) -> Step:
    """One optimizer step of ``cfg``: its batch, micro-batches, tokens and optimizer passes."""
    opt = cfg.optimizer
    passes = optimizer_passes(
        opt.name, getattr(opt, "momentum", 0.0), cfg.clip_grad_norm is not None
    )
    return Step(cfg.batch_size, passes, cfg.grad_accum_steps, shape.sequence_length)


def run_precision(cfg: RunConfig) -> str:
    """The precision ``cfg`` trains in, as the roofline names it (``tf32``: FP32 with TF32)."""
    p = cfg.precision
    return "tf32" if p.name == "fp32" and p.allow_tf32 else p.name


def gemm_plan(cfg: RunConfig, fmt: str) -> tuple[str, str, str] | None:
    """The formats ``precision.gemms`` gives the forward, input- and weight-gradient GEMMs of a
    Linear converted to ``fmt``, as a run resolves them (:mod:`mptrain.precision.gemm_plans`:
    null is ``fmt``; ``fp8`` under ``fp8.granularity=blockwise`` is blockwise FP8); None when it
    sets none. ValueError (format_name's ConfigError), in the run's words, for a format of the
    other family."""
    chosen = requested(cfg)
    if not chosen:
        return None
    first, second, third = (
        fmt if chosen.get(g) is None else format_name(cfg, g, chosen[g], fmt) for g in GEMMS
    )
    return first, second, third


def planned_layers(cfg: RunConfig, layers: Iterable[str]) -> list[str]:
    """The converted ``layers`` that ``precision.gemms.layers`` matches (fnmatch, as
    :class:`~mptrain.precision.quant.linear.LayerPlans` does); ValueError, as the run's
    ConfigError says, when none does."""
    patterns = list(cfg.precision.gemms.layers)
    names = list(layers)
    matched = [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in patterns)]
    if not matched:
        raise ValueError(
            f"precision.gemms.layers={patterns}: no converted layer matches; the converted "
            f"layers are {', '.join(names)}"
        )
    return matched


def _choice_key(cfg: RunConfig, fmt: str) -> tuple:
    """What chooses the Linears converted to ``fmt``: its config group's layer keys."""
    keys = getattr(cfg, FORMAT_TABLE[fmt].config_group)
    tail = cfg.nvfp4.keep_last_fraction if fmt == NVFP4 else 0.0
    include, exclude = tuple(keys.include), tuple(keys.exclude)
    return fmt, include, exclude, keys.keep_first_last, keys.min_features, tail


class Accountant:
    """The accounting of ``cfg``'s model under each (autocast, parameter dtype) pair asked for,
    each made once; each layer format's converted Linears chosen once per set of layer keys, from
    the fp32 build, unless ``layers`` names those a run converted (for its precision)."""

    def __init__(self, cfg: RunConfig, shape: DataShape, layers: Iterable[str] | None = None):
        self.cfg, self.shape = cfg, shape
        self._done: dict[tuple[torch.dtype | None, torch.dtype], Accounting] = {}
        self._layers: dict[tuple, list[str]] = {}
        self.given = None if layers is None else list(layers)

    def arithmetic(self, precision: str, cfg: RunConfig | None = None) -> Arithmetic:
        """``precision``'s arithmetic under ``cfg`` (default: the accountant's; the same model): FP8
        scaled per its ``fp8.granularity``, the Linears its layer keys convert, their GEMMs in the
        formats its ``precision.gemms`` plan gives them."""
        cfg = cfg or self.cfg
        scales = cfg.fp8.granularity
        fmt = layer_format(precision, scales)
        if fmt is None:
            return arithmetic_for(precision, (), scales)
        layers = self.layers(cfg, fmt)
        plan = gemm_plan(cfg, fmt)
        planned = planned_layers(cfg, layers) if plan is not None else ()
        return arithmetic_for(precision, layers, scales, cfg.nvfp4.weight_tiles, plan, planned)

    def layers(self, cfg: RunConfig, fmt: str) -> list[str]:
        """The Linears converted to ``fmt`` under ``cfg``'s layer keys (or those given)."""
        if self.given is not None:
            return self.given
        key = _choice_key(cfg, fmt)
        if key not in self._layers:
            model = meta_model(self.cfg, self.shape)
            self._layers[key] = converted_layer_names(model, cfg, fmt)
        return self._layers[key]

    def accounting(self, arithmetic: Arithmetic) -> Accounting:
        key = (arithmetic.autocast, arithmetic.param_dtype)
        if key not in self._done:
            model = meta_model(self.cfg, self.shape, arithmetic.param_dtype)
            self._done[key] = account(model, meta_sample(self.shape), arithmetic.autocast)
        return self._done[key]


def predict_configs(
    configs: Mapping[str, RunConfig], shape: DataShape, gpu: GPU
) -> dict[str, Prediction | str]:
    """Each named config's predicted step on ``gpu`` (one model and data: the configs differ
    in their precision, FP8 scaling, layer keys and per-GEMM plan, as advise's candidates and
    plans do), or why there is none (the
    GPU lacks the format: FP8 on an A100, MXFP8 on an H100, "no hardware kernel: emulated";
    the model has no Linear the format would convert). Delayed scaling and power-of-two scales
    move the same bytes as dynamic tensorwise scaling."""
    first = next(iter(configs.values()))
    accountant, step = Accountant(first, shape), run_step(first, shape)
    out: dict[str, Prediction | str] = {}
    for name, cfg in configs.items():
        try:
            arithmetic = accountant.arithmetic(run_precision(cfg), cfg)
            out[name] = predict(accountant.accounting(arithmetic), arithmetic, gpu, step)
        except ValueError as exc:  # no FP8 layer, or a format the GPU lacks: said, not guessed
            out[name] = str(exc)
    return out


def predict_config(
    cfg: RunConfig, shape: DataShape, gpu: GPU, precisions: Iterable[str]
) -> dict[str, Prediction | str]:
    """Each precision's (``tf32``: FP32 with TF32 allowed; ``fp8_blockwise``: blockwise FP8)
    predicted step of ``cfg`` on ``gpu``, or why there is none (see :func:`predict_configs`)."""
    return predict_configs({name: with_precision(cfg, name) for name in precisions}, shape, gpu)


def with_precision(cfg: RunConfig, name: str) -> RunConfig:
    """``cfg`` trained in ``name`` (``tf32``: FP32 with TF32 allowed; ``fp8_blockwise``: FP8
    with ``fp8.granularity=blockwise``), its other keys kept."""
    if name == FP8_BLOCKWISE:
        blockwise = replace(cfg.fp8, granularity="blockwise", scaling="dynamic", backend="builtin")
        return replace(with_precision(cfg, "fp8"), fp8=blockwise)
    fp32 = name in ("fp32", "tf32")
    precision = replace(cfg.precision, name="fp32" if fp32 else name, allow_tf32=name == "tf32")
    return replace(cfg, precision=precision)


def flops_by_format(
    cfg: RunConfig, shape: DataShape, precision: str, layers: Iterable[str] | None = None
) -> dict[str, float]:
    """Model FLOPs per sample (3 x forward GEMMs, attention whole) of ``cfg`` in ``precision``
    (``tf32``: FP32 with TF32 allowed) by the format each GEMM runs in (FP8, blockwise FP8,
    MXFP8 and NVFP4 Linears under their own names); ``layers``: the Linears that ran in the
    precision's low format (a run's fp8 section), else those the precision would convert."""
    accountant = Accountant(cfg, shape, layers)
    arithmetic = accountant.arithmetic(precision)
    return model_flops_by_format(accountant.accounting(arithmetic), arithmetic)


def mfu_of_run(
    cfg: RunConfig, shape: DataShape, precision: str, layers: Iterable[str] | None, gpu: GPU
) -> tuple[float, float]:
    """(model FLOPs per sample, FLOP-weighted peak FLOP/s) of a run of ``cfg`` in ``precision``
    on ``gpu`` (see :func:`flops_by_format`; a block-scaled format's GEMMs weighted by its peak,
    :meth:`~mptrain.perf.gpus.GPU.peak_flops`). MFU = FLOPs per sample x samples/s / (GPUs x
    peak)."""
    by_format = flops_by_format(cfg, shape, precision, layers)
    return sum(by_format.values()), mixed_peak_flops(by_format, gpu)
