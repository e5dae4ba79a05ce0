"""The run report: its schema, report.json (for machines), report.md (for people), the summary.

:class:`RunReport` declares every section as a dataclass; a run builds it once, at the end, from
explicit values (:mod:`mptrain.train.job`). report.json is its :meth:`~RunReport.to_dict` form with a
``schema_version``; readers of report.json files (sweep comparison, ``mptrain-compare``) get it
back with :func:`load_report`, where an unknown or missing key fails loudly, naming it. Reports
written before ``schema_version`` existed (the same sections) load as version 0.

Both files are written atomically (temporary file in the same directory, fsync, rename), so a
reader never sees half a report, and a report from an earlier write survives a failed one.
"""

from __future__ import annotations

import dataclasses
import json
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from mptrain.rundir.fileio import atomic_write_text, clean_json
from mptrain.rundir.layout import FAILURE_JSON, METRICS_JSONL, REPORT_JSON, REPORT_MD

SCHEMA_VERSION = 1


# ---------------------------------------------------------------------------------------- schema
@dataclass
class PrecisionSection:
    """What was asked for and what ran (``effective`` is None when it was never resolved)."""

    requested: str
    effective: str | None = None
    label: str | None = None  # "fp8 (emulated)" where FP8 GEMMs were emulated
    emulated: bool | None = None
    autocast_dtype: str | None = None
    loss_scaling: bool | None = None
    scaler: dict[str, Any] | None = None  # enabled, init_scale, growth/backoff, growth_interval
    reason: str = "not resolved"  # the user's choice, or how auto decided
    notes: list[str] = field(default_factory=list)
    master_weights_dtype: str | None = None
    master_weights: bool | None = None


@dataclass
class OptimizerSection:
    name: str
    implementation: str | None  # fused | foreach | single-tensor


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

    @property
    def non_training_share(self) -> float | None:
        """Evaluations and checkpoints as a share of the loop's time (what cadences change)."""
        loop = self.training_s + self.evaluation_s + self.checkpoint_s
        return (self.evaluation_s + self.checkpoint_s) / loop if loop > 0 else None


@dataclass
class MemorySection:
    peak_bytes: int | None
    kind: str | None  # what the peak measures (CUDA allocator, process RSS, ...)


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


def _model_words(model: ModelSection) -> str:
    """``custom tiny_net.TinyNet`` / ``torchvision resnet34 (conv1 ... replaced ...)`` / ``cnn``."""
    words = model.name if model.arch is None else f"{model.name} {model.arch}"
    return f"{words} ({'; '.join(model.adaptations)})" if model.adaptations else words


def load_report(path: Path) -> RunReport:
    """Read a report.json written by :func:`write_report`; raise ReportError naming a bad key."""
    data = json.loads(path.read_text(encoding="utf-8"))
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


# ------------------------------------------------------------------------------------ writing
def write_report(output_dir: Path, report: RunReport) -> tuple[Path, Path]:
    json_path, md_path = output_dir / REPORT_JSON, output_dir / REPORT_MD
    atomic_write_text(json_path, json.dumps(clean_json(report.to_dict()), indent=2) + "\n")
    atomic_write_text(md_path, render_markdown(report))
    return json_path, md_path


def write_failure(output_dir: Path, reason: str) -> Path:
    """failure.json for a job that stopped before training (bad input found at run time)."""
    output_dir.mkdir(parents=True, exist_ok=True)
    path = output_dir / FAILURE_JSON
    atomic_write_text(path, json.dumps({"status": "failed", "reason": reason}, indent=2) + "\n")
    return path


# ------------------------------------------------------------------------------------ formatting
def fmt_bytes(n: int | None) -> str:
    if n is None:
        return "n/a"
    if abs(n) < 1024:
        return f"{n} B"
    for unit in ("KiB", "MiB"):
        n /= 1024
        if abs(n) < 1024:
            return f"{n:.1f} {unit}"
    return f"{n / 1024:.1f} GiB"


def fmt_pct(x: float | None) -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{100 * x:.2f}%"


def fmt_num(x: float | None, spec: str = ".4g") -> str:
    return "n/a" if x is None else format(x, spec)


def _skipped_text(training: TrainingSection) -> str:
    skipped = training.skipped_steps
    if not skipped["count"]:
        return "0"
    steps = ", ".join(map(str, skipped["steps"][:20]))
    more = " …" if skipped["count"] > 20 else ""
    return f"{skipped['count']} (steps {steps}{more})"


def _scale_text(scale: dict[str, Any] | None) -> str:
    if scale is None:
        return "off"
    return (
        f"initial {scale['initial']:g}, final {scale['final']:g}, min {scale['min']:g}, "
        f"max {scale['max']:g}, {scale['backoffs']} backoffs, {scale['growths']} growths"
    )


