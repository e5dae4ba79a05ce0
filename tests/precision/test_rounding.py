"""Stochastic rounding FP32 -> BF16 (mptrain.precision.rounding): exact probabilities, unbiased
draws, representable values unchanged, sign symmetry, special values, seeded determinism, and
torchao's rounding bit for bit given the same random bits."""

from __future__ import annotations

import pytest
import torch

from mptrain.precision.rounding import stochastic_round, stochastic_round_with

ALL_BITS = torch.arange(2**16, dtype=torch.int32)  # every value the 16 random bits can take
BF16_MAX = torch.finfo(torch.bfloat16).max


def from_bits(*patterns: int) -> torch.Tensor:
    """FP32 values from their encodings (unsigned 32-bit patterns)."""
    signed = [p - 2**32 if p >= 2**31 else p for p in patterns]
    return torch.tensor(signed, dtype=torch.int32).view(torch.float32)


def bits16(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int16)


def awkward_values() -> torch.Tensor:
    """Normal values of many magnitudes and both signs, FP32 subnormals, values just above and
    below powers of two (a binade's edge), BF16's subnormal range and its largest finite value."""
    g = torch.Generator().manual_seed(0)
    normal = torch.randn(24, generator=g) * torch.logspace(-30, 30, 24)
    edges = torch.tensor([1.0, 2.0, 2.0**-126, 2.0**100]).repeat_interleave(2)
    edges = edges * torch.tensor([1 - 2**-20, 1 + 2**-20]).repeat(4)
    fp32_subnormals = from_bits(0x00000001, 0x0000FFFF, 0x00012345, 0x807FFFFF)
    bf16_subnormal_range = torch.tensor([3e-39, -1e-40, 9.2e-41])
    return torch.cat([normal, edges, fp32_subnormals, bf16_subnormal_range, -normal[:6]])


def test_every_value_rounds_up_with_probability_exactly_its_distance():
    """Over all 2**16 random values, the mean of the roundings is the input exactly (float64
    sums of BF16 values are exact here): unbiased with no approximation, subnormals included."""
    x = awkward_values()
    rounded = stochastic_round_with(x[:, None], ALL_BITS[None, :]).double()
    assert torch.equal(rounded.mean(dim=1), x.double())
    # Exactly (low 16 bits of x) of the 2**16 values round away from zero, to the next BF16
    # value; the others truncate.
    toward_zero = (x.view(torch.int32) & -0x10000).view(torch.float32).double()[:, None]
    away = stochastic_round_with(x, ALL_BITS[:1]).double()[:, None]
    assert torch.all((rounded == toward_zero) | (rounded == away))
    low_bits = x.view(torch.int32) & 0xFFFF
    assert torch.equal((rounded == away).sum(dim=1), low_bits.long())


def test_seeded_draws_are_unbiased_within_the_stated_bound():
    """Each draw is one of two neighbours a spacing ``u`` apart, so the mean of ``n`` draws has
    a standard deviation of at most ``u / (2 sqrt(n))``; the bound is 5 of those (seeded: no
    flakiness, just a bound that a biased rounding, e.g. nearest, would break)."""
    n = 4096
    x = torch.tensor([1.0 + 2**-10, -3.3e-3, 7.77e5, 1e-39, 0.1])
    away = stochastic_round_with(x, ALL_BITS[:1]).double()  # 0 < low bits: rounds away
    toward = stochastic_round_with(x, ALL_BITS[-1:]).double()  # 0xFFFF < low bits: never
    spacing = (away - toward).abs()
    assert torch.all(spacing > 0)  # none of them representable
    g = torch.Generator().manual_seed(1)
    draws = torch.stack([stochastic_round(x, generator=g).double() for _ in range(n)])
    error = (draws.mean(dim=0) - x.double()).abs()
    bound = 5 * spacing / (2 * n**0.5)
    assert torch.all(error <= bound), (error, bound)
    nearest_error = (x.bfloat16().double() - x.double()).abs()
    assert torch.any(nearest_error > bound)  # the bound tells nearest rounding apart


