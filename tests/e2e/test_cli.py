"""The ``mptrain`` command line, run as a subprocess (``python -m mptrain``) in a temporary directory.

CPU-only. Bad input must stop with exit code 2 and one ``mptrain: error:`` line before anything
trains; two tiny real runs (one single, one ``-m`` sweep) check what a run leaves on disk.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest
from support.processes import describe, run_command, run_mptrain
from support.runs import run_cli
from support.sweeps import job_dirs, read_report, run_sweep


# ----------------------------------------------------------------------------------------- helpers
def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]


@functools.cache
def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


# ---------------------------------------------------------------------------------------- bad input
# (overrides, texts the error line must contain, found only at train time after Hydra started)
BAD_INPUTS = [
    pytest.param(["precision=fp12"], ["precision=fp12"], False, id="unknown-precision"),
    pytest.param(["foo=1"], ["foo: unknown key"], False, id="unknown-key"),
    pytest.param(["batch_size=abc"], ["batch_size", "abc"], False, id="wrong-type"),
    pytest.param(["optimizer.lr=0"], ["optimizer.lr="], False, id="lr-zero"),
    pytest.param(["batch_size=0"], ["batch_size=0"], False, id="batch-size-zero"),
    pytest.param(["grad_accum_steps=0"], ["grad_accum_steps=0"], False, id="grad-accum-zero"),
    pytest.param(
        ["precision.scaler.growth_factor=1"],
        ["precision.scaler.growth_factor="],
        False,
        id="growth-factor-one",
    ),
    pytest.param(
        ["precision.scaler.backoff_factor=1.5"],
        ["precision.scaler.backoff_factor=1.5"],
        False,
        id="backoff-factor-above-one",
    ),
    pytest.param(
        ["precision.scaler.growth_interval=0"],
        ["precision.scaler.growth_interval=0"],
        False,
        id="growth-interval-zero",
    ),
    pytest.param(
        ["dataset=cifar10"],
        ["dataset.root='", "/data/cifar-10-batches-py"],
        True,
        id="cifar10-files-missing",
    ),
    pytest.param(["device=cuda"], ["device='cuda'"], True, id="cuda-not-visible"),
]


@pytest.mark.parametrize(("overrides", "named", "at_train_time"), BAD_INPUTS)
def test_bad_input_exits_2_with_one_error_line_and_no_report(
    tmp_path, monkeypatch, overrides, named, at_train_time
):
    if overrides == ["device=cuda"] and cuda_available():
        pytest.skip("a CUDA device is visible: device=cuda is valid here")

    result = run_cli(overrides, tmp_path, monkeypatch, jobs=True)  # cli.main, in this process

    assert result.code == 2, result
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result
    assert lines[0].startswith("mptrain: error: ")
    assert lines[0].removeprefix("mptrain: error: ").strip()
    for text in named:
        assert text in lines[0]
    assert list(tmp_path.rglob("report.json")) == []
    assert list(tmp_path.rglob("metrics.jsonl")) == []
    if not at_train_time:
        assert not (tmp_path / "outputs").exists(), "Hydra started a run for rejected input"


# ---------------------------------------------------------------------------------- tiny real run
@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    cwd = tmp_path_factory.mktemp("tiny_run")
    result = run_mptrain(
        cwd,
        "model=mlp",
        "max_steps=12",
        "log_every=4",
        "eval_every=6",
        "progress=false",
        "hydra.run.dir=run",
    )
    return result, cwd / "run"


@pytest.mark.slow
def test_tiny_run_exits_0(tiny_run):
    result, _ = tiny_run
    assert result.returncode == 0, describe(result)


@pytest.mark.slow
def test_tiny_run_reports_completed(tiny_run):
    _, run_dir = tiny_run
    report = read_report(run_dir)
    assert report["status"] == "completed"
    assert report["model"]["name"] == "mlp"
    assert (run_dir / "report.md").read_text(encoding="utf-8").strip()


@pytest.mark.slow
def test_tiny_run_logs_every_4_steps_and_evaluates_every_6(tiny_run):
    _, run_dir = tiny_run
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows if r["kind"] == "train"] == [4, 8, 12]
    assert [r["step"] for r in rows if r["kind"] == "eval"] == [6, 12]
    assert len(rows) == 5


@pytest.mark.slow
def test_tiny_run_saves_the_composed_config(tiny_run):
    import yaml

    _, run_dir = tiny_run
    saved = yaml.safe_load((run_dir / ".hydra" / "config.yaml").read_text(encoding="utf-8"))
    assert saved["model"]["name"] == "mlp"
    assert saved["max_steps"] == 12
    assert saved["eval_every"] == 6


# ---------------------------------------------------------------------------------- console script
@pytest.mark.slow
def test_console_script_help_exits_0(tmp_path):
    script = Path(sys.executable).parent / "mptrain"
    assert script.is_file(), f"no console script at {script}"

    result = run_command(tmp_path, str(script), "--help")

    assert result.returncode == 0, describe(result)
    assert result.stdout.startswith("usage: mptrain")
    assert (
        "precision  auto*, fp32, fp16, bf16, fp8, mxfp8, nvfp4, fp16_noscale, fp16_pure, bf16_pure"
        in result.stdout
    )
    assert "schema" not in result.stdout
    assert not (tmp_path / "outputs").exists()


# What a composition-only command may load: composing needs the schemas, not the builders.
NO_TORCH = """
import sys
from mptrain.cli import app as cli
try:
    cli.main(sys.argv[1:])
