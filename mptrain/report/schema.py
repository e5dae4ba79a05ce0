"""The run report's schema and reader (writing and rendering: :mod:`mptrain.report.render`).

:class:`RunReport` declares every section as a dataclass; a run builds it once, at the end, from
explicit values (:mod:`mptrain.train.job`). report.json is its :meth:`~RunReport.to_dict` form with a
``schema_version``; readers of report.json files (sweep comparison, ``mptrain-compare``) get it
back with :func:`load_report`, where an unknown or missing key fails loudly, naming it. Reports
written before ``schema_version`` existed (the same sections) load as version 0.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mptrain.rundir.layout import REPORT_JSON

SCHEMA_VERSION = 1


# ---------------------------------------------------------------------------------------- schema
@dataclass
class PrecisionSection:
    """What was asked for and what ran (``effective`` is None when it was never resolved)."""

    requested: str
    effective: str | None = None
    label: str | None = None  # "fp8 (emulated)" where FP8 (or block-scaled) GEMMs were emulated
    emulated: bool | None = None
    autocast_dtype: str | None = None
    loss_scaling: bool | None = None
    scaler: dict[str, Any] | None = None  # enabled, init_scale, growth/backoff, growth_interval
    reason: str = "not resolved"  # the user's choice, or how auto decided
    notes: list[str] = field(default_factory=list)
    master_weights_dtype: str | None = None
    master_weights: bool | None = None
    # precision=auto timed on the model: median s/step per candidate and every step timed
    # (mptrain.train.autoprecision); None when it was not timed.
    auto_timing: dict[str, Any] | None = None
    # precision.switch (mptrain.train.switch): the step, both precisions (from = the fields above),
    # the train loss over the steps either side and the evaluations around it; None: no switch.
    switch: dict[str, Any] | None = None
    # How a pure precision's update was written into its weights (precision.update): nearest |
    # stochastic | kahan; None with FP32 master weights (and in reports written before it existed).
    update: str | None = None
    # precision.gemms (mptrain.precision.gemm_plans): the format of each GEMM of the converted
    # Linear layers (forward, input_grad, weight_grad) and the layer patterns it applies to
    # (layers: "*" for all); None for the precision's own recipe.
    gemms: dict[str, str] | None = None

    def what_ran(self) -> str | None:
        """The precision as a comparison of runs names it: ``label`` (``effective`` without one;
        None when it was never resolved); with per-GEMM formats, each GEMM's (forward / input
        gradient / weight gradient: ``fp8 (emulated), GEMMs fp8 tensorwise / fp8 tensorwise /
        bf16``); with a precision switch, also the precision it switched to and after which step,
        as the report words it: ``fp8 (emulated) -> bf16 after step 17``, or ``... (not
        reached)`` when the run ended first. So a switched run never passes for a run of its
        first precision alone, nor a per-GEMM plan for the precision's own recipe."""
        first, switch = self.label or self.effective, self.switch
        if first is not None and self.gemms:  # per-GEMM formats: all three, in GEMM order
            formats = [fmt for gemm, fmt in self.gemms.items() if gemm != "layers"]
            first += f", GEMMs {' / '.join(formats)}"
            if self.gemms.get("layers", "*") != "*":
                first += f" ({self.gemms['layers']})"
        if first is None or switch is None:
            return first
        after = switch["switched_after_step"]
        words = f"{first} -> {switch['to_label']} after step "
        return words + (f"{switch['step']} (not reached)" if after is None else str(after))


@dataclass
class OptimizerSection:
    name: str
    implementation: str | None  # fused | foreach | single-tensor
    # the dtypes its state is stored in, step counters aside (float32; bfloat16 under
    # optimizer.state_dtype=bf16; uint8 and float32 for torchao's adamw8bit codes and scales)
    state_dtypes: list[str] | None = None


@dataclass
class ModelSection:
    name: str
    parameters: int | None
    channels_last: bool
    compile: bool
    # With compile=true: graphs TorchDynamo compiled and graph breaks it hit during the run
    # (training and evaluation forwards); None without compile.
    compiled_graphs: int | None = None
    graph_breaks: int | None = None
    # What was built (mptrain.models.build.ModelFacts); None in reports written before these existed,
    # or when the run stopped before the model was built.
    source: str | None = None  # builtin | torchvision | timm | custom
    arch: str | None = None  # torchvision/timm model name, or the custom model._target_
    class_name: str | None = None  # module.qualname of the built nn.Module
    adaptations: list[str] | None = None  # e.g. "conv1 (Conv2d) replaced for 1 input channel"
    convolutional: bool | None = None  # has Conv layers (FP16 convolutions crawl on CPUs)


