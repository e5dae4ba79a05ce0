"""FP8 on a real GPU: torch._scaled_mm against mptrain's emulation, then FP8 vs BF16 training.

For one NVIDIA GPU of compute capability >= 8.9 (H100/H200/L4/RTX 40xx); runs in a few minutes:

    python benchmarks/gpu_fp8_check.py [--out benchmarks/results/gpu_fp8_check.json]

1. GEMM agreement: random matrices quantized to FP8 (E4M3 x E4M3 and E5M2 x E4M3), multiplied by
   ``torch._scaled_mm`` and by the emulation (FP8 values in FP32, FP32 matmul, one rescale). The two
   must agree to BF16 rounding: both see the same FP8 operands.
2. Training: a Linear-heavy MLP (hidden 4096) on synthetic class-prototype data, BF16 autocast vs
   precision=fp8 (real GEMMs), same seed and data; prints samples/s of both (after warm-up,
   timed between device synchronisations) and the loss curves' mean absolute difference.

Prints a JSON document with the date, hardware and versions; --out also writes it to a file.

``--device cpu --gemm-shapes 64x128x256 --steps 4 --warmup 2 --batch 64 --width 64`` runs the same
code on a CPU in seconds, through torch's CPU ``_scaled_mm`` (a correctness smoke run, not FP8
hardware: the test suite runs it so the script is known to work before GPU time is spent on it).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from mptrain.config import MLPConfig
from mptrain.fp8 import (
    E4M3,
    E5M2,
    FP8Recipe,
    apply_fp8,
    fp8_gemm,
    fp8_gemm_available,
    quantize,
    scale_from_amax,
)
from mptrain.hardware import (
    hardware_info,
    peak_memory_bytes,
    reset_peak_memory,
    software_versions,
    synchronize,
)
from mptrain.models import build_mlp


def sqnr_db(reference: torch.Tensor, other: torch.Tensor) -> float:
    noise = (reference.float() - other.float()).pow(2).sum()
    return float(10 * torch.log10(reference.float().pow(2).sum() / noise.clamp(min=1e-30)))


def gemm_agreement(device: torch.device, shapes: list[tuple[int, int, int]]) -> list[dict]:
    rows = []
    for m, k, n in shapes:
        for a_dtype in (E4M3, E5M2):
            a = torch.randn(m, k, device=device)
            b = torch.randn(n, k, device=device) * 0.02  # weight-like, stored (N, K) row-major
            sa = scale_from_amax(a.abs().max(), a_dtype)
            sb = scale_from_amax(b.abs().max(), E4M3)
            a8, b8 = quantize(a, sa, a_dtype), quantize(b, sb, E4M3)
            real = fp8_gemm(a8, sa, b8.t(), sb, torch.bfloat16, real=True)
            emulated = fp8_gemm(a8, sa, b8.t(), sb, torch.bfloat16, real=False)
            exact = a @ b.t()
            rows.append(
                {
                    "shape": [m, k, n],
                    "a_dtype": str(a_dtype).replace("torch.", ""),
                    "real_vs_emulated_sqnr_db": sqnr_db(emulated, real),
                    "real_vs_emulated_max_rel": float(
                        (real.float() - emulated.float()).abs().max() / emulated.float().abs().max()
                    ),
                    "real_vs_fp32_sqnr_db": sqnr_db(exact, real),
                }
            )
    return rows


def train_throughput(
    device: torch.device, fp8: bool, steps: int, warmup: int, batch: int, width: int
) -> dict:
    torch.manual_seed(0)
    in_features, classes = 1024, 16
    model = build_mlp(MLPConfig(hidden_sizes=[width] * 4), 1, 32, classes).to(device)
    section = None
    if fp8:
        section = apply_fp8(
            model,
            FP8Recipe(real_gemm=True),
            torch.randn(2, 1, 32, 32, device=device),
            include=[],
            exclude=[],
            keep_first_last=True,
        )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    generator = torch.Generator(device=device).manual_seed(1)
    prototypes = torch.randn(classes, in_features, device=device, generator=generator)
    losses = []
    reset_peak_memory(device)
    start = None
    for step in range(steps):
        if step == warmup:
            synchronize(device)
            start = time.perf_counter()
        labels = torch.randint(0, classes, (batch,), device=device, generator=generator)
        x = prototypes[labels] + torch.randn(batch, in_features, device=device, generator=generator)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x.view(batch, 1, 32, 32)), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    synchronize(device)
    seconds = time.perf_counter() - start
    return {
        "precision": "fp8" if fp8 else "bf16",
        "samples_per_s": (steps - warmup) * batch / seconds,
        "losses": [float(v) for v in losses],
        "converted_flops_share": section["converted_linear_flops_share"] if section else None,
        "peak_memory_bytes": peak_memory_bytes(device),
    }


def parse_shapes(text: str) -> list[tuple[int, int, int]]:
    """ "MxKxN,MxKxN" -> [(M, K, N), ...]."""
    shapes = [tuple(int(d) for d in shape.split("x")) for shape in text.split(",")]
    if any(len(shape) != 3 for shape in shapes):
        raise ValueError(text)
    return shapes  # type: ignore[return-value]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=8192)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--gemm-shapes", default="128x256x512,1000x2048x4096,4096x4096x4096")
    parser.add_argument("--device", default="cuda", help="cuda (the check) | cpu (a smoke run)")
    args = parser.parse_args()
    if not 0 <= args.warmup < args.steps:
        parser.error(f"--warmup {args.warmup} --steps {args.steps}: need 0 <= warmup < steps")
    try:
        shapes = parse_shapes(args.gemm_shapes)
    except ValueError:
        parser.error(f"--gemm-shapes {args.gemm_shapes!r}: expected MxKxN[,MxKxN...]")
    device = torch.device(args.device)
    if device.type == "cuda" and not (torch.cuda.is_available() and fp8_gemm_available(device)):
        print(
            "needs an NVIDIA GPU of compute capability >= 8.9 (or --device cpu for a smoke run)",
            file=sys.stderr,
        )
        return 2
    result = {
        "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "hardware": hardware_info(device),
        "versions": software_versions(),
        "note": None
        if device.type == "cuda"
        else "CPU smoke run: torch's CPU _scaled_mm, not FP8 hardware; the speeds mean nothing",
        "gemm_agreement": gemm_agreement(device, shapes),
    }
    runs = [
        train_throughput(device, fp8, args.steps, args.warmup, args.batch, args.width)
        for fp8 in (False, True)
    ]
    bf16, fp8 = runs
    diffs = [abs(a - b) for a, b in zip(bf16["losses"], fp8["losses"], strict=True)]
    result["training"] = {
        "model": f"MLP 1024 -> 4x{args.width} -> 16, batch {args.batch}, {args.steps} steps",
        "bf16_samples_per_s": bf16["samples_per_s"],
        "fp8_samples_per_s": fp8["samples_per_s"],
        "fp8_speedup": fp8["samples_per_s"] / bf16["samples_per_s"],
        "converted_flops_share": fp8["converted_flops_share"],
        "bf16_peak_memory_bytes": bf16["peak_memory_bytes"],
        "fp8_peak_memory_bytes": fp8["peak_memory_bytes"],
        "final_loss_bf16": bf16["losses"][-1],
        "final_loss_fp8": fp8["losses"][-1],
        "loss_curve_mean_abs_diff": sum(diffs) / len(diffs),
        "all_losses_finite": all(math.isfinite(v) for v in bf16["losses"] + fp8["losses"]),
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
