"""FP8 on a real GPU: torch._scaled_mm against mptrain's emulation, then FP8 vs BF16 training.

For one NVIDIA GPU of compute capability >= 8.9 (H100/H200/L4/RTX 40xx); runs in a few minutes:

    python benchmarks/gpu_fp8_check.py [--out benchmarks/results/gpu_fp8_check.json]

1. GEMM agreement: random matrices quantized to FP8 (E4M3 x E4M3 and E5M2 x E4M3), multiplied by
   ``torch._scaled_mm`` and by the emulation (FP8 values in FP32, FP32 matmul, one rescale). The two
   must agree to BF16 rounding: both see the same FP8 operands.
2. Training: a Linear-heavy MLP (hidden 4096) on synthetic class-prototype data, BF16 autocast vs
   precision=fp8 (real GEMMs), same seed and data; prints samples/s of both (after warm-up, CUDA
   events) and the loss curves' mean absolute difference.

Prints a JSON document with the date, hardware and versions; --out also writes it to a file.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import sys
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
from mptrain.hardware import hardware_info, software_versions
from mptrain.models import build_mlp


def sqnr_db(reference: torch.Tensor, other: torch.Tensor) -> float:
    noise = (reference.float() - other.float()).pow(2).sum()
    return float(10 * torch.log10(reference.float().pow(2).sum() / noise.clamp(min=1e-30)))


def gemm_agreement(device: torch.device) -> list[dict]:
    rows = []
    for m, k, n in ((128, 256, 512), (1000, 2048, 4096), (4096, 4096, 4096)):
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
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for step in range(steps):
        if step == warmup:
            start.record()
        labels = torch.randint(0, classes, (batch,), device=device, generator=generator)
        x = prototypes[labels] + torch.randn(batch, in_features, device=device, generator=generator)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x.view(batch, 1, 32, 32)), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1000
    return {
        "precision": "fp8" if fp8 else "bf16",
        "samples_per_s": (steps - warmup) * batch / seconds,
        "losses": [float(v) for v in losses],
        "converted_flops_share": section["converted_linear_flops_share"] if section else None,
        "peak_memory_bytes": torch.cuda.max_memory_allocated(device),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=8192)
    parser.add_argument("--width", type=int, default=4096)
    args = parser.parse_args()
    device = torch.device("cuda")
    if not torch.cuda.is_available() or not fp8_gemm_available(device):
        print("needs an NVIDIA GPU of compute capability >= 8.9", file=sys.stderr)
        return 2
    result = {
        "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "hardware": hardware_info(device),
        "versions": software_versions(),
        "gemm_agreement": gemm_agreement(device),
    }
    runs = []
    for fp8 in (False, True):
        torch.cuda.reset_peak_memory_stats(device)
        runs.append(train_throughput(device, fp8, args.steps, 20, args.batch, args.width))
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
