"""Typed configuration: the dataclass schemas behind every Hydra config group, and their validation.

Hydra composes YAML from ``conf/`` on top of these schemas (registered in the ConfigStore by
:func:`mptrain.compose.registry.register_configs`), so an unknown key or a value of the wrong type fails at
compose time, naming the key. Config groups are typed with base schemas (``model: ModelConfig``,
as Hydra's structured-config tutorial types ``db: DBConfig``); each option's schema subclasses it.
Range checks that types cannot express (``lr > 0``, ``0 < backoff_factor < 1``) live beside the
schemas, in each option's ``validate()`` and in :func:`validate`, which raise :class:`ConfigError`
with a one-line message of the form ``key=value: what is accepted``.

This module imports no torch, and from OmegaConf only its ``MISSING`` marker:
:func:`mptrain.compose.registry.to_run_config` converts a composed config into these plain dataclasses
once, at the CLI edge.
"""

from __future__ import annotations

import importlib.util
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from omegaconf import MISSING


class ConfigError(ValueError):
    """A configuration value the user must change. The message is one line naming the key."""


# --------------------------------------------------------------------------------------- precision
REDUCE_DTYPES = ("float32", "float16", "bfloat16")


@dataclass
class ScalerConfig:
    """Dynamic loss scaling (torch.amp.GradScaler), for the precisions that scale (fp16)."""

    init_scale: float = 65536.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000


@dataclass
class PrecisionConfig:
    """A precision by name (what each runs: mptrain.precision.policy.PRECISIONS) and its tunables."""

    name: str = "auto"
    scaler: ScalerConfig = field(default_factory=ScalerConfig)
    allow_tf32: bool = False


@dataclass
class FP8Config:
    """FP8 Linear layers (precision=fp8). Ignored by every other precision."""

    format: str = "hybrid"  # hybrid: E4M3 forward, E5M2 gradients | e4m3: E4M3 everywhere
    scaling: str = "dynamic"  # dynamic (current amax) | delayed (amax history)
    granularity: str = "tensorwise"  # tensorwise: a scale per tensor | rowwise: per row (dynamic)
    amax_history_len: int = 16
    amax_compute_algo: str = "max"  # max | most_recent (delayed scaling)
    margin: int = 0  # scale divided by 2**margin: headroom against growing amax
    pow2_scales: bool = False  # scales rounded down to a power of two: scaling adds no rounding
    emulate: bool | None = None  # None: real where the GPU has FP8, emulated elsewhere
    backend: str = "builtin"  # builtin | torchao
    keep_first_last: bool = True
    include: list[str] = field(default_factory=list)
    exclude: list[str] = field(default_factory=list)
    min_features: int = 0  # a Linear with fewer in or out features stays in BF16; 0: off


# Field metadata of the keys that hold a file-system path: relative ones are taken from the
# directory mptrain was launched in (mptrain.compose.registry.absolute_paths), whatever the job's cwd.
PATH = {"path": True}

_launch_dir: Path | None = None


def set_launch_dir(path: Path) -> None:
    """Record the directory mptrain was launched in (a Hydra job: ``hydra.runtime.cwd``, which
    stays the user's directory when ``hydra.job.chdir=true`` moves the job into its output)."""
    global _launch_dir
    _launch_dir = path


def launch_dir() -> Path:
    """Where relative paths, ``_target_`` modules and the default ``./mlruns`` are looked up: the
    recorded launch directory, else the current one (mptrain used from Python)."""
    return _launch_dir if _launch_dir is not None else Path.cwd()


# ---------------------------------------------------------------------------------- group options
@dataclass(frozen=True)
class Option:
    """A config-group option as a registry lists it: its schema and what builds from it."""

    schema: type
    build: Callable[..., Any]


# ------------------------------------------------------------------------------------------ models
@dataclass
class ModelConfig:
    """Base of every model schema; ``name`` is the option's (mptrain.models.build.MODELS)."""

    name: str = MISSING

    def validate(self) -> None:
        """Range rules of this option's keys; ConfigError naming the first violation."""


