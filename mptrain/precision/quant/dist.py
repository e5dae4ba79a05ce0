"""FP8 state under data parallelism (DDP, FSDP2): what the ranks must agree on, and when (in
words: docs/distributed.md, *FP8*).

Built by :func:`build_fp8_sync`; the loop calls ``begin()`` once before its first step, then
``after_backward()`` and ``after_optimizer_step()`` around every optimizer step, on every rank
(each may run a collective). A single process, or a run without FP8, gets :class:`FP8Sync`,
whose calls do nothing. Nothing is read on the host: the collectives take and leave device
tensors.

Builtin backend (:mod:`mptrain.precision.quant.fp8_linear`), after the backward:

- delayed scaling: the amax histories of every TensorScaler are reduced with MAX in one
  all-reduce and every scale is recomputed from them, so a scale changes once per optimizer step,
  not after each cast as in a single process: the same thing when every layer runs once per step
  (``grad_accum_steps=1``, no layer called twice). A NaN amax is sent as +inf (an all-reduce MAX
  does not order NaN): either holds the scale. Dynamic scaling reduces nothing: a weight's amax
  is taken over the whole weight (DDP: identical replicas; FSDP: the all-gathered weight);
- counters: what each rank added since the previous step is summed over the ranks (one
  all-reduce), so every rank's buffers count the casts of the whole job.

torchao backend under FSDP2: weights are all-gathered in FP8 (``enable_fsdp_float8_all_gather``,
set at conversion), their scales computed by ``precompute_float8_dynamic_scale_for_fsdp`` after
every optimizer step, as torchao requires.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mptrain.platform.distributed import DistContext
from mptrain.platform.dtypes import dtype_name
from mptrain.precision.quant.block_linear import BlockLinear
from mptrain.precision.quant.fp8 import (
    AMAX_EVENT_COUNTERS,
    E4M3,
    FP8Quantization,
    TensorScaler,
    history_amax,
    scale_or_current,
)
from mptrain.precision.quant.fp8_linear import Float8Linear

COUNTERS = ("saturated", "seen", *AMAX_EVENT_COUNTERS)


def gathers_fp32(module: nn.Module) -> bool:
    """Whether FSDP2 must all-gather ``module``'s weight in FP32 (for
    :func:`mptrain.platform.distributed.wrap_model`): mptrain's Float8Linear and BlockLinear
    quantize their FP32 master weight, as in a single process; a BF16 gather would round the
    weight twice before FP8 (or MXFP8, NVFP4)."""
    return isinstance(module, (Float8Linear, BlockLinear))


class FP8Sync:
    """Nothing to agree on (one process; torchao under DDP): every call does nothing.
    ``description`` is what :meth:`describe` returns."""

    def __init__(self, description: dict[str, Any] | None = None) -> None:
        self.description = description or {}

    def begin(self) -> None:
        """Before the first step, after any checkpoint was loaded."""

    def after_backward(self) -> None:
        """After the step's last backward, before the optimizer step."""

    def after_optimizer_step(self) -> None:
        """After the optimizer step (whether or not it was skipped)."""

    def describe(self) -> dict[str, Any]:
        """The report's record of what ran (empty for a single process)."""
        return dict(self.description)


