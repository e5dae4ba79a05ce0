"""Figures: the run figure drawn in a child process (plots.FigureWorker) equals the one drawn here,
a failure there is one line, and an interrupted job still gets its figure."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from support.processes import SUBPROCESS_TIMEOUT_S

from mptrain.output import plots
from mptrain.output.plots import FigureWorker, plot_run, plot_sweep

ROWS = [
    *({"kind": "train", "step": s, "loss": 2.0 / s, "loss_scale": 2.0**16} for s in range(1, 40)),
    {"kind": "eval", "step": 20, "val_accuracy": 0.9},
    {"kind": "eval", "step": 39, "val_accuracy": 0.95},
]


def test_the_worker_draws_what_this_process_draws(tmp_path):
    here = plot_run(ROWS, "fp16 mlp", tmp_path / "here.png")
    with FigureWorker() as worker:
        there = worker.plot_run(ROWS, "fp16 mlp", tmp_path / "there.png")
    assert there.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert there.read_bytes() == here.read_bytes()


@pytest.fixture
def drawn(monkeypatch) -> list:
    """The matplotlib figures plots would save, kept open to be read (no PNG is written)."""
    figures = []
    plt = plots._pyplot()
    monkeypatch.setattr(plots, "_save", lambda fig, path: figures.append(fig))
    yield figures
    monkeypatch.undo()
    for fig in figures:
        plt.close(fig)


def test_a_short_sweeps_single_points_are_drawn_as_dots(drawn, tmp_path):
    curves = {f"precision={p}": [{"kind": "train", "step": 5, "loss": 2.0 + i}]
              for i, p in enumerate(("fp32", "bf16"))}  # fmt: skip
    plot_sweep(curves, "sweep", tmp_path / "sweep_loss.png")
    (ax,) = drawn[0].axes
    assert [line.get_label() for line in ax.lines] == list(curves)
    assert all(line.get_marker() == "o" for line in ax.lines), "a one-point line draws nothing"


@pytest.mark.slow
def test_the_run_figure_has_no_loss_scale_panel_when_nothing_was_scaled(drawn, tmp_path):
    unscaled = [{k: v for k, v in row.items() if k != "loss_scale"} for row in ROWS]
    plot_run(unscaled, "bf16 mlp", tmp_path / "curves.png")
    plot_run(ROWS, "fp16 mlp", tmp_path / "curves.png")
    titles = [[ax.get_title() for ax in fig.axes] for fig in drawn]
    assert titles == [
        ["training loss", "validation accuracy (%)"],
        ["training loss", "validation accuracy (%)", "loss scale"],
    ]
    assert not [t for ax in drawn[0].axes for t in ax.texts], "no 'no loss scaling' placeholder"


def test_a_failure_in_the_worker_is_one_line(tmp_path):
    with FigureWorker() as worker, pytest.raises(RuntimeError) as caught:
        worker.plot_run(ROWS, "t", tmp_path / "missing" / "curves.png")
    assert "figure process failed" in str(caught.value)
    assert "No such file or directory" in str(caught.value)
    assert "\n" not in str(caught.value)


def test_an_unused_worker_is_gone_when_the_job_ends():
    with FigureWorker() as worker:
        child = worker._child
    assert child.returncode is not None


@pytest.mark.slow
def test_ctrl_c_to_the_job_still_draws_its_figure(tmp_path):
    """A terminal's Ctrl-C signals the whole process group; the worker is in its own session."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "mptrain", "model=mlp", "device=cpu", "max_steps=100000",
           "epochs=null", "log_every=5", f"hydra.run.dir={run_dir}"]  # fmt: skip
    job = subprocess.Popen(cmd, cwd=tmp_path, start_new_session=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        deadline = time.monotonic() + SUBPROCESS_TIMEOUT_S
        while (
            not (run_dir / "metrics.jsonl").is_file()
            or "train" not in (run_dir / "metrics.jsonl").read_text()
        ):
            assert job.poll() is None and time.monotonic() < deadline, job.stderr.read()
            time.sleep(0.05)
        os.killpg(job.pid, signal.SIGINT)
        _, err = job.communicate(timeout=SUBPROCESS_TIMEOUT_S)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 130, err
    report = json.loads((run_dir / "report.json").read_text())
    assert report["status"] == "interrupted"
    assert report["figure"] == "curves.png" and (run_dir / "curves.png").stat().st_size > 1000
