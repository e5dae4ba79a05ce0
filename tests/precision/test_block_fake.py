"""The fast fake quantization's shortcuts (mptrain/precision/quant/fake.py), each equal bit for
bit to what it replaces:

- MX's multiplier and scale from FP32 bits (``mx.scale_factors``) against ``mx.scale_codes``'s
  multiplier and the E8M0 value of its codes, on every exponent field with the mantissas at
  the rounding edges, zero, subnormals, inf and NaN, both roundings, every element format;
- an operand quantized where it lies (``keep_layout``: no transposed copy) against the same
  operand quantized with its dimension moved last, every recipe and role, stochastic rounding's
  draws included;
- the Hadamard transform along the rows against ``random_hadamard_transform(..., dim=0)``.
"""

from __future__ import annotations

import pytest
import torch

from mptrain.precision.quant import fake
from mptrain.precision.quant.block_quant import BlockQuantization, fake_quant_operand
from mptrain.precision.quant.e2m1 import E2M1
from mptrain.precision.quant.fp8 import E4M3, E5M2
from mptrain.precision.quant.hadamard import random_hadamard_transform, rht_signs
from mptrain.precision.quant.mx import scale_codes, scale_factors

RECIPES = {
    "mxfp8-rceil": BlockQuantization("mxfp8"),
    "mxfp8-floor": BlockQuantization("mxfp8", scale_rounding="floor"),
    "nvfp4-1x16": BlockQuantization("nvfp4"),
    "nvfp4-recipe": BlockQuantization("nvfp4", hadamard=True, stochastic_rounding=True),
    "blockwise-hybrid": BlockQuantization("fp8_blockwise", grad_dtype=E5M2),
}


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape and FP32 bits (NaN where the other is NaN)."""
    assert a.shape == b.shape, (a.shape, b.shape)
    same = a.view(torch.int32) == b.view(torch.int32)
    return bool((same | (a.isnan() & b.isnan())).all())


def amaxes() -> torch.Tensor:
    """Every FP32 exponent field with mantissas at the rounding edges (zero and subnormals
    included: field 0) and random ones, inf, NaN (both signs of NaN)."""
    generator = torch.Generator().manual_seed(0)
    edges = [0, 1, 2, 0x3FFFFF, 0x400000, 0x400001, 0x7FFFFE, 0x7FFFFF]
    mantissas = torch.cat(
        [
            torch.tensor(edges, dtype=torch.int32),
            torch.randint(0, 1 << 23, (24,), generator=generator, dtype=torch.int32),
        ]
    )
    fields = torch.arange(256, dtype=torch.int32) << 23
    values = (fields[:, None] | mantissas[None, :]).flatten().view(torch.float32)
    return torch.cat([values, torch.tensor([float("nan"), -float("nan"), float("inf"), 0.0])])


@pytest.mark.parametrize("rounding", ["floor", "rceil"])
@pytest.mark.parametrize("elem", [E4M3, E5M2, E2M1], ids=["e4m3", "e5m2", "e2m1"])
def test_scale_factors_are_the_codes_multiplier_and_e8m0_value(elem, rounding):
    amax = amaxes()
    codes, multiplier = scale_codes(amax, elem, rounding)
    fast_multiplier, fast_scale = scale_factors(amax, elem, rounding)
    nan = amax.isnan()
    assert bits_equal(fast_scale, codes.view(torch.float8_e8m0fnu).float())
    assert bits_equal(fast_multiplier[~nan], multiplier[~nan])
    assert fast_multiplier[nan].isnan().all()  # a NaN block: NaN either way


def operand(case: str, shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """Gaussian values (``randn``; NVFP4's per-tensor scale keeps them finite), or ``edges``:
    values over 1e-20..1e20 across the rows, a NaN, an inf and a zero column stretch."""
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    if case == "edges":
        x *= torch.logspace(-20, 20, shape[0])[:, None]
        x[3, 5], x[shape[0] - 7, 7] = torch.nan, torch.inf
        x[:32, 9] = 0
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(256, 128), (128, 128)])
@pytest.mark.parametrize("case", ["randn", "edges"])
@pytest.mark.parametrize("recipe", RECIPES.values(), ids=RECIPES.keys())
def test_quantized_where_it_lies_equals_quantized_moved(recipe, case, shape, dtype):
    x = operand(case, shape, dtype)
    roles = ("input", "grad") if recipe.tiled_weight else ("input", "weight", "grad")
    for role in roles:  # a tiled weight is quantized once, in the forward
        seeded = [torch.Generator().manual_seed(3) for _ in range(2)]
        moved = fake_quant_operand(recipe, x, 0, role, generator=seeded[0])
        kept = fake_quant_operand(recipe, x, 0, role, generator=seeded[1], keep_layout=True)
        assert bits_equal(kept, moved), role
        assert kept.is_contiguous()  # x's layout: no transposed copy anywhere
        assert torch.equal(seeded[0].get_state(), seeded[1].get_state())  # the same draws


def test_tiles_are_refused_where_they_lie():
    with pytest.raises(ValueError, match="keep_layout takes \\(1, n\\) blocks, not 16x16"):
        fake.fake_nvfp4(torch.zeros(32, 32), 0, True, None, keep_layout=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(16, 3), (128, 64), (4096, 40)])
def test_hadamard_along_the_rows_is_the_transforms_bits(shape, dtype):
    t = (torch.randn(*shape, generator=torch.Generator().manual_seed(2)) * 10).to(dtype)
    signs = rht_signs(3)
    expected = random_hadamard_transform(t.float(), signs, 0)
    assert bits_equal(fake.hadamard_rows(t, signs, "test"), expected)
    assert bits_equal(fake.hadamard_rows(t.t().contiguous().t(), signs, "test"), expected)
