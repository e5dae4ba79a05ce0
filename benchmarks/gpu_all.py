"""Every GPU check of mptrain in one command, for a GPU machine's first minutes (an H200: ~6 min).

    python3 benchmarks/gpu_all.py [--out DIR] [--budget-s 465] [--skip-install] [--wheels DIR]
        [--only STEP,...] [--python PYTHON] [--[no-]bundle]
    python3 benchmarks/gpu_all.py --smoke [--out DIR]      # the same steps, tiny, on a CPU
    python3 benchmarks/gpu_all.py --fetch-wheels .whl      # beforehand, where PyPI is reachable

Steps, in this order (each a subprocess with its own time limit, cut to what is left of
``--budget-s``, which counts from the start, setup included: the whole run stays within 8 minutes;
the process group of a step that runs over is killed; a failed step is reported as failed and the
next one runs; ``--only`` reruns some steps, after setup):

1. ``setup``: checks that ``--python`` imports torch, torchvision, hydra, omegaconf and mptrain
   (this checkout, through PYTHONPATH) and, on the GPU, that CUDA is available. When an import
   fails (and no ``--skip-install``): installs the wheels in ``--wheels`` offline (``pip install
   --no-index``), or else runs ``pip install -e ".[test]"`` (a registry is needed; torch is then a
   CUDA build from it). Install time counts against the budget. When setup fails, no other step
   runs: summary.md says so.
2. ``nvidia_smi`` and ``collect_env`` (``python -m torch.utils.collect_env``): the machine.
3. ``sync_test``: ``pytest tests/test_gpu.py -k test_host_syncs_per_step_on_cuda`` (torch's sync
   detector: one host sync per FP16 step, none for BF16/FP32).
4. ``fp8_check``: benchmarks/gpu_fp8_check.py (``_scaled_mm`` vs emulation, FP8 vs BF16 training).
5. ``resnet50``: benchmarks/gpu_resnet50.py, FP32/TF32/FP16/BF16, batch 256, 40 steps after 10.
6. ``gpt``: benchmarks/gpu_gpt.py with its defaults (width 2048, 4 layers, 16 heads, block 1024,
   batch 32, 10 steps after 3): tokens/s and MFU at FP32/TF32/BF16/FP16/FP8.
7. ``imagefolder_train``: benchmarks/imagefolder_train.py, ResNet-50 BF16 through
   ``dataset=imagefolder`` on 4096 generated JPEGs (30 steps after 10): PIL in 14 persistent
   workers vs ``dataset.decode_device=cuda``.
8. ``pytest_gpu``: ``pytest -m gpu`` on the test files that hold GPU tests (the sync test above
   deselected). Files are named so that tests needing packages the GPU image lacks (mlflow,
   optuna) are not collected. On the GPU a pytest step in which no test passed (all skipped)
   counts as failed.
9. ``data_path`` (only when at least 60 s of the budget are left): benchmarks/data_path.py
   ``--device cuda --device-decode`` (the data path alone, no model).

Written into ``--out`` (default: ``$OUT`` when set, else benchmarks/results/gpu_<date>_<time>):
each step's combined stdout/stderr (``<step>.log``), the scripts' JSON documents
(``<step>.json``), pytest's JUnit XML, ``summary.json`` (every step's exit code, wall time and
JSON document) and ``summary.md`` (a table of steps, headline figures, the tail of each failed
step's log). With ``--bundle`` (the default when the directory is ``$OUT``, whose files come back
only eight at a time) every file but the two summaries is packed into ``gpu_all_files.tar.gz``.

On the H200 lent to these sessions: python3 there holds torch (a CUDA build), torchvision,
pytest, pillow and rich but not hydra-core, omegaconf or antlr4-python3-runtime, and no package
registry is reachable. So first, here: ``python3 benchmarks/gpu_all.py --fetch-wheels .whl``
(.whl/ is git-ignored), then run ``python3 benchmarks/gpu_all.py`` there with ``.whl`` carried.

``--smoke`` runs every step on the CPU with tiny sizes (``--device cpu`` modes of the scripts; the
pytest steps skip their CUDA tests): tests/test_benchmarks.py runs it, so this driver is known to
work before GPU time is spent on it. Exit code: 0 when every step that ran succeeded, else 1.
This file imports only the standard library: it runs before mptrain's dependencies exist.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BENCHMARKS = REPO / "benchmarks"
SYNC_TEST = "tests/test_gpu.py::test_host_syncs_per_step_on_cuda"
IMPORTS = "import torch, torchvision, hydra, omegaconf, mptrain.cli"
# What the GPU image lacks of mptrain's runtime dependencies (pyproject.toml), fetched as wheels:
# the versions this project is tested with (omegaconf 2.4 does not satisfy hydra-core 1.3.8).
WHEELS = ["hydra-core==1.3.8", "omegaconf==2.3.1", "antlr4-python3-runtime==4.9.3"]
BUNDLE = "gpu_all_files.tar.gz"
KILL_GRACE_S = 10


@dataclass
class Step:
    """One command of the run: ``argv`` with ``timeout_s`` (cut to the budget left); skipped
    unless at least ``min_s`` of the budget is left; ``json_out``: the document it writes."""

    name: str
    argv: list[str]
    timeout_s: float
    what: str
    json_out: str | None = None
    min_s: float = 15.0
    optional: bool = False
    skip: str | None = None  # why it is not run at all (a smoke run's missing nvidia-smi)
    must_pass: bool = False  # a pytest step that fails unless at least one test passed


@dataclass
class Outcome:
    """What one step did. ``status``: ok | failed | timed out | not run (why)."""

    name: str
    what: str
    status: str
    exit_code: int | None = None
    wall_s: float = 0.0
    timeout_s: float | None = None
    log: str | None = None
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
    wall seconds). Over ``timeout_s`` its whole process group gets SIGTERM, then SIGKILL."""
    start = time.perf_counter()
    with log.open("w") as sink:
        sink.write(f"$ {' '.join(argv)}\n")
        sink.flush()
        try:
            proc = subprocess.Popen(
                argv, cwd=REPO, env=child_env(), stdin=subprocess.DEVNULL, stdout=sink,
                stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        except OSError as exc:
            sink.write(f"cannot start: {exc}\n")
            return None, f"failed (cannot start: {exc.strerror})", time.perf_counter() - start
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            kill_group(proc)
            sink.write(f"\n[gpu_all] killed after {timeout_s:.0f} s\n")
            return None, "timed out", time.perf_counter() - start
    return code, "ok" if code == 0 else "failed", time.perf_counter() - start


def kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the process group ``proc`` leads, SIGKILL after KILL_GRACE_S."""
    for sig, wait_s in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def gpu_test_files() -> list[str]:
    """tests/*.py files that hold GPU-marked tests (relative to the repository root)."""
    return sorted(
        str(path.relative_to(REPO))
        for path in (REPO / "tests").glob("test_*.py")
        if "mark.gpu" in path.read_text()
    )


def pytest_argv(python: str, out: Path, name: str, *args: str) -> list[str]:
    junit = out / f"{name}.xml"
    return [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", *args]


def script(python: str, name: str, *args: str) -> list[str]:
    return [python, str(BENCHMARKS / name), *args]


def plan(python: str, out: Path, smoke: bool) -> list[Step]:
    """The steps after setup, with the GPU's sizes or (``smoke``) a CPU's tiny ones."""
    dev = ["--device", "cpu"] if smoke else []
    fp8 = ["--gemm-shapes", "64x128x256", "--steps", "4", "--warmup", "2", "--batch", "64"]
    fp8 += ["--width", "64", "--variants", "bf16,fp8,fp8_rowwise,fp8_rowwise_compiled"]
    fp8 += ["--compile-backend", "aot_eager"]  # the compiled code path without inductor's wait
    fp8 += ["--speed-shapes", "64x128x256", "--speed-repeats", "2"]
    rn50 = ["--batch", "2", "--image-size", "32", "--steps", "1", "--warmup", "1"]
    rn50 += ["--precisions", "fp32,bf16"]
    gpt = ["--precisions", "fp32,fp8"]  # --device cpu: the script's tiny sizes; FP8 emulated
    folder = ["--images", "16", "--image-size", "32", "--batch", "4", "--steps", "2"]
    folder += ["--warmup", "1", "--workers", "1", "--jobs", "2", "--precision", "fp32"]
    folder += ["--model", "cnn"]
    data_path = ["--workers", "1", "--images", "12", "--image-size", "32", "--reps", "1"]
    data_path += ["--epochs", "1", "--batch-size", "4"]
    if not smoke:
        # The script's defaults: the check as designed (~30 s on an H200 before the compiled
        # variants; inductor's three compilations add an estimated 60-90 s).
        fp8 = []
        # 40 and 30 steps (were 50 and 40): room in the budget for the gpt step.
        rn50 = ["--batch", "256", "--steps", "40", "--warmup", "10"]
        gpt = []  # the script's defaults: the GPU sizes (~50 s on an H200, estimated)
        folder = ["--images", "4096", "--workers", "14", "--jobs", "14", "--batch", "256"]
        folder += ["--steps", "30", "--warmup", "10", "--precision", "bf16"]
        data_path = ["--device", "cuda", "--workers", "14", "--images", "1024", "--reps", "2"]
        data_path += ["--epochs", "2", "--batch-size", "128"]
    gpu_tests = gpu_test_files()
    no_smi = (
        "CPU smoke run, no nvidia-smi here" if smoke and not shutil.which("nvidia-smi") else None
    )
    return [
        Step("nvidia_smi", ["nvidia-smi"], 20, "the GPU, its driver and clocks", skip=no_smi),
        Step("collect_env", [python, "-m", "torch.utils.collect_env"], 60, "torch's environment"),
        Step("sync_test", pytest_argv(python, out, "sync_test", SYNC_TEST), 90,
             "host syncs per step (torch.cuda sync debug mode)", must_pass=not smoke),
        Step("fp8_check", script(python, "gpu_fp8_check.py", *dev, *fp8,
             "--out", str(out / "fp8_check.json")), 150,
             "FP8 GEMMs vs emulation (tensorwise, rowwise); FP8 vs BF16 training, eager and "
             "compiled", "fp8_check.json"),
        Step("resnet50", script(python, "gpu_resnet50.py", *dev, *rn50,
             "--out", str(out / "resnet50.json")), 150,
             "ResNet-50 per precision, synthetic data", "resnet50.json"),
        Step("gpt", script(python, "gpu_gpt.py", *dev, *gpt, "--out", str(out / "gpt.json")),
             100, "GPT language model per precision: tokens/s, MFU", "gpt.json"),
        Step("imagefolder_train", script(python, "imagefolder_train.py", *dev, *folder,
             "--out", str(out / "imagefolder_train.json")), 150,
             "training through imagefolder: PIL workers vs device decode", "imagefolder_train.json"),
        Step("pytest_gpu", pytest_argv(python, out, "pytest_gpu", "-m", "gpu",
             "--deselect", SYNC_TEST, *gpu_tests), 210, "pytest -m gpu",
             must_pass=not smoke),
        Step("data_path", script(python, "data_path.py", *data_path, "--device-decode",
             "--json", str(out / "data_path.json")), 90,
             "data path alone: old/new/device decode", "data_path.json", min_s=60, optional=True),
    ]  # fmt: skip


class Budget:
    """Seconds left of the run's budget, counted from construction."""

    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


def run_step(step: Step, out: Path, budget: Budget) -> Outcome:
    """Run one step within its limit and the budget left; read its JSON document when it wrote
    one (an unreadable document fails the step)."""
    left = budget.left()
    if left < step.min_s:
        return Outcome(step.name, step.what, f"not run ({left:.0f} s of the budget left)")
    if step.skip:
        return Outcome(step.name, step.what, f"not run ({step.skip})")
    timeout_s = min(step.timeout_s, left)
    log = out / f"{step.name}.log"
    code, status, wall_s = run_command(step.argv, log, timeout_s)
    outcome = Outcome(step.name, step.what, status, code, wall_s, timeout_s, log.name)
    if step.must_pass and status == "ok":
        counts = pytest_counts(out / f"{step.name}.xml")
        if not counts or counts["passed"] == 0:
            outcome.status = f"failed (no test passed: {counts})"
    if step.json_out and status == "ok":
        try:
            outcome.result = json.loads((out / step.json_out).read_text())
        except (OSError, ValueError) as exc:
            outcome.status = f"failed (no JSON document: {exc})"
    return outcome


def can_import(python: str, smoke: bool) -> tuple[bool, str]:
    """Whether ``python`` imports mptrain's stack from this checkout (and, unless ``smoke``,
    sees a CUDA device); what it printed."""
    check = f"{IMPORTS}; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
    if not smoke:
        check += "; assert torch.cuda.is_available(), 'torch sees no CUDA device'"
    proc = subprocess.run(
        [python, "-c", check], cwd=REPO, env=child_env(), capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    return proc.returncode == 0, (proc.stdout + proc.stderr).strip()


def install_argv(python: str, wheels: Path | None) -> list[str]:
    if wheels is not None:
        found = sorted(str(p) for p in wheels.glob("*.whl"))
        return [python, "-m", "pip", "install", "--no-index", "--find-links", str(wheels), *found]
    return [python, "-m", "pip", "install", "-e", ".[test]"]


def setup(args: argparse.Namespace, out: Path, budget: Budget) -> Outcome:
    """Step 1: the imports work, after an install when they did not (see the module docstring)."""
    start = time.perf_counter()
    log = out / "setup.log"
    ok, said = can_import(args.python, args.smoke)
    log.write_text(f"import check: {'ok' if ok else 'failed'}\n{said}\n")
    what = "imports (and CUDA); install when missing"
    if ok or args.skip_install or "no CUDA device" in said:
        status = "ok" if ok else "failed (imports or CUDA; see setup.log)"
        return Outcome("setup", what, status, 0 if ok else 1, time.perf_counter() - start,
                       None, log.name)  # fmt: skip
    argv = install_argv(args.python, args.wheels)
    code, status, _ = run_command(argv, out / "install.log", min(300, budget.left()))
    ok, said = can_import(args.python, args.smoke)
    with log.open("a") as sink:
        sink.write(f"install ({' '.join(argv)}): {status}, see install.log\n")
        sink.write(f"import check after install: {'ok' if ok else 'failed'}\n{said}\n")
    status = "ok" if ok else f"failed (install {status}; imports still fail: see setup.log)"
    return Outcome("setup", what, status, code, time.perf_counter() - start, None, log.name)


# ------------------------------------------------------------------------------ headline figures
FP8_AGREE_DB = 40.0  # real vs emulated FP8 GEMM: far closer than FP8 is to FP32 (~10-40 dB)


def fp8_lines(doc: dict) -> list[str]:
    """The FP8 check's verdict: every GEMM (tensorwise and rowwise) agrees with the emulation
    (SQNR >= FP8_AGREE_DB), every training variant ran and every loss is finite; then each FP8
    variant's speed against BF16 in the same mode."""
    sqnr = min(g["real_vs_emulated_sqnr_db"] for g in doc["gemm_agreement"])
    training = doc["training"]
    agree = sqnr >= FP8_AGREE_DB and training["all_losses_finite"] and not training["failed"]
    verdict = "PASS" if agree else "FAIL"
    variants = training["variants"]
    lines = [
        f"- FP8 check: **{verdict}**: _scaled_mm vs emulation, lowest SQNR {sqnr:.1f} dB "
        f"(pass: >= {FP8_AGREE_DB:.0f} dB); losses finite: {training['all_losses_finite']}",
        f"- FP8 vs BF16 training ({training['model']}, compiled with "
        f"{training['compile_backend']}):",
    ]
    for name, row in training["vs_bf16"].items():
        lines.append(
            f"  - {name}: {variants[name]['samples_per_s']:.0f} vs {row['vs']} "
            f"{variants[row['vs']]['samples_per_s']:.0f} samples/s (x{row['speedup']:.2f}); "
            f"loss curves' mean abs diff {row['loss_curve_mean_abs_diff']:.4f}"
        )
    lines += [f"  - {name} FAILED: {why}" for name, why in training["failed"].items()]
    if doc.get("note"):
        lines.append(f"  - note: {doc['note']}")
    return lines


def resnet50_lines(doc: dict) -> list[str]:
    lines = [f"- {doc['benchmark']}:", "", "  | precision | img/s | vs fp32 | peak memory |"]
    lines.append("  | --- | ---: | ---: | ---: |")
    for row in doc["rows"]:
        peak = row["peak_memory_bytes"]
        lines.append(
            f"  | {row['precision']} | {row['samples_per_s']:.1f} | {row['vs_fp32']:.2f} | "
            f"{peak / 2**30:.2f} GiB |"
            if peak is not None
            else f"  | {row['precision']} | {row['samples_per_s']:.1f} | {row['vs_fp32']:.2f} | - |"
        )
    return [*lines, ""]


def gpt_lines(doc: dict) -> list[str]:
    """The GPT benchmark's table: tokens/s, ratio to FP32, MFU (own peak; BF16 peak), memory."""
    lines = [
        f"- {doc['benchmark']}:",
        "",
        "  | precision | tokens/s | vs fp32 | MFU | peak memory |",
    ]
    lines.append("  | --- | ---: | ---: | ---: | ---: |")
    for row in doc["rows"]:
        if row.get("error"):
            lines.append(f"  | {row['precision']} | {row['error']} | - | - | - |")
            continue
        peak = row["peak_memory_bytes"]
        memory = "-" if peak is None else f"{peak / 2**30:.2f} GiB"
        if row["mfu"] is not None or row["mfu_vs_bf16_peak"] is not None:
            own = "-" if row["mfu"] is None else f"{row['mfu']:.1%}"
            vs_bf16 = "-" if row["mfu_vs_bf16_peak"] is None else f"{row['mfu_vs_bf16_peak']:.1%}"
            mfu = f"{own} ({vs_bf16} of BF16 peak)"
        else:
            mfu = "emulated FP8: none" if row["emulated"] else "-"
        name = f"{row['precision']}{' (emulated)' if row['emulated'] else ''}"
        lines.append(
            f"  | {name} | {row['tokens_per_s']:,.0f} | {row['vs_fp32']:.2f} | {mfu} | {memory} |"
        )
    flops, mfu_doc = doc["flops"], doc["mfu"]
    lines.append(
        f"\n  MFU: {flops['per_token']:,} FLOP/token ({flops['formula']}) x tokens/s "
        f"over the precision's dense peak, in brackets over the BF16 peak "
        f"({mfu_doc['source'] or mfu_doc['unknown_reason']})"
    )
    return [*lines, ""]


def imagefolder_lines(doc: dict) -> list[str]:
    lines = [f"- {doc['benchmark']}:", "", "  | pipeline | img/s | data wait | decoder |"]
    lines.append("  | --- | ---: | ---: | --- |")
    for label, row in doc["pipelines"].items():
        wait = row["data_wait_fraction"]
        wait_text = "-" if wait is None else f"{wait:.1%}"
        decoder = (row.get("pipeline") or {}).get("decoder", "-")
        rate = "-" if row["images_per_s"] is None else f"{row['images_per_s']:.1f}"
        lines.append(f"  | {label} | {rate} | {wait_text} | {decoder} |")
    if doc.get("note"):
        lines.append(f"\n  note: {doc['note']}")
    return [*lines, ""]


def data_path_lines(doc: dict) -> list[str]:
    rates = ", ".join(
        f"{name} {row['images_per_s']['median']:.0f}" for name, row in doc["pipelines"].items()
    )
    return [f"- data path alone (images/s, median of {doc['settings']['reps']}): {rates}"]


def pytest_counts(xml_path: Path) -> dict[str, int] | None:
    """passed/failed/errors/skipped from pytest's JUnit XML; None when it is missing or broken."""
    try:
        root = ET.parse(xml_path).getroot()
    except (OSError, ET.ParseError):
        return None
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors")}
    counts["skipped"] = sum(int(s.get("skipped", 0)) for s in suites)
    failed = counts["failures"] + counts["errors"]
    counts["passed"] = counts["tests"] - failed - counts["skipped"]
    return counts


HEADLINES = {
    "fp8_check": fp8_lines,
    "resnet50": resnet50_lines,
    "gpt": gpt_lines,
    "imagefolder_train": imagefolder_lines,
    "data_path": data_path_lines,
}


def headlines(outcomes: list[Outcome], out: Path) -> list[str]:
    """The headline figures of every step that produced them; a failed reading says so."""
    lines = []
    for outcome in outcomes:
        if outcome.name in ("sync_test", "pytest_gpu") and outcome.log:
            counts = pytest_counts(out / f"{outcome.name}.xml")
            text = "no JUnit XML" if counts is None else ", ".join(
                f"{counts[k]} {k}" for k in ("passed", "failures", "errors", "skipped")
            )  # fmt: skip
            lines.append(f"- {outcome.name}: {text}")
        elif outcome.result is not None and outcome.name in HEADLINES:
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


def summary_md(outcomes: list[Outcome], out: Path, meta: dict) -> str:
    """summary.md: the steps table, the headline figures, the tail of every failed step's log."""
    failed = [o for o in outcomes if o.status not in ("ok",) and not o.status.startswith("not run")]
    lines = [
        f"# GPU run {meta['date']}{' (CPU smoke run)' if meta['smoke'] else ''}",
        "",
        f"{meta['verdict']}; {meta['total_s']:.0f} s of a {meta['budget_s']:.0f} s budget; "
        f"python {meta['python']}; commit {meta['commit']}",
        "",
        "| step | what | status | exit | wall s | limit s |",
        "| --- | --- | --- | ---: | ---: | ---: |",
    ]
    for o in outcomes:
        code = "-" if o.exit_code is None else str(o.exit_code)
        limit = "-" if o.timeout_s is None else f"{o.timeout_s:.0f}"
        lines.append(f"| {o.name} | {o.what} | {o.status} | {code} | {o.wall_s:.1f} | {limit} |")
    lines += ["", "## Headline figures", "", *headlines(outcomes, out)]
    for o in failed:
        lines += ["", f"## {o.name}: {o.status} (last lines of {o.log})", "", "```"]
        lines += [tail(out / o.log) if o.log else "(no log)", "```"]
    return "\n".join(lines) + "\n"


def git_commit() -> str:
    try:
        proc = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
            timeout=10,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    dirty = subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True)
    return proc.stdout.strip() + ("+changes" if dirty.stdout.strip() else "") or "unknown"


def write_summary(outcomes: list[Outcome], out: Path, meta: dict) -> None:
    doc = {**meta, "steps": [asdict(o) for o in outcomes]}
    (out / "summary.json").write_text(json.dumps(doc, indent=2, default=str) + "\n")
    (out / "summary.md").write_text(summary_md(outcomes, out, meta))


def bundle(out: Path) -> None:
    """Pack every file of ``out`` but summary.md/summary.json into BUNDLE, removing the files."""
    keep = {"summary.md", "summary.json", BUNDLE}
    files = sorted(p for p in out.rglob("*") if p.is_file() and p.name not in keep)
    with tarfile.open(out / BUNDLE, "w:gz") as tar:
        for path in files:
            tar.add(path, arcname=str(path.relative_to(out)))
    for path in files:
        path.unlink()


# ---------------------------------------------------------------------------------------- main
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
    parser.add_argument("--budget-s", type=float, default=None, help="default 465 (smoke: 300)")
    parser.add_argument("--smoke", action="store_true", help="every step tiny, on the CPU")
    parser.add_argument("--skip-install", action="store_true", help="never pip install")
    parser.add_argument("--wheels", type=Path, default=None, help="default: .whl/ when present")
    parser.add_argument("--python", default=sys.executable, help="the interpreter of every step")
    parser.add_argument("--bundle", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--only", default=None, help="comma-separated step names (a rerun)")
    parser.add_argument("--fetch-wheels", type=Path, default=None, metavar="DIR")
    args = parser.parse_args(argv)
    from_env = args.out is None and bool(os.environ.get("OUT"))
    if args.out is None:
        stamp = dt.datetime.now().strftime("%Y-%m-%d_%H%M")
        default = BENCHMARKS / "results" / f"gpu_{'smoke_' if args.smoke else ''}{stamp}"
        args.out = Path(os.environ["OUT"]) if from_env else default
    args.bundle = from_env if args.bundle is None else args.bundle
    args.budget_s = args.budget_s or (300.0 if args.smoke else 465.0)
    if args.wheels is None and (REPO / ".whl").is_dir():
        args.wheels = REPO / ".whl"
    args.wheels = args.wheels.resolve() if args.wheels else None
    return args


def run_all(args: argparse.Namespace, out: Path, budget: Budget) -> list[Outcome]:
    """Setup, then every planned step (or those in ``--only``), printing each one's time."""
    outcomes = [setup(args, out, budget)]
    report(outcomes[0])
    steps = plan(args.python, out, args.smoke)
    if args.only:
        names = set(args.only.split(","))
        steps = [s for s in steps if s.name in names]
    for step in steps:
        if outcomes[0].status != "ok":
            outcome = Outcome(step.name, step.what, "not run (setup failed)")
        else:
            print(f"[gpu_all] {step.name}: {step.what} ...", flush=True)
            outcome = run_step(step, out, budget)
        outcomes.append(outcome)
        report(outcome)
    return outcomes


def report(outcome: Outcome) -> None:
    code = "" if outcome.exit_code is None else f", exit {outcome.exit_code}"
    print(f"[gpu_all] {outcome.name}: {outcome.status}{code}, {outcome.wall_s:.1f} s", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.fetch_wheels:
        return fetch_wheels(args.fetch_wheels, args.python)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    budget = Budget(args.budget_s)
    outcomes = run_all(args, out, budget)
    ran = [o for o in outcomes if not o.status.startswith("not run")]
    setup_ok = outcomes[0].status == "ok"
    all_ok = setup_ok and all(o.status == "ok" for o in ran)
    meta = {
        "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "smoke": args.smoke,
        "verdict": "every step that ran succeeded" if all_ok else "SOME STEPS FAILED",
        "total_s": time.perf_counter() - start,
        "budget_s": args.budget_s,
        "python": args.python,
        "commit": git_commit(),
    }
    write_summary(outcomes, out, meta)
    if args.bundle:
        bundle(out)
    print((out / "summary.md").read_text())
    print(f"[gpu_all] {meta['verdict']}; {meta['total_s']:.1f} s in all; summary: {out}/summary.md")
    return 0 if all_ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
