"""The roofline predictor on hand-computed cases (one Linear's FLOPs and bytes, compute-bound and
memory-bound on an H100, FP8's quantization traffic, the FLOP-weighted peak of FP8 and BF16 GEMMs
mixed), the GPU table's names and its one-line error, and advise.target in advise, the run
report's MFU and their words."""

from __future__ import annotations

import importlib.util
import json
import sys
import types
from pathlib import Path

import pytest
import torch
from support.runs import run_cli, tiny_run
from torch import nn

from mptrain.commands.advise import measure
from mptrain.commands.advise import predict as advise_predict
from mptrain.config.base import ConfigError
from mptrain.config.commands import GPU_TARGETS
from mptrain.models.gpt import GPT, GPTShape
from mptrain.perf import gpus
from mptrain.perf.gemms import Gemm, account
from mptrain.perf.roofline import (
    Step,
    arithmetic_for,
    cast_bytes,
    gemm_passes,
    model_flops_by_format,
    pass_seconds,
    predict,
)
from mptrain.platform import hardware
from mptrain.precision.quant.convert import choose_layers
from mptrain.report import assemble as train_report
from mptrain.train.build import prepare_run

H100 = gpus.row("h100")
BF16_PEAK, FP8_PEAK, FP32_PEAK, BANDWIDTH = 989.5e12, 1979e12, 67e12, 3.35e12


def meta(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.zeros(shape, device="meta", dtype=dtype)


def linear_gemm(rows: int, k: int, n: int, a_grad: bool = False, a_bytes: int = 2) -> Gemm:
    """One Linear's forward GEMM per sample: ``rows`` x ``k`` input, ``n`` x ``k`` FP32 weight."""
    return Gemm("fc", "linear", 2.0 * rows * k * n, rows * k, k * n, rows * n, True, a_grad,
                True, a_bytes, 4)  # fmt: skip


# ------------------------------------------------------------------------------ the table
def test_the_table_takes_names_aliases_and_device_names():
    assert gpus.row("h100") is gpus.row("H100-SXM") is gpus.GPUS["h100-sxm"]
    assert gpus.row("h200").tflops["bf16"] == BF16_PEAK / 1e12 and gpus.row("h200").memory_gb == 141
    assert gpus.row("a100-80gb") is gpus.row("a100") and "fp8" not in gpus.row("a100").tflops
    names = {
        "NVIDIA H100 80GB HBM3": "h100-sxm",
        "NVIDIA H100 PCIe": "h100-pcie",
        "NVIDIA H100 NVL": "h100-nvl",
        "NVIDIA H200": "h200",
        "NVIDIA H200 NVL": "h200-nvl",
        "NVIDIA B200": "b200",
        "NVIDIA A100-SXM4-80GB": "a100",
        "NVIDIA A100-SXM4-40GB": "a100-40gb",
        "NVIDIA A100-PCIE-40GB": "a100-40gb",
        "NVIDIA A100 80GB PCIe": "a100-pcie",
        "NVIDIA L4": "l4",
        "NVIDIA L40S": "l40s",
        "NVIDIA GeForce RTX 4090": "rtx4090",
    }
    for device, key in names.items():
        assert gpus.row_for_device_name(device).key == key, device
    assert gpus.row_for_device_name("Tesla V100-SXM2-16GB") is None


def test_every_row_is_dense_and_cites_its_datasheet():
    for gpu in gpus.GPUS.values():
        t = gpu.tflops
        assert t["fp16"] == t["bf16"] and t["fp32"] < t["bf16"], gpu.key
        if "fp8" in t:  # FP8 doubles BF16 on every GPU that has it
            assert t["fp8"] == pytest.approx(2 * t["bf16"], rel=0.015), gpu.key  # as printed
        assert "datasheet" in gpu.source or "whitepaper" in gpu.source, gpu.key
        assert gpu.bandwidth_gb_s > 0 and gpu.memory_gb > 0 and gpu.sms > 0
    assert gpus.row("b200").tflops["fp4"] == 2 * gpus.row("b200").tflops["fp8"] == 9000


def test_the_config_takes_the_names_the_table_has():
    assert list(GPU_TARGETS) == gpus.accepted_names()
    with pytest.raises(ConfigError, match="'auto' names no GPU: one of h100-sxm, "):
        gpus.row("auto")


def test_an_unknown_target_is_one_line_naming_the_key_and_the_names():
    with pytest.raises(ConfigError) as caught:
        gpus.row("h900")
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("advise.target='h900': not a GPU this table knows; one of ")
    assert all(name in message for name in ("h100-sxm", "h200", "b200", "l4", "auto", "none"))


def test_auto_predicts_for_the_gpu_it_runs_on_and_nothing_on_a_cpu():
    assert gpus.resolve_target("auto", None)[0] is None
    assert "on a CPU" in gpus.resolve_target("auto", None)[1]
    assert gpus.resolve_target("auto", "NVIDIA H200")[0].key == "h200"
    gpu, why = gpus.resolve_target("auto", "Tesla V100-SXM2-16GB")
    assert gpu is None and "does not know the GPU 'Tesla V100-SXM2-16GB'" in why
    assert gpus.resolve_target("none", "NVIDIA H200")[0] is None
    assert gpus.resolve_target("l4", None)[0].key == "l4"


# ------------------------------------------------------------------------------ accounting
def test_one_linear_is_counted_exactly():
    acc = account(nn.Linear(64, 32, bias=False).to("meta"), meta(2, 8, 64))
    (g,) = acc.gemms
    assert (g.kind, g.name, g.flops) == ("linear", "(model)", 2 * 8 * 64 * 32)  # per sample
    assert (g.a_elems, g.b_elems, g.out_elems) == (8 * 64, 64 * 32, 8 * 32)
    assert g.b_is_weight and g.b_grad and not g.a_grad  # the input needs no gradient
    assert acc.parameters == 64 * 32


def test_elementwise_bytes_and_emulated_autocast_by_hand():
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU()).to("meta")
    # Per sample, FP32: the ReLU reads and writes 16 floats (128 B); the loss reads the 16
    # logits and the int64 target and writes its scalar, shared by the 2 samples (64 + 8 + 2).
    assert account(model, meta(2, 16)).elementwise_bytes == 128 + 74
    # BF16 autocast: the Linear's output is BF16, so the ReLU moves half (64 B); cross-entropy
    # runs in FP32: its BF16 input is cast up (32 B read, 64 written), then as before.
    assert account(model, meta(2, 16), torch.bfloat16).elementwise_bytes == 64 + 96 + 74