@dataclass
class MLPConfig(ModelConfig):
    name: str = "mlp"
    hidden_sizes: list[int] = field(default_factory=lambda: [256, 256])
    dropout: float = 0.0

    def validate(self) -> None:
        """Range rules of this option's keys; ConfigError naming the first violation."""
        sizes = self.hidden_sizes
        _require(all(h >= 1 for h in sizes), "model.hidden_sizes", sizes, "sizes >= 1")
        _check_dropout(self.dropout)


@dataclass
class CNNConfig(ModelConfig):
    name: str = "cnn"
    widths: list[int] = field(default_factory=lambda: [32, 64, 128])
    dropout: float = 0.0

    def validate(self) -> None:
        """Range rules of this option's keys; ConfigError naming the first violation."""
        _require(
            len(self.widths) >= 1 and all(w >= 1 for w in self.widths),
            "model.widths",
            self.widths,
            "a non-empty list of channel counts >= 1",
        )
        _check_dropout(self.dropout)


@dataclass
class ResNetConfig(ModelConfig):
    name: str = "resnet18"
    small_stem: bool | None = None  # None: small stem when the input is at most 32 px


@dataclass
class ViTConfig(ModelConfig):
    name: str = "vit"
    patch_size: int = 2
    dim: int = 64
    depth: int = 4
    heads: int = 4
    mlp_ratio: float = 4.0
    dropout: float = 0.0

    def validate(self) -> None:
        """Range rules of this option's keys; ConfigError naming the first violation."""
        for key in ("patch_size", "dim", "depth", "heads"):
            _at_least(f"model.{key}", getattr(self, key), 1)
        _require(
            self.dim % self.heads == 0,
            "model.dim",
            self.dim,
            f"must be divisible by model.heads={self.heads}",
        )
        _positive("model.mlp_ratio", self.mlp_ratio)
        _check_dropout(self.dropout)


@dataclass
class TorchvisionModelConfig(ModelConfig):
    """Any torchvision classification model by its registry name (torchvision.models.get_model)."""

    name: str = "torchvision"
    arch: str = "resnet18"

    def validate(self) -> None:
        """Range rules of this option's keys; ConfigError naming the first violation."""
        _require(bool(self.arch.strip()), "model.arch", self.arch, "a torchvision model name")


@dataclass
class TimmModelConfig(ModelConfig):
    """Any timm model by name (timm.create_model, pretrained=False); needs mptrain[timm]."""

    name: str = "timm"
    arch: str = "resnet18"

    def validate(self) -> None:
        """Range rules of this option's keys; ConfigError naming the first violation."""
        _require(bool(self.arch.strip()), "model.arch", self.arch, "a timm model name")


# Keys a custom option may add with Hydra's ``+model.width=64``: mptrain.compose.registry.to_run_config
# moves every key the schema does not declare into ``kwargs`` (the constructor's arguments).
@dataclass
class GPTConfig(ModelConfig):
    """A decoder-only transformer language model (mptrain.models.gpt); the vocabulary is the data's."""

    name: str = "gpt"
    layers: int = 4
    heads: int = 4
    width: int = 128
    block_size: int = 128  # context length: the training windows are this long
    dropout: float = 0.0

    def validate(self) -> None:
        """Range rules of this option's keys; ConfigError naming the first violation."""
        for key in ("layers", "heads", "width"):
            _at_least(f"model.{key}", getattr(self, key), 1)
        _at_least("model.block_size", self.block_size, 2)
        _require(
            self.width % self.heads == 0,
            "model.width",
            self.width,
            f"must be a multiple of model.heads={self.heads}",
        )
        _check_dropout(self.dropout)


EXTRA_KEYS_FIELD = "kwargs"


@dataclass
class CustomModelConfig(ModelConfig):
    """Any importable nn.Module, built by hydra.utils.instantiate from ``_target_`` and ``kwargs``."""

    accepts_extra_keys: ClassVar[bool] = True
    name: str = "custom"
    _target_: str = MISSING
    kwargs: dict[str, Any] = field(default_factory=dict)

    def validate(self) -> None:
        """Range rules of this option's keys; ConfigError naming the first violation."""
        _check_target("model._target_", self._target_)