@dataclass
class DataSection:
    description: str
    feed: str | None
    num_train: int | None
    num_val: int | None
    batch_size: int
    grad_accum_steps: int
    effective_batch_size: int
    # dataset.skip_bad_files=true: samples dropped because their file did not decode, counted each
    # time one was read (every epoch and evaluation)
    skipped_bad_files: int | None = None
    # File-backed feeds (imagefolder): what decoded the images (decode_device, decoder, draft,
    # persistent_workers, normalised_on; device decoding: host_decoded). None: in-memory data.
    pipeline: dict[str, Any] | None = None
    # dataset=text: the corpus read (source, files, bytes, file-list digest), vocabulary, window
    # length, train/validation tokens and the unigram baseline (see mptrain.data.text.TextFacts)
    text: dict[str, Any] | None = None


@dataclass
class TrainingSection:
    steps: int
    total_steps: int | None
    steps_per_epoch: int | None
    epochs_completed: int
    samples_seen: int
    skipped_steps: dict[str, Any]  # {"count": n, "steps": [...]}
    loss_scale: dict[str, Any] | None  # initial, final, min, max, backoffs, growths, changes
    final_train_loss: float | None
    clip_grad_norm: float | None
    # Averages over the probes taken every probe_every steps.
    zero_grad_fraction: float | None
    updates_lost_fraction: float | None
    # Which limit sets the run's length: "max_steps=2000", "15 epochs", "max_steps=400, before
    # 15 epochs"; None in reports written before it existed or of a run that failed first.
    length: str | None = None
    # Per optimizer state (exp_avg, exp_avg_sq, ...): the share of elements with a non-zero
    # gradient whose stored state a probed step left unchanged; None without probes.
    states_lost_fraction: dict[str, float] | None = None


@dataclass
class NumericsSection:
    nonfinite_loss_steps: dict[str, Any] | None = None  # {"count": n, "steps": first 100}
    warnings: list[dict[str, Any]] | None = None
    min_loss_scale: float | None = None
    culprit: dict[str, Any] | None = None  # the first module with a non-finite value
    fp32_modules: list[str] = field(default_factory=list)


@dataclass
class EvaluationSection:
    """The evaluations; "best" is the one with the best primary metric (the task's: validation
    accuracy for classification, validation loss for language models). Accuracy and loss are per
    prediction: per sample, or per token for language models."""

    final_val_accuracy: float | None
    final_val_loss: float | None
    best_val_accuracy: float | None
    best_step: int | None
    history: list[dict[str, Any]]
    task: str = "classify"
    primary_metric: str = "val_accuracy"
    best_val_loss: float | None = None
    final_val_perplexity: float | None = None  # lm: exp(final_val_loss)
    best_val_perplexity: float | None = None
    # lm: the loss of a unigram model of the training tokens on the validation tokens (nats per
    # token): what a model that ignores context scores. Below it, the model learned from context.
    baseline_val_loss: float | None = None


@dataclass
class ThroughputSection:
    samples_per_s: float | None
    measured_steps: int
    measured_time_s: float
    warmup_steps: int
    data_wait_fraction: float | None
    excludes: str = "warm-up steps and evaluation"
    comparable: bool = True  # False for emulated FP8: its speed says nothing about FP8 hardware
    tokens_per_s: float | None = None  # language models: samples/s x the window length
    # Per log_every window measured whole after warm-up (evaluation excluded): its samples/s and
    # steps, the spread behind sweep speed ratios. None in reports written before these existed.
    window_samples_per_s: list[float] | None = None
    window_steps: list[int] | None = None
    # Model FLOPs utilisation on a GPU of mptrain.perf.gpus' table: model FLOP/s over the
    # FLOP-weighted peak of the formats the GEMMs ran in (FP8 and BF16 mixed: still defined);
    # None with mfu_note saying why (a CPU: n/a). None in reports written before it existed.
    mfu: float | None = None
    mixed_peak_tflops: float | None = None
    mfu_note: str | None = None


@dataclass
class TimeSection:
    """Where the job's wall time went, in seconds; ``other_s`` is the rest of ``wall_time_s``:
    start-up, data loading, model building, diagnostics."""

    training_s: float  # the loop's steps, warm-up included
    evaluation_s: float
    evaluations: int
    checkpoint_s: float  # writes, the final one included
    checkpoints: int
    other_s: float
    # The estimate of the loop's time made once while training, beside the actual loop time
    # (mptrain.pace.estimate.RunEstimate.record); None when the run stopped before it was made,
    # and in reports written before it existed.
    estimate: dict[str, Any] | None = None

    @property
    def non_training_share(self) -> float | None:
        """Evaluations and checkpoints as a share of the loop's time (what cadences change)."""
        loop = self.training_s + self.evaluation_s + self.checkpoint_s
        return (self.evaluation_s + self.checkpoint_s) / loop if loop > 0 else None


