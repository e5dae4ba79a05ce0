"""One short measured run of a candidate precision (:func:`short_run`: losses per step, step
times, skipped steps), the nudge that sets FP32's chaos bar, and the budget every run is
charged against (:class:`Budget`, :class:`Cost`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from mptrain.commands import bench
from mptrain.config.base import ConfigError
from mptrain.config.run import RunConfig
from mptrain.precision.formats import LAYER_FORMATS
from mptrain.train.build import prepare_run
from mptrain.train.loop import LoopHooks, train_loop
from mptrain.train.monitor import LoopObserver

PILOT_STEPS = 6  # a run's first steps pay one-off costs (kernel set-up, lazy imports), so
PILOT_WARMUP = 3  # 3 untimed steps, then 3 timed ones
SCOUT_SAMPLES = 4  # a scout step's batch: cheap, and enough to extrapolate a full step from
MIN_TIMED_S = 0.5  # the fastest precision's timed seconds per measurement, at least
REP_MARGIN = 1.5  # a busy machine runs slower than the estimates taken a minute earlier
# The share of the budget left after the fidelity runs that the speed repetitions may fill: longer
# timing windows average out a shared machine's bursts (the rest is the estimates' safety margin).
SPEED_SHARE = 0.5
RESERVE_S = 5.0  # kept back for the report and the figure (matplotlib's import alone ~1.8 s)
NOT_COMPARED = "not compared: the FP32 reference run did not fit"
# The Linear layers that compute in a low-precision format of their own: every registered format's
# (FP8's Float8Linear, the block-scaled formats' BlockLinear).
FORMAT_LAYERS = tuple(dict.fromkeys(t for f in LAYER_FORMATS.values() for t in f.layer_types))


def format_layers(model: nn.Module) -> dict[str, nn.Module]:
    """``model``'s layers of :data:`FORMAT_LAYERS`, by name, in the model's order."""
    return {name: m for name, m in model.named_modules() if isinstance(m, FORMAT_LAYERS)}


# ------------------------------------------------------------------------------ one short run
class _Losses(LoopObserver):
    """Loop observer keeping every logged training loss (``log_every=1``: one per step)."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_log(self, row: dict[str, Any]) -> None:
        self.losses.append(row["loss"])


@dataclass
class Trial:
    """One short training run: its losses, what went wrong, what it measured and cost."""

    label: str
    steps: int  # optimizer steps run (fewer than asked when the deadline cut it short)
    losses: list[float]
    skipped_steps: int
    diverged: str | None
    step_time_s: float | None  # after the warm-up steps; None when none was timed
    wall_s: float  # build + steps
    cut_short: bool = False
    figures: dict[str, Any] = field(default_factory=dict)  # bench's figures (run_figures)
    fp8: dict[str, Any] | None = None  # the FP8 layer report, for precision=fp8
    blocks: dict[str, Any] | None = None  # the block-scaled layer report (mxfp8, nvfp4, ...)
    converted: int = 0  # Linear layers in a low-precision format (FORMAT_LAYERS)


