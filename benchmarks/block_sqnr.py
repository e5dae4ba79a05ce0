"""SQNR of each block-scaled format against FP32 on a Linear's three GEMMs, beside mptrain's
tensorwise and rowwise FP8.

    python -m benchmarks.block_sqnr [--rows 512] [--features 1024] [--outliers 1,1e3] [--out FILE]

A Linear layer (``features -> features``, FP32, nn.Linear's initialisation) takes ``rows``
activations N(0, 1), of which one row in 16 is ``outlier`` times larger (as the massive
activations of large transformers; 1: none), and an output gradient N(0, 1). Each format runs the
three GEMMs, out = x Wᵀ, dx = dy W and dW = dyᵀ x, from operands quantized along that GEMM's
reduction dimension and dequantized (the emulation: the numerics of the block-scaled GEMM up to
FP32 rounding), the products in FP32; each result is compared with the FP32 layer's as a
signal-to-quantization-noise ratio (SQNR, dB, higher is better):

- ``fp8 tensorwise`` / ``fp8 rowwise``: mptrain's Float8Linear (E4M3 forward, E5M2 gradients,
  dynamic scaling, emulated), one scale per tensor / per row;
- ``mxfp8 floor`` / ``mxfp8 rceil``: E4M3 everywhere, blocks of 32, E8M0 scales (torchao's MXFP8
  training recipe);
- ``nvfp4 1x16``: every operand in blocks of 16 with the per-tensor scale, rounded to nearest;
- ``nvfp4 16x16 w``: the same with the weight in 16x16 tiles (one quantized weight for both GEMMs);
- ``nvfp4 + rht``: and the random Hadamard transform on dW's operands (along the tokens);
- ``nvfp4 recipe``: NVIDIA's (arXiv 2509.25149, without its BF16 layers): all of the above and
  stochastic rounding of the output gradient (unbiased, at the cost of some SQNR);
- ``blockwise fp8``: 1x128 tiles, 128x128 weight blocks, E4M3 (DeepSeek-V3).

Prints a table per outlier size and, with --out, writes every figure. Deterministic (seeded);
CPU only, seconds.

Reading the figures: N(0, 1) data is unchanged in distribution by an orthogonal transform, so the
Hadamard transform gains nothing here (it spreads outliers inside a block); stochastic rounding
costs SQNR by design (its point is an unbiased gradient). With 1024 features nn.Linear's
weights are uniform in ±2^-5, a power of two: most 32-element blocks have their amax just below
it, in the top 3/16 of the binade where ``floor``'s scale saturates (98k of the 1M weights),
and MXFP8 ``floor`` loses about 4 dB on out and dx (``--features 768``: 28.1 dB vs 28.6 for
``rceil``).
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from benchmarks.fp8_rowwise_sqnr import (
    EVERY,
    linear_gemms,
    parse_outliers,
    sqnr_db,
)
from benchmarks.jsondoc import write_json
from benchmarks.mptrain_api import (
    Float8Linear,
    FP8Quantization,
    fake_quant_blockwise,
    fake_quant_mx,
    fake_quant_nvfp4,
    random_hadamard_transform,
    rht_signs,
    software_versions,
)

# quant(tensor, dim, role, gemm): the tensor fake-quantized along dim; role is "x", "w" or "dy",
# gemm "out", "dx" or "dW".
Quantizer = Callable[[torch.Tensor, int, str, str], torch.Tensor]


def three_gemms(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, quant: Quantizer) -> dict:
    """out, dx and dW of a Linear from operands quantized along each GEMM's reduction dim."""
    return {
        "out": quant(x, 1, "x", "out") @ quant(w, 1, "w", "out").t(),
        "dx": quant(dy, 1, "dy", "dx") @ quant(w, 0, "w", "dx"),
        "dW": quant(dy, 0, "dy", "dW").t() @ quant(x, 0, "x", "dW"),
    }


def nvfp4_recipe(generator: torch.Generator | None) -> Quantizer:
    """NVIDIA's NVFP4 choices per operand (see the module docstring); without ``generator``,
    without stochastic rounding."""
    signs = rht_signs(0)

    def quant(t: torch.Tensor, dim: int, role: str, gemm: str) -> torch.Tensor:
        if gemm == "dW":  # the Hadamard transform along the tokens, on both of dW's operands
            t = random_hadamard_transform(t, signs, dim)
        return fake_quant_nvfp4(
            t, dim, tile_2d=role == "w", generator=generator if role == "dy" else None
        )

    return quant


def block_quantizers() -> dict[str, Quantizer]:
    """Each block format's quantizer."""
    generator = torch.Generator().manual_seed(0)
    return {
        "mxfp8 floor": lambda t, dim, role, gemm: fake_quant_mx(t, dim, rounding="floor"),
        "mxfp8 rceil": lambda t, dim, role, gemm: fake_quant_mx(t, dim, rounding="rceil"),
        "nvfp4 1x16": lambda t, dim, role, gemm: fake_quant_nvfp4(t, dim),
        "nvfp4 16x16 w": lambda t, dim, role, gemm: fake_quant_nvfp4(t, dim, tile_2d=role == "w"),
        "nvfp4 + rht": nvfp4_recipe(None),
        "nvfp4 recipe": nvfp4_recipe(generator),
        "blockwise fp8": lambda t, dim, role, gemm: fake_quant_blockwise(
            t, dim, tile_2d=role == "w"
        ),
    }


def float8_gemms(reference: nn.Linear, granularity: str, x: torch.Tensor, dy: torch.Tensor) -> dict:
    """out, dx and dW of mptrain's Float8Linear (emulated) with the reference's weights."""
    layer = Float8Linear.from_linear(
        copy.deepcopy(reference), FP8Quantization(granularity=granularity)
    )
    return linear_gemms(layer, x, dy)


def measure(rows: int, features: int, outlier: float) -> list[dict]:
    """One row of SQNRs per format, against the FP32 layer, for one outlier size."""
    torch.manual_seed(0)
    reference = nn.Linear(features, features, bias=False)
    w = reference.weight.detach()
    x = torch.randn(rows, features)
    x[::EVERY] *= outlier
    dy = torch.randn(rows, features)
    exact = three_gemms(x, w, dy, lambda t, dim, role, gemm: t)
    results = {g: float8_gemms(reference, g, x, dy) for g in ("tensorwise", "rowwise")}
    results = {f"fp8 {g}": r for g, r in results.items()}
    results |= {name: three_gemms(x, w, dy, q) for name, q in block_quantizers().items()}
    return [
        {"outlier": outlier, "format": name, **{k: sqnr_db(exact[k], v[k]) for k in exact}}
        for name, v in results.items()
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--features", type=int, default=1024)
    parser.add_argument("--outliers", default="1,1e3")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    outliers = parse_outliers(parser, args.outliers)
    if args.rows % 128 or args.features % 128:
        parser.error("--rows and --features: multiples of 128 (blockwise FP8's blocks)")
    rows = [r for o in outliers for r in measure(args.rows, args.features, o)]
    print(f"Linear {args.features}->{args.features}, {args.rows} rows, SQNR dB vs FP32")
    print(f"{'outlier':>8} {'format':>14} {'out':>6} {'dx':>6} {'dW':>6}")
    for r in rows:
        print(
            f"{r['outlier']:>8g} {r['format']:>14} {r['out']:>6.2f} {r['dx']:>6.2f} {r['dW']:>6.2f}"
        )
    write_json(args.out, {"versions": software_versions(), "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