def test_a_convolution_is_an_implicit_gemm_and_the_images_need_no_gradient():
    (g,) = account(nn.Conv2d(3, 8, 3, padding=1).to("meta"), meta(2, 3, 8, 8)).gemms
    assert g.kind == "conv" and g.flops == 2 * (8 * 8 * 8) * (3 * 3 * 3)
    assert (g.a_elems, g.b_elems, g.out_elems) == (3 * 64, 8 * 3 * 9, 8 * 64) and not g.a_grad


def test_the_gpt_forward_is_its_linears_and_attention_in_closed_form():
    vocab, length, layers, width = 256, 32, 2, 32
    with torch.device("meta"):
        gpt = GPT(GPTShape(vocab, length, layers, 2, width, bias=False))
    acc = account(gpt, meta(2, length, dtype=torch.long))
    linear = 2 * length * (layers * 12 * width * width + width * vocab)  # blocks, tied head
    attention = layers * 4 * length * length * width  # QKᵀ and PV, whole
    assert sum(g.flops for g in acc.gemms) == linear + attention
    assert [g.causal for g in acc.gemms if g.kind == "attention"] == [True] * layers


# ------------------------------------------------------------------------------ the roofline
def test_a_large_gemm_is_compute_bound_and_a_thin_one_memory_bound_on_an_h100():
    k = n = 8192
    big = linear_gemm(8192, k, n)
    (flops, nbytes), *_ = gemm_passes(big, "bf16", 1)
    assert flops == 2 * 8192**3 and nbytes == (8192 * k + k * n + 8192 * n) * 2
    assert pass_seconds(flops, nbytes, "bf16", H100) == pytest.approx(2 * 8192**3 / BF16_PEAK)
    thin = linear_gemm(16, k, n)
    (flops, nbytes), *_ = gemm_passes(thin, "bf16", 1)
    weight_bound = (16 * k + k * n + 16 * n) * 2 / BANDWIDTH  # 40 µs, against 2 µs of FLOPs
    assert pass_seconds(flops, nbytes, "bf16", H100) == pytest.approx(weight_bound)
    assert flops / BF16_PEAK < weight_bound / 10


