"""``mptrain bench [overrides]``: what each precision buys for the configured model and data here
(docs/advise.md, "Measuring precisions", says what the table shows).

Every precision the device runs natively is trained on a fresh model through the same loop as a
run, ``bench.reps`` times in an order rotated every repetition (the first measurement of a process
and slow drifts of a shared machine hit them alike); each ratio pairs a precision with the FP32
(TF32) measurement of the same repetition and carries its spread (:mod:`mptrain.pace.spread`).
Emulated formats, and FP16 convolutions on a CPU, are skipped: their speed says nothing useful.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.markup import escape

from mptrain.config.base import ConfigError
from mptrain.config.format_table import BLOCK_FORMATS, FORMAT_TABLE, FP8_BLOCKWISE
from mptrain.config.precision import PrecisionConfig
from mptrain.config.run import RunConfig
from mptrain.models.build import config_has_convolutions
from mptrain.output.joblog import print_table
from mptrain.pace.spread import (
    MIN_SAMPLES,
    NOISY_SPREAD,
    Spread,
    format_ratio,
    repetition_spread,
)
from mptrain.platform import contention, hardware
from mptrain.precision.policy import blockwise_grad_dtype
from mptrain.precision.quant.fp8 import E4M3
from mptrain.precision.quant.kernels import block_gemm_available, fp8_gemm_available
from mptrain.report.rows import fmt_bytes, fmt_pct, plural
from mptrain.rundir.fileio import atomic_write_text
from mptrain.train.build import prepare_run, window_length
from mptrain.train.components import Run
from mptrain.train.loop import host_reads_per_step, train_loop
from mptrain.train.memory import account_step


def bench_precisions(
    device: torch.device,
    model_has_convs: bool,
    fp8_blockwise: bool = False,
    block_formats: bool = False,
    blockwise_grads: torch.dtype = E4M3,
) -> list[tuple[str, str | None]]:
    """(precision, reason it is skipped or None) for every precision worth timing here; with
    ``block_formats``, mxfp8 and nvfp4 too. Block-scaled GEMMs (fp8 with ``fp8_blockwise``)
    count only where they are real: emulated, they run FP32 matmuls and their speed says
    nothing (``blockwise_grads``: the gradients' element format, which the real blockwise GEMM
    restricts)."""
    blocks = BLOCK_ROWS if block_formats else ()
    rows: list[tuple[str, str | None]] = [("fp32", None)]
    if device.type == "cuda":
        bf16 = None if hardware.cuda_has_native_bf16(device) else "no native BF16 on this GPU"
        if fp8_blockwise:
            fp8 = _block_skip(device, FP8_BLOCKWISE, blockwise_grads)
        else:
            fp8 = None if fp8_gemm_available(device) else "no FP8 GEMMs (cc < 8.9)"
        rows += [("tf32", None), ("fp16", None), ("bf16", bf16), ("fp8", fp8)]
        return rows + [(name, _block_skip(device, name)) for name in blocks]
    native = hardware.cpu_has_native_bf16()
    rows.append(("bf16", None if native else "no native BF16 on this CPU (emulated: not a speed)"))
    rows.append(
        ("fp16", "FP16 convolutions take a very slow CPU path" if model_has_convs else None)
    )
    rows.append(("fp8", "no FP8 hardware: emulated FP8 is not a speed"))
    labels = {n: FORMAT_TABLE[n].label for n in blocks}
    return rows + [(n, f"no {w} hardware: emulated {w} is not a speed") for n, w in labels.items()]


# The block-scaled precisions bench lists (fp8 blockwise is the fp8 row, by fp8.granularity).
BLOCK_ROWS = tuple(fmt for fmt in BLOCK_FORMATS if FORMAT_TABLE[fmt].precision == fmt)


def _block_skip(device: torch.device, fmt: str, grads: torch.dtype = E4M3) -> str | None:
    """Why ``fmt`` is not timed on ``device`` (its GEMMs would be emulated), or None."""
    available, why_not = block_gemm_available(device, fmt, grads)
    label = FORMAT_TABLE[fmt].label
    return None if available else f"{why_not}: emulated {label} is not a speed"


def precision_config(name: str, base: PrecisionConfig) -> PrecisionConfig:
    """The precision config bench times for ``name`` (``tf32``: fp32 with TF32 allowed), keeping
    the user's loss-scaler numbers."""
    return PrecisionConfig(
        name="fp32" if name == "tf32" else name,
        scaler=dataclasses.replace(base.scaler),
        allow_tf32=name == "tf32",
    )