def nudge_weights(model: torch.nn.Module) -> None:
    """Move every floating-point parameter by one FP32 epsilon relative (× (1 ± 2⁻²³), the sign
    drawn from a fixed generator; one or two ulps): about the smallest perturbation there is, to
    see how far the training forks on its own."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point():
                sign = torch.randint(0, 2, p.shape, generator=generator).to(p) * 2 - 1
                p.mul_(1 + sign * 2.0**-23)


def short_run(
    cfg: RunConfig,
    steps: int,
    warmup: int,
    deadline: float | None = None,
    per_step: bool = True,
    nudge: bool = False,
) -> Trial:
    """Build ``cfg`` fresh (seeded: the same initial weights and batches for every precision) and
    train ``steps`` optimizer steps — fewer when ``time.perf_counter()`` passes ``deadline``
    (checked after each step: at least one runs). ``per_step``: log the loss every step (a host
    read per step; off for speed measurements). ``nudge``: the initial weights moved by one ulp
    (:func:`nudge_weights`). No evaluation, nothing written to disk.

    Raises ConfigError when the precision cannot run this model (FP8 without an eligible layer).
    """
    started = time.perf_counter()
    cfg = dataclasses.replace(
        cfg,
        max_steps=steps + 1,  # one more than run: the loop's final evaluation never comes
        epochs=None,
        log_every=1 if per_step else steps,
        eval_every=10**9,
        probe_every=None,  # the update probe copies every parameter: not needed here
        throughput_warmup_steps=min(warmup, steps - 1),
        progress=False,
    )
    run = prepare_run(cfg)
    if nudge:
        nudge_weights(run.model)
    losses = _Losses()

    def stop() -> bool:
        return run.state.step >= steps or (deadline is not None and time.perf_counter() > deadline)

    state = train_loop(run, LoopHooks(observers=(losses,), stop_requested=stop))
    t = run.monitor.throughput
    return Trial(
        label=run.precision.policy.label,
        steps=state.step,
        losses=losses.losses,
        skipped_steps=len(state.skipped_steps),
        diverged=run.monitor.diverged_reason,
        step_time_s=t.measured_time_s / t.measured_steps if t.measured_steps else None,
        wall_s=time.perf_counter() - started,
        cut_short=state.step < steps and run.monitor.diverged_reason is None,
        figures=bench.run_figures(run),
        fp8=run.precision.fp8,
        blocks=run.precision.blocks.section,
        converted=len(format_layers(run.model)),
    )


# ------------------------------------------------------------------------------ the budget
@dataclass(frozen=True)
class Cost:
    """What a run of this precision costs here, from its pilot."""

    overhead_s: float  # build + first step + final evaluation
    step_s: float

    def of(self, steps: int) -> float:
        return self.overhead_s + steps * self.step_s


def cost_of(trial: Trial) -> Cost:
    """A run's cost model from a measured ``trial``: its timed steps' mean and the rest."""
    step_s = trial.step_time_s if trial.step_time_s is not None else trial.wall_s / trial.steps
    return Cost(max(0.0, trial.wall_s - trial.steps * step_s), step_s)


@dataclass
class Budget:
    """``advise.budget_s`` seconds from ``started``."""

    total_s: float
    started: float = field(default_factory=time.perf_counter)

    def elapsed_s(self) -> float:
        return time.perf_counter() - self.started

    def left_s(self) -> float:
        return self.total_s - self.elapsed_s() - RESERVE_S

    def deadline(self) -> float:
        """When measuring must stop (``time.perf_counter()``): the report's reserve is kept."""
        return self.started + self.total_s - RESERVE_S


def estimated(need_s: float, how: str, left_s: float) -> str:
    """Why a part is skipped: ``estimated 12 s{how}, 3 s of advise.budget_s left``."""
    return f"estimated {need_s:.0f} s{how}, {max(left_s, 0):.0f} s of advise.budget_s left"


# timings' fixed costs, which the budget counts but cannot cut short
START_UP = "start-up (config, imports)"  # from advise_main's call to the first measurement
WARM_UP = "process warm-up"  # the first run's one-off set-up (see measure.run_pilots)
REPORT = "report (figure, files)"
IN_PROGRESS = "in progress"  # timings' key naming the part being measured (until it is done)


@contextlib.contextmanager
def timed_part(timings: dict[str, Any], part: str) -> Iterator[None]:
    """Measure ``part``: while it runs ``timings[IN_PROGRESS]`` names it (what an interrupt cut
    short); once it is done its seconds go to ``timings[part]``. A part that raises records
    nothing: it was not measured."""
    started = time.perf_counter()
    timings[IN_PROGRESS] = part
    yield
    timings[part] = time.perf_counter() - started
    del timings[IN_PROGRESS]


class OutOfBudget(ConfigError):
    """A speed measurement the budget cut short before it timed a step (measure_reps records
    the reason and does not measure that precision again)."""
