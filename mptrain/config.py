"""Typed configuration: the dataclass schemas behind every Hydra config group, and their validation.

Hydra composes YAML from ``conf/`` on top of these schemas (registered in the ConfigStore by
:func:`register_schemas`), so an unknown key or a value of the wrong type fails at compose time,
naming the key. Range checks that types cannot express (``lr > 0``, ``0 < backoff_factor < 1``) live
in :func:`validate`, which raises :class:`ConfigError` with a one-line message of the form
``key=value: what is accepted``.

Nothing below the CLI sees OmegaConf: :func:`to_run_config` converts a composed config into these
plain dataclasses once, at the edge.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING


class ConfigError(ValueError):
    """A configuration value the user must change. The message is one line naming the key."""


# --------------------------------------------------------------------------------------- precision
PRECISION_NAMES = ("auto", "fp32", "fp16", "bf16", "fp8", "fp16_noscale", "fp16_pure", "bf16_pure")
AUTOCAST_DTYPES = ("float16", "bfloat16")
PARAM_DTYPES = ("float32", "float16", "bfloat16")


@dataclass
class ScalerConfig:
    """Dynamic loss scaling (torch.amp.GradScaler). Only FP16 needs it."""

    enabled: bool = False
    init_scale: float = 65536.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000


@dataclass
class PrecisionConfig:
    name: str = "auto"
    autocast_dtype: str | None = None  # float16 | bfloat16 | None (no autocast: true FP32)
    scaler: ScalerConfig = field(default_factory=ScalerConfig)
    allow_tf32: bool = False
    # float32: FP32 master weights (every mixed recipe). float16/bfloat16: "pure" low-precision
    # training, parameters, gradients, updates and optimizer state in that dtype (no master copy).
    param_dtype: str = "float32"


@dataclass
class FP8Config:
    """FP8 Linear layers (precision=fp8). Ignored by every other precision."""

    format: str = "hybrid"  # hybrid: E4M3 forward, E5M2 gradients | e4m3: E4M3 everywhere
    scaling: str = "dynamic"  # dynamic (current amax) | delayed (amax history)
    amax_history_len: int = 16
    amax_compute_algo: str = "max"  # max | most_recent (delayed scaling)
    margin: int = 0  # scale divided by 2**margin: headroom against growing amax
    emulate: bool | None = None  # None: real where the GPU has FP8, emulated elsewhere
    backend: str = "builtin"  # builtin | torchao
    keep_first_last: bool = True
    include: list[str] = field(default_factory=list)
    exclude: list[str] = field(default_factory=list)


# ------------------------------------------------------------------------------------------ models
@dataclass
class MLPConfig:
    name: str = "mlp"
    hidden_sizes: list[int] = field(default_factory=lambda: [256, 256])
    dropout: float = 0.0


@dataclass
class CNNConfig:
    name: str = "cnn"
    widths: list[int] = field(default_factory=lambda: [32, 64, 128])
    dropout: float = 0.0


@dataclass
class ResNetConfig:
    name: str = "resnet18"
    small_stem: bool | None = None  # None: small stem when the input is at most 32 px


@dataclass
class ViTConfig:
    name: str = "vit"
    patch_size: int = 2
    dim: int = 64
    depth: int = 4
    heads: int = 4
    mlp_ratio: float = 4.0
    dropout: float = 0.0


# ---------------------------------------------------------------------------------------- datasets
@dataclass
class DigitsConfig:
    name: str = "digits"
    val_size: int = 360
    split_seed: int = 0


@dataclass
class SyntheticConfig:
    name: str = "synthetic"
    num_train: int = 2048
    num_val: int = 512
    num_classes: int = 10
    channels: int = 3
    image_size: int = 32
    noise: float = 1.0
    data_seed: int = 0


@dataclass
class TorchvisionDatasetConfig:
    name: str = "cifar10"
    root: str = "data"
    download: bool = False
    augment: bool = True


@dataclass
class ImageFolderConfig:
    name: str = "imagefolder"
    root: str = MISSING
    train_dir: str = "train"
    val_dir: str = "val"
    image_size: int = 224
    resize_size: int = 256
    augment: bool = True


# -------------------------------------------------------------------------------------- optimizers
@dataclass
class SGDConfig:
    name: str = "sgd"
    lr: float = 0.1
    momentum: float = 0.9
    nesterov: bool = False
    weight_decay: float = 5e-4
    decay_norm_and_bias: bool = False


@dataclass
class AdamWConfig:
    name: str = "adamw"
    lr: float = 3e-3
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    weight_decay: float = 0.01
    decay_norm_and_bias: bool = False


@dataclass
class SchedulerConfig:
    name: str = "cosine"
    warmup_epochs: float = 0.0
    warmup_start_factor: float = 0.1
    min_lr_factor: float = 0.0
    milestones: list[float] = field(default_factory=list)
    gamma: float = 0.1


# ----------------------------------------------------------------------------------------- recipe
@dataclass
class ExpectedResult:
    """The result a recipe's source reports, and where it was obtained."""

    metric: str = "final_val_accuracy"  # a key of the report's evaluation section
    value: float | None = None
    tolerance: float = 0.0  # met when the run reaches at least value - tolerance
    hardware: str = ""
    data: str = ""


