"""The runs of ``python3 -m benchmarks.gpu_all``: one row per step, what it measures, its limit and
estimate (seconds on an H200; BENCHMARKS.md), what it writes. benchmarks/gpu_all.py runs them.

Steps, in order of value per second; ``setup`` comes first (benchmarks/gpu_setup.py):

1. ``nvidia_smi``: the GPU, its driver and clocks.
2. ``fp8_check``: benchmarks/gpu_fp8_check.py: the ``_scaled_mm``-vs-emulation verdict first
   (the block-scaled GEMMs the GPU has included: blockwise FP8 on SM90, MXFP8/NVFP4 on SM100),
   forward GEMM speed (accurate and fast accumulation), then FP8 vs BF16 training, eager and
   compiled (graph breaks counted).
3. ``speed_table``: benchmarks/gpu_speed.py: the contention-free speed table, mptrain's GPT and
   ResNet-50 x FP32/TF32/FP16/BF16/FP8 (tensorwise, rowwise) x compile off/on through mptrain's
   own loop, every eager cell first, then the compiled ones by value, within its own budget
   (``--speed-s`` less SPEED_MARGIN_S); the cells it had no time for are listed as not run. It
   writes ``speed_table.json`` and ``speed_table.md`` (the table to paste into BENCHMARKS.md)
   after every cell.
4. ``pytest_gpu``: ``pytest -v -m gpu`` on the test files that hold GPU tests (:func:`pytest_argv`).
   Those files import what the image lacks (torchao, the test extra) only through
   ``pytest.importorskip`` inside a test; tests/e2e/test_gpu_image.py rehearses the image. On the
   GPU a pytest step in which no test passed (all skipped) counts as failed.
5. Optional, on the time the planned steps left: ``imagefolder_train`` (ResNet-50 BF16 through
   ``dataset=imagefolder`` on 4096 generated JPEGs: PIL in 14 persistent workers vs
   ``dataset.decode_device=cuda``), ``collect_env`` (``python -m torch.utils.collect_env``),
   ``resnet50`` (gpu_resnet50.py with its cudnn.benchmark row, batch 256, 30 steps after 10),
   ``gpt`` (gpu_gpt.py: tokens/s and MFU over a longer window than the table's) and ``data_path``
   (data_path.py ``--device cuda --device-decode``: the data path alone, no model).

The planned steps' limits, setup's included, add up to BUDGET_S, so no step is starved by the
ones before it; the optional ones run only on the time the others left unused. A step starts only
when at least MIN_SHARE of its estimate is left. ``smoke``: the same steps, tiny, on a CPU.
Standard library only: this runs before mptrain's dependencies exist.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEVICE_TIMEOUT_S = 540  # the device tool's timeout_s for the whole command (at most 600)
BUDGET_S = 510.0  # ~30 s of DEVICE_TIMEOUT_S left for the summary and the bundle
SMOKE_BUDGET_S = 240.0  # under tests/e2e/test_benchmarks.py's 300 s for the whole smoke run
SETUP_S, SETUP_ESTIMATE_S = 45.0, 20.0  # import check, offline install of 3 wheels, check again
SPEED_S = 165.0  # the speed table's limit (--speed-s): what the plan leaves it
SPEED_MARGIN_S = 20.0  # of its limit, for its imports and last write before gpu_all's SIGINT
# The GPU tests: 54 collect, 29 of them run on SM90 (the others need SM100's block-scaled GEMMs
# or two GPUs); among them an inductor-compiled ResNet-18 (~60 s alone) and five short trainings.
PYTEST_S, PYTEST_ESTIMATE_S = 180.0, 140.0
TEST_TIMEOUT_S = 90  # per GPU test (pytest-timeout): the inductor-compiled ResNet-18 is longest
MIN_SHARE = 0.5  # a step starts only with at least this share of its estimate left


@dataclass
class Step:
    """One command of the run: ``argv`` with ``timeout_s`` (cut to the budget left), expected to
    take ``estimate_s``; started only when at least :meth:`start_s` of the budget is left.
    ``optional`` steps are outside the planned budget (they run on time left unused)."""

    name: str
    argv: list[str]
    timeout_s: float
    what: str
    json_out: str | None = None  # the document it writes, read whatever its status
    estimate_s: float = 10.0
    optional: bool = False
    skip: str | None = None  # why it is not run at all (a smoke run's missing nvidia-smi)
    must_pass: bool = False  # a pytest step that fails unless at least one test passed
    junit: str | None = None  # a pytest step's JUnit XML (file name in the output directory)
    min_s: float | None = None  # default: MIN_SHARE x estimate_s

    def start_s(self) -> float:
        return MIN_SHARE * self.estimate_s if self.min_s is None else self.min_s


# Each script's arguments on the GPU (its defaults where none: the check as designed, every cell).
GPU_ARGS: dict[str, list[str]] = {
    "resnet50": ["--batch", "256", "--steps", "30", "--warmup", "10"],
    "imagefolder_train": [
        "--images", "4096", "--workers", "14", "--jobs", "14", "--batch", "256", "--steps", "30",
        "--warmup", "10", "--precision", "bf16",
    ],
    "data_path": [
        "--device", "cuda", "--workers", "14", "--images", "1024", "--reps", "2", "--epochs", "2",
        "--batch-size", "128",
    ],
}  # fmt: skip
# ... and in a smoke run, on a CPU: tiny sizes, seconds each.
SMOKE_ARGS: dict[str, list[str]] = {
    "fp8_check": [
        "--device", "cpu", "--gemm-shapes", "64x128x256", "--steps", "4", "--warmup", "2",
        "--batch", "64", "--width", "64", "--variants", "bf16,fp8,fp8_rowwise,fp8_rowwise_compiled",
        "--compile-backend", "aot_eager",  # the compiled code path without inductor's wait
        "--speed-shapes", "64x128x256", "--speed-repeats", "2",
    ],
    "speed_table": [  # two precisions (ResNet-50 refuses FP8); compiled: the GPT only
        "--device", "cpu", "--precisions", "fp32,fp8_rowwise", "--compile-backend", "aot_eager",
        "--compile-models", "gpt",  # compiling ResNet-50, even with aot_eager: ~15 s
    ],
    "gpt": ["--device", "cpu", "--precisions", "fp32,fp8"],  # tiny CPU sizes; FP8 emulated
    "resnet50": [
        "--device", "cpu", "--batch", "2", "--image-size", "32", "--steps", "1", "--warmup", "1",
        "--precisions", "fp32,bf16",
    ],
    "imagefolder_train": [
        "--device", "cpu", "--images", "16", "--image-size", "32", "--batch", "4", "--steps", "2",
        "--warmup", "1", "--workers", "1", "--jobs", "2", "--precision", "fp32", "--model", "cnn",
    ],
    "data_path": [
        "--workers", "1", "--images", "12", "--image-size", "32", "--reps", "1", "--epochs", "1",
        "--batch-size", "4",
    ],
}  # fmt: skip


def plan(
    python: str, out: Path, smoke: bool, test_timeout_s: int | None, speed_s: float = SPEED_S
) -> list[Step]:
    """The steps after setup, in order (the module docstring): name, argv, limit, what it
    measures, the document it writes, estimate. ``speed_s``: the speed table's limit, its own
    budget SPEED_MARGIN_S less (it stops its cells within it)."""
    sizes = SMOKE_ARGS if smoke else GPU_ARGS
    no_smi = (
        "CPU smoke run, no nvidia-smi here" if smoke and not shutil.which("nvidia-smi") else None
    )
    tests = ["-m", "gpu", *gpu_test_files()]
    speed_budget = ["--budget-s", f"{speed_s - SPEED_MARGIN_S:.0f}"]

    def bench(name: str, module: str, limit: float, estimate: float, what: str, *extra: str,
              optional: bool = False) -> Step:  # fmt: skip
        argv = script(
            python, module, *sizes.get(name, []), *extra, "--out", str(out / f"{name}.json")
        )
        return Step(name, argv, limit, what, f"{name}.json", estimate, optional)

    return [
        Step("nvidia_smi", ["nvidia-smi"], 10, "the GPU, its driver and clocks", estimate_s=2,
             skip=no_smi),
        bench("fp8_check", "gpu_fp8_check", 110, 80,
              "FP8 GEMMs vs emulation (tensorwise, rowwise; block-scaled where the GPU has "
              "them), forward GEMM speed; FP8 vs BF16 training, eager and compiled"),
        bench("speed_table", "gpu_speed", speed_s, speed_s - SPEED_MARGIN_S / 2,
              "GPT and ResNet-50 x precision x compile off/on: samples/s, tokens/s, memory",
              *speed_budget),
        Step("pytest_gpu", pytest_argv(python, out / "pytest_gpu.xml", tests, test_timeout_s),
             PYTEST_S, "pytest -m gpu", estimate_s=PYTEST_ESTIMATE_S, must_pass=not smoke,
             junit="pytest_gpu.xml"),
        bench("imagefolder_train", "imagefolder_train", 65, 45,
              "training through imagefolder: PIL workers vs device decode", optional=True),
        Step("collect_env", [python, "-m", "torch.utils.collect_env"], 30, "torch's environment",
             estimate_s=10, optional=True),
        bench("resnet50", "gpu_resnet50", 65, 50,
              "ResNet-50 per precision, synthetic data (+ cudnn.benchmark)", optional=True),
        bench("gpt", "gpu_gpt", 65, 50, "GPT language model per precision: tokens/s, MFU",
              optional=True),
        Step("data_path", script(python, "data_path", *sizes["data_path"], "--device-decode",
             "--json", str(out / "data_path.json")), 60, "data path alone: old/new/device decode",
             "data_path.json", 40, optional=True),
    ]  # fmt: skip


def script(python: str, module: str, *args: str) -> list[str]:
    """``python -m benchmarks.MODULE args``: run in the repository root (:func:`child_env`)."""
    return [python, "-m", f"benchmarks.{module}", *args]


def pytest_argv(python: str, junit: Path, args: list[str], test_timeout_s: int | None) -> list[str]:
    """pytest with ``-v`` (each test's name and outcome in the log, whatever becomes of the XML),
    its JUnit XML, and pytest-timeout's per-test limit when ``test_timeout_s`` (plugin found).
    In one process: the project's addopts (pyproject.toml) ask for two pytest-xdist workers,
    which the GPU image may lack and which would share the one GPU, so they are replaced.
    ``--continue-on-collection-errors``: pytest's default stops the whole run at one file that
    fails to import ("Interrupted: 1 error during collection"), and the shot is too dear for that."""
    limit = ["-p", "timeout", f"--timeout={test_timeout_s}"] if test_timeout_s else []
    return [
        python, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-o", "addopts=--strict-markers",
        "--continue-on-collection-errors", *limit, f"--junitxml={junit}", *args,
    ]  # fmt: skip


def gpu_test_files() -> list[str]:
    """tests/**/test_*.py files that hold GPU-marked tests (relative to the repository root)."""
    return sorted(
        str(path.relative_to(REPO))
        for path in (REPO / "tests").rglob("test_*.py")
        if "mark.gpu" in path.read_text()
    )


def child_env() -> dict[str, str]:
    """Every step's environment: this checkout first on PYTHONPATH (mptrain and the benchmarks
    package from here), unbuffered output."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("HYDRA_FULL_ERROR", None)
    return env
