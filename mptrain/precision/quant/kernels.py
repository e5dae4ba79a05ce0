"""The GEMM kernels both families of quantized Linear call, real where the GPU has them and
emulated everywhere else, with the rules of each kernel checked on every device (code that passes
on the CPU cannot fail on the GPU for a rule the CPU skipped):

- FP8 with one scale per tensor or per row (:func:`fp8_gemm`): ``torch._scaled_mm``
  (:func:`fp8_gemm_available`), its layout and alignment contract checked by
  :func:`check_gemm_operands`. Emulated: the FP8 values (exact in FP32) multiplied in FP32, the
  product rescaled once;
- block-scaled (:func:`block_gemm`): torch's block-scaled ``torch.nn.functional.scaled_mm``
  (:func:`block_gemm_available`: the compute capabilities and CUDA each format's row of
  :data:`mptrain.config.format_table.FORMAT_TABLE` names; which devices, in words:
  docs/precisions.md, *Real where the GPU has the kernel*). Both paths take the operands of the
  same quantization; only the matmul differs.

Emulated (``a`` and ``b`` the dequantized FP32 operands): an FP32 matmul with autocast off, cast
to the output dtype, as a hardware GEMM accumulating in FP32 writes its output. autocast is off
because torch.compile traces the backward under the forward's autocast (torch 2.14's default
``backward_pass_autocast="same_as_forward"``), which would run the mm in BF16 (the reason of
:func:`fp8_gemm` too).

Real (``a`` and ``b`` :class:`~.blocked.BlockQuantized`, elements and scales as quantized):
:func:`scaled_mm_call` lays them out as the kernel requires (``a`` row-major, ``b``
column-major, scales per quantization; checked on the CPU by tests/precision/test_block_gemm.py with
a reference that dequantizes exactly the arguments passed) and runs one ``scaled_mm`` that
accumulates in FP32. NVFP4's per-tensor scales multiply the FP32 product afterwards (torchao's
NVFP4 GEMM does the same). Real and emulated products differ by the FP32 summation order and,
for NVFP4 and blockwise FP8, by where the scales are applied (the emulation rounds each element
times its scales to FP32; MXFP8's are exact); the GPU tests bound it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from mptrain.config.format_table import FORMAT_TABLE, FP8_BLOCKWISE, MXFP8, NVFP4
from mptrain.platform import hardware
from mptrain.precision.quant import e2m1
from mptrain.precision.quant.block_quant import BlockQuantization
from mptrain.precision.quant.blocked import BlockQuantized
from mptrain.precision.quant.fp8 import E4M3, E5M2, GEMM_ALIGNMENT, MIN_FP8_CAPABILITY

Operand = torch.Tensor | BlockQuantized

# Rows of the left operand are padded to this for blockwise FP8: its FP32 scales are stored
# M-major, and cuBLAS wants their columns 16-byte aligned (torch tests only multiples of 128).
BLOCKWISE_ROW_ALIGNMENT = 16
# cuBLAS's swizzled block-scale layout: 128 rows x 4 scale columns per tile.
TILE_ROWS, TILE_COLS = 128, 4


# ------------------------------------------------------------------------------ FP8, per tensor or row
def check_gemm_operands(
    a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor
) -> None:
    """The torch._scaled_mm contract, enforced on every device.

    ``a`` (M×K) row-major, ``b`` (K×N) column-major, K and N multiples of 16, not both E5M2;
    scales either both per tensor (shape ()) or both rowwise: (M, 1) for ``a``, (1, N) for ``b``.
    """
    (m, k), (k_b, n) = a.shape, b.shape
    tensorwise = a_scale.shape == b_scale.shape == ()
    rowwise = a_scale.shape == (m, 1) and b_scale.shape == (1, n)
    if not (tensorwise or rowwise):
        raise ValueError(
            f"FP8 GEMM: scales {tuple(a_scale.shape)} and {tuple(b_scale.shape)} are neither "
            f"both per tensor nor rowwise ({m}, 1) and (1, {n})"
        )
    if k != k_b:
        raise ValueError(f"FP8 GEMM: inner dimensions differ ({k} vs {k_b})")
    if k % GEMM_ALIGNMENT or n % GEMM_ALIGNMENT:
        raise ValueError(f"FP8 GEMM: K={k} and N={n} must be multiples of {GEMM_ALIGNMENT}")
    if a.stride(1) != 1 or a.stride(0) != k:
        raise ValueError("FP8 GEMM: the first operand must be row-major")
    if b.stride(0) != 1 or b.stride(1) != k_b:
        raise ValueError("FP8 GEMM: the second operand must be column-major")
    if a.dtype == E5M2 and b.dtype == E5M2:
        raise ValueError("FP8 GEMM: E5M2 x E5M2 is not supported; one operand must be E4M3")


def fp8_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    out_dtype: torch.dtype,
    real: bool,
) -> torch.Tensor:
    """``dequantize(a) @ dequantize(b)`` with FP32 accumulation, as ``torch._scaled_mm`` computes it
    (scales per tensor or rowwise: see :func:`check_gemm_operands`)."""
    check_gemm_operands(a, a_scale, b, b_scale)
    a_inv, b_inv = a_scale.reciprocal(), b_scale.reciprocal()
    if real:
        return torch._scaled_mm(a, b, scale_a=a_inv, scale_b=b_inv, out_dtype=out_dtype)
    # FP8 values are exact in FP32: multiply them exactly-rounded in FP32, rescale once
    # (autocast off: see the module doc).
    with torch.autocast(a.device.type, enabled=False):
        return (torch.mm(a.float(), b.float()) * (a_inv * b_inv)).to(out_dtype)


def fp8_gemm_available(device: torch.device) -> bool:
    """True on NVIDIA GPUs of compute capability >= 8.9 with torch._scaled_mm."""
    if device.type != "cuda" or not hasattr(torch, "_scaled_mm"):
        return False
    return torch.cuda.get_device_capability(device) >= MIN_FP8_CAPABILITY


# ------------------------------------------------------------------------------ block-scaled
def block_gemm_available(
    device: torch.device, fmt: str, elements: torch.dtype = E4M3
) -> tuple[bool, str]:
    """(whether ``device`` runs ``fmt``'s GEMMs in hardware through this torch, why not): the
    kernel of ``fmt``'s row of the format table, from the device's compute capability
    (:func:`hardware.cuda_capability`) and torch's build. ``elements``: the gradients' element
    format (blockwise FP8 takes E4M3 only). The reason starts "no real <fmt> GEMM" and says what
    is missing."""
    no = f"no real {fmt} GEMM"
    kernel = FORMAT_TABLE[fmt].kernel  # a block format's row: compute capabilities, CUDA, needs
    if kernel is None:
        return False, f"{no}: torch has no kernel for it"
    if device.type != "cuda":
        return False, f"{no} on the {device.type.upper()}: it {kernel.needs}"
    if torch.version.cuda is None:
        return False, f"{no}: this torch ({torch.__version__}) is not a CUDA build"
    if not hasattr(F, "scaled_mm") or not hasattr(F, "ScalingType"):
        return False, f"{no}: torch {torch.__version__} has no torch.nn.functional.scaled_mm"
    cuda = tuple(int(part) for part in torch.version.cuda.split(".")[:2])
    if kernel.min_cuda is not None and cuda < kernel.min_cuda:
        need = ".".join(map(str, kernel.min_cuda))
        return False, f"{no}: torch is built with CUDA {torch.version.cuda}, it needs >= {need}"
    if not torch.cuda.is_available():
        return False, f"{no}: CUDA is not available here"
    capability = hardware.cuda_capability(device)
    if not kernel.runs_on(capability):
        major, minor = capability
        return False, f"{no} on compute capability {major}.{minor}: it {kernel.needs}"
    if fmt == FP8_BLOCKWISE and elements != E4M3:
        return False, (
            f"{no} for {str(elements).replace('torch.', '')} gradients: torch's blockwise FP8 "
            "GEMM takes E4M3 operands only (fp8.format=e4m3 runs it)"
        )
    return True, ""


def block_gemm(
    a: Operand, b: Operand, out_dtype: torch.dtype, quantization: BlockQuantization
) -> torch.Tensor:
    """``a @ b`` (M x K times K x N) with FP32 accumulation, in ``out_dtype``. Emulated
    (``quantization.real_gemm`` false): two dequantized FP32 tensors. Real: two
    :class:`BlockQuantized` quantized along K, ``b`` standing for the K x N matrix (its
    ``dequantize()``; :func:`transposed` turns an N x K one into it)."""
    if quantization.real_gemm:
        if not (isinstance(a, BlockQuantized) and isinstance(b, BlockQuantized)):
            raise TypeError(f"{quantization.format}: the real GEMM takes quantized operands")
        call = scaled_mm_call(a, b, out_dtype, quantization.format)
        out = F.scaled_mm(
            call.mat_a,
            call.mat_b,
            scale_a=call.scale_a,
            scale_recipe_a=call.recipe_a,
            scale_b=call.scale_b,
            scale_recipe_b=call.recipe_b,
            swizzle_a=call.swizzle,
            swizzle_b=call.swizzle,
            output_dtype=call.output_dtype,
        )
        if call.alpha is not None:  # NVFP4's per-tensor scales, on the FP32 product
            out = out * call.alpha
        return out[: call.rows].to(out_dtype)  # padding rows dropped
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        raise TypeError(f"{quantization.format}: the emulated GEMM takes dequantized FP32 tensors")
    with torch.autocast(a.device.type, enabled=False):
        return torch.mm(a, b).to(out_dtype)


def transposed(operand: Operand) -> Operand:
    """The transpose of a 2-D operand: ``.t()`` of a tensor; a :class:`BlockQuantized` standing
    for its dequantization's transpose (the same elements and scales, the quantized dimension
    renamed: no copy)."""
    if isinstance(operand, torch.Tensor):
        return operand.t()
    if operand.data.dim() != 2:
        raise ValueError(f"transposed: a 2-D operand, got {operand.data.dim()}-D")
    return replace(operand, dim=1 - operand.dim)


@dataclass(frozen=True)
class ScaledMMCall:
    """The arguments of one ``torch.nn.functional.scaled_mm`` (see :func:`scaled_mm_call`):
    ``mat_a`` (M' x K, row-major; M' >= ``rows``, zero rows past them), ``mat_b`` (K x N,
    column-major), their scales and ``ScalingType`` quantizations, the swizzle of both scales (None:
    not swizzled), the kernel's output dtype, and ``alpha``: what multiplies the FP32 product
    afterwards (NVFP4's two per-tensor scales), or None."""

    mat_a: torch.Tensor
    mat_b: torch.Tensor
    scale_a: torch.Tensor
    recipe_a: F.ScalingType
    scale_b: torch.Tensor
    recipe_b: F.ScalingType
    swizzle: F.SwizzleType | None
    output_dtype: torch.dtype
    alpha: torch.Tensor | None
    rows: int


def scaled_mm_call(
    a: BlockQuantized, b: BlockQuantized, out_dtype: torch.dtype, fmt: str
) -> ScaledMMCall:
    """The ``scaled_mm`` arguments of ``a @ b`` (see :func:`block_gemm`): ``a`` quantized along
    its dimension 1 in 1-D blocks, ``b`` along K (a weight's tiles along either: transposed
    here when needed). Pure torch (no kernel runs): the layout rules are tested on the CPU.
    Raises ValueError for operands the kernel cannot take."""
    if a.dim != 1 or a.block[0] != 1 or a.data.dim() != 2:
        raise ValueError(f"{fmt} GEMM: the left operand must be 2-D, in 1-D blocks along dim 1")
    b = _k_last(b, fmt)
    if a.data.shape[1] != b.data.shape[1]:
        raise ValueError(f"{fmt} GEMM: inner dimensions differ ({a.data.shape} and {b.data.shape})")
    if fmt == FP8_BLOCKWISE:
        return _blockwise_call(a, b, out_dtype)
    if fmt == MXFP8:
        return _mx_call(a, b, out_dtype)
    if fmt == NVFP4:
        return _nvfp4_call(a, b)
    raise ValueError(f"{fmt!r} is not a block-scaled format with a real GEMM")


def _k_last(b: BlockQuantized, fmt: str) -> BlockQuantized:
    """``b`` (standing for K x N) with K last in its data: as quantized when it was quantized
    along K (``dim`` 0); a tiled weight quantized along N is transposed (its tiles, hence its
    values, are the same either way)."""
    if b.data.dim() != 2:
        raise ValueError(f"{fmt} GEMM: the right operand must be 2-D")
    if b.dim == 0:
        return b
    if b.block[0] == 1:
        raise ValueError(f"{fmt} GEMM: the right operand's blocks lie along N, not K")
    if b.data.dtype == torch.uint8:  # FP4 codes, two per byte along the last dimension
        data = e2m1.pack(e2m1.unpack(b.data).t().contiguous())
    else:
        data = b.data.t().contiguous()
    return replace(b, data=data, scale=b.scale.t().contiguous(), dim=0)


def _gemm_out(out_dtype: torch.dtype) -> torch.dtype:
    """The kernel's output dtype for ``out_dtype``: BF16 and FP32 directly (one rounding of the
    FP32 sum, as the emulation), anything else through FP32."""
    return out_dtype if out_dtype in (torch.bfloat16, torch.float32) else torch.float32


def _blockwise_call(a: BlockQuantized, b: BlockQuantized, out_dtype: torch.dtype) -> ScaledMMCall:
    """torch's DeepSeek quantization: ``a`` 1x128 with its (M, K/128) scales M-major (strides (1, M));
    ``b`` 128x128 with its scales as (round_up(K/128, 4), N/128), strides (1, that) (cuBLAS's
    K-major layout, padding ones unread), or 1x128 with (N, K/128) scales N-major."""
    if a.data.dtype != E4M3 or b.data.dtype != E4M3:
        raise ValueError(
            f"blockwise FP8 GEMM: E4M3 operands only, got {a.data.dtype} and {b.data.dtype}"
        )
    rows = a.data.shape[0]
    extra = -rows % BLOCKWISE_ROW_ALIGNMENT
    mat_a, scale_a = a.data, a.scale
    if extra:  # zero elements; scale 1 (any finite value: the elements are zero)
        mat_a = torch.cat([mat_a, mat_a.new_zeros(extra, mat_a.shape[1])])
        scale_a = torch.cat([scale_a, scale_a.new_ones(extra, scale_a.shape[1])])
    if b.block[0] == 1:
        scale_b, recipe_b = _outer_major(b.scale), F.ScalingType.BlockWise1x128
    else:
        k_blocks = b.scale.shape[1]
        padded = b.scale.new_ones(b.scale.shape[0], k_blocks + -k_blocks % 4)
        padded[:, :k_blocks] = b.scale
        scale_b, recipe_b = padded.t(), F.ScalingType.BlockWise128x128
    return ScaledMMCall(
        mat_a, b.data.t(), _outer_major(scale_a), F.ScalingType.BlockWise1x128, scale_b,
        recipe_b, None, _gemm_out(out_dtype), None, rows,
    )  # fmt: skip


def _outer_major(scale: torch.Tensor) -> torch.Tensor:
    """A (rows, K/128) scale stored rows-fastest (strides (1, rows)): "outer-dim-major"."""
    return scale.t().contiguous().t()


def _mx_call(a: BlockQuantized, b: BlockQuantized, out_dtype: torch.dtype) -> ScaledMMCall:
    """MXFP8: E4M3 elements, (rows, K/32) E8M0 scales swizzled (:func:`to_blocked`)."""
    if a.data.dtype != E4M3 or b.data.dtype != E4M3:
        raise ValueError(f"MXFP8 GEMM: E4M3 operands only, got {a.data.dtype} and {b.data.dtype}")
    return ScaledMMCall(
        a.data, b.data.t(), to_blocked(a.scale), F.ScalingType.BlockWise1x32,
        to_blocked(b.scale), F.ScalingType.BlockWise1x32, F.SwizzleType.SWIZZLE_32_4_4,
        _gemm_out(out_dtype), None, a.data.shape[0],
    )  # fmt: skip


def _nvfp4_call(a: BlockQuantized, b: BlockQuantized) -> ScaledMMCall:
    """NVFP4: packed E2M1 elements, (rows, K/16) E4M3 block scales swizzled (a weight's 16x16
    tile scales repeated down their 16 rows), FP32 output times the per-tensor scales."""
    if a.data.dtype != torch.uint8 or b.data.dtype != torch.uint8:
        raise ValueError(f"NVFP4 GEMM: packed E2M1 operands only, got {a.data.dtype}")
    scales = [q.scale.repeat_interleave(q.block[0], dim=0) for q in (a, b)]
    tensor_scales = [q.tensor_scale for q in (a, b) if q.tensor_scale is not None]
    alpha = None
    if tensor_scales:
        alpha = tensor_scales[0] * tensor_scales[1] if len(tensor_scales) == 2 else tensor_scales[0]
    fp4 = torch.float4_e2m1fn_x2
    return ScaledMMCall(
        a.data.view(fp4), b.data.view(fp4).t(), to_blocked(scales[0]),
        F.ScalingType.BlockWise1x16, to_blocked(scales[1]), F.ScalingType.BlockWise1x16,
        F.SwizzleType.SWIZZLE_32_4_4, torch.float32, alpha, a.data.shape[0],
    )  # fmt: skip


def to_blocked(scale: torch.Tensor) -> torch.Tensor:
    """A (rows, cols) block-scale matrix in cuBLAS's swizzled layout (SWIZZLE_32_4_4, "1D block
    scaling factors layout"), flattened: padded with zeros to whole tiles of 128 rows x 4
    columns; in each tile, row r = 32 i + j (i < 4, j < 32) and column c land at
    ``j * 16 + i * 4 + c``; tiles follow one another row of tiles by row of tiles. Equal to
    torchao's ``mx_formats.utils.to_blocked`` (tests/precision/test_block_gemm.py)."""
    rows, cols = scale.shape
    row_tiles, col_tiles = -(-rows // TILE_ROWS), -(-cols // TILE_COLS)
    padded = scale.new_zeros(row_tiles * TILE_ROWS, col_tiles * TILE_COLS)
    padded[:rows, :cols] = scale
    # (row tile, i, j, col tile, c) -> (row tile, col tile, j, i, c)
    tiles = padded.view(row_tiles, 4, TILE_ROWS // 4, col_tiles, TILE_COLS)
    return tiles.permute(0, 3, 2, 1, 4).reshape(-1)
