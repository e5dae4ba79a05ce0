"""Training in the block-scaled formats (precision=mxfp8, precision=nvfp4, fp8.granularity=blockwise).

- :class:`BlockLinear`'s output and gradients equal torchao's MXFP8 training layer with its
  emulated kernels bit for bit; NVFP4 and blockwise FP8 equal a direct reference built from the
  quantizers (the recipe's roles, tiles, Hadamard transform, stochastic rounding and its draw
  order) and stay close to FP32;
- the emulation's fast fake quantization equals ``quantize_*().dequantize()`` bit for bit on
  every case of test_blocks_torchao.py, and its FP32 rounding equals torch's FP8 casts on every
  grid point, midpoint and their neighbours;
- layer selection (FP8's rules under each format's keys, the block-size alignment, NVFP4's BF16
  tail), conversion and its undoing, counting only when asked;
- the precision policy (emulated and labelled, ``emulate=false`` refused), config validation;
- tiny classification and language-model runs train and report their formats and counts, a
  stochastically rounded NVFP4 run resumes bit for bit, a changed recipe's checkpoint is noted.
"""

from __future__ import annotations

import math
from collections import OrderedDict

import pytest
import torch
from support.runs import LM, NoFigure, compose_run, tiny_run, train
from torch import nn

from mptrain.checkpoint.checkpointer import run_signature
from mptrain.checkpoint.file import load_checkpoint
from mptrain.config.base import ConfigError
from mptrain.config.precision import FP8Config, MXConfig, NVFP4Config, PrecisionConfig
from mptrain.precision.formats import to_plain_linear
from mptrain.precision.plugin import Precision
from mptrain.precision.policy import resolve_precision
from mptrain.precision.quant import e2m1, fake
from mptrain.precision.quant.block_linear import BlockLinear
from mptrain.precision.quant.block_quant import (
    BlockQuantization,
    fake_quant_operand,
    quantize_operand,
)
from mptrain.precision.quant.blockwise import quantize_blockwise
from mptrain.precision.quant.convert import (
    BlockLayers,
    apply_quantized,
    convert_linears,
    layer_rules,
)
from mptrain.precision.quant.dist import gathers_fp32
from mptrain.precision.quant.fp8 import E4M3, E5M2, FP8_MAX
from mptrain.precision.quant.hadamard import random_hadamard_transform, rht_signs
from mptrain.precision.quant.nvfp4 import quantize_nvfp4
from mptrain.precision.selection import choose
from mptrain.train import job as run_module

CPU = torch.device("cpu")
MXFP8 = BlockQuantization("mxfp8")
NVFP4 = BlockQuantization("nvfp4", weight_tiles=True, hadamard=True, stochastic_rounding=True)
BLOCKWISE = BlockQuantization("fp8_blockwise", grad_dtype=E5M2)


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def sqnr_db(reference: torch.Tensor, other: torch.Tensor) -> float:
    ref, out = reference.double(), other.double()
    return 10 * math.log10(ref.pow(2).sum().item() / (ref - out).pow(2).sum().item())


