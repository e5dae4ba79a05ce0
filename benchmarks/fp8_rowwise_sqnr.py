"""FP8 accuracy with one scale per tensor vs one per row, on activations with outlier rows.

    python -m benchmarks.fp8_rowwise_sqnr [--outliers 1,1e2,1e3,1e4,1e5,1e6] [--out FILE]

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
import math
from pathlib import Path

import torch
from torch import nn

from benchmarks.jsondoc import write_json
from benchmarks.mptrain_api import Float8Linear, FP8Quantization, software_versions

ROWS, FEATURES, EVERY = 512, 1024, 16


def sqnr_db(reference: torch.Tensor, other: torch.Tensor) -> float:
    ref, out = reference.double(), other.double()
    noise = (ref - out).pow(2).sum().item()
    return math.inf if noise == 0 else 10 * math.log10(ref.pow(2).sum().item() / noise)


def linear_gemms(layer: nn.Module, x: torch.Tensor, dy: torch.Tensor) -> dict[str, torch.Tensor]:
    """A Linear layer's three GEMMs as autograd runs them: its output for ``x`` (``out``), and
    the gradients of ``x`` (``dx``) and of its weight (``dW``) for the output gradient ``dy``."""
    inputs = x.clone().requires_grad_()
    out = layer(inputs)
    out.backward(dy)
    return {"out": out.detach(), "dx": inputs.grad, "dW": layer.weight.grad}


def parse_outliers(parser: argparse.ArgumentParser, text: str) -> list[float]:
    """``--outliers``' comma-separated numbers; the parser's error (exit 2) for anything else."""
    try:
        return [float(v) for v in text.split(",")]
    except ValueError:
        parser.error(f"--outliers {text!r}: comma-separated numbers")


def measure(outlier: float, granularity: str) -> dict[str, float]:
    """SQNRs of one FP8 layer against the FP32 layer, for one outlier size."""
    torch.manual_seed(0)
    reference = nn.Linear(FEATURES, FEATURES)
    layer = Float8Linear.from_linear(
        copy.deepcopy(reference), FP8Quantization(granularity=granularity)
    )
    x = torch.randn(ROWS, FEATURES)
    x[::EVERY] *= outlier
    grad_out = torch.randn(ROWS, FEATURES)
    exact, fp8 = (linear_gemms(module, x, grad_out) for module in (reference, layer))
    ordinary = torch.ones(ROWS, dtype=torch.bool)
    ordinary[::EVERY] = False
    return {
        "out_ordinary_rows": sqnr_db(exact["out"][ordinary], fp8["out"][ordinary]),
        **{k: sqnr_db(exact[k], fp8[k]) for k in ("out", "dx", "dW")},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--outliers", default="1,1e2,1e3,1e4,1e5,1e6")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    outliers = parse_outliers(parser, args.outliers)
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
    write_json(args.out, {"versions": software_versions(), "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
