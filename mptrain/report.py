"""The run report: report.json (for machines), report.md (for people), and the terminal summary.

Both files are written atomically (temporary file in the same directory, fsync, rename), so a
reader never sees half a report, and a report from an earlier write survives a failed one.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from mptrain.fileio import atomic_write_text

REPORT_JSON = "report.json"
REPORT_MD = "report.md"
METRICS_JSONL = "metrics.jsonl"
FAILURE_JSON = "failure.json"


def clean_json(value: Any) -> Any:
    """Make a value strict-JSON: non-finite floats become strings ("nan", "inf")."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): clean_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [clean_json(v) for v in value]
    return value


def write_report(output_dir: Path, report: dict[str, Any]) -> tuple[Path, Path]:
    json_path, md_path = output_dir / REPORT_JSON, output_dir / REPORT_MD
    atomic_write_text(json_path, json.dumps(clean_json(report), indent=2) + "\n")
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
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return str(n)


def fmt_pct(x: float | None) -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{100 * x:.2f}%"


def fmt_num(x: float | None, spec: str = ".4g") -> str:
    return "n/a" if x is None else format(x, spec)


def _skipped_text(training: dict[str, Any]) -> str:
    skipped = training["skipped_steps"]
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


def summary_rows(report: dict[str, Any]) -> list[tuple[str, str]]:
    """The key figures, in the order the terminal summary and report.md show them."""
    p, t, e = report["precision"], report["training"], report["evaluation"]
    thr, mem = report["throughput"], report["memory"]
    label = p.get("label") or p["effective"]
    precision = (
        label if p["requested"] == p["effective"] else f"{label} (requested {p['requested']})"
    )
    rows = [
        ("status", report["status"] + (f": {report['reason']}" if report.get("reason") else "")),
        (
            "precision",
            f"{precision}; autocast {p['autocast_dtype'] or 'none'}; "
            f"loss scaling {'on' if p['loss_scaling'] else 'off'}",
        ),
        ("precision choice", p["reason"]),
        ("device", report["hardware"]["device"]),
        ("model / data", f"{report['model']['name']} / {report['data']['description']}"),
        ("steps", f"{t['steps']} of {t['total_steps']} ({t['epochs_completed']} epochs)"),
        ("skipped steps", _skipped_text(t)),
        ("loss scale", _scale_text(t["loss_scale"])),
        ("final val accuracy", fmt_pct(e["final_val_accuracy"])),
        ("best val accuracy", f"{fmt_pct(e['best_val_accuracy'])} (step {e['best_step']})"),
        ("final val loss", fmt_num(e["final_val_loss"])),
        ("final train loss", fmt_num(t["final_train_loss"])),
        (
            "throughput",
            f"{fmt_num(thr['samples_per_s'], '.1f')} samples/s "
            f"({thr['measured_steps']} steps after {thr['warmup_steps']} warm-up, eval excluded)",
        ),
        ("data wait", fmt_pct(thr["data_wait_fraction"])),
        ("peak memory", f"{fmt_bytes(mem['peak_bytes'])} ({mem['kind']})"),
        ("wall time", f"{report['wall_time_s']:.1f} s"),
    ]
    recipe = report.get("recipe")
    if recipe:
        exp = recipe["expected"]
        rows.append(
            (
                "recipe",
                f"{recipe['name']}: expected {exp['metric']} {exp['value']} ± "
                f"{exp['tolerance']}, got {fmt_num(recipe['actual'])}: {recipe['verdict']}",
            )
        )
    t = report["training"]
    if t.get("zero_grad_fraction") is not None:
        rows.append(
            (
                "gradient probes",
                f"zero gradients {fmt_pct(t['zero_grad_fraction'])}, updates lost "
                f"to rounding {fmt_pct(t['updates_lost_fraction'])} (averages of probes every probe_every steps)",
            )
        )
    rows += [("note", n) for n in p["notes"]]
    return rows


def render_markdown(report: dict[str, Any]) -> str:
    v, hw = report["versions"], report["hardware"]
    lines = [
        f"# mptrain run report — {report['status']}",
        "",
        f"Run directory: `{report['output_dir']}`  ",
        f"Started {report['started_at']}, finished {report['finished_at']}.",
        "",
        "## Summary",
        "",
        "| | |",
        "|---|---|",
    ]
    lines += [f"| {k} | {str(val).replace('|', '/')} |" for k, val in summary_rows(report)]
    cpu = hw["cpu"]
    lines += [
        "",
        "## Hardware",
        "",
        f"- CPU: {cpu['model']}, {cpu['logical_cores']} logical cores, torch threads "
        f"{cpu['torch_threads']}, capability {cpu['torch_cpu_capability']}; native BF16: "
        f"{cpu['native_bf16']} (AVX512-BF16 {cpu['avx512_bf16']}, AMX-BF16 {cpu['amx_bf16']}), "
        f"AVX512-FP16 {cpu['avx512_fp16']}",
    ]
    gpu = hw.get("gpu")
    if gpu:
        lines.append(
            f"- GPU: {gpu['name']} (compute capability {gpu['compute_capability']}, "
            f"{fmt_bytes(gpu['memory_bytes'])}, driver {gpu['driver']}, {gpu['count']} visible)"
        )
    else:
        lines.append("- GPU: none used")
    lines += [f"- TF32: {json.dumps(report['tf32'])}", "", "## Software", ""]
    lines += [f"- {k}: {val}" for k, val in v.items()]
    evals = report["evaluation"]["history"]
    if evals:
        lines += [
            "",
            "## Evaluations",
            "",
            "| step | epoch | val loss | val accuracy |",
            "|---:|---:|---:|---:|",
        ]
        lines += [
            f"| {e['step']} | {e['epoch']} | {fmt_num(e['val_loss'])} | "
            f"{fmt_pct(e['val_accuracy'])} |"
            for e in evals
        ]
    if report.get("figure"):
        lines += [
            "",
            "## Curves",
            "",
            f"![training loss, validation accuracy, loss scale]({report['figure']})",
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


def print_summary(console: Console, report: dict[str, Any], report_path: Path) -> None:
    table = Table(title=f"mptrain — {report['status']}", show_header=False, box=None)
    table.add_column(style="bold")
    table.add_column()
    for key, value in summary_rows(report):
        table.add_row(key, escape(value))  # values are text, never rich markup
    table.add_row("report", escape(str(report_path)))
    console.print(table)
