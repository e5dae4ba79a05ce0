"""FP4 E2M1, the element format of NVFP4 and MXFP4: encoding with round-to-nearest-even or
stochastic rounding, decoding, and packing two codes per byte.

E2M1 (OCP Microscaling Formats v1.0, section 5.3.3): 1 sign, 2 exponent, 1 mantissa bit, no inf
or NaN; the magnitudes are 0, 0.5, 1, 1.5, 2, 3, 4 and 6 (codes 0-7, code | 8 is the negative).
torch has ``torch.float4_e2m1fn_x2`` (two codes per byte) but no CPU copy kernel to it, so codes
are computed here and packed by hand into ``uint8``; ``packed.view(torch.float4_e2m1fn_x2)``
reinterprets them for a GEMM that reads that dtype. Packing: element ``2i`` in the low nibble,
element ``2i + 1`` in the high one (torchao's ``pack_uint4``, the byte layout cuBLAS reads).
"""

from __future__ import annotations

import torch

E2M1 = torch.float4_e2m1fn_x2  # how callers name the format (as torchao does)
E2M1_MAX = 6.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitude of codes 0..7
# Halfway between neighbouring magnitudes. A tie goes to the even code (round half to even):
# at an even index i the tie stays on code i, at an odd one it goes up to code i + 1.
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
# The smallest scaled magnitude that saturation clipped (see quant.saturation_boundary): with one
# more binade the next value above 6 (1.1b x 2^2, odd mantissa) would be 8, the tie 7 rounds up to
# it, so 7 and above saturate while (6, 7) rounds to 6 anyway.
E2M1_SATURATION_BOUNDARY = 7.0
_SIGN = 8


def encode(x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """E2M1 codes (uint8, one per element, 0-15) of the FP32 tensor ``x``, already scaled and
    clipped to [-6, 6].

    Without ``generator``: round to nearest, ties to even (the same codes as torchao's
    ``f32_to_f4_unpacked`` for every non-NaN input). With ``generator``: stochastic rounding, up to
    the next magnitude with probability (|x| - lower) / (upper - lower), exact in FP32, against one
    ``torch.rand`` draw per element (in ``x``'s order, from ``generator``, which must be on
    ``x``'s device: restoring its ``get_state()`` replays the same draws). The sign is kept, -0 and values rounding to zero
    included. NaN (no E2M1 encoding) gives a zero code with NaN's sign bit; the block formats
    give a NaN block a NaN scale, so its elements never count.
    """
    magnitude = torch.nan_to_num(x.abs(), nan=0.0)
    if generator is None:
        code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
        for i, midpoint in enumerate(_MIDPOINTS):
            code += (magnitude >= midpoint) if i % 2 else (magnitude > midpoint)
    else:
        values = torch.tensor(E2M1_VALUES, device=magnitude.device)
        lower = torch.bucketize(magnitude, values, right=True) - 1  # largest value <= magnitude
        upper = (lower + 1).clamp(max=len(E2M1_VALUES) - 1)
        gap = values[upper] - values[lower]  # 0.5, 1 or 2 (0 at 6): the division below is exact
        fraction = torch.where(gap > 0, (magnitude - values[lower]) / gap.clamp(min=0.5), 0.0)
        draw = torch.rand(magnitude.shape, generator=generator, device=magnitude.device)
        code = (lower + (draw < fraction).long()).to(torch.uint8)
    return code | (torch.signbit(x).to(torch.uint8) * _SIGN)


def decode(codes: torch.Tensor) -> torch.Tensor:
    """The FP32 values of E2M1 codes (uint8, 0-15); code 8 is -0."""
    magnitudes = torch.tensor(E2M1_VALUES, device=codes.device)
    table = torch.cat([magnitudes, -magnitudes])
    return table[codes.long()]


def pack(codes: torch.Tensor) -> torch.Tensor:
    """Two codes per byte along the last dimension (even length): shape (..., n) -> (..., n/2)."""
    pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """The codes of :func:`pack`'s bytes: shape (..., n/2) -> (..., n)."""
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1)
    return codes.reshape(*packed.shape[:-1], packed.shape[-1] * 2)
