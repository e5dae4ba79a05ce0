"""Predicted speed of a configured model on a named GPU: the roofline of each precision's step.

    python -m benchmarks.roofline --target h200 model=resnet50 model.small_stem=false \\
        dataset=synthetic dataset.image_size=224 dataset.num_classes=1000 batch_size=256 optimizer=sgd
    python -m benchmarks.roofline --target h100 --preset gpt     # benchmarks/gpu_gpt.py's GPT
    python -m benchmarks.roofline --target h100 --preset resnet50  # benchmarks/gpu_resnet50.py's
    python -m benchmarks.roofline --target h100 --llama3-8b  # as torchao's float8 README measures
    python -m benchmarks.roofline --target h100 --gpt2-124m  # as llm.c trains GPT-2 124M

Any mptrain overrides; ``--preset`` starts from the settings of a GPU script (overrides after it
still apply). Runs on a CPU in seconds: the model is built on the meta device and counted, not
run (:mod:`mptrain.perf.speed`, :mod:`mptrain.perf.roofline`). Every figure is a
*prediction*: a lower bound of the step's time on that GPU (no efficiency factor), so a
measured speed is below it; ``errors`` gives (predicted − measured) / measured for measured
figures. ``--out`` writes the JSON document; the table goes to stdout.

For a GPU script: ``predict_for(overrides, target)`` returns the same document, e.g.
``predict_for(GPT, "auto")`` on the GPU it runs on.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.jsondoc import write_json
from benchmarks.mptrain_api import (
    SAMPLES,
    account,
    arithmetic_for,
    compose,
    data_shape,
    gpt_model,
    gpus,
    optimizer_passes,
    predict,
    predict_config,
)
from benchmarks.mptrain_api import RooflineStep as Step

BF16 = torch.bfloat16

PRECISIONS = ("fp32", "tf32", "bf16", "fp16", "fp8", "fp8_blockwise", "mxfp8", "nvfp4")
# The settings of the GPU scripts, so that their measurements and these predictions match.
RESNET50 = [
    "model=resnet50", "model.small_stem=false", "dataset=synthetic", "dataset.image_size=224",
    "dataset.num_classes=1000", "batch_size=256", "optimizer=sgd", "channels_last=true",
]  # fmt: skip
GPT = [
    "task=lm", "model.width=2048", "model.layers=4", "model.heads=16", "model.block_size=1024",
    "dataset.vocabulary=bytes", "dataset.max_bytes=2000000", "batch_size=32",
]  # fmt: skip
PRESETS = {"resnet50": RESNET50, "gpt": GPT}


def run_config(overrides: list[str]) -> Any:
    """The typed RunConfig of ``overrides`` (composed from the shipped YAML)."""
    return compose(*overrides)


def target_row(target: str) -> gpus.GPU:
    """The GPU ``target`` names; ``auto``: the CUDA GPU here. SystemExit-free: ValueError (or
    mptrain's ConfigError) with the reason when there is none."""
    device_name = None
    if target.lower() == gpus.AUTO:
        import torch

        device_name = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    gpu, why = gpus.resolve_target(target, device_name)
    if gpu is None:
        raise ValueError(why)
    return gpu


def predict_for(
    cfg_overrides: list[str], target: str, precisions: tuple[str, ...] = PRECISIONS
) -> dict[str, Any]:
    """The predicted step of the run ``cfg_overrides`` configures, per precision, on ``target``
    (a name of mptrain.perf.gpus, or auto): the document this script writes."""
    gpu = target_row(target)
    cfg = run_config(cfg_overrides)
    found = predict_config(cfg, data_shape(cfg), gpu, precisions)
    rows = {}
    for name, p in found.items():
        if isinstance(p, str):
            rows[name] = {"precision": name, "none": p}
            continue
        rows[name] = {
            "precision": name,
            "step_time_ms": 1e3 * p.step_time_s,
            "samples_per_s": p.samples_per_s,
            "tokens_per_s": p.tokens_per_s,
            "gemm_ms": 1e3 * p.gemm_s,
            "compute_bound_share": p.compute_bound_share,
            "cast_ms": 1e3 * p.cast_s,
            "elementwise_ms": 1e3 * p.elementwise_s,
            "optimizer_ms": 1e3 * p.optimizer_s,
            "model_tflop_per_step": p.model_flops / 1e12,
            "low_flops_share": p.low_share,
            "mixed_peak_tflops": p.mixed_peak_tflops,
        }
    for reference in ("fp32", "bf16"):
        base = rows.get(reference, {}).get("step_time_ms")
        for row in rows.values():
            if base and "step_time_ms" in row:
                row[f"vs_{reference}"] = base / row["step_time_ms"]
    return {
        "kind": "predicted (roofline: a lower bound of the step time, no efficiency factor)",
        "overrides": list(cfg_overrides),
        "batch_size": cfg.batch_size * cfg.grad_accum_steps,
        "gpu": {"key": gpu.key, "name": gpu.name, "source": gpu.source},
        "rows": list(rows.values()),
    }


# ------------------------------------------------------------------------------ Llama 3 8B
class _Llama3Block(nn.Module):
    """A Llama 3 block as torchtitan's: RMSNorm, grouped-query attention through SDPA (rotary
    embeddings left out: elementwise, two tensors per layer), RMSNorm, SwiGLU MLP."""

    def __init__(self, dim: int, heads: int, kv_heads: int, hidden: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.attention_norm, self.ffn_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, dim = x.shape
        h = self.attention_norm(x)
        q = self.wq(h).view(batch, length, self.heads, -1).transpose(1, 2)
        k = self.wk(h).view(batch, length, self.kv_heads, -1).transpose(1, 2)
        v = self.wv(h).view(batch, length, self.kv_heads, -1).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.wo(y.transpose(1, 2).reshape(batch, length, dim))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Llama3(nn.Module):
    """Llama 3 8B's shape (Meta's params.json: dim 4096, 32 layers, 32 heads, 8 KV heads, FFN
    14336, vocabulary 128256; untied output head)."""

    def __init__(self, dim: int = 4096, layers: int = 32, vocab: int = 128256) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(_Llama3Block(dim, 32, 8, 14336) for _ in range(layers))
        self.norm, self.output = nn.RMSNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(ids)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


def per_gpu(model: nn.Module, length: int, step: Step, gpu: gpus.GPU, arithmetics: dict) -> dict:
    """Each named arithmetic's predicted step of the language model ``model`` (token windows of
    ``length``) on ``gpu``, or why there is none (a format the GPU has no kernel for)."""
    acc = account(model, torch.zeros(SAMPLES, length, dtype=torch.long, device="meta"), BF16)
    rows: dict[str, Any] = {}
    for name, arithmetic in arithmetics.items():
        try:
            rows[name] = predict(acc, arithmetic, gpu, step)
        except ValueError as exc:  # e.g. MXFP8 on an H100: emulated, not a prediction
            rows[name] = str(exc)
    return rows


def llama3_8b(target: str, length: int = 8192, gpus_sharded: int = 8) -> dict[str, Any]:
    """Llama 3 8B as torchao's float8 README benchmarks it with torchtitan (8 H100s, FSDP2,
    batch 1, sequence 8192, AdamW): BF16, and FP8 in every block's Linears (torchtitan leaves
    the output head in BF16); each GPU's AdamW updates its 1/``gpus_sharded`` of the weights."""
    gpu = target_row(target)
    with torch.device("meta"):
        model = Llama3()
    step = Step(1, optimizer_passes("adamw") / gpus_sharded, 1, length)
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n != "output"]
    rows = per_gpu(model, length, step, gpu, {
        "bf16": arithmetic_for("bf16"),
        "fp8 tensorwise": arithmetic_for("fp8", linears),
        "fp8 rowwise": arithmetic_for("fp8", linears, "rowwise"),
    })  # fmt: skip
    return {
        "model": f"Llama 3 8B shape, sequence {length}, batch 1, AdamW, FSDP over "
        f"{gpus_sharded} GPUs (optimizer sharded; communication not counted)",
        "gpu": gpu.key,
        "tokens_per_s": {name: p.tokens_per_s for name, p in rows.items()},
        "vs_bf16": {name: rows["bf16"].step_time_s / p.step_time_s for name, p in rows.items()},
    }


# llm.c's GPT-2 124M run (karpathy/llm.c scripts/run_gpt2_124M.sh): 12 layers, 12 heads, width
# 768, 1024-token windows, the vocabulary padded to 50,304; 64 windows per GPU, 8 GPUs,
# BF16 with FP32 master weights, AdamW sharded over the GPUs (-z 1), gradients clipped.
GPT2_124M = gpt_model.GPTShape(50304, 1024, 12, 12, 768)


def gpt2_124m(target: str, batch: int = 64, gpus_sharded: int = 8) -> dict[str, Any]:
    """GPT-2 124M as llm.c trains it (:data:`GPT2_124M`), per GPU: BF16, and each low-precision
    format in the block Linears (mptrain's layer choice: the first and last Linear, here the
    first block's attention projection and the tied head, kept in BF16); AdamW's passes over
    1/``gpus_sharded`` of the weights. Tokens/s per GPU, or why there is no prediction."""
    gpu = target_row(target)
    with torch.device("meta"):
        model = gpt_model.GPT(GPT2_124M)
    step = Step(batch, optimizer_passes("adamw", clip=True) / gpus_sharded, 1, GPT2_124M.block_size)
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)][1:-1]
    rows = per_gpu(model, GPT2_124M.block_size, step, gpu, {
        "bf16": arithmetic_for("bf16"),
        "fp8 tensorwise": arithmetic_for("fp8", linears),
        "fp8 blockwise": arithmetic_for("fp8", linears, "blockwise"),
        "mxfp8": arithmetic_for("mxfp8", linears),
        "nvfp4": arithmetic_for("nvfp4", linears),
    })  # fmt: skip
    return {
        "model": f"GPT-2 124M shape, sequence 1024, {batch} windows per GPU, AdamW sharded over "
        f"{gpus_sharded} GPUs (communication not counted)",
        "gpu": gpu.key,
        "tokens_per_s": {n: p if isinstance(p, str) else p.tokens_per_s for n, p in rows.items()},
        "mfu_ceiling": {
            n: p.model_flops / p.step_time_s / (p.mixed_peak_tflops * 1e12)
            for n, p in rows.items()
            if not isinstance(p, str)
        },
    }


