"""Block-scaled formats where no reference implementation runs on the CPU: the E2M1 codec, the
counts (saturated, underflowed, zero and non-finite blocks), the round-trip error bounds and
SQNR of each format, NVFP4's 16x16 weight tiles and stochastic rounding (seeded, resumable,
unbiased), the random Hadamard transform, and the blockwise FP8 GEMM against a direct
high-precision reference (``torch._scaled_mm`` refuses block scales on the CPU).
Bit-for-bit comparisons with torchao: test_blocks_torchao.py."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from mptrain.precision.quant import e2m1
from mptrain.precision.quant.blockwise import fake_quant_blockwise, quantize_blockwise
from mptrain.precision.quant.e2m1 import E2M1
from mptrain.precision.quant.fp8 import E4M3, E5M2
from mptrain.precision.quant.hadamard import (
    random_hadamard_transform,
    rht_signs,
    walsh_hadamard,
)
from mptrain.precision.quant.mx import fake_quant_mx, quantize_mx
from mptrain.precision.quant.nvfp4 import fake_quant_nvfp4, quantize_nvfp4


def sqnr_db(reference: torch.Tensor, other: torch.Tensor) -> float:
    ref, out = reference.double(), other.double()
    return 10 * math.log10(ref.pow(2).sum().item() / (ref - out).pow(2).sum().item())


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------- E2M1
def test_e2m1_encodes_every_value_and_rounds_ties_to_even():
    values = torch.tensor(e2m1.E2M1_VALUES)
    assert torch.equal(e2m1.encode(values), torch.arange(8, dtype=torch.uint8))
    assert torch.equal(e2m1.encode(-values), torch.arange(8, 16, dtype=torch.uint8))  # -0: 8
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    assert e2m1.decode(e2m1.encode(ties)).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    near = torch.tensor([0.2500001, 0.7499999, 5.0000005, 6.0, 1e-45, -0.1])
    assert e2m1.decode(e2m1.encode(near)).tolist() == [0.5, 0.5, 6.0, 6.0, 0.0, -0.0]
    assert e2m1.encode(torch.tensor([-0.1])).item() == 8  # the sign of what rounds to zero


def test_e2m1_packs_two_codes_per_byte_low_nibble_first():
    codes = torch.randint(
        0, 16, (3, 8), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)
    )
    packed = e2m1.pack(codes)
    assert packed.shape == (3, 4)
    assert torch.equal(packed & 0xF, codes[:, 0::2]) and torch.equal(packed >> 4, codes[:, 1::2])
    assert torch.equal(e2m1.unpack(packed), codes)
    assert packed.view(E2M1).shape == (3, 4)  # what a GEMM reading float4_e2m1fn_x2 takes


# -------------------------------------------------------------------------------- counts
def test_counts_saturation_underflow_zero_and_nonfinite_blocks():
    x = randn(6, 32)
    x[0, 0] = 500.0  # floor: scale 2^(8-8) = 1 and 500 > 464 saturates; rceil: scale 2
    x[0, 1:] = x[0, 1:].clamp(-1, 1)
    x[1] = 0.0  # a zero block
    x[2, 0], x[2, 1:] = 1e4, 1e-6  # 31 values under the outlier's scale's smallest step
    x[3, 4] = torch.inf
    x[4, 9] = torch.nan
    floor = quantize_mx(x, rounding="floor", stats=True).stats.as_dict()
    rceil = quantize_mx(x, rounding="rceil", stats=True).stats.as_dict()
    assert floor == {
        "elements": 192, "blocks": 6, "saturated": 1, "underflows": 31, "zero_blocks": 1,
        "nonfinite_blocks": 2,
    }  # fmt: skip
    assert rceil == {**floor, "saturated": 0}
    # NVFP4 (blocks of 16) on rows 0, 1, 2 and 5: the 15 values beside 500 and the 15 beside
    # 1e4 underflow (E2M1's smallest step is 1/12 of a block's amax), and so do the next sixteen
    # 1e-6 alone in their block: a block scale is at least E4M3's 2^-6 (times the per-tensor
    # scale, 1e4 / 2688 here). Without the per-tensor scale 1e4 needs a block scale of 1667,
    # beyond E4M3's 448: it saturates.
    counts = {
        "elements": 128,
        "blocks": 8,
        "underflows": 46,
        "zero_blocks": 3,
        "nonfinite_blocks": 0,
    }
    for tensor_scale, saturated in ((False, 1), (True, 0)):
        nvfp4 = quantize_nvfp4(x[[0, 1, 2, 5]], tensor_scale=tensor_scale, stats=True)
        assert nvfp4.stats.as_dict() == {**counts, "saturated": saturated}
    # Row 4's NaN makes NVFP4's per-tensor scale NaN: every block of the tensor is NaN.
    poisoned = quantize_nvfp4(x[[0, 4]], stats=True).stats.as_dict()
    assert poisoned["nonfinite_blocks"] == 4 and poisoned["underflows"] == 0
    assert quantize_mx(x).stats is None  # counted only when asked: a few more passes


# ------------------------------------------------------------------ round trip and SQNR
@pytest.mark.parametrize("rounding", ["floor", "rceil"])
def test_mxfp8_round_trip_is_within_half_an_e4m3_step(rounding):
    """|x - dequantized| <= max(2^-4 |x|, 2^-10 scale): half a step of E4M3's 3-bit mantissa, or
    of its subnormal spacing 2^-9 x scale. Elements that saturate (floor only) lose what lies
    above 448 x scale; rceil saturates nothing."""
    x = randn(64, 256) * torch.logspace(-20, 20, 64)[:, None]
    q = quantize_mx(x, rounding=rounding)
    scale = q.scale.float().repeat_interleave(32, dim=-1)
    error = (q.dequantize() - x).abs()
    saturated = x.abs() >= 464 * scale
    assert saturated.any() == (rounding == "floor")
    bound = torch.maximum(x.abs() * 2.0**-4, scale * 2.0**-10)
    assert (error[~saturated] <= bound[~saturated]).all()
    assert (error[saturated] <= x.abs()[saturated] - 448 * scale[saturated]).all()


def test_floor_keeps_torchaos_2_pow_minus_126_divisor_for_the_smallest_scale():
    """A block below 2^-118 gets the scale 2^-127 (code 0) but is divided by 2^-126, as torchao
    does: dequantized it is half the input (documented in mx.py; no real tensor lives there)."""
    x = torch.full((1, 32), 2.0**-120)
    q = quantize_mx(x, rounding="floor")
    assert q.scale.view(torch.uint8).item() == 0 and (q.data.float() == 64).all()
    assert torch.equal(q.dequantize(), x / 2)
    assert torch.equal(quantize_mx(x, rounding="rceil").dequantize(), torch.zeros_like(x))


def test_nvfp4_round_trip_is_within_half_an_e2m1_step():
    """In units of the block's multiplier m (tensor scale x block scale): half the gap between
    E2M1 neighbours, max(0.25, |x|/4 m), plus what clipping at 6 m took off."""
    x = randn(64, 256) * torch.logspace(-8, 8, 64)[:, None]
    for tensor_scale in (False, True):
        q = quantize_nvfp4(x, tensor_scale=tensor_scale)
        m = q.scale.float().repeat_interleave(16, dim=-1) * (q.tensor_scale or 1.0)
        scaled = x.abs() / m
        bound = (torch.clamp(scaled / 4, min=0.25) + (scaled - 6).clamp(min=0)) * m
        assert ((q.dequantize() - x).abs() <= bound * (1 + 1e-6)).all()


def test_blockwise_round_trip_is_within_half_an_e4m3_step():
    x = randn(256, 256) * torch.logspace(-20, 20, 256)[:, None]
    for tile_2d in (False, True):
        q = quantize_blockwise(x, tile_2d=tile_2d)
        scale = q.scale.repeat_interleave(128, dim=-1)
        if tile_2d:
            scale = scale.repeat_interleave(128, dim=0)
        bound = torch.maximum(x.abs() * 2.0**-4, scale * 2.0**-10) * (1 + 1e-6)
        assert ((q.dequantize() - x).abs() <= bound).all()


def test_sqnr_of_each_format_on_normal_data():
    """Measured on 256x1024 N(0, 1) values (three seeds agree within 0.1 dB): the bands are ±1 dB
    around them, and the order is the formats' (finer blocks and more mantissa bits win)."""
    x = randn(256, 1024)
    measured = {
        "mxfp8 floor": sqnr_db(x, fake_quant_mx(x, rounding="floor")),  # 30.7
        "mxfp8 rceil": sqnr_db(x, fake_quant_mx(x, rounding="rceil")),  # 31.5
        "mxfp8 e5m2": sqnr_db(x, fake_quant_mx(x, elem_dtype=E5M2, rounding="rceil")),  # 25.4
        "mxfp4": sqnr_db(x, fake_quant_mx(x, elem_dtype=E2M1, rounding="rceil")),  # 18.8
        "nvfp4": sqnr_db(x, fake_quant_nvfp4(x)),  # 20.4
        "nvfp4 16x16": sqnr_db(x, fake_quant_nvfp4(x, tile_2d=True)),  # 19.1
        "blockwise": sqnr_db(x, fake_quant_blockwise(x)),  # 31.8
    }
    expected = {
        "mxfp8 floor": 30.7, "mxfp8 rceil": 31.5, "mxfp8 e5m2": 25.4, "mxfp4": 18.8,
        "nvfp4": 20.4, "nvfp4 16x16": 19.1, "blockwise": 31.8,
    }  # fmt: skip
    for name, db in measured.items():
        assert abs(db - expected[name]) < 1.0, (name, db)
    assert measured["mxfp8 rceil"] > measured["mxfp8 floor"]  # floor saturates the top 3/16
    assert measured["nvfp4"] > measured["mxfp4"] > measured["nvfp4 16x16"] - 1.0


