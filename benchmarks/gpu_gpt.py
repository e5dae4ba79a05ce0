"""GPU throughput of a GPT language model per precision: tokens/s and model FLOPs utilisation.

For one H100/H200-class GPU; about a minute with the defaults (estimate: not yet run on a GPU):

    python -m benchmarks.gpu_gpt [--out benchmarks/results/gpu_gpt.json]

The model is mptrain's GPT (``task=lm``: model=gpt on the embedded Python-stdlib corpus, byte
vocabulary) at a width where FP8 pays: width 2048, 16 heads, 4 layers, 1024-token windows, batch
32 (32,768 tokens per step; ~200 M parameters). Memory is not what limits the batch: an
estimate from the tensors autograd saves (~64 x width bytes per token and layer in FP32, ~36 in
BF16, measured on a CPU) plus 16 bytes per parameter puts FP32 at ~20-25 GiB of the H200's
~139 GiB; batch 32 already gives GEMMs of 32,768 rows, and FP32 steps (~1 s each, estimated) are
what the time goes to.

``--device cpu`` runs the same code with tiny sizes (width 64, 1 layer, 64-token windows, batch
4, 2 steps after 1; any size flag still applies) in seconds: the test suite does, so the script is
known to work before GPU time is spent on it.

Every precision runs ``mptrain bench``'s measurement (the real training loop: fused AdamW, gradient
clipping, data resident on the device, flash or memory-efficient SDPA), reporting tokens/s and
samples/s after warm-up, step time, peak memory, the ratio to FP32 and TF32, and model FLOPs
utilisation (MFU). Model FLOPs per token (PaLM, appendix B):

    6 * N + 12 * layers * block * width

where N counts the parameters except the position embedding (the tied token embedding / output
head once: its matmul is the head's), and the second term is the attention scores and values,
counted whole (not halved for the causal mask). MFU = FLOPs per token x tokens/s / peak FLOP/s,
against the FLOP-weighted peak of the formats the row's GEMMs ran in (``mfu``:
:func:`mptrain.perf.gpus.mixed_peak_flops`; FP8 converts the attention projections and MLP
Linears but the first, while SDPA and the head stay BF16, so FP8's peak mixes the FP8 and BF16
peaks by their FLOPs; FP32 is the non-tensor rate, TF32 and BF16/FP16 tensor) and against the
BF16 peak (``mfu_vs_bf16_peak``: one yardstick for all rows). The dense (no sparsity) peaks come
from mptrain's table by GPU name (:mod:`mptrain.perf.gpus`; ``--peak-tflops
fp32=67,bf16=989,...`` overrides or adds); an unknown GPU (or a CPU) gets MFU null with the
reason. Emulated FP8 (no FP8 GEMMs: compute capability < 8.9, or a CPU) is measured and
labelled, but gets no MFU: it is not a speed.

On a GPU of the table each row also has the roofline's *predicted* tokens/s for that GPU
(:mod:`mptrain.perf.roofline`: an upper bound of the speed) and the prediction's error,
(predicted − measured) / measured (``predicted_tokens_per_s``, ``prediction_error``).

The JSON document is rewritten into ``--out`` atomically after every row; a precision that raises
(out of memory or any other error) is a row with its ``error`` and the others still run (exit
code 1 then).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import gc
import json
import sys
from pathlib import Path
from typing import Any

import torch

from benchmarks.jsondoc import error_text, write_json
from benchmarks.mptrain_api import (
    GPT,
    DataShape,
    GPTShape,
    compose,
    flops_by_format,
    fp8_gemm_available,
    gpus,
    hardware_info,
    measure,
    precision_config,
    predict_config,
    software_versions,
)

PRECISIONS = ("fp32", "tf32", "bf16", "fp16", "fp8")
VOCAB = 256  # dataset.vocabulary=bytes
# Sizes: the benchmark on a GPU; a smoke run (seconds) on a CPU.
SIZES = {
    "cuda": {"width": 2048, "layers": 4, "heads": 16, "block": 1024, "batch": 32, "steps": 10,
             "warmup": 3, "max_bytes": 2_000_000},
    "cpu": {"width": 64, "layers": 1, "heads": 2, "block": 64, "batch": 4, "steps": 2,
            "warmup": 1, "max_bytes": 100_000},
}  # fmt: skip
MFU_BASIS = {
    "mfu": "model FLOP/s over the FLOP-weighted dense peak of the formats the row's GEMMs ran "
    "in (fp32: FP32 non-tensor, tf32: TF32 tensor, bf16/fp16: BF16/FP16 tensor, fp8: its FP8 "
    "Linears at the FP8 peak, the rest at BF16's)",
    "mfu_vs_bf16_peak": "model FLOP/s over the dense BF16 tensor peak, for every row",
}


def parameters_counted(shape: GPTShape) -> int:
    """N of the FLOPs formula: every parameter of mptrain's GPT but the position embedding (the
    tied token embedding and output head once). Counted on the meta device: nothing allocated."""
    with torch.device("meta"):
        model = GPT(shape)
    return sum(p.numel() for name, p in model.named_parameters() if not name.startswith("pos_emb"))


def flops_per_token(shape: GPTShape) -> int:
    """Model FLOPs per trained token (forward and backward): 6 N + 12 layers block width."""
    return 6 * parameters_counted(shape) + 12 * shape.layers * shape.block_size * shape.width


def table_peaks(gpu_name: str | None) -> tuple[str | None, dict[str, float]]:
    """(the table's row, its dense TFLOP/s by format) for ``gpu_name``; (None, {}) when the
    table (:mod:`mptrain.perf.gpus`) does not know it."""
    gpu = gpus.row_for_device_name(gpu_name) if gpu_name else None
    return (gpu.key, dict(gpu.tflops)) if gpu else (None, {})


def parse_peaks(text: str | None) -> dict[str, float]:
    """``fp32=67,bf16=989`` -> {"fp32": 67.0, "bf16": 989.0} (TFLOP/s)."""
    peaks: dict[str, float] = {}
    for item in filter(None, (text or "").split(",")):
        name, _, value = item.partition("=")
        if name not in PRECISIONS or not value:
            raise ValueError(f"--peak-tflops: {item!r} is not PRECISION=TFLOPS ({PRECISIONS})")
        peaks[name] = float(value)
        if peaks[name] <= 0:
            raise ValueError(f"--peak-tflops: {item!r}: the peak must be > 0")
    return peaks


def peak_table(gpu_name: str | None, override: dict[str, float]) -> dict[str, Any]:
    """The peaks MFU is taken against, where they came from, and why there are none."""
    entry, peaks = table_peaks(gpu_name)
    peaks.update(override)
    sources = [f"mptrain.perf.gpus: {entry} (dense)"] if entry else []
    sources += ["--peak-tflops"] if override else []
    reason = None
    if not peaks:
        where = f"GPU {gpu_name!r}" if gpu_name else "a CPU"
        reason = f"no peak FLOP/s known for {where}: give --peak-tflops PRECISION=TFLOPS,..."
    return {"tflops": peaks, "source": " + ".join(sources) or None, "unknown_reason": reason}


def peak_gpu(peaks: dict[str, Any]) -> gpus.GPU:
    """The peaks of :func:`peak_table` as a GPU row the mixed peak can be taken on."""
    return gpus.GPU("peaks", peaks["source"] or "", "", dict(peaks["tflops"]), 0, 0, 0, (0, 0), "")


def add_mfu(
    row: dict[str, Any],
    per_token: int,
    peaks: dict[str, Any],
    by_format: dict[str, float] | None = None,
) -> None:
    """``mfu``, ``mfu_vs_bf16_peak`` (fractions, or None) and ``mfu_note`` (why one is None).
    ``by_format``: the row's model FLOPs by the format its GEMMs ran in (the mixed peak's
    weights); None: all in the row's own precision."""
    row["mfu"] = row["mfu_vs_bf16_peak"] = None
    row["mfu_note"] = None
    if row.get("error"):
        row["mfu_note"] = "not measured"
        return
    if row["emulated"]:
        row["mfu_note"] = "emulated FP8 (no FP8 GEMM hardware): not a speed, no MFU"
        return
    if peaks["unknown_reason"]:
        row["mfu_note"] = peaks["unknown_reason"]
        return
    achieved = per_token * row["tokens_per_s"]
    tflops = peaks["tflops"]
    notes = []
    try:
        mixed = gpus.mixed_peak_flops(by_format or {row["precision"]: 1.0}, peak_gpu(peaks))
        row["mfu"] = achieved / mixed
    except ValueError:
        notes.append(f"no {row['precision']} peak for this GPU")
    if "bf16" in tflops:
        row["mfu_vs_bf16_peak"] = achieved / (tflops["bf16"] * 1e12)
    else:
        notes.append("no bf16 peak for this GPU")
    row["mfu_note"] = "; ".join(notes) or None