def _precision_text(p: PrecisionSection) -> str:
    label = p.label or p.effective
    ran = label if p.requested == p.effective else f"{label} (requested {p.requested})"
    scaling = "on" if p.loss_scaling else "off"
    return f"{ran}; autocast {p.autocast_dtype or 'none'}; loss scaling {scaling}"


def _corpus_rows(text: dict[str, Any] | None) -> list[tuple[str, str]]:
    """A language model's corpus in one row: where from, which files, and the list's digest."""
    if text is None:
        return []
    files = f"{text['files']} files ({text['first_file']} … {text['last_file']})"
    return [
        (
            "text",
            f"{text['source']}: {files}, {text['bytes']:,} bytes, list sha256 "
            f"{text['file_list_sha256'][:12]}; {text['vocabulary']} vocabulary of "
            f"{text['vocab_size']}",
        )
    ]


def _tokens_text(thr: ThroughputSection) -> str:
    return "" if thr.tokens_per_s is None else f" = {thr.tokens_per_s:,.0f} tokens/s"


def _evaluation_rows(e: EvaluationSection) -> list[tuple[str, str]]:
    if e.task != "lm":
        return [
            ("final val accuracy", fmt_pct(e.final_val_accuracy)),
            ("best val accuracy", f"{fmt_pct(e.best_val_accuracy)} (step {e.best_step})"),
            ("final val loss", fmt_num(e.final_val_loss)),
        ]
    return [
        (
            "final val loss",
            f"{fmt_num(e.final_val_loss)} (perplexity {fmt_num(e.final_val_perplexity, '.2f')})",
        ),
        ("best val loss", f"{fmt_num(e.best_val_loss)} (step {e.best_step})"),
        ("unigram baseline", _baseline_text(e)),
        ("next-token accuracy", fmt_pct(e.final_val_accuracy)),
    ]


def _evaluation_table(evals: list[dict[str, Any]], task: str) -> list[str]:
    """report.md's table of evaluations (language models: perplexity, per-token accuracy)."""
    if task != "lm":
        head = ["| step | epoch | val loss | val accuracy |", "|---:|---:|---:|---:|"]
        return head + [
            f"| {e['step']} | {e['epoch']} | {fmt_num(e['val_loss'])} | "
            f"{fmt_pct(e['val_accuracy'])} |"
            for e in evals
        ]
    head = [
        "| step | epoch | val loss | val perplexity | next-token accuracy |",
        "|---:|---:|---:|---:|---:|",
    ]
    return head + [
        f"| {e['step']} | {e['epoch']} | {fmt_num(e['val_loss'])} | "
        f"{fmt_num(e.get('val_perplexity'), '.2f')} | {fmt_pct(e['val_accuracy'])} |"
        for e in evals
    ]


def _baseline_text(e: EvaluationSection) -> str:
    """How the final validation loss compares with the unigram baseline, in words."""
    if e.baseline_val_loss is None:
        return "—"
    words = f"{fmt_num(e.baseline_val_loss)} nats/token"
    if e.final_val_loss is None or math.isnan(e.final_val_loss):
        return words
    gap = e.baseline_val_loss - e.final_val_loss
    side = "below" if gap > 0 else "NOT below"
    return (
        f"{words}; final val loss {abs(gap):.3f} {side} it ({abs(gap) / e.baseline_val_loss:.0%})"
    )


def summary_rows(report: RunReport) -> list[tuple[str, str]]:
    """The key figures, in the order the terminal summary and report.md show them."""
    p, t, e = report.precision, report.training, report.evaluation
    thr, mem = report.throughput, report.memory
    rows = [
        ("status", report.status + (f": {report.reason}" if report.reason else "")),
        ("precision", _precision_text(p)),
        ("precision choice", p.reason),
        ("device", report.hardware["device"]),
        ("model / data", f"{_model_words(report.model)} / {report.data.description}"),
        *_corpus_rows(report.data.text),
        *_fp8_rows(report.fp8),
        *_compile_rows(report.model),
        ("steps", f"{t.steps} of {t.total_steps} ({t.epochs_completed} epochs)"),
        ("skipped steps", _skipped_text(t)),
        ("loss scale", _scale_text(t.loss_scale)),
        *_evaluation_rows(e),
        ("final train loss", fmt_num(t.final_train_loss)),
        (
            "throughput",
            f"{fmt_num(thr.samples_per_s, '.1f')} samples/s{_tokens_text(thr)} "
            f"({thr.measured_steps} steps after {thr.warmup_steps} warm-up, eval excluded)",
        ),
        ("data wait", fmt_pct(thr.data_wait_fraction)),
        ("peak memory", f"{fmt_bytes(mem.peak_bytes)} ({mem.kind})"),
        ("wall time", f"{report.wall_time_s:.1f} s"),
    ]
    if report.time:
        rows.append(("time", _time_text(report.time)))
    if report.recipe:
        r, exp = report.recipe, report.recipe.expected
        rows.append(
            (
                "recipe",
                f"{r.name}: expected {exp['metric']} {exp['value']} ± "
                f"{exp['tolerance']}, got {fmt_num(r.actual)}: {r.verdict}",
            )
        )
    if t.zero_grad_fraction is not None:
        rows.append(
            (
                "gradient probes",
                f"zero gradients {fmt_pct(t.zero_grad_fraction)}, updates lost "
                f"to rounding {fmt_pct(t.updates_lost_fraction)} (averages of probes every probe_every steps)",
            )
        )
    rows += [("note", n) for n in p.notes]
    return rows


