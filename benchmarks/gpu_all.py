"""Every GPU check of mptrain in one command, for the one shot a lent H200 gives (~8.5 min).

    python3 benchmarks/gpu_all.py [--out DIR] [--budget-s 510] [--skip-install] [--wheels DIR]
        [--pip-install] [--only STEP,...] [--python PYTHON] [--[no-]bundle] [--speed-s 165]
    python3 benchmarks/gpu_all.py --smoke [--out DIR]      # the same steps, tiny, on a CPU
    python3 benchmarks/gpu_all.py --fetch-wheels .whl      # beforehand, where PyPI is reachable

The device tool lends 15 minutes of device time per session, the machine's start (a few minutes)
included, at most 600 s per command: run this as one command with ``timeout_s`` 540
(DEVICE_TIMEOUT_S). ``--budget-s`` (default 510) counts from the start, setup included, and
leaves ~30 s of those 540 for the summary and the bundle. The planned steps' limits add up to the
budget, so no step is starved by the ones before it; the optional steps at the end run only on
the time the others left unused. Steps, in order of value per second (each a subprocess with its
own limit, cut to what is left of the budget; a step starts only when at least MIN_SHARE of its
estimate is left; BENCHMARKS.md has the limits and estimates):

1. ``setup``: checks that ``--python`` imports torch, torchvision, hydra, omegaconf and mptrain
   (this checkout, through PYTHONPATH) and, on the GPU, that CUDA is available. When an import
   fails (and no ``--skip-install``): installs the wheels in ``--wheels`` offline (``pip install
   --no-index``), or with ``--pip-install`` runs ``pip install -e ".[test]"`` (a registry is
   needed). Without either it fails at once, printing the two commands that carry the wheels.
   When setup fails, no other step runs: summary.md says so.
2. ``nvidia_smi``: the GPU, its driver and clocks.
3. ``fp8_check``: benchmarks/gpu_fp8_check.py: the ``_scaled_mm``-vs-emulation verdict first
   (the block-scaled GEMMs the GPU has included: blockwise FP8 on SM90, MXFP8/NVFP4 on SM100),
   forward GEMM speed (accurate and fast accumulation), then FP8 vs BF16 training, eager and
   compiled (graph breaks counted).
4. ``speed_table``: benchmarks/gpu_speed.py: the contention-free speed table, mptrain's GPT and
   ResNet-50 x FP32/TF32/FP16/BF16/FP8 (tensorwise, rowwise) x compile off/on through mptrain's
   own loop, every eager cell first, then the compiled ones by value, within its own budget
   (``--speed-s`` less SPEED_MARGIN_S); the cells it had no time for are listed as not run. It
   writes ``speed_table.json`` and ``speed_table.md`` (the table to paste into BENCHMARKS.md)
   after every cell.
5. ``pytest_gpu``: ``pytest -v -m gpu`` on the test files that hold GPU tests, with
   ``--continue-on-collection-errors`` (a file that fails to import costs its own tests, never
   the others') and pytest-timeout's limit per test (TEST_TIMEOUT_S) where the plugin is
   installed. Those files import what the image lacks (torchao, the test extra) only through
   ``pytest.importorskip`` inside a test; tests/e2e/test_gpu_image.py rehearses the image (below).
   On the GPU a pytest step in which no test passed (all skipped) counts as failed.
6. Optional, on the time the planned steps left: ``imagefolder_train``
   (benchmarks/imagefolder_train.py, ResNet-50 BF16 through ``dataset=imagefolder`` on 4096
   generated JPEGs: PIL in 14 persistent workers vs ``dataset.decode_device=cuda``),
   ``collect_env`` (``python -m torch.utils.collect_env``), ``resnet50`` (gpu_resnet50.py with
   its cudnn.benchmark row, batch 256, 30 steps after 10), ``gpt`` (gpu_gpt.py: tokens/s and MFU
   over a longer window than the table's) and ``data_path`` (benchmarks/data_path.py ``--device
   cuda --device-decode``: the data path alone, no model).

A step over its limit gets SIGINT (pytest then writes its JUnit XML; the scripts have their JSON
on disk already), SIGTERM halfway through KILL_GRACE_S, SIGKILL at its limit, all to its process
group; it is reported as timed out and the next one runs. Every step's JSON document is read
whatever its status (``partial`` unless the step ended ok; each script rewrites it atomically
after every row). ``summary.json`` and ``summary.md`` are rewritten after every step, and when the
driver gets SIGTERM or SIGINT (the device tool's limit, a person): the running step's process
group is stopped, its partial figures read, the summary written and bundled, exit 143 (130).

Written into ``--out`` (default: ``$OUT`` when set, else benchmarks/results/gpu_<date>_<time>):
each step's combined stdout/stderr (``<step>.log``), the scripts' JSON documents
(``<step>.json``), pytest's JUnit XML, ``summary.json`` (every step's exit code, wall time, JSON
document and, for pytest, every test's outcome) and ``summary.md`` (the steps table, headline
figures with the speed table, every GPU test by name with its outcome, the tail of each failed
step's log). With ``--bundle`` (the default when the directory is ``$OUT``, whose files come back
only eight at a time) every file but the two summaries and ``speed_table.md`` is packed into
``gpu_all_files.tar.gz`` at the end.

On the H200 lent to these sessions: python3 there holds torch (a CUDA build), torchvision,
pytest, pytest-timeout, pillow and rich but not hydra-core, omegaconf or antlr4-python3-runtime,
and no package registry is reachable. So first, here: ``python3 benchmarks/gpu_all.py
--fetch-wheels .whl`` (.whl/ is git-ignored), then there: the device tool's run with command
``python3 benchmarks/gpu_all.py``, ``carry=[".whl"]`` and ``timeout_s`` 540.

Rehearse the image here: ``PYTHONPATH=benchmarks/gpu_image`` makes every package the image lacks
unimportable (benchmarks/gpu_image/sitecustomize.py); tests/e2e/test_gpu_image.py runs the pytest
step's command (``--collect-only``) and the scripts' smoke runs that way.

``--smoke`` runs every step on the CPU with tiny sizes (``--device cpu`` modes of the scripts; the
pytest step's CUDA tests skip): tests/e2e/test_benchmarks.py runs it, so this driver is known to work
before GPU time is spent on it. Exit code: 0 when every step that ran succeeded, else 1.
This file imports only the standard library (and benchmarks/jsondoc.py, which does too): it runs
before mptrain's dependencies exist.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import traceback
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path

from jsondoc import first_line, write_json, write_text  # benchmarks/ is on sys.path

REPO = Path(__file__).resolve().parent.parent
BENCHMARKS = REPO / "benchmarks"
IMPORTS = "import torch, torchvision, hydra, omegaconf, mptrain.cli"
# What the GPU image lacks of mptrain's runtime dependencies (pyproject.toml), fetched as wheels:
# the versions this project is tested with (omegaconf 2.4 does not satisfy hydra-core 1.3.8).
WHEELS = ["hydra-core==1.3.8", "omegaconf==2.3.1", "antlr4-python3-runtime==4.9.3"]
WHEEL_MODULES = ("hydra", "omegaconf", "antlr4")
BUNDLE = "gpu_all_files.tar.gz"
SPEED_TABLE_MD = "speed_table.md"  # left out of the bundle: the table to paste, read at once
DEVICE_TIMEOUT_S = 540  # the device tool's timeout_s for this command (at most 600)
BUDGET_S = 510.0  # ~30 s of DEVICE_TIMEOUT_S left for the summary and the bundle
SMOKE_BUDGET_S = 240.0  # under tests/e2e/test_benchmarks.py's 300 s for the whole smoke run
SPEED_S = 165.0  # the speed table's limit (--speed-s): what the plan leaves it
# The GPU tests: 54 collect, 29 of them run on SM90 (the others need SM100's block-scaled GEMMs
# or two GPUs); among them an inductor-compiled ResNet-18 (~60 s alone) and five short trainings.
PYTEST_S, PYTEST_ESTIMATE_S = 180.0, 140.0
SPEED_MARGIN_S = 20.0  # of its limit, for its imports and last write before gpu_all's SIGINT
SETUP_S = 45.0  # import check, offline install of three wheels, import check again
SETUP_ESTIMATE_S = 20.0
IMPORT_CHECK_S = 30.0
TEST_TIMEOUT_S = 90  # per GPU test (pytest-timeout): the inductor-compiled ResNet-18 is longest
MIN_SHARE = 0.5  # a step starts only with at least this share of its estimate left
KILL_GRACE_S = 10.0  # at a step's limit: SIGINT this long before it, SIGTERM halfway
STOP_GRACE_S = 3.0  # the same when the driver itself is stopped
FETCH_HERE = "python3 benchmarks/gpu_all.py --fetch-wheels .whl"
RUN_THERE = (
    f'device tool: run(command="python3 benchmarks/gpu_all.py", carry=[".whl"], '
    f"timeout_s={DEVICE_TIMEOUT_S})"
)


class Terminated(Exception):
    """The driver got SIGTERM or SIGINT (the device tool's time limit, a person's Ctrl-C)."""


def on_signal(signum: int, frame: object) -> None:
    """Turn SIGTERM/SIGINT into :class:`Terminated`, once: a second signal is ignored while the
    driver stops the running step and writes its summary."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise Terminated(signal.Signals(signum).name)


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


