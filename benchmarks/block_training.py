"""Training in the block-scaled formats, emulated: final loss against FP32 and BF16, and the
emulation's step time as a ratio to FP32's.

    python -m benchmarks.block_training [--jobs lm,classify] [--lm-steps 300] [--epochs 15]
        [--precisions fp32,bf16,mxfp8,nvfp4,fp8_blockwise] [--threads 1] [--out FILE]
        [--lm-overrides "model.layers=2 ..."] [-- extra overrides for every run]

Two jobs, each trained once per precision from the same seed (the same initial weights and
batches), in mptrain's own loop (``mptrain.train.job.train``: the run a user gets):

- ``lm``: ``task=lm`` with the default GPT (4 blocks, width 128, 128-token windows, batch 32) on
  the embedded text, ``max_steps=--lm-steps``: its 16 block Linears convert (not the head);
  NVFP4 keeps the last 15% of the blocks in BF16 (rounded up: the last block's four Linears);
- ``classify``: ``model=mlp`` on digits, ``epochs=--epochs`` (the default classification job's
  data and length; the default ``cnn`` has a single Linear, its classifier, which every
  low-precision format keeps, so it cannot run in one): its 256x256 hidden layer converts.

Precisions: ``fp32``, ``bf16``, ``mxfp8`` (rceil), ``nvfp4`` (NVIDIA's recipe, all on),
``fp8_blockwise`` (``precision=fp8 fp8.granularity=blockwise fp8.format=e4m3``: DeepSeek-V3's).
Each row gives the final training loss (the last metrics row's batch), the final validation loss
(and accuracy for ``classify``), the difference of the validation loss to FP32's, the step time
(mptrain's throughput stopwatch: warm-up and evaluation excluded) and the job's CPU time per step
(every thread; build and evaluation included), each with its ratio to FP32's.
The block formats are emulated (FP32 matmuls of the dequantized operands): their ratio is the
cost of the emulation, not a speed of the format. Wall-clock ratios on a shared machine move with
its load: each row records the 1-minute load average before and after it, and the runs use one
thread unless ``--threads`` says otherwise.

Prints a markdown table and writes the JSON document with ``--out``.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from benchmarks.jsondoc import error_text, write_json
from benchmarks.mptrain_api import compose, hardware_info, software_versions

CPU = torch.device("cpu")
PRECISIONS = {
    "fp32": ("precision=fp32",),
    "bf16": ("precision=bf16",),
    "mxfp8": ("precision=mxfp8",),
    "nvfp4": ("precision=nvfp4",),
    "fp8_blockwise": ("precision=fp8", "fp8.granularity=blockwise", "fp8.format=e4m3"),
}
COMMON = (
    "device=cpu",
    "progress=false",
    "precision.measure=false",
    "checkpoint.enabled=false",
    "throughput_warmup_steps=5",
)


def job_overrides(job: str, args: argparse.Namespace) -> tuple[str, ...]:
    """The overrides of one job (module doc)."""
    if job == "lm":
        steps = (f"max_steps={args.lm_steps}", f"eval_every={args.lm_steps}")
        return ("task=lm", *steps, *args.lm_overrides.split())
    return ("model=mlp", "dataset=digits", f"epochs={args.epochs}")


def load_average() -> float:
    return os.getloadavg()[0]


def cpu_seconds() -> float:
    """This process's CPU time so far (user and system, every thread)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def train_one(job: str, precision: str, overrides: tuple[str, ...]) -> dict[str, Any]:
    """One run's figures (module doc)."""
    from benchmarks.mptrain_api import train

    cfg = compose(*COMMON, *overrides, *PRECISIONS[precision])
    load_before, cpu_before = load_average(), cpu_seconds()
    with tempfile.TemporaryDirectory() as tmp:
        report = train(cfg, Path(tmp))
    cpu_s = cpu_seconds() - cpu_before
    t, e = report.throughput, report.evaluation
    row: dict[str, Any] = {
        "job": job,
        "precision": precision,
        "label": report.precision.label,
        "status": report.status,
        "steps": report.training.steps,
        "final_train_loss": report.training.final_train_loss,
        "final_val_loss": e.final_val_loss,
        "final_val_accuracy": e.final_val_accuracy if job == "classify" else None,
        "step_time_ms": 1000 * t.measured_time_s / t.measured_steps if t.measured_steps else None,
        # CPU time of the whole job (build and evaluation included) per step: steadier than
        # wall time on a machine others share
        "cpu_ms_per_step": 1000 * cpu_s / max(report.training.steps, 1),
        "load_before": load_before,
        "load_after": load_average(),
    }
    if report.blocks:
        row["converted_linear_flops_share"] = report.blocks["converted_linear_flops_share"]
    return row


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Per job: the validation loss's difference to FP32's and the step time's ratio to it."""
    for row in rows:
        base = next((r for r in rows if r["job"] == row["job"] and r["precision"] == "fp32"), {})
        ok = row.get("final_val_loss") is not None and base.get("final_val_loss") is not None
        row["val_loss_vs_fp32"] = row["final_val_loss"] - base["final_val_loss"] if ok else None
        for key in ("step_time_ms", "cpu_ms_per_step"):
            timed = row.get(key) and base.get(key)
            ratio = key.replace("_ms", "").replace("_per_step", "") + "_vs_fp32"
            row[ratio] = row[key] / base[key] if timed else None


