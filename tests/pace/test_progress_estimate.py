"""A run is never silent for long: its first progress line after step 1, lines by the clock
(mptrain.pace.clocks.now) between log rows, the estimate of the whole run, and the note of a
precision known to be far slower than FP32 here (FP16 convolutions on a CPU), given after the
first step with FP32's step measured on the same model, without changing the run; while a step
runs long, the heartbeat (the loop tells the display when each step starts)."""

from __future__ import annotations

import io
import re
import textwrap

import pytest
import torch
from rich.console import Console
from support.runs import NoFigure, run_cli, tiny_run

import mptrain.pace.clocks
import mptrain.pace.progress
import mptrain.train.job
from mptrain.pace.progress import ProgressDisplay
from mptrain.pace.slowpath import FP16_CONV_ON_CPU, check_slow_path, time_fp32_step
from mptrain.platform.distributed import DistContext
from mptrain.train.build import build_run, prepare_run, resolve_run
from mptrain.train.job import train
from mptrain.train.loop import LoopHooks, train_loop

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


class NoTicks:
    """A heartbeat ticker that never ticks: for a clock that moves each time it is read."""

    def __init__(self, every_s: float, tick) -> None:
        pass

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass


def test_between_log_rows_the_clock_gives_lines(tmp_path, monkeypatch):
    monkeypatch.setattr(mptrain.train.job, "FigureWorker", NoFigure)
    monkeypatch.setattr(mptrain.pace.progress, "Ticker", NoTicks)
    seconds = iter(range(0, 10_000, 40))  # each read of the clock: 40 s later
    monkeypatch.setattr(mptrain.pace.clocks, "now", lambda: float(next(seconds)))
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


class Calls:
    """An observer that records the loop's calls in order."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def on_step_start(self, step: int) -> None:
        self.calls.append(f"start {step}")

    def on_step(self, state) -> None:
        self.calls.append(f"done {state.step}")

    def on_log(self, row: dict) -> None:
        self.calls.append(f"row {row['step']}")

    def on_eval(self, row: dict) -> None:
        self.calls.append(f"eval {row['step']}")

    def on_warning(self, message: str) -> None:
        pass


def test_the_loop_tells_observers_each_step_start_before_the_step():
    run = prepare_run(tiny_run("max_steps=3", "log_every=2", "eval_every=2"))
    observer = Calls()
    train_loop(run, LoopHooks(observers=(observer,)))
    assert observer.calls == [
        "start 1", "done 1",
        "start 2", "row 2", "done 2", "eval 2",
        "start 3", "row 3", "done 3", "eval 3",
    ]  # fmt: skip


# A model whose training forward under autocast (fp16: the run's own steps, not the FP32 step
# timed before them) waits until the progress display's heartbeat has spoken: the first step
# outlasts the heartbeat's wait whatever the machine's speed, with no sleep of a fixed length.
SLOW_STEP_NET = textwrap.dedent(
    """
    import threading

    import torch
    from torch import nn

    HEARD = threading.Event()


    class SlowStepNet(nn.Module):
        def __init__(self, in_channels, num_classes):
            super().__init__()
            self.conv = nn.Conv2d(in_channels, 4, kernel_size=3, padding=1)
            self.head = nn.Linear(4, num_classes)

        def forward(self, images):
            if self.training and torch.is_autocast_enabled("cpu"):
                HEARD.wait(timeout=120)
            return self.head(self.conv(images).relu().mean(dim=(2, 3)))
    """
)


@pytest.mark.slow
def test_a_long_first_step_is_heard_in_the_log_file_before_its_line(tmp_path, monkeypatch):
    (tmp_path / "slow_step.py").write_text(SLOW_STEP_NET)
    monkeypatch.syspath_prepend(str(tmp_path))
    import slow_step  # the module the run imports: its HEARD is the one set below

    monkeypatch.setattr(ProgressDisplay, "FIRST_BEAT_S", 0.2)  # documented class attributes
    monkeypatch.setattr(ProgressDisplay, "BEAT_POLL_S", 0.02)
    beat = ProgressDisplay.beat

    def beat_then_tell(display: ProgressDisplay) -> None:
        beat(display)
        if display.heartbeats:
            slow_step.HEARD.set()

    monkeypatch.setattr(ProgressDisplay, "beat", beat_then_tell)
    args = [
        "model=custom",
        "model._target_=slow_step.SlowStepNet",
        "precision=fp16",
        "device=cpu",
        "threads=1",
        "max_steps=2",
        "log_every=50",
        "checkpoint.enabled=false",
        "hydra.run.dir=run",
    ]
    outcome = run_cli(args, tmp_path, monkeypatch, jobs=True)
    assert outcome.code == 0, outcome
    log = (tmp_path / "run" / "mptrain.log").read_text(encoding="utf-8")
    story = [line.split(" - ", 1)[-1] for line in log.splitlines()]
    heard = next(i for i, line in enumerate(story) if " running for " in line)
    first = next(i for i, line in enumerate(story) if line.startswith("train step=1/2 epoch=0"))
    assert heard < first, log
    assert re.fullmatch(
        r"train step=1/2 running for [\d.]+ s \(first step, one-off costs included\): the whole "
        r"run takes at least [\d.]+ s at this pace",
        story[heard],
    ), story[heard]
    assert re.fullmatch(
        rf"note: {FP16_CONV_ON_CPU}: step 1 has run [\d.]+ s in fp16 so far vs [\d.e-]+ s for a "
        r"whole fp32 step \(≥[\d.]+×\); precision=(bf16 \(or fp32\)|fp32) is the fast choice here",
        story[heard + 1],
    ), story[heard + 1]
    assert any(line.startswith(f"note: {FP16_CONV_ON_CPU}: one step took") for line in story)