# ---------------------------------------------------------------------------------------- datasets
@dataclass
class DatasetConfig:
    """Base of every dataset schema; ``name`` is the option's (mptrain.data.build.DATASETS)."""

    name: str = MISSING

    def validate(self) -> None:
        """Range rules of this option's keys; ConfigError naming the first violation."""


@dataclass
class DigitsConfig(DatasetConfig):
    name: str = "digits"
    val_size: int = 360
    split_seed: int = 0

    def validate(self) -> None:
        """Range rules of this option's keys; ConfigError naming the first violation."""
        _require(0 < self.val_size < 1797, "dataset.val_size", self.val_size, "must be in 1..1796")


@dataclass
class SyntheticConfig(DatasetConfig):
    name: str = "synthetic"
    num_train: int = 2048
    num_val: int = 512
    num_classes: int = 10
    channels: int = 3
    image_size: int = 32
    noise: float = 1.0
    data_seed: int = 0

    def validate(self) -> None:
        """Range rules of this option's keys; ConfigError naming the first violation."""
        for key in ("num_train", "num_val", "channels", "image_size"):
            _at_least(f"dataset.{key}", getattr(self, key), 1)
        _at_least("dataset.num_classes", self.num_classes, 2)
        _require(self.noise >= 0, "dataset.noise", self.noise, "must be >= 0")


@dataclass
class TorchvisionDatasetConfig(DatasetConfig):
    name: str = "cifar10"
    root: str = field(default="data", metadata=PATH)
    download: bool = False
    augment: bool = True

    def validate(self) -> None:
        """Range rules of this option's keys; ConfigError naming the first violation."""
        _check_path("dataset.root", self.root)


@dataclass
class ImageFolderConfig(DatasetConfig):
    name: str = "imagefolder"
    root: str = field(default=MISSING, metadata=PATH)
    train_dir: str = "train"
    val_dir: str = "val"
    image_size: int = 224
    resize_size: int = 256
    augment: bool = True
    skip_bad_files: bool = False  # true: skip images that do not decode (counted in the report)
    decode_device: str = "cpu"  # cpu: PIL in the workers | cuda: bytes from the workers, GPU decode
    decode_draft: bool = True  # cpu: JPEGs decoded at 1/2..1/8 size when the crop allows it

    def validate(self) -> None:
        """Range rules of this option's keys; ConfigError naming the first violation."""
        if self.root is not MISSING:
            _check_path("dataset.root", self.root)
        _at_least("dataset.image_size", self.image_size, 1)
        _at_least("dataset.resize_size", self.resize_size, self.image_size)
        _require(
            self.decode_device in ("cpu", "cuda"),
            "dataset.decode_device",
            self.decode_device,
            "cpu (PIL in the DataLoader workers) or cuda (the training GPU decodes JPEGs)",
        )


@dataclass
class CustomDatasetConfig(DatasetConfig):
    """Any importable callable returning ``(train, val)`` torch Datasets (see mptrain.data.build)."""

    accepts_extra_keys: ClassVar[bool] = True
    name: str = "custom"
    _target_: str = MISSING
    num_classes: int | None = None  # None: len(train.classes)
    in_memory: bool | None = None  # None: tensor feed for TensorDatasets, DataLoader otherwise
    kwargs: dict[str, Any] = field(default_factory=dict)

    def validate(self) -> None:
        """Range rules of this option's keys; ConfigError naming the first violation."""
        _check_target("dataset._target_", self._target_)
        _at_least("dataset.num_classes", self.num_classes, 2, allow_none=True)


