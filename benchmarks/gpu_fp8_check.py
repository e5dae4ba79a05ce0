"""FP8 on a real GPU: torch._scaled_mm against mptrain's emulation, then FP8 vs BF16 training.

For one NVIDIA GPU of compute capability >= 8.9 (H100/H200/L4/RTX 40xx); runs in a few minutes:

    python -m benchmarks.gpu_fp8_check [--out benchmarks/results/gpu_fp8_check.json]

1. GEMM agreement (``gemm_agreement``, the verdict; seconds): random matrices quantized to FP8
   (E4M3 x E4M3 and E5M2 x E4M3), with one scale per tensor and with rowwise scales (one per row
   of the left operand, per column of the right), multiplied by ``torch._scaled_mm`` and by the
   emulation (FP8 values in FP32, FP32 matmul, one rescale). The two must agree to BF16 rounding:
   both see the same FP8 operands.
   Block-scaled GEMMs (``block_gemms``, part of the verdict; seconds): per ``--block-shapes``
   shape, blockwise FP8 (1x128 activations x 128x128 weights; needs SM90) and MXFP8 and NVFP4
   (need SM100 or later) quantized by mptrain's recipes and multiplied by torch's block-scaled
   ``scaled_mm`` (mptrain.precision.quant.kernels) and by the emulation (dequantized operands, FP32
   matmul): their SQNR, and the seconds per call of both and of a BF16 matmul. A format the GPU
   lacks is a row ``skipped: needs SM100, this is SM90`` (printed), not a failure.
2. Forward GEMM speed (``forward_gemm``): per ``--speed-shapes`` shape and scaling, BF16 matmul vs
   ``torch._scaled_mm`` with accurate accumulation (``use_fast_accum=False``: every FP8 GEMM
   mptrain runs) and with fast accumulation (``use_fast_accum=True``: what torchao's float8 recipes
   use for the forward output GEMM), with the fast one's SQNR against the emulation.
3. Training: a Linear-heavy MLP (hidden 4096) on synthetic class-prototype data, same seed and
   data, in each of ``--variants``: BF16 autocast, FP8 with tensorwise and with rowwise scaling
   (real GEMMs, accurate accumulation), each eager and under ``torch.compile``
   (``--compile-backend``, inductor by default: FP8 speed needs the fused amax/cast kernels),
   eager ones first. Prints samples/s (after warm-up, timed between device synchronisations,
   compilation inside the warm-up), each FP8 variant's speed against BF16 of the same mode
   (eager/compiled), its loss curve's mean absolute difference, and for compiled variants the
   graph breaks torch._dynamo counted.

The JSON document (date, hardware, versions, the parts above) is rewritten into ``--out``
atomically after every part and every training variant, so a run stopped at any point keeps what
it measured; a GEMM row or training variant that raises is recorded with its ``error`` and the
rest go on. Printed in full at the end.

``--device cpu --gemm-shapes 64x128x256 --steps 4 --warmup 2 --batch 64 --width 64`` runs the same
code on a CPU in seconds, through torch's CPU ``_scaled_mm`` (a correctness smoke run, not FP8
hardware: the test suite runs it so the script is known to work before GPU time is spent on it).
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.jsondoc import (
    error_text,
    first_line,
    write_json,
)
from benchmarks.mptrain_api import (
    E4M3,
    E5M2,
    FORMAT_TABLE,
    TABLE_BLOCK_FORMATS,
    BlockQuantization,
    FP8Quantization,
    MLPConfig,
    apply_quantized,
    block_gemm,
    block_gemm_available,
    build_mlp,
    fp8_gemm,
    fp8_gemm_available,
    hardware_info,
    layer_rules,
    peak_memory_bytes,
    quantize,
    quantize_operand,
    reset_peak_memory,
    scale_from_amax,
    software_versions,
    synchronize,
    transposed,
)


def sqnr_db(reference: torch.Tensor, other: torch.Tensor) -> float:
    noise = (reference.float() - other.float()).pow(2).sum()
    return float(10 * torch.log10(reference.float().pow(2).sum() / noise.clamp(min=1e-30)))


def amax(t: torch.Tensor, rowwise: bool) -> torch.Tensor:
    """The tensor's amax, or (rowwise) one per row: shape (rows, 1)."""
    return t.abs().amax(dim=1, keepdim=True) if rowwise else t.abs().max()


