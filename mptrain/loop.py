"""The training loop: one explicit AMP loop for every precision, and evaluation.

Per optimizer step (``grad_accum_steps`` micro-batches), in this order:

1. for each micro-batch: forward and loss under ``policy.autocast()``; the loss divided by the
   number of micro-batches; ``scaler.scale(loss).backward()`` outside autocast. One loss scale
   covers the whole effective batch.
2. ``scaler.unscale_(optimizer)``: gradients become true FP32 gradients (skipped without scaling).
3. clip the FP32 gradient norm (when configured): clipping always sees unscaled gradients.
4. ``scaler.step(optimizer)``: skips the update when any gradient holds inf/NaN, leaving
   parameters and optimizer state untouched.
5. ``scaler.update()``: halves the scale after a skip, grows it after ``growth_interval`` clean
   steps. A skipped step is recorded and does *not* advance the LR scheduler.
6. gradients set to ``None`` (``optimizer.zero_grad(set_to_none=True)``, see :func:`clear_grads`).

Host-device synchronisation: with loss scaling, ``scaler.step`` reads the inf flag (one sync per
step that PyTorch's scaler needs anyway) and the loop reads the new scale right after it. Losses are
summed on the device and read only every ``log_every`` steps and at evaluations.

:class:`LoopState` is mutated in place, so a caller that catches an exception or an interrupt still
has the figures of the steps that ran.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from mptrain.config import NumericsConfig
from mptrain.data import Batch, BatchSource, DataBundle
from mptrain.distributed import DistContext, all_reduce_sum, broadcast_flag, no_sync
from mptrain.hardware import synchronize
from mptrain.numerics import ScaleHealth, describe_culprit, find_culprit
from mptrain.precision import PrecisionPolicy

_NO_CONTEXT = contextlib.nullcontext()  # reusable (and re-entrant): no per-step allocation


class LoopObserver(Protocol):
    """Receives what the loop measured: the metrics log and the progress display implement it."""

    def on_step(self, state: LoopState) -> None: ...

    def on_log(self, row: dict[str, Any]) -> None: ...

    def on_eval(self, row: dict[str, Any]) -> None: ...

    def on_warning(self, message: str) -> None: ...


@dataclass(frozen=True)
class LoopSettings:
    total_steps: int
    steps_per_epoch: int
    grad_accum_steps: int = 1
    clip_grad_norm: float | None = None
    label_smoothing: float = 0.0
    eval_every: int | None = None  # None: at the end of every epoch
    log_every: int = 50
    throughput_warmup_steps: int = 5
    channels_last: bool = False
    inject_inf_grad_steps: frozenset[int] = frozenset()
    health: NumericsConfig = field(default_factory=NumericsConfig)
    find_culprit: bool = True
    probe_every: int | None = 100  # gradient/update probe cadence (costs a parameter copy)
    inject_inf_grad_rank: int | None = None  # with inject_inf_grad_steps: only this rank
    dist: DistContext = field(default_factory=DistContext)


@dataclass
class ScaleStats:
    initial: float
    final: float
    min: float
    max: float
    backoffs: int = 0
    growths: int = 0
    changes: list[tuple[int, float]] = field(default_factory=list)  # (step, new scale)

    def record(self, step: int, scale: float) -> None:
        if scale < self.final:
            self.backoffs += 1
        elif scale > self.final:
            self.growths += 1
        else:
            return
        self.final = scale
        self.min = min(self.min, scale)
        self.max = max(self.max, scale)
        self.changes.append((step, scale))


@dataclass
class LoopState:
    """Counters and measurements of a run so far."""

    step: int = 0  # optimizer steps attempted (applied + skipped)
    epoch: int = 0
    samples_seen: int = 0
    skipped_steps: list[int] = field(default_factory=list)
    scale: ScaleStats | None = None
    evals: list[dict[str, Any]] = field(default_factory=list)
    last_train_loss: float | None = None
    diverged_reason: str | None = None
    stopped: bool = False  # stopped on request (a signal) after finishing a step
    health: ScaleHealth | None = None
    culprit: dict[str, Any] | None = None  # first non-finite module, when one was searched for
    # Throughput window (after warm-up, evaluation excluded).
    measured_steps: int = 0
    measured_samples: int = 0
    measured_time_s: float = 0.0
    data_wait_s: float = 0.0
    # Gradient/update probes, taken every probe_every steps (see _UpdateProbe).
    probes: int = 0
    zero_grad_fraction_sum: float = 0.0
    updates_lost_fraction_sum: float = 0.0
    update_probes: int = 0

    @property
    def samples_per_s(self) -> float | None:
        if self.measured_time_s <= 0:
            return None
        return self.measured_samples / self.measured_time_s

    @property
    def data_wait_fraction(self) -> float | None:
        if self.measured_time_s <= 0:
            return None
        return self.data_wait_s / self.measured_time_s

    @property
    def zero_grad_fraction(self) -> float | None:
        return self.zero_grad_fraction_sum / self.probes if self.probes else None

    @property
    def updates_lost_fraction(self) -> float | None:
        return self.updates_lost_fraction_sum / self.update_probes if self.update_probes else None

    @property
    def best_eval(self) -> dict[str, Any] | None:
        return max(self.evals, key=lambda e: e["val_accuracy"], default=None)


class _Stopwatch:
    """Accumulates training time after warm-up; pauses around evaluation.

    On CUDA it synchronises at each start/stop so the interval covers the kernels, not just their
    launch; it runs only at warm-up end, around evaluations and at the end of the run.
    """

    def __init__(self, device: torch.device, state: LoopState) -> None:
        self.device = device
        self.state = state
        self.started_at: float | None = None

    def start(self) -> None:
        synchronize(self.device)
        self.started_at = time.perf_counter()

    def stop(self) -> None:
        if self.started_at is not None:
            synchronize(self.device)
            self.state.measured_time_s += time.perf_counter() - self.started_at
            self.started_at = None

    @property
    def running(self) -> bool:
        return self.started_at is not None


def to_model_input(
    images: torch.Tensor, policy: PrecisionPolicy, channels_last: bool
) -> torch.Tensor:
    """Inputs in the parameters' dtype ("pure" low precision) and memory format."""
    if policy.param_dtype != torch.float32:
        images = images.to(policy.param_dtype)
    if channels_last:
        images = images.contiguous(memory_format=torch.channels_last)
    return images


