"""What a run measures and watches while it trains, kept out of the training loop.

The loop hands every step's :class:`StepOutcome` to :meth:`Monitor.after_step`, which

- counts throughput after warm-up (the :class:`Stopwatch` pauses around evaluation) and data wait;
- averages the gradient/update probes;
- records the loss scale's history (:class:`ScaleStats`) and feeds the per-step health watch
  (:class:`ScaleHealth`): warnings once per kind, divergence with a reason;
- searches for the module that first produced a non-finite value when the run diverges
  (re-running the batch with hooks, once per run);
- writes a metrics row to the observers every ``log_every`` steps (the loop's logging sync point),
  naming the precision that computed it;
- keeps the loss of every step in a :class:`LossWindow` when one is set (a precision schedule's
  steps around its switch).

It also resets and reads the device's peak-memory counter. Its state (scale history, health,
probe sums) is saved in checkpoints through :meth:`Monitor.state_dict` and restored with
:meth:`Monitor.load_state_dict`, so a resumed run reports the figures of the whole run.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from mptrain.config.sections import NumericsConfig
from mptrain.platform import hardware

if TYPE_CHECKING:
    from mptrain.train.state import LoopState
    from mptrain.train.threads import ThreadTuner
from mptrain.pace.clocks import Interval, LoopTime, Stopwatch, Throughput
from mptrain.train.health import CulpritFinder, Probes, ScaleHealth, ScaleStats, describe_culprit


class LoopObserver(Protocol):
    """Receives what the run measured: the metrics log and the progress display implement it.
    A subclass inherits a call that does nothing for each method it does not define."""

    def on_step(self, state: LoopState) -> None: ...

    def on_log(self, row: dict[str, Any]) -> None: ...

    def on_eval(self, row: dict[str, Any]) -> None: ...

    def on_warning(self, message: str) -> None: ...

    # Optional: ``on_step_start(step)``, called as the loop starts step ``step`` (1-based).


@dataclass
class StepOutcome:
    """What one optimizer step produced, as the loop hands it to the monitor."""

    loss: torch.Tensor  # the effective batch's loss, on the device (not read yet)
    skipped: bool  # the loss scaler skipped the update (inf/NaN gradients)
    scale: float | None  # the loss scale after the step's update; None without loss scaling
    grad_norm: torch.Tensor | None  # unscaled FP32 norm, when clipping or logging needed it
    batch: tuple[torch.Tensor, torch.Tensor]  # the last micro-batch, for the culprit search
    data_wait_s: float = 0.0  # time spent waiting for this step's micro-batches
    zero_grads: float | None = None  # probe: share of gradient values that were zero
    updates_lost: float | None = None  # probe: share of non-zero gradients the update lost
    states_lost: dict[str, float] | None = None  # probe: the same per optimizer state
    loss_finite: bool = True  # with loss scaling: the loss was finite on every rank (read per step)


@dataclass
class LossWindow:
    """The train loss of every step from ``first`` to ``last`` (a precision schedule's steps
    around its switch: :mod:`mptrain.train.switch`). Losses stay on the device until
    :meth:`values` reads them; a checkpoint holds them as floats, so a resumed run reports the
    same figures as an uninterrupted one."""

    first: int
    last: int
    losses: dict[int, torch.Tensor | float] = field(default_factory=dict)

    def record(self, step: int, loss: torch.Tensor) -> None:
        if self.first <= step <= self.last:
            self.losses[step] = loss

    def values(self) -> dict[int, float]:
        """Step -> loss, read from the device (one read for all steps not read yet)."""
        unread = [step for step, loss in self.losses.items() if isinstance(loss, torch.Tensor)]
        if unread:
            read = torch.stack([self.losses[s].float().reshape(()) for s in unread]).tolist()
            self.losses.update(zip(unread, read, strict=True))
        return {step: self.losses[step] for step in sorted(self.losses)}


@dataclass(frozen=True)
class MonitorSettings:
    """How the monitor measures and when it warns or stops (from the run's config)."""

    samples_per_step: int  # batch size x micro-batches x world size
    tokens_per_sample: int | None = None  # language models: the window length
    precision: str = "fp32"  # the effective precision's name, for messages
    throughput_warmup_steps: int = 5
    health: NumericsConfig = field(default_factory=NumericsConfig)
    find_culprit: bool = True  # single process only: the re-run would call collectives


class Monitor:
    """Measures the run step by step and decides warnings and divergence (see module doc).

    Call order per run: :meth:`begin`, then per step :meth:`before_step` and :meth:`after_step`,
    evaluations and checkpoint writes inside :meth:`paused`, and :meth:`end`. ``diverged_reason`` is set when the run
    must stop; ``culprit`` holds the first non-finite module once searched for.
    """

    def __init__(
        self,
        settings: MonitorSettings,
        device: torch.device,
        culprit_finder: CulpritFinder | None = None,
    ) -> None:
        self.settings = settings
        self.device = device
        self.culprit_finder = culprit_finder
        self.throughput = Throughput()
        self.time = LoopTime()
        self._loop_started: float | None = None
        self.probes = Probes()
        self.scale_stats: ScaleStats | None = None
        self.health = ScaleHealth(settings.health)
        self.scale: float | None = None  # the current loss scale, None without loss scaling
        self.culprit: dict[str, Any] | None = None
        self.diverged_reason: str | None = None
        self.memory_kind: str | None = None  # what peak memory measures; None before begin()
        self.stopwatch = Stopwatch(device, self.throughput)
        self.observers: tuple[LoopObserver, ...] = ()
        self._step_starts: tuple[Callable[[int], None], ...] = ()  # observers' on_step_start
        self._optimizer: torch.optim.Optimizer | None = None
        self._interval = Interval(started=time.perf_counter())
        self._first_step: int | None = None  # the step the loop started from (before_step)
        # threads=auto on a CPU: times each step to pick the thread count (mptrain.train.threads)
        self.threads: ThreadTuner | None = None
        self.loss_window: LossWindow | None = None  # set by a precision schedule

    # ------------------------------------------------------------------------------ lifecycle
    def begin(
        self,
        scaler: torch.amp.GradScaler,
        optimizer: torch.optim.Optimizer,
        observers: tuple[LoopObserver, ...],
    ) -> None:
        """Before the first step: read the loss scale, reset the peak-memory counter."""
        self.observers = observers
        # Told as each step starts, by those that want it (the progress display's heartbeat)
        self._step_starts = tuple(o.on_step_start for o in observers if hasattr(o, "on_step_start"))
        self._optimizer = optimizer
        self.memory_kind = hardware.reset_peak_memory(self.device)
        self._use_scaler(scaler)
        self._interval.restart()
        self._loop_started = time.perf_counter()
        self._first_step = None

    def _use_scaler(self, scaler: torch.amp.GradScaler) -> None:
        """Read the loss scale (None without loss scaling); start its history at the first one."""
        self.scale = scaler.get_scale() if scaler.is_enabled() else None
        if self.scale_stats is None and self.scale is not None:
            s = self.scale
            self.scale_stats = ScaleStats(initial=s, final=s, min=s, max=s)

    def switch_precision(
        self, precision: str, scaler: torch.amp.GradScaler, culprit_finder: CulpritFinder
    ) -> None:
        """A precision schedule's switch between two steps: rows and messages name ``precision``,
        the loss scale is ``scaler``'s from now on (the history of an earlier phase's scale stays),
        a divergence's culprit is searched for under the new precision."""
        self.settings = dataclasses.replace(self.settings, precision=precision)
        self.culprit_finder = culprit_finder
        self._use_scaler(scaler)

    def before_step(self, steps_done: int) -> None:
        """Start timing after this process's first ``throughput_warmup_steps`` steps: counted
        from where the loop started, so a resumed run (at step 1000) is timed too. Observers
        with ``on_step_start`` are told that step ``steps_done + 1`` starts."""
        if self._first_step is None:
            self._first_step = steps_done
        if steps_done - self._first_step == self.settings.throughput_warmup_steps:
            self.stopwatch.start()
        if self.threads is not None:
            self.threads.before_step(steps_done)
        for started in self._step_starts:
            started(steps_done + 1)

    def end(self) -> None:
        self.stopwatch.stop()
        if self._loop_started is not None:
            t = self.time
            elapsed = time.perf_counter() - self._loop_started
            t.training_s = elapsed - t.evaluation_s - t.checkpoint_s
            self._loop_started = None

    @contextmanager
    def paused(self, kind: str) -> Iterator[None]:
        """Evaluations and checkpoint writes (``kind``) are not training time: neither the
        throughput nor the row's samples/s count them; :attr:`time` records them."""
        running, started = self.stopwatch.running, time.perf_counter()
        self.stopwatch.stop()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - started
            self._interval.started += elapsed
            self.time.add(kind, elapsed)
            if running:
                self.stopwatch.start()

    @property
    def tokens_per_s(self) -> float | None:
        """Language models: the measured samples/s times the window length; None otherwise."""
        tokens, speed = self.settings.tokens_per_sample, self.throughput.samples_per_s
        return speed * tokens if tokens and speed is not None else None

    @property
    def peak_memory_bytes(self) -> int | None:
        return hardware.peak_memory_bytes(self.device) if self.memory_kind else None

    # ------------------------------------------------------------------------------ per step
    def after_step(self, state: LoopState, outcome: StepOutcome, logged: bool) -> None:
        """Record one finished step (``state`` already counts it); log a row when ``logged``."""
        if self.threads is not None:  # first: the row's logging is not the step's time
            self.threads.after_step(state.step)
        self._interval.losses.append(outcome.loss)
        if self.loss_window is not None:
            self.loss_window.record(state.step, outcome.loss)
        self.probes.record(outcome.zero_grads, outcome.updates_lost, outcome.states_lost)
        if self.scale is not None:
            self._watch_scale(state.step, outcome)
        if self.stopwatch.running:
            self._interval.measured += 1
            self.throughput.measured_steps += 1
            self.throughput.measured_samples += self.settings.samples_per_step
            self.throughput.data_wait_s += outcome.data_wait_s
        if not self.diverged_reason and logged:
            self._log(state, outcome)
            if not math.isfinite(state.last_train_loss) and self.scale is None:
                self._diverge_without_scaler(state, outcome)
        for observer in self.observers:
            observer.on_step(state)

    def record_eval(self, row: dict[str, Any]) -> None:
        for observer in self.observers:
            observer.on_eval(row)

    def _watch_scale(self, step: int, outcome: StepOutcome) -> None:
        """Scale history, health warnings (once per kind), divergence and its culprit."""
        previous, self.scale = self.scale, outcome.scale
        if self.scale != previous:
            self.scale_stats.record(step, self.scale)
        loss_finite = outcome.loss_finite  # agreed across ranks, or they would part ways
        if not loss_finite and not self.health.nonfinite_loss_steps:
            self._search_culprit(outcome, 1.0)
        grew = self.scale > previous
        for message in self.health.observe(step, outcome.skipped, self.scale, grew, loss_finite):
            for observer in self.observers:
                observer.on_warning(message)
        if self.health.diverged:
            self._search_culprit(outcome, previous)  # at the scale that overflowed
            self.diverged_reason = self.health.diverged + self._culprit_text()

    def _diverge_without_scaler(self, state: LoopState, outcome: StepOutcome) -> None:
        self._search_culprit(outcome, 1.0)
        self.diverged_reason = (
            f"training loss became {state.last_train_loss} by step {state.step} "
            f"({self.settings.precision}, no loss scaler to skip the update)" + self._culprit_text()
        )

    def _log(self, state: LoopState, outcome: StepOutcome) -> None:
        # The logging sync point: one device read for the loss and the gradient norm together.
        device_values = [torch.stack(self._interval.losses).mean().float()]
        if outcome.grad_norm is not None:
            device_values.append(outcome.grad_norm)
        mean_loss, *grad_norm = torch.stack(device_values).tolist()
        now = time.perf_counter()  # after the read: the device finished the interval's work
        state.last_train_loss = mean_loss
        steps = len(self._interval.losses)
        if self._interval.measured == steps:  # every step of the interval after warm-up
            self.throughput.windows.append((steps, now - self._interval.started))
        row = {
            "kind": "train",
            "step": state.step,
            "epoch": state.epoch,
            "precision": self.settings.precision,
            "loss": mean_loss,
            "lr": float(self._optimizer.param_groups[0]["lr"]),  # torchao's: a tensor
            "loss_scale": self.scale,
            "grad_norm": grad_norm[0] if grad_norm else None,
            "skipped": outcome.skipped,
            "skipped_total": len(state.skipped_steps),
            "zero_grad_fraction": outcome.zero_grads,
            "updates_lost_fraction": outcome.updates_lost,
            "samples_per_s": steps
            * self.settings.samples_per_step
            / (now - self._interval.started),
        }
        if self.settings.tokens_per_sample:
            row["tokens_per_s"] = row["samples_per_s"] * self.settings.tokens_per_sample
        for observer in self.observers:
            observer.on_log(row)
        self._interval.restart()

    def _search_culprit(self, outcome: StepOutcome, loss_scale: float) -> None:
        """Name the first module that produced a non-finite value on this batch (once per run)."""
        if self.culprit is None and self.settings.find_culprit and self.culprit_finder:
            found = self.culprit_finder(*outcome.batch, loss_scale)
            self.culprit = found or {"forward": None, "backward": None, "reproduced": False}

    def _culprit_text(self) -> str:
        if self.culprit is None:
            return ""
        reproduced = self.culprit.get("reproduced") is not False
        return "; " + describe_culprit(self.culprit if reproduced else None)

    # ------------------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The measurements a resumed run continues from (throughput restarts with the run); with
        a precision switch, the losses around it."""
        return {
            "scale": dataclasses.asdict(self.scale_stats) if self.scale_stats else None,
            "health": dataclasses.asdict(self.health),
            "probes": list(dataclasses.astuple(self.probes)),  # Probes(*probes) loads it
        } | ({} if self.loss_window is None else {"loss_window": self.loss_window.values()})

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        if saved["scale"]:
            scale = dict(saved["scale"])
            scale["changes"] = [tuple(c) for c in scale["changes"]]
            self.scale_stats = ScaleStats(**scale)
        if saved["health"]:
            health = {k: v for k, v in saved["health"].items() if k != "settings"}
            self.health = ScaleHealth(settings=self.settings.health, **health)  # this run's limits
        self.probes = Probes(*saved["probes"])
        if self.loss_window is not None and saved.get("loss_window"):  # None before it existed
            self.loss_window.losses = dict(saved["loss_window"])