def test_backward_passes_by_hand():
    g = linear_gemm(4, 8, 2, a_grad=True)  # per sample; batch 3
    a, w, c = 3 * 4 * 8, 8 * 2, 3 * 4 * 2
    assert gemm_passes(g, "bf16", 3) == [
        (3 * g.flops, (a + w) * 2 + c * 2),  # y = x Wᵀ
        (3 * g.flops, (c + w) * 2 + a * 2),  # dx = dy W
        (3 * g.flops, (c + a) * 2 + w * 2),  # dW = dyᵀ x
    ]
    # FP8: one-byte operands, BF16 results
    assert gemm_passes(g, "fp8", 3)[0] == (3 * g.flops, (a + w) + c * 2)


def test_fp8_quantization_traffic_by_hand():
    x, w, dy = 1024 * 4096, 4096 * 4096, 1024 * 4096
    g = linear_gemm(1024, 4096, 4096, a_grad=True, a_bytes=2)  # a BF16 input, an FP32 weight
    casts = x * (2 * 2 + 1) + w * (2 * 4 + 1) + dy * (2 * 2 + 1)  # amax read, read, 1-byte write
    grad_to_fp32 = w * (2 + 4)  # dW written in BF16, added into the FP32 gradient
    tensorwise = arithmetic_for("fp8", ["fc"])
    assert cast_bytes(g, "fp8", tensorwise, 1) == casts + 2 * (x + w + dy) + grad_to_fp32
    rowwise = arithmetic_for("fp8", ["fc"], "rowwise")
    assert cast_bytes(g, "fp8", rowwise, 1) == 2 * casts + grad_to_fp32
    # BF16 autocast: the FP32 weight cast down and its gradient cast back up; the input is BF16.
    assert cast_bytes(g, "bf16", arithmetic_for("bf16"), 1) == 2 * w * (4 + 2)
    assert cast_bytes(g, "fp32", arithmetic_for("fp32"), 1) == 0


def test_one_linears_step_time_by_hand():
    """FP32, SGD without momentum: forward and weight-gradient GEMMs, the loss's bytes three
    times, three passes over the weights."""
    rows, k, n, batch = 512, 1024, 1024, 4
    acc = account(nn.Linear(k, n, bias=False).to("meta"), meta(2, rows, k))
    step = predict(acc, arithmetic_for("fp32"), H100, Step(batch, optimizer_passes=3))
    flops = 2 * batch * rows * k * n
    a, w, c = batch * rows * k, k * n, batch * rows * n
    forward = max(flops / FP32_PEAK, 4 * (a + w + c) / BANDWIDTH)
    weight_grad = max(flops / FP32_PEAK, 4 * (c + a + w) / BANDWIDTH)
    loss = 3 * batch * (4 * rows * n + 8 * rows + 4 / 2) / BANDWIDTH
    optimizer = 3 * 4 * w / BANDWIDTH
    assert step.step_time_s == pytest.approx(forward + weight_grad + loss + optimizer)
    assert step.samples_per_s == pytest.approx(batch / step.step_time_s)
    assert step.model_flops == 3 * flops and step.flops_by_format == {"fp32": 3 * flops}
    assert step.mixed_peak_tflops == 67
    # The forward's two operations (the GEMM, the loss) and their backward: 6 kernels, ~30 µs at
    # least, well inside the ~140 µs the roofline gives: not launch-bound.
    assert step.kernels == 6 and not step.launch_bound


