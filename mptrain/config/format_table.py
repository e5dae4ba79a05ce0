"""Every number format mptrain computes GEMMs in, one frozen row each: the one home of a format's
facts. Config validation, the build, the report, the roofline, the GPU table, bench, advise and
the checkpoint signature read them here; a format's name is spelled as a string in this module
(and in the option list, :mod:`mptrain.config.options`) only — elsewhere it is one of the
constants below.

FP8 with per-tensor or per-row scales is one row (``fp8``): the granularity is a setting of that
format (``fp8.granularity``), its Linear and its kernel are the same. Blockwise FP8 (DeepSeek-V3's
1x128 / 128x128 tiles) is a row of its own: another Linear, another kernel, selected by
``precision=fp8 fp8.granularity=blockwise``.
"""

from __future__ import annotations

from dataclasses import dataclass

# The formats' names, as config, reports and the roofline spell them.
FP32, TF32, BF16, FP16 = "fp32", "tf32", "bf16", "fp16"
FP8, FP4 = "fp8", "fp4"  # FP8 (tensorwise/rowwise scales), and FP4: a GPU rate column only
FP8_BLOCKWISE, MXFP8, NVFP4 = "fp8_blockwise", "mxfp8", "nvfp4"


@dataclass(frozen=True)
class Kernel:
    """Where a format's GEMM runs in hardware through torch: NVIDIA compute capabilities from
    ``least`` up to (not including) ``below`` (None: every later one), with a torch built for
    CUDA ``min_cuda`` or later (cuBLAS's first with the kernel; None: any CUDA torch supports);
    ``needs``: that, in words."""

    least: tuple[int, int]
    below: tuple[int, int] | None
    min_cuda: tuple[int, int] | None
    needs: str

    def runs_on(self, capability: tuple[int, int]) -> bool:
        return self.least <= capability and (self.below is None or capability < self.below)

    @property
    def capabilities(self) -> str:
        """The capabilities with the kernel, for people: "9.x", "10.0 or later"."""
        major, minor = self.least
        if self.below == (major + 1, 0):
            return f"{major}.x"
        return f"{major}.{minor} or later"


@dataclass(frozen=True)
class NumberFormat:
    """One format: the label people read, the bytes of an element and of the GEMM's result, and
    the facts below (dtypes by torch's name: this layer imports no torch). ``peak_row``: the
    column of the GPU table (:mod:`mptrain.perf.gpus`) whose dense rate it runs at where it has a
    kernel; a format without one is emulated everywhere it is not a plain dtype. ``scale_bytes``:
    bytes of block scale per element, for a 1-D block along the reduction dimension and for a 2-D
    weight tile; ``tensor_scale_bytes``: a per-tensor scale on top (NVFP4's FP32)."""

    name: str
    label: str
    element_bytes: float
    result_bytes: float
    peak_row: str
    precision: str | None = None  # the precision option whose Linear layers compute in it
    config_group: str | None = None  # the config section whose keys set it
    elements: str | None = None  # forward operands' element dtype (gradients: the recipe's)
    scale: str | None = None  # block scale dtype
    block: int | None = None  # elements per block along the reduction dimension
    scale_bytes: tuple[float, float] = (0.0, 0.0)
    tensor_scale_bytes: int = 0
    kernel: Kernel | None = None


_BLACKWELL = "needs an NVIDIA GPU of compute capability >= 10.0 (Blackwell)"

FORMAT_TABLE: dict[str, NumberFormat] = {
    row.name: row
    for row in (
        NumberFormat(FP32, "FP32", 4, 4, FP32),
        NumberFormat(TF32, "TF32", 4, 4, TF32),  # FP32 storage, TF32 tensor-core products
        NumberFormat(BF16, "BF16", 2, 2, BF16),
        NumberFormat(FP16, "FP16", 2, 2, FP16),
        NumberFormat(
            FP8,
            "FP8",
            element_bytes=1,
            result_bytes=2,
            peak_row=FP8,
            precision=FP8,
            config_group="fp8",
            elements="float8_e4m3fn",
            scale="float32",
            kernel=Kernel((8, 9), None, None, "needs an NVIDIA GPU of compute capability >= 8.9"),
        ),  # torch._scaled_mm: Ada, Hopper and later
        # DeepSeek-V3 (arXiv 2412.19437): 1x128 tiles of activations and gradients, 128x128 of
        # weights, an FP32 scale each. torch runs its scaled_mm on SM90 only (ScaledBlas.cpp:
        # "DeepSeek style scaling only supported in CUDA for SM90"), Blackwell included.
        NumberFormat(
            FP8_BLOCKWISE,
            "blockwise FP8",
            element_bytes=1,
            result_bytes=2,
            peak_row=FP8,
            precision=FP8,
            config_group="fp8",
            elements="float8_e4m3fn",
            scale="float32",
            block=128,
            scale_bytes=(4 / 128, 4 / 128**2),
            kernel=Kernel(
                (9, 0), (10, 0), (12, 9), "needs an NVIDIA Hopper GPU (compute capability 9.x)"
            ),
        ),
        # OCP MX v1.0: E4M3 elements in blocks of 32, one E8M0 scale byte each; Blackwell's
        # tensor cores apply the scales inside the MMA (torch: BlockWise1x32, CUDA >= 12.8).
        NumberFormat(
            MXFP8,
            "MXFP8",
            element_bytes=1,
            result_bytes=2,
            peak_row=FP8,
            precision=MXFP8,
            config_group="mx",
            elements="float8_e4m3fn",
            scale="float8_e8m0fnu",
            block=32,
            scale_bytes=(1 / 32, 1 / 32),
            kernel=Kernel((10, 0), None, (12, 8), _BLACKWELL),
        ),
        # NVIDIA's NVFP4 (arXiv 2509.25149): E2M1 codes two a byte in blocks of 16 with an E4M3
        # scale each (16x16 weight tiles: one per 256), and an FP32 scale per tensor.
        NumberFormat(
            NVFP4,
            "NVFP4",
            element_bytes=0.5,
            result_bytes=2,
            peak_row=FP4,
            precision=NVFP4,
            config_group="nvfp4",
            elements="float4_e2m1fn",
            scale="float8_e4m3fn",
            block=16,
            scale_bytes=(1 / 16, 1 / 256),
            tensor_scale_bytes=4,
            kernel=Kernel((10, 0), None, (12, 8), _BLACKWELL),
        ),
    )
}
# The block-scaled formats, in the table's order (fp8_blockwise, mxfp8, nvfp4).
BLOCK_FORMATS = tuple(name for name, row in FORMAT_TABLE.items() if row.block is not None)
# The config groups one low-precision format alone reads, and the precision that reads each
# (fp8.* serves tensorwise, rowwise and blockwise FP8 alike).
PRECISION_OF_GROUP = {
    row.config_group: row.precision
    for row in FORMAT_TABLE.values()
    if row.config_group is not None and row.precision is not None
}
# The other way: the config group of each precision that computes Linear layers in a format.
GROUP_OF_PRECISION = {precision: group for group, precision in PRECISION_OF_GROUP.items()}
# What one GEMM of a quantized Linear may run in (precision.gemms.*): a high-precision dtype, or a
# quantized format of the table (fp8: as fp8.* sets it).
GEMM_FORMATS = (FP32, BF16, FP8, *BLOCK_FORMATS)
