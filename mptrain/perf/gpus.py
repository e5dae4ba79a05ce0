"""What NVIDIA GPUs can do at best, by name: dense peak throughput per number format, memory
bandwidth and size, from the vendors' datasheets; and the FLOP-weighted peak that keeps model
FLOPs utilisation (MFU) defined when a step's GEMMs run in several formats.

Every figure is a **dense** one (no 2:4 sparsity). NVIDIA's datasheets print the tensor-core rates
with sparsity (marked ``*``), some beside the dense ones, and state that dense is half; this table
holds the dense figure where printed, else the half. FP32 is
the non-tensor (CUDA-core) rate, which the datasheets print dense. FP16 equals BF16 everywhere
here. Bandwidth is in GB/s (10⁹ bytes per second), memory in GB (10⁹ bytes), as printed.

Block-scaled formats (:data:`mptrain.config.format_table.BLOCK_FORMATS`) have no row of their own: a GPU whose tensor cores
(or kernels) take their block scales runs them at its element format's rate (MXFP8 at FP8's,
NVFP4 at FP4's, blockwise FP8 at FP8's on Hopper only: torch has no blockwise kernel for
Blackwell); on any other GPU they are emulated, and :meth:`GPU.peak_flops` says so rather than
giving a rate.

``advise.target`` takes a row's name or an alias (:func:`resolve_target`); ``auto`` maps
``torch.cuda.get_device_name()`` to a row (:func:`row_for_device_name`). Nothing here imports
torch: the table is data, and the mixed peak is arithmetic.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from mptrain.config.base import ConfigError
from mptrain.config.commands import TARGETS
from mptrain.config.format_table import (
    BF16,
    BLOCK_FORMATS,
    FORMAT_TABLE,
    FP4,
    FP8,
    FP16,
    FP32,
    TF32,
)

# The rate columns of the table below (a block-scaled format runs at one of them where the GPU
# has its kernel: mptrain.config.format_table, each row's ``peak_row`` and ``kernel``).
RATE_COLUMNS = (FP32, TF32, BF16, FP16, FP8, FP4)


@dataclass(frozen=True)
class GPU:
    """One GPU model and form factor: its dense peaks (TFLOP/s by format; a format it lacks is
    absent), bandwidth, memory, SM count and compute capability, and where the figures come from."""

    key: str  # what advise.target accepts: h100-sxm, a100-40gb, ...
    name: str  # for people: "NVIDIA H100 SXM5 80GB"
    form_factor: str  # SXM | PCIe | NVL (PCIe cards bridged in pairs) | PCIe card
    tflops: dict[str, float]  # dense peak by format
    bandwidth_gb_s: float
    memory_gb: float
    sms: int
    capability: tuple[int, int]
    source: str  # the document the figures are from, and how they were read
    matches: str = ""  # a regular expression on torch.cuda.get_device_name() (upper case)
    excludes: tuple[str, ...] = field(default=())  # words the device name must not hold

    def peak_flops(self, fmt: str) -> float:
        """FLOP/s of ``fmt`` at best (a block-scaled format: its element format's rate, see
        the format table's ``peak_row`` and ``kernel``); ValueError naming the GPU when it has no such format, or no
        hardware kernel for a block-scaled one (emulated there: no rate to predict)."""
        if fmt in BLOCK_FORMATS:
            element, kernel = FORMAT_TABLE[fmt].peak_row, FORMAT_TABLE[fmt].kernel
            if kernel is None or not kernel.runs_on(self.capability) or element not in self.tflops:
                have = ".".join(map(str, self.capability))
                needs = kernel.capabilities if kernel else "a kernel torch does not have"
                raise ValueError(
                    f"{self.name} has no hardware kernel for {fmt} (compute capability {have}, "
                    f"needs {needs}): emulated there, not a prediction"
                )
            fmt = element
        if fmt not in self.tflops:
            have = ", ".join(self.tflops)
            raise ValueError(f"{self.name} has no {fmt} peak (it has {have})")
        return self.tflops[fmt] * 1e12

    @property
    def bandwidth_bytes_s(self) -> float:
        return self.bandwidth_gb_s * 1e9


def _hopper(fp32: float, tf32_sparse: float, bf16_sparse: float, fp8_sparse: float) -> dict:
    """Tensor rates from a datasheet's with-sparsity column, halved to dense."""
    return {
        "fp32": fp32,
        "tf32": tf32_sparse / 2,
        "bf16": bf16_sparse / 2,
        "fp16": bf16_sparse / 2,
        "fp8": fp8_sparse / 2,
    }


H100_SHEET = "NVIDIA H100 Tensor Core GPU datasheet"
H200_SHEET = "NVIDIA H200 Tensor Core GPU datasheet"
A100_SHEET = "NVIDIA A100 Tensor Core GPU datasheet"
BLACKWELL_ULTRA_SHEET = "NVIDIA Blackwell Ultra datasheet"
HALVED = "tensor rates printed with sparsity, halved to dense"
# Every A100 form factor has the same peaks (the datasheet prints them dense and with sparsity).
A100_TFLOPS = {"fp32": 19.5, "tf32": 156, "bf16": 312, "fp16": 312}
A100_PEAKS = "FP32 19.5, TF32 156, BF16/FP16 312 TFLOPS"

GPUS: dict[str, GPU] = {
    g.key: g
    for g in (
        GPU("h100-sxm", "NVIDIA H100 SXM5 80GB", "SXM", _hopper(67, 989, 1979, 3958),
            3350, 80, 132, (9, 0),
            f"{H100_SHEET}, H100 SXM column: FP32 67, TF32 989*, BF16/FP16 1,979*, FP8 3,958* "
            f"TFLOPS, 80 GB HBM3 at 3.35 TB/s ({HALVED}: BF16 989.5 dense)",
            r"\bH100\b", ("PCIE", "NVL")),
        GPU("h100-pcie", "NVIDIA H100 PCIe 80GB", "PCIe", _hopper(51, 756, 1513, 3026),
            2000, 80, 114, (9, 0),
            f"{H100_SHEET}, H100 PCIe column: FP32 51, TF32 756*, BF16/FP16 1,513*, FP8 3,026* "
            f"TFLOPS, 80 GB HBM2e at 2 TB/s ({HALVED})",
            r"\bH100\b.*PCIE"),
        GPU("h100-nvl", "NVIDIA H100 NVL 94GB", "NVL", _hopper(60, 835, 1671, 3341),
            3900, 94, 132, (9, 0),
            f"{H100_SHEET}, H100 NVL column: FP32 60, TF32 835*, BF16/FP16 1,671*, FP8 3,341* "
            f"TFLOPS, 94 GB HBM3 at 3.9 TB/s ({HALVED})",
            r"\bH100\b.*NVL"),
        GPU("h200", "NVIDIA H200 SXM 141GB", "SXM", _hopper(67, 989, 1979, 3958),
            4800, 141, 132, (9, 0),
            f"{H200_SHEET}, H200 SXM column: FP32 67, TF32 989*, BF16/FP16 1,979*, FP8 3,958* "
            f"TFLOPS, 141 GB HBM3e at 4.8 TB/s ({HALVED})",
            r"\bH200\b", ("NVL",)),
        GPU("h200-nvl", "NVIDIA H200 NVL 141GB", "NVL", _hopper(60, 835, 1671, 3341),
            4800, 141, 132, (9, 0),
            f"{H200_SHEET}, H200 NVL column: FP32 60, TF32 835*, BF16/FP16 1,671*, FP8 3,341* "
            f"TFLOPS, 141 GB HBM3e at 4.8 TB/s ({HALVED})",
            r"\bH200\b.*NVL"),
        GPU("b200", "NVIDIA B200 180GB", "SXM",
            {**_hopper(600 / 8, 18000 / 8, 36000 / 8, 72000 / 8), "fp4": 144000 / 8 / 2},
            8000, 180, 148, (10, 0),
            "NVIDIA HGX B200 datasheet (8 GPUs): FP32 600 TFLOPS, TF32 18*, BF16/FP16 36*, "
            "FP8 72*, FP4 144* PFLOPS, 1.4 TB HBM3e at 64 TB/s; per GPU: divided by 8 "
            f"(180 GB at 8 TB/s; {HALVED})",
            r"\bB200\b"),
        GPU("b300", "NVIDIA B300 (Blackwell Ultra, HGX) 270GB", "SXM",
            {**_hopper(75, 2200, 4500, 9000), "fp4": 14000},
            7700, 270, 160, (10, 3),
            f"{BLACKWELL_ULTRA_SHEET}, individual GPU specifications, HGX B300 column: FP4 "
            "18 | 14 PFLOPS (sparse | dense), FP8/FP6 9*, FP16/BF16 4.5*, TF32 2.2* PFLOPS, FP32 "
            f"75 TFLOPS, 270 GB HBM3E at 7.7 TB/s ({HALVED}; NVIDIA's HGX page prints 144 | 108 "
            "PFLOPS FP4 for 8 GPUs, 13.5 dense each). 160 SMs: not in the datasheet",
            r"\bB300\b"),
        GPU("gb200", "NVIDIA GB200 (Blackwell, Grace Blackwell NVL72) 186GB", "NVL72",
            {**_hopper(5760 / 72, 180000 / 72, 360000 / 72, 720000 / 72), "fp4": 720000 / 72},
            8000, 186, 148, (10, 0),
            "NVIDIA GB200 NVL72 datasheet (72 GPUs): NVFP4 1,440 | 720 PFLOPS (sparse | dense), "
            "FP8/FP6 720*, FP16/BF16 360*, TF32 180* PFLOPS, FP32 5,760 TFLOPS, 13.4 TB HBM3E at "
            f"576 TB/s; per GPU: divided by 72 (186 GB at 8 TB/s; {HALVED}). SMs as B200's",
            r"\bGB200\b"),
        GPU("gb300", "NVIDIA GB300 (Blackwell Ultra, Grace Blackwell NVL72) 279GB", "NVL72",
            {**_hopper(80, 2500, 5000, 10000), "fp4": 15000},
            8000, 279, 160, (10, 3),
            f"{BLACKWELL_ULTRA_SHEET}, individual GPU specifications, GB300 column: FP4 "
            "20 | 15 PFLOPS (sparse | dense), FP8/FP6 10*, FP16/BF16 5*, TF32 2.5* PFLOPS, FP32 "
            f"80 TFLOPS, 279 GB HBM3E at 8 TB/s ({HALVED}). SMs as B300's",
            r"\bGB300\b"),
        GPU("a100", "NVIDIA A100 SXM4 80GB", "SXM",
            A100_TFLOPS, 2039, 80, 108, (8, 0),
            f"{A100_SHEET}, A100 80GB SXM column: {A100_PEAKS} (dense; 312*/624* with "
            "sparsity), 80 GB HBM2e at 2,039 GB/s",
            r"\bA100\b", ("40GB", "PCIE")),
        GPU("a100-40gb", "NVIDIA A100 40GB (SXM4 or PCIe)", "SXM or PCIe",
            A100_TFLOPS, 1555, 40, 108, (8, 0),
            f"{A100_SHEET}, A100 40GB columns (PCIe and SXM alike): {A100_PEAKS} (dense), "
            "40 GB HBM2 at 1,555 GB/s",
            r"\bA100\b.*40GB"),
        GPU("a100-pcie", "NVIDIA A100 PCIe 80GB", "PCIe",
            A100_TFLOPS, 1935, 80, 108, (8, 0),
            f"{A100_SHEET}, A100 80GB PCIe column: {A100_PEAKS} (dense), 80 GB HBM2e at "
            "1,935 GB/s",
            r"\bA100\b.*PCIE", ("40GB",)),
        GPU("l4", "NVIDIA L4 24GB", "PCIe card", _hopper(30.3, 120, 242, 485),
            300, 24, 58, (8, 9),
            "NVIDIA L4 Tensor Core GPU datasheet: FP32 30.3, TF32 120*, BF16/FP16 242*, "
            f"FP8 485* TFLOPS, 24 GB GDDR6 at 300 GB/s ({HALVED})",
            r"\bL4\b"),
        GPU("l40s", "NVIDIA L40S 48GB", "PCIe card",
            {"fp32": 91.6, "tf32": 183, "bf16": 362.05, "fp16": 362.05, "fp8": 733},
            864, 48, 142, (8, 9),
            "NVIDIA L40S GPU datasheet: FP32 91.6, TF32 183, BF16/FP16 362.05, FP8 733 TFLOPS "
            "dense (366*, 733*, 1,466* with sparsity), 48 GB GDDR6 at 864 GB/s",
            r"\bL40S\b"),
        GPU("rtx4090", "NVIDIA GeForce RTX 4090 24GB", "PCIe card",
            {"fp32": 82.6, "tf32": 82.6, "bf16": 165.2, "fp16": 165.2, "fp8": 330.3},
            1008, 24, 128, (8, 9),
            "NVIDIA Ada Lovelace GPU Architecture whitepaper, appendix (GeForce RTX 4090): FP32 "
            "82.6, TF32 tensor 82.6, FP16/BF16 tensor with FP32 accumulate 165.2, FP8 tensor "
            "with FP32 accumulate 330.3 TFLOPS dense (training accumulates in FP32; GeForce "
            "halves that rate), 24 GB GDDR6X at 1,008 GB/s",
            r"\bRTX 4090\b"),
    )
}  # fmt: skip
ALIASES = {"h100": "h100-sxm", "h200-sxm": "h200", "a100-sxm": "a100", "a100-80gb": "a100"}
AUTO, NONE = "auto", "none"


def accepted_names() -> list[str]:
    """Every name ``advise.target`` takes: the rows, their aliases, auto and none (the
    config's :data:`~mptrain.config.commands.GPU_TARGETS`)."""
    return [*GPUS, *ALIASES, AUTO, NONE]


def row(name: str) -> GPU:
    """The row ``name`` (a key or an alias, any case); ConfigError in one line listing the
    accepted names (auto and none name no row)."""
    TARGETS.check("advise.target", name)
    key = ALIASES.get(name.lower(), name.lower())
    if key not in GPUS:
        raise ConfigError(f"{name!r} names no GPU: one of {', '.join(GPUS)}")
    return GPUS[key]


def row_for_device_name(device_name: str) -> GPU | None:
    """The row whose pattern matches ``device_name`` (``torch.cuda.get_device_name()``, e.g.
    ``NVIDIA H100 80GB HBM3``); None when no row does. A row excluded by a word (PCIe, NVL,
    40GB) leaves the name to the row that names that word."""
    upper = device_name.upper()
    for gpu in GPUS.values():
        if re.search(gpu.matches, upper) and not any(word in upper for word in gpu.excludes):
            return gpu
    return None


def resolve_target(name: str, device_name: str | None) -> tuple[GPU | None, str]:
    """What ``advise.target=name`` predicts for: (the row or None, a line saying why).

    ``none``: no prediction. ``auto``: the GPU advise runs on (``device_name``; None on a CPU,
    where there is no prediction), or no prediction with the reason when the table does not know
    that GPU. Any other name: its row, or ConfigError listing the accepted names."""
    lowered = name.lower()
    if lowered == NONE:
        return None, "advise.target=none: no prediction"
    if lowered == AUTO:
        if device_name is None:
            return None, "advise.target=auto on a CPU: no prediction (name a GPU to get one)"
        gpu = row_for_device_name(device_name)
        if gpu is None:
            return None, (
                f"advise.target=auto: the table does not know the GPU {device_name!r}; "
                f"name one of {', '.join(GPUS)}"
            )
        return gpu, f"advise.target=auto: {device_name} is {gpu.name}"
    gpu = row(name)
    return gpu, f"advise.target={name}: {gpu.name}"


# ------------------------------------------------------------------------------ mixed peak
def mixed_peak_flops(flops_by_format: Mapping[str, float], gpu: GPU) -> float:
    """The FLOP-weighted peak of a step whose GEMMs do ``flops_by_format[f]`` FLOPs in format
    ``f``: the rate at which the GPU would do that mix with every GEMM at its format's peak,

        Σ flops_f / Σ (flops_f / peak_f),

    the harmonic mean of the peaks weighted by FLOPs. One format: that format's peak; FP8 and
    BF16 half and half: 2 / (1/fp8 + 1/bf16). ValueError when there are no FLOPs or the GPU lacks
    a format that has some."""
    used = {fmt: flops for fmt, flops in flops_by_format.items() if flops > 0}
    if not used:
        raise ValueError("no GEMM FLOPs: a peak needs at least one GEMM")
    seconds = sum(flops / gpu.peak_flops(fmt) for fmt, flops in used.items())
    return sum(used.values()) / seconds