@torch.no_grad()
def evaluate(
    model: nn.Module,
    batches: BatchSource,
    policy: PrecisionPolicy,
    channels_last: bool = False,
    dist: DistContext | None = None,
) -> tuple[float, float]:
    """Mean cross-entropy and top-1 accuracy over ``batches`` (same autocast policy as training).

    Distributed: each rank evaluates its shard; the sums are all-reduced, so every rank returns
    the figures of the whole validation set.
    """
    was_training = model.training
    model.eval()
    loss_sum, correct, count = None, None, 0
    for images, labels in batches.batches(0):
        images = to_model_input(images, policy, channels_last)
        with policy.autocast():
            logits = model(images)
        batch_loss = F.cross_entropy(logits.float(), labels, reduction="sum")
        batch_correct = (logits.argmax(dim=1) == labels).sum()
        loss_sum = batch_loss if loss_sum is None else loss_sum + batch_loss
        correct = batch_correct if correct is None else correct + batch_correct
        count += len(labels)
    model.train(was_training)
    sums = [
        float(loss_sum) if loss_sum is not None else 0.0,
        float(correct) if correct is not None else 0.0,
        float(count),
    ]
    loss_total, correct_total, count_total = all_reduce_sum(
        sums,
        dist or DistContext(),
        loss_sum.device if loss_sum is not None else torch.device("cpu"),
    )
    if count_total == 0:
        return math.nan, math.nan
    return loss_total / count_total, correct_total / count_total


def gradient_norm(params: Iterable[torch.Tensor]) -> torch.Tensor:
    """L2 norm of the parameters' gradients, computed in FP32 (a device tensor: reading it syncs).

    Pass a list made once: walking ``model.parameters()`` costs more than the norm for small
    models.
    """
    grads = [p.grad for p in params if p.grad is not None]
    if grads and all(type(g) is torch.Tensor for g in grads):
        # One multi-tensor kernel: get_total_norm() runs a norm per tensor on the CPU (3x slower
        # for a small MLP). Sharded (DTensor) gradients keep torch's own reduction across ranks.
        norms = torch._foreach_norm(grads, 2.0, dtype=torch.float32)
        return torch.linalg.vector_norm(torch.stack(norms))
    norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # a plain tensor


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (FSDP); the tensor itself otherwise."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _flat_fp32(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One new FP32 vector holding all ``tensors`` (this rank's shards)."""
    return torch.cat([_local(t).detach().reshape(-1).float() for t in tensors])


