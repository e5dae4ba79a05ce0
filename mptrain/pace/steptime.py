"""Time optimizer steps of copies of a run's model before training, leaving the run untouched.

Two decisions are made from such timings: the slow-path note (one FP32 step against the run's
own first step, :mod:`mptrain.pace.slowpath`) and ``precision=auto`` on a CPU (BF16 and FP32
steps alternating, :mod:`mptrain.train.autoprecision`). Both need the run's model on the run's
first batch, and neither may change what the run then computes:

- the model is a deep copy, the optimizer a fresh copy over it (its state empty: a fresh
  optimizer's steps, as the run's first steps are; :func:`mptrain.train.optim.copy_for`);
- the batch comes from a fresh iterator of the run's epoch, so the run's data position is not
  moved;
- the CPU random state is forked: a DataLoader's iterator draws its seed from it, dropout draws
  from it.

CPU only: no device synchronisation is made, so on a GPU the clock would measure the launch.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence

import torch

from mptrain.models.task import logits_of
from mptrain.precision.policy import to_model_input
from mptrain.train.components import Run
from mptrain.train.optim import copy_for


def time_steps(
    run: Run,
    autocasts: Sequence[torch.dtype | None],
    fp32_weights: bool = False,
    threads: Sequence[int] | None = None,
) -> list[float]:
    """Seconds of one optimizer step (``grad_accum_steps`` forwards and backwards, the update,
    the gradients cleared) for each entry of ``autocasts`` in order — the autocast dtype of that
    step, None for none — on one copy of the model (see the module doc).

    ``fp32_weights``: the copy's parameters and float inputs in FP32 whatever the run's precision
    (FP32's step for a run with low-precision weights). ``threads``: the intra-op thread count of
    each step (as many entries as ``autocasts``); the count in effect is restored afterwards.
    None: every step at the count in effect.
    """
    if threads is not None and len(threads) != len(autocasts):
        raise ValueError(f"{len(threads)} thread counts for {len(autocasts)} steps")
    if run.device.type != "cpu":
        raise ValueError(f"time_steps times CPU steps (no device sync); the run is on {run.device}")
    with torch.random.fork_rng(devices=[]):
        inputs, targets = next(iter(run.data.train.batches(run.state.epoch)))
        model = copy.deepcopy(run.model)
        optimizer = copy_for(run.optimizer, run.model, model)  # over the copy, its state empty
        model.train()
        if fp32_weights:
            model.float()
        inputs = to_model_input(inputs, run.precision.policy, run.settings.channels_last)
        if fp32_weights and inputs.is_floating_point():
            inputs = inputs.float()
        in_effect = torch.get_num_threads()
        counts = threads if threads is not None else [in_effect] * len(autocasts)
        try:
            seconds = []
            for dtype, count in zip(autocasts, counts, strict=True):
                torch.set_num_threads(count)
                seconds.append(_step_seconds(run, model, optimizer, (inputs, targets), dtype))
            return seconds
        finally:
            torch.set_num_threads(in_effect)


def _step_seconds(
    run: Run,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: tuple[torch.Tensor, torch.Tensor],
    autocast_dtype: torch.dtype | None,
) -> float:
    inputs, targets = batch
    accum = run.settings.grad_accum_steps
    started = time.perf_counter()
    for _ in range(accum):
        with torch.autocast("cpu", autocast_dtype, enabled=autocast_dtype is not None):
            loss = run.loss_fn(logits_of(model(inputs)), targets) / accum
        loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - started