def test_the_flop_weighted_peak_of_fp8_and_bf16_by_hand():
    # Half the FLOPs in each: 2 / (1/1979 + 1/989.5) TFLOP/s = 1,319.33.
    peak = gpus.mixed_peak_flops({"fp8": 1e12, "bf16": 1e12}, H100)
    assert peak == pytest.approx(1319.333e12, rel=1e-5)
    assert gpus.mixed_peak_flops({"fp8": 5.0, "bf16": 5.0}, H100) == pytest.approx(peak)  # the mix
    assert gpus.mixed_peak_flops({"fp8": 3.0, "bf16": 0.0}, H100) == FP8_PEAK
    with pytest.raises(ValueError, match="no fp8 peak"):
        gpus.mixed_peak_flops({"fp8": 1.0}, gpus.row("a100"))


def test_fp8_layer_choice_sets_the_mix():
    """Three equal Linears, FP8's first and last kept in BF16: one third of the FLOPs in FP8."""
    model = nn.Sequential(*(nn.Linear(64, 64, bias=False) for _ in range(3))).to("meta")
    chosen = [c.name for c in choose_layers(model, [], [], keep_first_last=True) if c.converted]
    assert chosen == ["1"]
    acc = account(model, meta(2, 64), torch.bfloat16)
    by_format = model_flops_by_format(acc, arithmetic_for("fp8", chosen))
    each = 3 * 2 * 64 * 64
    assert by_format == {"bf16": 2 * each, "fp8": each}
    assert gpus.mixed_peak_flops(by_format, H100) == pytest.approx(
        3 / (1 / FP8_PEAK + 2 / BF16_PEAK)
    )


def test_recipes_come_from_the_precision_table():
    assert arithmetic_for("tf32").gemm_format == "tf32"
    assert (arithmetic_for("bf16").gemm_format, arithmetic_for("bf16").param_bytes) == ("bf16", 4)
    assert (arithmetic_for("bf16_pure").gemm_format, arithmetic_for("bf16_pure").param_bytes) == (
        "bf16",
        2,
    )
    assert arithmetic_for("fp16").loss_scaling and not arithmetic_for("fp16_noscale").loss_scaling
    assert arithmetic_for("bf16", ["fc"]).layers == frozenset()  # only fp8, mxfp8, nvfp4 convert
    blockwise = arithmetic_for("fp8", ["fc"], "blockwise")
    assert (blockwise.layer_format, blockwise.tiled_weight, blockwise.rowwise) == (
        "fp8_blockwise", True, False)  # fmt: skip
    assert (
        arithmetic_for("nvfp4", ["fc"]).tiled_weight
        and not arithmetic_for("mxfp8", ["fc"]).tiled_weight
    )
    assert not arithmetic_for("nvfp4", ["fc"], weight_tiles=False).tiled_weight
    with pytest.raises(ValueError, match="precision 'int8': one of tf32, fp32"):
        arithmetic_for("int8")


# ------------------------------------------------------------------------------ advise
@pytest.fixture(autouse=True)
def bf16_cpu(monkeypatch):
    """advise's candidates on a CPU with native BF16 (AVX512-BF16 or AMX), whatever this one has:
    on an AVX2-only CPU advise skips BF16 as emulated, and these tests are about the GPU rows."""
    monkeypatch.setattr(hardware, "cpu_has_native_bf16", lambda: True)


def advice_for(*overrides: str) -> dict:
    """advise's prediction for a tiny CPU run's candidates."""
    cfg = tiny_run(*overrides)
    cpu = torch.device("cpu")
    return advise_predict.predict(cfg, cpu, measure.candidates(cfg, cpu))


