"""One training step's bytes by kind and dtype (mptrain.train.memory), against independent counts:
parameters, gradients and optimizer states from their shapes and dtypes, what autograd saved
from the graph's own ``_saved_*`` attributes (not the pack hooks the accounting uses)."""

from __future__ import annotations

import copy

import pytest
import torch
from support.runs import LM, compose_run, tiny_run
from support.runs import train as run_train

from mptrain.models.task import logits_of
from mptrain.platform.distributed import unwrap
from mptrain.platform.dtypes import dtype_name
from mptrain.report.schema import load_report
from mptrain.train.build import prepare_run
from mptrain.train.memory import account_step

RESNET = ("model=resnet18", "dataset=synthetic", "dataset.image_size=32", "batch_size=8")
QUIET = ("device=cpu", "threads=1", "precision.measure=false", "progress=false")


def config(*overrides: str):
    """A run of the MLP on digits (tiny_run), or of the overrides' model (LM, RESNET)."""
    if "model=mlp" in overrides or not any(o.startswith(("task=", "model=")) for o in overrides):
        return tiny_run(*overrides)
    return compose_run(*QUIET, *overrides)


def by_dtype(tensors) -> dict[str, int]:
    """Bytes of each tensor's storage, once per storage, by dtype."""
    out, seen = {}, set()
    for t in tensors:
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            out[dtype_name(t.dtype)] = (
                out.get(dtype_name(t.dtype), 0) + t.untyped_storage().nbytes()
            )
    return out


def shape_bytes(params, per_param=1) -> dict[str, int]:
    """``per_param`` tensors of each parameter's shape and dtype, counted from the shape."""
    out = {}
    for p in params:
        out[dtype_name(p.dtype)] = out.get(dtype_name(p.dtype), 0) + per_param * p.numel() * (
            torch.finfo(p.dtype).bits // 8
        )
    return out


def saved_by_graph(run) -> dict[str, int]:
    """What autograd saved for one micro-batch's backward, read off the graph: every node's
    ``_saved_*`` tensors (and a custom function's ``saved_tensors``), parameters and buffers
    left out."""
    model = copy.deepcopy(unwrap(run.model))
    model.train()
    with torch.random.fork_rng(devices=[]):
        inputs, targets = next(iter(run.data.train.batches(run.state.epoch)))
        inputs = run.precision.model_input(inputs, run.settings.channels_last)
        with run.precision.forward_context():
            loss = run.loss_fn(logits_of(model(inputs)), targets)
    held = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    saved, nodes, stack = [], set(), [loss.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or fn in nodes:
            continue
        nodes.add(fn)
        for name in dir(fn):
            if name.startswith("_saved_") or name == "saved_tensors":
                value = getattr(fn, name)
                values = value if isinstance(value, tuple | list) else (value,)
                saved += [v for v in values if torch.is_tensor(v)]
        stack += [f for f, _ in fn.next_functions]
    return by_dtype(t for t in saved if t.untyped_storage().data_ptr() not in held)


def merged(*counts: dict[str, int]) -> dict[str, int]:
    out = {}
    for count in counts:
        for dtype, n in count.items():
            out[dtype] = out.get(dtype, 0) + n
    return out


@pytest.mark.parametrize(
    "overrides",
    [
        ("precision=fp32",),
        ("precision=bf16",),
        ("precision=fp8",),
        (*LM, "precision=fp32"),
        (*LM, "precision=bf16"),
        (*RESNET, "precision=fp32"),
        (*RESNET, "precision=bf16"),
    ],
    ids=[
        "mlp-fp32",
        "mlp-bf16",
        "mlp-fp8",
        "gpt-fp32",
        "gpt-bf16",
        "resnet18-fp32",
        "resnet18-bf16",
    ],
)
def test_each_kind_is_its_independent_count(overrides):
    run = prepare_run(config(*overrides))
    accounted = account_step(run)
    counted = accounted["bytes"]
    params = list(unwrap(run.model).parameters())
    assert counted["parameters"] == shape_bytes(params)
    assert counted["gradients"] == shape_bytes(params)  # FP32 master gradients
    # AdamW: two moments of each parameter's shape and dtype, and a 4-byte step counter each
    states = merged(shape_bytes(params, per_param=2), {"float32": 4 * len(params)})
    assert counted["optimizer_states"] == states
    assert merged(counted["parameter_casts"], counted["activations"]) == saved_by_graph(run)
    assert accounted["total_bytes"] == sum(sum(k.values()) for k in counted.values())


def test_bf16_saves_about_half_the_activation_bytes_of_fp32_and_casts_the_weights():
    """Autocast casts the matmuls' inputs to BF16 (half the bytes) and keeps the loss, norms and
    softmax in FP32: the GPT's saved activations under BF16 are 0.5-0.8 of FP32's."""
    fp32, bf16 = (
        account_step(prepare_run(config(*LM, f"precision={p}"))) for p in ("fp32", "bf16")
    )
    ratio = bf16["total"]["activations"] / fp32["total"]["activations"]
    assert 0.45 < ratio < 0.8, ratio
    assert "bfloat16" in bf16["bytes"]["activations"] and "float32" in bf16["bytes"]["activations"]
    assert fp32["bytes"]["parameter_casts"] == {} and "bfloat16" in bf16["bytes"]["parameter_casts"]


def test_fp8_layers_save_their_operands_in_fp8_and_hold_their_scales():
    fp8 = account_step(prepare_run(config("precision=fp8")))
    assert "float8_e4m3fn" in fp8["bytes"]["activations"]
    assert fp8["total"]["scales"] > 0


def test_activations_grow_with_the_batch():
    small, big = (
        account_step(prepare_run(config(*LM, f"batch_size={n}")))["total"]["activations"]
        for n in (2, 4)
    )
    assert 1.8 < big / small <= 2.0, (small, big)


def test_the_report_holds_the_accounting_and_the_summary_shows_it(tmp_path):
    run_train(tiny_run("precision=bf16"), tmp_path)
    accounted = load_report(tmp_path).memory.accounted
    assert accounted["total_bytes"] == sum(accounted["total"].values()) > 0
    assert accounted["bytes"]["activations"]["bfloat16"] > 0
    md = (tmp_path / "report.md").read_text()
    assert "| memory accounted |" in md and "|   activations |" in md and "bfloat16" in md


def test_memory_account_false_counts_nothing(tmp_path):
    run_train(tiny_run("memory.account=false"), tmp_path)
    assert load_report(tmp_path).memory.accounted is None
    assert "memory accounted" not in (tmp_path / "report.md").read_text()