def predictions(cfg: Any, data: DataShape, gpu_name: str | None, names: list[str]) -> dict:
    """The roofline's predicted step per precision on this GPU (``rows``: tokens/s, or why
    none), with which GPU row and figures; no rows on a CPU or a GPU the table lacks."""
    gpu = gpus.row_for_device_name(gpu_name) if gpu_name else None
    if gpu is None:
        why = f"the table does not know {gpu_name}" if gpu_name else "on a CPU"
        return {"gpu": None, "note": f"no prediction: {why}", "rows": {}}
    found = predict_config(cfg, data, gpu, names)
    rows = {n: p if isinstance(p, str) else p.tokens_per_s for n, p in found.items()}
    return {"gpu": gpu.key, "source": gpu.source, "basis": "roofline, at best", "rows": rows}


def add_prediction(row: dict[str, Any], predicted: float | str | None) -> None:
    """``predicted_tokens_per_s`` beside the measured figure and ``prediction_error``
    ((predicted − measured) / measured); a reason instead when there is no prediction."""
    if predicted is None:
        return
    if isinstance(predicted, str):
        row["predicted_tokens_per_s"], row["prediction_note"] = None, predicted
        return
    row["predicted_tokens_per_s"] = predicted
    if not row.get("error") and not row["emulated"]:
        row["prediction_error"] = (predicted - row["tokens_per_s"]) / row["tokens_per_s"]


