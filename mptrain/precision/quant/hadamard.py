"""The random Hadamard transform (RHT) of NVIDIA's NVFP4 training quantization: before the
weight-gradient GEMM ``dW = dYᵀ X`` quantizes its inputs, both are multiplied along the GEMM's
reduction dimension (the tokens) by the same orthogonal block-diagonal matrix R = D H / 4, with H
the 16x16 Hadamard matrix and D a diagonal of random signs. R Rᵀ = I, so (dYᵀ R)(Rᵀ X) = dYᵀ X:
the product is unchanged while outliers are spread over each 16-element block before the block
scales are taken (arXiv 2509.25149, section 4.2; Transformer Engine and torchao's
``nvfp4_training`` use the same 16x16 matrix and sign rule).

The signs are seeded (:func:`rht_signs`): one vector per layer, kept for the whole run (a
checkpoint stores the seed or the vector). The transform is computed with the fast
Walsh-Hadamard butterflies in FP32, elementwise additions only, so every device gives the same
bits; the result is rounded to the input's dtype, as torchao rounds its BF16 transform to BF16.
"""

from __future__ import annotations

import torch

RHT_SIZE = 16
RHT_NORM = RHT_SIZE**-0.5  # 1/4: exact


def rht_signs(seed: int) -> torch.Tensor:
    """16 random signs (FP32 ±1, on the CPU) from ``seed``: +1 where a uniform draw is >= 0.5,
    torchao's rule (``get_wgrad_sign_vector``), from a generator of its own (the global RNG is
    left alone), so the same seed gives the same vector everywhere."""
    generator = torch.Generator().manual_seed(seed)
    draws = torch.rand(RHT_SIZE, generator=generator)
    return torch.where(draws >= 0.5, 1.0, -1.0)


def random_hadamard_transform(x: torch.Tensor, signs: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``x`` with each block of 16 along ``dim`` multiplied by R = diag(``signs``) H / 4 (as a row
    vector: ``block @ R``), in ``x``'s dtype. Applying it to both operands of a GEMM along their
    shared reduction dimension leaves the product unchanged (up to rounding). ValueError if the
    size of ``dim`` is not a multiple of 16 or ``signs`` is not a vector of 16 (:func:`rht_signs`;
    their values are not checked: that would synchronise with the device on every call)."""
    if signs.shape != (RHT_SIZE,):
        raise ValueError(
            f"RHT: signs must be a vector of {RHT_SIZE} (rht_signs), got {tuple(signs.shape)}"
        )
    if x.dim() == 0 or x.shape[dim] % RHT_SIZE:
        raise ValueError(
            f"RHT: the size of dim {dim} of shape {tuple(x.shape)} is not a multiple of {RHT_SIZE}"
        )
    moved = x.movedim(dim, -1)
    blocks = moved.float().reshape(*moved.shape[:-1], -1, RHT_SIZE)
    transformed = walsh_hadamard(blocks * signs.to(blocks.device)) * RHT_NORM
    return transformed.reshape(moved.shape).movedim(-1, dim).to(x.dtype)


def walsh_hadamard(t: torch.Tensor) -> torch.Tensor:
    """``t @ H`` for the last dimension (a power of two, n) and H the n x n Sylvester Hadamard
    matrix (H_2n = [[H_n, H_n], [H_n, -H_n]], unnormalised), by log2(n) butterfly stages."""
    n = t.shape[-1]
    half = 1
    while half < n:
        pairs = t.reshape(*t.shape[:-1], n // (2 * half), 2, half)
        first, second = pairs[..., 0, :], pairs[..., 1, :]
        t = torch.stack([first + second, first - second], dim=-2).reshape(*t.shape[:-1], n)
        half *= 2
    return t