@dataclass
class TextDatasetConfig(DatasetConfig):
    """Text for language models (mptrain.data.text): a local file or directory, or by default the
    Python standard library's sources that ship with the interpreter (no download)."""

    name: str = "text"
    path: str = field(default="", metadata=PATH)  # "": the embedded standard-library corpus
    suffix: str | None = None  # files a directory contributes; None: .py (stdlib) / .txt (path)
    max_bytes: int = 2_000_000  # whole files in sorted order until this many bytes
    vocabulary: str = "bytes"  # bytes (256 ids) | chars (built from the training text)
    val_fraction: float = 0.1  # the last share of the tokens validates
    val_windows: int = 64  # fixed validation windows (model.block_size tokens each)

    def validate(self) -> None:
        """Range rules of this option's keys; ConfigError naming the first violation."""
        if self.path:
            _check_path("dataset.path", self.path)
        _at_least("dataset.max_bytes", self.max_bytes, 1)
        _require(
            self.vocabulary in ("bytes", "chars"),
            "dataset.vocabulary",
            self.vocabulary,
            "bytes (256 byte values) or chars (the training text's characters)",
        )
        _require(
            0 < self.val_fraction < 1,
            "dataset.val_fraction",
            self.val_fraction,
            "must be in (0, 1)",
        )
        _at_least("dataset.val_windows", self.val_windows, 1)


# -------------------------------------------------------------------------------------- optimizers
@dataclass
class OptimizerConfig:
    """Base of every optimizer schema: what every optimizer takes."""

    name: str = MISSING
    lr: float = MISSING
    weight_decay: float = 0.0
    decay_norm_and_bias: bool = False

    def validate(self) -> None:
        """Range rules of this option's keys; ConfigError naming the first violation."""
        _positive("optimizer.lr", self.lr)
        _require(
            0 <= self.weight_decay < math.inf,
            "optimizer.weight_decay",
            self.weight_decay,
            "must be >= 0 and finite",
        )


@dataclass
class SGDConfig(OptimizerConfig):
    name: str = "sgd"
    lr: float = 0.1
    momentum: float = 0.9
    nesterov: bool = False
    weight_decay: float = 5e-4
    decay_norm_and_bias: bool = False

    def validate(self) -> None:
        """Range rules of this option's keys; ConfigError naming the first violation."""
        super().validate()
        _require(
            0 <= self.momentum < math.inf,
            "optimizer.momentum",
            self.momentum,
            "must be >= 0 and finite",
        )
        _require(
            not self.nesterov or self.momentum > 0,
            "optimizer.nesterov",
            self.nesterov,
            "needs momentum > 0",
        )


@dataclass
class AdamWConfig(OptimizerConfig):
    name: str = "adamw"
    lr: float = 3e-3
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    weight_decay: float = 0.01
    decay_norm_and_bias: bool = False

    def validate(self) -> None:
        """Range rules of this option's keys; ConfigError naming the first violation."""
        super().validate()
        _require(
            len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
            "optimizer.betas",
            self.betas,
            "two values in [0, 1)",
        )
        _positive("optimizer.eps", self.eps)


@dataclass
class SchedulerConfig:
    """The LR schedule by name (mptrain.train.optim.SCHEDULES), with linear warm-up for all."""

    name: str = "cosine"
    warmup_epochs: float = 0.0
    warmup_start_factor: float = 0.1
    min_lr_factor: float = 0.0
    milestones: list[float] = field(default_factory=list)
    gamma: float = 0.1

    def validate(self) -> None:
        """Range rules of this option's keys; ConfigError naming the first violation."""
        _require(
            self.warmup_epochs >= 0, "scheduler.warmup_epochs", self.warmup_epochs, "must be >= 0"
        )
        _require(
            0 < self.warmup_start_factor <= 1,
            "scheduler.warmup_start_factor",
            self.warmup_start_factor,
            "must be in (0, 1]",
        )
        _require(
            0 <= self.min_lr_factor <= 1,
            "scheduler.min_lr_factor",
            self.min_lr_factor,
            "must be in [0, 1]",
        )
        _require(0 < self.gamma <= 1, "scheduler.gamma", self.gamma, "must be in (0, 1]")
        _require(
            list(self.milestones) == sorted(self.milestones)
            and all(m > 0 for m in self.milestones),
            "scheduler.milestones",
            self.milestones,
            "increasing epoch numbers > 0",
        )


# ----------------------------------------------------------------------------------------- recipe
@dataclass
class ExpectedResult:
    """The result a recipe's source reports, and where it was obtained."""

    metric: str = "final_val_accuracy"  # a key of the report's evaluation section
    value: float | None = None
    tolerance: float = (
        0.0  # met at least value - tolerance (loss/perplexity metrics: at most value + tolerance)
    )
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
    every_minutes: float | None = 10.0
    every_steps: int | None = None
    every_epoch: bool = False
    keep_last: int = 2
    keep_best: bool = True


