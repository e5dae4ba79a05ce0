"""Stochastic rounding from FP32 to BF16: exact, unbiased, seeded.

:func:`stochastic_round` rounds each FP32 value to one of its two BF16 neighbours, up (away from
zero) with probability equal to its distance from the lower one over their spacing, so the
expected result is the input exactly. BF16 is FP32's upper 16 bits, so this is the standard bit
trick: the lower 16 bits ``f`` of the FP32 encoding are the distance in units of 2**-16 BF16
spacings; a uniform 16-bit integer ``r`` decides, and the value rounds away from zero iff
``r < f`` (the same as adding ``0xFFFF - r`` to the encoding and truncating: a carry into the
upper half happens with probability ``f / 2**16``). The encodings of same-signed floats are ordered
like their values, so this holds across binades, in the subnormal range and at zero, with nothing
of FP32's value lost: the probability is exactly ``f / 2**16``, not an approximation.

Special values: NaN stays NaN (truncating a NaN whose payload lies in the low bits would make it
an infinity); ±inf stays ±inf (low bits zero). A finite value above BF16's largest finite value
rounds to that value or, with probability equal to its distance over one spacing, to inf: inf
plays the next BF16 value (2**128), as in the bit pattern and as torchao's rounding does.

The result is a function of the input and the caller's generator's state (a run that restores
``generator.get_state()`` rounds the same afterwards), and equals torchao's ``_fp32_to_bf16_sr``
(``torchao.optim.quant_utils``) bit for bit given the same random bits
(tests/precision/test_rounding.py), NaN payloads aside.
"""

from __future__ import annotations

import torch

_LOW_BITS = 0xFFFF  # the 16 bits of an FP32 encoding BF16 drops
_HIGH_MASK = -0x10000  # 0xFFFF0000 as an int32: the bits BF16 keeps
_ONE_BF16_STEP = 0x10000  # one unit in the last place of the BF16 half


def stochastic_round_with(x: torch.Tensor, random_bits: torch.Tensor) -> torch.Tensor:
    """BF16 of FP32 ``x``, rounded away from zero where ``random_bits < low 16 bits of x``.

    ``random_bits``: int32 in ``[0, 2**16)``, broadcastable to ``x``; uniform ones make the
    rounding unbiased. The deterministic core of :func:`stochastic_round` (tests feed it every
    16-bit value to check the probabilities exactly). Raises TypeError unless ``x`` is FP32.
    """
    if x.dtype != torch.float32:
        raise TypeError(f"stochastic_round_with: x must be float32, got {x.dtype}")
    bits = x.view(torch.int32)
    toward_zero = bits & _HIGH_MASK
    # No int32 overflow: only a NaN's upper half (0x7FFF/0xFFFF) would carry past the sign bit,
    # and NaNs are replaced below.
    rounded = torch.where(
        random_bits < (bits & _LOW_BITS), toward_zero + _ONE_BF16_STEP, toward_zero
    )
    result = rounded.view(torch.float32).to(torch.bfloat16)  # exact: the low bits are zero
    return torch.where(torch.isnan(x), x.to(torch.bfloat16), result)


def stochastic_round(x: torch.Tensor, *, generator: torch.Generator) -> torch.Tensor:
    """``x`` (FP32) rounded stochastically to BF16 (the only format with this exact bit trick:
    FP16's narrower exponent would need another rule below its normal range).

    Unbiased: ``E[result] == x`` for every finite ``x`` within BF16's range; values already in
    BF16 come back unchanged; ``-x`` rounds to ``-result`` given the same bits. Draws
    ``x.numel()`` 16-bit values from ``generator``, which must be on ``x``'s device. Raises
    TypeError for a non-FP32 ``x``.
    """
    bits = torch.randint(  # uniform in [0, 2**16)
        0, _LOW_BITS + 1, x.shape, generator=generator, device=x.device, dtype=torch.int32
    )
    return stochastic_round_with(x, bits)