@dataclass
class Outcome:
    """What one step did. ``status``: ok | failed (why) | timed out | stopped (why) | not run
    (why) | not run yet; ``partial``: its JSON document is what it wrote before it ended
    without success; ``tests``: a pytest step's tests, each with its outcome."""

    name: str
    what: str
    status: str
    exit_code: int | None = None
    wall_s: float = 0.0
    timeout_s: float | None = None
    log: str | None = None
    estimate_s: float | None = None
    partial: bool = False
    tests: list[dict] | None = None
    result: dict | None = field(default=None, repr=False)


def child_env() -> dict[str, str]:
    """The steps' environment: this checkout first on PYTHONPATH, unbuffered output."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("HYDRA_FULL_ERROR", None)
    return env


def run_command(argv: list[str], log: Path, timeout_s: float) -> tuple[int | None, str, float]:
    """Run ``argv`` in the repository root, stdout and stderr into ``log``: (exit code, status,
    wall seconds). It ends within ``timeout_s``: :func:`stop_group` starts a grace before it.
    :class:`Terminated` (the driver stopped) stops the group with a short grace and propagates."""
    start = time.perf_counter()
    grace = min(KILL_GRACE_S, timeout_s / 4)
    with log.open("w") as sink:
        sink.write(f"$ {' '.join(argv)}\n")
        sink.flush()
        try:
            proc = subprocess.Popen(
                argv, cwd=REPO, env=child_env(), stdin=subprocess.DEVNULL, stdout=sink,
                stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=default_interrupt,
            )  # fmt: skip
        except OSError as exc:
            sink.write(f"cannot start: {exc}\n")
            return None, f"failed (cannot start: {exc.strerror})", time.perf_counter() - start
        try:
            code = proc.wait(timeout=timeout_s - grace)
            status = "ok" if code == 0 else "failed"
        except subprocess.TimeoutExpired:
            code = stop_group(proc, grace)
            sink.write(f"\n[gpu_all] stopped at its limit of {timeout_s:.0f} s\n")
            status = "timed out"
        except Terminated as exc:
            stop_group(proc, STOP_GRACE_S)
            sink.write(f"\n[gpu_all] stopped: the driver got {exc}\n")
            raise
        finally:
            signal_group(proc, signal.SIGKILL)  # what the step left running (workers)
    return code, status, time.perf_counter() - start


def default_interrupt() -> None:
    """In a step's process, before it runs its command: SIGINT back to its default. A driver
    started in the background by a non-interactive shell (``cmd &``, nohup) inherits SIGINT
    ignored, and so would every step: Python would then never raise KeyboardInterrupt, and a
    step stopped at its limit would be killed before writing its JSON or JUnit XML."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def signal_group(proc: subprocess.Popen, sig: int) -> bool:
    """``sig`` to the process group ``proc`` leads; False when the group is gone."""
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def stop_group(proc: subprocess.Popen, grace_s: float) -> int | None:
    """SIGINT to the process group ``proc`` leads (pytest writes its JUnit XML, Python unwinds),
    SIGTERM after half of ``grace_s``, SIGKILL after the other half: the leader's exit code."""
    for sig, wait_s in ((signal.SIGINT, grace_s / 2), (signal.SIGTERM, grace_s / 2)):
        if not signal_group(proc, sig):
            return proc.poll()
        try:
            return proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            continue
    signal_group(proc, signal.SIGKILL)
    return proc.wait()