def measure(cfg: RunConfig, warmup: int, steps: int) -> dict[str, Any]:
    """Train ``warmup + steps`` optimizer steps of ``cfg`` and return the measured figures; with
    ``memory.account``, one step counted first (:func:`~mptrain.train.memory.account_step`, on
    copies of the model and optimizer, the random state forked: the timed run is untouched)."""
    cfg = dataclasses.replace(
        cfg,
        max_steps=warmup + steps,
        epochs=None,
        throughput_warmup_steps=warmup,
        log_every=max(steps, 1),
        eval_every=10**9,  # only the final evaluation, which the stopwatch excludes
    )
    run = prepare_run(cfg)
    accounted = account_step(run) if cfg.memory.account else None
    train_loop(run)
    return run_figures(run, accounted)


def run_figures(run: Run, accounted: dict[str, Any] | None = None) -> dict[str, Any]:
    """What a trained ``run`` measured: speed after its warm-up, peak memory, data wait, and from
    ``accounted`` (:func:`~mptrain.train.memory.account_step`'s count of one step; None: not
    counted) the step's activation bytes and all its accounted bytes (None when not counted)."""
    throughput = run.monitor.throughput
    counted = accounted is not None and "not_counted" not in accounted
    return {
        "samples_per_s": throughput.samples_per_s,
        "tokens_per_s": run.monitor.tokens_per_s,  # None for classifiers
        "step_time_ms": 1000 * throughput.measured_time_s / throughput.measured_steps
        if throughput.measured_steps
        else None,
        "peak_memory_bytes": run.monitor.peak_memory_bytes,
        "activation_bytes": accounted["total"]["activations"] if counted else None,
        "accounted_bytes": accounted["total_bytes"] if counted else None,
        "data_wait_fraction": throughput.data_wait_fraction,
        "host_syncs_per_step": host_reads_per_step(run),  # see mptrain.train.loop
        "label": run.precision.policy.label,
    }


def rotated(names: list[str], rep: int) -> list[str]:
    """The order of repetition ``rep``: ``names`` rotated by ``rep`` places."""
    k = rep % len(names) if names else 0
    return names[k:] + names[:k]


def measure_reps(
    configs: dict[str, RunConfig],
    warmup: int,
    steps: int,
    reps: int,
    measure_one: Callable[[RunConfig, int, int], dict[str, Any]] | None = None,
) -> tuple[dict[str, list[dict[str, Any]]], dict[str, str]]:
    """Each config measured ``reps`` times in rotating order by ``measure_one(cfg, warmup,
    steps)`` (default :func:`measure`; its figures): (per-repetition figures by name, reasons for the names
    whose config refused to build, which are not measured again)."""
    measure_one = measure_one or measure  # looked up now: tests replace bench.measure
    measured: dict[str, list[dict[str, Any]]] = {name: [] for name in configs}
    refused: dict[str, str] = {}
    for rep in range(reps):
        for name in rotated([n for n in configs if n not in refused], rep):
            try:
                measured[name].append(measure_one(configs[name], warmup, steps))
            except ConfigError as exc:
                refused[name] = str(exc)
    return {n: figures for n, figures in measured.items() if n not in refused}, refused


def summarise(name: str, reps: list[dict[str, Any]]) -> dict[str, Any]:
    """One precision's row: medians over its repetitions (``reps`` keeps each one's figures).
    Language models' rows also carry ``tokens_per_s`` and ``tokens_per_s_range``."""
    speeds = [r["samples_per_s"] for r in reps]
    tokens = [r["tokens_per_s"] for r in reps if r.get("tokens_per_s") is not None]
    step_ms = [r["step_time_ms"] for r in reps if r["step_time_ms"] is not None]
    waits = [r["data_wait_fraction"] for r in reps if r["data_wait_fraction"] is not None]
    peaks = [r["peak_memory_bytes"] for r in reps if r["peak_memory_bytes"] is not None]
    per_token = (
        {
            "tokens_per_s": statistics.median(tokens),
            "tokens_per_s_range": [min(tokens), max(tokens)],
        }
        if tokens
        else {}
    )
    return {
        "precision": name,
        "label": reps[0]["label"],
        "samples_per_s": statistics.median(speeds),
        "samples_per_s_range": [min(speeds), max(speeds)],
        **per_token,
        "step_time_ms": statistics.median(step_ms) if step_ms else None,
        "peak_memory_bytes": max(peaks) if peaks else None,  # a peak: the highest repetition's
        # One step's count: the same every repetition (None: memory.account=false).
        "activation_bytes": _first(reps, "activation_bytes"),
        "accounted_bytes": _first(reps, "accounted_bytes"),
        "data_wait_fraction": statistics.median(waits) if waits else None,
        "host_syncs_per_step": reps[0]["host_syncs_per_step"],  # the same every repetition
        "reps": reps,
    }