def run_layer(layer: nn.Module, x: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(output, input gradient, weight gradient, bias gradient) of one forward and backward."""
    layer.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    out = layer(x)
    out.backward(dy)
    return out.detach(), x.grad, layer.weight.grad, layer.bias.grad


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and bits (NaN where the other is NaN)."""
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
    ints = {4: torch.int32, 2: torch.int16}[a.element_size()]
    return bool(((a.view(ints) == b.view(ints)) | (a.isnan() & b.isnan())).all())


# ---------------------------------------------------------------- 1. against torchao (MXFP8)
@pytest.mark.parametrize("rounding", ["floor", "rceil"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_block_linear_equals_torchaos_emulated_mxfp8_linear(rounding, dtype):
    """torchao's MXFP8 training layer (``MXFP8Linear``, ``KernelPreference.EMULATED``: to_mx and
    a matmul of the dequantized operands) on the same weights and inputs (3-D, as a transformer
    feeds it): the output, the input, weight and bias gradients, bit for bit. In BF16 (a pure
    BF16 layer) torchao multiplies in BF16 and mptrain in FP32 then rounds: the same bits here
    (the products of E4M3 values with power-of-two scales are exact)."""
    mxfp8_linear = pytest.importorskip("torchao.prototype.moe_training.mxfp8_linear")
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

    torch.manual_seed(0)
    linear = nn.Linear(128, 96).to(dtype)
    theirs = mxfp8_linear.MXFP8Linear(
        128,
        96,
        kernel_preference=KernelPreference.EMULATED,
        scale_calculation_mode=ScaleCalculationMode(rounding),
    ).to(dtype)
    theirs.load_state_dict(linear.state_dict())
    ours = BlockLinear.from_linear(linear, BlockQuantization("mxfp8", scale_rounding=rounding))
    x, dy = randn(4, 16, 128, seed=1).to(dtype), randn(4, 16, 96, seed=2).to(dtype)
    for mine, reference in zip(run_layer(ours, x, dy), run_layer(theirs, x, dy), strict=True):
        assert bits_equal(mine, reference)


def test_block_linear_reshapes_and_counts_under_bf16_autocast():
    """Under autocast (FP32 master weights, BF16 activations) the output takes the autocast
    dtype, the input gradient the input's and the weight gradient FP32."""
    layer = BlockLinear.from_linear(nn.Linear(64, 32), MXFP8)
    x = randn(2, 8, 64).to(torch.bfloat16).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x)
    out.float().sum().backward()
    assert out.shape == (2, 8, 32) and out.dtype == torch.bfloat16
    assert x.grad.dtype == torch.bfloat16 and layer.weight.grad.dtype == torch.float32


# --------------------------------------------------- 2. NVFP4 and blockwise against references
def nvfp4_reference(
    linear: nn.Linear, layer: BlockLinear, x: torch.Tensor, dy: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """NVIDIA's recipe written out with the quantizers: x 1x16 and W 16x16 tiles in the forward;
    dy 1x16 stochastically rounded (the layer's seed, first draws) and the same W tiles for dx;
    dy (next draws) and x Hadamard-transformed along the tokens for dW."""
    generator = torch.Generator().manual_seed(layer.seed)
    signs = layer.rht_signs

    def q(t, dim, tile_2d=False, sr=False):
        g = generator if sr else None
        return quantize_nvfp4(t, dim, tile_2d=tile_2d, generator=g).dequantize()

    w = q(linear.weight.detach(), 1, tile_2d=True)
    out = (q(x, 1) @ w.t()) + linear.bias.detach()
    dx = q(dy, 1, sr=True) @ w
    g_t = random_hadamard_transform(dy.t().contiguous(), signs, -1)
    x_t = random_hadamard_transform(x.t().contiguous(), signs, -1)
    dw = q(g_t, 1, sr=True) @ q(x_t, 1).t()
    return out, dx, dw, dy.sum(0)


def test_nvfp4_linear_is_the_recipe_written_out_and_close_to_fp32():
    linear = nn.Linear(64, 48)
    layer = BlockLinear.from_linear(nn.Linear(64, 48), NVFP4, seed=7)
    layer.load_state_dict(linear.state_dict())
    x, dy = randn(32, 64, seed=1), randn(32, 48, seed=2)
    ours = run_layer(layer, x, dy)
    for mine, reference in zip(ours, nvfp4_reference(linear, layer, x, dy), strict=True):
        assert bits_equal(mine, reference)
    fp32 = run_layer(linear, x, dy)
    # 4-bit elements (SQNR about 20 dB on N(0, 1) data), stochastic rounding of dy costs a few
    # dB more; the random Hadamard transform leaves dW = dyᵀ x unchanged up to rounding.
    for name, mine, reference, floor_db in zip(
        ("out", "dx", "dW"), ours, fp32, (15, 10, 10), strict=False
    ):
        assert sqnr_db(reference, mine) > floor_db, name


def test_nvfp4_stochastic_rounding_draws_from_the_layers_generator_only():
    layer = BlockLinear.from_linear(nn.Linear(32, 32), NVFP4, seed=3)
    global_state = torch.get_rng_state()
    first = run_layer(layer, randn(16, 32), randn(16, 32, seed=1))
    assert torch.equal(torch.get_rng_state(), global_state)
    again = run_layer(layer, randn(16, 32), randn(16, 32, seed=1))
    assert torch.equal(first[0], again[0])  # the forward rounds to nearest
    assert not torch.equal(first[1], again[1])  # dy's draws moved on
    layer.generator.manual_seed(3)
    replay = run_layer(layer, randn(16, 32), randn(16, 32, seed=1))
    assert all(torch.equal(a, b) for a, b in zip(first, replay, strict=True))


def test_blockwise_linear_is_the_recipe_written_out_and_close_to_fp32():
    linear = nn.Linear(256, 128)
    layer = BlockLinear.from_linear(nn.Linear(256, 128), BLOCKWISE)
    layer.load_state_dict(linear.state_dict())
    x, dy = randn(100, 256, seed=1), randn(100, 128, seed=2)  # 100 tokens: dW pads to 128

    def q(t, dim, tile_2d=False, elem=E4M3):
        return quantize_blockwise(t, dim, tile_2d=tile_2d, elem_dtype=elem).dequantize()

    w = q(linear.weight.detach(), 1, tile_2d=True)
    pad = torch.zeros(28, 256), torch.zeros(28, 128)
    x_pad, dy_pad = torch.cat([x, pad[0]]), torch.cat([dy, pad[1]])
    reference = (
        q(x, 1) @ w.t() + linear.bias.detach(),
        q(dy, 1, elem=E5M2) @ w,
        q(dy_pad.t().contiguous(), 1, elem=E5M2) @ q(x_pad.t().contiguous(), 1).t(),
        dy.sum(0),
    )
    ours = run_layer(layer, x, dy)
    for mine, theirs in zip(ours, reference, strict=True):
        assert bits_equal(mine, theirs)
    for mine, fp32 in zip(ours[:3], run_layer(linear, x, dy)[:3], strict=True):
        assert sqnr_db(fp32, mine) > 22  # E4M3 operands about 31 dB; dx and dW, E5M2 dy: 25


# -------------------------------------------------------- 3. the fast fake quantization
def special(case: str, shape: tuple[int, int], block: int) -> torch.Tensor:
    """Edge cases of test_blocks_torchao.py: zeros, a zero block, FP32 subnormals, blocks at the
    bottom of E8M0's range, outliers, inf, NaN and a range of 1e-35..1e35 across rows."""
    x = randn(*shape, seed=len(case))
    if case == "zeros":
        x.zero_()
    elif case == "zero_block":
        x[1, block : 2 * block] = 0
    elif case == "denormal":
        x *= 1e-40
    elif case == "tiny_blocks":  # blocks at 1e-40 (subnormal), 1e-38, 2^-118, 1e-30
        for row, size in enumerate((1e-40, 1e-38, 2.0**-118, 1e-30)):
            x[row, :block] *= size
    elif case == "outlier":
        x[2, 3], x[3, block + 1] = 1e4, -3e4
    elif case == "inf":
        x[0, 5], x[2, block] = torch.inf, -torch.inf
    elif case == "nan":
        x[1, 7] = torch.nan
    elif case == "wide_range":
        x *= torch.logspace(-35, 35, shape[0])[:, None]
    return x


CASES = (
    "randn", "zeros", "zero_block", "denormal", "tiny_blocks", "outlier", "inf", "nan", "wide_range",
)  # fmt: skip
RECIPES = {
    "mxfp8-floor": BlockQuantization("mxfp8", scale_rounding="floor"),
    "mxfp8-rceil": MXFP8,
    "nvfp4-1x16": BlockQuantization("nvfp4"),
    "nvfp4-recipe": NVFP4,
    "blockwise-e4m3": BlockQuantization("fp8_blockwise"),
    "blockwise-hybrid": BLOCKWISE,
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("recipe", RECIPES.values(), ids=RECIPES.keys())
def test_fast_fake_quantization_equals_quantize_then_dequantize(recipe, case, dtype):
    x = special(case, (256, 256), recipe.block_size).to(dtype)
    for role in ("input", "weight", "grad"):
        for dim in (0, 1):
            seeded = [torch.Generator().manual_seed(5) for _ in range(2)]
            slow = quantize_operand(recipe, x, dim, role, generator=seeded[0]).dequantize()
            fast = fake_quant_operand(recipe, x, dim, role, generator=seeded[1])
            assert bits_equal(fast, slow), (role, dim)
            assert fast.stride() == slow.stride()  # the GEMM reads the same layout


@pytest.mark.parametrize("shape", [(3, 16), (64, 128), (40, 4096)])
def test_in_place_hadamard_transform_is_the_transforms_bits(shape):
    t = randn(*shape) * 10
    signs = rht_signs(3)
    expected = random_hadamard_transform(t, signs, -1)
    assert bits_equal(fake.hadamard_(t.clone(), signs), expected)


def grid_points(values: torch.Tensor, limit: float, count: int) -> torch.Tensor:
    """A format's values, the midpoints between them, their FP32 neighbours (clamped to
    ±``limit``), uniform draws over the range, small values, zeros of both signs."""
    values = torch.cat([values, -values]).unique()
    points = torch.cat([values, (values[:-1] + values[1:]) / 2])
    up, down = torch.tensor(math.inf), torch.tensor(-math.inf)
    points = torch.cat([points, torch.nextafter(points, up), torch.nextafter(points, down)])
    draws = torch.rand(count, generator=torch.Generator().manual_seed(0))
    tiny = randn(count) * 1e-3
    signed_zeros = torch.tensor([0.0, -0.0, 1e-45, -1e-45])
    return torch.cat([points.clamp(-limit, limit), (2 * draws - 1) * limit, tiny, signed_zeros])


@pytest.mark.parametrize("dtype", [E4M3, E5M2, e2m1.E2M1], ids=["e4m3", "e5m2", "e2m1"])
def test_fp32_rounding_is_the_casts_on_every_grid_point_and_midpoint(dtype):
    if dtype == e2m1.E2M1:
        points = grid_points(torch.tensor(e2m1.E2M1_VALUES), e2m1.E2M1_MAX, 100_000)
        cast = e2m1.decode(e2m1.encode(points))
    else:
        codes = torch.arange(256, dtype=torch.uint8).view(dtype).float()
        points = grid_points(codes[codes.isfinite()], FP8_MAX[dtype], 100_000)
        cast = points.to(dtype).float()
    assert bits_equal(fake.round_magnitude_(points.abs(), dtype).copysign_(points), cast)


# -------------------------------------------------------------- 4. selection and conversion
def named_model() -> nn.Sequential:
    return nn.Sequential(
        OrderedDict(
            embed=nn.Linear(32, 64),
            qkv=nn.Linear(64, 192),
            odd=nn.Linear(64, 48),  # 48: a multiple of 16, not of 32
            fc=nn.Linear(64, 256),
            proj=nn.Linear(256, 128),
            head=nn.Linear(128, 16),
        )
    )


def reasons(recipe: BlockQuantization, **rules) -> dict[str, str]:
    settings = {"include": [], "exclude": [], "keep_first_last": True, **rules}
    return {c.name: c.reason for c in choose(named_model(), layer_rules(recipe, **settings))}


def test_block_formats_select_layers_by_fp8s_rules_with_their_block_size():
    mx = reasons(MXFP8)
    assert mx["embed"] == mx["head"] == "first/last layer kept in BF16"
    assert mx["qkv"] == mx["fc"] == mx["proj"] == "converted"
    assert mx["odd"] == "in/out features not multiples of 32 (MXFP8 blocks of 32)"
    nv = reasons(BlockQuantization("nvfp4", keep_last_fraction=0.3))
    assert nv["odd"] == "converted"  # 48 is a multiple of 16
    tail = (
        "in the last 0.3 of Linear layers (nvfp4.keep_last_fraction; the model has no block "
        "list), kept in BF16"
    )
    assert nv["proj"] == tail and nv["fc"] == "converted"  # ceil(0.3 x 6) = 2: proj, head
    assert nv["head"] == "first/last layer kept in BF16"
    blockwise = reasons(BLOCKWISE, keep_first_last=False)
    assert [n for n, r in blockwise.items() if r == "converted"] == ["proj"]  # 256 -> 128 only
    assert blockwise["fc"] == "in/out features not multiples of 128 (blockwise FP8 blocks of 128)"


def test_include_exclude_and_min_features_name_the_formats_keys():
    assert reasons(MXFP8, include=["fc"])["qkv"] == "not matched by mx.include"
    assert reasons(NVFP4, exclude=["q*"])["qkv"] == "excluded by nvfp4.exclude pattern 'q*'"
    small = reasons(BlockQuantization("mxfp8", min_features=128))
    assert small["qkv"] == "smaller than mx.min_features=128" and small["proj"] == "converted"
    # include names layers exactly: neither first/last nor the BF16 tail keeps them then
    tail = reasons(BlockQuantization("nvfp4", keep_last_fraction=0.5), include=["head", "proj"])
    assert tail["head"] == tail["proj"] == "converted"


def test_conversion_shares_parameters_and_undoes():
    model = named_model()
    params = list(model.parameters())
    convert_linears(model, choose(model, layer_rules(NVFP4, [], [], True)), NVFP4)
    layers = BlockLayers.of(model)
    assert list(layers.layers) == ["qkv", "odd", "fc", "proj"]
    assert all(isinstance(model.get_submodule(n), BlockLinear) for n in layers.layers)
    assert list(model.parameters()) == params and set(model.state_dict()) == {
        f"{n}.{p}"
        for n in ("embed", "qkv", "odd", "fc", "proj", "head")
        for p in ("weight", "bias")
    }  # no buffers in the state_dict: checkpoints load across precisions
    seeds = [layer.seed for layer in layers.layers.values()]
    assert len(set(seeds)) == 4  # every layer its own signs and generator
    assert to_plain_linear(model) == ["qkv", "odd", "fc", "proj"]
    assert not any(isinstance(m, BlockLinear) for m in model.modules())
    assert list(model.parameters()) == params


def test_block_conversion_reports_formats_flops_and_layers():
    model = nn.Sequential(
        OrderedDict(
            embed=nn.Linear(32, 64), up=nn.Linear(64, 128), down=nn.Linear(128, 64),
            head=nn.Linear(64, 16),
        )
    )  # fmt: skip
    section = apply_quantized(model, MXFP8, randn(2, 32), layer_rules(MXFP8, [], [], True))
    layers = BlockLayers.of(model)
    assert section["name"] == "MXFP8" and section["emulated"] is True
    assert section["operands"]["grad"] == {
        "element": "float8_e4m3fn",
        "scale": "float8_e8m0fnu",
        "block": "1x32",
    }
    assert section["scale_rounding"] == "rceil"
    flops = {"embed": 32 * 64, "up": 64 * 128, "down": 128 * 64, "head": 64 * 16}
    share = (flops["up"] + flops["down"]) / sum(flops.values())
    assert section["linear_flops_share"]["mxfp8"] == pytest.approx(share)
    assert section["linear_flops_share"]["bf16"] == pytest.approx(1 - share)
    assert [row["name"] for row in section["layers"] if row["converted"]] == ["up", "down"]
    assert list(layers.layers) == ["up", "down"]


def test_counts_only_while_sampling():
    """Counting takes the quantizers' own path: the same bits as the fast one."""
    layer = BlockLinear.from_linear(nn.Linear(64, 64), MXFP8)
    layers = BlockLayers({"layer": layer})
    x, dy = randn(32, 64), randn(32, 64, seed=1)
    fast = run_layer(layer, x, dy)
    assert all(c["samples"] == 0 for c in layer.layer_stats().values())
    layers.sample(True)
    counted = run_layer(layer, x, dy)
    layers.sample(False)
    stats = layer.layer_stats()
    # input: forward and dW; weight: forward and dx; grad: dx and dW
    assert [stats[r]["samples"] for r in ("input", "weight", "grad")] == [2, 2, 2]
    assert stats["input"]["elements"] == 2 * 32 * 64 and stats["input"]["blocks"] == 2 * 64
    assert all(torch.equal(a, b) for a, b in zip(fast, counted, strict=True))
    run_layer(layer, x, dy)
    assert layer.layer_stats() == stats


def test_fsdp_gathers_block_layers_weights_in_fp32():
    """As Float8Linear: the layer quantizes its FP32 master weight, not a BF16 copy of it."""
    assert gathers_fp32(BlockLinear.from_linear(nn.Linear(32, 32), MXFP8))
    assert not gathers_fp32(nn.Linear(32, 32))


def test_generator_states_round_trip_and_a_mismatch_is_noted():
    model = named_model()
    convert_linears(model, choose(model, layer_rules(NVFP4, [], [], True)), NVFP4)
    layers = BlockLayers.of(model)
    saved = layers.state_dict()
    assert set(saved["ranks"][0]) == set(layers.layers) and len(saved["ranks"]) == 1
    for layer in layers.layers.values():
        torch.rand(5, generator=layer.generator)
    assert layers.load_state_dict(saved) == []
    for name, layer in layers.layers.items():
        assert torch.equal(saved["ranks"][0][name], layer.generator.get_state())
    (note,) = layers.load_state_dict({})
    assert "not resumed" in note and "start from their seeds" in note
    assert BlockLayers().load_state_dict(saved) == []  # a run without them ignores them


# ------------------------------------------------------------------------ 5. policy, config
def test_block_precisions_are_emulated_and_labelled_on_the_cpu():
    for name, fmt in (("mxfp8", "MXFP8"), ("nvfp4", "NVFP4")):
        policy = resolve_precision(PrecisionConfig(name=name), CPU)
        assert (policy.label, policy.emulated, policy.blocks.format) == (
            f"{name} (emulated)",
            True,
            name,
        )
        assert policy.autocast_dtype is torch.bfloat16 and policy.master_weights
        assert any(note.startswith(f"{fmt} (emulated)") for note in policy.notes)
        assert f"{fmt} Linear layers via emulated GEMMs" in policy.describe()
    blockwise = resolve_precision(
        PrecisionConfig(name="fp8"), CPU, FP8Config(granularity="blockwise")
    )
    assert blockwise.label == "fp8 (emulated)" and blockwise.blocks.format == "fp8_blockwise"
    assert blockwise.blocks.grad_dtype is E5M2 and blockwise.fp8.granularity == "blockwise"


def test_recipe_settings_come_from_their_config_keys():
    nvfp4 = NVFP4Config(hadamard=False, keep_last_fraction=0.25, min_features=32)
    policy = resolve_precision(PrecisionConfig(name="nvfp4"), CPU, nvfp4=nvfp4)
    assert (policy.blocks.hadamard, policy.blocks.keep_last_fraction) == (False, 0.25)
    assert policy.blocks.stochastic_rounding and policy.blocks.weight_tiles
    assert policy.blocks.min_features == 32
    mx = resolve_precision(PrecisionConfig(name="mxfp8"), CPU, mx=MXConfig(scale_rounding="floor"))
    assert mx.blocks.scale_rounding == "floor"
    e4m3 = FP8Config(granularity="blockwise", format="e4m3")
    fp8 = resolve_precision(PrecisionConfig(name="fp8"), CPU, e4m3)
    assert fp8.blocks.grad_dtype is E4M3
    assert resolve_precision(PrecisionConfig(name="bf16"), CPU).blocks is None


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (("precision=mxfp8", "mx.emulate=false"), r"^mx\.emulate=false: no real mxfp8 GEMM"),
        (("precision=nvfp4", "nvfp4.emulate=false"), r"^nvfp4\.emulate=false: "),
        (
            ("precision=fp8", "fp8.granularity=blockwise", "fp8.emulate=false"),
            r"^fp8\.emulate=false: no real fp8_blockwise GEMM",
        ),
    ],
)
def test_emulate_false_is_refused_where_no_real_kernel_runs(overrides, message):
    cfg = tiny_run(*overrides)
    with pytest.raises(ConfigError, match=message) as err:
        resolve_precision(cfg.precision, CPU, cfg.fp8, cfg.mx, cfg.nvfp4)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("mx.scale_rounding=ceil", r"^mx\.scale_rounding='ceil': rceil .* or floor"),
        ("mx.min_features=-1", r"^mx\.min_features=-1: must be an integer >= 0"),
        ("nvfp4.keep_last_fraction=1.0", r"^nvfp4\.keep_last_fraction=1\.0: must be in \[0, 1\)"),
        ("fp8.granularity=columnwise", r"^fp8\.granularity='columnwise': tensorwise, rowwise"),
    ],
)
def test_block_settings_out_of_range_fail_in_one_line(override, message):
    with pytest.raises(ConfigError, match=message) as err:
        tiny_run(override)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (("fp8.scaling=delayed",), r"^fp8\.granularity='blockwise': blockwise scales are dynamic"),
        (("fp8.backend=torchao",), r"^fp8\.backend='torchao': .*builtin backend only"),
        (("fp8.pow2_scales=true",), r"^fp8\.pow2_scales=True: .*from its amax"),
    ],
)
def test_blockwise_fp8_refuses_what_it_does_not_do(overrides, message):
    with pytest.raises(ConfigError, match=message):
        tiny_run("precision=fp8", "fp8.granularity=blockwise", *overrides)


