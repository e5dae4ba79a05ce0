"""Optimizer states in low precision against FP32 states: advise's paired TOST over seeds.

    python -m benchmarks.state_dtype_tost [--seeds 0,1,2] [--steps 150] [--width 512]
                                         [--variants bf16,bf16_stochastic,adamw8bit]
                                         [--margin 0.05] [--out benchmarks/results/state_dtype_tost_cpu.json]

The GPT (``task=lm`` on the embedded text; 2 layers of ``--width``, 4 heads, 64-token windows,
batch 16, AdamW, ``precision=fp32``) trained ``--steps`` steps per seed with AdamW's moments in
FP32 and with each variant: ``bf16`` (``optimizer.state_dtype=bf16``, rounded to nearest),
``bf16_stochastic`` (stochastic rounding) and ``adamw8bit`` (torchao's 8-bit AdamW; skipped
without torchao). Each seed's runs share initial weights and batches, so the final validation
losses are compared per seed: :func:`mptrain.commands.advise.confidence.paired_tost` (what
``mptrain advise`` decides its seeds with) against ±``--margin`` of FP32's mean, at α 0.05 (advise's verdict and words).
Each run also gives its optimizer-state bytes (the memory accounting) and the share of each
moment's updates lost to rounding (the probe, every 10 steps).
Prints advise's verdict per variant; --out writes every figure with the CPU and the date.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path
from typing import Any

from benchmarks.inprocess import CPU_JOB, cpu_document, train_report
from benchmarks.jsondoc import write_json

VARIANTS = {
    "fp32": ("optimizer=adamw",),
    "bf16": ("optimizer=adamw", "optimizer.state_dtype=bf16"),
    "bf16_stochastic": (
        "optimizer=adamw",
        "optimizer.state_dtype=bf16",
        "optimizer.state_rounding=stochastic",
    ),
    "adamw8bit": ("optimizer=adamw8bit",),
}
ALPHA = 0.05


def gpt(width: int, steps: int) -> tuple[str, ...]:
    return (
        *CPU_JOB,
        "task=lm",
        "precision=fp32",
        "model.layers=2",
        "model.heads=4",
        f"model.width={width}",
        "model.block_size=64",
        "batch_size=16",
        f"max_steps={steps}",
        f"eval_every={steps}",
        "probe_every=10",
        "threads=1",  # the same kernels in every run (and two runs could share the cores)
    )


def run_once(variant: str, seed: int, width: int, steps: int) -> dict[str, Any]:
    report = train_report(*gpt(width, steps), *VARIANTS[variant], f"seed={seed}")
    states = report["memory"]["accounted"]["bytes"]["optimizer_states"]
    return {
        "variant": variant,
        "seed": seed,
        "final_val_loss": report["evaluation"]["final_val_loss"],
        "state_bytes": sum(states.values()),
        "state_dtypes": report["optimizer"]["state_dtypes"],
        "states_lost_fraction": report["training"]["states_lost_fraction"],
        "training_s": report["time"]["training_s"],
    }


def verdicts(rows: list[dict[str, Any]], margin: float) -> list[dict[str, Any]]:
    """Per variant against FP32: advise's verdict on the per-seed final validation losses
    (paired TOST), with its words and the state bytes' ratio."""
    from benchmarks.mptrain_api import advise_verdict, verdict_words

    def of(variant: str) -> list[dict[str, Any]]:
        return sorted((r for r in rows if r["variant"] == variant), key=lambda r: r["seed"])

    fp32 = of("fp32")
    out = []
    for variant in [v for v in VARIANTS if v != "fp32" and of(v)]:
        runs = of(variant)
        losses = [r["final_val_loss"] for r in runs]
        v = advise_verdict(losses, [r["final_val_loss"] for r in fp32], margin, ALPHA, paired=True)
        out.append(
            {
                **dataclasses.asdict(v),
                "variant": variant,
                "words": verdict_words(variant + " states", v),
                "state_bytes_ratio": fp32[0]["state_bytes"] / runs[0]["state_bytes"],
            }
        )
    return out


def _lost(row: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v:.1%}" for k, v in (row["states_lost_fraction"] or {}).items())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--variants", default="bf16,bf16_stochastic,adamw8bit")
    parser.add_argument("--margin", type=float, default=0.05)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    variants = ["fp32", *args.variants.split(",")]
    unknown = [v for v in variants[1:] if v not in VARIANTS or v == "fp32"]
    if unknown:  # fp32 is the reference every seed pairs with: it runs once per seed anyway
        parser.error(f"--variants {','.join(unknown)}: one of {', '.join(list(VARIANTS)[1:])}")
    if "adamw8bit" in variants:
        try:
            import torchao  # noqa: F401
        except ImportError:
            print("adamw8bit skipped: torchao is not installed")
            variants.remove("adamw8bit")
    rows = []
    for seed in (int(s) for s in args.seeds.split(",")):
        for variant in variants:
            rows.append(run_once(variant, seed, args.width, args.steps))
            r = rows[-1]
            print(
                f"seed {seed} {variant}: val loss {r['final_val_loss']:.4f}, states "
                f"{r['state_bytes'] / 2**20:.2f} MiB, updates lost {_lost(r)}, "
                f"{r['training_s']:.0f} s",
                flush=True,
            )
            write_json(args.out, {"rows": rows, "partial": True})
    results = verdicts(rows, args.margin)
    for r in results:
        print(f"{r['words']}; states {r['state_bytes_ratio']:.2f}x smaller")
    arguments = {k: str(v) for k, v in vars(args).items()}
    write_json(args.out, cpu_document(arguments, started, rows=rows, verdicts=results))


if __name__ == "__main__":
    main()
