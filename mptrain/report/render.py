"""The report written and shown: report.json (strict JSON) and report.md in the run directory,
failure.json for a job stopped before training, and the terminal summary (the number formats
every table uses, ``fmt_*`` and ``plural``: :mod:`mptrain.report.rows`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from mptrain.pace.estimate import rough_duration
from mptrain.platform.contention import busy_words
from mptrain.report.rows import (
    blocks_lines,
    blocks_rows,
    fmt_bytes,
    fmt_num,
    fmt_pct,
    memory_rows,
    plural,
    switch_rows,
)
from mptrain.report.schema import (
    EvaluationSection,
    ModelSection,
    PrecisionSection,
    RunReport,
    ThreadsSection,
    ThroughputSection,
    TimeSection,
    TrainingSection,
)
from mptrain.rundir.fileio import atomic_write_text, clean_json
from mptrain.rundir.layout import FAILURE_JSON, METRICS_JSONL, REPORT_JSON, REPORT_MD


# ------------------------------------------------------------------------------------ writing
def write_report(output_dir: Path, report: RunReport) -> tuple[Path, Path]:
    """report.json and report.md, each written atomically: a reader never sees half a report, and
    a report from an earlier write survives a failed one."""
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


# ------------------------------------------------------------------------------------ rows
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
        f"max {scale['max']:g}, {plural(scale['backoffs'], 'backoff')}, "
        f"{plural(scale['growths'], 'growth')}"
    )


def _precision_text(p: PrecisionSection) -> str:
    label = p.label or p.effective
    ran = label if p.requested == p.effective else f"{label} (requested {p.requested})"
    scaling = "on" if p.loss_scaling else "off"
    update = f"; weight updates {_UPDATE_WORDS[p.update]}" if p.update in _UPDATE_WORDS else ""
    return f"{ran}; autocast {p.autocast_dtype or 'none'}; loss scaling {scaling}{update}"


def _gemm_rows(gemms: dict[str, str] | None) -> list[tuple[str, str]]:
    """precision.gemms: the format each GEMM of the converted layers ran in."""
    if not gemms:
        return []
    formats = ", ".join(f"{gemm} {fmt}" for gemm, fmt in gemms.items() if gemm != "layers")
    layers = gemms.get("layers", "*")
    return [("GEMMs", formats + ("" if layers == "*" else f" (layers {layers})"))]


# precision.update of a pure precision, for people (report.precision.update)
_UPDATE_WORDS = {
    "nearest": "rounded to nearest",
    "stochastic": "rounded stochastically",
    "kahan": "Kahan-compensated",
}


def _corpus_rows(text: dict[str, Any] | None) -> list[tuple[str, str]]:
    """A language model's corpus in one row: where from, which files, and the list's digest."""
    if text is None:
        return []
    files = f"{plural(text['files'], 'file')} ({text['first_file']} … {text['last_file']})"
    return [
        (
            "text",
            f"{text['source']}: {files}, {text['bytes']:,} bytes, list sha256 "
            f"{text['file_list_sha256'][:12]}; {text['vocabulary']} vocabulary of "
            f"{text['vocab_size']}",
        )
    ]


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
    lm = task == "lm"
    columns = ["step", "epoch", "val loss", *(["val perplexity"] if lm else [])]
    columns.append("next-token accuracy" if lm else "val accuracy")
    lines = ["| " + " | ".join(columns) + " |", "|" + "---:|" * len(columns)]
    for e in evals:
        perplexity = f"{fmt_num(e.get('val_perplexity'), '.2f')} | " if lm else ""
        lines.append(
            f"| {e['step']} | {e['epoch']} | {fmt_num(e['val_loss'])} | {perplexity}"
            f"{fmt_pct(e['val_accuracy'])} |"
        )
    return lines


def _baseline_text(e: EvaluationSection) -> str:
    """How the final validation loss compares with the unigram baseline, in words."""
    if e.baseline_val_loss is None:
        return "—"
    words = f"{fmt_num(e.baseline_val_loss)} nats/token"
    if e.final_val_loss is None or math.isnan(e.final_val_loss):
        return words
    gap = e.baseline_val_loss - e.final_val_loss
    side = "below" if gap > 0 else "above"  # above: the model predicts worse than letter counts
    share = abs(gap) / e.baseline_val_loss
    return f"{words}; final val loss {e.final_val_loss:.3f}, {abs(gap):.3f} {side} it ({share:.0%})"


def _model_words(model: ModelSection) -> str:
    """``custom tiny_net.TinyNet`` / ``torchvision resnet34 (conv1 ... replaced ...)`` / ``cnn``."""
    words = model.name if model.arch is None else f"{model.name} {model.arch}"
    return f"{words} ({'; '.join(model.adaptations)})" if model.adaptations else words


def summary_rows(report: RunReport) -> list[tuple[str, str]]:
    """The key figures, in the order the terminal summary and report.md show them. A figure the
    run never reached is left out, not shown as n/a: a run that failed before its first step has
    what it was (status, precision, device, model and data) and ``steps 0``; the training rows
    come with its first step, the evaluation rows with its first evaluation."""
    p, t = report.precision, report.training
    rows = [
        ("status", report.status + (f": {report.reason}" if report.reason else "")),
        ("precision", _precision_text(p)),
        ("precision choice", p.reason),
        *_gemm_rows(p.gemms),
        *switch_rows(p.switch),
        ("device", report.hardware["device"]),
        *_threads_rows(report.threads),
        *_distributed_rows(report.distributed),
        ("model / data", f"{_model_words(report.model)} / {report.data.description}"),
        *_resumed_rows(report.resumed),
        *_fp32_module_rows(report.numerics.fp32_modules),
        *_corpus_rows(report.data.text),
        *_fp8_rows(report.fp8),
        *blocks_rows(report.blocks),
        *_compile_rows(report.model),
        ("steps", _steps_text(t)),
    ]
    if t.steps > 0:
        rows += [("skipped steps", _skipped_text(t)), ("loss scale", _scale_text(t.loss_scale))]
    if report.evaluation.history:
        rows += _evaluation_rows(report.evaluation)
    if t.final_train_loss is not None:
        rows.append(("final train loss", fmt_num(t.final_train_loss)))
    if t.steps > 0:
        rows += _speed_rows(report.throughput) + _busy_rows(report.hardware)
    if report.memory.peak_bytes is not None:
        rows.append(
            ("peak memory", f"{fmt_bytes(report.memory.peak_bytes)} ({report.memory.kind})")
        )
    rows += memory_rows(report.memory)
    rows.append(("wall time", f"{report.wall_time_s:.1f} s"))
    return rows + _closing_rows(report)


def _resumed_rows(resumed: dict[str, Any] | None) -> list[tuple[str, str]]:
    """``resumed  from PATH at step N; ...``: the run continued a checkpoint (and what the resume
    noted), or resume=auto found nothing and started fresh."""
    if not resumed:
        return []
    if resumed.get("from") is None:
        return [("resumed", resumed.get("note") or "no checkpoint found: started fresh")]
    notes = resumed.get("notes") or []
    changes = resumed.get("allowed_differences") or []
    text = f"from {resumed['from']} at step {resumed['step']}"
    text += f"; allowed changes: {', '.join(map(str, changes))}" if changes else ""
    return [("resumed", text + "".join(f"; {note}" for note in notes))]


def _fp32_module_rows(modules: list[str]) -> list[tuple[str, str]]:
    return [("fp32 modules", ", ".join(modules))] if modules else []


def _steps_text(t: TrainingSection) -> str:
    """``30 of 300 (1 epoch; length: 15 epochs)``; without a known total (a run that failed
    before it was worked out) just the steps taken."""
    of = "" if t.total_steps is None else f" of {t.total_steps}"
    # The length is said where max_steps set it (an epoch count speaks for itself).
    length = f"; length: {t.length}" if t.length and "max_steps" in t.length else ""
    return f"{t.steps}{of} ({plural(t.epochs_completed, 'epoch')}{length})"


def _speed_rows(thr: ThroughputSection) -> list[tuple[str, str]]:
    measured = f"{plural(thr.measured_steps, 'step')} after {thr.warmup_steps} warm-up"
    tokens = "" if thr.tokens_per_s is None else f" = {thr.tokens_per_s:,.0f} tokens/s"
    rows = [
        (
            "throughput",
            f"{fmt_num(thr.samples_per_s, '.1f')} samples/s{tokens} ({measured}, eval excluded)",
        )
    ]
    if thr.data_wait_fraction is not None:
        rows.append(("data wait", fmt_pct(thr.data_wait_fraction)))
    if thr.mfu is not None:
        peak = f"{thr.mixed_peak_tflops:,.0f} TFLOP/s"
        rows.append(("MFU", f"{fmt_pct(thr.mfu)} of {peak} ({thr.mfu_note})"))
    elif thr.mfu_note is not None:
        rows.append(("MFU", thr.mfu_note))
    return rows


def _busy_rows(hw: dict[str, Any]) -> list[tuple[str, str]]:
    """A row when others' work competed for the cores: the speed above is a busy machine's."""
    busy = busy_words(hw.get("machine_load"))
    return [] if busy is None else [("machine", f"{busy}: the speed figures are a busy machine's")]


def _distributed_rows(distributed: dict[str, Any]) -> list[tuple[str, str]]:
    """One row for a run of several processes (a single process says nothing here)."""
    if distributed.get("world_size", 1) <= 1:
        return []
    return [("distributed", _distributed_text(distributed))]


def _distributed_text(d: dict[str, Any]) -> str:
    """``4 processes, backend nccl, strategy fsdp, gradients reduced in float32``, or ``no
    (1 process)``."""
    size = d.get("world_size", 1)
    if size <= 1:
        return "no (1 process)"
    words = (
        f"{plural(size, 'process', 'processes')}, backend {d['backend']}, strategy {d['strategy']}"
    )
    if d.get("strategy") == "fsdp":  # what distributed.reduce_dtype sets
        words += f", gradients reduced in {d['reduce_dtype']}"
    return words


def _closing_rows(report: RunReport) -> list[tuple[str, str]]:
    """Where the time went, the recipe's verdict, the gradient probes and the precision's notes."""
    t, rows = report.training, []
    if report.time:
        rows.append(("time", _time_text(report.time)))
        if report.time.estimate:
            rows.append(("estimate", _estimate_text(report.time.estimate)))
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
    if t.states_lost_fraction:
        lost = ", ".join(f"{name} {fmt_pct(v)}" for name, v in t.states_lost_fraction.items())
        rows.append(("optimizer states", f"updates lost to rounding: {lost}"))
    return rows + [("note", n) for n in report.precision.notes]


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
    graphs = plural(model.compiled_graphs, "graph")
    return [("compile", f"{graphs}, {plural(model.graph_breaks, 'graph break')}")]


def _threads_rows(t: ThreadsSection | None) -> list[tuple[str, str]]:
    """One row: the count at the end, how it was chosen, what was measured and changed."""
    if t is None:
        return []
    if t.mode != "auto":
        return [("threads", f"{t.threads} ({t.mode}: {t.basis})")]
    measured = [
        f"step {m['step']}: "
        + ", ".join(f"{c} -> {v:.3g}" for c, v in m["steps_per_s"].items())
        + " steps/s"
        for m in t.measurements
    ]
    changes = [f"{c['from']} -> {c['to']} at step {c['step']}" for c in t.changes]
    words = [f"auto, started at {t.initial} ({t.basis})"]
    if measured:
        words.append(f"measured {'; '.join(measured)}")
    else:  # one thread has nothing fewer to try; else the run ended before its measuring steps
        words.append(
            "nothing fewer to measure" if t.initial == 1 else "not measured: too few steps"
        )
    words += [f"changed {', '.join(changes)}"] if changes else []
    return [("threads", f"{t.threads} ({'; '.join(words)})")]


def _time_text(t: TimeSection) -> str:
    return (
        f"training {t.training_s:.1f} s, evaluation {t.evaluation_s:.1f} s ({t.evaluations}×), "
        f"checkpoints {t.checkpoint_s:.1f} s ({t.checkpoints}×): "
        f"{fmt_pct(t.non_training_share)} of the loop; other {t.other_s:.1f} s"
    )


def _estimate_text(e: dict[str, Any]) -> str:
    """``about 2 min 3 s for 3 steps at 41.2 s/step (measured over step 2), made at step 2
    (0:00:53 in); actual 2 min 1 s for 3 steps``."""
    actual = (
        f"actual {rough_duration(e['actual_s'])} for {e['actual_steps']:,} steps"
        if e.get("actual_s") is not None
        else "no actual time"
    )
    made = f"made at step {e['made_at_step']} ({rough_duration(e['made_after_s'])} in)"
    return f"{e['line']}, {made}; {actual}"


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
    if hw.get("machine_load"):
        lines.append(f"- machine load while it ran: {hw['machine_load']['words']}")
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
    lines += [f"- distributed: {_distributed_text(report.distributed)}"]
    lines += [f"- TF32: {json.dumps(report.tf32)}", "", "## Software", ""]
    lines += [f"- {k}: {val}" for k, val in v.items()]
    lines += blocks_lines(report.blocks)
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
            f"![training loss and validation accuracy over steps]({report.figure})",
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
    """The summary: on a terminal a rich table (long values fold within its width); anywhere
    else one ``key  value`` line per row, keys aligned, values whole and nothing padded after
    them."""
    rows = [*summary_rows(report), ("report", str(report_path))]
    title = f"mptrain — {report.status}"
    if not console.is_terminal:
        width = max(len(key) for key, _ in rows)
        lines = [f"{key.ljust(width)}  {value}".rstrip() for key, value in rows]
        console.out("\n".join([title, *lines]), highlight=False)
        return
    table = Table(title=title, show_header=False, box=None)
    table.add_column(style="bold", no_wrap=True)
    table.add_column(overflow="fold")
    for key, value in rows:
        table.add_row(key, escape(value))  # values are text, never rich markup
    console.print(table)
