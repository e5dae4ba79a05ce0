"""The whole job's schema, :class:`RunConfig`, with the groups it holds (numerics, checkpoint,
distributed, debug, trackers, recipe), the task/model/dataset agreement and :func:`validate`, the
range rules of a whole run.

Hydra composes YAML from ``conf/`` on top of these schemas (registered in the ConfigStore by
:func:`mptrain.compose.registry.register_configs`), so an unknown key or a value of the wrong type
fails at compose time, naming the key; :func:`mptrain.compose.registry.to_run_config` converts a
composed config into these plain dataclasses once, at the CLI edge.
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass, field

from omegaconf import MISSING

from mptrain.config.base import (
    NOT_TRAINING,
    PATH,
    ConfigError,
    at_least,
    check_path,
    positive,
    require,
)
from mptrain.config.commands import (
    AdviseConfig,
    BenchConfig,
    EvalConfig,
    SampleConfig,
    check_eval_checkpoint,
    validate_advise,
    validate_sample,
)
from mptrain.config.data import DatasetConfig
from mptrain.config.models import ModelConfig
from mptrain.config.optim import OptimizerConfig, SchedulerConfig
from mptrain.config.options import PRECISION_NAMES
from mptrain.config.precision import (
    REDUCE_DTYPES,
    FP8Config,
    MXConfig,
    NVFP4Config,
    PrecisionConfig,
    validate_fp8,
    validate_mx,
    validate_nvfp4,
    validate_precision,
    validate_switch,
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
class RecipeData:
    """The data a recipe reproduces: what a run must train on for its verdict to mean anything.
    Checked before training (:func:`mptrain.config.recipes.check_recipe_source`: the dataset
    option and a stat of ``dataset.path``) and once read (:func:`mptrain.train.recipe.check_recipe_data`:
    the text's size and sha256, the sample counts). An empty field checks nothing."""

    dataset: str = ""  # the dataset option it trains on (dataset.name); "": any
    file: str = ""  # dataset=text: the file's name as its source publishes it (named in messages)
    bytes: int | None = None  # dataset=text: the file's size
    sha256: str = (
        ""  # dataset=text: the sha256 of its bytes; "": unknown, the size alone is checked
    )
    train_samples: int | None = None  # the training split's samples (windows for text: not checked)
    val_samples: int | None = None  # the validation split's samples


@dataclass
class RecipeConfig:
    """Set by ``recipe=NAME`` (recipes/NAME.yaml); empty when no recipe is applied."""

    name: str | None = None
    source: str = ""
    command: str = ""
    expected: ExpectedResult = field(default_factory=ExpectedResult)
    note: str = ""
    data: RecipeData = field(default_factory=RecipeData)
    # true: data other than ``data`` names is refused before training (exit 2); false: the run
    # goes ahead and its verdict says "not comparable" with what differed.
    strict: bool = True


# -------------------------------------------------------------------------------------------- run
@dataclass
class NumericsConfig:
    """Loss-scale health limits, culprit search and per-layer FP32 overrides."""

    min_loss_scale: float = 1.0
    warn_consecutive_backoffs: int = field(default=5, metadata=NOT_TRAINING)
    warn_skip_rate: float = field(default=0.25, metadata=NOT_TRAINING)
    warn_window: int = field(default=200, metadata=NOT_TRAINING)
    max_consecutive_nonfinite_loss: int = 5
    find_culprit: bool = field(default=True, metadata=NOT_TRAINING)
    fp32_modules: list[str] = field(default_factory=list)


@dataclass
class CheckpointConfig:
    enabled: bool = True
    every_minutes: float | None = 10.0
    every_steps: int | None = None
    every_epoch: bool = False
    keep_last: int = 2
    keep_best: bool = True
    # The signal that asks for a checkpoint (SLURM's --signal=USR1@T warns before pre-emption),
    # and what follows it: save (checkpoint after this step, go on) | stop (checkpoint and stop).
    signal: str | None = "SIGUSR1"
    on_signal: str = "save"


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
    mx: MXConfig = field(default_factory=MXConfig)
    nvfp4: NVFP4Config = field(default_factory=NVFP4Config)
    recipe: RecipeConfig = field(default_factory=RecipeConfig, metadata=NOT_TRAINING)
    task: str = "classify"  # classify | lm (set by task=NAME, conf/task/)
    # The run's length. epochs=null (the default) means DEFAULT_EPOCHS unless max_steps is given,
    # which then is the length (as in Hugging Face's Trainer and Lightning); both given, the
    # first reached ends the run. Resolved when the config is built (__post_init__).
    epochs: int | None = None
    max_steps: int | None = None
    batch_size: int = 64
    eval_batch_size: int = 512
    grad_accum_steps: int = 1
    clip_grad_norm: float | None = None
    label_smoothing: float = 0.0
    # Not compared: sweeps pair runs across seeds (a resume signature adds it back).
    seed: int = field(default=0, metadata=NOT_TRAINING)
    device: str = field(default="auto", metadata=NOT_TRAINING)
    eval_every: int | None = field(default=None, metadata=NOT_TRAINING)
    eval_every_minutes: float | None = field(default=None, metadata=NOT_TRAINING)
    log_every: int = field(default=50, metadata=NOT_TRAINING)
    probe_every: int | None = field(default=100, metadata=NOT_TRAINING)
    throughput_warmup_steps: int = field(default=5, metadata=NOT_TRAINING)
    channels_last: bool = False
    compile: bool = field(default=False, metadata=NOT_TRAINING)
    num_workers: int = field(default=2, metadata=NOT_TRAINING)
    # Intra-op CPU threads: auto (from affinity, cgroup quota, workers; measured on training steps
    # on a CPU) or a count that pins it. On CUDA it sets the host's threads only.
    threads: str = field(default="auto", metadata=NOT_TRAINING)
    progress: bool = field(default=True, metadata=NOT_TRAINING)
    audit: bool = field(default=False, metadata=NOT_TRAINING)
    probe: bool = field(default=False, metadata=NOT_TRAINING)
    probe_batches: int = field(default=4, metadata=NOT_TRAINING)
    numerics: NumericsConfig = field(default_factory=NumericsConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig, metadata=NOT_TRAINING)
    resume: str | None = field(default=None, metadata=PATH | NOT_TRAINING)  # or "auto"
    resume_allow_changes: bool = field(default=False, metadata=NOT_TRAINING)
    overwrite: bool = field(default=False, metadata=NOT_TRAINING)
    # mptrain eval / sample: rebuild a model or dataset whose _target_ the checkpoint names (its
    # code runs: only for checkpoints you trust); see mptrain.config.targets.
    trust_checkpoint_code: bool = field(default=False, metadata=NOT_TRAINING)
    bench: BenchConfig = field(default_factory=BenchConfig, metadata=NOT_TRAINING)
    advise: AdviseConfig = field(default_factory=AdviseConfig, metadata=NOT_TRAINING)
    eval: EvalConfig = field(default_factory=EvalConfig, metadata=NOT_TRAINING)
    sample: SampleConfig = field(default_factory=SampleConfig, metadata=NOT_TRAINING)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    debug: DebugConfig = field(default_factory=DebugConfig, metadata=NOT_TRAINING)
    # Experiment trackers (names of LOGGERS): where the run is reported, not what it computes.
    logger: list[str] = field(default_factory=list, metadata=NOT_TRAINING)
    tensorboard: TensorBoardConfig = field(default_factory=TensorBoardConfig, metadata=NOT_TRAINING)
    mlflow: MLflowConfig = field(default_factory=MLflowConfig, metadata=NOT_TRAINING)

    def __post_init__(self) -> None:
        # The default length applies when neither limit is given (see ``epochs``); resolved
        # here so the report, the resume signature and every reader see the number that ran.
        if self.epochs is None and self.max_steps is None:
            self.epochs = DEFAULT_EPOCHS


# epochs=null and max_steps=null: the run's length (passes over the training set).
DEFAULT_EPOCHS = 15
# The most optimizer steps a run may take: step counts are passed to C ints (2**31 - 1).
MAX_STEPS = 2**31 - 1

# Signals a scheduler may send before pre-empting a job (SLURM --signal, LSF, PBS), which a run
# can take as "checkpoint now": not the stop signals, not ones Python or torch use themselves.
CHECKPOINT_SIGNALS = ("SIGUSR1", "SIGUSR2", "SIGALRM", "SIGXCPU")


def _validate_checkpoint_signal(c: CheckpointConfig) -> None:
    require(
        c.on_signal in ("save", "stop"),
        "checkpoint.on_signal",
        c.on_signal,
        "save (checkpoint and go on) or stop (checkpoint and stop)",
    )
    require(
        c.signal is None or c.signal in CHECKPOINT_SIGNALS,
        "checkpoint.signal",
        c.signal,
        f"null or one of {', '.join(CHECKPOINT_SIGNALS)} (SIGINT, SIGTERM and SIGHUP stop a run)",
    )


def _validate_numerics(n: NumericsConfig) -> None:
    positive("numerics.min_loss_scale", n.min_loss_scale)
    at_least("numerics.warn_consecutive_backoffs", n.warn_consecutive_backoffs, 1)
    require(
        0 < n.warn_skip_rate <= 1, "numerics.warn_skip_rate", n.warn_skip_rate, "must be in (0, 1]"
    )
    at_least("numerics.warn_window", n.warn_window, 1)
    at_least("numerics.max_consecutive_nonfinite_loss", n.max_consecutive_nonfinite_loss, 1)


# The tasks (each an overlay conf/task/<name>.yaml), and the models and datasets of the
# language-model task; every other one classifies. model=custom serves both tasks.
TASKS = ("classify", "lm")
LM_MODELS, LM_DATASETS = ("gpt", "hf", "custom"), ("text",)
EITHER_TASK = ("custom",)


def _check_task(run: RunConfig) -> None:
    """The task, the model and the dataset must agree: a language model reads token windows."""
    require(run.task in TASKS, "task", run.task, " or ".join(TASKS))
    lm = run.task == "lm"
    for group, names in (("model", LM_MODELS), ("dataset", LM_DATASETS)):
        name = getattr(run, group).name
        if lm and name not in names:
            accepted = " or ".join(f"{group}={n}" for n in names)
            raise ConfigError(f"{group}={name}: task=lm trains a language model; use {accepted}")
        if not lm and name in names and name not in EITHER_TASK:
            raise ConfigError(f"{group}={name}: for language models; add task=lm")
    block_size = getattr(run.model, "block_size", None)
    if not lm and run.model.name in EITHER_TASK and block_size is not None:
        raise ConfigError(f"model.block_size={block_size}: for language models; add task=lm")


def validate(run: RunConfig) -> None:
    """Check every range and cross-key rule; raise :class:`ConfigError` on the first violation."""
    validate_precision(run.precision)
    validate_switch(run.precision, PRECISION_NAMES)
    validate_fp8(run.fp8)
    validate_mx(run.mx)
    validate_nvfp4(run.nvfp4)
    for group in (run.model, run.dataset, run.optimizer, run.scheduler):
        group.validate()  # each schema's own range rules
    at_least("epochs", run.epochs, 1, allow_none=True)
    for key in ("epochs", "max_steps"):  # step counters reach C ints (the LR schedule, seeds)
        require(
            getattr(run, key) is None or getattr(run, key) <= MAX_STEPS,
            key,
            getattr(run, key),
            f"at most {MAX_STEPS:,}",
        )
    _check_task(run)
    at_least("max_steps", run.max_steps, 1, allow_none=True)
    require(
        -(2**63) <= run.seed < 2**64,
        "seed",
        run.seed,
        "must fit in 64 bits (torch.manual_seed's range: -2**63 .. 2**64 - 1)",
    )
    if run.resume not in (None, "auto"):
        check_path("resume", run.resume)
    at_least("batch_size", run.batch_size, 1)
    at_least("eval_batch_size", run.eval_batch_size, 1)
    at_least("grad_accum_steps", run.grad_accum_steps, 1)
    positive("clip_grad_norm", run.clip_grad_norm, allow_none=True)
    require(
        0 <= run.label_smoothing < 1, "label_smoothing", run.label_smoothing, "must be in [0, 1)"
    )
    require(
        re.fullmatch(r"auto|cpu|cuda(:\d+)?", run.device) is not None,
        "device",
        run.device,
        "one of auto, cpu, cuda, cuda:N",
    )
    at_least("eval_every", run.eval_every, 1, allow_none=True)
    positive("eval_every_minutes", run.eval_every_minutes, allow_none=True)
    at_least("log_every", run.log_every, 1)
    at_least("probe_every", run.probe_every, 1, allow_none=True)
    at_least("throughput_warmup_steps", run.throughput_warmup_steps, 0)
    at_least("num_workers", run.num_workers, 0)
    require(
        re.fullmatch(r"auto|0*[1-9]\d*", str(run.threads).strip()) is not None,
        "threads",
        run.threads,
        "auto or a thread count of at least 1",
    )
    _validate_numerics(run.numerics)
    at_least("probe_batches", run.probe_batches, 1)
    _validate_mechanics(run)
    validate_loggers(run.logger)


def _validate_mechanics(run: RunConfig) -> None:
    """Checkpoints, bench, distributed and debug: how the run is carried out."""
    at_least("checkpoint.every_steps", run.checkpoint.every_steps, 1, allow_none=True)
    positive("checkpoint.every_minutes", run.checkpoint.every_minutes, allow_none=True)
    at_least("checkpoint.keep_last", run.checkpoint.keep_last, 1)
    _validate_checkpoint_signal(run.checkpoint)
    at_least("bench.warmup_steps", run.bench.warmup_steps, 1)
    at_least("bench.steps", run.bench.steps, 1)
    at_least("bench.reps", run.bench.reps, 1)
    validate_advise(run.advise)
    check_eval_checkpoint(run.eval.checkpoint)
    validate_sample(run.sample)
    require(
        run.distributed.strategy in ("ddp", "fsdp"),
        "distributed.strategy",
        run.distributed.strategy,
        "ddp or fsdp",
    )
    require(
        run.distributed.reduce_dtype in REDUCE_DTYPES,
        "distributed.reduce_dtype",
        run.distributed.reduce_dtype,
        "float32 (default), bfloat16 or float16",
    )
    require(
        all(s >= 1 for s in run.debug.inject_inf_grad_steps),
        "debug.inject_inf_grad_steps",
        run.debug.inject_inf_grad_steps,
        "optimizer step numbers >= 1",
    )


def validate_loggers(names: list[str]) -> None:
    """Every name in ``logger`` is a tracker of :data:`LOGGERS` whose package is installed."""
    for name in names:
        require(
            name in LOGGERS,
            "logger",
            names,
            f"unknown logger {name!r}; one of {', '.join(LOGGERS)}",
        )
        package = LOGGERS[name]
        require(
            importlib.util.find_spec(package) is not None,
            "logger",
            names,
            f"{name} needs the {package} package, which is not installed: "
            f'pip install "mptrain[{name}]"',
        )
