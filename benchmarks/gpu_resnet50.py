"""GPU throughput: ResNet-50 on synthetic 224 px images at FP32, TF32, FP16 and BF16.

For one H100/H200-class GPU; under 8 minutes with the defaults:

    python -m benchmarks.gpu_resnet50 [--out benchmarks/results/gpu_resnet50.json]

``--device cpu --batch 2 --image-size 32 --steps 1 --precisions fp32,bf16`` runs the same code on a
CPU in seconds (the test suite does, so the script is known to work before GPU time is spent on it).

Every precision runs ``mptrain bench``'s measurement (the real training loop: channels_last,
fused SGD, data resident on the GPU, no per-step host sync beyond the FP16 scaler's), reporting
images/s after warm-up and peak memory, with ``torch.backends.cudnn.benchmark`` off as mptrain
trains (``cudnn_benchmark: false``). Then each of ``--autotuned`` (default: bf16) once more with
cudnn.benchmark on (``cudnn_benchmark: true``; cuDNN times its convolution algorithms in the
first steps, which the warm-up holds), as NVIDIA DeepLearningExamples runs. Its reference: ResNet-50
v1.5 on one A100 80GB trains at 2470 img/s with AMP and 938 img/s in TF32 (batch 256); compare it
with the autotuned row. For FP8 on a Linear-heavy model see benchmarks/gpu_fp8_check.py.

The JSON document is rewritten into ``--out`` atomically after every row; a precision that raises
is a row with its ``error`` and the others still run (exit code 1 then).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import sys
from pathlib import Path

import torch

from benchmarks.jsondoc import error_text, write_json
from benchmarks.mptrain_api import (
    compose,
    hardware_info,
    measure,
    precision_config,
    software_versions,
)

PRECISIONS = ("fp32", "tf32", "fp16", "bf16")
REFERENCE = (
    "DeepLearningExamples RN50 v1.5, 1x A100 80GB: AMP 2470 img/s, TF32 938 img/s "
    "(cudnn.benchmark on: compare with the cudnn_benchmark rows)"
)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=15)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--precisions", default=",".join(PRECISIONS))
    parser.add_argument("--autotuned", default="bf16", help="rerun with cudnn.benchmark ('': none)")
    parser.add_argument("--device", default="cuda", help="cuda (the benchmark) | cpu (a smoke run)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.steps < 1 or args.warmup < 1 or args.batch < 1:
        parser.error("--steps, --warmup and --batch must be >= 1")
    args.precisions = args.precisions.split(",")
    if "fp32" not in args.precisions or set(args.precisions) - set(PRECISIONS):
        parser.error("--precisions: fp32 (the baseline) plus any of tf32, fp16, bf16")
    args.autotuned = [name for name in args.autotuned.split(",") if name]
    if set(args.autotuned) - set(PRECISIONS):
        parser.error(f"--autotuned: any of {', '.join(PRECISIONS)}")
    return args


def run_config(args: argparse.Namespace, device: torch.device):
    """The typed RunConfig every row starts from (composed from the shipped YAML)."""
    overrides = [
        "model=resnet50",
        "model.small_stem=false",
        "dataset=synthetic",
        f"dataset.image_size={args.image_size}",
        f"dataset.num_train={args.batch * 4}",
        "dataset.num_val=64",
        "dataset.num_classes=1000",
        f"batch_size={args.batch}",
        "eval_batch_size=64",
        "optimizer=sgd",
        "channels_last=true",
        f"device={device.type}",
        "progress=false",
    ]
    return compose(*overrides)


def measure_row(cfg, name: str, autotuned: bool, args: argparse.Namespace) -> dict:
    """One row: precision ``name`` through mptrain's loop, cudnn.benchmark on when ``autotuned``
    (off again afterwards); an exception is a row with its ``error``."""
    run_cfg = dataclasses.replace(cfg, precision=precision_config(name, cfg.precision))
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    row = {"precision": name, "cudnn_benchmark": autotuned}
    torch.backends.cudnn.benchmark = autotuned
    try:
        row.update(measure(run_cfg, args.warmup, args.steps))
    except Exception as exc:  # recorded in the document, the other rows still run
        row["error"] = error_text(exc)
    finally:
        torch.backends.cudnn.benchmark = False
    return row


def add_ratios(rows: list[dict]) -> None:
    """``vs_fp32`` and ``vs_tf32`` of every measured row, against the plain (not autotuned) ones."""
    base = {
        r["precision"]: r["samples_per_s"]
        for r in rows
        if not r.get("error") and not r["cudnn_benchmark"]
    }
    for row in rows:
        for reference in ("fp32", "tf32"):
            if reference in base and not row.get("error"):
                row[f"vs_{reference}"] = row["samples_per_s"] / base[reference]


def describe(row: dict) -> str:
    name = f"{row['precision']}{' +cudnn.benchmark' if row['cudnn_benchmark'] else ''}"
    if row.get("error"):
        return f"{name:>21}: {row['error']}"
    peak = row["peak_memory_bytes"]
    memory = "-" if peak is None else f"{peak / 2**30:6.2f} GiB"
    return f"{name:>21}: {row['samples_per_s']:8.1f} img/s  peak {memory}"


def main() -> int:
    args = parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("needs a CUDA GPU (or --device cpu for a smoke run)", file=sys.stderr)
        return 2
    cfg = run_config(args, device)
    rows: list[dict] = []
    result = {
        "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "benchmark": (
            f"ResNet-50, synthetic {args.image_size} px, batch {args.batch}, channels_last, SGD"
        ),
        "hardware": hardware_info(device),
        "versions": software_versions(),
        "reference": REFERENCE,
        "rows": rows,
    }
    plan = [(name, False) for name in args.precisions] + [(n, True) for n in args.autotuned]
    for name, autotuned in plan:
        rows.append(measure_row(cfg, name, autotuned, args))
        add_ratios(rows)
        print(describe(rows[-1]), flush=True)
        write_json(args.out, result)
    print(json.dumps(result, indent=2))
    return 1 if any(r.get("error") for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