def test_advise_predicts_each_candidate_labelled_and_says_why_not():
    prediction = advice_for("advise.target=h100")
    assert prediction["gpu"]["key"] == "h100-sxm" and prediction["same_device"] is False
    rows = prediction["rows"]
    arithmetics = ["fp8", "fp8-rowwise", "fp8-delayed", "fp8-pow2"]
    blocks = ["fp8-blockwise", "mxfp8", "nvfp4"]
    assert list(rows) == ["fp32", "bf16", "fp16", *arithmetics, *blocks, "tf32"]  # CPU's, then TF32
    # Blockwise FP8 runs on Hopper; MX and NVFP4 need Blackwell's tensor cores: said, not guessed.
    assert rows["fp8-blockwise"]["flops_by_format"]["fp8_blockwise"] > 0
    for name in ("mxfp8", "nvfp4"):
        assert rows[name] == {"none": f"NVIDIA H100 SXM5 80GB has no hardware kernel for {name} "
                              "(compute capability 9.0, needs 10.0 or later): emulated there, not a "
                              "prediction"}  # fmt: skip
    assert rows["fp8-rowwise"]["cast_s"] > rows["fp8"]["cast_s"]  # every operand cast twice
    assert rows["fp8-delayed"]["step_time_s"] == rows["fp8"]["step_time_s"]
    assert rows["bf16"]["vs_fp32"] == rows["fp32"]["step_time_s"] / rows["bf16"]["step_time_s"]
    assert 0 < rows["fp8"]["flops_by_format"]["fp8"] < rows["fp8"]["model_flops"]  # the middle one
    assert advise_predict.headers(prediction) == ["predicted on h100-sxm (roofline, at best)"]
    bf16_cell = advise_predict.cells(prediction, "bf16", lm=False)[0]
    assert bf16_cell.startswith("predicted ")  # a 1.4 µs step of 18 kernels: launches set it
    assert rows["bf16"]["launch_bound"] and bf16_cell.endswith(
        "launch-bound: ~18 kernels at ≥ 5 µs each take longer"
    )
    assert "Predicted on NVIDIA H100 SXM5 80GB" in advise_predict.lines(prediction)[0]
    a100 = advice_for("advise.target=a100")
    assert a100["rows"]["fp8"] == {"none": "NVIDIA A100 SXM4 80GB has no fp8 peak (it has "
                                   "fp32, tf32, bf16, fp16)"}  # fmt: skip
    assert advice_for()["gpu"] is None  # auto, on a CPU


def test_on_the_target_gpu_the_measured_speed_stands_beside_the_prediction():
    prediction = advice_for("advise.target=h100")
    prediction["same_device"] = True  # as when advise runs on an H100
    bf16 = prediction["rows"]["bf16"]
    measured = bf16["samples_per_s"] / 4
    rows = [{"precision": "bf16", "speed": {"samples_per_s": measured}, "emulated": False}]
    advise_predict.compare(prediction, rows)
    assert bf16["error"] == pytest.approx(3.0)  # predicted 4x the measured speed: +300 %
    per_sample = bf16["model_flops"] / bf16["batch"]
    assert bf16["measured_mfu"] == pytest.approx(measured * per_sample / BF16_PEAK)
    assert advise_predict.cells(prediction, "bf16", lm=False)[1].startswith("error +300%, MFU ")


@pytest.mark.slow
def test_advise_target_writes_the_predicted_column_labelled_as_such(tmp_path, monkeypatch):
    args = ["advise", "model=mlp", "device=cpu", "advise.budget_s=5", "advise.target=h100"]
    outcome = run_cli([*args, "hydra.run.dir=out"], tmp_path, monkeypatch)
    assert outcome.code == 0, outcome
    markdown = (tmp_path / "out" / "advise.md").read_text()
    header = next(line for line in markdown.splitlines() if line.startswith("| precision"))
    assert header.endswith("| predicted on h100-sxm (roofline, at best) |")
    fp8 = next(line for line in markdown.splitlines() if line.startswith("| fp8 tensorwise"))
    assert "| not measured (below) |" in fp8 and "| predicted " in fp8 and " µs/step" in fp8
    assert "Predicted on NVIDIA H100 SXM5 80GB (advise.target=h100" in markdown
    data = json.loads((tmp_path / "out" / "advise.json").read_text())
    assert data["settings"]["target"] == "h100" and data["prediction"]["rows"]["fp8"]["batch"]