@dataclass
class BenchConfig:
    """``mptrain bench``: how long and how often each precision is timed."""

    warmup_steps: int = 5
    steps: int = 30
    reps: int = 3  # repetitions in rotating order; fewer than 3 cannot judge the spread


@dataclass
class AdviseConfig:
    """``mptrain advise``: how long the advice may take and what counts as faithful to FP32."""

    budget_s: float = 120.0  # the whole advice; parts that would not fit are skipped and listed
    tolerance: float = 0.05  # largest relative loss difference to FP32 a recommendation may show
    max_skipped_fraction: float = 0.1  # skipped optimizer steps (lost updates) a winner may have
    fidelity_steps: int = 40  # optimizer steps of each precision's short run beside FP32's
    warmup_steps: int = 3  # speed: optimizer steps run before timing starts
    speed_steps: int = 20  # speed: optimizer steps timed per precision and repetition
    reps: int = 3  # speed: repetitions in rotating order (fewer than 3 cannot judge the spread)


@dataclass
class EvalConfig:
    """``mptrain eval resume=PATH``: which checkpoint of a run directory is evaluated."""

    checkpoint: str = "latest"  # latest: the newest that loads | best: best.pt


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
class TensorBoardConfig:
    """logger=[tensorboard]: scalars and the config as hparams (``pip install "mptrain[tensorboard]"``)."""

    log_dir: str | None = field(default=None, metadata=PATH)  # None: <run dir>/tensorboard


@dataclass
class MLflowConfig:
    """logger=[mlflow]: params, metrics and the report as artifacts (``pip install "mptrain[mlflow]"``)."""

    tracking_uri: str | None = None  # None: $MLFLOW_TRACKING_URI, else the file store ./mlruns
    experiment_name: str = "mptrain"
    run_name: str | None = None  # None: the run directory's name


# logger=[...]: each experiment tracker a config may name -> the package it needs (and the extra
# that installs it, mptrain[<name>]).
LOGGERS = {"tensorboard": "tensorboard", "mlflow": "mlflow"}