def has_module(python: str, module: str) -> bool:
    """Whether ``python`` finds ``module`` (importlib.util.find_spec, nothing imported)."""
    code = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"
    try:
        proc = subprocess.run([python, "-c", code], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return proc.returncode == 0


def gpu_test_files() -> list[str]:
    """tests/**/test_*.py files that hold GPU-marked tests (relative to the repository root)."""
    return sorted(
        str(path.relative_to(REPO))
        for path in (REPO / "tests").rglob("test_*.py")
        if "mark.gpu" in path.read_text()
    )


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


def script(python: str, name: str, *args: str) -> list[str]:
    return [python, str(BENCHMARKS / name), *args]


def script_args(smoke: bool) -> dict[str, list[str]]:
    """Each script's arguments: the GPU's sizes, or (``smoke``) a CPU's tiny ones."""
    if not smoke:
        return {
            "fp8_check": [],  # its defaults: the check as designed (inductor compiles last)
            "speed_table": [],  # its defaults: every cell, the GPU sizes
            "gpt": [],  # its defaults: the GPU sizes
            "resnet50": ["--batch", "256", "--steps", "30", "--warmup", "10"],
            "imagefolder_train": [
                "--images", "4096", "--workers", "14", "--jobs", "14", "--batch", "256",
                "--steps", "30", "--warmup", "10", "--precision", "bf16",
            ],
            "data_path": [
                "--device", "cuda", "--workers", "14", "--images", "1024", "--reps", "2",
                "--epochs", "2", "--batch-size", "128",
            ],
        }  # fmt: skip
    cpu = ["--device", "cpu"]
    return {
        "fp8_check": [
            *cpu, "--gemm-shapes", "64x128x256", "--steps", "4", "--warmup", "2", "--batch",
            "64", "--width", "64", "--variants", "bf16,fp8,fp8_rowwise,fp8_rowwise_compiled",
            "--compile-backend", "aot_eager",  # the compiled code path without inductor's wait
            "--speed-shapes", "64x128x256", "--speed-repeats", "2",
        ],
        "speed_table": [  # two precisions (ResNet-50 refuses FP8); compiled: the GPT only
            *cpu, "--precisions", "fp32,fp8_rowwise", "--compile-backend", "aot_eager",
            "--compile-models", "gpt",  # compiling ResNet-50, even with aot_eager: ~15 s
        ],
        "gpt": [*cpu, "--precisions", "fp32,fp8"],  # the script's tiny CPU sizes; FP8 emulated
        "resnet50": [
            *cpu, "--batch", "2", "--image-size", "32", "--steps", "1", "--warmup", "1",
            "--precisions", "fp32,bf16",
        ],
        "imagefolder_train": [
            *cpu, "--images", "16", "--image-size", "32", "--batch", "4", "--steps", "2",
            "--warmup", "1", "--workers", "1", "--jobs", "2", "--precision", "fp32", "--model",
            "cnn",
        ],
        "data_path": [
            "--workers", "1", "--images", "12", "--image-size", "32", "--reps", "1", "--epochs",
            "1", "--batch-size", "4",
        ],
    }  # fmt: skip


def plan(
    python: str, out: Path, smoke: bool, test_timeout_s: int | None, speed_s: float = SPEED_S
) -> list[Step]:
    """The steps after setup, in order of value per second (see the module docstring); limits
    and estimates in seconds on an H200 (BENCHMARKS.md). ``speed_s``: the speed table's limit,
    its own budget SPEED_MARGIN_S less (it stops its cells within it)."""
    sizes = script_args(smoke)
    no_smi = (
        "CPU smoke run, no nvidia-smi here" if smoke and not shutil.which("nvidia-smi") else None
    )
    tests = ["-m", "gpu", *gpu_test_files()]
    sizes["speed_table"] += ["--budget-s", f"{speed_s - SPEED_MARGIN_S:.0f}"]

    def bench(
        name: str, file: str, limit: float, estimate: float, what: str, optional: bool = False
    ) -> Step:
        argv = script(python, file, *sizes[name], "--out", str(out / f"{name}.json"))
        return Step(name, argv, limit, what, f"{name}.json", estimate, optional)

    return [
        Step("nvidia_smi", ["nvidia-smi"], 10, "the GPU, its driver and clocks", estimate_s=2,
             skip=no_smi),
        bench("fp8_check", "gpu_fp8_check.py", 110, 80,
              "FP8 GEMMs vs emulation (tensorwise, rowwise; block-scaled where the GPU has "
              "them), forward GEMM speed; FP8 vs BF16 training, eager and compiled"),
        bench("speed_table", "gpu_speed.py", speed_s, speed_s - SPEED_MARGIN_S / 2,
              "GPT and ResNet-50 x precision x compile off/on: samples/s, tokens/s, memory"),
        Step("pytest_gpu", pytest_argv(python, out / "pytest_gpu.xml", tests, test_timeout_s),
             PYTEST_S, "pytest -m gpu", estimate_s=PYTEST_ESTIMATE_S, must_pass=not smoke,
             junit="pytest_gpu.xml"),
        bench("imagefolder_train", "imagefolder_train.py", 65, 45,
              "training through imagefolder: PIL workers vs device decode", optional=True),
        Step("collect_env", [python, "-m", "torch.utils.collect_env"], 30, "torch's environment",
             estimate_s=10, optional=True),
        bench("resnet50", "gpu_resnet50.py", 65, 50,
              "ResNet-50 per precision, synthetic data (+ cudnn.benchmark)", optional=True),
        bench("gpt", "gpu_gpt.py", 65, 50, "GPT language model per precision: tokens/s, MFU",
              optional=True),
        Step("data_path", script(python, "data_path.py", *sizes["data_path"], "--device-decode",
             "--json", str(out / "data_path.json")), 60, "data path alone: old/new/device decode",
             "data_path.json", 40, optional=True),
    ]  # fmt: skip


class Budget:
    """Seconds left of the run's budget, counted from construction."""

    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


def run_step(step: Step, out: Path, budget: Budget) -> Outcome:
    """Run one step within its limit and the budget left (not at all with less than its
    ``start_s`` left), then read what it left behind (:func:`collect`)."""
    left = budget.left()
    if step.skip:
        return Outcome(step.name, step.what, f"not run ({step.skip})", estimate_s=step.estimate_s)
    if left < step.start_s():
        why = f"not run ({left:.0f} s of the budget left, {step.start_s():.0f} s needed to start)"
        return Outcome(step.name, step.what, why, estimate_s=step.estimate_s)
    for stale in filter(None, (step.json_out, step.junit)):  # an earlier run's, in this --out
        (out / stale).unlink(missing_ok=True)
    timeout_s = min(step.timeout_s, left)
    log = out / f"{step.name}.log"
    code, status, wall_s = run_command(step.argv, log, timeout_s)
    outcome = Outcome(step.name, step.what, status, code, wall_s, timeout_s, log.name)
    return collect(step, out, outcome)


def collect(step: Step, out: Path, outcome: Outcome) -> Outcome:
    """Read what a step that ran left, whatever its status: its JSON document (``partial``
    unless it ended ok; one that ended ok without a readable document failed) and a pytest
    step's tests (one that must pass fails when none passed)."""
    outcome.estimate_s = step.estimate_s
    if step.junit:
        outcome.tests = step_tests(out / step.junit, out / f"{step.name}.log")
        if step.must_pass and outcome.status == "ok" and tally(outcome.tests)["passed"] == 0:
            outcome.status = f"failed (no test passed: {tally_text(outcome.tests)})"
    if step.json_out:
        try:
            outcome.result = json.loads((out / step.json_out).read_text())
        except (OSError, ValueError) as exc:
            if outcome.status == "ok":
                outcome.status = f"failed (no JSON document: {exc})"
        else:
            outcome.partial = outcome.status != "ok"
    return outcome


# ------------------------------------------------------------------------------------- setup
def can_import(python: str, smoke: bool, timeout_s: float) -> tuple[bool, str]:
    """Whether ``python`` imports mptrain's stack from this checkout (and, unless ``smoke``,
    sees a CUDA device); what it printed (or why it could not tell)."""
    check = f"{IMPORTS}; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
    if not smoke:
        check += "; assert torch.cuda.is_available(), 'torch sees no CUDA device'"
    try:
        proc = subprocess.run(
            [python, "-c", check], cwd=REPO, env=child_env(), capture_output=True, text=True,
            timeout=timeout_s,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return False, f"the import check timed out after {timeout_s:.0f} s"
    except OSError as exc:
        return False, f"cannot run {python}: {exc}"
    return proc.returncode == 0, (proc.stdout + proc.stderr).strip()


def missing_module(said: str) -> str | None:
    """The top-level module an import check reported missing (ModuleNotFoundError), if any."""
    found = re.search(r"No module named '([\w.]+)'", said)
    return found.group(1).split(".")[0] if found else None


def install_argv(python: str, wheels: Path | None) -> list[str]:
    if wheels is not None:
        found = sorted(str(p) for p in wheels.glob("*.whl"))
        return [python, "-m", "pip", "install", "--no-index", "--find-links", str(wheels), *found]
    return [python, "-m", "pip", "install", "-e", ".[test]"]


def no_install(args: argparse.Namespace, said: str) -> str | None:
    """Why setup fails without installing anything (None: install). Without wheels or
    ``--pip-install`` a registry is not assumed: pip would retry one that cannot be reached."""
    if args.skip_install or "no CUDA device" in said or "timed out" in said:
        return "imports or CUDA; see setup.log"
    if args.wheels is not None or args.pip_install:
        return None
    missing = missing_module(said)
    if missing not in WHEEL_MODULES:
        return f"imports: no module {missing!r}; see setup.log" if missing else "see setup.log"
    print(
        f"[gpu_all] setup: no module {missing!r}, and the wheels were not carried (no .whl/): "
        f"fetch them here, then run with them carried:\n    {FETCH_HERE}\n    {RUN_THERE}",
        flush=True,
    )
    return f"the wheels were not carried: no module {missing!r}; {FETCH_HERE}, then {RUN_THERE}"


SETUP_WHAT = "imports (and CUDA); install when missing"


def setup(args: argparse.Namespace, out: Path, budget: Budget) -> Outcome:
    """Step 1: the imports work, after an install when they did not (see the module docstring)."""
    start = time.perf_counter()
    log = out / "setup.log"
    ok, said = can_import(args.python, args.smoke, IMPORT_CHECK_S)
    log.write_text(f"import check: {'ok' if ok else 'failed'}\n{said}\n")
    why = None if ok else no_install(args, said)
    if ok or why:
        status = "ok" if ok else f"failed ({why})"
        return Outcome("setup", SETUP_WHAT, status, 0 if ok else 1, time.perf_counter() - start,
                       SETUP_S, log.name, SETUP_ESTIMATE_S)  # fmt: skip
    argv = install_argv(args.python, args.wheels)
    limit = max(5.0, min(SETUP_S - (time.perf_counter() - start), budget.left()))
    code, status, _ = run_command(argv, out / "install.log", limit)
    ok, said = can_import(args.python, args.smoke, IMPORT_CHECK_S)
    with log.open("a") as sink:
        sink.write(f"install ({' '.join(argv)}): {status}, see install.log\n")
        sink.write(f"import check after install: {'ok' if ok else 'failed'}\n{said}\n")
    status = "ok" if ok else f"failed (install {status}; imports still fail: see setup.log)"
    wall_s = time.perf_counter() - start
    return Outcome("setup", SETUP_WHAT, status, code, wall_s, SETUP_S, log.name, SETUP_ESTIMATE_S)


# ------------------------------------------------------------------------------ pytest's tests
def node_id(classname: str, name: str) -> str:
    """pytest's node id (``tests/e2e/test_gpu.py::test_x[fp16]``) of a JUnit ``testcase``."""
    parts = classname.split(".")
    for cut in range(len(parts), 0, -1):
        path = "/".join(parts[:cut]) + ".py"
        if (REPO / path).is_file():
            return "::".join([path, *parts[cut:], name])
    return f"{classname}::{name}"


JUNIT_OUTCOMES = {"error": "error", "failure": "failed", "skipped": "skipped"}


def junit_tests(xml_path: Path) -> list[dict] | None:
    """Every ``testcase`` of pytest's JUnit XML: test (node id), outcome (passed | failed | error
    | skipped), time_s, message (first line); None when the file is missing or broken."""
    try:
        root = ET.parse(xml_path).getroot()
    except (OSError, ET.ParseError):
        return None
    tests = []
    for case in root.iter("testcase"):
        if not case.get("name"):  # the test a SIGINT interrupted: a nameless entry
            continue
        marks = {child.tag: child for child in case if child.tag in JUNIT_OUTCOMES}
        tag = next((t for t in JUNIT_OUTCOMES if t in marks), None)  # error outranks failure
        tests.append({
            "test": node_id(case.get("classname", ""), case.get("name", "")),
            "outcome": JUNIT_OUTCOMES[tag] if tag else "passed",
            "time_s": float(case.get("time") or 0.0),
            "message": first_line(marks[tag].get("message", "")) if tag else "",
        })  # fmt: skip
    return tests


VERBOSE_LINE = re.compile(r"^(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)?")


def log_tests(log: Path) -> list[dict]:
    """The tests ``pytest -v`` named in its log, with their outcomes; a test named without one
    (it was running when the step was stopped) is ``running when stopped``."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return []
    tests: dict[str, str] = {}
    for line in lines:
        found = VERBOSE_LINE.match(line)
        if found:
            word = (found.group(2) or "").lower()
            outcome = {"xfail": "skipped", "xpass": "passed"}.get(word, word)
            tests[found.group(1)] = outcome or "running when stopped"
    return [{"test": t, "outcome": o, "time_s": None, "message": ""} for t, o in tests.items()]


def same_test(node: str) -> str:
    """What identifies a test in the XML and in the log alike: its module's name and the rest
    (the log's path is relative to the working directory, the XML's module to pytest's root)."""
    where, _, rest = node.partition("::")
    return f"{where.removesuffix('.py').replace('/', '.').split('.')[-1]}::{rest}"


def step_tests(xml_path: Path, log: Path) -> list[dict]:
    """A pytest step's tests: the JUnit XML's, plus those only its ``-v`` log names (the test
    a SIGINT interrupted; all of them when a hard kill left no XML)."""
    tests = junit_tests(xml_path) or []
    known = {same_test(t["test"]) for t in tests}
    return tests + [t for t in log_tests(log) if same_test(t["test"]) not in known]


def tally(tests: list[dict] | None) -> dict[str, int]:
    counts = dict.fromkeys(("passed", "failed", "error", "skipped", "running when stopped"), 0)
    for test in tests or []:
        counts[test["outcome"]] = counts.get(test["outcome"], 0) + 1
    return counts


def tally_text(tests: list[dict] | None) -> str:
    counts = tally(tests)
    text = ", ".join(f"{n} {k}" for k, n in counts.items() if n or k != "running when stopped")
    return f"{text} (of {len(tests or [])} reported)"


def test_lines(outcomes: list[Outcome]) -> list[str]:
    """Every test of every pytest step, by name, with its outcome (and why, when not passed)."""
    lines = []
    for outcome in outcomes:
        if outcome.tests is None:
            continue
        lines += ["", f"## Tests of {outcome.name}: {tally_text(outcome.tests)}", ""]
        for test in outcome.tests:
            took = "" if test["time_s"] is None else f" ({test['time_s']:.1f} s)"
            why = f": {test['message']}" if test["message"] else ""
            lines.append(f"- `{test['test']}`: {test['outcome']}{took}{why}")
    return lines


# ------------------------------------------------------------------------------ headline figures
FP8_AGREE_DB = 40.0  # real vs emulated FP8 GEMM: far closer than FP8 is to FP32 (~10-40 dB)


def fp8_verdict(doc: dict) -> tuple[str, str]:
    """(PASS | FAIL | INCOMPLETE, the reading): PASS when every GEMM agrees with the emulation
    (SQNR >= FP8_AGREE_DB), every planned training variant ran and every loss is finite."""
    # the block-scaled GEMMs the GPU has count like the others; skipped ones (no kernel) do not
    blocks = [g for g in doc.get("block_gemms") or [] if "skipped" not in g]
    gemms = (doc.get("gemm_agreement") or []) + blocks
    sqnrs = [g["real_vs_emulated_sqnr_db"] for g in gemms if "error" not in g]
    raised = len(gemms) - len(sqnrs)
    lowest = min(sqnrs, default=float("nan"))
    text = f"_scaled_mm vs emulation, lowest SQNR {lowest:.1f} dB (pass: >= {FP8_AGREE_DB:.0f} dB)"
    text += f", {raised} GEMMs raised" if raised else ""
    training = doc.get("training")
    if raised or not sqnrs or not lowest >= FP8_AGREE_DB:
        return "FAIL", text
    if not training:
        return "INCOMPLETE", f"{text}; no training variant finished"
    finite = training["all_losses_finite"]
    text += f"; losses finite: {finite}"
    if training["failed"] or not finite:
        return "FAIL", text
    done = len(training["variants"]) + len(training["failed"])
    if done < len(training.get("planned", training["variants"])):
        return "INCOMPLETE", f"{text}; {done} of {len(training['planned'])} variants finished"
    return "PASS", text


def fp8_lines(doc: dict) -> list[str]:
    """The FP8 check's verdict, each FP8 variant's speed against BF16 in the same mode (with
    the compiled ones' graph breaks) and the forward GEMM speeds."""
    verdict, text = fp8_verdict(doc)
    lines = [f"- FP8 check: **{verdict}**: {text}"]
    training = doc.get("training") or {"variants": {}, "vs_bf16": {}, "failed": {}}
    variants = training["variants"]
    if variants:
        lines.append(
            f"- FP8 vs BF16 training ({training['model']}, compiled with "
            f"{training['compile_backend']}; use_fast_accum: false):"
        )
    for name, row in training["vs_bf16"].items():
        lines.append(
            f"  - {name}: {variants[name]['samples_per_s']:.0f} vs {row['vs']} "
            f"{variants[row['vs']]['samples_per_s']:.0f} samples/s (x{row['speedup']:.2f}); "
            f"loss curves' mean abs diff {row['loss_curve_mean_abs_diff']:.4f}"
        )
    lines += [
        f"  - {name}: {row['graph_breaks']} graph breaks, {row['graphs']} graphs"
        + (f" ({'; '.join(row['graph_break_reasons'])})" if row["graph_breaks"] else "")
        for name, row in variants.items()
        if "graph_breaks" in row
    ]
    lines += [f"  - {name} FAILED: {why}" for name, why in training["failed"].items()]
    lines += forward_gemm_lines(doc.get("forward_gemm") or [])
    lines += block_gemm_lines(doc.get("block_gemms") or [])
    if doc.get("note"):
        lines.append(f"  - note: {doc['note']}")
    return lines


def forward_gemm_lines(rows: list[dict]) -> list[str]:
    lines = ["- FP8 forward GEMM vs BF16 (speed-up; fast accumulation: torchao's forward):"]
    for row in rows:
        shape = "x".join(map(str, row["shape"]))
        if row.get("error"):
            lines.append(f"  - {shape} {row['granularity']}: {row['error']}")
            continue
        lines.append(
            f"  - {shape} {row['granularity']}: BF16 {row['tflops']['bf16']:.1f} TFLOP/s; FP8 "
            f"x{row['fp8_speedup_vs_bf16']:.2f} (use_fast_accum false), "
            f"x{row['fp8_fast_accum_speedup_vs_bf16']:.2f} (true; SQNR vs emulation "
            f"{row['fast_accum_vs_emulated_sqnr_db']:.1f} dB)"
        )
    return lines if rows else []


def block_gemm_lines(rows: list[dict]) -> list[str]:
    lines = ["- Block-scaled GEMMs, real (scaled_mm) vs emulated:"]
    for row in rows:
        name = f"{row['format']} {'x'.join(map(str, row['shape']))}"
        if row.get("skipped") or row.get("error"):
            lines.append(f"  - {name}: {row.get('skipped') or row['error']}")
            continue
        lines.append(
            f"  - {name}: SQNR vs emulation {row['real_vs_emulated_sqnr_db']:.1f} dB; "
            f"{row['tflops']['real']:.1f} TFLOP/s (x{row['real_speedup_vs_emulated']:.1f} the "
            f"emulation, x{row['real_speedup_vs_bf16']:.2f} BF16)"
        )
    return lines if rows else []


def ratio(row: dict, key: str) -> str:
    return "-" if row.get(key) is None else f"{row[key]:.2f}"


def memory(row: dict) -> str:
    peak = row.get("peak_memory_bytes")
    return "-" if peak is None else f"{peak / 2**30:.2f} GiB"


def resnet50_lines(doc: dict) -> list[str]:
    lines = [f"- {doc['benchmark']}:", "", "  | precision | img/s | vs fp32 | peak memory |"]
    lines.append("  | --- | ---: | ---: | ---: |")
    for row in doc["rows"]:
        name = f"{row['precision']}{' + cudnn.benchmark' if row.get('cudnn_benchmark') else ''}"
        if row.get("error"):
            lines.append(f"  | {name} | {row['error']} | - | - |")
            continue
        lines.append(
            f"  | {name} | {row['samples_per_s']:.1f} | {ratio(row, 'vs_fp32')} | {memory(row)} |"
        )
    return [*lines, "", f"  reference: {doc['reference']}", ""]


def mfu_text(row: dict) -> str:
    if row["mfu"] is None and row["mfu_vs_bf16_peak"] is None:
        return "emulated FP8: none" if row["emulated"] else "-"
    own = "-" if row["mfu"] is None else f"{row['mfu']:.1%}"
    vs_bf16 = "-" if row["mfu_vs_bf16_peak"] is None else f"{row['mfu_vs_bf16_peak']:.1%}"
    return f"{own} ({vs_bf16} of BF16 peak)"


def gpt_lines(doc: dict) -> list[str]:
    """The GPT benchmark's table: tokens/s, ratio to FP32, MFU (own peak; BF16 peak), memory."""
    lines = [
        f"- {doc['benchmark']}:",
        "",
        "  | precision | tokens/s | vs fp32 | MFU | peak memory |",
        "  | --- | ---: | ---: | ---: | ---: |",
    ]
    for row in doc["rows"]:
        if row.get("error"):
            lines.append(f"  | {row['precision']} | {row['error']} | - | - | - |")
            continue
        name = f"{row['precision']}{' (emulated)' if row['emulated'] else ''}"
        lines.append(
            f"  | {name} | {row['tokens_per_s']:,.0f} | {ratio(row, 'vs_fp32')} | "
            f"{mfu_text(row)} | {memory(row)} |"
        )
    flops, mfu_doc = doc["flops"], doc["mfu"]
    lines.append(
        f"\n  MFU: {flops['per_token']:,} FLOP/token ({flops['formula']}) x tokens/s "
        f"over the precision's dense peak, in brackets over the BF16 peak "
        f"({mfu_doc['source'] or mfu_doc['unknown_reason']})"
    )
    return [*lines, ""]


def decoder_text(row: dict) -> str:
    """The pipeline's decoder, and how many JPEGs the host decoded for device decoding: when
    nvJPEG refused them, the figure is partly (or wholly) the host's."""
    decoder = (row.get("pipeline") or {}).get("decoder", "-")
    host = row.get("host_decoded")
    return decoder if not host else f"{decoder}; {host} JPEGs host-decoded (nvJPEG refused them)"


def imagefolder_lines(doc: dict) -> list[str]:
    lines = [f"- {doc['benchmark']}:", "", "  | pipeline | img/s | data wait | decoder |"]
    lines.append("  | --- | ---: | ---: | --- |")
    for label, row in doc["pipelines"].items():
        if row.get("error"):
            lines.append(f"  | {label} | {row['error']} | - | - |")
            continue
        wait = row["data_wait_fraction"]
        wait_text = "-" if wait is None else f"{wait:.1%}"
        rate = "-" if row["images_per_s"] is None else f"{row['images_per_s']:.1f}"
        lines.append(f"  | {label} | {rate} | {wait_text} | {decoder_text(row)} |")
    if doc.get("note"):
        lines.append(f"\n  note: {doc['note']}")
    return [*lines, ""]


def data_path_lines(doc: dict) -> list[str]:
    host = doc.get("host_decoded") or {}
    rates = ", ".join(
        f"{name} {row['images_per_s']['median']:.0f} (median of {len(row['reps'])})"
        + (f", {host[name]} JPEGs host-decoded" if host.get(name) else "")
        for name, row in doc["pipelines"].items()
    )
    failed = [f"{name} FAILED: {why}" for name, why in (doc.get("errors") or {}).items()]
    return [f"- data path alone (images/s): {rates or 'none timed'}", *[f"  - {f}" for f in failed]]


def speed_lines(doc: dict) -> list[str]:
    """The speed table as gpu_speed.py rendered it (after every cell), under a heading."""
    return ["", f"### Speed table ({SPEED_TABLE_MD})", "", *doc["markdown"].splitlines(), ""]


HEADLINES = {
    "fp8_check": fp8_lines,
    "speed_table": speed_lines,
    "resnet50": resnet50_lines,
    "gpt": gpt_lines,
    "imagefolder_train": imagefolder_lines,
    "data_path": data_path_lines,
}


def headlines(outcomes: list[Outcome]) -> list[str]:
    """The headline figures of every step that produced them (partial ones marked); a failed
    reading says so."""
    lines = []
    for outcome in outcomes:
        if outcome.tests is not None:
            lines.append(f"- {outcome.name}: {tally_text(outcome.tests)}")
        elif outcome.result is not None and outcome.name in HEADLINES:
            if outcome.partial:
                lines.append(f"- {outcome.name}: PARTIAL figures (the step {outcome.status}):")
            try:
                lines.extend(HEADLINES[outcome.name](outcome.result))
            except (KeyError, TypeError, ValueError) as exc:
                lines.append(f"- {outcome.name}: cannot read its JSON document ({exc!r})")
        elif outcome.name in HEADLINES:
            lines.append(f"- {outcome.name}: no figures ({outcome.status})")
    return lines


# ------------------------------------------------------------------------------------- summary
def tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return f"(cannot read {path.name}: {exc})"


def failed(outcome: Outcome) -> bool:
    return outcome.status != "ok" and not outcome.status.startswith("not run")


def summary_md(outcomes: list[Outcome], out: Path, meta: dict) -> str:
    """summary.md: the steps table, the headline figures, every test by name, the tail of every
    failed step's log."""
    lines = [
        f"# GPU run {meta['date']}{' (CPU smoke run)' if meta['smoke'] else ''}",
        "",
        f"{meta['verdict']}; {meta['total_s']:.0f} s of a {meta['budget_s']:.0f} s budget; "
        f"python {meta['python']}; commit {meta['commit']}",
        "",
        "| step | what | status | exit | wall s | limit s | estimate s |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for o in outcomes:
        code = "-" if o.exit_code is None else str(o.exit_code)
        limit = "-" if o.timeout_s is None else f"{o.timeout_s:.0f}"
        estimate = "-" if o.estimate_s is None else f"{o.estimate_s:.0f}"
        status = f"{o.status}, partial figures" if o.partial else o.status
        lines.append(
            f"| {o.name} | {o.what} | {status} | {code} | {o.wall_s:.1f} | {limit} | {estimate} |"
        )
    lines += ["", "## Headline figures", "", *headlines(outcomes), *test_lines(outcomes)]
    for o in filter(failed, outcomes):
        lines += ["", f"## {o.name}: {o.status} (last lines of {o.log})", "", "```"]
        lines += [tail(out / o.log) if o.log else "(no log)", "```"]
    return "\n".join(lines) + "\n"


def git_commit() -> str:
    try:
        proc = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
            timeout=10,
        )  # fmt: skip
        dirty = subprocess.run(
            ["git", "status", "--porcelain"], cwd=REPO, capture_output=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return proc.stdout.strip() + ("+changes" if dirty.stdout.strip() else "") or "unknown"


def write_summary(outcomes: list[Outcome], out: Path, meta: dict) -> None:
    """summary.json and summary.md, each written atomically."""
    write_json(out / "summary.json", {**meta, "steps": [asdict(o) for o in outcomes]})
    write_text(out / "summary.md", summary_md(outcomes, out, meta))


def bundle(out: Path) -> None:
    """Pack every file of ``out`` but summary.md/summary.json/SPEED_TABLE_MD into BUNDLE (written whole, then
    renamed), then remove the packed files."""
    keep = {"summary.md", "summary.json", BUNDLE, SPEED_TABLE_MD}
    files = sorted(p for p in out.rglob("*") if p.is_file() and p.name not in keep)
    partial = out / f".{BUNDLE}.tmp"
    with tarfile.open(partial, "w:gz") as tar:
        for path in files:
            tar.add(path, arcname=str(path.relative_to(out)))
    os.replace(partial, out / BUNDLE)
    for path in files:
        path.unlink()


# ---------------------------------------------------------------------------------------- main
class Driver:
    """One run: setup, then the planned steps; ``outcomes`` so far (steps not reached yet listed
    as ``not run yet``), written into the summary after every step and when stopped."""

    def __init__(self, args: argparse.Namespace, out: Path):
        self.args, self.out = args, out
        self.start = time.perf_counter()
        self.budget = Budget(args.budget_s)
        self.commit = git_commit()
        self.outcomes: list[Outcome] = []
        self.steps: list[Step] = []
        self.running: tuple[Step, float] | None = None  # the step running and when it started
        self.stopped: str | None = None  # the signal that stopped the driver
        self.crashed: str | None = None  # the driver's own error, when it had one

    def run(self) -> None:
        """Setup, then every planned step (or those in ``--only``), printing each one's time."""
        self.outcomes.append(setup(self.args, self.out, self.budget))
        report(self.outcomes[0])
        timeout = TEST_TIMEOUT_S if has_module(self.args.python, "pytest_timeout") else None
        self.steps = plan(
            self.args.python, self.out, self.args.smoke, timeout, speed_s=self.args.speed_s
        )
        if self.args.only:
            names = set(self.args.only.split(","))
            self.steps = [s for s in self.steps if s.name in names]
        for step in self.steps:
            if self.outcomes[0].status != "ok":
                outcome = Outcome(step.name, step.what, "not run (setup failed)")
            else:
                print(f"[gpu_all] {step.name}: {step.what} ...", flush=True)
                self.running = (step, time.perf_counter())
                outcome = run_step(step, self.out, self.budget)
                self.running = None
            self.outcomes.append(outcome)
            report(outcome)
            self.write()

    def stop(self, why: str) -> None:
        """After :class:`Terminated` or an error of the driver itself (``why``, in words): the
        step it interrupted (already stopped by run_command) is recorded with what it left."""
        status = f"stopped ({why})"
        if not self.outcomes:
            self.outcomes.append(Outcome("setup", SETUP_WHAT, status, log="setup.log"))
        if self.running is not None:
            step, started = self.running
            wall_s = time.perf_counter() - started
            outcome = Outcome(step.name, step.what, status, None, wall_s, None, f"{step.name}.log")
            self.outcomes.append(collect(step, self.out, outcome))
            self.running = None

    def all_ok(self) -> bool:
        ran = [o for o in self.outcomes if not o.status.startswith("not run")]
        return not (self.stopped or self.crashed) and all(o.status == "ok" for o in ran)

    def meta(self) -> dict:
        if self.crashed:
            verdict = f"DRIVER ERROR ({self.crashed})"
        elif self.stopped:
            verdict = f"STOPPED (the driver got {self.stopped})"
        elif len(self.outcomes) <= len(self.steps):
            verdict = f"RUNNING ({len(self.outcomes)} of {len(self.steps) + 1} steps done)"
        else:
            verdict = "every step that ran succeeded" if self.all_ok() else "SOME STEPS FAILED"
        return {
            "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
            "smoke": self.args.smoke,
            "verdict": verdict,
            "total_s": time.perf_counter() - self.start,
            "budget_s": self.args.budget_s,
            "device_timeout_s": DEVICE_TIMEOUT_S,
            "python": self.args.python,
            "commit": self.commit,
        }

    def write(self) -> None:
        """The summary of what ran so far, with the steps not reached yet."""
        done = {o.name for o in self.outcomes}
        pending = [
            Outcome(s.name, s.what, "not run yet", estimate_s=s.estimate_s)
            for s in self.steps
            if s.name not in done
        ]
        write_summary(self.outcomes + pending, self.out, self.meta())


def report(outcome: Outcome) -> None:
    code = "" if outcome.exit_code is None else f", exit {outcome.exit_code}"
    print(f"[gpu_all] {outcome.name}: {outcome.status}{code}, {outcome.wall_s:.1f} s", flush=True)


def fetch_wheels(target: Path, python: str) -> int:
    """Download (or build) WHEELS into ``target`` where PyPI is reachable, for an offline install."""
    target.mkdir(parents=True, exist_ok=True)
    argv = [python, "-m", "pip", "wheel", "--no-deps", "-w", str(target), *WHEELS]
    code = subprocess.run(argv, check=False).returncode
    print(f"wheels in {target}: {sorted(p.name for p in target.glob('*.whl'))}")
    return code


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="default: $OUT, else results/")
    parser.add_argument("--budget-s", type=float, default=None, help="default 510 (smoke: 240)")
    parser.add_argument("--smoke", action="store_true", help="every step tiny, on the CPU")
    parser.add_argument("--skip-install", action="store_true", help="never pip install")
    parser.add_argument("--wheels", type=Path, default=None, help="default: .whl/ when present")
    parser.add_argument("--pip-install", action="store_true", help="no wheels: pip from PyPI")
    parser.add_argument("--python", default=sys.executable, help="the interpreter of every step")
    parser.add_argument("--bundle", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--only", default=None, help="comma-separated step names (a rerun)")
    parser.add_argument("--speed-s", type=float, default=SPEED_S, help="the speed table's limit")
    parser.add_argument("--fetch-wheels", type=Path, default=None, metavar="DIR")
    args = parser.parse_args(argv)
    from_env = args.out is None and bool(os.environ.get("OUT"))
    if args.out is None:
        stamp = dt.datetime.now().strftime("%Y-%m-%d_%H%M")
        default = BENCHMARKS / "results" / f"gpu_{'smoke_' if args.smoke else ''}{stamp}"
        args.out = Path(os.environ["OUT"]) if from_env else default
    args.bundle = from_env if args.bundle is None else args.bundle
    args.budget_s = args.budget_s or (SMOKE_BUDGET_S if args.smoke else BUDGET_S)
    if args.wheels is None and (REPO / ".whl").is_dir():
        args.wheels = REPO / ".whl"
    args.wheels = args.wheels.resolve() if args.wheels else None
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.fetch_wheels:
        return fetch_wheels(args.fetch_wheels, args.python)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    # Handlers, not SIG_IGN: the steps then start with SIGINT at its default (a background job
    # inherits it ignored, and a Python started so would ignore the SIGINT that stops it).
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    driver = Driver(args, out)
    try:
        driver.run()
    except Terminated as exc:
        driver.stopped = str(exc)
        driver.stop(f"the driver got {exc}")
    except Exception as exc:  # a bug here must not cost the summary of what ran
        traceback.print_exc()
        driver.crashed = f"{type(exc).__name__}: {first_line(exc)}"
        driver.stop("the driver failed")
    for sig in (signal.SIGTERM, signal.SIGINT):  # the summary and bundle take a second
        signal.signal(sig, signal.SIG_IGN)
    driver.write()
    if args.bundle:
        bundle(out)
    print((out / "summary.md").read_text())
    meta = driver.meta()
    print(f"[gpu_all] {meta['verdict']}; {meta['total_s']:.1f} s in all; summary: {out}/summary.md")
    if driver.stopped:
        return 128 + signal.Signals[driver.stopped].value
    return 0 if driver.all_ok() else 1


if __name__ == "__main__":
    raise SystemExit(main())
