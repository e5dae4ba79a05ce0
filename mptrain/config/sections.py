"""The sections of a run that are not a config group (``numerics``, ``checkpoint``,
``distributed``, ``memory``, ``debug``, the trackers, ``recipe``) and their range rules;
:class:`~mptrain.config.run.RunConfig` holds one of each, and its field's help says what for.
"""

from __future__ import annotations

from dataclasses import dataclass

from mptrain.config.base import (
    NOT_TRAINING,
    PATH,
    Accepts,
    at_least_rule,
    in_range_rule,
    one_of_rule,
    positive_rule,
    setting,
)
from mptrain.config.precision import REDUCE_DTYPES


# ----------------------------------------------------------------------------------------- recipe
@dataclass
class ExpectedResult:
    """The result a recipe's source reports, and where it was obtained."""

    metric: str = setting("final_val_accuracy", "a key of the report's evaluation section")
    value: float | None = setting(None, "the expected value of the metric")
    tolerance: float = setting(
        0.0,
        (
            "met when the run reaches at least value - tolerance (a loss or perplexity metric: at"
            " most value + tolerance)"
        ),
    )
    hardware: str = setting("", "the hardware the expected result was obtained on")
    data: str = setting("", "the data it was obtained on")


@dataclass
class RecipeData:
    """The data a recipe reproduces: what a run must train on for its verdict to mean anything.
    Checked before training (:func:`mptrain.config.recipes.check_recipe_source`: the dataset
    option and a stat of ``dataset.path``) and once read (:func:`mptrain.train.recipe.check_recipe_data`:
    the text's size and sha256, the sample counts). An empty field checks nothing."""

    dataset: str = setting("", "the dataset option it trains on")
    file: str = setting("", "dataset=text: the file's name, as its source publishes it")
    bytes: int | None = setting(None, "dataset=text: the file's size (a stat, before reading)")
    sha256: str = setting("", "dataset=text: the sha256 of its bytes (once read)")
    train_samples: int | None = setting(None, "the training split's samples")
    val_samples: int | None = setting(None, "the validation split's samples")


@dataclass
class RecipeConfig:
    name: str | None = setting(None, "the recipe's name; null when no recipe is applied")
    source: str = setting("", "where the recipe and its expected result come from")
    command: str = setting("", "the exact command that runs it")
    expected: ExpectedResult = setting(help="the result the source reports", factory=ExpectedResult)
    note: str = setting("", "how a run here relates to the source's result")
    data: RecipeData = setting(
        help="the data the recipe reproduces; an empty key checks nothing", factory=RecipeData
    )
    strict: bool = setting(
        True,
        (
            "true: other data than recipe.data is refused before training (exit 2); false: it "
            "runs, and the verdict says not comparable"
        ),
    )


# -------------------------------------------------------------------------------------------- run
# Signals a scheduler may send before pre-empting a job (SLURM --signal, LSF, PBS), which a run
# can take as "checkpoint now": not the stop signals, not ones Python or torch use themselves.
CHECKPOINT_SIGNALS = ("SIGUSR1", "SIGUSR2", "SIGALRM", "SIGXCPU")
CHECKPOINT_SIGNAL = Accepts(
    lambda v: v in CHECKPOINT_SIGNALS,
    f"null or one of {', '.join(CHECKPOINT_SIGNALS)} (SIGINT, SIGTERM and SIGHUP stop a run)",
    optional=True,
)


@dataclass
class NumericsConfig:
    """Loss-scale health limits, culprit search and per-layer FP32 overrides."""

    min_loss_scale: float = setting(
        1.0,
        "the run stops as diverged when the dynamic scale falls to this",
        accepts=positive_rule(),
    )
    warn_consecutive_backoffs: int = setting(
        5,
        "warn (once) after this many backoffs in a row without growth",
        metadata=NOT_TRAINING,
        accepts=at_least_rule(1),
    )
    warn_skip_rate: float = setting(
        0.25,
        "warn (once) when more than this share of recent steps was skipped",
        metadata=NOT_TRAINING,
        accepts=in_range_rule("(0, 1]"),
    )
    warn_window: int = setting(
        200, "steps the skip rate is measured over", metadata=NOT_TRAINING, accepts=at_least_rule(1)
    )
    max_consecutive_nonfinite_loss: int = setting(
        5, "stop as diverged after this many non-finite losses in a row", accepts=at_least_rule(1)
    )
    find_culprit: bool = setting(
        True,
        "on divergence, re-run the batch with hooks and name the first non-finite module",
        metadata=NOT_TRAINING,
    )
    fp32_modules: list[str] = setting(
        help=('module-name patterns (fnmatch) run outside autocast in FP32, e.g. ["head"]'),
        factory=list,
    )


