"""The roofline's block-scaled formats on hand-computed cases: each format's peak on the GPUs
that have its kernels (and "emulated, not a prediction" on the others), its GEMM traffic with
the block scales, its quantization traffic (MXFP8, NVFP4 with and without 2-D weight tiles,
blockwise FP8), the FLOP-weighted peak (MFU's) with block formats mixed in, and the layer choice
each format makes on a configured run."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from support.runs import tiny_run
from test_roofline import linear_gemm, meta, roofline_script
from torch import nn

from mptrain.config.format_table import BLOCK_FORMATS, FORMAT_TABLE
from mptrain.perf import gpus
from mptrain.perf.gemms import account
from mptrain.perf.roofline import Step, arithmetic_for, cast_bytes, gemm_passes, predict
from mptrain.perf.speed import DataShape, flops_by_format, mfu_of_run, with_precision

B200, H100 = gpus.row("b200"), gpus.row("h100")
X, W, DY = 1024 * 4096, 4096 * 4096, 1024 * 4096  # a 1024-row BF16 input, a 4096x4096 weight


def test_each_block_format_runs_at_its_element_formats_dense_peak_where_the_kernels_are():
    # HGX B200 datasheet: FP8 72, FP4 144 PFLOPS with sparsity for 8 GPUs: 4.5 and 9 dense each.
    assert B200.peak_flops("mxfp8") == 4500e12
    assert B200.peak_flops("nvfp4") == 9000e12
    # Blackwell Ultra datasheet, HGX B300: FP4 14 PFLOPS dense; GB200 NVL72: NVFP4 720 / 72 GPUs.
    assert gpus.row("b300").peak_flops("nvfp4") == 14000e12
    gb200 = gpus.row("gb200")
    assert (gb200.peak_flops("mxfp8"), gb200.peak_flops("nvfp4")) == (5000e12, 10000e12)
    assert H100.peak_flops("fp8_blockwise") == 1979e12  # Hopper: the FP8 tensor-core rate
    for gpu, fmt, least in (
        (H100, "mxfp8", "10.0 or later"),
        (gpus.row("l4"), "fp8_blockwise", "9.x"),
        (gpus.row("b200"), "fp8_blockwise", "9.x"),  # torch's blockwise scaled_mm: SM90 only
    ):
        with pytest.raises(ValueError, match=rf"no hardware kernel for {fmt} .*needs {least}\): "
                                             "emulated there, not a prediction"):  # fmt: skip
            gpu.peak_flops(fmt)
    # Each block format's kernel range: from its least capability up to (not including) below.
    for fmt in BLOCK_FORMATS:
        kernel = FORMAT_TABLE[fmt].kernel
        least, below = kernel.least, kernel.below
        last = (below[0] - 1, 9) if below else (12, 9)
        assert kernel.runs_on(least) and kernel.runs_on(last), fmt
        assert not kernel.runs_on((least[0] - 1, 9)), fmt
        assert below is None or not kernel.runs_on(below), fmt
    assert gpus.row_for_device_name("NVIDIA GB200").key == "gb200"
    assert gpus.row_for_device_name("NVIDIA B300 SXM6 AC").key == "b300"


def test_block_gemms_read_their_scales():
    g = linear_gemm(4, 256, 128, a_grad=True)  # per sample; batch 2
    a, w, c = 2 * 4 * 256, 256 * 128, 2 * 4 * 128
    forward, data_grad, weight_grad = gemm_passes(g, "mxfp8", 2)
    assert forward == (2 * g.flops, a * (1 + 1 / 32) + w * (1 + 1 / 32) + c * 2)  # E8M0 per 32
    assert data_grad[1] == c * (1 + 1 / 32) + w * (1 + 1 / 32) + a * 2
    assert weight_grad[1] == c * (1 + 1 / 32) + a * (1 + 1 / 32) + w * 2
    # NVFP4: half a byte an element, an E4M3 scale per 16 (per 16x16 weight tile), FP32 per tensor
    nvfp4 = gemm_passes(g, "nvfp4", 2, tiled_weight=True)[0][1]
    assert nvfp4 == pytest.approx(a * (0.5 + 1 / 16) + 4 + w * (0.5 + 1 / 256) + 4 + c * 2)
    # Blockwise FP8: an FP32 scale per 1x128 tile, per 128x128 weight block
    blockwise = gemm_passes(g, "fp8_blockwise", 2, tiled_weight=True)[0][1]
    assert blockwise == pytest.approx(a * (1 + 4 / 128) + w * (1 + 4 / 128**2) + c * 2)


def test_mxfp8_quantization_traffic_by_hand():
    """Each of x, W and dy quantized along two axes (two GEMMs read each): a BF16 or FP32 read,
    a one-byte element and a 1/32-byte scale written; no amax pass (a block's scale is its own)."""
    g = linear_gemm(1024, 4096, 4096, a_grad=True, a_bytes=2)  # a BF16 input, an FP32 weight
    each = 2 * (X * (2 + 1 + 1 / 32) + W * (4 + 1 + 1 / 32) + DY * (2 + 1 + 1 / 32))
    grad_to_fp32 = W * (2 + 4)  # dW written in BF16, added into the FP32 gradient
    assert cast_bytes(g, "mxfp8", arithmetic_for("mxfp8", ["fc"]), 1) == pytest.approx(
        each + grad_to_fp32
    )
    # A Linear whose input needs no gradient: no data-gradient GEMM, W and dy quantized once.
    first = linear_gemm(1024, 4096, 4096, a_grad=False)
    once = 2 * X * (2 + 1 + 1 / 32) + W * (4 + 1 + 1 / 32) + DY * (2 + 1 + 1 / 32)
    assert cast_bytes(first, "mxfp8", arithmetic_for("mxfp8", ["fc"]), 1) == pytest.approx(
        once + grad_to_fp32
    )


def test_nvfp4_quantization_traffic_by_hand():
    """Half-byte elements, an E4M3 scale per 16, the FP32 tensor scale's amax pass (a read) and
    its four bytes; with 16x16 weight tiles the weight is quantized once for both its GEMMs."""
    g = linear_gemm(1024, 4096, 4096, a_grad=True, a_bytes=2)

    def quantize(elems: int, high: int, scales: float) -> float:
        return elems * high * 2 + elems * (0.5 + scales) + 4  # amax read, read, write

    act = 2 * quantize(X, 2, 1 / 16) + 2 * quantize(DY, 2, 1 / 16)
    tiled = act + quantize(W, 4, 1 / 256) + W * 6
    assert cast_bytes(g, "nvfp4", arithmetic_for("nvfp4", ["fc"]), 1) == pytest.approx(tiled)
    rows = act + 2 * quantize(W, 4, 1 / 16) + W * 6
    untiled = arithmetic_for("nvfp4", ["fc"], weight_tiles=False)
    assert cast_bytes(g, "nvfp4", untiled, 1) == pytest.approx(rows)


def test_blockwise_fp8_quantization_traffic_by_hand():
    """FP32 scales per 1x128 tile of x and dy (each quantized for two GEMMs), per 128x128 block
    of W (one quantization serves the forward and the data gradient)."""
    g = linear_gemm(1024, 4096, 4096, a_grad=True, a_bytes=2)
    tiles = 2 * X * (2 + 1 + 4 / 128) + 2 * DY * (2 + 1 + 4 / 128)
    blocks = W * (4 + 1 + 4 / 128**2)
    arithmetic = arithmetic_for("fp8", ["fc"], "blockwise")
    assert cast_bytes(g, "fp8_blockwise", arithmetic, 1) == pytest.approx(tiles + blocks + W * 6)


def test_the_flop_weighted_peak_takes_the_block_formats_peaks():
    """MFU's peak, half the FLOPs in each format on a B200: 2 / (1/4500 + 1/2250) = 3,000
    TFLOP/s with MXFP8, 2 / (1/9000 + 1/2250) = 3,600 with NVFP4; blockwise FP8 on an H100 as
    FP8 (1,319.33); MXFP8 on an H100 has no peak (emulated)."""
    assert gpus.mixed_peak_flops({"mxfp8": 1.0, "bf16": 1.0}, B200) == pytest.approx(3000e12)
    assert gpus.mixed_peak_flops({"nvfp4": 1.0, "bf16": 1.0}, B200) == pytest.approx(3600e12)
    blockwise = gpus.mixed_peak_flops({"fp8_blockwise": 1.0, "bf16": 1.0}, H100)
    assert blockwise == pytest.approx(1319.333e12, rel=1e-5)
    with pytest.raises(ValueError, match="emulated"):
        gpus.mixed_peak_flops({"mxfp8": 1.0}, H100)


def test_one_nvfp4_linears_step_by_hand_is_compute_bound_at_the_fp4_rate():
    """A 4096-wide NVFP4 Linear, 8192 rows, on a B200: each of its two GEMMs at 9 PFLOP/s."""
    with torch.device("meta"):
        linear = nn.Linear(4096, 4096, bias=False)
    acc = account(linear, meta(2, 8192, 4096), torch.bfloat16)
    step = predict(acc, arithmetic_for("nvfp4", ["(model)"]), B200, Step(1, optimizer_passes=0))
    flops = 2 * 8192 * 4096 * 4096
    assert step.gemm_s == pytest.approx(2 * flops / 9000e12) and step.compute_bound_share == 1
    assert step.flops_by_format == {"nvfp4": 3 * flops}
    assert step.mixed_peak_tflops == pytest.approx(9000)
    assert step.low_share == 1


def test_a_run_in_each_block_format_converts_what_the_run_would_and_mfu_weights_it():
    """The digits MLP (Linears 64-256, 256-256, 256-10): first and last kept in BF16, the middle
    one (aligned to 32, 16 and 128) in the format; NVFP4's 15 % BF16 tail keeps nothing more."""
    middle, shape = 3 * 2 * 256 * 256, DataShape(1, 8, 10)  # digits: 8x8 images, 10 classes
    base = tiny_run()
    for fmt in ("mxfp8", "nvfp4"):
        cfg = with_precision(base, fmt)
        assert flops_by_format(cfg, shape, fmt)[fmt] == middle, fmt
        per_sample, peak = mfu_of_run(cfg, shape, fmt, None, B200)
        bf16 = per_sample - middle
        assert peak == pytest.approx(per_sample / (middle / B200.peak_flops(fmt) + bf16 / 2250e12))
    blockwise = with_precision(base, "fp8_blockwise")
    assert flops_by_format(blockwise, shape, "fp8")["fp8_blockwise"] == middle
    small = replace(with_precision(base, "mxfp8"), mx=replace(base.mx, min_features=512))
    with pytest.raises(ValueError, match="no Linear layer of model=mlp can run in mxfp8"):
        flops_by_format(small, shape, "mxfp8")


def test_the_script_predicts_gpt2_124m_and_block_formats_only_where_they_run():
    script = roofline_script()
    h100, b200 = script.gpt2_124m("h100"), script.gpt2_124m("b200")
    assert h100["tokens_per_s"]["bf16"] > 0 and h100["tokens_per_s"]["fp8 blockwise"] > 0
    assert "emulated there, not a prediction" in h100["tokens_per_s"]["nvfp4"]
    assert "emulated there, not a prediction" in b200["tokens_per_s"].pop("fp8 blockwise")
    assert all(isinstance(v, float) for v in b200["tokens_per_s"].values())
    assert 0 < b200["mfu_ceiling"]["nvfp4"] < b200["mfu_ceiling"]["bf16"] < 1