def test_only_the_runs_format_keys_are_in_its_resume_signature():
    for name, own, other in (("mxfp8", "mx.", "nvfp4."), ("nvfp4", "nvfp4.", "mx.")):
        cfg = tiny_run(f"precision={name}")
        keys = run_signature(
            cfg, Precision(resolve_precision(cfg.precision, CPU, cfg.fp8, cfg.mx, cfg.nvfp4))
        )
        assert any(k.startswith(own) for k in keys)
        assert not any(k.startswith((other, "fp8.")) for k in keys)
    cfg = tiny_run("precision=bf16")
    keys = run_signature(cfg, Precision(resolve_precision(cfg.precision, CPU)))
    assert not any(k.startswith(("mx.", "nvfp4.", "fp8.")) for k in keys)
    # a schedule into a block format signs that format's keys too: its second phase reads them
    for to, own in (("nvfp4", "nvfp4."), ("mxfp8", "mx.")):
        cfg = tiny_run("precision=bf16", f"precision.switch.to={to}", "precision.switch.at=0.5")
        keys = run_signature(cfg, Precision(resolve_precision(cfg.precision, CPU)))
        assert any(k.startswith(own) for k in keys), to


# ----------------------------------------------------------------------------- 6. runs
BLOCK_RUNS = {
    "mxfp8": ("precision=mxfp8",),
    "nvfp4": ("precision=nvfp4",),
    "fp8-blockwise": ("precision=fp8", "fp8.granularity=blockwise"),
}