@dataclass
class CheckpointConfig:
    enabled: bool = setting(
        True, "false: no checkpoints (a SIGINT/SIGTERM then loses the run's progress)"
    )
    every_minutes: float | None = setting(
        10.0,
        (
            "save when this many minutes passed since the last save (a kill -9 loses at most "
            "that); null = never by time"
        ),
        accepts=positive_rule(optional=True),
    )
    every_steps: int | None = setting(
        None,
        "also save every N optimizer steps; null = not by steps",
        accepts=at_least_rule(1, optional=True),
    )
    every_epoch: bool = setting(
        False, "also save at the end of every epoch (tiny epochs: mostly fsync time)"
    )
    keep_last: int = setting(
        2,
        "periodic checkpoints kept (older ones are deleted after a new one is safe)",
        accepts=at_least_rule(1),
    )
    keep_best: bool = setting(
        True, "also keep best.pt: the state with the best validation accuracy"
    )
    signal: str | None = setting(
        "SIGUSR1",
        "this signal asks for a checkpoint (SLURM: --signal=USR1@120); null = none",
        accepts=CHECKPOINT_SIGNAL,
    )
    on_signal: str = setting(
        "save",
        (
            "save: checkpoint after the current step and go on | stop: checkpoint and stop (exit "
            "128 + the signal)"
        ),
        accepts=one_of_rule(
            ("save", "stop"), "save (checkpoint and go on) or stop (checkpoint and stop)"
        ),
    )


@dataclass
class DistributedConfig:
    """Used when several ranks train: launched by torchrun, or a SLURM / submitit job of several
    tasks (mptrain.platform.launch)."""

    strategy: str = setting(
        "ddp",
        (
            "ddp: DistributedDataParallel | fsdp: FSDP2 fully_shard with the recipe's "
            "mixed-precision policy"
        ),
        accepts=one_of_rule(("ddp", "fsdp"), "ddp or fsdp"),
    )
    reduce_dtype: str = setting(
        "float32",
        "fsdp: dtype gradients are reduced in (bfloat16 reductions are known to hurt at scale)",
        accepts=one_of_rule(tuple(REDUCE_DTYPES), "float32 (default), bfloat16 or float16"),
    )
    timeout_s: float = setting(
        600.0,
        (
            "seconds a collective waits for the other ranks: when one is lost the others stop "
            "within it (the report names the lost rank)"
        ),
        accepts=positive_rule(),
    )


@dataclass
class MemoryConfig:
    """Where a run's bytes go (mptrain.train.memory) and what it keeps for the backward."""

    account: bool = setting(
        True,
        "count one training step's bytes by kind and dtype (parameters, gradients, optimizer "
        "states, scales, saved activations) on copies of the model and optimizer before "
        "training: one extra step, and memory for the copies",
        metadata=NOT_TRAINING,
    )
    activation_checkpointing: str = setting(
        "none",
        "recompute blocks in the backward instead of keeping their activations (mptrain.train"
        ".recompute): none | full (every transformer or residual block) | selective (every "
        "second one)",
        accepts=one_of_rule(("none", "full", "selective")),
    )


@dataclass
class DebugConfig:
    """Test hooks: faults on purpose (tests, checking a setup); unset in every real run."""

    inject_inf_grad_steps: list[int] = setting(
        help="test hook: optimizer steps whose gradients get an inf (exercises skipping)",
        factory=list,
        accepts=Accepts(lambda v: all(s >= 1 for s in v), "optimizer step numbers >= 1"),
    )
    inject_inf_grad_rank: int | None = setting(
        None, "distributed test hook: inject only on this rank (null = every rank)"
    )
    kill_at_step: int | None = setting(
        None,
        (
            "test hook: debug.kill_rank SIGKILLs itself after this optimizer step, on the job's "
            "first attempt only (exercises elastic restarts and lost ranks)"
        ),
        accepts=at_least_rule(1, optional=True),
    )
    kill_rank: int = setting(
        0, "debug.kill_at_step: the rank that is killed", accepts=at_least_rule(0)
    )


@dataclass
class TensorBoardConfig:
    log_dir: str | None = setting(
        None,
        "null = <run dir>/tensorboard; view with `tensorboard --logdir outputs`",
        metadata=PATH,
    )


@dataclass
class MLflowConfig:
    tracking_uri: str | None = setting(
        None,
        (
            "null = $MLFLOW_TRACKING_URI when set, else the local file store ./mlruns (in the "
            "launch directory)"
        ),
    )
    experiment_name: str = setting(
        "mptrain", "the MLflow experiment the run is logged under (created when missing)"
    )
    run_name: str | None = setting(None, "null = the run directory's name")


# logger=[...]: each experiment tracker a config may name -> the package it needs (and the extra
# that installs it, mptrain[<name>]).
LOGGERS = {"tensorboard": "tensorboard", "mlflow": "mlflow"}