@dataclass
class ThreadsSection:
    """Intra-op CPU threads (the ``threads`` key): what was asked, what ran, what was measured."""

    requested: str  # auto | the pinned count
    threads: int  # the count at the end of the run
    initial: int  # the count the run started with (see basis)
    mode: str  # auto (measured on training steps) | auto, not measured (why: basis) | pinned
    basis: str  # how the starting count was chosen: affinity, cgroup quota, jobs, workers
    # threads=auto on a CPU: each measurement of the candidates on real training steps
    # ({step, why, steps_per_s: {count: ..}, steps: {count: ..}, chose}) and every change of the
    # count ({step, from, to, why}).
    measurements: list[dict[str, Any]] = field(default_factory=list)
    changes: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class MemorySection:
    peak_bytes: int | None
    kind: str | None  # what the peak measures (CUDA allocator, process RSS, ...)
    # One training step's bytes by kind and dtype (mptrain.train.memory.account_step): "bytes"
    # {kind: {dtype: bytes}}, "total" {kind: bytes}, "total_bytes"; None: not counted
    # (memory.account=false, or a report written before it existed).
    accounted: dict[str, Any] | None = None


@dataclass
class CheckpointsSection:
    directory: str
    kept: list[str]
    latest: str | None
    best: str | None


@dataclass
class RecipeSection:
    """A reference recipe's expected result, the run's figure and the verdict."""

    name: str
    source: str
    command: str
    expected: dict[str, Any]  # metric, value, tolerance, hardware, data
    actual: float | None
    note: str
    verdict: str  # met | not met | not comparable: why
    met: bool | None  # None when not comparable


@dataclass
class RunReport:
    """report.json's schema: one dataclass per section, in the file's order."""

    status: str  # completed | diverged | failed | interrupted
    reason: str | None
    output_dir: str
    started_at: str
    finished_at: str
    wall_time_s: float
    precision: PrecisionSection
    tf32: dict[str, Any] | None
    fp8: dict[str, Any] | None
    hardware: dict[str, Any]
    versions: dict[str, Any]
    seed: int
    optimizer: OptimizerSection
    model: ModelSection
    data: DataSection
    training: TrainingSection
    numerics: NumericsSection
    evaluation: EvaluationSection
    throughput: ThroughputSection
    memory: MemorySection
    distributed: dict[str, Any]
    resumed: dict[str, Any] | None
    checkpoints: CheckpointsSection | None
    recipe: RecipeSection | None
    config: dict[str, Any]  # the resolved config (dataclasses.asdict of the RunConfig)
    time: TimeSection | None = None  # None in reports written before it existed
    threads: ThreadsSection | None = None  # None in reports written before it existed
    # The block-scaled formats (mxfp8, nvfp4, blockwise fp8): formats, layers, counts
    # (mptrain.report.rows); None for other precisions and in reports written before it existed.
    blocks: dict[str, Any] | None = None
    figure: str | None = None  # curves.png, once written
    schema_version: int = SCHEMA_VERSION

    def to_dict(self) -> dict[str, Any]:
        """report.json's content (non-finite floats are made strict JSON when written); ``figure``
        only once there is one."""
        content = dataclasses.asdict(self)
        if content["figure"] is None:
            del content["figure"]
        return content


class ReportError(ValueError):
    """A report.json that does not match this mptrain's schema; the message names the key."""


def load_report(path: str | Path) -> RunReport:
    """A run's report: ``path`` (str or Path) is a report.json written by :func:`write_report` or
    the run directory holding one. FileNotFoundError naming the path when there is none there;
    ReportError naming the file when it is not a report of this schema (not JSON, an unknown or
    missing key, another ``schema_version``)."""
    path = Path(path)
    if path.is_dir():
        if not (path / REPORT_JSON).is_file():
            raise FileNotFoundError(
                f"{path}: no {REPORT_JSON} in this directory; give a run directory (a run writes "
                f"{REPORT_JSON} when it ends) or a {REPORT_JSON} file"
            )
        path = path / REPORT_JSON
    elif not path.is_file():
        raise FileNotFoundError(
            f"{path}: no such file or directory; give a run directory or its {REPORT_JSON}"
        )
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise ReportError(f"{path}: not JSON ({exc})") from None
    except RecursionError:  # json's decoder recurses once per nesting level
        raise ReportError(f"{path}: nested too deeply to be a report") from None
    if not isinstance(data, dict):
        raise ReportError(f"{path}: not a JSON object (a {type(data).__name__}); not a report")
    version = data.setdefault("schema_version", 0)  # 0: written before the field existed
    if version not in (0, SCHEMA_VERSION):
        raise ReportError(
            f"{path}: schema_version {version!r}, this mptrain reads {SCHEMA_VERSION}"
        )
    return _from_dict(RunReport, data, str(path))


def _from_dict(cls: type, data: dict[str, Any], where: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ReportError(f"{where}: unknown key {unknown[0]!r} in {cls.__name__}")
    values = {}
    for name, value in data.items():
        section = _section_type(hints[name])
        nested = section is not None and isinstance(value, dict)
        values[name] = _from_dict(section, value, f"{where}: {name}") if nested else value
    try:
        return cls(**values)
    except TypeError as exc:  # a missing key
        raise ReportError(f"{where}: {exc}") from exc


def _section_type(hint: Any) -> type | None:
    """The dataclass a field holds (``X`` or ``X | None``), or None for plain values."""
    candidates = typing.get_args(hint) or (hint,)
    return next((c for c in candidates if dataclasses.is_dataclass(c)), None)
