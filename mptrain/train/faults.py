"""Fault injection: ``debug.inject_inf_grad_steps`` puts an inf into a gradient at chosen steps;
``debug.kill_at_step`` kills a rank (:class:`KillAtStep`).

It shows the loss scaler's skip path handled end to end (a skipped step counted, the scheduler
not advanced, the scale backed off, the health watch warning). Installed once, at build time, on
the run's loss scaler and first parameter: the loop has no branch for it.

Where the inf goes:

- single process and DDP: a tensor hook on the first trainable parameter, armed by the last
  micro-batch's ``scaler.scale(loss)`` of a chosen step, edits the gradient before it is
  accumulated, hence before DDP averages it: an inf injected on one rank reaches every rank, as
  a real overflow would;
- FSDP: reduce-scattered gradient shards are assigned without running tensor hooks, so the inf
  goes into this rank's local shard just before ``scaler.unscale_``, as a rank-local overflow
  would appear to the sharded scaler (which all-reduces the inf flag).
"""

from __future__ import annotations

import math
import os
import signal
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from mptrain.platform.distributed import local_shard
from mptrain.train.monitor import LoopObserver


class InfGradInjector:
    """Arms an inf gradient for the optimizer steps in ``steps`` (1-based), on ``rank`` or all.

    ``steps_done()`` returns the optimizer steps finished so far (the run's state), so the count
    survives a resume and ignores backward passes outside the loop (diagnostics re-runs).
    """

    def __init__(
        self,
        steps: frozenset[int],
        grad_accum_steps: int,
        sharded: bool,
        steps_done: Callable[[], int],
    ) -> None:
        self.steps = steps
        self.grad_accum_steps = grad_accum_steps
        self.sharded = sharded
        self.steps_done = steps_done
        self.micro_batches = 0  # scale() calls since the last unscale_()
        self.armed = False

    def install(self, model: nn.Module, scaler: torch.amp.GradScaler) -> None:
        """Wrap ``scaler.scale`` and ``scaler.unscale_`` on this instance; hook the parameter."""
        first = next(p for p in model.parameters() if p.requires_grad)
        scale, unscale_ = scaler.scale, scaler.unscale_

        def scale_and_arm(outputs: Any) -> Any:
            self.micro_batches += 1
            last = self.micro_batches == self.grad_accum_steps
            self.armed = last and self.steps_done() + 1 in self.steps
            return scale(outputs)

        def inject_then_unscale(optimizer: torch.optim.Optimizer) -> None:
            self.micro_batches = 0
            if self.armed and self.sharded:
                self.armed = False
                local_shard(first.grad).view(-1)[0] = math.inf
            unscale_(optimizer)

        def hook(grad: torch.Tensor) -> torch.Tensor:
            if not self.armed or self.sharded:
                return grad
            self.armed = False
            grad = grad.clone()
            grad.view(-1)[0] = math.inf
            return grad

        scaler.scale = scale_and_arm  # type: ignore[method-assign]
        scaler.unscale_ = inject_then_unscale  # type: ignore[method-assign]
        first.register_hook(hook)


class KillAtStep(LoopObserver):
    """Loop observer: SIGKILL this process once optimizer step ``step`` is done, as the
    out-of-memory killer or a lost node would end it (no handler, no last word), on the job's
    first attempt only: a restarted attempt (torchrun --max-restarts) trains on."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step(self, state: Any) -> None:
        if state.step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def kill_observer(debug: Any, rank: int, restart: int) -> KillAtStep | None:
    """``debug.kill_at_step``'s observer on ``debug.kill_rank`` in a first attempt; else None."""
    if debug.kill_at_step is None or rank != debug.kill_rank or restart > 0:
        return None
    return KillAtStep(debug.kill_at_step)
