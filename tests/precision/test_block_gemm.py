"""The real block-scaled GEMMs (mptrain.precision.quant.kernels): where they run, how their operands
are laid out, and that both paths of :class:`BlockLinear` share the quantization.

On the CPU (no block-scaled kernel runs here):
- the swizzled scale layout equals torchao's ``to_blocked`` bit for bit on odd shapes;
- the availability answer and the policy's choice and record for faked GPUs (compute capability
  and torch's CUDA version replaced: a unit test of the decision);
- the arguments :func:`scaled_mm_call` builds satisfy torch's ``scaled_mm`` contract (dtypes,
  row-major first operand, column-major second, scale shapes, strides, swizzle) and, dequantized
  by :func:`reference_scaled_mm` (a pure-torch reading of exactly those arguments, swizzled scales
  undone with torchao's ``from_blocked``; these tests skip without torchao), are the emulated
  GEMM's operands bit for bit
  (NVFP4: to one FP32 rounding, where the per-tensor scale is applied);
- with the kernel replaced by that reference, BlockLinear's real path (forward, input and weight
  gradients, tiles, Hadamard, stochastic rounding, counting) equals its emulated path, and a
  training run with the real backend records it.

On a GPU that has the kernels (``-m gpu``): real against emulated GEMMs and layers within FP32
accumulation order, and a short training run whose report says the GEMMs were real.
"""

from __future__ import annotations

import copy
import importlib.util
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from support.runs import NoFigure, compose_run, requires_cuda, tiny_run, train

from mptrain.config.base import ConfigError
from mptrain.config.format_table import FORMAT_TABLE
from mptrain.config.precision import FP8Config, MXConfig, NVFP4Config, PrecisionConfig
from mptrain.precision import policy as policy_module
from mptrain.precision.policy import resolve_precision
from mptrain.precision.quant.block_linear import BlockLinear
from mptrain.precision.quant.block_quant import BlockQuantization, quantize_operand
from mptrain.precision.quant.blocked import BlockQuantized
from mptrain.precision.quant.fp8 import E4M3, E5M2
from mptrain.precision.quant.kernels import (
    block_gemm,
    block_gemm_available,
    scaled_mm_call,
    to_blocked,
    transposed,
)
from mptrain.train import job as run_module

CPU, GPU = torch.device("cpu"), torch.device("cuda")
RECIPES = {
    "mxfp8": BlockQuantization("mxfp8"),
    "nvfp4": BlockQuantization("nvfp4", weight_tiles=True, hadamard=True, stochastic_rounding=True),
    "nvfp4-1d": BlockQuantization("nvfp4"),
    "fp8_blockwise": BlockQuantization("fp8_blockwise"),
}
ST = F.ScalingType


def randn(*shape: int, seed: int = 0, device: torch.device = CPU) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device)


# ------------------------------------------------------------------- a reference of the kernel
def torchao_mx():
    """torchao's MX helpers (FP4 unpacking, the swizzled scale layout), imported when a test needs
    them: a test that does skips where torchao is not installed. Not at module level: the GPU
    machine's image has no torchao, and one collection error would cost every GPU test of the
    run (benchmarks/gpu_image/sitecustomize.py rehearses that image)."""
    kernels = pytest.importorskip("torchao.prototype.mx_formats.kernels")
    utils = pytest.importorskip("torchao.prototype.mx_formats.utils")
    return kernels, utils


def _element_values(mat: torch.Tensor, k_last: bool) -> torch.Tensor:
    """FP32 values of FP8 or packed FP4 elements (FP4 packed along K: the last dimension of a
    row-major left operand, the first of a column-major right one)."""
    if mat.dtype != torch.float4_e2m1fn_x2:
        return mat.float()
    rows_first = mat if k_last else mat.t()
    kernels, _ = torchao_mx()
    values = kernels.f4_unpacked_to_f32(
        kernels.unpack_uint4(rows_first.contiguous().view(torch.uint8))
    )
    return values if k_last else values.t()