def test_representable_values_never_move():
    x = (torch.randn(1000, generator=torch.Generator().manual_seed(2)) * 100).bfloat16()
    x = torch.cat(
        [x, torch.tensor([0.0, -0.0, BF16_MAX, -BF16_MAX, 2**-133], dtype=torch.bfloat16)]
    )
    wide = x.float()
    for bits in (ALL_BITS[:1], ALL_BITS[-1:]):
        assert torch.equal(bits16(stochastic_round_with(wide, bits)), bits16(x))
    assert torch.equal(
        bits16(stochastic_round(wide, generator=torch.Generator().manual_seed(3))), bits16(x)
    )


def test_sign_symmetric_given_the_same_bits():
    x = awkward_values()
    bits = torch.randint(
        0, 2**16, x.shape, generator=torch.Generator().manual_seed(4), dtype=torch.int32
    )
    positive, negative = stochastic_round_with(x, bits), stochastic_round_with(-x, bits)
    assert torch.equal(bits16(negative), bits16(-positive))


def test_nan_and_inf_pass_through_and_overflow_rounds_to_max_or_inf():
    nans = from_bits(0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FFFFFFF, 0xFFFFFFFF)
    infs = torch.tensor([float("inf"), float("-inf")])
    for bits in (ALL_BITS[:1], ALL_BITS[-1:]):
        assert torch.isnan(stochastic_round_with(nans, bits)).all()  # a low-bit payload too
        assert torch.equal(stochastic_round_with(infs, bits).float(), infs)
    # FP32's largest value lies 0xFFFF / 2**16 of a spacing above BF16's largest: inf plays the
    # next BF16 value, so it comes out that often.
    over = from_bits(0x7F7FFFFF, 0xFF7FFFFF)
    rounded = stochastic_round_with(over[:, None], ALL_BITS[None, :]).float()
    assert (rounded.isinf().sum(dim=1) == 0xFFFF).all()
    assert torch.equal(rounded[:, -1], torch.tensor([BF16_MAX, -BF16_MAX]))
    assert (rounded[0] > 0).all() and (rounded[1] < 0).all()


def test_the_generator_decides_and_its_state_replays():
    x = torch.randn(5000, generator=torch.Generator().manual_seed(5))
    g = torch.Generator().manual_seed(6)
    saved = g.get_state()
    first, second = stochastic_round(x, generator=g), stochastic_round(x, generator=g)
    assert not torch.equal(bits16(first), bits16(second))  # the generator moved on
    g.set_state(saved)
    assert torch.equal(bits16(stochastic_round(x, generator=g)), bits16(first))
    other = stochastic_round(x, generator=torch.Generator().manual_seed(6))
    assert torch.equal(bits16(other), bits16(first))  # a seed is the whole story


def test_only_fp32_to_bf16():
    g = torch.Generator()
    with pytest.raises(TypeError, match="float32"):
        stochastic_round(torch.ones(2, dtype=torch.float64), generator=g)


def test_equals_torchaos_rounding_bit_for_bit_given_the_same_bits():
    """torchao's ``_fp32_to_bf16_sr`` (its BF16 AdamW's rounding) draws its 16 bits with
    ``torch.randint`` from torch's global generator; the same seed in a generator of our own
    gives the same bits. NaNs compared as NaNs (torchao can turn a low-bit payload into inf)."""
    quant_utils = pytest.importorskip("torchao.optim.quant_utils")
    x = torch.cat(
        [
            awkward_values(),
            torch.randn(10_000, generator=torch.Generator().manual_seed(7)),
            torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan")]),
            from_bits(0x7F7FFFFF, 0xFF7F8000),
        ]
    )
    for seed in (0, 11):
        torch.manual_seed(seed)
        theirs = quant_utils._fp32_to_bf16_sr(x)
        ours = stochastic_round(x, generator=torch.Generator().manual_seed(seed))
        finite = ~torch.isnan(x)
        assert torch.equal(bits16(ours[finite]), bits16(theirs[finite]))
        assert torch.isnan(ours[~finite]).all() and torch.isnan(theirs[~finite]).all()
