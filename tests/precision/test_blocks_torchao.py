"""mptrain's block-scaled quantization against torchao 0.18, an implementation nobody here wrote.

Same inputs (normal, all-zero, a zero block, denormal-range, outlier, inf, NaN, wide-range
tensors; FP32 and BF16), compared bit for bit: MX elements and E8M0 scales (``to_mx``, FLOOR and
RCEIL; E4M3, E5M2 and E2M1 elements), NVFP4 elements, E4M3 block scales and per-tensor scales
(``NVFP4Tensor.to_nvfp4``, with and without the per-tensor scale), blockwise FP8 (torchao's
pure-torch references of ``blockwise_fp8_training``, and the scales of its Triton kernel run by
Triton's interpreter), the dequantized tensors, the random Hadamard transform's matrix and
signs, and the three GEMMs of a Linear in MXFP8 (torchao's emulated ``mx_mm`` and
``MXFP8Linear``, at K = 1024). Where the two differ the test says so and checks the difference
exactly: a NaN's sign or payload (not a value), E2M1 codes inside a NaN-scaled block (E2M1 has no
NaN: torchao's bit trick gives garbage, mptrain a zero code; both dequantize to NaN), NVFP4's
per-tensor scale of an all-zero or ~1e-40 tensor, RCEIL's rounding just above a power of two,
the blockwise FP8 scale of a BF16 128x1 tile below 1e-12 in torchao's rhs reference (it clamps
the amax in BF16; its other references, its Triton kernels and mptrain in FP32), and a BF16
MXFP8 Linear's products (torchao multiplies BF16 operands with a BF16 ``torch.mm``, mptrain the
FP32 ones in FP32 and rounds once). docs/precisions.md explains each.
torchao is in the ``test`` extra; without it these tests are skipped.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from mptrain.precision.quant.block_linear import BlockLinear
from mptrain.precision.quant.block_quant import BlockQuantization
from mptrain.precision.quant.blockwise import quantize_blockwise
from mptrain.precision.quant.e2m1 import E2M1
from mptrain.precision.quant.fp8 import AMAX_EPS, E4M3, E5M2, quantize, scale_from_amax
from mptrain.precision.quant.hadamard import random_hadamard_transform, rht_signs
from mptrain.precision.quant.mx import fake_quant_mx, quantize_mx
from mptrain.precision.quant.nvfp4 import nvfp4_tensor_scale, quantize_nvfp4

mx_tensor = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor", reason="no torchao")
from torchao.prototype.blockwise_fp8_training import kernels as blockwise_ref  # noqa: E402
from torchao.prototype.moe_training import mxfp8_linear  # noqa: E402
from torchao.prototype.moe_training.nvfp4_training import hadamard_utils  # noqa: E402
from torchao.prototype.mx_formats import config as mx_config  # noqa: E402
from torchao.prototype.mx_formats import nvfp4_tensor  # noqa: E402
from torchao.quantization.quantize_.common.kernel_preference import KernelPreference  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
ROUNDINGS = ("floor", "rceil")
CASES = (
    "randn", "zeros", "zero_block", "denormal", "tiny_blocks", "outlier", "inf", "nan", "wide_range",
)  # fmt: skip


def make(case: str, rows: int, cols: int, block: int) -> torch.Tensor:
    """An FP32 test tensor of shape (rows, cols); ``block`` places the special blocks."""
    generator = torch.Generator().manual_seed(CASES.index(case))
    x = torch.randn(rows, cols, generator=generator)
    if case == "zeros":
        x.zero_()
    elif case == "zero_block":
        x[1, block : 2 * block] = 0
    elif case == "denormal":  # the whole tensor in FP32's subnormal range
        x *= 1e-40
    elif case == "tiny_blocks":  # blocks at 1e-40 (subnormal), 1e-38, 2^-118, 1e-30
        for row, size in enumerate((1e-40, 1e-38, 2.0**-118, 1e-30)):
            x[row, :block] *= size
    elif case == "outlier":
        x[2, 3] = 1e4
        x[3, block + 1] = -3e4
    elif case == "inf":
        x[0, 5] = torch.inf
        x[2, block] = -torch.inf
    elif case == "nan":
        x[1, 7] = torch.nan
    elif case == "wide_range":  # rows from 1e-35 to 1e35: scale exponents across E8M0's range
        x *= torch.logspace(-35, 35, rows)[:, None]
    return x


def bits_equal(ours: torch.Tensor, theirs: torch.Tensor) -> bool:
    """Same shape and the same bits wherever both are not NaN (a NaN's sign and payload are not
    values: torch's operations do not keep them alike); NaN where the other is NaN."""
    assert ours.shape == theirs.shape, (ours.shape, theirs.shape)
    assert ours.dtype == theirs.dtype, (ours.dtype, theirs.dtype)
    int_dtype = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[ours.element_size()]
    same = ours.view(int_dtype) == theirs.view(int_dtype)
    if ours.is_floating_point() and ours.dtype != torch.float8_e8m0fnu:
        nan_ours, nan_theirs = ours.float().isnan(), theirs.float().isnan()
        same = (same & (nan_ours == nan_theirs)) | (nan_ours & nan_theirs)
    return bool(same.all())


def nan_blocks_as_bytes(scale_is_nan: torch.Tensor, block: int) -> torch.Tensor:
    """Per packed E2M1 byte: is it in a block whose scale is NaN."""
    return scale_is_nan.repeat_interleave(block // 2, dim=-1)


def assert_e2m1_equal(
    ours: torch.Tensor, theirs: torch.Tensor, scale_is_nan: torch.Tensor, block: int
):
    """Packed E2M1 bytes equal outside NaN-scaled blocks (inside them both dequantize to NaN)."""
    outside = ~nan_blocks_as_bytes(scale_is_nan, block)
    assert torch.equal(ours.view(torch.uint8)[outside], theirs.view(torch.uint8)[outside])


# ---------------------------------------------------------------------------------------- MX
@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("elem", [E4M3, E5M2, E2M1], ids=["e4m3", "e5m2", "e2m1"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_mx_elements_scales_and_dequantized_are_torchaos(case, dtype, elem, rounding):
    x = make(case, 8, 128, 32).to(DTYPES[dtype])
    mode = mx_config.ScaleCalculationMode(rounding)
    their_scale, their_data = mx_tensor.to_mx(x, elem, 32, mode)
    ours = quantize_mx(x, elem_dtype=elem, rounding=rounding)
    assert ours.scale.dtype == torch.float8_e8m0fnu
    assert bits_equal(ours.scale, their_scale)
    if elem == E2M1:
        assert_e2m1_equal(ours.data, their_data, ours.scale.view(torch.uint8) == 255, 32)
    else:
        assert bits_equal(ours.data, their_data)
    theirs = mx_tensor.MXTensor.to_mx(x, elem, 32, mode).dequantize(x.dtype)
    assert bits_equal(ours.dequantize(x.dtype), theirs)


@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_mx_along_any_dim_is_torchaos_on_the_moved_tensor(rounding):
    """torchao quantizes the last dim of a contiguous tensor; mptrain moves ``dim`` last itself."""
    x = make("wide_range", 1024, 96, 32).reshape(32, 32, 96).to(torch.bfloat16)
    mode = mx_config.ScaleCalculationMode(rounding)
    for dim in (0, 1):
        scale, data = mx_tensor.to_mx(x.movedim(dim, -1).contiguous(), E4M3, 32, mode)
        ours = quantize_mx(x, dim, rounding=rounding)
        assert bits_equal(ours.scale, scale) and bits_equal(ours.data, data)
        assert ours.dequantize().shape == x.shape


def test_mx_refuses_a_size_that_is_not_a_multiple_of_32_as_torchao_does():
    x = torch.randn(4, 48)
    with pytest.raises(AssertionError, match="divisible by block_size"):
        mx_tensor.to_mx(x, E4M3, 32)
    with pytest.raises(ValueError, match=r"MX: the size 48 of dim 1 is not a multiple of .* 32"):
        quantize_mx(x)
    with pytest.raises(ValueError, match="size 4 of dim 0"):
        quantize_mx(x, dim=0)
    with pytest.raises(ValueError, match="rounding='even' is not one of"):
        quantize_mx(torch.randn(4, 32), rounding="even")
    with pytest.raises(ValueError, match=r"input dtype torch\.float64"):
        quantize_mx(torch.randn(4, 32, dtype=torch.float64))


def test_rceil_rounds_up_exactly_where_torchaos_eager_log2_does_not():
    """torchao's eager RCEIL takes ceil(torch.log2(amax / max)); torch.log2 returns the integer
    for FP32 inputs up to ~22 ulps above a power of two, so such a block gets a scale one binade
    too small and its largest elements saturate. mptrain rounds up exactly (what cuBLAS and the
    PTX instruction ``cvt.rp.satfinite.ue8m0x2.f32``, torchao's own SM100 path, compute). Only
    FP32 inputs can land there: a BF16/FP16 amax just above 448 x 2^k is 448 x 2^k itself
    (448 = 7 x 2^6 needs 3 bits, the next BF16 is 2^-7 of it away), so for them the two agree
    always. On 1M blocks of FP32 normal data none differed (an estimated ~3e-7 chance a block)."""
    rceil = mx_config.ScaleCalculationMode.RCEIL
    k = torch.arange(-100, 100, 7).repeat_interleave(24)
    ulps = torch.arange(24, dtype=torch.int32).repeat(len(k) // 24)  # 0-23 ulps above 448 x 2^k
    amaxes = torch.tensor([448 * 2.0**e for e in k.tolist()])
    amaxes = (amaxes.view(torch.int32) + ulps).view(torch.float32)
    x = torch.zeros(len(amaxes), 32)
    x[:, 0], x[:, 1] = amaxes, amaxes / 3
    their_scale, their_data = mx_tensor.to_mx(x, E4M3, 32, rceil)
    theirs_code = their_scale.view(torch.uint8).long().flatten()
    ours = quantize_mx(x, rounding="rceil")
    ours_code = ours.scale.view(torch.uint8).long().flatten()
    # amax / 448 is 2^k exactly at 0 ulps, above it (by >= 0.57 ulp, rounded up to 1) after.
    assert torch.equal(ours_code, k + 127 + (ulps > 0).long())
    differ = ours_code != theirs_code
    assert differ.sum() > 100  # the window is real: up to ~22 ulps above each power here
    assert torch.equal(ours_code[differ] - theirs_code[differ], torch.ones_like(k[differ]))
    # In those blocks torchao's largest element saturates at 448; ours is half of it, exact to
    # E4M3's rounding. Either way the error of the dequantized block is below 2^-4 of the value.
    assert (their_data[differ, 0].float() == 448).all()
    assert (ours.data[differ, 0].float() == 224).all()
    theirs = mx_tensor.MXTensor.to_mx(x, E4M3, 32, rceil).dequantize()
    for deq in (ours.dequantize(), theirs):
        assert ((deq - x).abs() <= x.abs() * 2.0**-4).all()
    assert torch.equal(ours.data[~differ].view(torch.uint8), their_data[~differ].view(torch.uint8))


@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_three_gemms_of_a_linear_equal_torchaos_emulated_mxfp8(dtype, rounding):
    """out = x Wᵀ, dx = dy W, dW = dyᵀ x with every operand fake-quantized along its own GEMM's
    reduction dimension equal, bit for bit, torchao's MXFP8 training autograd function with its
    emulated kernels (``mx_mm``: E4M3 everywhere, the backward re-quantizing the saved x and W).
    In BF16 that is a BF16 matmul of BF16 operands, torchao's; mptrain's emulation multiplies in
    FP32 and rounds once (the K = 1024 tests below)."""
    generator = torch.Generator().manual_seed(0)
    dt = DTYPES[dtype]
    x = torch.randn(64, 128, generator=generator).to(dt).requires_grad_()
    w = torch.randn(96, 128, generator=generator).to(dt).requires_grad_()
    dy = torch.randn(64, 96, generator=generator).to(dt)
    out = mxfp8_linear.mx_mm.apply(
        x, w, E4M3, E4M3, E4M3, 32, KernelPreference.EMULATED,
        mx_config.MXFP8Dim0CastKernelChoice.TORCH, mx_config.MXFP8Dim1CastKernelChoice.TORCH,
        mx_config.ScaleCalculationMode(rounding), False,
    )  # fmt: skip
    out.backward(dy)

    def fq(t: torch.Tensor, dim: int) -> torch.Tensor:
        return fake_quant_mx(t.detach(), dim, rounding=rounding)

    assert torch.equal(torch.mm(fq(x, 1), fq(w, 1).t()), out)
    assert torch.equal(torch.mm(fq(dy, 1), fq(w, 0)), x.grad)
    assert torch.equal(torch.mm(fq(dy, 0).t(), fq(x, 0)), w.grad)


FEATURES = 1024  # tokens, in and out features: K = 1024 in all three GEMMs


def mxfp8_linears(weight: torch.Tensor, rounding: str) -> tuple[nn.Module, nn.Module]:
    """(mptrain's emulated MXFP8 layer, torchao's ``MXFP8Linear`` on its emulated kernels), both
    holding ``weight`` (no bias), in its dtype."""
    out_features, in_features = weight.shape
    theirs = mxfp8_linear.MXFP8Linear(
        in_features, out_features, bias=False, device="meta",
        kernel_preference=KernelPreference.EMULATED,
        scale_calculation_mode=mx_config.ScaleCalculationMode(rounding),
    ).to_empty(device="cpu").to(weight.dtype)  # fmt: skip
    theirs.weight.data.copy_(weight)
    plain = nn.Linear(in_features, out_features, bias=False, device="meta")
    plain.weight = nn.Parameter(weight.clone())
    return BlockLinear.from_linear(
        plain, BlockQuantization("mxfp8", scale_rounding=rounding)
    ), theirs


def forward_backward(layer: nn.Module, x: torch.Tensor, dy: torch.Tensor) -> list[torch.Tensor]:
    """[output, input gradient, weight gradient] of one forward and backward."""
    x = x.clone().requires_grad_()
    out = layer(x)
    out.backward(dy)
    return [out.detach(), x.grad, layer.weight.grad]


def mxfp8_operands(
    x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, rounding: str
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The FP32 dequantized operands of out = x Wᵀ, dx = dy W, dW = dyᵀ x (each quantized along
    its GEMM's K), in the layouts mptrain's emulation multiplies them in."""

    def fq(t: torch.Tensor, dim: int) -> torch.Tensor:
        return fake_quant_mx(t.float(), dim, rounding=rounding).contiguous()

    return [(fq(x, 1), fq(w, 1).t()), (fq(dy, 1), fq(w, 0)), (fq(dy, 0).t(), fq(x, 0))]


def bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in BF16 ulps: how many steps from one BF16 value to the next lead from a to b
    (+0 and -0 are one value)."""

    def ordered(t: torch.Tensor) -> torch.Tensor:
        bits = t.view(torch.int16).int()
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)

    return (ordered(a) - ordered(b)).abs()


def layer_inputs(dtype: torch.dtype, grad_size: float = 1.0) -> tuple[torch.Tensor, ...]:
    """(x, W, dy) for a FEATURES-square layer, in ``dtype``: x normal, W normal / sqrt(in
    features) (nn.Linear's scale), dy normal times ``grad_size``."""
    generator = torch.Generator().manual_seed(0)
    x, w, dy = (torch.randn(FEATURES, FEATURES, generator=generator) for _ in range(3))
    return x.to(dtype), (w / FEATURES**0.5).to(dtype), (dy * grad_size).to(dtype)


def bf16_ulp(t: torch.Tensor) -> torch.Tensor:
    """The spacing of BF16 values at each element of the BF16 ``t``, from its exponent field
    (2^-133 for zero and subnormals), in FP32."""
    field = (t.view(torch.int16).int() >> 7) & 0xFF
    return torch.exp2((field.clamp(min=1) - 134).float())


def torchaos_bf16_operands(
    operands: list[tuple[torch.Tensor, torch.Tensor]],
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``operands`` (:func:`mxfp8_operands`) in BF16 and in the layouts torchao's ``mx_mm``
    multiplies them in: its right operands are K-major (``b.t()`` contiguous), dW's left one
    quantized from dyᵀ (contiguous)."""
    (x, w_t), (dy, w), (dy_t, x_k) = ((a.bfloat16(), b.bfloat16()) for a, b in operands)
    return [(x, w_t), (dy, w.t().contiguous().t()), (dy_t.contiguous(), x_k.t().contiguous().t())]


@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_fp32_mxfp8_linear_is_torchaos_emulated_mxfp8_linear_at_k_1024(rounding):
    """In FP32 both multiply the same FP32 dequantized operands with an FP32 ``torch.mm``: the
    output and both gradients are torchao's bit for bit, at K = 1024 in all three GEMMs."""
    x, w, dy = layer_inputs(torch.float32)
    ours, theirs = mxfp8_linears(w, rounding)
    for mine, reference in zip(
        forward_backward(ours, x, dy), forward_backward(theirs, x, dy), strict=True
    ):
        assert bits_equal(mine, reference)


@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_bf16_mxfp8_linear_rounds_its_fp32_product_once_where_torchao_multiplies_in_bf16(rounding):
    """A BF16 layer: the same operands, another matmul. torchao dequantizes to BF16 (exact for
    these ordinary tensors: checked) and multiplies with a BF16 ``torch.mm``: its output and
    gradients are that product, bit for bit. mptrain dequantizes to FP32 and multiplies with an
    FP32 ``torch.mm``: its are the FP32 product rounded once to BF16, bit for bit. The two
    differ where their FP32 accumulations, in different orders, round to different BF16
    neighbours: on this CPU, at K = 1024, on about 2e-5 of the entries (the bound: 1e-4), by
    one BF16 ulp plus at most 2^-24 of the sum of the terms' magnitudes (the accumulations'
    difference; measured: under 0.1 of that). So 1 ulp mostly, and up to 8 where the terms
    cancel to ~1e-7 of their magnitudes. Neither is the exactly rounded product there; the next
    test has where mptrain's is and torchao's is not."""
    x, w, dy = layer_inputs(torch.bfloat16)
    ours, theirs = mxfp8_linears(w, rounding)
    mine, reference = forward_backward(ours, x, dy), forward_backward(theirs, x, dy)
    operands = mxfp8_operands(x, w, dy, rounding)
    mode = mx_config.ScaleCalculationMode(rounding)
    for t, dim in ((x, 1), (w, 1), (dy, 1), (w, 0), (dy, 0), (x, 0)):
        theirs_operand = mx_tensor.MXTensor.to_mx(t.movedim(dim, -1).contiguous(), E4M3, 32, mode)
        ours_operand = fake_quant_mx(t.float(), dim, rounding=rounding).movedim(dim, -1)
        assert torch.equal(theirs_operand.dequantize(torch.bfloat16).float(), ours_operand)
    differing = 0
    for ours_gemm, their_gemm, (a, b), (a_bf16, b_bf16) in zip(
        mine, reference, operands, torchaos_bf16_operands(operands), strict=True
    ):
        assert bits_equal(ours_gemm, torch.mm(a, b).bfloat16())
        assert bits_equal(their_gemm, torch.mm(a_bf16, b_bf16))
        differ = ours_gemm != their_gemm
        assert differ.sum() <= 1e-4 * differ.numel()
        distance = (ours_gemm.float() - their_gemm.float()).abs()
        ulp = torch.maximum(bf16_ulp(ours_gemm), bf16_ulp(their_gemm))
        magnitudes = torch.mm(a.abs(), b.abs())
        assert (distance <= ulp + 2.0**-24 * magnitudes).all()
        differing += int(differ.sum())
    assert differing > 0  # not bit for bit (at K = 128 they happen to be)


def test_bf16_floor_blocks_at_2_pow_minus_127_lose_bits_in_torchaos_emulation_only():
    """FLOOR gives a block with amax below 2^-118 the scale 2^-127 (E8M0 code 0) and divides it
    by 2^-126 (torchao's convention, mx.py): its dequantized elements are halves, down to 2^-136.
    Exact in FP32 (mptrain's emulation); torchao's BF16 dequantization rounds them to BF16's
    subnormal spacing, 2^-133: it is mptrain's FP32 operand rounded to BF16 (for BF16 inputs
    the only place where the two differ: elsewhere an element's grid spacing is a power of two
    that the BF16 input is already a multiple of, or one of at least 2^-133). Output gradients
    around 2^-126 put every block of dy there (5 % of its elements lose bits): torchao's
    grad_weight then differs from mptrain's on 43 % of its entries, by up to 16 ulps, its
    grad_input on 9 % by 1 ulp (the bounds: 20 %, at least 8 ulps, 2 %); mptrain's are the
    exactly rounded (FP64) product of the FP32 operands but for 4 entries (1 ulp: the FP32
    sum's own rounding; the bound: 1e-5 of them)."""
    x, w, dy = layer_inputs(torch.bfloat16, grad_size=2.0**-126)
    for dim in (0, 1):
        assert (quantize_mx(dy, dim, rounding="floor").scale.view(torch.uint8) == 0).all()
    exact = fake_quant_mx(dy.float(), 0, rounding="floor")
    mode = mx_config.ScaleCalculationMode.FLOOR
    their_operand = mx_tensor.MXTensor.to_mx(dy.t().contiguous(), E4M3, 32, mode)
    their_operand = their_operand.dequantize(torch.bfloat16).t()
    assert torch.equal(their_operand, exact.bfloat16())
    assert (their_operand.float() != exact).float().mean() > 0.02  # 5 % lost bits
    ours, theirs = mxfp8_linears(w, "floor")
    mine, reference = forward_backward(ours, x, dy), forward_backward(theirs, x, dy)
    operands = mxfp8_operands(x, w, dy, "floor")
    for name, ours_gemm, their_gemm, (a, b), share in zip(
        ("dx", "dW"), mine[1:], reference[1:], operands[1:], (0.02, 0.2), strict=True
    ):
        assert bits_equal(ours_gemm, torch.mm(a, b).bfloat16()), name
        rounded = bf16_ulps(ours_gemm, torch.mm(a.double(), b.double()).bfloat16())
        assert rounded.max() <= 1 and (rounded > 0).sum() <= 1e-5 * rounded.numel(), name
        ulps = bf16_ulps(ours_gemm, their_gemm)
        assert (ulps > 0).float().mean() > share, name
    assert bf16_ulps(mine[2], reference[2]).max() >= 8


# ------------------------------------------------------------------------------------- NVFP4
TORCHAO_NVFP4_BREAKS = ("zeros", "denormal")  # with the per-tensor scale: see the test below
NVFP4_CASES = [
    pytest.param(case, tensor_scale, id=f"{case}-{'tensor' if tensor_scale else 'block'}-scale")
    for case in CASES
    for tensor_scale in (False, True)
    if not (tensor_scale and case in TORCHAO_NVFP4_BREAKS)
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("case", "tensor_scale"), NVFP4_CASES)
def test_nvfp4_elements_scales_and_dequantized_are_torchaos(case, tensor_scale, dtype):
    x = make(case, 8, 64, 16).to(DTYPES[dtype])
    scale = nvfp4_tensor.per_tensor_amax_to_scale(x.abs().amax()) if tensor_scale else None
    theirs = nvfp4_tensor.NVFP4Tensor.to_nvfp4(x, per_tensor_scale=scale)
    ours = quantize_nvfp4(x, tensor_scale=tensor_scale)
    assert bits_equal(ours.scale, theirs.scale)
    if tensor_scale:
        assert bits_equal(ours.tensor_scale, scale)
    else:
        assert ours.tensor_scale is None
    assert_e2m1_equal(ours.data, theirs.qdata, ours.scale.float().isnan(), 16)
    assert bits_equal(ours.dequantize(x.dtype), theirs.dequantize(x.dtype))


@pytest.mark.parametrize("tensor_scale", [False, True], ids=["block-scales", "tensor-scale"])
def test_nvfp4_elements_are_torchaos_at_the_rounding_ties(tensor_scale):
    """An ulp more or less in an element's multiplier ((1 / tensor scale) / block scale) changes
    its E2M1 code only within an ulp of a tie: about one element in a million of random data, so
    random tensors cannot tell two ways of computing it apart. Here every element but each
    block's amax lies within 3 ulps of a tie (torchao's own multiplier places them there)."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(256, 16, generator=generator)
    x[:, 0] = x.abs().amax(dim=1) * 1.5  # the block's amax: its scale is known before the rest
    scale = nvfp4_tensor.per_tensor_amax_to_scale(x.abs().amax()) if tensor_scale else None
    their_scale = nvfp4_tensor.NVFP4Tensor.to_nvfp4(x, per_tensor_scale=scale).scale.float()
    multiplier = (1.0 / scale) / their_scale if tensor_scale else 1.0 / their_scale
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    picks = torch.randint(0, 7, (256, 15), generator=generator)
    near = (ties[picks] / multiplier).view(torch.int32)
    near += torch.randint(-3, 4, near.shape, generator=generator, dtype=torch.int32)
    x[:, 1:] = near.view(torch.float32) * torch.where(picks % 2 == 0, 1.0, -1.0)
    theirs = nvfp4_tensor.NVFP4Tensor.to_nvfp4(x, per_tensor_scale=scale)
    ours = quantize_nvfp4(x, tensor_scale=tensor_scale)
    assert bits_equal(ours.scale, theirs.scale)
    assert torch.equal(ours.data, theirs.qdata)


def test_nvfp4_3d_tensor_is_torchaos():
    x = make("wide_range", 64, 64, 16).reshape(4, 16, 64)
    scale = nvfp4_tensor.per_tensor_amax_to_scale(x.abs().amax())
    theirs = nvfp4_tensor.NVFP4Tensor.to_nvfp4(x, per_tensor_scale=scale)
    ours = quantize_nvfp4(x)
    assert bits_equal(ours.scale, theirs.scale) and torch.equal(ours.data, theirs.qdata)


@pytest.mark.parametrize("case", TORCHAO_NVFP4_BREAKS)
def test_nvfp4_tensor_scale_of_a_zero_or_tiny_tensor_stays_finite(case):
    """torchao divides by amax / 2688 as given: 0 for an all-zero tensor (every block scale and
    element NaN), ~4e-44 for a tensor at 1e-40 (1 / scale is inf: every nonzero element
    saturates at ±6, a sign and nothing more). mptrain's per-tensor scale is at least 2^-121:
    both quantize to zeros, counted as zero blocks and underflows."""
    x = make(case, 8, 64, 16)
    theirs = nvfp4_tensor.NVFP4Tensor.to_nvfp4(
        x, per_tensor_scale=nvfp4_tensor.per_tensor_amax_to_scale(x.abs().amax())
    )
    ours = quantize_nvfp4(x, stats=True)
    if case == "zeros":
        assert theirs.scale.float().isnan().all() and theirs.dequantize().isnan().all()
    else:
        codes = torch.stack([theirs.qdata & 7, theirs.qdata >> 4 & 7], -1).flatten()
        assert (codes == 7).all()  # every element at E2M1's max
    assert bits_equal(ours.tensor_scale, torch.tensor(2.0**-121))
    assert torch.equal(ours.dequantize(), torch.zeros_like(x).abs())
    stats = ours.stats.as_dict()
    assert stats["zero_blocks"] == stats["blocks"] and stats["underflows"] == int((x != 0).sum())
    # Above 448 x 6 x 2^-121 the per-tensor scale is torchao's.
    amax = torch.tensor(2688 * 2.0**-120)
    assert bits_equal(nvfp4_tensor_scale(amax), nvfp4_tensor.per_tensor_amax_to_scale(amax))


def test_nvfp4_refuses_a_size_that_is_not_a_multiple_of_16_as_torchao_does():
    x = torch.randn(4, 40)
    with pytest.raises(AssertionError, match="divisible by block_size"):
        nvfp4_tensor.NVFP4Tensor.to_nvfp4(x)
    with pytest.raises(ValueError, match=r"NVFP4: the size 40 of dim 1 is not a multiple of .* 16"):
        quantize_nvfp4(x)


# --------------------------------------------------------------------------- blockwise FP8
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_blockwise_tiles_and_blocks_are_torchaos(case, dtype):
    """1x128 tiles along the last dim (torchao's lhs activation cast), along dim 0 (its rhs cast,
    dW's operands) and 128x128 blocks of a weight and of its transpose."""
    x = make(case, 256, 384, 128).to(DTYPES[dtype])
    for (their_data, their_scale), ours in (
        (blockwise_ref.torch_blockwise_scale_act_quant_lhs(x), quantize_blockwise(x)),
        (blockwise_ref.torch_blockwise_scale_weight_quant(x), quantize_blockwise(x, tile_2d=True)),
    ):
        assert bits_equal(ours.data, their_data)
        assert bits_equal(ours.scale, their_scale.contiguous())
    their_data, their_scale = blockwise_ref.torch_blockwise_scale_act_quant_rhs(x)
    ours = quantize_blockwise(x, dim=0)  # data and scale hold dim 0 last
    assert bits_equal(ours.data.t(), their_data)
    # torchao's rhs reference clamps the amax at 1e-12 in the input's dtype (its lhs and weight
    # references, its Triton kernels and mptrain in FP32 or FP64): a BF16 tile below 1e-12 (zero
    # included) gets the scale of BF16(1e-12) there. Every such tile here lies below 1e-30, whose
    # elements round to zero under either scale (below ~2e-18 they do); above that they differ:
    # test_blockwise_bf16_tiles_below_1e_12_are_torchaos_rhs_reference_with_the_clamp_in_fp32.
    # Elsewhere the scales agree, and everywhere with torchao's lhs reference on the transpose.
    amax = x.float().abs().reshape(2, 128, 384).amax(1)
    usual = amax >= 1e-12
    assert bits_equal(ours.scale.t()[usual], their_scale[usual])
    _, their_scale = blockwise_ref.torch_blockwise_scale_act_quant_lhs(x.t().contiguous())
    assert bits_equal(ours.scale, their_scale.contiguous())
    their_data, their_scale = blockwise_ref.torch_blockwise_scale_weight_quant(x.t().contiguous())
    ours = quantize_blockwise(x, dim=0, tile_2d=True)
    assert bits_equal(ours.data, their_data) and bits_equal(ours.scale, their_scale)


def test_blockwise_elements_are_torchaos_at_the_rounding_ties():
    """As for NVFP4: every element but each tile's amax within 3 ulps of an E4M3 tie (halfway
    between neighbouring E4M3 values) once multiplied by torchao's scale."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 128, generator=generator)
    x[:, 0] = x.abs().amax(dim=1) * 1.5
    _, their_inverse = blockwise_ref.torch_blockwise_scale_act_quant_lhs(x)
    grid = torch.arange(1, 126, dtype=torch.uint8).view(E4M3).float()  # 2^-9 up to 416
    picks = torch.randint(0, len(grid) - 1, (64, 127), generator=generator)
    ties = (grid[picks] + grid[picks + 1]) / 2
    near = (ties * their_inverse).view(torch.int32)
    near += torch.randint(-3, 4, near.shape, generator=generator, dtype=torch.int32)
    x[:, 1:] = near.view(torch.float32)
    their_data, their_inverse = blockwise_ref.torch_blockwise_scale_act_quant_lhs(x)
    ours = quantize_blockwise(x)
    assert bits_equal(ours.scale, their_inverse.contiguous())
    assert bits_equal(ours.data, their_data)


def tiny_bf16_tiles() -> torch.Tensor:
    """A BF16 (256, 128) tensor whose 128x1 tiles (along dim 0) in rows 0-127 have amaxes from
    1e-18 up to BF16's largest value below 1e-12 (0.99476e-12), one all zero, and the last one
    at BF16(1e-12) = 1.00187e-12 itself; rows 128-255 are ordinary."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(256, 128, generator=generator)
    top = x[:128]
    top /= top.abs().amax(0)  # amax 1 per column, then the column's own
    eps = torch.tensor(AMAX_EPS).bfloat16()  # rounds up: 1.00187e-12
    below = (eps.view(torch.int16) - 1).view(torch.bfloat16)
    top *= torch.cat([torch.logspace(-18, -12.01, 126), below.float()[None], eps.float()[None]])
    top[:, 0] = 0
    return x.bfloat16()


def test_blockwise_bf16_tiles_below_1e_12_are_torchaos_rhs_reference_with_the_clamp_in_fp32():
    """torchao's rhs reference (``torch_blockwise_scale_act_quant_rhs``: 128x1 tiles, dW's
    operand x) clamps each tile's amax at 1e-12 in the input's dtype, BF16(1e-12) = 1.00187e-12
    for a BF16 tensor; mptrain clamps at FP32(1e-12), as torchao's lhs and weight references
    (FP64) and its Triton kernels do (next test). So a BF16 tile with amax below 1e-12 gets, in
    that reference, mptrain's scale of an amax of BF16(1e-12): a multiplier 0.19 % smaller, and
    its elements are ``quantize`` of the tile under that multiplier, bit for bit: each equal to
    mptrain's or one E4M3 step smaller in magnitude (not zeros: 448 / 1e-12 lifts any tile
    above ~2e-18 into E4M3's range). Everywhere else (other tiles, the same tiles in FP32, the
    lhs reference on the transpose) the two are equal bit for bit."""
    x = tiny_bf16_tiles()
    amax = x.float().abs().reshape(2, 128, -1).amax(1)
    tiny = amax < AMAX_EPS
    assert tiny[0, :-1].all() and not tiny[0, -1] and not tiny[1].any()
    their_data, their_scale = blockwise_ref.torch_blockwise_scale_act_quant_rhs(x)
    ours = quantize_blockwise(x, dim=0)
    our_data, our_scale = ours.data.t(), ours.scale.t()
    assert bits_equal(our_scale[~tiny], their_scale[~tiny])
    assert bits_equal(our_data[128:], their_data[128:])
    assert bits_equal(our_data[:128, -1], their_data[:128, -1])  # at BF16(1e-12)

    zero = torch.zeros(())
    bf16_eps = torch.tensor(AMAX_EPS).bfloat16().float()
    our_multiplier, their_multiplier = (scale_from_amax(a, E4M3) for a in (zero, bf16_eps))
    assert their_multiplier / our_multiplier == pytest.approx(1 - 0.00186, abs=1e-5)
    assert (our_scale[tiny] == our_multiplier.reciprocal()).all()
    assert (their_scale[tiny] == their_multiplier.reciprocal()).all()
    tiles = x[:128, :-1].float()
    assert bits_equal(our_data[:128, :-1], quantize(tiles, our_multiplier, E4M3))
    assert bits_equal(their_data[:128, :-1], quantize(tiles, their_multiplier, E4M3))
    magnitude = 0x7F  # E4M3's bits below the sign: the codes of the magnitudes, in order
    ours_code = our_data[:128, :-1].view(torch.uint8) & magnitude
    theirs_code = their_data[:128, :-1].view(torch.uint8) & magnitude
    steps = ours_code.int() - theirs_code.int()
    assert ((steps == 0) | (steps == 1)).all()
    assert (ours_code > 0).sum() > 10_000 and (steps == 1).sum() > 100  # 13382, 281 of 16256

    their_data, their_scale = blockwise_ref.torch_blockwise_scale_act_quant_rhs(x.float())
    ours = quantize_blockwise(x.float(), dim=0)
    assert bits_equal(ours.data.t(), their_data) and bits_equal(ours.scale.t(), their_scale)
    their_data, their_scale = blockwise_ref.torch_blockwise_scale_act_quant_lhs(x.t().contiguous())
    ours = quantize_blockwise(x, dim=0)
    assert bits_equal(ours.data, their_data) and bits_equal(ours.scale, their_scale.contiguous())


# torchao's Triton rhs kernel through Triton's interpreter, in a process of its own (the
# interpreter is chosen when the kernels are defined, at import): argv[1] holds the BF16 input,
# argv[2] receives the kernel's scales.
_TRITON_RHS_SCALES = """
import sys, torch
from torchao.prototype.blockwise_fp8_training import kernels
x = torch.load(sys.argv[1])
rows, cols = x.shape
data = torch.empty_like(x, dtype=torch.float8_e4m3fn).as_strided(x.shape, (1, rows))
scale = x.new_empty(rows // 128, cols, dtype=torch.float32)
groups = 16  # NUM_GROUPS, one of the autotuner's configs (the autotuner needs a GPU to time)
kernels.triton_fp8_blockwise_act_quant_rhs_kernel.fn[(rows // 128, cols // groups)](
    x, *x.stride(), data, *data.stride(), scale, *scale.stride(), M=rows, K=cols,
    BLOCK_SIZE=128, NUM_GROUPS=groups, EPS=kernels.EPS, FP8_MAX=448.0,
)
torch.save(scale, sys.argv[2])
"""


@pytest.mark.slow  # a subprocess importing Triton's interpreter: ~5 s
def test_blockwise_bf16_tile_scales_are_torchaos_triton_kernels(tmp_path):
    """What torchao's blockwise FP8 training runs on the GPU for dW's x,
    ``triton_fp8_blockwise_act_quant_rhs`` (its ``fp8_blockwise_mm`` backward), clamps in FP32:
    Triton's ``tl.clamp`` promotes a BF16 operand to FP32 first. Its scales (run here by
    Triton's interpreter) equal mptrain's bit for bit on the tiles of the test above, those
    below 1e-12 included. Only the scales are compared: the interpreter's FP32-to-FP8
    conversion is not the GPU's (its elements differ from torchao's own reference on ordinary
    tiles too); on the GPU the kernel's elements follow from its scales as the reference's do."""
    pytest.importorskip("triton")
    pytest.importorskip("numpy")  # the interpreter computes with it
    x = tiny_bf16_tiles()
    torch.save(x, tmp_path / "x.pt")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    paths = [str(tmp_path / name) for name in ("x.pt", "s.pt")]
    args = [sys.executable, "-c", _TRITON_RHS_SCALES, *paths]
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    theirs = torch.load(tmp_path / "s.pt")
    assert bits_equal(quantize_blockwise(x, dim=0).scale.t(), theirs)


# ------------------------------------------------------------------------------------- RHT
def test_rht_signs_and_matrix_are_torchaos():
    """Same seed, same signs (torchao draws from the global RNG, mptrain from its own generator);
    the transform of BF16 data equals, bit for bit, BF16(x @ R) with torchao's RHT matrix."""
    for seed in range(4):
        torch.manual_seed(seed)
        theirs = hadamard_utils.get_wgrad_sign_vector(16, "cpu", torch.float32)
        assert torch.equal(rht_signs(seed), theirs)
    signs = rht_signs(7)
    matrix = hadamard_utils.get_rht_matrix(tuple(int(s) for s in signs), "cpu", torch.float32, 16)
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    theirs = (x.float().reshape(32, 4, 16) @ matrix).reshape(32, 64).to(torch.bfloat16)
    assert bits_equal(random_hadamard_transform(x, signs), theirs)
    assert bits_equal(random_hadamard_transform(x.t(), signs, dim=0), theirs.t())