@pytest.mark.parametrize("overrides", BLOCK_RUNS.values(), ids=BLOCK_RUNS.keys())
def test_a_classifier_trains_and_reports_its_format(tmp_path, monkeypatch, overrides):
    monkeypatch.setattr(run_module, "FigureWorker", NoFigure)
    report = train(tiny_run(*overrides, "max_steps=30", "log_every=10"), tmp_path)
    assert report["status"] == "completed"
    precision = report["precision"]
    assert precision["emulated"] is True and precision["label"].endswith("(emulated)")
    assert report["throughput"]["comparable"] is False
    blocks = report["blocks"]
    # mlp on digits: 64->256 (first), 256->256 (converted), 256->10 (last)
    assert [row["name"] for row in blocks["layers"] if row["converted"]] == ["3"]
    (stats,) = blocks["final_layer_stats"]
    assert [stats[role]["samples"] for role in ("input", "grad")] == [6, 6]  # 3 log rows x 2
    losses = [r["loss"] for r in report_rows(tmp_path)]
    assert losses[-1] < losses[0]
    markdown = (tmp_path / "report.md").read_text()
    assert f"| block format | {blocks['name']}: input " in markdown
    assert f"## {blocks['name']} layers" in markdown and "| 3 | grad |" in markdown


def report_rows(run_dir):
    import json

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == "train"]