def errors(doc: dict[str, Any], measured_per_s: dict[str, float]) -> dict[str, float]:
    """(predicted − measured) / measured per precision, from measured samples/s (or tokens/s for
    a language model: the same unit the document predicts in) by precision."""
    out = {}
    for row in doc["rows"]:
        measured = measured_per_s.get(row["precision"])
        if measured and "samples_per_s" in row:
            predicted = row["tokens_per_s"] or row["samples_per_s"]
            out[row["precision"]] = (predicted - measured) / measured
    return out


def table(doc: dict[str, Any]) -> str:
    """The document as a Markdown table."""
    lines = [
        f"Predicted on {doc['gpu']['name']}, batch {doc['batch_size']} ({doc['kind']})",
        "",
        "| precision | step (ms) | samples/s | tokens/s | vs fp32 | vs bf16 | GEMM ms "
        "(compute-bound) | casts ms | other ops ms | optimizer ms | low-precision share | "
        "peak TFLOP/s |",
        "|" + "---|" * 12,
    ]
    for r in doc["rows"]:
        if "none" in r:
            lines.append(f"| {r['precision']} | n/a: {r['none']} |" + " |" * 10)
            continue
        tokens = f"{r['tokens_per_s']:,.0f}" if r["tokens_per_s"] else "-"
        lines.append(
            f"| {r['precision']} | {r['step_time_ms']:.2f} | {r['samples_per_s']:,.0f} | "
            f"{tokens} | {r.get('vs_fp32', 0):.2f}× | {r.get('vs_bf16', 0):.2f}× | "
            f"{r['gemm_ms']:.2f} ({r['compute_bound_share']:.0%}) | {r['cast_ms']:.2f} | "
            f"{r['elementwise_ms']:.2f} | {r['optimizer_ms']:.2f} | "
            f"{r['low_flops_share']:.0%} | {r['mixed_peak_tflops']:,.0f} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "overrides", nargs="*", help="mptrain overrides (model=..., batch_size=...)"
    )
    parser.add_argument(
        "--target", required=True, help=f"one of {', '.join(gpus.accepted_names())}"
    )
    parser.add_argument("--preset", choices=sorted(PRESETS), help="a GPU script's settings first")
    parser.add_argument("--precisions", default=",".join(PRECISIONS))
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--llama3-8b", action="store_true", help="Llama 3 8B as torchao's README measures it"
    )
    parser.add_argument("--gpt2-124m", action="store_true", help="GPT-2 124M as llm.c trains it")
    args = parser.parse_args()
    if args.llama3_8b or args.gpt2_124m:
        doc = llama3_8b(args.target) if args.llama3_8b else gpt2_124m(args.target)
        print(json.dumps(doc, indent=2))
        return 0
    overrides = [*PRESETS.get(args.preset, []), *args.overrides]
    try:
        doc = predict_for(overrides, args.target, tuple(args.precisions.split(",")))
    except ValueError as exc:  # mptrain's ConfigError is one: an unknown name, a bad override
        print(f"roofline.py: {exc}", file=sys.stderr)
        return 2
    write_json(args.out, doc)
    print(table(doc))
    if args.out is None:
        print(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