def _first(reps: list[dict[str, Any]], key: str) -> Any:
    """The first repetition's ``key`` that is not None (None when none has one)."""
    return next((r[key] for r in reps if r.get(key) is not None), None)


def run_bench(
    cfg: RunConfig, output_dir: Path, warmup: int, steps: int, reps: int, console: Console
) -> list[dict[str, Any]]:
    """Time every precision ``reps`` times (see module doc); write bench.json and bench.md into
    ``output_dir``, print the table, and return its rows (skipped precisions with the reason)."""
    device = hardware.resolve_device(cfg.device)
    has_convs = config_has_convolutions(cfg.model, cfg.task == "lm")  # FP16 convs crawl on CPUs
    blockwise = cfg.fp8.granularity == "blockwise"
    grads = blockwise_grad_dtype(cfg.fp8)
    precisions = bench_precisions(device, has_convs, blockwise, True, grads)
    configs = {
        name: dataclasses.replace(cfg, precision=precision_config(name, cfg.precision))
        for name, skip in precisions
        if not skip
    }
    before = contention.sample()
    measured, refused = measure_reps(configs, warmup, steps, reps)
    machine = contention.judged_since(before, device)
    rows = []
    for name, skip in precisions:
        reason = skip or refused.get(name)
        rows.append(
            {"precision": name, "skipped": reason} if reason else summarise(name, measured[name])
        )
    add_ratios(rows, busy=contention.busy_words(machine))
    result = {
        "model": cfg.model.name,
        "dataset": cfg.dataset.name,
        "task": cfg.task,
        "batch_size": cfg.batch_size,
        "tokens_per_sample": window_length(cfg),
        "warmup_steps": warmup,
        "measured_steps": steps,
        "reps": reps,
        "hardware": hardware.hardware_info(device),
        "machine_load": machine,
        "versions": hardware.software_versions(),
        "rows": rows,
    }
    output_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(output_dir / "bench.json", json.dumps(result, indent=2) + "\n")
    atomic_write_text(output_dir / "bench.md", render(result))
    _print(console, result)
    console.print(f"bench written to {output_dir / 'bench.md'}")
    return rows


def add_ratios(rows: list[dict[str, Any]], busy: str | None = None) -> None:
    """``vs_<base>`` (median), ``vs_<base>_range`` (min–max) and ``vs_<base>_noisy`` (the reason,
    or None) on every measured row, from the ratios of each repetition to the base's measurement
    of the same repetition; each repetition's ratio also goes into its ``reps`` entry. ``busy``
    (others' work competed for the cores, in words) makes every ratio noisy."""
    by_name = {r["precision"]: r for r in rows if "reps" in r}
    for base_name in ("fp32", "tf32"):
        base = by_name.get(base_name)
        if base is None:
            continue
        key = f"vs_{base_name}"
        for row in by_name.values():
            if row is base:  # 1 by definition, not a measurement
                row.update({key: 1.0, f"{key}_range": [1.0, 1.0], f"{key}_noisy": None})
                continue
            pairs = zip(row["reps"], base["reps"], strict=True)
            ratios = [r["samples_per_s"] / b["samples_per_s"] for r, b in pairs]
            for rep, ratio in zip(row["reps"], ratios, strict=True):
                rep[key] = ratio
            spread = repetition_spread(ratios).marked(
                f"taken on a busy machine ({busy})" if busy else None
            )
            row.update(
                {
                    key: spread.median,
                    f"{key}_range": [spread.low, spread.high],
                    f"{key}_noisy": spread.noisy,
                }
            )


def _ratio_cell(row: dict[str, Any], key: str) -> str:
    if key not in row:
        return ""
    if key == f"vs_{row['precision']}":
        return "1.00×"  # the base itself: 1 by definition
    low, high = row[f"{key}_range"]
    return format_ratio(Spread(row[key], low, high, len(row["reps"]), row[f"{key}_noisy"]))


def _cells(row: dict[str, Any], has_tf32: bool, has_tokens: bool = False) -> list[str]:
    if row.get("skipped"):
        return [row["precision"], f"skipped: {row['skipped']}"] + [""] * (7 + has_tf32 + has_tokens)
    low, high = row["samples_per_s_range"]
    cells = [row["label"], f"{row['samples_per_s']:.1f} ({low:.0f}–{high:.0f})"]
    if has_tokens:
        low, high = row["tokens_per_s_range"]
        cells.append(f"{row['tokens_per_s']:,.0f} ({low:,.0f}–{high:,.0f})")
    cells.append(_ratio_cell(row, "vs_fp32"))
    if has_tf32:
        cells.append(_ratio_cell(row, "vs_tf32"))
    cells += [
        f"{row['step_time_ms']:.2f}",
        fmt_bytes(row["peak_memory_bytes"]),
        fmt_bytes(row.get("activation_bytes")),
        fmt_bytes(row.get("accounted_bytes")),
        fmt_pct(row["data_wait_fraction"]),
        str(row["host_syncs_per_step"]),
    ]
    return cells


