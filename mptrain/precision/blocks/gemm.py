"""The GEMM of two block-scaled operands, emulated: what :class:`~.linear.BlockLinear` multiplies.

The operands arrive dequantized in FP32 (their elements times their block scales: the values a
block-scaled tensor-core GEMM multiplies); the product is an FP32 matmul, then cast to the
output dtype, as a hardware GEMM accumulating in FP32 writes its output. autocast is off around
it: torch.compile traces the backward under the forward's autocast (torch 2.14's default
``backward_pass_autocast="same_as_forward"``), which would run this mm in BF16 (the same reason
as :func:`mptrain.precision.fp8.linear.fp8_gemm`).

Real block-scaled kernels (``torch.nn.functional.scaled_mm`` with BlockWise1x128/128x128 scales
on SM90, BlockWise1x32/1x16 on SM100) are not wired in yet: :func:`block_gemm_available` says so
for every device, the policy records every block-scaled run as emulated, and ``emulate=false``
is refused with that reason.
"""

from __future__ import annotations

import torch

from mptrain.precision.blocks.recipe import BlockRecipe


def block_gemm(
    a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype, recipe: BlockRecipe
) -> torch.Tensor:
    """``a @ b`` of two dequantized FP32 operands with FP32 accumulation, in ``out_dtype``."""
    if recipe.real_gemm:  # the policy never sets it while no real kernel is wired in
        raise NotImplementedError(f"{recipe.format}: no real block-scaled GEMM in this mptrain")
    with torch.autocast(a.device.type, enabled=False):
        return torch.mm(a, b).to(out_dtype)


def block_gemm_available(device: torch.device, fmt: str) -> tuple[bool, str]:
    """(whether ``device`` runs ``fmt``'s GEMMs in hardware here, why not). Always False for
    now: the real kernels are not wired in (see module doc)."""
    return False, f"no real {fmt} GEMM is wired into mptrain yet (emulated on every device)"
