"""The whole job's schema, :class:`RunConfig` (its sections beside the config groups are in
:mod:`mptrain.config.sections`), the task/model/dataset agreement and :func:`validate`, the range
rules of a whole run. Hydra composes ``conf/`` on top of it (:mod:`mptrain.cli.registry`).
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass, field

from omegaconf import MISSING

from mptrain.config.base import (
    NOT_TRAINING,
    PATH,
    Accepts,
    ConfigError,
    at_least_rule,
    auto_or_count_rule,
    check_path,
    check_settings,
    in_range_rule,
    positive_rule,
    require,
    setting,
)
from mptrain.config.commands import (
    AdviseConfig,
    BenchConfig,
    EvalConfig,
    SampleConfig,
    check_eval_checkpoint,
)
from mptrain.config.data import DatasetConfig
from mptrain.config.format_table import FORMAT_TABLE, MXFP8, NVFP4
from mptrain.config.models import ModelConfig
from mptrain.config.optim import OptimizerConfig, SchedulerConfig
from mptrain.config.options import PRECISION_NAMES
from mptrain.config.precision import (
    FP8Config,
    MXConfig,
    NVFP4Config,
    PrecisionConfig,
    validate_fp8,
    validate_precision,
    validate_switch,
)
from mptrain.config.sections import (
    LOGGERS,
    CheckpointConfig,
    DebugConfig,
    DistributedConfig,
    MemoryConfig,
    MLflowConfig,
    NumericsConfig,
    RecipeConfig,
    TensorBoardConfig,
)

# Range rules of settings whose test is more than a bound (on their fields below).
DEVICES = Accepts(
    lambda v: re.fullmatch(r"auto|cpu|cuda(:\d+)?", v) is not None, "one of auto, cpu, cuda, cuda:N"
)
SEEDS = Accepts(
    lambda v: -(2**63) <= v < 2**64,
    "must fit in 64 bits (torch.manual_seed's range: -2**63 .. 2**64 - 1)",
)


@dataclass
class RunConfig:
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    model: ModelConfig = MISSING
    dataset: DatasetConfig = MISSING
    optimizer: OptimizerConfig = MISSING
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    fp8: FP8Config = setting(help="FP8 settings, used only by precision=fp8", factory=FP8Config)
    mx: MXConfig = setting(
        help=(
            "MXFP8 settings, used only by precision=mxfp8 (E4M3 elements in blocks of 32, one "
            "E8M0 power-of-two scale per block)"
        ),
        factory=MXConfig,
    )
    nvfp4: NVFP4Config = setting(
        help=(
            "NVFP4 settings, used only by precision=nvfp4 (E2M1 elements in blocks of 16, E4M3 "
            "block scales, an FP32 scale per tensor; NVIDIA's recipe, arXiv 2509.25149)"
        ),
        factory=NVFP4Config,
    )
    recipe: RecipeConfig = setting(
        help="filled in by recipe=NAME: what the recipe expects (recorded in the report)",
        factory=RecipeConfig,
        metadata=NOT_TRAINING,
    )
    task: str = setting(
        "classify",
        "classify | lm: set by the task group (task=lm also selects model=gpt, dataset=text)",
    )
    epochs: int | None = setting(
        None,
        (
            "passes over the training set; null: 15, unless max_steps is given (then max_steps "
            "alone sets the length)"
        ),
        accepts=at_least_rule(1, optional=True),
    )
    max_steps: int | None = setting(
        None,
        (
            "optimizer steps: the run's length when epochs is not given; with epochs, whichever "
            "comes first ends the run"
        ),
        accepts=at_least_rule(1, optional=True),
    )
    batch_size: int = setting(64, "samples per micro-batch", accepts=at_least_rule(1))
    eval_batch_size: int = setting(
        512, "samples per batch during evaluation", accepts=at_least_rule(1)
    )
    grad_accum_steps: int = setting(
        1,
        "micro-batches per optimizer step (effective batch = batch_size x this)",
        accepts=at_least_rule(1),
    )
    clip_grad_norm: float | None = setting(
        None,
        "max L2 norm of the unscaled FP32 gradients; null = no clipping",
        accepts=positive_rule(optional=True),
    )
    label_smoothing: float = setting(
        0.0,
        "cross-entropy label smoothing in [0, 1)",
        accepts=in_range_rule("[0, 1)"),
    )
    # Not compared: sweeps pair runs across seeds (a resume signature adds it back).
    seed: int = setting(
        0,
        "seeds python, numpy and torch (weights, data order, dropout)",
        metadata=NOT_TRAINING,
        accepts=SEEDS,
    )
    device: str = setting(
        "auto",
        "auto (cuda when available, else cpu) | cpu | cuda | cuda:N",
        metadata=NOT_TRAINING,
        accepts=DEVICES,
    )
    eval_every: int | None = setting(
        None,
        (
            "evaluate every N optimizer steps; null (and eval_every_minutes null) = at the end of"
            " every epoch"
        ),
        metadata=NOT_TRAINING,
        accepts=at_least_rule(1, optional=True),
    )
    eval_every_minutes: float | None = setting(
        None,
        (
            "evaluate every M minutes of wall time (with eval_every: whichever is due); which "
            "steps get evaluated then varies run to run"
        ),
        metadata=NOT_TRAINING,
        accepts=positive_rule(optional=True),
    )
    log_every: int = setting(
        50,
        (
            "write a metrics row (loss, gradient norm: one device read) every N optimizer steps "
            "(~0.2 ms each on a CPU)"
        ),
        metadata=NOT_TRAINING,
        accepts=at_least_rule(1),
    )
    probe_every: int | None = setting(
        100,
        (
            "measure zero gradients and the updates rounded away, in the parameters and in each"
            " optimizer state, every N steps (costs a copy of the parameters and one of the"
            " states); null = never"
        ),
        metadata=NOT_TRAINING,
        accepts=at_least_rule(1, optional=True),
    )
    throughput_warmup_steps: int = setting(
        5,
        "optimizer steps excluded from the throughput figure (warm-up)",
        metadata=NOT_TRAINING,
        accepts=at_least_rule(0),
    )
    channels_last: bool = setting(
        False, "NHWC memory format for conv nets (fast path for tensor cores under autocast)"
    )
    compile: bool = setting(False, "wrap the model in torch.compile", metadata=NOT_TRAINING)
    num_workers: int = setting(
        2,
        "DataLoader workers for file-backed datasets (imagefolder)",
        metadata=NOT_TRAINING,
        accepts=at_least_rule(0),
    )
    threads: str = setting(
        "auto",
        (
            "intra-op CPU threads: auto (affinity/cgroup quota less workers, per concurrent sweep"
            " job; on a CPU measured against fewer on the first training steps and re-checked "
            "when throughput halves) | N (pinned); on CUDA it sets the host threads only"
        ),
        metadata=NOT_TRAINING,
        accepts=auto_or_count_rule("auto or a thread count of at least 1"),
    )
    progress: bool = setting(
        True,
        (
            "progress on stdout: a live bar on a terminal, else a plain line every log_every "
            "steps and per evaluation (the job's .log file records the lines either way)"
        ),
        metadata=NOT_TRAINING,
    )
    audit: bool = setting(
        False,
        "trace one training step: every op's dtypes under autocast -> audit.md / audit.json",
        metadata=NOT_TRAINING,
    )
    probe: bool = setting(
        False,
        (
            "FP16 range probe before training: magnitudes, underflow, headroom -> probe.md / "
            "probe.json"
        ),
        metadata=NOT_TRAINING,
    )
    probe_batches: int = setting(
        4, "batches the probe measures", metadata=NOT_TRAINING, accepts=at_least_rule(1)
    )
    numerics: NumericsConfig = setting(
        help="loss-scale health and diagnostics", factory=NumericsConfig
    )
    checkpoint: CheckpointConfig = setting(
        help=(
            "checkpoints in <run dir>/checkpoints/ (atomic writes): on these cadences, and always"
            " at the end and on SIGINT/SIGTERM/SIGHUP"
        ),
        factory=CheckpointConfig,
        metadata=NOT_TRAINING,
    )
    resume: str | None = setting(
        None,
        (
            "continue a run: a checkpoint file, a run directory, or auto (this run's newest valid"
            " checkpoint)"
        ),
        metadata=PATH | NOT_TRAINING,
    )
    resume_allow_changes: bool = setting(
        False,
        "true: resume although precision, model or data settings differ from the checkpoint's",
        metadata=NOT_TRAINING,
    )
    overwrite: bool = setting(
        False,
        (
            "true: start fresh in a run directory that holds another run's checkpoints (deleting "
            "them)"
        ),
        metadata=NOT_TRAINING,
    )
    # See mptrain.config.targets.refuse_checkpoint_code.
    trust_checkpoint_code: bool = setting(
        False,
        (
            "mptrain eval / sample: true runs the model or dataset _target_ a checkpoint names "
            "(its code: only for checkpoints you trust; else give the _target_ on the command "
            "line)"
        ),
        metadata=NOT_TRAINING,
    )
    bench: BenchConfig = setting(
        help="`mptrain bench [overrides]`: time every precision this device runs natively",
        factory=BenchConfig,
        metadata=NOT_TRAINING,
    )
    advise: AdviseConfig = setting(
        help="`mptrain advise [overrides]`: measure every precision here and recommend one",
        factory=AdviseConfig,
        metadata=NOT_TRAINING,
    )
    eval: EvalConfig = setting(
        help="`mptrain eval resume=PATH [overrides]`: evaluate a trained model, no training",
        factory=EvalConfig,
        metadata=NOT_TRAINING,
    )
    sample: SampleConfig = setting(
        help=(
            "`mptrain sample resume=PATH [overrides]`: text from a trained task=lm model "
            "(checkpoint: eval.checkpoint)"
        ),
        factory=SampleConfig,
        metadata=NOT_TRAINING,
    )
    distributed: DistributedConfig = setting(
        help="used only under torchrun (WORLD_SIZE > 1); NCCL on GPUs, Gloo on CPUs",
        factory=DistributedConfig,
    )
    memory: MemoryConfig = setting(
        help="memory: the report's bytes by tensor kind and dtype, activation checkpointing",
        factory=MemoryConfig,
    )
    debug: DebugConfig = setting(
        help="test hooks: inf gradients injected at chosen steps (exercise step skipping)",
        factory=DebugConfig,
        metadata=NOT_TRAINING,
    )
    logger: list[str] = setting(
        help=(
            "experiment trackers: [tensorboard], [mlflow] or [tensorboard,mlflow] (each an extra:"
            ' pip install "mptrain[tensorboard]")'
        ),
        factory=list,
        metadata=NOT_TRAINING,
    )
    tensorboard: TensorBoardConfig = setting(
        help=(
            "logger=[tensorboard]: scalars every log_every steps and per evaluation, the config "
            "as hparams"
        ),
        factory=TensorBoardConfig,
        metadata=NOT_TRAINING,
    )
    mlflow: MLflowConfig = setting(
        help=(
            "logger=[mlflow]: the flattened config as params, metrics, "
            "report.json/report.md/curves.png as artifacts"
        ),
        factory=MLflowConfig,
        metadata=NOT_TRAINING,
    )

    def __post_init__(self) -> None:
        # The default length applies when neither limit is given (see ``epochs``); resolved
        # here so the report, the resume signature and every reader see the number that ran.
        if self.epochs is None and self.max_steps is None:
            self.epochs = DEFAULT_EPOCHS


# epochs=null and max_steps=null: the run's length (passes over the training set).
DEFAULT_EPOCHS = 15
# The most optimizer steps a run may take: step counts are passed to C ints (2**31 - 1).
MAX_STEPS = 2**31 - 1

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
    for name in (FORMAT_TABLE[MXFP8].config_group, FORMAT_TABLE[NVFP4].config_group):
        check_settings(getattr(run, name), f"{name}.")  # mx.*, nvfp4.*: rules on fields only
    for group in (run.model, run.dataset, run.optimizer, run.scheduler):
        group.validate()  # each schema's rules: those on its fields, then its cross-key ones
    check_settings(run)  # the fields' own rules
    for key in ("epochs", "max_steps"):  # step counters reach C ints (the LR schedule, seeds)
        value = getattr(run, key)
        require(value is None or value <= MAX_STEPS, key, value, f"at most {MAX_STEPS:,}")
    _check_task(run)
    if run.resume not in (None, "auto"):
        check_path("resume", run.resume)
    sections = ("numerics", "checkpoint", "bench", "advise", "sample", "distributed", "memory")
    for name in (*sections, "debug"):  # the sections' rules: how the run is carried out
        check_settings(getattr(run, name), f"{name}.")
    check_eval_checkpoint(run.eval.checkpoint)
    validate_loggers(run.logger)


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
