"""A run is never silent for long: its first progress line after step 1, lines by the clock
(mptrain.train.cadence.now) between log rows, the estimate of the whole run, and the note of a
precision known to be far slower than FP32 here (FP16 convolutions on a CPU), given after the
first step with FP32's step measured on the same model, without changing the run."""

from __future__ import annotations

import io
import re

import torch
from conftest import NoFigure, tiny_run
from rich.console import Console

import mptrain.train.cadence
import mptrain.train.job
from mptrain.platform.distributed import DistContext
from mptrain.train.build import build_run, resolve_run
from mptrain.train.job import train
from mptrain.train.slowpath import FP16_CONV_ON_CPU, check_slow_path, time_fp32_step

TINY_CNN = (
    "model=cnn",
    "model.widths=[4]",
    "dataset=synthetic",
    "dataset.num_train=64",
    "dataset.num_val=16",
    "dataset.channels=1",
    "dataset.image_size=8",
    "batch_size=8",
)


def _built(*overrides: str):
    cfg = tiny_run(*overrides)
    device, policy, tf32 = resolve_run(cfg, DistContext())
    return build_run(cfg, device, policy, tf32, DistContext())


def test_fp16_convolutions_on_a_cpu_get_the_note_with_the_measured_ratio(tmp_path, monkeypatch):
    monkeypatch.setattr(mptrain.train.job, "FigureWorker", NoFigure)
    out = io.StringIO()
    cfg = tiny_run(
        *TINY_CNN,
        "precision=fp16",
        "max_steps=6",
        "log_every=50",
        "progress=true",
        "checkpoint.enabled=false",
    )
    report = train(cfg, tmp_path, Console(file=out, width=100_000, soft_wrap=True))

    text = out.getvalue()
    note = re.search(
        rf"note: {FP16_CONV_ON_CPU}: one step took [\d.]+ s in fp16 vs [\d.e-]+ s in fp32 "
        r"\(([\d.]+)×\); precision=(bf16 \(or fp32\)|fp32) is the fast choice here",
        text,
    )
    assert note, text
    assert report.precision.effective == "fp16"  # told, not changed
    assert report.precision.notes[-1] == note.group(0).removeprefix("note: ")
    lines = text.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("train step="))
    assert lines[first].startswith("train step=1/6 epoch=0 elapsed=")
    assert lines[first].endswith("(first step, one-off costs included)")
    assert re.search(r"^about .+ for 6 steps at .+ \(measured over steps 2-5\)$", text, re.M)
    estimate = report.time.estimate
    assert estimate["measured_steps"] == [2, 5] and estimate["steps"] == 6
    assert estimate["actual_steps"] == 6 and estimate["actual_s"] > 0
    assert "| estimate |" in (tmp_path / "report.md").read_text()


def test_between_log_rows_the_clock_gives_lines(tmp_path, monkeypatch):
    monkeypatch.setattr(mptrain.train.job, "FigureWorker", NoFigure)
    seconds = iter(range(0, 10_000, 40))  # each read of the clock: 40 s later
    monkeypatch.setattr(mptrain.train.cadence, "now", lambda: float(next(seconds)))
    out = io.StringIO()
    cfg = tiny_run("max_steps=6", "log_every=50", "progress=true", "checkpoint.enabled=false")
    train(cfg, tmp_path, Console(file=out, width=100_000, soft_wrap=True))
    steps = re.findall(r"^train step=(\d)/6 epoch=0 elapsed=\S+ s/step=\d+ ", out.getvalue(), re.M)
    assert steps == ["1", "2", "3", "4", "5"], out.getvalue()  # step 6: its log row's line


def test_no_note_for_a_linear_model_or_another_precision():
    assert check_slow_path(_built("precision=fp16", "max_steps=1")) is None  # model=mlp
    assert check_slow_path(_built(*TINY_CNN, "precision=bf16", "max_steps=1")) is None


def test_timing_fp32_leaves_the_run_as_it_was():
    run = _built(*TINY_CNN, "precision=fp16", "max_steps=1", "model.dropout=0.5")
    weights = [p.detach().clone() for p in run.model.parameters()]
    buffers = [b.clone() for b in run.model.buffers()]  # batch-norm statistics
    rng = torch.get_rng_state()
    assert time_fp32_step(run) > 0
    assert all(torch.equal(a, b) for a, b in zip(weights, run.model.parameters(), strict=True))
    assert all(torch.equal(a, b) for a, b in zip(buffers, run.model.buffers(), strict=True))
    assert torch.equal(rng, torch.get_rng_state())
    assert not run.optimizer.state and all(p.grad is None for p in run.model.parameters())
