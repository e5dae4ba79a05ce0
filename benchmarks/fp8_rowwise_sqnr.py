"""FP8 accuracy with one scale per tensor vs one per row, on activations with outlier rows.

    python benchmarks/fp8_rowwise_sqnr.py [--outliers 1,1e2,1e3,1e4,1e5,1e6] [--out FILE]

A Linear layer (1024 -> 1024, FP32 weights) takes a batch of 512 activation rows of which one in 16
is ``outlier`` times larger, as the massive activations of large transformers are (one token's row
far above the others). The same layer in FP8 (hybrid formats, dynamic scaling, emulated: the
numerics of ``torch._scaled_mm``) runs with ``fp8.granularity=tensorwise`` and ``rowwise``; each
output and gradient is compared with the FP32 layer's as a signal-to-quantization-noise ratio
(SQNR, dB, higher is better):

- ``out ordinary rows``: the outputs of the rows that are not outliers. With one scale per tensor
  the outlier sets the scale and pushes the ordinary rows down into FP8's subnormals; rowwise gives
  each row its own scale.
- ``out``, ``dx``, ``dW``: whole tensors (dominated by the outlier rows' energy).

Prints a table and, with --out, writes every figure. Deterministic (seeded); CPU only, seconds.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
from pathlib import Path

import torch
from torch import nn

from mptrain.platform.hardware import software_versions
from mptrain.precision.fp8.linear import Float8Linear
from mptrain.precision.fp8.quant import FP8Recipe

ROWS, FEATURES, EVERY = 512, 1024, 16


def sqnr_db(reference: torch.Tensor, other: torch.Tensor) -> float:
    ref, out = reference.double(), other.double()
    noise = (ref - out).pow(2).sum().item()
    return math.inf if noise == 0 else 10 * math.log10(ref.pow(2).sum().item() / noise)


def measure(outlier: float, granularity: str) -> dict[str, float]:
    """SQNRs of one FP8 layer against the FP32 layer, for one outlier size."""
    torch.manual_seed(0)
    reference = nn.Linear(FEATURES, FEATURES)
    layer = Float8Linear.from_linear(copy.deepcopy(reference), FP8Recipe(granularity=granularity))
    x = torch.randn(ROWS, FEATURES)
    x[::EVERY] *= outlier
    grad_out = torch.randn(ROWS, FEATURES)
    results = []
    for module in (reference, layer):
        inputs = x.clone().requires_grad_()
        out = module(inputs)
        out.backward(grad_out)
        results.append((out.detach(), inputs.grad, module.weight.grad))
    (ref_out, ref_dx, ref_dw), (out, dx, dw) = results
    ordinary = torch.ones(ROWS, dtype=torch.bool)
    ordinary[::EVERY] = False
    return {
        "out_ordinary_rows": sqnr_db(ref_out[ordinary], out[ordinary]),
        "out": sqnr_db(ref_out, out),
        "dx": sqnr_db(ref_dx, dx),
        "dW": sqnr_db(ref_dw, dw),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--outliers", default="1,1e2,1e3,1e4,1e5,1e6")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    try:
        outliers = [float(v) for v in args.outliers.split(",")]
    except ValueError:
        parser.error(f"--outliers {args.outliers!r}: comma-separated numbers")
    rows = [
        {"outlier": o, "granularity": g, **measure(o, g)}
        for o in outliers
        for g in ("tensorwise", "rowwise")
    ]
    print(f"Linear {FEATURES}->{FEATURES}, {ROWS} rows, every {EVERY}th row x outlier; SQNR dB")
    print(f"{'outlier':>8} {'granularity':>11} {'out ordinary':>13} {'out':>6} {'dx':>6} {'dW':>6}")
    for r in rows:
        print(
            f"{r['outlier']:>8g} {r['granularity']:>11} {r['out_ordinary_rows']:>13.2f} "
            f"{r['out']:>6.2f} {r['dx']:>6.2f} {r['dW']:>6.2f}"
        )
    if args.out:
        doc = {"versions": software_versions(), "rows": rows}
        args.out.write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