def _num(x: float | None, spec: str) -> str:
    return "" if x is None else format(x, spec)


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| job | precision | steps | final train loss | final val loss | vs FP32 | val accuracy "
        "| step ms | × FP32 | job CPU ms/step | × FP32 | load |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['job']} | {r['precision']} | failed: {r['error']} |||||||||")
            continue
        accuracy = _num(r["final_val_accuracy"] and 100 * r["final_val_accuracy"], ".1f")
        name = r["precision"] + (" (emulated)" if r["label"].endswith("(emulated)") else "")
        lines.append(
            f"| {r['job']} | {name} | {r['steps']} | {_num(r['final_train_loss'], '.4f')} "
            f"| {_num(r['final_val_loss'], '.4f')} | {_num(r['val_loss_vs_fp32'], '+.4f')} "
            f"| {accuracy + '%' if accuracy else ''} | {_num(r['step_time_ms'], '.1f')} "
            f"| {_num(r['step_time_vs_fp32'], '.2f')} | {_num(r['cpu_ms_per_step'], '.1f')} "
            f"| {_num(r['cpu_vs_fp32'], '.2f')} | {r['load_before']:.1f}–{r['load_after']:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", default="lm,classify")
    parser.add_argument("--precisions", default=",".join(PRECISIONS))
    parser.add_argument("--lm-steps", type=int, default=300)
    parser.add_argument("--lm-overrides", default="", help="overrides of the lm job only")
    parser.add_argument("--epochs", type=int, default=15)
    # One thread by default: two threads on a 2-core machine others use collapse (each waits on
    # the other's core) and their spin-waits fill the CPU time; one thread keeps its core.
    parser.add_argument("--threads", default="1", help="mptrain's threads= for every run")
    parser.add_argument("--out", type=Path)
    parser.add_argument("extra", nargs="*", help="overrides for every run (after --)")
    args = parser.parse_args(argv)
    precisions = args.precisions.split(",")
    unknown = [p for p in precisions if p not in PRECISIONS]
    if unknown or "fp32" not in precisions:
        parser.error(f"--precisions: fp32 and any of {', '.join(PRECISIONS)}; got {unknown}")
    doc: dict[str, Any] = {
        "hardware": hardware_info(CPU),
        "versions": software_versions(),
        "args": {k: str(v) for k, v in vars(args).items()},
        "rows": [],
    }
    for job in args.jobs.split(","):
        overrides = (*job_overrides(job, args), f"threads={args.threads}", *args.extra)
        for precision in precisions:
            try:
                row = train_one(job, precision, overrides)
            except Exception as exc:  # a failed row is recorded, the others still run
                row = {"job": job, "precision": precision, "error": error_text(exc)}
            doc["rows"].append(row)
            print(f"{job} {precision}: {row}", file=sys.stderr, flush=True)
            write_json(args.out, doc)
    add_ratios([r for r in doc["rows"] if "error" not in r])
    doc["markdown"] = markdown(doc["rows"])
    write_json(args.out, doc)
    print(doc["markdown"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
