"""The training loop: one explicit AMP loop for every precision, and evaluation.

Per optimizer step (:func:`take_step`, ``grad_accum_steps`` micro-batches), in this order:

1. for each micro-batch: forward and loss under the precision's autocast; the loss divided by the
   number of micro-batches; the scaled loss's backward outside autocast. One loss scale covers
   the whole effective batch.
2. unscale: gradients become true FP32 gradients (nothing to do without loss scaling).
3. clip the FP32 gradient norm (when configured): clipping always sees unscaled gradients.
4. the optimizer step, skipped when any gradient holds inf/NaN (parameters and optimizer state
   untouched), and the scale update: halved after a skip, grown after ``growth_interval`` clean
   steps (see :func:`_scaled_step` for the order that needs one host read; the host reads per
   step: :func:`host_reads_per_step`).
5. a skipped step is recorded and does *not* advance the LR scheduler.
6. gradients set to ``None`` (``optimizer.zero_grad(set_to_none=True)``, see :func:`clear_grads`).

The precision is one object, ``run.precision`` (:class:`~mptrain.precision.plugin.Precision`):
the loop calls it at named points — ``begin``, ``count_quantizations``, ``model_input``,
``forward_context``, ``scale`` (the loss its backward starts from), ``after_backward``, ``unscale``, ``after_optimizer_step`` — and
reads its loss scaler for the skip rule (step 4). Before every step, ``run.schedule`` may swap it
for another precision's (once, with ``precision.switch``: :mod:`mptrain.train.switch`), so every
call above reads ``run.precision`` when it runs. Data-parallel FP8 runs agree on their FP8 state
after the backward and after the optimizer step (:mod:`mptrain.precision.quant.dist`; nothing for
other runs); block-scaled layers count their saturated, underflowed and zero blocks on the steps
that write a metrics row (the counts cost more than the quantization).

:class:`LoopState` is mutated in place, so a caller that catches an exception or an interrupt still
has the figures of the steps that ran.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from mptrain.data.batches import Batch, BatchSource
from mptrain.models.task import correct_predictions, cross_entropy, logits_of
from mptrain.pace.clocks import TimeCadence
from mptrain.platform.distributed import (
    DistContext,
    all_reduce_sum,
    any_rank,
    gather_ints,
    local_shard,
    no_sync,
)
from mptrain.precision.policy import PrecisionPolicy, to_model_input
from mptrain.precision.update import WeightUpdate
from mptrain.train.monitor import LoopObserver, StepOutcome
from mptrain.train.state import LoopSettings, LoopState

if TYPE_CHECKING:
    from mptrain.train.components import Run

_NO_CONTEXT = contextlib.nullcontext()  # reusable (and re-entrant): no per-step allocation


@dataclass(frozen=True)
class LoopHooks:
    """What the caller plugs into the loop: observers, the checkpoint call, the stop request."""

    observers: tuple[LoopObserver, ...] = ()
    checkpoint: Callable[[LoopState, bool], None] | None = None  # (state, end_of_epoch)
    stop_requested: Callable[[], bool] = lambda: False
    # The signal that asked this rank to stop (its number; None: none came): distributed runs tell
    # every rank which ranks were asked and how (LoopState.stop_signals).
    stop_signal: Callable[[], int | None] = lambda: None
    # Entered around the forward/backward and evaluations, where the weights and optimizer state
    # are still the last completed step's: a "stop now" may abandon the step there (the job's
    # GracefulStop.interruptible raises StopNow; the loop's state stays that step's).
    interruptible: contextlib.AbstractContextManager = _NO_CONTEXT


def train_loop(run: Run, hooks: LoopHooks = LoopHooks()) -> LoopState:
    """Train until ``total_steps`` optimizer steps have been attempted (see module doc).

    Starts from ``run.state`` (a resumed run continues mid-epoch from its step). After every step:
    the monitor records it (metrics every ``log_every``), evaluation on schedule,
    ``hooks.checkpoint(state, end_of_epoch)``, and a stop (``state.stopped``) when
    ``hooks.stop_requested()`` says so, e.g. after a signal. Stops early when the monitor finds
    the run diverged (``run.monitor.diverged_reason``).
    """
    s, state, monitor = run.settings, run.state, run.monitor
    params = [p for p in run.model.parameters() if p.requires_grad]
    samples_per_step = monitor.settings.samples_per_step
    eval_clock = TimeCadence(s.eval_every_minutes)
    monitor.begin(run.precision.scaler, run.optimizer, hooks.observers)
    run.precision.begin()
    run.model.train()
    clear_grads(run.optimizer)
    for micro_batches in _step_batches(run.data.train, s, state):
        run.schedule.before_step(run, state.step)  # precision.switch: once, between two steps
        monitor.before_step(state.step)
        logged = _every(state.step + 1, s.log_every) or state.step + 1 == s.total_steps
        probed = _every(state.step + 1, s.probe_every)
        outcome = take_step(run, params, micro_batches, logged, probed, hooks.interruptible)
        end_of_epoch = state.advance(outcome.skipped, samples_per_step, s.steps_per_epoch)
        monitor.after_step(state, outcome, logged)
        if monitor.diverged_reason:
            break  # the last checkpoint stays the last good state
        if _eval_due(s, state.step, end_of_epoch, eval_clock, run.device):
            state.evaluating = True  # stays True when a second stop signal abandons it
            with monitor.paused("evaluation"), hooks.interruptible:
                _evaluate_into(run, state)
            state.evaluating = False
            eval_clock.restart()
        if hooks.checkpoint is not None:
            hooks.checkpoint(state, end_of_epoch)
        if _stop_agreed(hooks, logged, s.dist, run.device, state):
            state.stopped = True
            break
    monitor.end()
    return state


def _every(step: int, interval: int | None) -> bool:
    return interval is not None and step % interval == 0


def _eval_due(
    s: LoopSettings, step: int, end_of_epoch: bool, clock: TimeCadence, device: torch.device
) -> bool:
    """After the last step; every ``eval_every`` steps and/or ``eval_every_minutes``; at epoch
    ends when neither is set."""
    if step == s.total_steps:
        return True
    if s.eval_every is None and s.eval_every_minutes is None:
        return end_of_epoch
    return _every(step, s.eval_every) or clock.due(step, s.log_every, s.dist, device)


STOP_ASKED = 255  # LoopState.stop_signals: a rank asked to stop without a signal (a deadline)


def _stop_agreed(
    hooks: LoopHooks, logged: bool, dist: DistContext, device: torch.device, state: LoopState
) -> bool:
    """Every rank must stop after the same step: distributed runs agree at every log row, and
    every rank learns which ranks asked and by which signal (``state.stop_signals``)."""
    requested = hooks.stop_requested()
    if not dist.enabled:
        return requested
    if not logged:
        return False
    mine = (hooks.stop_signal() or STOP_ASKED) if requested else 0
    asked = {rank: code for rank, code in enumerate(gather_ints(mine, dist, device)) if code}
    state.stop_signals = asked
    return bool(asked)


def _step_batches(
    train: BatchSource, s: LoopSettings, state: LoopState
) -> Iterator[Iterator[Batch]]:
    """Per remaining optimizer step, the iterator its micro-batches come from, until total_steps.

    The run is placed by its step count: epoch ``step // steps_per_epoch``, and within it the
    data order of that epoch past the micro-batches already used. A run resumed with another
    epoch length (another world size or batch layout) is placed the same way; exact resume needs
    the same layout, and the report notes a change.
    """
    state.epoch, done = divmod(state.step, s.steps_per_epoch)
    epoch = state.epoch
    while state.step < s.total_steps:
        micro_batches = itertools.islice(train.batches(epoch), done * s.grad_accum_steps, None)
        for _ in range(done, s.steps_per_epoch):
            if state.step >= s.total_steps:
                return
            yield micro_batches
        epoch, done = epoch + 1, 0


def _evaluate_into(run: Run, state: LoopState) -> None:
    s = run.settings
    figures = evaluate(run.model, run.data.val, run.precision.policy, s.channels_last, s.dist)
    row = {"kind": "eval", "step": state.step, "epoch": state.epoch, **run.task.eval_row(*figures)}
    state.evals.append(row)
    run.monitor.record_eval(row)


def take_step(
    run: Run,
    params: list[torch.Tensor],
    micro_batches: Iterator[Batch],
    norm_now: bool = False,
    probe_now: bool = False,
    interruptible: contextlib.AbstractContextManager = _NO_CONTEXT,
) -> StepOutcome:
    """One optimizer step over ``grad_accum_steps`` micro-batches (steps 1-6 of the module doc).

    ``norm_now``: compute the gradient norm even without clipping (for the metrics row);
    ``probe_now``: measure zero gradients and updates lost to rounding around the update;
    ``interruptible``: entered around the forward and backward only (see :class:`LoopHooks`).
    DDP: the gradient all-reduce runs only with the last micro-batch's backward (``no_sync``
    before it). FSDP reduce-scatters every micro-batch's gradients: the same sums, more traffic.
    """
    model, precision = run.model, run.precision
    accum, channels_last = run.settings.grad_accum_steps, run.settings.channels_last
    precision.count_quantizations(norm_now)  # block-scaled layers: on the metrics rows' steps
    step_loss, data_wait_s = None, 0.0
    with interruptible:
        for micro in range(accum):
            wait_start = time.perf_counter()
            inputs, targets = next(micro_batches)
            data_wait_s += time.perf_counter() - wait_start
            inputs = precision.model_input(inputs, channels_last)
            with _NO_CONTEXT if micro == accum - 1 else no_sync(model):
                loss = _forward(run, inputs, targets)
                precision.scale(loss).backward()  # outside autocast
            step_loss = loss.detach() if step_loss is None else step_loss + loss.detach()
    precision.count_quantizations(False)
    precision.after_backward()
    batch = (inputs, targets)  # the last micro-batch
    outcome = StepOutcome(step_loss, False, None, None, batch, data_wait_s)
    outcome = _optimizer_step(run, params, norm_now, probe_now, outcome)
    precision.after_optimizer_step()
    return outcome


def _forward(run: Run, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """One micro-batch's loss under the precision's autocast: the task's loss, in FP32
    (:mod:`mptrain.models.task`), divided by the number of micro-batches of the step."""
    accum = run.settings.grad_accum_steps
    with run.precision.forward_context():
        loss = run.loss_fn(logits_of(run.model(inputs)), targets)
        return loss / accum if accum > 1 else loss


def _optimizer_step(
    run: Run, params: list[torch.Tensor], norm_now: bool, probe_now: bool, outcome: StepOutcome
) -> StepOutcome:
    """unscale -> clip -> step -> update -> (scheduler unless skipped) -> clear grads."""
    optimizer, precision, clip = run.optimizer, run.precision, run.settings.clip_grad_norm
    precision.unscale(optimizer)  # gradients are now true FP32 gradients
    if clip is not None or norm_now:
        outcome.grad_norm = gradient_norm(params)
    if clip is not None:
        torch.nn.utils.clip_grads_with_norm_(params, clip, outcome.grad_norm)
    probe = UpdateProbe(params, precision.update, optimizer) if probe_now else None
    if precision.loss_scaling:
        _scaled_step(run, outcome)
    else:
        optimizer.step()
    if not outcome.skipped:
        run.scheduler.step()
    if probe is not None:
        outcome.zero_grads = probe.zero_grad_fraction()
        if not outcome.skipped:
            outcome.updates_lost = probe.updates_lost_fraction()
            outcome.states_lost = probe.states_lost_fraction()
    clear_grads(optimizer)
    return outcome


def _scaled_step(run: Run, outcome: StepOutcome) -> None:
    """Step and update the loss scale with one host read; sets ``skipped``, ``scale`` and
    ``loss_finite`` of ``outcome``.

    ``scaler.step`` would read the inf flag to decide on the host (unless the optimizer is fused),
    and the loop would read the flag, the new scale and the loss's finiteness: up to four reads,
    each draining a GPU's queue. Instead the scale is updated on the device first (``update()``
    needs only the flags ``unscale_`` computed), then the flag, the new scale and the loss's
    finiteness come back in one read. A fused optimizer takes the flag on the device and is
    stepped before the read; any other is stepped after it, only when the flag is clear. Skips
    are the scaler's own flags (a ``backoff_factor`` near 1 can leave the scale unchanged).
    """
    optimizer, scaler = run.optimizer, run.precision.scaler
    # The per-device flags unscale_ just computed (under FSDP already all-reduced), kept until
    # update(): torch has no public accessor, _found_inf_per_device is the one its step uses.
    flags = scaler._found_inf_per_device(optimizer).values()
    found_inf = torch.stack([f.reshape(()) for f in flags]).sum()
    fused = getattr(optimizer, "_step_supports_amp_scaling", False)
    if fused:
        scaler.step(optimizer)  # skips on the device: no host read
    scaler.update()
    nonfinite = any_rank(~torch.isfinite(outcome.loss), run.settings.dist)
    flag, scale, loss_nonfinite = torch.stack(
        [found_inf.float(), scaler._get_scale_async().reshape(()).float(), nonfinite.float()]
    ).tolist()  # the step's one host read
    outcome.skipped, outcome.scale, outcome.loss_finite = flag > 0, scale, not loss_nonfinite
    if not fused and not outcome.skipped:
        optimizer.step()


@torch.no_grad()
def evaluate(
    model: nn.Module,
    batches: BatchSource,
    policy: PrecisionPolicy,
    channels_last: bool = False,
    dist: DistContext | None = None,
) -> tuple[float, float]:
    """Mean cross-entropy and top-1 accuracy per prediction over ``batches`` (same autocast
    policy as training): per sample for classifiers, per token for language models.

    Distributed: each rank evaluates its shard; the sums are all-reduced, so every rank returns
    the figures of the whole validation set.
    """
    was_training = model.training
    model.eval()
    loss_sum, correct, count = None, None, 0
    for inputs, targets in batches.batches(0):
        inputs = to_model_input(inputs, policy, channels_last)
        with policy.autocast():
            logits = logits_of(model(inputs))
        batch_loss = cross_entropy(logits, targets, reduction="sum")
        batch_correct = correct_predictions(logits, targets)
        loss_sum = batch_loss if loss_sum is None else loss_sum + batch_loss
        correct = batch_correct if correct is None else correct + batch_correct
        count += targets.numel()
    model.train(was_training)
    if loss_sum is None:  # no batch (on this rank)
        loss_sum = correct = torch.zeros(())
    sums = [float(loss_sum), float(correct), float(count)]
    loss_total, correct_total, count_total = all_reduce_sum(
        sums, dist or DistContext(), loss_sum.device
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


def _flat_fp32(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One new FP32 vector holding all ``tensors`` (this rank's shards)."""
    return torch.cat([local_shard(t).detach().reshape(-1).float() for t in tensors])