def quantized_pair(
    device: torch.device, shape: tuple[int, int, int], rowwise: bool, a_dtype: torch.dtype
) -> tuple:
    """(a, b, a8, sa, b8, sb): random operands of ``a @ b.t()`` (rows of ``a`` spanning four
    decades) and their FP8 quantizations with tensorwise or rowwise scales."""
    m, k, n = shape
    a = torch.randn(m, k, device=device) * torch.logspace(-2, 2, m, device=device)[:, None]
    b = torch.randn(n, k, device=device) * 0.02  # weight-like, stored (N, K) row-major
    sa = scale_from_amax(amax(a, rowwise), a_dtype)  # () or (M, 1)
    sb = scale_from_amax(amax(b, rowwise), E4M3)  # () or (N, 1)
    return a, b, quantize(a, sa, a_dtype), sa, quantize(b, sb, E4M3), sb


def gemm_row(device: torch.device, shape: tuple, granularity: str, a_dtype: torch.dtype) -> dict:
    """One GEMM: ``torch._scaled_mm`` against the emulation and against FP32."""
    a, b, a8, sa, b8, sb = quantized_pair(device, shape, granularity == "rowwise", a_dtype)
    real = fp8_gemm(a8, sa, b8.t(), sb.t(), torch.bfloat16, real=True)
    emulated = fp8_gemm(a8, sa, b8.t(), sb.t(), torch.bfloat16, real=False)
    return {
        "real_vs_emulated_sqnr_db": sqnr_db(emulated, real),
        "real_vs_emulated_max_rel": float(
            (real.float() - emulated.float()).abs().max() / emulated.float().abs().max()
        ),
        "real_vs_fp32_sqnr_db": sqnr_db(a @ b.t(), real),
    }


def gemm_agreement(device: torch.device, shapes: list[tuple[int, int, int]]) -> list[dict]:
    """Every shape x scaling x left dtype; a GEMM that raises is a row with its ``error``."""
    rows = []
    for shape, granularity, a_dtype in itertools.product(
        shapes, ("tensorwise", "rowwise"), (E4M3, E5M2)
    ):
        row = {
            "shape": list(shape),
            "granularity": granularity,
            "a_dtype": str(a_dtype).replace("torch.", ""),
        }
        try:
            row.update(gemm_row(device, shape, granularity, a_dtype))
        except Exception as exc:  # recorded in the document, the other GEMMs still run
            row["error"] = error_text(exc)
        rows.append(row)
    return rows


# The block-scaled formats the GPU check multiplies, with the least SM their real GEMM needs.
BLOCK_FORMATS = {
    fmt: "SM{}{}".format(*FORMAT_TABLE[fmt].kernel.least) for fmt in TABLE_BLOCK_FORMATS
}


def block_skip(device: torch.device, fmt: str) -> str | None:
    """Why ``fmt``'s real GEMM does not run on ``device`` ("skipped: needs SM100, this is SM90"),
    or None when it does."""
    available, why = block_gemm_available(device, fmt)
    if available:
        return None
    if device.type == "cuda" and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(device)
        here = f"SM{major}{minor}"
    else:
        here = f"the {device.type.upper()}"
    return f"skipped: needs {BLOCK_FORMATS[fmt]}, this is {here} ({why})"


def block_gemm_row(device: torch.device, fmt: str, shape: tuple, repeats: int) -> dict:
    """One block-scaled format and shape: the real GEMM against the emulation (SQNR, the largest
    difference over the largest value) and against FP32, and the seconds per call of the real
    GEMM, the emulated one (its FP32 matmul of the dequantized operands) and a BF16 matmul,
    operands quantized once beforehand (mptrain's recipe: activation x weight, as the forward)."""
    m, k, n = shape
    a = torch.randn(m, k, device=device) * torch.logspace(-2, 2, m, device=device)[:, None]
    b = torch.randn(n, k, device=device) * 0.02
    recipe = BlockQuantization(fmt, weight_tiles=True)  # NVFP4: its recipe's 16x16 weight tiles
    a_q, b_q = quantize_operand(recipe, a, 1, "input"), quantize_operand(recipe, b, 1, "weight")
    a_e, b_e = a_q.dequantize(torch.float32), b_q.dequantize(torch.float32).t()
    real_recipe = BlockQuantization(fmt, real_gemm=True)

    def real() -> torch.Tensor:
        return block_gemm(a_q, transposed(b_q), torch.bfloat16, real_recipe)

    def emulated() -> torch.Tensor:
        return block_gemm(a_e, b_e, torch.bfloat16, recipe)

    got, want = real(), emulated()
    a16, b16 = a.bfloat16(), b.bfloat16()
    seconds = {
        "real": seconds_per_call(device, real, repeats),
        "emulated": seconds_per_call(device, emulated, repeats),
        "bf16": seconds_per_call(device, lambda: a16 @ b16.t(), repeats),
    }
    flops = 2 * math.prod(shape)
    return {
        "real_vs_emulated_sqnr_db": sqnr_db(want, got),
        "real_vs_emulated_max_rel": float(
            (got.float() - want.float()).abs().max() / want.float().abs().max()
        ),
        "real_vs_fp32_sqnr_db": sqnr_db(a @ b.t(), got),
        "seconds_per_call": seconds,
        "tflops": {name: flops / s / 1e12 for name, s in seconds.items()},
        "real_speedup_vs_emulated": seconds["emulated"] / seconds["real"],
        "real_speedup_vs_bf16": seconds["bf16"] / seconds["real"],
    }


def block_gemms(device: torch.device, shapes: list[tuple[int, int, int]], repeats: int) -> list:
    """:func:`block_gemm_row` per format and shape where the GPU has the format's kernel, else a
    ``skipped`` row (printed); one that raises is a row with its ``error``."""
    rows = []
    for fmt, shape in itertools.product(BLOCK_FORMATS, shapes):
        row: dict = {"format": fmt, "shape": list(shape)}
        skip = block_skip(device, fmt)
        if skip:
            print(f"block GEMM {fmt} {'x'.join(map(str, shape))}: {skip}", flush=True)
            row["skipped"] = skip
        else:
            try:
                row.update(block_gemm_row(device, fmt, shape, repeats))
            except Exception as exc:  # recorded in the document, the other formats still run
                row["error"] = error_text(exc)
        rows.append(row)
    return rows


def seconds_per_call(device: torch.device, call: Callable[[], object], repeats: int) -> float:
    """Mean seconds of ``call()`` over ``repeats`` calls after three warm-up calls, timed between
    device synchronisations."""
    for _ in range(3):
        call()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        call()
    synchronize(device)
    return (time.perf_counter() - start) / repeats


def speed_row(device: torch.device, shape: tuple, granularity: str, repeats: int) -> dict:
    """One forward GEMM shape: TFLOP/s of BF16, of FP8 with accurate and with fast accumulation
    (E4M3 operands), the speed-ups over BF16 and the fast accumulation's SQNR vs the emulation."""
    a, b, a8, sa, b8, sb = quantized_pair(device, shape, granularity == "rowwise", E4M3)
    a16, b16 = a.bfloat16(), b.bfloat16()
    a_inv, b_inv = sa.reciprocal(), sb.reciprocal().t()

    def fp8(fast: bool) -> torch.Tensor:
        return torch._scaled_mm(
            a8, b8.t(), scale_a=a_inv, scale_b=b_inv, out_dtype=torch.bfloat16,
            use_fast_accum=fast,
        )  # fmt: skip

    flops = 2 * math.prod(shape)
    seconds = {
        "bf16": seconds_per_call(device, lambda: a16 @ b16.t(), repeats),
        "fp8": seconds_per_call(device, lambda: fp8(False), repeats),
        "fp8_fast_accum": seconds_per_call(device, lambda: fp8(True), repeats),
    }
    emulated = fp8_gemm(a8, sa, b8.t(), sb.t(), torch.bfloat16, real=False)
    return {
        "tflops": {name: flops / s / 1e12 for name, s in seconds.items()},
        "fp8_speedup_vs_bf16": seconds["bf16"] / seconds["fp8"],
        "fp8_fast_accum_speedup_vs_bf16": seconds["bf16"] / seconds["fp8_fast_accum"],
        "fast_accum_vs_emulated_sqnr_db": sqnr_db(emulated, fp8(True)),
    }


def forward_gemm(device: torch.device, shapes: list[tuple[int, int, int]], repeats: int) -> list:
    """:func:`speed_row` per shape and scaling; one that raises is a row with its ``error``."""
    rows = []
    for shape, granularity in itertools.product(shapes, ("tensorwise", "rowwise")):
        row: dict = {"shape": list(shape), "granularity": granularity}
        try:
            row.update(speed_row(device, shape, granularity, repeats))
        except Exception as exc:  # recorded in the document, the other shapes still run
            row["error"] = error_text(exc)
        rows.append(row)
    return rows


VARIANTS = {  # name: (FP8 granularity or None for BF16, compiled)
    "bf16": (None, False),
    "fp8": ("tensorwise", False),
    "fp8_rowwise": ("rowwise", False),
    "bf16_compiled": (None, True),
    "fp8_compiled": ("tensorwise", True),
    "fp8_rowwise_compiled": ("rowwise", True),
}


@dataclass(frozen=True)
class Sizes:
    steps: int
    warmup: int
    batch: int
    width: int


def build_variant(name: str, device: torch.device, width: int, backend: str) -> tuple:
    """(model to train, its parameters, fp8 section or None) for one of VARIANTS."""
    granularity, compiled = VARIANTS[name]
    torch.manual_seed(0)
    model = build_mlp(MLPConfig(hidden_sizes=[width] * 4), 1, 32, 16).to(device)
    section = None
    if granularity is not None:
        fp8_recipe = FP8Quantization(granularity=granularity, real_gemm=True)
        section = apply_quantized(
            model,
            fp8_recipe,
            torch.randn(2, 1, 32, 32, device=device),
            layer_rules(fp8_recipe, [], [], True),
        )
    parameters = list(model.parameters())
    if compiled:
        model = torch.compile(model, backend=backend)
    return model, parameters, section


def graph_breaks() -> dict:
    """What torch._dynamo counted since its counters were cleared: graph breaks (with up to five
    of their reasons) and graphs compiled. A compiled FP8 variant that breaks its graph runs the
    pieces between breaks eagerly, so its speed is not the compiled speed it claims."""
    from torch._dynamo.utils import counters

    reasons = counters["graph_break"]
    return {
        "graph_breaks": sum(reasons.values()),
        "graph_break_reasons": [first_line(reason) for reason, _ in reasons.most_common(5)],
        "graphs": counters["stats"]["unique_graphs"],
    }


def train_throughput(device: torch.device, name: str, sizes: Sizes, backend: str) -> dict:
    """Train one variant on the same synthetic data; samples/s after the warm-up (which holds
    the compilation of compiled variants), the losses, the peak memory and (compiled variants)
    the graph breaks."""
    in_features, classes = 1024, 16
    compiled = VARIANTS[name][1]
    if compiled:  # counts and compiled code of this variant only
        from torch import _dynamo
        from torch._dynamo.utils import counters

        _dynamo.reset()
        counters.clear()
    model, parameters, section = build_variant(name, device, sizes.width, backend)
    optimizer = torch.optim.AdamW(parameters, lr=1e-3, fused=True)
    generator = torch.Generator(device=device).manual_seed(1)
    prototypes = torch.randn(classes, in_features, device=device, generator=generator)
    batch, losses = sizes.batch, []
    reset_peak_memory(device)
    start = None
    for step in range(sizes.steps):
        if step == sizes.warmup:
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
        "variant": name,
        "samples_per_s": (sizes.steps - sizes.warmup) * batch / seconds,
        "losses": [float(v) for v in losses],
        "converted_flops_share": section["converted_linear_flops_share"] if section else None,
        "peak_memory_bytes": peak_memory_bytes(device),
        **(graph_breaks() if compiled else {}),
    }


def compare_with_bf16(runs: dict[str, dict]) -> dict[str, dict]:
    """Each FP8 variant against BF16 in the same mode (eager with eager, compiled with compiled):
    speed-up and the loss curves' mean absolute difference."""
    rows = {}
    for name, run in runs.items():
        baseline = runs.get("bf16_compiled" if VARIANTS[name][1] else "bf16")
        if VARIANTS[name][0] is None or baseline is None:
            continue
        diffs = [abs(a - b) for a, b in zip(baseline["losses"], run["losses"], strict=True)]
        rows[name] = {
            "vs": baseline["variant"],
            "speedup": run["samples_per_s"] / baseline["samples_per_s"],
            "loss_curve_mean_abs_diff": sum(diffs) / len(diffs),
        }
    return rows


def parse_shapes(text: str) -> list[tuple[int, int, int]]:
    """ "MxKxN,MxKxN" -> [(M, K, N), ...]."""
    shapes = [tuple(int(d) for d in shape.split("x")) for shape in text.split(",")]
    if any(len(shape) != 3 for shape in shapes):
        raise ValueError(text)
    return shapes  # type: ignore[return-value]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=8192)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--gemm-shapes", default="128x256x512,1000x2048x4096,4096x4096x4096")
    parser.add_argument("--speed-shapes", default="8192x4096x4096", help="forward GEMM MxKxN")
    parser.add_argument("--speed-repeats", type=int, default=50)
    parser.add_argument(
        "--block-shapes", default="256x512x384,4096x4096x4096", help="block-scaled GEMMs MxKxN"
    )
    parser.add_argument("--block-repeats", type=int, default=10)
    parser.add_argument("--device", default="cuda", help="cuda (the check) | cpu (a smoke run)")
    parser.add_argument(
        "--variants", default=",".join(VARIANTS), help="a subset of " + ",".join(VARIANTS)
    )
    parser.add_argument("--compile-backend", default="inductor", help="torch.compile backend")
    args = parser.parse_args()
    args.variants = args.variants.split(",")
    if not args.variants or any(v not in VARIANTS for v in args.variants):
        parser.error(f"--variants {','.join(args.variants)!r}: a subset of {','.join(VARIANTS)}")
    if not 0 <= args.warmup < args.steps:
        parser.error(f"--warmup {args.warmup} --steps {args.steps}: need 0 <= warmup < steps")
    try:
        args.gemm_shapes = parse_shapes(args.gemm_shapes)
        args.speed_shapes = parse_shapes(args.speed_shapes)
        args.block_shapes = parse_shapes(args.block_shapes)
    except ValueError as exc:
        parser.error(f"--gemm/speed/block-shapes {exc}: expected MxKxN[,MxKxN...]")
    return args


def training_section(args: argparse.Namespace, runs: dict, failed: dict) -> dict:
    """The document's ``training`` part from the variants run so far (``planned``: all asked)."""
    return {
        "model": f"MLP 1024 -> 4x{args.width} -> 16, batch {args.batch}, {args.steps} steps",
        "compile_backend": args.compile_backend,
        "use_fast_accum": False,  # mptrain's FP8 GEMMs: accurate accumulation (see forward_gemm)
        "planned": args.variants,
        "variants": {
            name: {
                "samples_per_s": run["samples_per_s"],
                "peak_memory_bytes": run["peak_memory_bytes"],
                "final_loss": run["losses"][-1],
                "converted_flops_share": run["converted_flops_share"],
                **{
                    k: run[k] for k in ("graph_breaks", "graph_break_reasons", "graphs") if k in run
                },
            }
            for name, run in runs.items()
        },
        "failed": failed,
        "vs_bf16": compare_with_bf16(runs),
        "all_losses_finite": all(math.isfinite(v) for run in runs.values() for v in run["losses"]),
    }


def main() -> int:
    args = parse_args()
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
        "accumulation": "training FP8 GEMMs: torch._scaled_mm use_fast_accum=False (accurate); "
        "forward_gemm also times use_fast_accum=True, torchao's forward choice",
    }
    result["gemm_agreement"] = gemm_agreement(device, args.gemm_shapes)
    write_json(args.out, result)  # the verdict first: kept whatever happens later
    result["block_gemms"] = block_gemms(device, args.block_shapes, args.block_repeats)
    write_json(args.out, result)
    result["forward_gemm"] = forward_gemm(device, args.speed_shapes, args.speed_repeats)
    write_json(args.out, result)
    sizes = Sizes(args.steps, args.warmup, args.batch, args.width)
    runs, failed = {}, {}
    for name in args.variants:  # one failing variant (a compile error, say) leaves the others
        try:
            runs[name] = train_throughput(device, name, sizes, args.compile_backend)
        except Exception as error:  # recorded in the document, not hidden
            failed[name] = error_text(error)
        result["training"] = training_section(args, runs, failed)
        write_json(args.out, result)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