class BuiltinFP8Sync(FP8Sync):
    """Amax histories reduced with MAX (delayed scaling only) and counters summed over the ranks,
    once per optimizer step (see the module doc). The scalers' ``defer_scale_update`` is set."""

    def __init__(self, scalers: list[TensorScaler], ctx: DistContext, delayed: bool) -> None:
        super().__init__()
        self.ctx, self.delayed = ctx, delayed
        # Grouped by format and quantization, each group a block of the reduced histories: its scales
        # are computed together (a few kernels per group, not a few per scaler).
        groups: dict[tuple[torch.dtype, FP8Quantization], list[TensorScaler]] = {}
        for scaler in scalers:
            groups.setdefault((scaler.dtype, scaler.quantization), []).append(scaler)
            scaler.defer_scale_update = delayed
        self.groups = list(groups.items())
        self.scalers = [s for _, group in self.groups for s in group]
        self._counter_buffers = [getattr(s, name) for s in scalers for name in COUNTERS]
        self._counted = self._counts()  # the job's totals as of the last sum (see begin)

    def _counts(self) -> torch.Tensor:
        return torch.stack(self._counter_buffers)

    def begin(self) -> None:
        # A resumed run loaded the job's totals into the buffers: only what is added from now on
        # is this rank's own.
        self._counted = self._counts()

    @torch.no_grad()
    def after_backward(self) -> None:
        if self.delayed:
            self._reduce_histories()
        self._sum_counters()

    def _reduce_histories(self) -> None:
        histories = [s.amax_history for s in self.scalers]
        flat = torch.cat(histories)
        flat = torch.where(flat.isnan(), math.inf, flat)
        dist.all_reduce(flat, op=dist.ReduceOp.MAX)
        torch._foreach_copy_(histories, list(flat.split([h.numel() for h in histories])))
        start = 0
        # TensorScaler.update_scale, group by group
        for (dtype, quantization), group in self.groups:
            block = flat[start : start + len(group) * quantization.amax_history_len]
            start += block.numel()
            amax = history_amax(block.view(len(group), -1), quantization.amax_compute_algo)
            scales = [s.scale for s in group]
            new = scale_or_current(amax, torch.stack(scales), dtype, quantization)
            torch._foreach_copy_(scales, list(new.unbind()))

    def _sum_counters(self) -> None:
        added = self._counts() - self._counted
        dist.all_reduce(added)
        totals = self._counted + added
        torch._foreach_copy_(self._counter_buffers, list(totals.unbind()))
        self._counted = totals

    def describe(self) -> dict[str, Any]:
        world = self.ctx.world_size
        fsdp = self.ctx.strategy == "fsdp"
        return {
            "amax_reduction": (
                f"max over {world} ranks, once per optimizer step (input, weight, grad)"
                if self.delayed
                else "none: dynamic scaling, input/grad scales per rank, weight amax of the "
                + ("all-gathered weight" if fsdp else "replicated weight")
            ),
            "counters": f"summed over {world} ranks",
            "weight_all_gather_dtype": "float32" if fsdp else None,
        }


class TorchaoFsdpSync(FP8Sync):
    """torchao's FP8 weight all-gather: the weights' scales precomputed after each step."""

    def __init__(self, model: nn.Module, ctx: DistContext) -> None:
        super().__init__()
        self.model, self.ctx = model, ctx

    def after_optimizer_step(self) -> None:
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        precompute_float8_dynamic_scale_for_fsdp(self.model)

    def describe(self) -> dict[str, Any]:
        return {
            "amax_reduction": "none: dynamic scaling, input/grad scales per rank; weight scales "
            f"from one all-reduce over {self.ctx.world_size} ranks after each optimizer step",
            "counters": None,
            "weight_all_gather_dtype": dtype_name(E4M3),
        }


def build_fp8_sync(
    model: nn.Module, ctx: DistContext, fp8_backend: str, quantization: FP8Quantization
) -> FP8Sync:
    """What ``model``'s FP8 layers (``fp8.backend``; the quantization's scaling and granularity) need
    from the ranks.

    ``model`` is the wrapped model (DDP or FSDP2), not a torch.compile'd one.
    """
    if not ctx.enabled:
        return FP8Sync()
    if fp8_backend == "torchao":
        # torchao all-gathers weights in FP8 with tensorwise scales only (its config refuses
        # rowwise): rowwise weights are gathered like any other.
        if ctx.strategy == "fsdp" and quantization.granularity == "tensorwise":
            return TorchaoFsdpSync(model, ctx)
        return FP8Sync(
            {
                "amax_reduction": "none: dynamic scaling, input/grad scales per rank, weight amax "
                "of the replicated weight",
                "counters": None,
                "weight_all_gather_dtype": None,
            }
        )
    scalers = [m for m in model.modules() if isinstance(m, TensorScaler)]
    return BuiltinFP8Sync(scalers, ctx, delayed=quantization.scaling == "delayed")