@dataclass
class RunConfig:
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    model: ModelConfig = MISSING
    dataset: DatasetConfig = MISSING
    optimizer: OptimizerConfig = MISSING
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    fp8: FP8Config = field(default_factory=FP8Config)
    recipe: RecipeConfig = field(default_factory=RecipeConfig)
    task: str = "classify"  # classify | lm (set by task=NAME, conf/task/)
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
    eval_every_minutes: float | None = None
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
    resume: str | None = field(default=None, metadata=PATH)  # or "auto"
    resume_allow_changes: bool = False
    overwrite: bool = False
    bench: BenchConfig = field(default_factory=BenchConfig)
    advise: AdviseConfig = field(default_factory=AdviseConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
    logger: list[str] = field(default_factory=list)  # experiment trackers: names of LOGGERS
    tensorboard: TensorBoardConfig = field(default_factory=TensorBoardConfig)
    mlflow: MLflowConfig = field(default_factory=MLflowConfig)


# ------------------------------------------------------------------------------------- validation
FP32_MAX = 3.4028234663852886e38  # the loss scale is an FP32 tensor
NAME_MAX, PATH_MAX = 255, 4096  # Linux limits on one path component and on a whole path (bytes)


def _check_path(key: str, path: str) -> None:
    """A path the file system could hold: no name over NAME_MAX bytes, at most PATH_MAX bytes."""
    longest = max((len(part.encode()) for part in path.split("/")), default=0)
    _require(
        longest <= NAME_MAX and len(path.encode()) <= PATH_MAX,
        key,
        path if len(path) <= 80 else f"{path[:40]}...({len(path)} characters)",
        f"longer than the file system allows ({NAME_MAX} bytes per name, {PATH_MAX} per path)",
    )


def _check_target(key: str, target: str) -> None:
    """A dotted import path: ``package.module.Name``."""
    _require(
        re.fullmatch(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)+", target) is not None,
        key,
        target,
        "a dotted import path such as my_pkg.MyNet (module, then the name in it)",
    )


def _check_dropout(dropout: float) -> None:
    _require(0 <= dropout < 1, "model.dropout", dropout, "must be in [0, 1)")


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
    """The scaler's numbers (the name is checked against the precision table at the CLI edge)."""
    s = p.scaler
    _require(
        0 < s.init_scale <= FP32_MAX,
        "precision.scaler.init_scale",
        s.init_scale,
        f"must be > 0 and at most FP32's largest value {FP32_MAX:.4g}",
    )
    _require(
        1 < s.growth_factor < math.inf,
        "precision.scaler.growth_factor",
        s.growth_factor,
        "must be > 1 and finite",
    )
    _require(
        0 < s.backoff_factor < 1,
        "precision.scaler.backoff_factor",
        s.backoff_factor,
        "must be in the open interval (0, 1)",
    )
    _at_least("precision.scaler.growth_interval", s.growth_interval, 1)


def validate_fp8(f: FP8Config) -> None:
    _require(f.format in ("hybrid", "e4m3"), "fp8.format", f.format, "hybrid or e4m3")
    _require(f.scaling in ("dynamic", "delayed"), "fp8.scaling", f.scaling, "dynamic or delayed")
    _require(
        f.granularity in ("tensorwise", "rowwise"),
        "fp8.granularity",
        f.granularity,
        "tensorwise or rowwise",
    )
    _require(
        f.granularity == "tensorwise" or f.scaling == "dynamic",
        "fp8.granularity",
        f.granularity,
        "rowwise scales are dynamic (one per row of each tensor, no history): "
        "use fp8.scaling=dynamic or fp8.granularity=tensorwise",
    )
    _at_least("fp8.amax_history_len", f.amax_history_len, 1)
    _require(
        f.amax_compute_algo in ("max", "most_recent"),
        "fp8.amax_compute_algo",
        f.amax_compute_algo,
        "max or most_recent",
    )
    _require(f.margin >= 0, "fp8.margin", f.margin, "must be an integer >= 0")
    _require(f.backend in ("builtin", "torchao"), "fp8.backend", f.backend, "builtin or torchao")
    _require(isinstance(f.pow2_scales, bool), "fp8.pow2_scales", f.pow2_scales, "true or false")
    _require(
        type(f.min_features) is int and f.min_features >= 0,
        "fp8.min_features",
        f.min_features,
        "must be an integer >= 0 (0: every size converts)",
    )


def _validate_numerics(n: NumericsConfig) -> None:
    _positive("numerics.min_loss_scale", n.min_loss_scale)
    _at_least("numerics.warn_consecutive_backoffs", n.warn_consecutive_backoffs, 1)
    _require(
        0 < n.warn_skip_rate <= 1, "numerics.warn_skip_rate", n.warn_skip_rate, "must be in (0, 1]"
    )
    _at_least("numerics.warn_window", n.warn_window, 1)
    _at_least("numerics.max_consecutive_nonfinite_loss", n.max_consecutive_nonfinite_loss, 1)


# The tasks (each an overlay conf/task/<name>.yaml), and the models and datasets of the
# language-model task; every other one classifies.
TASKS = ("classify", "lm")
LM_MODELS, LM_DATASETS = ("gpt",), ("text",)


def _check_task(run: RunConfig) -> None:
    """The task, the model and the dataset must agree: a language model reads token windows."""
    _require(run.task in TASKS, "task", run.task, " or ".join(TASKS))
    lm = run.task == "lm"
    for group, names, accepted in (
        ("model", LM_MODELS, "model=gpt"),
        ("dataset", LM_DATASETS, "dataset=text"),
    ):
        name = getattr(run, group).name
        if lm and name not in names:
            raise ConfigError(f"{group}={name}: task=lm trains a language model; use {accepted}")
        if not lm and name in names:
            raise ConfigError(f"{group}={name}: for language models; add task=lm")


def validate(run: RunConfig) -> None:
    """Check every range and cross-key rule; raise :class:`ConfigError` on the first violation."""
    validate_precision(run.precision)
    validate_fp8(run.fp8)
    for group in (run.model, run.dataset, run.optimizer, run.scheduler):
        group.validate()  # each schema's own range rules
    _require(
        run.epochs is not None or run.max_steps is not None,
        "epochs",
        run.epochs,
        "set epochs or max_steps (both null leaves the run without an end)",
    )
    _at_least("epochs", run.epochs, 1, allow_none=True)
    _check_task(run)
    _at_least("max_steps", run.max_steps, 1, allow_none=True)
    _require(
        -(2**63) <= run.seed < 2**64,
        "seed",
        run.seed,
        "must fit in 64 bits (torch.manual_seed's range: -2**63 .. 2**64 - 1)",
    )
    if run.resume not in (None, "auto"):
        _check_path("resume", run.resume)
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
    _positive("eval_every_minutes", run.eval_every_minutes, allow_none=True)
    _at_least("log_every", run.log_every, 1)
    _at_least("probe_every", run.probe_every, 1, allow_none=True)
    _at_least("throughput_warmup_steps", run.throughput_warmup_steps, 0)
    _at_least("num_workers", run.num_workers, 0)
    _validate_numerics(run.numerics)
    _at_least("probe_batches", run.probe_batches, 1)
    _validate_mechanics(run)
    validate_loggers(run.logger)


def check_eval_checkpoint(which: str) -> None:
    """``eval.checkpoint``: which checkpoint of a run directory ``mptrain eval`` takes."""
    _require(
        which in ("latest", "best"),
        "eval.checkpoint",
        which,
        "latest (the newest checkpoint that loads) or best (best.pt)",
    )


def _validate_mechanics(run: RunConfig) -> None:
    """Checkpoints, bench, distributed and debug: how the run is carried out."""
    _at_least("checkpoint.every_steps", run.checkpoint.every_steps, 1, allow_none=True)
    _positive("checkpoint.every_minutes", run.checkpoint.every_minutes, allow_none=True)
    _at_least("checkpoint.keep_last", run.checkpoint.keep_last, 1)
    _at_least("bench.warmup_steps", run.bench.warmup_steps, 1)
    _at_least("bench.steps", run.bench.steps, 1)
    _at_least("bench.reps", run.bench.reps, 1)
    _validate_advise(run.advise)
    check_eval_checkpoint(run.eval.checkpoint)
    _require(
        run.distributed.strategy in ("ddp", "fsdp"),
        "distributed.strategy",
        run.distributed.strategy,
        "ddp or fsdp",
    )
    _require(
        run.distributed.reduce_dtype in REDUCE_DTYPES,
        "distributed.reduce_dtype",
        run.distributed.reduce_dtype,
        "float32 (default), bfloat16 or float16",
    )
    _require(
        all(s >= 1 for s in run.debug.inject_inf_grad_steps),
        "debug.inject_inf_grad_steps",
        run.debug.inject_inf_grad_steps,
        "optimizer step numbers >= 1",
    )


def _validate_advise(a: AdviseConfig) -> None:
    """``mptrain advise``: a positive budget and tolerance, whole step counts, a fraction."""
    _positive("advise.budget_s", a.budget_s)
    _positive("advise.tolerance", a.tolerance)
    _require(
        0 <= a.max_skipped_fraction < 1,
        "advise.max_skipped_fraction",
        a.max_skipped_fraction,
        "must be in [0, 1)",
    )
    _at_least("advise.fidelity_steps", a.fidelity_steps, 2)
    _at_least("advise.warmup_steps", a.warmup_steps, 1)
    _at_least("advise.speed_steps", a.speed_steps, 1)
    _at_least("advise.reps", a.reps, 1)


def validate_loggers(names: list[str]) -> None:
    """Every name in ``logger`` is a tracker of :data:`LOGGERS` whose package is installed."""
    for name in names:
        _require(
            name in LOGGERS,
            "logger",
            names,
            f"unknown logger {name!r}; one of {', '.join(LOGGERS)}",
        )
        package = LOGGERS[name]
        _require(
            importlib.util.find_spec(package) is not None,
            "logger",
            names,
            f"{name} needs the {package} package, which is not installed: "
            f'pip install "mptrain[{name}]"',
        )
