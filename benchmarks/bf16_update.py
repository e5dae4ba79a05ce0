"""Pure BF16 with stochastic-rounded or Kahan-compensated updates against rounding to nearest.

    python -m benchmarks.bf16_update [--jobs mlp,gpt] [--mlp-steps 300] [--gpt-steps 200]
                                     [--lrs 3e-4,3e-3] [--fp32-seeds 1,2]
                                     [--out benchmarks/results/bf16_update_cpu.json]

Per job and peak learning rate, four whole runs through ``mptrain.train.job.train`` (build, loop,
evaluations, report), each from the same seed: ``precision=fp32``, then ``precision=bf16_pure``
with ``precision.update=nearest`` (torch's BF16 step), ``stochastic`` and ``kahan``. Jobs:

- ``mlp``: the MLP on digits (batch 64, AdamW, cosine schedule), ``--mlp-steps`` steps;
- ``gpt``: the small GPT (``task=lm``, 2 layers, width 64, block 64, batch 16) on the stdlib text,
  ``--gpt-steps`` steps.

The lost-update probe runs every step (``probe_every=1``): the share of non-zero gradients whose
update left no trace (nearest: the weight did not move; stochastic: the FP32 value it rounded from
equals the old weight; kahan: weight plus buffer unchanged). Figures per run: final validation
loss and its difference from FP32's, final training loss, the probe's mean, and training
samples/s of the same run without the probe (the loop's time, evaluation excluded; checked to
train the same; a shared 2-core machine makes it noisy).
``--fp32-seeds``: FP32 runs at other seeds too, what the differences are to be read against.
Prints a table; --out writes every figure with the CPU and the date.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from benchmarks.inprocess import CPU_JOB, SMALL_GPT, cpu_document, train_report
from benchmarks.jsondoc import write_json

# The MLP on digits, and the small GPT (benchmarks/contention.py's too).
JOBS = {"mlp": ("model=mlp", "dataset=digits"), "gpt": SMALL_GPT}
COMMON = (*CPU_JOB, "threads=1")  # no checkpoints, no thread measuring
VARIANTS = (("fp32", "nearest"), ("bf16_pure", "nearest"), ("bf16_pure", "stochastic"))
VARIANTS += (("bf16_pure", "kahan"),)


def run_report(job: str, lr: float, steps: int, *overrides: str) -> dict:
    """One whole run's report: ``job`` at peak learning rate ``lr`` with ``overrides``."""
    return train_report(*JOBS[job], *COMMON, f"max_steps={steps}", f"optimizer.lr={lr}", *overrides)


def run_once(job: str, precision: str, update: str, lr: float, steps: int) -> dict[str, Any]:
    """The figures of one variant (see module doc): a run probed every step for the losses and
    the probe, and the same run without the probe (its cost is not the update's) for the speed."""
    variant = (f"precision={precision}", f"precision.update={update}")
    report = run_report(job, lr, steps, *variant, "probe_every=1")
    timed = run_report(job, lr, steps, *variant, "probe_every=null")
    training = report["training"]
    if timed["training"]["final_train_loss"] != training["final_train_loss"]:
        raise RuntimeError(f"{job} {precision} {update}: the probe changed the training")
    return {
        "job": job,
        "lr": lr,
        "steps": steps,
        "precision": precision,
        "update": update,
        "final_val_loss": report["evaluation"]["final_val_loss"],
        "final_train_loss": training["final_train_loss"],
        "updates_lost_fraction": training["updates_lost_fraction"],
        "samples_per_s": timed["training"]["samples_seen"] / timed["time"]["training_s"],
    }


def measure(
    jobs: list[str], lrs: list[float], steps: dict[str, int], seeds: list[int], out: Path | None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(a row per job, lr and variant; FP32's final validation loss at each other seed)."""
    rows: list[dict[str, Any]] = []
    spread: list[dict[str, Any]] = []
    for job in jobs:
        for lr in lrs:
            for precision, update in VARIANTS:
                rows.append(run_once(job, precision, update, lr, steps[job]))
                print(_row_text(rows[-1]), flush=True)
                write_json(out, {"rows": rows, "partial": True})
            for seed in seeds:  # what FP32 alone varies by, to read the differences against
                report = run_report(job, lr, steps[job], "precision=fp32", f"seed={seed}")
                loss = report["evaluation"]["final_val_loss"]
                spread.append({"job": job, "lr": lr, "seed": seed, "final_val_loss": loss})
                print(f"{job} lr={lr:g} fp32 seed={seed}: val loss {loss:.4f}", flush=True)
    for row in rows:
        fp32 = next(
            r
            for r in rows
            if (r["job"], r["lr"], r["precision"]) == (row["job"], row["lr"], "fp32")
        )
        row["val_loss_minus_fp32"] = row["final_val_loss"] - fp32["final_val_loss"]
    return rows, spread


def _row_text(row: dict[str, Any]) -> str:
    return (
        f"{row['job']} lr={row['lr']:g} {row['precision']} {row['update']}: val loss "
        f"{row['final_val_loss']:.4f}, lost {row['updates_lost_fraction']:.2%}, "
        f"{row['samples_per_s']:.0f} samples/s"
    )


def render(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| job | lr | precision | update | val loss | − FP32 | train loss | updates lost "
        "| samples/s |",
        "|---|---:|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['job']} | {r['lr']:g} | {r['precision']} | {r['update']} "
            f"| {r['final_val_loss']:.4f} | {r['val_loss_minus_fp32']:+.4f} "
            f"| {r['final_train_loss']:.4f} | {r['updates_lost_fraction']:.2%} "
            f"| {r['samples_per_s']:.0f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", default="mlp,gpt")
    parser.add_argument("--lrs", default="3e-4,3e-3")
    parser.add_argument("--mlp-steps", type=int, default=300)
    parser.add_argument("--gpt-steps", type=int, default=200)
    parser.add_argument("--fp32-seeds", default="", help="FP32 runs at these seeds too: 1,2")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    jobs, lrs = args.jobs.split(","), [float(x) for x in args.lrs.split(",")]
    seeds = [int(x) for x in args.fp32_seeds.split(",") if x]
    steps = {"mlp": args.mlp_steps, "gpt": args.gpt_steps}
    rows, spread = measure(jobs, lrs, steps, seeds, args.out)
    print(render(rows))
    arguments = {k: str(v) for k, v in vars(args).items()}
    write_json(args.out, cpu_document(arguments, started, rows=rows, fp32_other_seeds=spread))


if __name__ == "__main__":
    main()
