"""CUDA paths (skipped without a GPU): scaler on the real device, BF16, channels_last, compile."""

from __future__ import annotations

import warnings

import pytest
import torch
from support.runs import compose_run, requires_cuda, restored_tf32, train

from mptrain.config.precision import PrecisionConfig
from mptrain.precision.policy import build_grad_scaler, resolve_precision
from mptrain.train.build import prepare_run
from mptrain.train.loop import host_reads_per_step, take_step

pytestmark = [pytest.mark.gpu, requires_cuda]


def gpu_run(*overrides: str):
    return compose_run("device=cuda", "progress=false", "throughput_warmup_steps=2", *overrides)


def test_fp16_scaler_is_a_cuda_scaler_and_enabled():
    cfg = PrecisionConfig(name="fp16")
    scaler = build_grad_scaler(resolve_precision(cfg, torch.device("cuda")))
    assert scaler.is_enabled() and scaler._device == "cuda"


@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16", "auto"])
def test_each_precision_trains_on_cuda(tmp_path, precision):
    report = train(gpu_run(f"precision={precision}", "model=cnn", "max_steps=40"), tmp_path)
    assert report["status"] == "completed"
    assert report["hardware"]["gpu"]["name"]
    assert report["memory"]["kind"] == "cuda_max_allocated" and report["memory"]["peak_bytes"] > 0
    assert report["data"]["feed"] == "tensor-indexed (on the GPU)"
    assert report["evaluation"]["final_val_accuracy"] > 0.5


def test_inf_injection_skips_on_cuda(tmp_path):
    cfg = gpu_run("precision=fp16", "model=mlp", "max_steps=6", "debug.inject_inf_grad_steps=[3]")
    report = train(cfg, tmp_path)
    assert report["training"]["skipped_steps"]["steps"] == [3]


def test_channels_last_and_compile(tmp_path):
    cfg = gpu_run(
        "precision=bf16",
        "model=resnet18",
        "dataset=synthetic",
        "channels_last=true",
        "compile=true",
        "max_steps=6",
        "batch_size=32",
    )
    convs = [m for m in prepare_run(cfg).model.modules() if isinstance(m, torch.nn.Conv2d)]
    assert convs and all(
        c.weight.is_contiguous(memory_format=torch.channels_last) and not c.weight.is_contiguous()
        for c in convs
        if c.weight.shape[-2:] != (1, 1)  # a 1x1 kernel is contiguous in both layouts
    )
    report = train(cfg, tmp_path)
    assert report["status"] == "completed"
    model = report["model"]
    assert (model["channels_last"], model["compile"]) == (True, True)
    assert model["compiled_graphs"] > 0, model  # TorchDynamo compiled, not an eager fallback


@pytest.fixture
def tf32_restored():
    """The TF32 flags as they were before the test: a run with precision.allow_tf32=true leaves
    them on (they are torch's process-wide settings), and the FP8 and block GEMM comparisons run
    later in the same process compute their FP32 references with whatever is left."""
    with restored_tf32():
        yield


def test_tf32_opt_in_is_recorded(tmp_path, tf32_restored):
    report = train(gpu_run("precision=fp32", "precision.allow_tf32=true", "max_steps=3"), tmp_path)
    assert report["tf32"]["cuda_matmul"] == "tf32"


@pytest.mark.parametrize(("precision", "expected"), [("fp16", 1), ("bf16", 0), ("fp32", 0)])
def test_host_syncs_per_step_on_cuda(precision, expected):
    """torch's own sync detector agrees with tests/train/test_host_reads.py: one per FP16 step."""
    run = prepare_run(gpu_run(f"precision={precision}", "model=mlp", "max_steps=4"))
    assert host_reads_per_step(run) == expected
    params = [p for p in run.model.parameters() if p.requires_grad]
    batches = run.data.train.batches(0)
    take_step(run, params, iter([next(batches)]))  # the first step creates the optimizer state
    micro = iter([next(batches)])  # the batch is fetched before counting
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            take_step(run, params, micro)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) == expected, syncs