def test_an_unknown_advise_target_stops_before_measuring(tmp_path, monkeypatch):
    outcome = run_cli(["advise", "model=mlp", "device=cpu", "advise.target=h900"], tmp_path,
                      monkeypatch)  # fmt: skip
    assert outcome.code == 2
    line = "mptrain: error: advise.target='h900': not a GPU this table knows; one of h100-sxm, "
    assert outcome.stderr.startswith(line) and outcome.stderr.count("\n") == 1
    assert not (tmp_path / "outputs").exists()  # nothing measured, nothing written


# ------------------------------------------------------------------------------ the run report
def job_on(device: str, precision: str = "fp32") -> types.SimpleNamespace:
    """What the report reads of a job, for a CPU-built MLP run said to be on ``device``, with
    1000 samples/s measured."""
    cfg = tiny_run(f"precision={precision}")
    run = prepare_run(cfg)
    run.monitor.throughput.measured_samples, run.monitor.throughput.measured_time_s = 1000, 1.0
    return types.SimpleNamespace(
        cfg=cfg, run=run, policy=run.precision.policy, device=torch.device(device), dist=run.dist
    )


def test_the_report_gives_mfu_on_a_known_gpu_and_says_n_a_on_a_cpu(monkeypatch):
    assert train_report._mfu_fields(job_on("cpu")) == {
        "mfu_note": "n/a: on a CPU (no peak throughput table)"
    }
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 PCIe")
    fields = train_report._mfu_fields(job_on("cuda"))
    # digits: 8 x 8 images, 10 classes; the MLP's Linears 64-256, 256-256, 256-10.
    per_sample = 3 * 2 * (64 * 256 + 256 * 256 + 256 * 10)
    assert fields["mfu"] == pytest.approx(1000 * per_sample / 51e12)
    assert fields["mixed_peak_tflops"] == 51 and "NVIDIA H100 PCIe 80GB, fp32" in fields["mfu_note"]
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100")
    assert (
        train_report._mfu_fields(job_on("cuda"))["mfu_note"] == "n/a: no peak table for Tesla V100"
    )


# ------------------------------------------------------------------------------ the script
def roofline_script() -> types.ModuleType:
    """benchmarks/roofline.py as a module (benchmarks/ on sys.path, as when it runs)."""
    benchmarks = Path(__file__).resolve().parents[2] / "benchmarks"
    if str(benchmarks) not in sys.path:
        sys.path.append(str(benchmarks))
    spec = importlib.util.spec_from_file_location("roofline_script", benchmarks / "roofline.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_script_predicts_a_configured_run_for_a_gpu_script_to_call():
    script = roofline_script()
    with torch.device("meta"):
        llama = script.Llama3()
    assert sum(p.numel() for p in llama.parameters()) == 8_030_261_248  # Llama 3 8B's count
    doc = script.predict_for(["model=mlp", "device=cpu"], "h100", ("fp32", "bf16", "fp8"))
    rows = {r["precision"]: r for r in doc["rows"]}
    assert doc["gpu"]["key"] == "h100-sxm" and doc["kind"].startswith("predicted")
    assert rows["fp32"]["vs_fp32"] == 1.0 and 0 < rows["fp8"]["low_flops_share"] < 1
    assert script.errors(doc, {"bf16": rows["bf16"]["samples_per_s"] / 2}) == {"bf16": 1.0}
    with pytest.raises(ConfigError, match=r"^advise\.target='h900': not a GPU this table knows"):
        script.predict_for(["model=mlp"], "h900")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what it says without a GPU")
def test_gpu_speeds_predictor_hook_predicts_on_the_gpu_it_runs_on_or_says_why_not(monkeypatch):
    cfg = tiny_run("precision=bf16")
    with pytest.raises(ValueError, match=r"advise\.target=auto on a CPU: no prediction"):
        advise_predict.predict_samples_per_s(cfg)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    bf16 = advise_predict.predict_samples_per_s(cfg)
    tf32 = advise_predict.predict_samples_per_s(
        tiny_run("precision=fp32", "precision.allow_tf32=true")
    )
    assert bf16 == advice_for("advise.target=h200")["rows"]["bf16"]["samples_per_s"]
    assert tf32 == advice_for("advise.target=h200")["rows"]["tf32"]["samples_per_s"]
