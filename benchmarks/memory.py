"""Where one training step's bytes go, per precision: ``python -m benchmarks.memory``.

For the GPT (``task=lm``, mptrain's default shape) and ResNet-18 (32x32 synthetic images, batch 64)
under fp32, bf16 and fp8 (ResNet-18: fp16), the accounted bytes of each kind (``mptrain.train.memory``: parameters,
gradients, optimizer states, scales, buffers, parameter casts, activations) and the BF16/FP32
ratio of the saved activations. Counted, not timed: the figures are the same on any CPU.
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
    write_json(args.json, {"rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