@dataclass
class RecipeConfig:
    """Set by ``recipe=NAME`` (recipes/NAME.yaml); empty when no recipe is applied."""

    name: str | None = None
    source: str = ""
    command: str = ""
    expected: ExpectedResult = field(default_factory=ExpectedResult)
    note: str = ""


# -------------------------------------------------------------------------------------------- run
@dataclass
class NumericsConfig:
    """Loss-scale health limits, culprit search and per-layer FP32 overrides."""

    min_loss_scale: float = 1.0
    warn_consecutive_backoffs: int = 5
    warn_skip_rate: float = 0.25
    warn_window: int = 200
    max_consecutive_nonfinite_loss: int = 5
    find_culprit: bool = True
    fp32_modules: list[str] = field(default_factory=list)


@dataclass
class CheckpointConfig:
    enabled: bool = True
    every_steps: int | None = None
    every_epoch: bool = True
    keep_last: int = 2
    keep_best: bool = True


@dataclass
class BenchConfig:
    """``mptrain bench``: how long each precision is timed."""

    warmup_steps: int = 5
    steps: int = 30


@dataclass
class DistributedConfig:
    """Used when launched by torchrun (WORLD_SIZE > 1)."""

    strategy: str = "ddp"  # ddp | fsdp
    reduce_dtype: str = "float32"  # FSDP gradient reduction dtype


@dataclass
class DebugConfig:
    # Steps (1-based optimizer steps) whose gradients get an inf after backward: exercises the
    # loss scaler's skip path on purpose (tests, checking a setup). Empty in every real run.
    inject_inf_grad_steps: list[int] = field(default_factory=list)
    inject_inf_grad_rank: int | None = None  # distributed: inject on this rank only