@pytest.mark.parametrize(
    "fake_quant",
    [fake_quant_mx, fake_quant_nvfp4, fake_quant_blockwise],
    ids=["mx", "nvfp4", "blockwise"],
)
def test_fake_quant_keeps_dtype_shape_and_layout(fake_quant):
    x = randn(128, 256).to(torch.bfloat16)
    for dim in (0, 1):
        out = fake_quant(x, dim)
        assert out.dtype == torch.bfloat16 and out.shape == x.shape
        assert sqnr_db(x, out) > 15
        assert torch.equal(out.t(), fake_quant(x.t().contiguous(), 1 - dim))


# ------------------------------------------------------------------------ NVFP4 recipe
def test_nvfp4_16x16_tiles_quantize_a_weight_and_its_transpose_alike():
    """One scale per 16x16 tile: the weight the forward GEMM sees (quantized along dim 1) is the
    one the backward GEMM sees (along dim 0), bit for bit; 1x16 blocks differ."""
    w = randn(64, 96) * torch.logspace(-3, 3, 64)[:, None]
    forward = quantize_nvfp4(w, 1, tile_2d=True)
    backward = quantize_nvfp4(w, 0, tile_2d=True)
    assert forward.scale.shape == (4, 6) and backward.scale.shape == (6, 4)
    assert torch.equal(forward.dequantize(), backward.dequantize())
    assert not torch.equal(quantize_nvfp4(w, 1).dequantize(), quantize_nvfp4(w, 0).dequantize())
    b_forward = quantize_blockwise(randn(256, 384), 1, tile_2d=True)
    b_backward = quantize_blockwise(randn(256, 384), 0, tile_2d=True)
    assert torch.equal(b_forward.dequantize(), b_backward.dequantize())