def add_ratios(rows: list[dict[str, Any]]) -> None:
    base = {r["precision"]: r["tokens_per_s"] for r in rows if not r.get("error")}
    for row in rows:
        for reference in ("fp32", "tf32"):
            if reference in base and not row.get("error"):
                row[f"vs_{reference}"] = row["tokens_per_s"] / base[reference]


def measure_precision(cfg: Any, name: str, args: argparse.Namespace, device: torch.device) -> dict:
    """One precision through mptrain's loop; an exception (out of memory, an FP8 kernel error) is a
    row with its ``error``, so the rows measured before and after it are kept."""
    run_cfg = dataclasses.replace(cfg, precision=precision_config(name, cfg.precision))
    try:
        row = measure(run_cfg, args.warmup, args.steps)
    except Exception as exc:  # recorded in the document, the other precisions still run
        row = {"error": error_text(exc)}
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    emulated = name == "fp8" and (
        not fp8_gemm_available(device) or "emulated" in row.get("label", "")
    )
    return {"precision": name, **row, "emulated": emulated}


def describe(row: dict[str, Any]) -> str:
    if row.get("error"):
        return f"{row['precision']:>5}: {row['error']}"
    peak = row["peak_memory_bytes"]
    mfu = "-" if row["mfu"] is None else f"{row['mfu']:.1%}"
    vs_bf16 = "-" if row["mfu_vs_bf16_peak"] is None else f"{row['mfu_vs_bf16_peak']:.1%}"
    return (
        f"{row['precision']:>5}: {row['tokens_per_s']:12,.0f} tokens/s "
        f"({row['samples_per_s']:8.2f} samples/s, {row['step_time_ms']:8.1f} ms/step), "
        f"peak {'-' if peak is None else f'{peak / 2**30:.2f} GiB'}, MFU {mfu} "
        f"(vs BF16 peak {vs_bf16}){'  [emulated FP8]' if row['emulated'] else ''}"
        + (
            f"; predicted {row['predicted_tokens_per_s']:,.0f} tokens/s ({row['prediction_error']:+.0%})"
            if "prediction_error" in row
            else ""
        )
    )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (the benchmark) | cpu (a smoke run)")
    for flag in ("width", "layers", "heads", "block", "batch", "steps", "warmup"):
        parser.add_argument(f"--{flag}", type=int, default=None, help="default: see SIZES")
    parser.add_argument("--max-bytes", type=int, default=None, help="corpus bytes read")
    parser.add_argument("--precisions", default=",".join(PRECISIONS))
    parser.add_argument("--peak-tflops", default=None, help="PRECISION=TFLOPS,... (dense peaks)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    sizes = SIZES["cuda" if args.device.startswith("cuda") else "cpu"]
    for key, value in sizes.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if min(args.width, args.layers, args.heads, args.block, args.batch, args.steps) < 1:
        parser.error("sizes and --steps must be >= 1")
    if args.warmup < 1:
        parser.error("--warmup must be >= 1")
    if args.width % args.heads:
        parser.error(f"--width {args.width} is not a multiple of --heads {args.heads}")
    args.precisions = args.precisions.split(",")
    if "fp32" not in args.precisions or set(args.precisions) - set(PRECISIONS):
        parser.error(f"--precisions: fp32 (the baseline) plus any of {PRECISIONS[1:]}")
    try:
        args.peak_override = parse_peaks(args.peak_tflops)
    except ValueError as exc:
        parser.error(str(exc))
    return args


def run_config(args: argparse.Namespace) -> Any:
    """The typed RunConfig every row starts from (composed from the shipped YAML)."""
    overrides = [
        "task=lm",
        f"model.width={args.width}",
        f"model.layers={args.layers}",
        f"model.heads={args.heads}",
        f"model.block_size={args.block}",
        "dataset.vocabulary=bytes",
        f"dataset.max_bytes={args.max_bytes}",
        f"batch_size={args.batch}",
        f"eval_batch_size={args.batch}",
        f"device={args.device}",
        "progress=false",
    ]
    return compose(*overrides)


def document(args: argparse.Namespace, shape: GPTShape, peaks: dict, hardware: dict) -> dict:
    """The JSON document without its rows."""
    tokens_per_step = args.batch * args.block
    return {
        "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "benchmark": (
            f"GPT width {args.width}, {args.layers} layers, {args.heads} heads, block {args.block}, "
            f"batch {args.batch} ({tokens_per_step:,} tokens/step), byte vocabulary, AdamW; "
            f"{args.steps} steps after {args.warmup}"
        ),
        "settings": {k: getattr(args, k) for k in (*SIZES["cuda"], "precisions")},
        "flops": {
            "per_token": flops_per_token(shape),
            "parameters_counted": parameters_counted(shape),
            "formula": "6 * N + 12 * layers * block * width (PaLM appendix B)",
            "N": "parameters except the position embedding; the tied token embedding / output "
            "head once",
        },
        "mfu": {**peaks, "basis": MFU_BASIS},
        "hardware": hardware,
        "versions": software_versions(),
        "rows": [],
    }