def _nonzero_mask_(x: torch.Tensor) -> torch.Tensor:
    """In place: 1.0 where ``x`` is non-zero (NaN included), 0.0 where it is zero.

    Float arithmetic on purpose: count_nonzero() and comparisons run 2-4x slower on the CPU.
    """
    return x.abs_().nan_to_num_(1.0).sign_()  # sign(NaN) is 0 on the CPU: map NaN first


class _UpdateProbe:
    """Measures, around one optimizer step, how many gradients are zero and how many non-zero
    gradients left their parameter unchanged (the update rounded away in the parameter's dtype).

    Works on flat FP32 copies of all gradients and parameters (three concatenations and a few
    element-wise kernels, not a dozen small kernels per tensor); it still costs a copy of the
    parameters, so the loop takes it only every ``probe_every`` steps. Under FSDP each rank
    measures its own shard.
    """

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.params = [p for p in params if p.grad is not None]
        self.total = sum(_local(p).numel() for p in params)  # no gradient counts as zero
        self.moved_mask = self.before = None
        self.moved = 0.0
        if self.params:
            self.moved_mask = _nonzero_mask_(_flat_fp32([p.grad for p in self.params]))
            self.before = _flat_fp32(self.params)
            self.moved = float(self.moved_mask.sum())

    def zero_grad_fraction(self) -> float:
        return 1.0 - self.moved / self.total if self.total else 0.0

    def updates_lost_fraction(self) -> float:
        """After the optimizer step: of the non-zero gradients, the share whose parameter did not
        change. (Two distinct floats never subtract to zero, so a zero difference means equal.)"""
        if not self.moved:
            return 0.0
        changed = _nonzero_mask_(_flat_fp32(self.params) - self.before)
        return 1.0 - float(torch.dot(self.moved_mask, changed)) / self.moved


def _inject_inf_into_shard(model: nn.Module) -> None:
    """FSDP assigns reduce-scattered gradient shards without running tensor hooks: put the inf
    into this rank's local shard, as a rank-local overflow would appear to the scaler."""
    first = next(p for p in model.parameters() if p.requires_grad)
    _local(first.grad).view(-1)[0] = math.inf