def _block_scales(scale, recipe, swizzle, rows: int, k: int) -> torch.Tensor:
    """One scale per element of a (rows, K) operand, FP32, read as the kernel reads ``scale``."""
    if recipe in (ST.BlockWise1x32, ST.BlockWise1x16):
        block = 32 if recipe == ST.BlockWise1x32 else 16
        assert swizzle == F.SwizzleType.SWIZZLE_32_4_4 and scale.is_contiguous()
        assert scale.numel() == -(-rows // 128) * 128 * -(-(k // block) // 4) * 4
        per_block = torchao_mx()[1].from_blocked(scale, rows, k // block)
        return per_block.float().repeat_interleave(block, dim=1)
    assert swizzle is None and scale.dtype == torch.float32
    if recipe == ST.BlockWise1x128:  # (rows, K/128), outer-dim-major
        # torch accepts stride 1 for a dimension of size 1 (its strides are then ambiguous)
        assert scale.shape == (rows, k // 128) and scale.stride(0) == 1
        assert scale.stride(1) == rows or scale.shape[1] == 1
        return scale.repeat_interleave(128, dim=1)
    assert recipe == ST.BlockWise128x128  # (round_up(K/128, 4), rows/128), strides (1, that)
    padded = -(-(k // 128) // 4) * 4
    assert scale.shape == (padded, rows // 128) and scale.stride(0) == 1
    assert scale.stride(1) == padded or scale.shape[1] == 1
    return scale[: k // 128].t().repeat_interleave(128, 0).repeat_interleave(128, 1)


def dequantized_arguments(  # noqa: PLR0913 (scaled_mm's own arguments)
    mat_a, mat_b, scale_a, scale_recipe_a, scale_b, scale_recipe_b, swizzle_a=None, swizzle_b=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, B): the M x K and K x N FP32 matrices a ``scaled_mm`` call with these arguments
    multiplies, after checking torch's contract for them (ScaledBlas.cpp)."""
    packed = 2 if mat_a.dtype == torch.float4_e2m1fn_x2 else 1
    (m, k), n = (mat_a.shape[0], mat_a.shape[1] * packed), mat_b.shape[1]
    assert mat_b.shape[0] * packed == k and k % 16 == 0 and n % 16 == 0
    assert mat_a.stride() == (mat_a.shape[1], 1), "mat_a must be row-major"
    assert mat_b.stride() == (1, mat_b.shape[0]), "mat_b must be column-major"
    if scale_recipe_a in (ST.BlockWise1x128, ST.BlockWise128x128):  # torch's DeepSeek recipe
        assert mat_a.dtype == mat_b.dtype == E4M3
    a = _element_values(mat_a, True) * _block_scales(scale_a, scale_recipe_a, swizzle_a, m, k)
    b = _element_values(mat_b.t(), True) * _block_scales(scale_b, scale_recipe_b, swizzle_b, n, k)
    return a, b.t()


def reference_scaled_mm(  # noqa: PLR0913 (scaled_mm's own signature)
    mat_a, mat_b, scale_a, scale_recipe_a, scale_b, scale_recipe_b, swizzle_a=None,
    swizzle_b=None, bias=None, output_dtype=torch.bfloat16, contraction_dim=(),
    use_fast_accum=False,
) -> torch.Tensor:  # fmt: skip
    """``torch.nn.functional.scaled_mm`` as the kernel computes it (FP32 accumulation), in pure
    torch, for the recipes mptrain uses: what stands in for the kernel on the CPU."""
    assert bias is None and not contraction_dim and not use_fast_accum
    a, b = dequantized_arguments(
        mat_a, mat_b, scale_a, scale_recipe_a, scale_b, scale_recipe_b, swizzle_a, swizzle_b
    )
    return torch.mm(a.contiguous(), b.contiguous()).to(output_dtype)


# ------------------------------------------------------------------------------ 1. to_blocked
@pytest.mark.parametrize("shape", [(1, 1), (3, 5), (128, 4), (130, 7), (257, 9), (64, 33)])
@pytest.mark.parametrize("dtype", [torch.float8_e8m0fnu, E4M3, torch.float32])
def test_to_blocked_equals_torchaos_bit_for_bit(shape, dtype):
    codes = torch.randint(0, 255, shape, generator=torch.Generator().manual_seed(1))
    scale = codes.to(torch.uint8).view(dtype) if dtype != torch.float32 else codes.float()
    utils = torchao_mx()[1]
    ours, theirs = to_blocked(scale), utils.to_blocked(scale)
    assert ours.dtype == theirs.dtype == dtype and ours.shape == theirs.shape
    ints = torch.uint8 if dtype != torch.float32 else torch.int32
    assert torch.equal(ours.view(ints), theirs.view(ints))
    assert torch.equal(utils.from_blocked(ours, *shape).view(ints), scale.view(ints))


# -------------------------------------------------------------------- 2. the decision, faked
@pytest.fixture
def fake_gpu(monkeypatch):
    """Pretend a CUDA device of a chosen compute capability (and torch's CUDA version)."""

    def install(capability: tuple[int, int], cuda: str | None = "13.0") -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "FakeGPU")
        monkeypatch.setattr(torch.version, "cuda", cuda)

    return install


@pytest.mark.parametrize(
    ("capability", "blockwise", "mx"),
    [((8, 9), False, False), ((9, 0), True, False), ((10, 0), False, True),
     ((10, 3), False, True), ((12, 0), False, True)],
)  # fmt: skip
def test_availability_follows_the_compute_capability(fake_gpu, capability, blockwise, mx):
    fake_gpu(capability)
    assert block_gemm_available(GPU, "fp8_blockwise")[0] is blockwise
    for fmt in ("mxfp8", "nvfp4"):
        available, why = block_gemm_available(GPU, fmt)
        assert available is mx and (why == "") is mx
        if not mx:
            major, minor = capability
            assert why == (
                f"no real {fmt} GEMM on compute capability {major}.{minor}: it needs an "
                "NVIDIA GPU of compute capability >= 10.0 (Blackwell)"
            )
    if not blockwise:
        assert (
            "Hopper GPU (compute capability 9.x)" in block_gemm_available(GPU, "fp8_blockwise")[1]
        )


def test_availability_needs_cuda_torchs_build_and_e4m3_gradients(fake_gpu, monkeypatch):
    available, why = block_gemm_available(CPU, "mxfp8")
    assert not available and why.startswith("no real mxfp8 GEMM on the CPU: it needs")
    fake_gpu((9, 0))
    available, why = block_gemm_available(GPU, "fp8_blockwise", E5M2)
    assert not available and "E4M3 operands only (fp8.format=e4m3" in why
    fake_gpu((9, 0), cuda="12.8")  # cuBLAS's blockwise FP8 arrived in 12.9
    assert "built with CUDA 12.8, it needs >= 12.9" in block_gemm_available(GPU, "fp8_blockwise")[1]
    fake_gpu((10, 0), cuda="12.8")
    assert block_gemm_available(GPU, "mxfp8") == (True, "")
    fake_gpu((10, 0), cuda=None)
    assert "is not a CUDA build" in block_gemm_available(GPU, "nvfp4")[1]
    fake_gpu((10, 0))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert block_gemm_available(GPU, "nvfp4") == (
        False,
        "no real nvfp4 GEMM: CUDA is not available here",
    )


def test_the_policy_runs_real_gemms_where_available_and_records_it(fake_gpu):
    fake_gpu((9, 0))
    e4m3 = FP8Config(granularity="blockwise", format="e4m3")
    real = resolve_precision(PrecisionConfig(name="fp8"), GPU, e4m3)
    assert real.blocks.real_gemm and (real.label, real.emulated) == ("fp8", False)
    assert not any("emulated" in note for note in real.notes)
    assert "via scaled_mm" in real.describe()
    hybrid = resolve_precision(PrecisionConfig(name="fp8"), GPU, FP8Config(granularity="blockwise"))
    assert not hybrid.blocks.real_gemm and hybrid.label == "fp8 (emulated)"
    assert any("E4M3 operands only" in note for note in hybrid.notes)
    asked = resolve_precision(PrecisionConfig(name="fp8"), GPU, FP8Config(
        granularity="blockwise", format="e4m3", emulate=True))  # fmt: skip
    assert not asked.blocks.real_gemm and any("fp8.emulate=true" in n for n in asked.notes)
    mx = resolve_precision(PrecisionConfig(name="mxfp8"), GPU)
    assert not mx.blocks.real_gemm and any("compute capability 9.0" in n for n in mx.notes)
    with pytest.raises(ConfigError, match=r"^mx\.emulate=false: no real mxfp8 GEMM on comp"):
        resolve_precision(PrecisionConfig(name="mxfp8"), GPU, mx=MXConfig(emulate=False))
    fake_gpu((10, 0))
    for name in ("mxfp8", "nvfp4"):
        policy = resolve_precision(PrecisionConfig(name=name), GPU)
        assert policy.blocks.real_gemm and policy.label == name and not policy.emulated
    nvfp4 = resolve_precision(PrecisionConfig(name="nvfp4"), GPU, nvfp4=NVFP4Config(emulate=False))
    assert nvfp4.blocks.real_gemm and nvfp4.blocks.weight_tiles  # the recipe's settings kept
    with pytest.raises(ConfigError, match=r"^fp8\.emulate=false: no real fp8_blockwise GEMM"):
        resolve_precision(PrecisionConfig(name="fp8"), GPU, FP8Config(
            granularity="blockwise", format="e4m3", emulate=False))  # fmt: skip


# ------------------------------------------------------------ 3. the kernel's arguments
def gemm_operands(recipe: BlockQuantization, tokens: int, n_in: int, n_out: int, which: str):
    """(quantized a, quantized b, emulated a, emulated b) of one of a Linear's GEMMs, quantized
    as BlockLinear quantizes them: ``out`` (x Wᵀ), ``dx`` (dy W), ``dW`` (dyᵀ x)."""
    x, w, dy = randn(tokens, n_in, seed=1), randn(n_out, n_in, seed=2), randn(tokens, n_out, seed=3)
    tiled = recipe.tiled_weight

    def both(t, dim, role):
        q = quantize_operand(recipe, t, dim, role)
        return q, q.dequantize(torch.float32)

    if which == "out":
        (a, ea), (b, eb) = both(x, 1, "input"), both(w, 1, "weight")
        return a, transposed(b), ea, eb.t()
    if which == "dx":  # a tiled weight: the forward's quantization, along in_features
        (a, ea), (b, eb) = both(dy, 1, "grad"), both(w, 1 if tiled else 0, "weight")
        return a, b, ea, eb
    (a, ea), (b, eb) = both(dy.t().contiguous(), 1, "grad"), both(x.t().contiguous(), 1, "input")
    return a, transposed(b), ea, eb.t()


SHAPES = {  # (tokens, in, out): tokens not a multiple of 16 (blockwise pads them)
    "mxfp8": (40, 96, 64), "nvfp4": (33, 64, 48), "nvfp4-1d": (33, 64, 48),
    "fp8_blockwise": (37, 256, 384),
}  # fmt: skip


@pytest.mark.parametrize("which", ["out", "dx", "dW"])
@pytest.mark.parametrize("name", RECIPES)
def test_the_kernels_arguments_are_the_emulated_operands(name, which):
    recipe = RECIPES[name]
    tokens, n_in, n_out = SHAPES[name]
    if which == "dW":  # the tokens are the reduction: whole blocks, as BlockLinear pads them
        tokens += -tokens % recipe.block_size
    a, b, ea, eb = gemm_operands(recipe, tokens, n_in, n_out, which)
    call = scaled_mm_call(a, b, torch.bfloat16, recipe.format)
    arguments = (call.mat_a, call.mat_b, call.scale_a, call.recipe_a, call.scale_b, call.recipe_b)
    a_ref, b_ref = dequantized_arguments(*arguments, call.swizzle, call.swizzle)
    rows = ea.shape[0]
    assert call.rows == rows and (a_ref[rows:] == 0).all()  # padding rows add nothing
    alpha = call.alpha if call.alpha is not None else torch.tensor(1.0)
    if (
        recipe.format == "nvfp4"
    ):  # element x (tensor scale x block scale) vs (element x block) x both
        a_ts, b_ts = a.tensor_scale, b.tensor_scale
        torch.testing.assert_close(a_ref[:rows] * a_ts, ea, rtol=2**-23, atol=0)
        torch.testing.assert_close(b_ref * b_ts, eb, rtol=2**-23, atol=0)
        assert torch.equal(alpha, a_ts * b_ts) and call.output_dtype == torch.float32
    else:
        assert torch.equal(a_ref[:rows], ea) and torch.equal(b_ref, eb) and call.alpha is None
        assert call.output_dtype == torch.bfloat16
    expected = {"mxfp8": ST.BlockWise1x32, "nvfp4": ST.BlockWise1x16}.get(recipe.format)
    if expected is not None:
        assert call.recipe_a == call.recipe_b == expected
        assert call.swizzle == F.SwizzleType.SWIZZLE_32_4_4
    else:
        weight_b = which != "dW"  # the weight's 128x128 blocks; dW's x in 1x128 tiles
        assert call.recipe_a == ST.BlockWise1x128
        assert call.recipe_b == (ST.BlockWise128x128 if weight_b else ST.BlockWise1x128)


def test_operands_the_kernel_cannot_take_are_refused():
    x, w = randn(32, 128), randn(128, 128, seed=1)
    mx = RECIPES["mxfp8"]
    a, b = quantize_operand(mx, x, 1, "input"), quantize_operand(mx, w, 1, "weight")
    with pytest.raises(ValueError, match="blocks lie along N, not K"):
        scaled_mm_call(a, b, torch.bfloat16, "mxfp8")  # b not transposed: blocks along N
    with pytest.raises(ValueError, match="left operand must be 2-D, in 1-D blocks along dim 1"):
        scaled_mm_call(transposed(a), transposed(b), torch.bfloat16, "mxfp8")
    e5m2 = BlockQuantization("fp8_blockwise", grad_dtype=E5M2)
    g = quantize_operand(e5m2, x, 1, "grad")
    w_q = quantize_operand(e5m2, w, 1, "weight")
    with pytest.raises(ValueError, match="E4M3 operands only"):
        scaled_mm_call(g, transposed(w_q), torch.float32, "fp8_blockwise")
    with pytest.raises(TypeError, match="real GEMM takes quantized operands"):
        block_gemm(x, w.t(), torch.float32, BlockQuantization("mxfp8", real_gemm=True))


# ------------------------------------------ 4. BlockLinear's real path, the kernel a reference
def layer_pair(name: str, n_in: int, n_out: int, device: torch.device = CPU):
    """(real, emulated): BlockLinear copies of one nn.Linear, the same seed."""
    base = torch.nn.Linear(n_in, n_out).to(device)
    recipe = RECIPES[name]
    return tuple(
        BlockLinear.from_linear(copy.deepcopy(base), replace(recipe, real_gemm=real), seed=5)
        for real in (True, False)
    )


def run_both(real, emulated, x, dy, autocast: bool = False):
    results = []
    for layer in (real, emulated):
        xi = x.clone().requires_grad_()
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast):
            out = layer(xi)
        out.backward(dy)
        results.append((out.float(), xi.grad, layer.weight.grad, layer.bias.grad))
    return results


@pytest.mark.parametrize("sampling", [False, True])
@pytest.mark.parametrize("name", RECIPES)
def test_block_linears_real_path_equals_its_emulation(monkeypatch, name, sampling):
    monkeypatch.setattr(F, "scaled_mm", reference_scaled_mm)
    tokens, n_in, n_out = SHAPES[name]
    real, emulated = layer_pair(name, n_in, n_out)
    real.sampling = emulated.sampling = sampling
    x, dy = randn(3, tokens, n_in, seed=7), randn(3, tokens, n_out, seed=8)
    got, want = run_both(real, emulated, x, dy)
    for g, w in zip(got, want, strict=True):  # FP32 sums in another order, NVFP4's scale after
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5 * w.abs().max().item())
    if sampling:  # the counts come from the same quantizations
        assert real.layer_stats() == emulated.layer_stats()
        assert real.layer_stats()["grad"]["samples"] == 2
    if real.generator is not None:  # the same stochastic-rounding draws
        assert torch.equal(real.generator.get_state(), emulated.generator.get_state())


@pytest.mark.slow
def test_a_run_with_the_real_backend_records_it(tmp_path, monkeypatch):
    """The policy picks the real GEMM (availability faked) and the kernel is the reference:
    the report says what the layers ran."""
    monkeypatch.setattr(
        policy_module, "block_gemm_available", lambda device, fmt, grads: (True, "")
    )
    monkeypatch.setattr(F, "scaled_mm", reference_scaled_mm)
    monkeypatch.setattr(run_module, "FigureWorker", NoFigure)
    report = train(tiny_run("precision=mxfp8", "max_steps=4", "log_every=2"), tmp_path)
    assert report["status"] == "completed"
    assert (report["precision"]["emulated"], report["precision"]["label"]) == (False, "mxfp8")
    assert report["blocks"]["gemm"] == "scaled_mm" and report["blocks"]["emulated"] is False


def load_script(name: str):
    """A benchmark script as a module, benchmarks/ on sys.path as when it runs (its jsondoc)."""
    benchmarks = Path(__file__).resolve().parents[2] / "benchmarks"
    if str(benchmarks) not in sys.path:
        sys.path.append(str(benchmarks))
    spec = importlib.util.spec_from_file_location(f"_{name.removesuffix('.py')}", benchmarks / name)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_the_gpu_checks_block_rows_run_where_the_kernel_does(monkeypatch, capsys):
    """benchmarks/gpu_fp8_check.py's block-scaled part, the kernel the reference (and its
    availability faked): a row per format and shape with its figures; without: the skip printed."""
    script = load_script("gpu_fp8_check.py")
    rows = script.block_gemms(CPU, [(48, 256, 128)], 1)
    assert [(r["format"], r["skipped"]) for r in rows] == [
        (fmt, f"skipped: needs {sm}, this is the CPU (no real {fmt} GEMM on the CPU: it needs "
              f"{FORMAT_TABLE[fmt].kernel.needs.removeprefix('needs ')})")
        for fmt, sm in (("fp8_blockwise", "SM90"), ("mxfp8", "SM100"), ("nvfp4", "SM100"))
    ]  # fmt: skip
    assert "block GEMM mxfp8 48x256x128: skipped: needs SM100" in capsys.readouterr().out
    monkeypatch.setattr(script, "block_gemm_available", lambda device, fmt: (True, ""))
    monkeypatch.setattr(F, "scaled_mm", reference_scaled_mm)
    rows = script.block_gemms(CPU, [(48, 256, 128)], 1)
    assert [row["format"] for row in rows] == ["fp8_blockwise", "mxfp8", "nvfp4"]
    for row in rows:
        assert "error" not in row and "skipped" not in row, row
        assert row["real_vs_emulated_sqnr_db"] > 40 and row["real_vs_fp32_sqnr_db"] > 10
        assert set(row["seconds_per_call"]) == {"real", "emulated", "bf16"}


# ------------------------------------------------------------------------------- 5. on a GPU
def needs_kernel(fmt: str):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    available, why = block_gemm_available(GPU, fmt)
    if not available:
        pytest.skip(why)


def on_gpu(q: BlockQuantized) -> BlockQuantized:
    ts = None if q.tensor_scale is None else q.tensor_scale.to(GPU)
    return replace(q, data=q.data.to(GPU), scale=q.scale.to(GPU), tensor_scale=ts)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("which", ["out", "dx", "dW"])
@pytest.mark.parametrize("name", RECIPES)
def test_real_block_gemm_matches_the_emulated_one(name, which, out_dtype):
    recipe = RECIPES[name]
    needs_kernel(recipe.format)
    tokens, n_in, n_out = (256, 512, 384) if recipe.format == "fp8_blockwise" else (200, 256, 96)
    tokens += -tokens % recipe.block_size if which == "dW" else 0
    a, b, ea, eb = gemm_operands(recipe, tokens, n_in, n_out, which)
    real = block_gemm(
        on_gpu(a), on_gpu(b), out_dtype, BlockQuantization(recipe.format, real_gemm=True)
    )
    emulated = block_gemm(ea.to(GPU), eb.to(GPU), out_dtype, BlockQuantization(recipe.format))
    assert real.dtype == emulated.dtype == out_dtype and real.shape == emulated.shape
    atol = 1e-3 * emulated.float().abs().max().item()
    rtol = 2**-7 if out_dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(real.float(), emulated.float(), rtol=rtol, atol=atol)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("name", RECIPES)
def test_real_block_linear_matches_emulated_under_bf16_autocast(name):
    needs_kernel(RECIPES[name].format)
    n_in, n_out = (256, 384) if name == "fp8_blockwise" else (128, 96)
    real, emulated = layer_pair(name, n_in, n_out, GPU)
    x, dy = randn(4, 50, n_in, device=GPU), randn(4, 50, n_out, seed=1, device=GPU)
    got, want = run_both(real, emulated, x, dy.bfloat16(), autocast=True)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=2**-7, atol=1e-2 * w.abs().max().item())


GPU_RUNS = {
    "mxfp8": ("precision=mxfp8",),
    "nvfp4": ("precision=nvfp4",),
    "fp8_blockwise": ("precision=fp8", "fp8.granularity=blockwise", "fp8.format=e4m3"),
}


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("fmt", GPU_RUNS)
def test_a_short_gpu_run_trains_with_real_block_gemms(tmp_path, fmt):
    needs_kernel(fmt)
    # mlp on digits: 64->256 (first), 256->256 (converted: 256 is whole blocks), 256->10 (last)
    cfg = compose_run("device=cuda", "progress=false", "model=mlp", "max_steps=40",
                      "log_every=10", *GPU_RUNS[fmt])  # fmt: skip
    report = train(cfg, tmp_path)
    assert report["status"] == "completed"
    assert (report["precision"]["emulated"], report["blocks"]["gemm"]) == (False, "scaled_mm")
    assert [row["name"] for row in report["blocks"]["layers"] if row["converted"]]
    assert report["evaluation"]["final_val_accuracy"] > 0.5