def main() -> int:
    args = parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("needs a CUDA GPU (or --device cpu for a smoke run)", file=sys.stderr)
        return 2
    cfg = run_config(args)
    shape = GPTShape(VOCAB, args.block, args.layers, args.heads, args.width)
    hardware = hardware_info(device)
    gpu_name = hardware["gpu"]["name"] if hardware.get("gpu") else None
    peaks = peak_table(gpu_name, args.peak_override)
    result = document(args, shape, peaks, hardware)
    data = DataShape(0, 0, VOCAB, args.block)
    by_format = {name: flops_by_format(cfg, data, name) for name in args.precisions}
    predicted = predictions(cfg, data, gpu_name, args.precisions)
    result["prediction"] = {k: v for k, v in predicted.items() if k != "rows"}
    rows = result["rows"]
    for name in args.precisions:
        rows.append(measure_precision(cfg, name, args, device))
        add_ratios(rows)  # against the rows so far: fp32 comes first
        for row in rows:
            add_mfu(row, result["flops"]["per_token"], peaks, by_format[row["precision"]])
        add_prediction(rows[-1], predicted["rows"].get(name))
        print(describe(rows[-1]), flush=True)
        write_json(args.out, result)
    print(json.dumps(result, indent=2))
    return 1 if any(r.get("error") for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