def _headers(has_tf32: bool, has_tokens: bool = False) -> list[str]:
    return [
        "precision",
        "samples/s (min–max)",
        *(["tokens/s (min–max)"] if has_tokens else []),
        "vs fp32 (min–max)",
        *(["vs tf32 (min–max)"] if has_tf32 else []),
        "step ms",
        "peak memory",
        "activations",
        "accounted",
        "data wait",
        "host syncs/step",
    ]


def notes(result: dict[str, Any]) -> list[str]:
    """What the figures are, then one line per noisy ratio with its reason."""
    lines = [
        f"Medians of {plural(result['reps'], 'repetition')} (min–max in brackets), the "
        "precisions in an order rotated every repetition; each ratio pairs a precision with the base measured in "
        "the same repetition. Noisy: the ratio's range is wider than "
        f"{NOISY_SPREAD:.0%} of it, or too few repetitions to tell (bench.reps below "
        f"{MIN_SAMPLES}): do not read it as fact."
    ]
    if any(row.get("accounted_bytes") is not None for row in result["rows"]):
        lines.append(
            "Activations: what autograd saved for one micro-batch's backward; accounted: all of "
            "one step's counted bytes, activations included (parameters, gradients, optimizer "
            "states, scales, buffers, parameter casts). The peak is larger: it also holds what "
            "no step saves (a CPU's peak: the whole process)."
        )
    for row in result["rows"]:
        for base in ("fp32", "tf32"):
            if row.get(f"vs_{base}_noisy"):
                lines.append(f"{row['label']} vs {base} noisy: {row[f'vs_{base}_noisy']}")
    return lines


def _columns(result: dict[str, Any]) -> tuple[bool, bool]:
    """(a TF32 column, a tokens/s column): TF32 where it was timed, tokens/s for language models."""
    has_tf32 = any(r["precision"] == "tf32" for r in result["rows"])
    return has_tf32, result.get("tokens_per_sample") is not None


def render(result: dict[str, Any]) -> str:
    columns = _columns(result)
    hw = result["hardware"]
    where = hw["gpu"]["name"] if hw.get("gpu") else hw["cpu"]["model"]
    batch = f"batch {result['batch_size']}"
    if result.get("tokens_per_sample"):
        batch += f" x {result['tokens_per_sample']} tokens"
    lines = [
        f"# mptrain bench: {result['model']} on {result['dataset']}, {batch}",
        "",
        f"{where}; torch {result['versions']['torch']}; {plural(result['measured_steps'], 'step')} "
        f"after {result['warmup_steps']} warm-up, evaluation excluded, "
        f"{plural(result['reps'], 'repetition')}.",
        "",
        "| " + " | ".join(_headers(*columns)) + " |",
        "|" + "---|" * len(_headers(*columns)),
    ]
    lines += ["| " + " | ".join(_cells(r, *columns)) + " |" for r in result["rows"]]
    lines += ["", *(f"- {line}" for line in notes(result))]
    return "\n".join(lines) + "\n"


def _print(console: Console, result: dict[str, Any]) -> None:
    """The table (rich on a terminal, plain text in a log file: see
    :func:`~mptrain.output.joblog.print_table`), then the notes."""
    columns = _columns(result)
    title = f"mptrain bench: {result['model']} on {result['dataset']}"
    cells = [_cells(row, *columns) for row in result["rows"]]
    print_table(console, title, _headers(*columns), cells)
    for line in notes(result):
        console.print(escape(line))


def bench_main(overrides: list[str]) -> None:
    """``mptrain bench [overrides]``: time every precision for the configured model and data.

    Writes bench.md and bench.json to ``outputs/bench/<date>/<time>_<model>_<dataset>``, or to
    ``hydra.run.dir=DIR`` when given (parsed and resolved by Hydra: quotes, ``${now:...}``).
    Bad input raises ConfigError (the CLI's one-line error, exit 2).
    """
    from mptrain.cli.preflight import subcommand_job
    from mptrain.output.joblog import table_console

    cfg, output_dir = subcommand_job(overrides, "bench")
    b = cfg.bench
    run_bench(cfg, output_dir, b.warmup_steps, b.steps, b.reps, table_console(140))