except SystemExit as exit:
    assert exit.code in (0, None), exit.code
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "torchvision", "matplotlib"))
assert not heavy, heavy[:5]
"""


@pytest.mark.slow
@pytest.mark.parametrize("args", [["--help"], ["--cfg", "job"], ["model=mlp", "--cfg", "job"]])
def test_composing_imports_no_torch(tmp_path, args):
    """``mptrain --help`` and ``--cfg job`` answer without importing torch or any builder."""
    result = run_command(tmp_path, sys.executable, "-c", NO_TORCH, *args)
    assert result.returncode == 0, describe(result)
    assert not (tmp_path / "outputs").exists()


# ----------------------------------------------------------------------------------------- sweep
@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    return run_sweep(
        tmp_path_factory.mktemp("sweep"),
        "precision=fp32,bf16",
        "model=mlp",
        "max_steps=6",
        "progress=false",
    )


@pytest.mark.slow
def test_sweep_exits_0(sweep):
    result, _ = sweep
    assert result.returncode == 0, describe(result)


@pytest.mark.slow
def test_sweep_writes_one_report_per_job_with_its_precision(sweep):
    _, sweep_dir = sweep
    jobs = job_dirs(sweep_dir)  # named <job number>_<overrides>
    assert [p.name.split("_", 1)[0] for p in jobs] == ["0", "1"]
    precisions = [read_report(job)["precision"] for job in jobs]
    assert [p["effective"] for p in precisions] == ["fp32", "bf16"]
    assert [p["requested"] for p in precisions] == ["fp32", "bf16"]


REPO_ROOT = Path(__file__).resolve().parents[2]

# `python -m mptrain` from a checkout's root after a non-editable `pip install .`: the source tree's
# mptrain/ comes first on sys.path and shadows the installed package (the editable finder here is
# removed to be in that situation).
_FROM_SOURCE_TREE = (
    "import runpy, sys; "
    "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f).lower()]; "
    "sys.argv[0] = 'mptrain'; runpy.run_module('mptrain', run_name='__main__')"
)


def test_python_m_mptrain_works_from_the_repository_root():
    result = run_command(REPO_ROOT, sys.executable, "-c", _FROM_SOURCE_TREE, "--cfg", "job")
    assert result.returncode == 0, describe(result)
    assert "model:" in result.stdout and "recipe:" in result.stdout


def test_only_a_command_line_run_freezes_the_collector_before_exit(tmp_path):
    """main() from the command line skips the interpreter's final collections (gc.freeze);
    called from Python (argv given), it leaves the caller's collector alone."""
    import gc

    from mptrain.cli import app as cli

    frozen = gc.get_freeze_count()
    cli.main(["model=mlp", "max_steps=1", "epochs=null", f"hydra.run.dir={tmp_path / 'run'}"])
    assert gc.get_freeze_count() == frozen
    assert (tmp_path / "run" / "report.json").is_file()


MAX_FRAMES_TO_BACKWARD = 6  # issue 41: torchtitan has 5 from its entry point to backward()


def mptrain_frames_at_backward(args: list[str], monkeypatch) -> list[str]:
    """``mptrain args`` in this process; the frames of mptrain on the stack when the first
    training step calls ``backward`` (``module/path:function``, outermost first)."""
    import traceback

    import torch

    from mptrain.cli import app as cli

    package = str(Path(cli.__file__).resolve().parents[1])
    seen: list[list[str]] = []
    backward = torch.autograd.backward

    def recording_backward(*a, **k):
        frames = [
            f"{Path(f.filename).resolve().relative_to(package).with_suffix('')}:{f.name}"
            for f in traceback.extract_stack()[:-1]
            if Path(f.filename).resolve().is_relative_to(package)
        ]
        if not seen and "train/loop:take_step" in frames:  # not the memory accounting's step
            seen.append(frames)
        return backward(*a, **k)

    monkeypatch.setattr(torch.autograd, "backward", recording_backward)
    cli.main(args)
    return seen[0]


def test_the_console_script_reaches_backward_in_at_most_six_mptrain_frames(tmp_path, monkeypatch):
    """The call path ARCHITECTURE.md draws, read off the stack at the first backward: the console
    script, Hydra's task, the job, the loop, the step; nothing in between but Hydra's frames."""
    monkeypatch.chdir(tmp_path)
    args = ["model=mlp", "max_steps=1", "epochs=null", "progress=false", "hydra.run.dir=run"]
    frames = mptrain_frames_at_backward(args, monkeypatch)
    assert frames == [
        "cli/app:main",
        "cli/launch:run_job",
        "train/job:train",
        "train/job:execute",
        "train/loop:train_loop",
        "train/loop:take_step",
    ], frames
    assert len(frames) <= MAX_FRAMES_TO_BACKWARD


def test_a_sweeps_job_reaches_backward_through_one_more_frame(tmp_path, monkeypatch):
    """Under -m the sweep's guard (cli.launch._sweep: every job failed, then the sweeper) sits
    between the console script and Hydra: seven frames."""
    monkeypatch.chdir(tmp_path)
    args = ["-m", "model=mlp", "max_steps=1", "epochs=null", "progress=false", "hydra.sweep.dir=s"]
    frames = mptrain_frames_at_backward(args, monkeypatch)
    assert frames[:2] == ["cli/app:main", "cli/launch:_sweep"], frames
    assert len(frames) == MAX_FRAMES_TO_BACKWARD + 1
