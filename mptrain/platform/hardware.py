"""What this machine is: device selection, CPU/GPU capabilities and software versions, and the
device-side helpers of measurement (synchronisation, peak memory).

Everything else here is read-only inspection. Capability queries are small functions so tests can replace
them (the way torchtune tests hardware paths on CPU): :func:`cpu_has_native_bf16` and
:func:`cuda_capability`.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import platform
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import torch

from mptrain.config.base import ConfigError

# In-memory data (tensors, token streams) larger than this stays in host memory instead of being
# copied to the GPU once at the start.
MAX_DEVICE_RESIDENT_BYTES = 2 << 30


# torch logs this once, importing torch.utils.cpp_extension (inductor does when compile=true builds
# its C++ kernels for the CPU), on a machine with a CUDA toolkit (nvcc, CUDA_HOME) but no CUDA
# runtime: nothing a CPU run uses.
_CPP_EXTENSION_LOGGER = "torch.utils.cpp_extension"
_NO_CUDA_RUNTIME = "No CUDA runtime is found, using CUDA_HOME="


def _drop_no_cuda_runtime(record: logging.LogRecord) -> bool:
    """A logging filter: drops torch's ``No CUDA runtime is found, using CUDA_HOME=...`` notice."""
    return not str(record.msg).startswith(_NO_CUDA_RUNTIME)


def resolve_device(requested: str) -> torch.device:
    """Turn ``device`` (auto | cpu | cuda | cuda:N) into a torch.device, or raise ConfigError.
    A CPU device without a CUDA runtime drops torch's CUDA_HOME notice (``_NO_CUDA_RUNTIME``)
    for the rest of the process; every other record of that logger still shows."""
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    if requested.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError(
                f"device={requested!r}: no CUDA device is visible; use device=cpu or auto"
            )
        device = torch.device(requested)
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(
                f"device={requested!r}: only {torch.cuda.device_count()} CUDA device(s) are visible"
            )
        return device
    if not torch.cuda.is_available():  # torch never logs the notice where CUDA is available
        logging.getLogger(_CPP_EXTENSION_LOGGER).addFilter(_drop_no_cuda_runtime)  # added once
    return torch.device("cpu")


def _cpuinfo(field: str) -> str | None:
    """The value of /proc/cpuinfo's first ``field`` line; None where there is none (or no file)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return None
    return next((line.split(":", 1)[1] for line in lines if line.startswith(field)), None)


@cache
def cpu_flags() -> frozenset[str]:
    """CPU feature flags from /proc/cpuinfo (empty where that file does not exist)."""
    return frozenset((_cpuinfo("flags") or "").split())


def cpu_model_name() -> str:
    """The CPU's marketing name from /proc/cpuinfo, else what ``platform`` knows."""
    name = _cpuinfo("model name")
    return name.strip() if name is not None else platform.processor() or platform.machine()


def cpu_has_native_bf16() -> bool:
    """True when the CPU executes BF16 dot products in hardware (AVX512-BF16 or AMX-BF16)."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def cuda_capability(device: torch.device) -> tuple[int, int]:
    """(major, minor) compute capability of a CUDA device; tests replace it to fake a GPU."""
    return torch.cuda.get_device_capability(device)


def cuda_has_native_bf16(device: torch.device) -> bool:
    """BF16 tensor cores arrived with Ampere (compute capability 8.0)."""
    return cuda_capability(device) >= (8, 0)


def _command_output(args: list[str], timeout: float) -> str | None:
    """Standard output of the command ``args``; None when it cannot start, exits non-zero or
    runs longer than ``timeout`` seconds."""
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=timeout, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout


def _cuda_driver_version() -> str | None:
    """The NVIDIA driver version nvidia-smi reports for the first GPU; None without nvidia-smi."""
    out = _command_output(
        ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], timeout=10
    )
    return out.strip().splitlines()[0] if out and out.strip() else None


def hardware_info(device: torch.device) -> dict[str, Any]:
    """CPU model and features always; GPU name, capability, memory and driver on CUDA devices."""
    flags = cpu_flags()
    info: dict[str, Any] = {
        "device": str(device),
        "cpu": {
            "model": cpu_model_name(),
            "logical_cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "avx512_bf16": "avx512_bf16" in flags,
            "amx_bf16": "amx_bf16" in flags,
            "avx512_fp16": "avx512_fp16" in flags,
            "native_bf16": cpu_has_native_bf16(),
        },
        "gpu": None,
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info["gpu"] = {
            "name": props.name,
            "compute_capability": f"{props.major}.{props.minor}",
            "memory_bytes": props.total_memory,
            "count": torch.cuda.device_count(),
            "driver": _cuda_driver_version(),
        }
    return info


def _package_version(name: str) -> str | None:
    """The installed version of distribution ``name``; None when it is not installed."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git_commit() -> str | None:
    """The commit of the mptrain source tree when it is a git checkout (editable installs).

    None for an installed wheel, even one inside some other repository's virtual environment.
    """
    source_dir = Path(__file__).resolve().parents[1]  # the mptrain package
    git = ["git", "-C", str(source_dir)]
    top = _command_output([*git, "rev-parse", "--show-toplevel"], timeout=5)
    if top is None or Path(top.strip()).resolve() != source_dir.parent:
        return None
    head = _command_output([*git, "rev-parse", "HEAD"], timeout=5)
    if head is None:
        return None
    dirty = _command_output([*git, "status", "--porcelain", "--untracked-files=no"], timeout=5)
    if dirty is None:
        return None
    return head.strip() + ("-dirty" if dirty.strip() else "")


def software_versions() -> dict[str, Any]:
    """Versions of Python, torch and friends, CUDA/cuDNN, mptrain and its git commit, and the OS."""
    import mptrain

    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torchvision": _package_version("torchvision"),
        "cuda": torch.version.cuda,
        "cudnn": cudnn,
        "hydra-core": _package_version("hydra-core"),
        "omegaconf": _package_version("omegaconf"),
        "mptrain": mptrain.__version__,
        "git_commit": _git_commit(),
        "platform": platform.platform(),
    }


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued kernels (CUDA); a no-op on the CPU, which runs eagerly. Timers
    call it at their start and stop so an interval covers the kernels, not just their launch."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak_memory(device: torch.device) -> str:
    """Start a fresh peak-memory measurement; return what will be measured.

    CUDA: the caching allocator's max allocated bytes. CPU: the process's peak resident set size
    (VmHWM), reset through /proc/self/clear_refs where the kernel allows it; otherwise the peak
    covers the whole process lifetime (say so in the report).
    """
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return "cuda_max_allocated"
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return "cpu_peak_rss_since_run_start"
    except OSError:
        return "cpu_peak_rss_since_process_start"


def peak_memory_bytes(device: torch.device) -> int | None:
    """The peak :func:`reset_peak_memory` started measuring, in bytes (CUDA allocator or CPU RSS)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux
