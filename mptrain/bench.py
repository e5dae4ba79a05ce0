"""``mptrain bench [overrides]``: what each precision buys for the configured model and data here.

For every precision the device runs natively — FP32, BF16 and FP16 (and TF32 and FP8 on GPUs
that have them) — the configured model is built fresh and trained for ``bench.steps`` optimizer steps
after ``bench.warmup_steps`` warm-up steps through the same loop as a normal run (evaluation excluded). The
table shows training samples/s, the ratio to FP32 (and to TF32 on GPUs), peak memory, the fraction
of time spent waiting for data, and the host syncs per step the precision needs. Emulated FP8 and
FP16 convolutions on a CPU are skipped: their speed says nothing useful (the table says so).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from mptrain import hardware
from mptrain.build import prepare_run
from mptrain.config import ConfigError, PrecisionConfig, RunConfig
from mptrain.fileio import atomic_write_text
from mptrain.fp8 import fp8_gemm_available
from mptrain.loop import host_reads_per_step, train_loop
from mptrain.models import config_has_convolutions
from mptrain.report import fmt_bytes, fmt_pct


def bench_precisions(device: torch.device, model_has_convs: bool) -> list[tuple[str, str | None]]:
    """(precision, reason it is skipped or None) for every precision worth timing here."""
    rows: list[tuple[str, str | None]] = [("fp32", None)]
    if device.type == "cuda":
        rows.append(("tf32", None))
        rows.append(("fp16", None))
        native_bf16 = hardware.cuda_has_native_bf16(device)
        rows.append(("bf16", None if native_bf16 else "no native BF16 on this GPU"))
        rows.append(("fp8", None if fp8_gemm_available(device) else "no FP8 GEMMs (cc < 8.9)"))
        return rows
    native = hardware.cpu_has_native_bf16()
    rows.append(("bf16", None if native else "no native BF16 on this CPU (emulated: not a speed)"))
    rows.append(
        ("fp16", "FP16 convolutions take a very slow CPU path" if model_has_convs else None)
    )
    rows.append(("fp8", "no FP8 hardware: emulated FP8 is not a speed"))
    return rows


def precision_config(name: str, base: PrecisionConfig) -> PrecisionConfig:
    """The precision config bench times for ``name`` (``tf32``: fp32 with TF32 allowed), keeping
    the user's loss-scaler numbers."""
    return PrecisionConfig(
        name="fp32" if name == "tf32" else name,
        scaler=dataclasses.replace(base.scaler),
        allow_tf32=name == "tf32",
    )


def measure(cfg: RunConfig, warmup: int, steps: int) -> dict[str, Any]:
    """Train ``warmup + steps`` optimizer steps of ``cfg`` and return the measured figures."""
    cfg = dataclasses.replace(
        cfg,
        max_steps=warmup + steps,
        epochs=None,
        throughput_warmup_steps=warmup,
        log_every=max(steps, 1),
        eval_every=10**9,  # only the final evaluation, which the stopwatch excludes
    )
    run = prepare_run(cfg)
    train_loop(run)
    throughput = run.monitor.throughput
    return {
        "samples_per_s": throughput.samples_per_s,
        "step_time_ms": 1000 * throughput.measured_time_s / throughput.measured_steps
        if throughput.measured_steps
        else None,
        "peak_memory_bytes": run.monitor.peak_memory_bytes,
        "data_wait_fraction": throughput.data_wait_fraction,
        "host_syncs_per_step": host_reads_per_step(run),  # see mptrain.loop
        "label": run.policy.label,
    }


def run_bench(
    cfg: RunConfig, output_dir: Path, warmup: int, steps: int, console: Console
) -> list[dict[str, Any]]:
    device = hardware.resolve_device(cfg.device)
    has_convs = config_has_convolutions(cfg.model)  # FP16 convolutions crawl on CPUs
    rows = []
    for name, skip in bench_precisions(device, has_convs):
        row: dict[str, Any] = {"precision": name}
        if skip:
            row["skipped"] = skip
        else:
            run_cfg = dataclasses.replace(cfg, precision=precision_config(name, cfg.precision))
            try:
                row.update(measure(run_cfg, warmup, steps))
            except ConfigError as exc:
                row["skipped"] = str(exc)
        rows.append(row)
    _add_ratios(rows)
    result = {
        "model": cfg.model.name,
        "dataset": cfg.dataset.name,
        "batch_size": cfg.batch_size,
        "warmup_steps": warmup,
        "measured_steps": steps,
        "hardware": hardware.hardware_info(device),
        "versions": hardware.software_versions(),
        "rows": rows,
    }
    output_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(output_dir / "bench.json", json.dumps(result, indent=2) + "\n")
    atomic_write_text(output_dir / "bench.md", render(result))
    _print(console, result)
    console.print(f"bench written to {output_dir / 'bench.md'}")
    return rows


def _add_ratios(rows: list[dict[str, Any]]) -> None:
    by_name = {r["precision"]: r for r in rows if r.get("samples_per_s")}
    for row in rows:
        for base in ("fp32", "tf32"):
            if row.get("samples_per_s") and base in by_name:
                row[f"vs_{base}"] = row["samples_per_s"] / by_name[base]["samples_per_s"]


def _cells(row: dict[str, Any], has_tf32: bool) -> list[str]:
    if row.get("skipped"):
        return [row["precision"], f"skipped: {row['skipped']}"] + [""] * (5 + has_tf32)
    cells = [
        row["label"],
        f"{row['samples_per_s']:.1f}",
        f"{row['vs_fp32']:.2f}×",
    ]
    if has_tf32:
        cells.append(f"{row['vs_tf32']:.2f}×" if "vs_tf32" in row else "")
    cells += [
        f"{row['step_time_ms']:.2f}",
        fmt_bytes(row["peak_memory_bytes"]),
        fmt_pct(row["data_wait_fraction"]),
        str(row["host_syncs_per_step"]),
    ]
    return cells


def _headers(has_tf32: bool) -> list[str]:
    headers = ["precision", "samples/s", "vs fp32"]
    if has_tf32:
        headers.append("vs tf32")
    return [*headers, "step ms", "peak memory", "data wait", "host syncs/step"]


def render(result: dict[str, Any]) -> str:
    has_tf32 = any(r["precision"] == "tf32" for r in result["rows"])
    hw = result["hardware"]
    where = hw["gpu"]["name"] if hw.get("gpu") else hw["cpu"]["model"]
    lines = [
        f"# mptrain bench: {result['model']} on {result['dataset']}, batch {result['batch_size']}",
        "",
        f"{where}; torch {result['versions']['torch']}; {result['measured_steps']} steps after "
        f"{result['warmup_steps']} warm-up, evaluation excluded.",
        "",
        "| " + " | ".join(_headers(has_tf32)) + " |",
        "|" + "---|" * len(_headers(has_tf32)),
    ]
    lines += ["| " + " | ".join(_cells(r, has_tf32)) + " |" for r in result["rows"]]
    return "\n".join(lines) + "\n"


def _print(console: Console, result: dict[str, Any]) -> None:
    has_tf32 = any(r["precision"] == "tf32" for r in result["rows"])
    table = Table(title=f"mptrain bench: {result['model']} on {result['dataset']}")
    for header in _headers(has_tf32):
        table.add_column(header, overflow="fold")
    for row in result["rows"]:
        table.add_row(*_cells(row, has_tf32))
    console.print(table)