@pytest.mark.slow
@pytest.mark.parametrize("overrides", BLOCK_RUNS.values(), ids=BLOCK_RUNS.keys())
def test_a_language_model_trains_in_each_format(tmp_path, monkeypatch, overrides):
    monkeypatch.setattr(run_module, "FigureWorker", NoFigure)
    width = ("model.width=128",) if "fp8.granularity=blockwise" in overrides else ()
    report = train(compose_run(*LM, *overrides, *width, "max_steps=30"), tmp_path)
    assert report["status"] == "completed"
    converted = [row["name"] for row in report["blocks"]["layers"] if row["converted"]]
    assert converted[:2] == ["blocks.0.attn.qkv", "blocks.0.attn.proj"]  # as fp8 on task=lm
    assert "head" not in converted
    losses = [r["loss"] for r in report_rows(tmp_path)]
    assert losses[-1] < losses[0] - 0.5


def test_a_model_with_no_eligible_layer_is_refused(tmp_path):
    with pytest.raises(ConfigError) as err:
        train(tiny_run("precision=mxfp8", "model.hidden_sizes=[48]", "max_steps=2"), tmp_path)
    assert str(err.value) == (
        "precision=mxfp8: no Linear layer of model=mlp can run in MXFP8 (2 layers: first/last "
        "layer kept in BF16); see mx.include/exclude/keep_first_last/min_features"
    )