def _fp8_rows(fp8: dict[str, Any] | None) -> list[tuple[str, str]]:
    """What the FP8 recipe was: scaling, formats, the layers it converted."""
    if fp8 is None:
        return []
    layers = fp8["layers"]
    converted = sum(layer["converted"] for layer in layers)
    pow2 = ", power-of-two scales" if fp8.get("pow2_scales") else ""
    return [
        (
            "fp8",
            f"{fp8['scaling']} {fp8.get('granularity', 'tensorwise')} scaling{pow2}, "
            f"{fp8['forward_dtype']}/{fp8['backward_dtype']}, {fp8['gemm']}; {converted} of "
            f"{len(layers)} Linear layers ({fmt_pct(fp8['converted_linear_flops_share'])} of "
            "their FLOPs)",
        )
    ]


def _compile_rows(model: ModelSection) -> list[tuple[str, str]]:
    if model.compiled_graphs is None:
        return []
    return [("compile", f"{model.compiled_graphs} graphs, {model.graph_breaks} graph breaks")]


def _time_text(t: TimeSection) -> str:
    return (
        f"training {t.training_s:.1f} s, evaluation {t.evaluation_s:.1f} s ({t.evaluations}×), "
        f"checkpoints {t.checkpoint_s:.1f} s ({t.checkpoints}×): "
        f"{fmt_pct(t.non_training_share)} of the loop; other {t.other_s:.1f} s"
    )


def _hardware_lines(hw: dict[str, Any]) -> list[str]:
    cpu, gpu = hw["cpu"], hw.get("gpu")
    lines = [
        f"- CPU: {cpu['model']}, {cpu['logical_cores']} logical cores, torch threads "
        f"{cpu['torch_threads']}, capability {cpu['torch_cpu_capability']}; native BF16: "
        f"{cpu['native_bf16']} (AVX512-BF16 {cpu['avx512_bf16']}, AMX-BF16 {cpu['amx_bf16']}), "
        f"AVX512-FP16 {cpu['avx512_fp16']}",
    ]
    if gpu:
        lines.append(
            f"- GPU: {gpu['name']} (compute capability {gpu['compute_capability']}, "
            f"{fmt_bytes(gpu['memory_bytes'])}, driver {gpu['driver']}, {gpu['count']} visible)"
        )
    else:
        lines.append("- GPU: none used")
    return lines


def render_markdown(report: RunReport) -> str:
    v, hw = report.versions, report.hardware
    lines = [
        f"# mptrain run report — {report.status}",
        "",
        f"Run directory: `{report.output_dir}`  ",
        f"Started {report.started_at}, finished {report.finished_at}.",
        "",
        "## Summary",
        "",
        "| | |",
        "|---|---|",
    ]
    lines += [f"| {k} | {str(val).replace('|', '/')} |" for k, val in summary_rows(report)]
    lines += ["", "## Hardware", "", *_hardware_lines(hw)]
    lines += [f"- TF32: {json.dumps(report.tf32)}", "", "## Software", ""]
    lines += [f"- {k}: {val}" for k, val in v.items()]
    evals = report.evaluation.history
    if evals:
        lines += [
            "",
            "## Evaluations",
            "",
            *_evaluation_table(evals, report.evaluation.task),
        ]
    if report.figure:
        lines += [
            "",
            "## Curves",
            "",
            f"![training loss, validation accuracy, loss scale]({report.figure})",
        ]
    lines += [
        "",
        "## Files",
        "",
        f"- `{REPORT_JSON}`: every figure above, machine-readable, with the resolved config",
        f"- `{METRICS_JSONL}`: a row per logged step and per evaluation",
        "",
    ]
    return "\n".join(lines)


def print_summary(console: Console, report: RunReport, report_path: Path) -> None:
    table = Table(title=f"mptrain — {report.status}", show_header=False, box=None)
    table.add_column(style="bold")
    table.add_column()
    for key, value in summary_rows(report):
        table.add_row(key, escape(value))  # values are text, never rich markup
    table.add_row("report", escape(str(report_path)))
    console.print(table)