def _inject_inf_grad(model: nn.Module) -> torch.utils.hooks.RemovableHandle:
    """Make the next backward produce an inf in the first parameter's gradient.

    A tensor hook acts before the gradient is accumulated, hence before DDP averages it across
    ranks: an inf injected on one rank reaches every rank, as a real overflow would.
    """
    first = next(p for p in model.parameters() if p.requires_grad)

    def hook(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        grad.view(-1)[0] = math.inf
        return grad

    return first.register_hook(hook)


@dataclass
class _Interval:
    """Losses and timing since the last metrics row; read (one device sync) when a row is logged.

    The per-step losses stay on the device as a list (appending costs no kernel); the row sums
    them in one go.
    """

    started: float  # time.perf_counter() at the interval's start, evaluations excluded
    losses: list[torch.Tensor] = field(default_factory=list)

    @property
    def steps(self) -> int:
        return len(self.losses)

    def mean_loss(self) -> torch.Tensor:
        return torch.stack(self.losses).mean()

    def restart(self) -> None:
        self.losses.clear()
        self.started = time.perf_counter()


def train_loop(
    model: nn.Module,
    data: DataBundle,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    scaler: torch.amp.GradScaler,
    policy: PrecisionPolicy,
    settings: LoopSettings,
    device: torch.device,
    state: LoopState,
    observers: tuple[LoopObserver, ...] = (),
    checkpoint: Callable[[LoopState, bool], None] | None = None,
    stop_requested: Callable[[], bool] = lambda: False,
) -> LoopState:
    """Train until ``settings.total_steps`` optimizer steps have been attempted (see module doc).

    Starts from ``state`` (a resumed run continues mid-epoch from ``state.step``). After every
    step: metrics every ``log_every``, evaluation on schedule, ``checkpoint(state, end_of_epoch)``,
    and a stop (``state.stopped``) when ``stop_requested()`` says so, e.g. after a signal.
    """
    s = settings
    loss_fn = functools.partial(F.cross_entropy, label_smoothing=s.label_smoothing)
    params = [p for p in model.parameters() if p.requires_grad]
    scale = scaler.get_scale() if scaler.is_enabled() else None
    if state.scale is None and scale is not None:
        state.scale = ScaleStats(initial=scale, final=scale, min=scale, max=scale)
    if state.health is None:
        state.health = ScaleHealth(s.health)
    samples_per_step = data.train.batch_size * s.grad_accum_steps * s.dist.world_size
    stopwatch = _Stopwatch(device, state)
    interval = _Interval(started=time.perf_counter())
    distributed = s.dist.enabled
    model.train()
    clear_grads(optimizer)

    while state.step < s.total_steps:
        done_in_epoch = state.step - state.epoch * s.steps_per_epoch  # > 0 after a resume
        if not 0 <= done_in_epoch < s.steps_per_epoch:
            # Resumed with another epoch length (another world size or batch layout): place the
            # run by its step count. Exact resume needs the same layout; the report notes it.
            state.epoch, done_in_epoch = divmod(state.step, s.steps_per_epoch)
        skip = done_in_epoch * s.grad_accum_steps
        micro_batches = itertools.islice(data.train.batches(state.epoch), skip, None)
        while done_in_epoch < s.steps_per_epoch and state.step < s.total_steps:
            if state.step == s.throughput_warmup_steps:
                stopwatch.start()
            # 1. forward + backward over the micro-batches of one effective batch
            inject = _inject_now(s, state.step + 1)
            images, labels, step_loss = _forward_backward(
                model, micro_batches, loss_fn, scaler, policy, s, state, stopwatch, inject
            )
            interval.losses.append(step_loss)
            state.step += 1
            # 2-6. unscale, clip, step (skipped on inf/NaN), update the scale, zero the grads
            logged = state.step % s.log_every == 0 or state.step == s.total_steps
            probed = s.probe_every is not None and state.step % s.probe_every == 0
            step = _optimizer_step(params, optimizer, scheduler, scaler, s, logged, probed)
            if step.zero_grads is not None:
                state.probes += 1
                state.zero_grad_fraction_sum += step.zero_grads
            if step.updates_lost is not None:
                state.update_probes += 1
                state.updates_lost_fraction_sum += step.updates_lost
            if scale is not None:
                scale = _watch_scale(
                    scaler,
                    scale,
                    step_loss,
                    step,
                    model,
                    images,
                    labels,
                    policy,
                    s,
                    state,
                    observers,
                )
            if step.skipped:
                state.skipped_steps.append(state.step)
            state.samples_seen += samples_per_step
            if stopwatch.running:
                state.measured_steps += 1
                state.measured_samples += samples_per_step
            done_in_epoch += 1
            end_of_epoch = done_in_epoch == s.steps_per_epoch
            if end_of_epoch:
                state.epoch += 1
            if not state.diverged_reason and logged:
                _log(interval, state, step, scale, optimizer, samples_per_step, observers)
                if not math.isfinite(state.last_train_loss) and scale is None:
                    if s.find_culprit:
                        _search_culprit(model, images, labels, policy, 1.0, state)
                    state.diverged_reason = (
                        f"training loss became {state.last_train_loss} by step {state.step} "
                        f"({policy.name}, no loss scaler to skip the update)" + _culprit_text(state)
                    )
            for observer in observers:
                observer.on_step(state)
            if state.diverged_reason:
                return _finish(stopwatch, state)  # the last checkpoint stays the last good state
            periodic = s.eval_every is not None and state.step % s.eval_every == 0
            epoch_eval = s.eval_every is None and end_of_epoch
            if periodic or epoch_eval or state.step == s.total_steps:
                eval_started = time.perf_counter()
                _run_eval(model, data, policy, s, state, stopwatch, observers)
                # Evaluation is not training time: the row's samples/s must not count it (it
                # used to restart the interval here, dropping the steps before the evaluation).
                interval.started += time.perf_counter() - eval_started
            if checkpoint is not None:
                checkpoint(state, end_of_epoch)
            stop = stop_requested()
            if distributed:  # every rank must stop after the same step: agree every log row
                stop = logged and broadcast_flag(stop, s.dist, stopwatch.device)
            if stop:
                state.stopped = True
                return _finish(stopwatch, state)
    return _finish(stopwatch, state)


def _inject_now(s: LoopSettings, step: int) -> bool:
    """Fault injection (tests): an inf gradient at this step, on this rank?"""
    return step in s.inject_inf_grad_steps and s.inject_inf_grad_rank in (None, s.dist.rank)


def _finish(stopwatch: _Stopwatch, state: LoopState) -> LoopState:
    stopwatch.stop()
    return state


def _sharded(s: LoopSettings) -> bool:
    """FSDP: gradients arrive as per-rank shards (fault injection must target the shard)."""
    return s.dist.enabled and s.dist.strategy == "fsdp"


def _forward_backward(
    model: nn.Module,
    micro_batches: Iterator[Batch],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    scaler: torch.amp.GradScaler,
    policy: PrecisionPolicy,
    s: LoopSettings,
    state: LoopState,
    stopwatch: _Stopwatch,
    inject_inf: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Accumulate one effective batch's scaled gradients; return the last micro-batch and the loss.

    DDP: the gradient all-reduce runs only with the last micro-batch's backward (``no_sync``
    before it). FSDP reduce-scatters every micro-batch's gradients: the same sums, more traffic.
    """
    accumulating = s.grad_accum_steps > 1
    sharded = _sharded(s)
    inject_hook, inject_shard = inject_inf and not sharded, inject_inf and sharded
    step_loss = None
    for micro in range(s.grad_accum_steps):
        last = micro == s.grad_accum_steps - 1
        wait_start = time.perf_counter()
        images, labels = next(micro_batches)
        if stopwatch.running:
            state.data_wait_s += time.perf_counter() - wait_start
        images = to_model_input(images, policy, s.channels_last)
        handle = _inject_inf_grad(model) if inject_hook and last else None
        with _NO_CONTEXT if last else no_sync(model):
            with policy.autocast():
                # Logits to FP32 for the loss: CPU autocast would run cross_entropy's log-softmax
                # in BF16, and "pure" low-precision runs would too. A no-op in FP32.
                loss = loss_fn(model(images).float(), labels)
                if accumulating:
                    loss = loss / s.grad_accum_steps
            scaler.scale(loss).backward()  # outside autocast
        if handle is not None:
            handle.remove()
        if inject_shard and last:
            _inject_inf_into_shard(model)
        step_loss = loss.detach() if step_loss is None else step_loss + loss.detach()
    return images, labels, step_loss


@dataclass
class _StepOutcome:
    skipped: bool
    grad_norm: torch.Tensor | None
    zero_grads: float | None = None
    updates_lost: float | None = None


def _optimizer_step(
    params: list[torch.Tensor],
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    scaler: torch.amp.GradScaler,
    s: LoopSettings,
    norm_now: bool,
    probe_now: bool,
) -> _StepOutcome:
    """unscale -> clip -> step -> update -> (scheduler unless skipped) -> clear grads."""
    if scaler.is_enabled():
        scaler.unscale_(optimizer)  # gradients are now true FP32 gradients
    grad_norm = None
    if s.clip_grad_norm is not None or norm_now:
        grad_norm = gradient_norm(params)
    if s.clip_grad_norm is not None:
        torch.nn.utils.clip_grads_with_norm_(params, s.clip_grad_norm, grad_norm)
    probe = _UpdateProbe(params) if probe_now else None
    scale_before = scaler.get_scale() if scaler.is_enabled() else None
    scaler.step(optimizer)  # skipped when any gradient holds inf/NaN (syncs to read the flag)
    scaler.update()
    # A skip always backs the scale off; reading it costs nothing more after step()'s sync.
    skipped = scale_before is not None and scaler.get_scale() < scale_before
    if not skipped:
        scheduler.step()
    outcome = _StepOutcome(skipped, grad_norm)
    if probe is not None:
        outcome.zero_grads = probe.zero_grad_fraction()
        if not skipped:
            outcome.updates_lost = probe.updates_lost_fraction()
    clear_grads(optimizer)
    return outcome


def clear_grads(optimizer: torch.optim.Optimizer) -> None:
    """``optimizer.zero_grad(set_to_none=True)`` without its profiler scope: ~1 us instead of
    ~11 us per call on a 2-core Xeon, a few percent of a one-Linear model's whole step there."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            p.grad = None


def _watch_scale(
    scaler: torch.amp.GradScaler,
    scale: float,
    step_loss: torch.Tensor,
    step: _StepOutcome,
    model: nn.Module,
    images: torch.Tensor,
    labels: torch.Tensor,
    policy: PrecisionPolicy,
    s: LoopSettings,
    state: LoopState,
    observers: tuple[LoopObserver, ...],
) -> float:
    """Record the new scale, feed the health monitor, warn once, flag divergence. Returns it."""
    new_scale = scaler.get_scale()
    if new_scale != scale:
        state.scale.record(state.step, new_scale)
    health = state.health
    loss_finite = bool(torch.isfinite(step_loss))  # the device already synced in scaler.step()
    if s.dist.enabled:  # one decision for all ranks, or they would part ways at a collective
        loss_finite = not broadcast_flag(not loss_finite, s.dist, step_loss.device)
    if not loss_finite and not health.nonfinite_loss_steps and s.find_culprit:
        _search_culprit(model, images, labels, policy, 1.0, state)
    for message in health.observe(
        state.step, step.skipped, new_scale, new_scale > scale, loss_finite
    ):
        for observer in observers:
            observer.on_warning(message)
    if health.diverged:
        if s.find_culprit:  # re-run at the scale that overflowed, not the backed-off one
            _search_culprit(model, images, labels, policy, scale, state)
        state.diverged_reason = health.diverged + _culprit_text(state)
    return new_scale


def _log(
    interval: _Interval,
    state: LoopState,
    step: _StepOutcome,
    scale: float | None,
    optimizer: torch.optim.Optimizer,
    samples_per_step: int,
    observers: tuple[LoopObserver, ...],
) -> None:
    now = time.perf_counter()
    # The logging sync point: one device read for the loss and the gradient norm together.
    device_values = [interval.mean_loss().float()]
    if step.grad_norm is not None:
        device_values.append(step.grad_norm)
    mean_loss, *grad_norm = torch.stack(device_values).tolist()
    state.last_train_loss = mean_loss
    row = {
        "kind": "train",
        "step": state.step,
        "epoch": state.epoch,
        "loss": mean_loss,
        "lr": optimizer.param_groups[0]["lr"],
        "loss_scale": scale,
        "grad_norm": grad_norm[0] if grad_norm else None,
        "skipped": step.skipped,
        "skipped_total": len(state.skipped_steps),
        "zero_grad_fraction": step.zero_grads,
        "updates_lost_fraction": step.updates_lost,
        "samples_per_s": interval.steps * samples_per_step / (now - interval.started),
    }
    for observer in observers:
        observer.on_log(row)
    interval.restart()


def _search_culprit(
    model: nn.Module,
    images: torch.Tensor,
    labels: torch.Tensor,
    policy: PrecisionPolicy,
    loss_scale: float,
    state: LoopState,
) -> None:
    """Name the first module that produced a non-finite value on this batch (once per run)."""
    if state.culprit is None:
        found = find_culprit(model, images, labels, policy.autocast, loss_scale)
        state.culprit = found or {"forward": None, "backward": None, "reproduced": False}


def _culprit_text(state: LoopState) -> str:
    if state.culprit is None:
        return ""
    if state.culprit.get("reproduced") is False:
        return "; " + describe_culprit(None)
    return "; " + describe_culprit(state.culprit)


def _run_eval(
    model: nn.Module,
    data: DataBundle,
    policy: PrecisionPolicy,
    settings: LoopSettings,
    state: LoopState,
    stopwatch: _Stopwatch,
    observers: tuple[LoopObserver, ...],
) -> None:
    """Evaluate with the throughput stopwatch paused: evaluation time is not training time."""
    running = stopwatch.running
    stopwatch.stop()
    val_loss, val_accuracy = evaluate(
        model, data.val, policy, settings.channels_last, settings.dist
    )
    row = {
        "kind": "eval",
        "step": state.step,
        "epoch": state.epoch,
        "val_loss": val_loss,
        "val_accuracy": val_accuracy,
    }
    state.evals.append(row)
    for observer in observers:
        observer.on_eval(row)
    if running:
        stopwatch.start()
