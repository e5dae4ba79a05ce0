"""Where one training step's bytes go, per precision: ``python -m benchmarks.memory``.

For the GPT (``task=lm``, mptrain's default shape) and ResNet-18 (32x32 synthetic images, batch 64)
under fp32, bf16 and fp8 (ResNet-18: fp16), the accounted bytes of each kind (``mptrain.train.memory``: parameters,
gradients, optimizer states, scales, buffers, parameter casts, activations) and the BF16/FP32
ratio of the saved activations. Then what fits an H100 (80 GB) per precision, optimizer-state
choice and activation checkpointing, as ``mptrain advise advise.target=h100`` predicts it
(:mod:`mptrain.commands.advise.fits`): one step's bytes at the benchmark's batch and the largest
micro-batch. Counted, not timed: the figures are the same on any CPU (CPU autocast's casts).
``--json PATH`` writes them too.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks import mptrain_api as mp
from benchmarks.jsondoc import write_json

MODELS = {  # name -> (overrides, precisions): ResNet-18's one Linear is kept whole under FP8
    "gpt": (("task=lm", "dataset.max_bytes=200000"), ("fp32", "bf16", "fp8")),
    "resnet18": (
        ("model=resnet18", "dataset=synthetic", "dataset.image_size=32", "batch_size=64"),
        ("fp32", "bf16", "fp16"),
    ),
}
COMMON = ("device=cpu", "threads=1", "precision.measure=false", "progress=false")


def mib(n: int) -> str:
    return f"{n / 2**20:.2f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    rows = []
    for model, (overrides, precisions) in MODELS.items():
        for precision in precisions:
            run = mp.prepare_run(mp.compose(*COMMON, *overrides, f"precision={precision}"))
            rows.append({"model": model, "precision": precision, **mp.account_step(run)})
    kinds = list(rows[0]["total"])
    print(
        "| model | precision | "
        + " | ".join(k.replace("_", " ") for k in kinds)
        + " | total (MiB) |"
    )
    print("|---|---|" + "---|" * (len(kinds) + 1))
    for r in rows:
        cells = " | ".join(mib(r["total"][k]) for k in kinds)
        print(f"| {r['model']} | {r['precision']} | {cells} | {mib(r['total_bytes'])} |")
    print()
    for model in MODELS:
        by = {r["precision"]: r for r in rows if r["model"] == model}
        ratio = by["bf16"]["total"]["activations"] / by["fp32"]["total"]["activations"]
        print(
            f"{model}: bf16/fp32 saved activations {ratio:.3f}; bf16 activations by dtype "
            f"{ {d: mib(n) for d, n in by['bf16']['bytes']['activations'].items()} } MiB"
        )
    fit_rows = what_fits()
    write_json(args.json, {"rows": rows, "fits": fit_rows})
    return 0


FIT_TARGET = "h100"
FIT_MODES = ("none", "full")
FIT_STATES = ("fp32", "bf16", "adamw8bit")


def what_fits() -> list[dict]:
    """Per model, precision, checkpointing mode and state choice: one step's bytes at the
    benchmark's batch and the largest micro-batch on :data:`FIT_TARGET`; printed as a table."""
    fits, footprint = mp.fits, mp.footprint
    usable = fits.usable_bytes(mp.gpus.row(FIT_TARGET).memory_gb)
    choices = {s.name: s for s in fits.STATE_CHOICES}
    out = []
    for model, (overrides, precisions) in MODELS.items():
        base = mp.compose(*COMMON, *overrides)
        states = None
        for precision in precisions[:2]:  # fp32 and bf16
            cfg = mp.compose(*COMMON, *overrides, f"precision={precision}")
            for mode in FIT_MODES:
                points, run = footprint.account_line(cfg, mode)
                line = fits.line_through({int(b): n for b, n in points.items()})
                if states is None:  # the moments do not depend on the autocast precision
                    states = {n: footprint.state_bytes(base, run, choices[n]) for n in FIT_STATES}
                for state in FIT_STATES:
                    moved = fits.Line(line.fixed - states["fp32"] + states[state], line.per_sample)
                    out.append(
                        {
                            "model": model,
                            "precision": precision,
                            "checkpointing": mode,
                            "state": state,
                            "batch": base.batch_size,
                            "bytes_at_batch": moved.at(base.batch_size),
                            "largest_batch": moved.largest_batch(usable),
                        }
                    )
    print(f"\nWhat fits an {FIT_TARGET} ({usable / 2**30:.1f} GiB usable), predicted:\n")
    print(
        "| model | precision | checkpointing | states | one step at its batch (MiB) | largest micro-batch |"
    )
    print("|---|---|---|---|---|---|")
    for r in out:
        print(
            f"| {r['model']} (batch {r['batch']}) | {r['precision']} | {r['checkpointing']} | "
            f"{r['state']} | {mib(r['bytes_at_batch'])} | {r['largest_batch']:,} |"
        )
    return out


if __name__ == "__main__":
    raise SystemExit(main())