@dataclass
class RunConfig:
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    model: Any = MISSING
    dataset: Any = MISSING
    optimizer: Any = MISSING
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    fp8: FP8Config = field(default_factory=FP8Config)
    recipe: RecipeConfig = field(default_factory=RecipeConfig)
    epochs: int | None = 15
    max_steps: int | None = None
    batch_size: int = 64
    eval_batch_size: int = 512
    grad_accum_steps: int = 1
    clip_grad_norm: float | None = None
    label_smoothing: float = 0.0
    seed: int = 0
    device: str = "auto"
    eval_every: int | None = None
    log_every: int = 50
    probe_every: int | None = 100
    throughput_warmup_steps: int = 5
    channels_last: bool = False
    compile: bool = False
    num_workers: int = 2
    progress: bool = True
    audit: bool = False
    probe: bool = False
    probe_batches: int = 4
    numerics: NumericsConfig = field(default_factory=NumericsConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    resume: str | None = None
    resume_allow_changes: bool = False
    bench: BenchConfig = field(default_factory=BenchConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)


# Schema per config-group option: the YAML file of an option names its schema in its defaults list
# as ``/<name>@_here_``.
GROUP_SCHEMAS: dict[str, dict[str, type]] = {
    "precision": {"precision_schema": PrecisionConfig},
    "model": {
        "mlp_schema": MLPConfig,
        "cnn_schema": CNNConfig,
        "resnet_schema": ResNetConfig,
        "vit_schema": ViTConfig,
    },
    "dataset": {
        "digits_schema": DigitsConfig,
        "synthetic_schema": SyntheticConfig,
        "torchvision_schema": TorchvisionDatasetConfig,
        "imagefolder_schema": ImageFolderConfig,
    },
    "optimizer": {"sgd_schema": SGDConfig, "adamw_schema": AdamWConfig},
    "scheduler": {"scheduler_schema": SchedulerConfig},
}

MODEL_NAMES = ("mlp", "cnn", "resnet18", "resnet50", "vit")
DATASET_NAMES = (
    "digits",
    "synthetic",
    "cifar10",
    "cifar100",
    "mnist",
    "fashion_mnist",
    "imagefolder",
)
SCHEDULER_NAMES = ("constant", "cosine", "multistep")


def register_schemas() -> None:
    """Register the run schema and every group-option schema in Hydra's ConfigStore (idempotent)."""
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    store.store(name="run_schema", node=RunConfig)
    from mptrain.recipe import load_recipes

    for name, node in load_recipes().items():
        store.store(group="recipe", name=name, node=node, package="_global_")
    # At the root rather than in <group>/, so schemas are neither options nor listed as groups.
    for schemas in GROUP_SCHEMAS.values():
        for name, schema in schemas.items():
            store.store(name=name, node=schema)


def to_run_config(cfg: Any) -> RunConfig:
    """Convert a composed OmegaConf config into plain dataclasses and validate it."""
    from omegaconf import OmegaConf

    _reject_unknown_keys(cfg)
    run = OmegaConf.to_object(cfg)
    if not isinstance(run, RunConfig):
        raise ConfigError("config: the primary config must use run_schema in its defaults list")
    validate(run)
    return run


def accepted_keys(schema: type) -> str:
    return ", ".join(f.name for f in dataclasses.fields(schema))


def _reject_unknown_keys(node: Any, path: str = "") -> None:
    """Refuse keys a schema does not declare. Hydra's ``+key=value`` adds them past the schema."""
    from omegaconf import DictConfig, OmegaConf

    schema = OmegaConf.get_type(node)
    declared = (
        {f.name for f in dataclasses.fields(schema)} if dataclasses.is_dataclass(schema) else None
    )
    for key in node:
        if declared is not None and key not in declared:
            raise ConfigError(f"{path}{key}: unknown key; accepted keys: {accepted_keys(schema)}")
        child = node._get_node(key)
        if isinstance(child, DictConfig) and not child._is_none() and not child._is_missing():
            _reject_unknown_keys(child, f"{path}{key}.")


# ------------------------------------------------------------------------------------- validation
def _require(ok: bool, key: str, value: object, accepted: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r}: {accepted}")


def _positive(key: str, value: float | int | None, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    _require(
        value is not None and value > 0 and math.isfinite(value),
        key,
        value,
        "must be > 0 and finite",
    )


def _at_least(key: str, value: int | None, minimum: int, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    _require(value is not None and value >= minimum, key, value, f"must be an integer >= {minimum}")


def validate_precision(p: PrecisionConfig) -> None:
    _require(
        p.name in PRECISION_NAMES, "precision.name", p.name, f"one of {', '.join(PRECISION_NAMES)}"
    )
    _require(
        p.autocast_dtype is None or p.autocast_dtype in AUTOCAST_DTYPES,
        "precision.autocast_dtype",
        p.autocast_dtype,
        "null (no autocast), float16 or bfloat16",
    )
    if p.name == "auto":
        _require(
            p.autocast_dtype is None,
            "precision.autocast_dtype",
            p.autocast_dtype,
            "must stay null with precision=auto (auto chooses the dtype); pick fp16 or bf16 instead",
        )
    _require(
        p.param_dtype in PARAM_DTYPES,
        "precision.param_dtype",
        p.param_dtype,
        "float32, float16 or bfloat16",
    )
    expected = {
        "fp32": None,
        "fp16": "float16",
        "bf16": "bfloat16",
        "fp8": "bfloat16",
        "fp16_noscale": "float16",
        "fp16_pure": None,
        "bf16_pure": None,
    }
    if p.name in expected:
        _require(
            p.autocast_dtype == expected[p.name],
            "precision.autocast_dtype",
            p.autocast_dtype,
            f"precision={p.name} runs autocast dtype {expected[p.name]}; choose another precision "
            "instead of changing its dtype",
        )
    pure = {"fp16_pure": "float16", "bf16_pure": "bfloat16"}.get(p.name, "float32")
    _require(
        p.param_dtype == pure,
        "precision.param_dtype",
        p.param_dtype,
        f"precision={p.name} keeps parameters in {pure}; choose another precision instead",
    )
    if p.name in ("fp16_noscale", "fp16_pure", "bf16_pure"):
        _require(
            not p.scaler.enabled,
            "precision.scaler.enabled",
            p.scaler.enabled,
            f"precision={p.name} runs without loss scaling by definition; use fp16 for scaling",
        )
    s = p.scaler
    _positive("precision.scaler.init_scale", s.init_scale)
    _require(s.growth_factor > 1, "precision.scaler.growth_factor", s.growth_factor, "must be > 1")
    _require(
        0 < s.backoff_factor < 1,
        "precision.scaler.backoff_factor",
        s.backoff_factor,
        "must be in the open interval (0, 1)",
    )
    _at_least("precision.scaler.growth_interval", s.growth_interval, 1)


def validate_fp8(f: FP8Config, precision: PrecisionConfig) -> None:
    _require(f.format in ("hybrid", "e4m3"), "fp8.format", f.format, "hybrid or e4m3")
    _require(f.scaling in ("dynamic", "delayed"), "fp8.scaling", f.scaling, "dynamic or delayed")
    _at_least("fp8.amax_history_len", f.amax_history_len, 1)
    _require(
        f.amax_compute_algo in ("max", "most_recent"),
        "fp8.amax_compute_algo",
        f.amax_compute_algo,
        "max or most_recent",
    )
    _require(f.margin >= 0, "fp8.margin", f.margin, "must be an integer >= 0")
    _require(f.backend in ("builtin", "torchao"), "fp8.backend", f.backend, "builtin or torchao")
    if precision.name == "fp8":
        _require(
            not precision.scaler.enabled,
            "precision.scaler.enabled",
            precision.scaler.enabled,
            "precision=fp8 scales each FP8 tensor itself and runs BF16 elsewhere: no loss scaler",
        )


def _validate_model(m: Any) -> None:
    _require(m.name in MODEL_NAMES, "model.name", m.name, f"one of {', '.join(MODEL_NAMES)}")
    if isinstance(m, MLPConfig):
        _require(
            all(h >= 1 for h in m.hidden_sizes), "model.hidden_sizes", m.hidden_sizes, "sizes >= 1"
        )
    if isinstance(m, CNNConfig):
        _require(
            len(m.widths) >= 1 and all(w >= 1 for w in m.widths),
            "model.widths",
            m.widths,
            "a non-empty list of channel counts >= 1",
        )
    if isinstance(m, ViTConfig):
        _at_least("model.patch_size", m.patch_size, 1)
        _at_least("model.dim", m.dim, 1)
        _at_least("model.depth", m.depth, 1)
        _at_least("model.heads", m.heads, 1)
        _require(
            m.dim % m.heads == 0, "model.dim", m.dim, f"must be divisible by model.heads={m.heads}"
        )
        _positive("model.mlp_ratio", m.mlp_ratio)
    if hasattr(m, "dropout"):
        _require(0 <= m.dropout < 1, "model.dropout", m.dropout, "must be in [0, 1)")


def _validate_dataset(d: Any) -> None:
    _require(d.name in DATASET_NAMES, "dataset.name", d.name, f"one of {', '.join(DATASET_NAMES)}")
    if isinstance(d, DigitsConfig):
        _require(0 < d.val_size < 1797, "dataset.val_size", d.val_size, "must be in 1..1796")
    if isinstance(d, SyntheticConfig):
        for key in ("num_train", "num_val", "channels", "image_size"):
            _at_least(f"dataset.{key}", getattr(d, key), 1)
        _at_least("dataset.num_classes", d.num_classes, 2)
        _require(d.noise >= 0, "dataset.noise", d.noise, "must be >= 0")
    if isinstance(d, ImageFolderConfig):
        _at_least("dataset.image_size", d.image_size, 1)
        _at_least("dataset.resize_size", d.resize_size, d.image_size)


def _validate_optimizer(o: Any) -> None:
    _require(o.name in ("sgd", "adamw"), "optimizer.name", o.name, "one of sgd, adamw")
    _positive("optimizer.lr", o.lr)
    _require(o.weight_decay >= 0, "optimizer.weight_decay", o.weight_decay, "must be >= 0")
    if isinstance(o, SGDConfig):
        _require(o.momentum >= 0, "optimizer.momentum", o.momentum, "must be >= 0")
        _require(
            not o.nesterov or o.momentum > 0, "optimizer.nesterov", o.nesterov, "needs momentum > 0"
        )
    if isinstance(o, AdamWConfig):
        _require(
            len(o.betas) == 2 and all(0 <= b < 1 for b in o.betas),
            "optimizer.betas",
            o.betas,
            "two values in [0, 1)",
        )
        _positive("optimizer.eps", o.eps)


def _validate_scheduler(s: SchedulerConfig) -> None:
    _require(
        s.name in SCHEDULER_NAMES, "scheduler.name", s.name, f"one of {', '.join(SCHEDULER_NAMES)}"
    )
    _require(s.warmup_epochs >= 0, "scheduler.warmup_epochs", s.warmup_epochs, "must be >= 0")
    _require(
        0 < s.warmup_start_factor <= 1,
        "scheduler.warmup_start_factor",
        s.warmup_start_factor,
        "must be in (0, 1]",
    )
    _require(
        0 <= s.min_lr_factor <= 1, "scheduler.min_lr_factor", s.min_lr_factor, "must be in [0, 1]"
    )
    _require(0 < s.gamma <= 1, "scheduler.gamma", s.gamma, "must be in (0, 1]")
    _require(
        list(s.milestones) == sorted(s.milestones) and all(m > 0 for m in s.milestones),
        "scheduler.milestones",
        s.milestones,
        "increasing epoch numbers > 0",
    )


def validate(run: RunConfig) -> None:
    """Check every range and cross-key rule; raise :class:`ConfigError` on the first violation."""
    validate_precision(run.precision)
    validate_fp8(run.fp8, run.precision)
    _validate_model(run.model)
    _validate_dataset(run.dataset)
    _validate_optimizer(run.optimizer)
    _validate_scheduler(run.scheduler)
    _require(
        run.epochs is not None or run.max_steps is not None,
        "epochs",
        run.epochs,
        "set epochs or max_steps (both null leaves the run without an end)",
    )
    _at_least("epochs", run.epochs, 1, allow_none=True)
    _at_least("max_steps", run.max_steps, 1, allow_none=True)
    _at_least("batch_size", run.batch_size, 1)
    _at_least("eval_batch_size", run.eval_batch_size, 1)
    _at_least("grad_accum_steps", run.grad_accum_steps, 1)
    _positive("clip_grad_norm", run.clip_grad_norm, allow_none=True)
    _require(
        0 <= run.label_smoothing < 1, "label_smoothing", run.label_smoothing, "must be in [0, 1)"
    )
    _require(
        re.fullmatch(r"auto|cpu|cuda(:\d+)?", run.device) is not None,
        "device",
        run.device,
        "one of auto, cpu, cuda, cuda:N",
    )
    _at_least("eval_every", run.eval_every, 1, allow_none=True)
    _at_least("log_every", run.log_every, 1)
    _at_least("probe_every", run.probe_every, 1, allow_none=True)
    _at_least("throughput_warmup_steps", run.throughput_warmup_steps, 0)
    _at_least("num_workers", run.num_workers, 0)
    n = run.numerics
    _positive("numerics.min_loss_scale", n.min_loss_scale)
    _at_least("numerics.warn_consecutive_backoffs", n.warn_consecutive_backoffs, 1)
    _require(
        0 < n.warn_skip_rate <= 1, "numerics.warn_skip_rate", n.warn_skip_rate, "must be in (0, 1]"
    )
    _at_least("numerics.warn_window", n.warn_window, 1)
    _at_least("numerics.max_consecutive_nonfinite_loss", n.max_consecutive_nonfinite_loss, 1)
    _at_least("probe_batches", run.probe_batches, 1)
    _at_least("checkpoint.every_steps", run.checkpoint.every_steps, 1, allow_none=True)
    _at_least("checkpoint.keep_last", run.checkpoint.keep_last, 1)
    _at_least("bench.warmup_steps", run.bench.warmup_steps, 1)
    _require(
        run.distributed.strategy in ("ddp", "fsdp"),
        "distributed.strategy",
        run.distributed.strategy,
        "ddp or fsdp",
    )
    _require(
        run.distributed.reduce_dtype in PARAM_DTYPES,
        "distributed.reduce_dtype",
        run.distributed.reduce_dtype,
        "float32 (default), bfloat16 or float16",
    )
    _at_least("bench.steps", run.bench.steps, 1)
    _require(
        all(s >= 1 for s in run.debug.inject_inf_grad_steps),
        "debug.inject_inf_grad_steps",
        run.debug.inject_inf_grad_steps,
        "optimizer step numbers >= 1",
    )