def test_nvfp4_tile_scale_is_the_tiles_amax():
    """If every 1x16 block of a tile already has the tile's amax, tiles and blocks agree."""
    w = randn(32, 64).clamp(-7, 7)
    w[:, ::16] = 8.0  # each row's block: amax 8, the tile's too
    assert torch.equal(quantize_nvfp4(w, tile_2d=True).dequantize(), quantize_nvfp4(w).dequantize())


def test_tiles_need_a_2d_tensor_with_both_sizes_multiples_of_the_tile():
    with pytest.raises(ValueError, match="16x16 tiles need a 2-D tensor"):
        quantize_nvfp4(torch.randn(2, 16, 16), tile_2d=True)
    with pytest.raises(ValueError, match="the size 40 of dim 0 is not a multiple"):
        quantize_nvfp4(torch.randn(40, 32), tile_2d=True)
    with pytest.raises(ValueError, match="blockwise FP8: the size 64 of dim 1"):
        quantize_blockwise(torch.randn(128, 64))


def grid_neighbours(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    values = torch.tensor(e2m1.E2M1_VALUES)
    lower = values[torch.bucketize(x, values, right=True) - 1]
    upper = values[(torch.bucketize(x, values, right=True)).clamp(max=7)]
    return lower, upper


def test_stochastic_rounding_is_unbiased_and_picks_a_neighbour():
    """Blocks of 16 whose amax is 6 (block scale 1: the scaled value is the input): 4096 draws of
    each value average to it within 5 standard errors, each draw one of its two neighbours."""
    targets = torch.tensor(
        [0.1, 0.3, 0.6, 1.1, 1.4, 1.9, 2.2, 2.9, 3.3, 3.9, 4.5, 5.2, 5.9, 2.0, 6.0]
    )
    x = torch.cat([torch.tensor([6.0]), targets]).repeat(4096, 1)
    q = quantize_nvfp4(x, tensor_scale=False, generator=torch.Generator().manual_seed(0))
    assert (q.scale.float() == 1).all()
    draws = q.dequantize()[:, 1:]
    lower, upper = grid_neighbours(targets)
    assert ((draws == lower) | (draws == upper)).all()
    standard_error = (upper - lower) / 2 / math.sqrt(4096)
    assert ((draws.mean(0) - targets).abs() < 5 * standard_error + 1e-7).all()
    assert (draws[:, -2:] == targets[-2:]).all()  # on the grid: exact


def test_stochastic_rounding_is_seeded_and_resumes_from_the_generators_state():
    x = randn(32, 64)
    generator = torch.Generator().manual_seed(1)
    first = quantize_nvfp4(x, generator=generator).data
    state = generator.get_state()  # what a checkpoint saves
    second = quantize_nvfp4(x, generator=generator).data
    assert not torch.equal(first, second)  # the stream moved on: new draws
    resumed = torch.Generator()
    resumed.set_state(state)
    assert torch.equal(quantize_nvfp4(x, generator=resumed).data, second)
    again = quantize_nvfp4(x, generator=torch.Generator().manual_seed(1)).data
    assert torch.equal(again, first)
    nearest = quantize_nvfp4(x).data
    assert not torch.equal(first, nearest)


# ---------------------------------------------------------------------------------- RHT
def test_walsh_hadamard_is_sylvesters_matrix_and_orthogonal():
    h = walsh_hadamard(torch.eye(16))
    h2 = torch.tensor([[1.0, 1.0], [1.0, -1.0]])
    assert torch.equal(h, torch.kron(torch.kron(torch.kron(h2, h2), h2), h2))
    assert torch.equal(h @ h.t(), 16 * torch.eye(16))


def test_rht_keeps_a_gemm_and_spreads_an_outlier():
    signs = rht_signs(3)
    assert set(signs.tolist()) == {1.0, -1.0} and torch.equal(signs, rht_signs(3))
    a, b = randn(32, 64, seed=1), randn(64, 48, seed=2)
    product = (
        random_hadamard_transform(a, signs, 1).double()
        @ random_hadamard_transform(b, signs, 0).double()
    )
    assert torch.allclose(product, a.double() @ b.double(), rtol=0, atol=1e-5)
    x = randn(4, 16) * 0.01
    x[:, 3] = 100.0
    y = random_hadamard_transform(x, signs)
    assert torch.allclose(y.norm(dim=1), x.norm(dim=1), rtol=1e-6)
    assert (y.abs().amax(dim=1) < 26).all()  # 100 / 4 spread over 16 elements, plus the rest
    with pytest.raises(ValueError, match="not a multiple of 16"):
        random_hadamard_transform(torch.randn(4, 24), signs)
    with pytest.raises(ValueError, match="a vector of 16"):
        random_hadamard_transform(torch.randn(4, 32), torch.ones(8))


# ----------------------------------------------------------------- blockwise FP8 GEMM
def test_blockwise_gemm_of_fake_quantized_operands_is_the_block_scaled_gemm():
    """Out = x Wᵀ with x in 1x128 tiles and W in 128x128 blocks: the product of the dequantized
    operands equals the block-scaled GEMM (FP8 values multiplied, each partial sum over a
    128-block rescaled by both scales), computed here in FP64, up to the FP32 rounding of the
    dequantized values (one rounding of each element x scale: 2^-24 relative)."""
    x, w = randn(64, 256, seed=1), randn(384, 256, seed=2)
    qx, qw = quantize_blockwise(x), quantize_blockwise(w, tile_2d=True)
    reference = torch.zeros(64, 384, dtype=torch.float64)
    for k in range(2):
        columns = slice(128 * k, 128 * (k + 1))
        partial = qx.data[:, columns].double() @ qw.data[:, columns].double().t()
        w_scale = qw.scale[:, k].double().repeat_interleave(128)
        reference += partial * qx.scale[:, k : k + 1].double() * w_scale
    emulated = fake_quant_blockwise(x).double() @ fake_quant_blockwise(w, tile_2d=True).double().t()
    magnitude = x.abs().double() @ w.abs().double().t()
    assert ((emulated - reference).abs() <= magnitude * 2.0**-22).all()


@pytest.mark.skipif(not hasattr(F, "ScalingType"), reason="torch without F.scaled_mm")
def test_cpu_scaled_mm_refuses_block_scales():
    """Why the blockwise GEMM is compared with a direct reference: torch's CPU ``scaled_mm``
    takes tensorwise and rowwise scales only. If this starts to pass, compare with it instead."""
    a = torch.randn(128, 256).to(E4M3)
    b = torch.randn(256, 128).to(E4M3).t().contiguous().t()
    with pytest.raises((RuntimeError, ValueError, NotImplementedError)):
        F.scaled_mm(
            a, b, scale_a=torch.ones(128, 2), scale_recipe_a=F.ScalingType.BlockWise1x128,
            scale_b=torch.ones(2, 1), scale_recipe_b=F.ScalingType.BlockWise128x128,
            output_dtype=torch.bfloat16,
        )  # fmt: skip