def test_nvfp4_with_stochastic_rounding_resumes_bit_for_bit(tmp_path, monkeypatch):
    """The uninterrupted run's step-20 checkpoint equals the one of a run resumed at step 10:
    weights, optimizer state and the stochastic-rounding generators (the draws go on from where
    the checkpoint left them). Without the generators' states the weights differ."""
    monkeypatch.setattr(run_module, "FigureWorker", NoFigure)
    overrides = ("precision=nvfp4", "max_steps=20", "log_every=5", "checkpoint.every_steps=10")
    train(tiny_run(*overrides, "checkpoint.keep_last=5"), tmp_path / "whole")
    step_10 = tmp_path / "whole" / "checkpoints" / "step_00000010.pt"
    train(tiny_run(*overrides, f"resume={step_10}"), tmp_path / "resumed")
    whole, resumed = (load_checkpoint(tmp_path / d / "checkpoints" / "step_00000020.pt") for d in ("whole", "resumed"))  # fmt: skip
    (straight,), (again,) = whole["blocks"]["ranks"], resumed["blocks"]["ranks"]
    assert straight.keys() == {"3"} and torch.equal(straight["3"], again["3"])
    for key, value in whole["model"].items():
        assert torch.equal(value, resumed["model"][key]), key
    assert whole["optimizer"]["state"].keys() == resumed["optimizer"]["state"].keys()

    # the control: the same resume without the generators' states is another run
    monkeypatch.setattr(BlockLayers, "load_state_dict", lambda self, states: [])
    train(tiny_run(*overrides, f"resume={step_10}"), tmp_path / "fresh")
    fresh = load_checkpoint(tmp_path / "fresh" / "checkpoints" / "step_00000020.pt")
    assert not torch.equal(fresh["model"]["3.weight"], whole["model"]["3.weight"])


@pytest.mark.slow
@pytest.mark.parametrize("recipe", [MXFP8, NVFP4], ids=["mxfp8", "nvfp4"])
def test_compiled_block_linear_equals_eager(recipe):
    """torch.compile (compile=true) computes what the eager layer computes: the output and the
    input and weight gradients bit for bit (the rounding in FP32 arithmetic survives Inductor:
    no fast-math folding of (m + c) - c), the bias gradient, a sum over the tokens that Inductor
    orders its own way, to FP32 rounding."""
    eager = BlockLinear.from_linear(nn.Linear(64, 64), recipe, seed=1)
    compiled = BlockLinear.from_linear(nn.Linear(64, 64), recipe, seed=1)
    compiled.load_state_dict(eager.state_dict())
    x, dy = randn(32, 64), randn(32, 64, seed=1)
    *expected, bias = run_layer(eager, x, dy)
    *mine, compiled_bias = run_layer(torch.compile(compiled), x, dy)
    for ours, reference in zip(mine, expected, strict=True):
        assert bits_equal(ours, reference)
    torch.testing.assert_close(compiled_bias, bias, rtol=1e-6, atol=1e-6)