def _nonzero_mask_(x: torch.Tensor) -> torch.Tensor:
    """In place: 1.0 where ``x`` is non-zero (NaN included), 0.0 where it is zero.

    Float arithmetic on purpose: count_nonzero() and comparisons run 2-4x slower on the CPU.
    """
    return x.abs_().nan_to_num_(1.0).sign_()  # sign(NaN) is 0 on the CPU: map NaN first


class UpdateProbe:
    """Measures, around one optimizer step, how many gradients are zero and how many non-zero
    gradients left no trace of their update (rounded away in the parameter's dtype), and, given
    the ``optimizer``, the same for each of its states (Adam's moments, SGD's momentum): the
    share of elements with a non-zero gradient whose stored state the step left unchanged
    (what it shows, in words: docs/report.md#optimizer-states-in-less-memory).

    Works on flat FP32 copies of all gradients and parameters (three concatenations and a few
    element-wise kernels, not a dozen small kernels per tensor); the states are copied in their
    own dtype (torchao's dequantized) and compared tensor by tensor, counts summed on the device.
    It costs a copy of the parameters and one of the states, so the loop takes it only every
    ``probe_every`` steps. Under FSDP each rank measures its own shard. With
    ``precision.update`` (``update``) the trace is where that rule keeps updates
    (:meth:`mptrain.precision.update.WeightUpdate.landing`): the weight plus its
    Kahan buffer, or the FP32 result stochastic rounding drew from.
    """

    def __init__(
        self,
        params: list[torch.Tensor],
        update: WeightUpdate | None = None,
        optimizer: torch.optim.Optimizer | None = None,
    ) -> None:
        self.params = [p for p in params if p.grad is not None]
        self.total = sum(local_shard(p).numel() for p in params)  # no gradient counts as zero
        self.update = update
        self.optimizer = optimizer
        self.moved_mask = self.before = None
        self.moved = 0.0
        self.states_before: dict[str, list[tuple[int, torch.Tensor]]] = {}
        if self.params:
            self.moved_mask = _nonzero_mask_(_flat_fp32([p.grad for p in self.params]))
            self.before = self._weights()
            self.moved = float(self.moved_mask.sum())
            if optimizer is not None:
                self.states_before = {
                    name: [(i, self._state(i, name).clone()) for i in indices]
                    for name, indices in _param_shaped_states(optimizer, self.params).items()
                }
        if update is not None:
            update.keep_results(True)

    def _state(self, index: int, name: str) -> torch.Tensor:
        """The ``name`` state of parameter ``index`` (this rank's shard) in its own dtype;
        torchao's quantized states dequantized (``dequantize`` is the tensor itself otherwise)."""
        return local_shard(self.optimizer.state[self.params[index]][name]).dequantize()

    def _weights(self) -> torch.Tensor:
        if self.update is None:
            return _flat_fp32(self.params)
        return _flat_fp32([self.update.landing(p) for p in self.params])

    def zero_grad_fraction(self) -> float:
        return 1.0 - self.moved / self.total if self.total else 0.0

    def updates_lost_fraction(self) -> float:
        """After the optimizer step: of the non-zero gradients, the share whose parameter (or the
        update rule's trace of it) did not change. (Two distinct floats never subtract to zero,
        so a zero difference means equal.)"""
        if not self.moved:
            lost = 0.0
        else:
            changed = _nonzero_mask_(self._weights() - self.before)
            lost = 1.0 - float(torch.dot(self.moved_mask, changed)) / self.moved
        if self.update is not None:
            self.update.keep_results(False)
        return lost

    def states_lost_fraction(self) -> dict[str, float]:
        """After the optimizer step, per state name: of the elements with a non-zero gradient,
        the share whose state did not change. Parameters without state before the step (their
        first) are left out; a name none of whose elements had a gradient is absent."""
        bounds = list(
            itertools.accumulate((local_shard(p).numel() for p in self.params), initial=0)
        )
        lost = {}
        for name, befores in self.states_before.items():
            moved = unchanged = self.moved_mask.new_zeros(())
            for i, before in befores:
                mask = self.moved_mask[bounds[i] : bounds[i + 1]]
                same = torch.eq(self._state(i, name), before).reshape(-1).to(mask.dtype)
                moved, unchanged = moved + mask.sum(), unchanged + torch.dot(mask, same)
            moved_n, unchanged_n = torch.stack([moved, unchanged]).tolist()  # one host read
            if moved_n:
                lost[name] = unchanged_n / moved_n
        return lost


def _param_shaped_states(
    optimizer: torch.optim.Optimizer, params: list[torch.Tensor]
) -> dict[str, list[int]]:
    """Per state name, the indices of ``params`` whose optimizer state holds a tensor of that
    name with one element per parameter element (moments, momentum; not step counters)."""
    names: dict[str, list[int]] = {}
    for i, p in enumerate(params):
        for name, value in optimizer.state.get(p, {}).items():
            if name != "step" and isinstance(value, torch.Tensor) and value.shape == p.shape:
                names.setdefault(name, []).append(i)
    return names


def host_reads_per_step(run: Run) -> int:
    """Device-to-host reads per optimizer step between log rows: one with loss scaling (the inf
    flag, the new scale and the loss's finiteness together, see :func:`_scaled_step`), none
    without. Log rows, probes, evaluations and checkpoints read more, on their own schedule."""
    return 1 if run.precision.loss_scaling else 0


def clear_grads(optimizer: torch.optim.Optimizer) -> None:
    """``optimizer.zero_grad(set_to_none=True)`` without its profiler scope: ~1 us instead of
    ~11 us per call on a 2-core Xeon, a few percent of a one-Linear model's whole step there."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            p.grad = None
