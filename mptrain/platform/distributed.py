"""Data-parallel and sharded training on torch.distributed: the process group ``torchrun`` (or
:mod:`mptrain.platform.launch`) describes, NCCL on GPUs and Gloo on CPUs; the model wrapped in
DDP (``strategy=ddp``) or FSDP2 ``fully_shard`` (``strategy=fsdp``, a MixedPrecisionPolicy from
the precision); the collectives the loop needs, full state dicts and the loss scaler. What each
rank does: docs/distributed.md; FP8 state across ranks: :mod:`mptrain.precision.quant.dist`.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mptrain.config.base import ConfigError
from mptrain.platform.dtypes import DTYPES
from mptrain.platform.launch import Launch, export_torch_env


@dataclass(frozen=True)
class DistContext:
    """Where this process sits in the job. A single process is rank 0 of a world of 1."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: str | None = None
    strategy: str = "single"  # single | ddp | fsdp
    reduce_dtype: str = "float32"
    launch: Launch = field(default_factory=Launch)
    timeout_s: float | None = None  # a collective waits this long for a lost rank (None: single)

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def describe(self) -> dict[str, Any]:
        return {
            "world_size": self.world_size,
            "rank": self.rank,
            "backend": self.backend,
            "strategy": self.strategy,
            "reduce_dtype": self.reduce_dtype if self.enabled else None,
            **asdict(self.launch),
            "timeout_s": self.timeout_s,
        }


def init_distributed(
    device_request: str, strategy: str, reduce_dtype: str, timeout_s: float = 600.0
) -> DistContext:
    """Join the process group torchrun describes, or a SLURM or submitit job of several tasks
    (:mod:`mptrain.platform.launch` writes torchrun's variables for those); no-op for a single
    process. Every collective waits at most ``timeout_s`` for the other ranks: then a lost rank
    stops the others instead of leaving them waiting."""
    launch = export_torch_env()
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return DistContext(launch=launch)
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = device_request != "cpu" and torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(local_rank)
    backend = "nccl" if use_cuda else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, timeout=dt.timedelta(seconds=timeout_s))
    return DistContext(
        rank=rank,
        world_size=world,
        local_rank=local_rank,
        backend=backend,
        strategy=strategy,
        reduce_dtype=reduce_dtype,
        launch=launch,
        timeout_s=timeout_s,
    )


class StartGate:
    """Rank 0 checks the job's directory alone (its lock, another run's work); the other ranks
    wait here for its word instead of in their first collective, where a refusal on rank 0 left
    them until torchrun killed them.

    Rank 0 calls :meth:`open` once its checks passed, or :meth:`refuse` with the ConfigError that
    stopped it (a no-op once opened: later errors are every rank's own). The other ranks call
    :meth:`wait`, which returns on open and raises rank 0's ConfigError on refuse. One
    ``broadcast_object_list`` from rank 0 (Gloo or NCCL); nothing for a single process.
    """

    def __init__(self, ctx: DistContext) -> None:
        self.ctx = ctx
        self._said = not ctx.enabled

    def open(self) -> None:
        self._say(None)

    def refuse(self, exc: ConfigError) -> None:
        self._say(str(exc))

    def wait(self) -> None:
        if self._said:
            return
        word: list[str | None] = [None]
        dist.broadcast_object_list(word, src=0)
        self._said = True
        if word[0] is not None:
            raise ConfigError(f"rank 0 refused the job: {word[0]}")

    def _say(self, refusal: str | None) -> None:
        if self._said:
            return
        self._said = True
        dist.broadcast_object_list([refusal], src=0)


def shutdown(ctx: DistContext) -> None:
    if ctx.enabled and dist.is_initialized():
        dist.destroy_process_group()


def wrap_model(
    model: nn.Module,
    ctx: DistContext,
    device: torch.device,
    param_dtype: torch.dtype | None,
    gathers_fp32: Callable[[nn.Module], bool],
) -> nn.Module:
    """DDP or FSDP2 around ``model`` (returned unchanged for a single process).

    Under FSDP2 a module for which ``gathers_fp32(module)`` is true all-gathers its FP32 master
    weight whatever ``param_dtype`` is (the precision layer says which: FP8 layers)."""
    if not ctx.enabled:
        return model
    if ctx.strategy == "fsdp":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        reduce_dtype = DTYPES[ctx.reduce_dtype]
        policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
        fp32_policy = MixedPrecisionPolicy(param_dtype=None, reduce_dtype=reduce_dtype)
        # A parameter two modules share (a GPT's head tied to its token embedding) must live in
        # one FSDP group: such modules stay in the root's group.
        owners = Counter(id(p) for m in model.modules() for p in m.parameters(recurse=False))
        for module in list(model.modules())[1:]:
            own = list(module.parameters(recurse=False))
            if (
                isinstance(module, nn.Linear | nn.Conv2d)
                and any(p.requires_grad for p in own)
                and all(owners[id(p)] == 1 for p in own)
            ):
                fully_shard(module, mp_policy=fp32_policy if gathers_fp32(module) else policy)
        fully_shard(model, mp_policy=policy)
        return model
    ids = [device.index] if device.type == "cuda" else None
    return nn.parallel.DistributedDataParallel(model, device_ids=ids)


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside DDP / torch.compile wrappers."""
    while hasattr(model, "module") or hasattr(model, "_orig_mod"):
        model = getattr(model, "module", None) or model._orig_mod
    return model


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (FSDP); the tensor itself otherwise."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def no_sync(model: nn.Module) -> contextlib.AbstractContextManager[Any]:
    """Skip DDP's gradient all-reduce (for the non-final micro-batches of an accumulation)."""
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return model.no_sync()
    return contextlib.nullcontext()


def all_reduce_sum(values: list[float], ctx: DistContext, device: torch.device) -> list[float]:
    if not ctx.enabled:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


def any_rank(flag: torch.Tensor, ctx: DistContext) -> torch.Tensor:
    """``flag`` (a boolean device tensor) OR-ed across ranks, on the device: nothing is read."""
    if not ctx.enabled:
        return flag
    t = flag.to(torch.int32).reshape(1)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.reshape(flag.shape).bool()


def gather_ints(value: int, ctx: DistContext, device: torch.device) -> list[int]:
    """Every rank's ``value``, by rank (one all-reduce of a vector with this rank's slot set)."""
    if not ctx.enabled:
        return [value]
    t = torch.zeros(ctx.world_size, dtype=torch.int64, device=device)
    t[ctx.rank] = value
    dist.all_reduce(t)
    return [int(v) for v in t.tolist()]


def broadcast_flag(flag: bool, ctx: DistContext, device: torch.device) -> bool:
    """True on every rank when any rank says True (e.g. a stop request seen by one rank)."""
    if not ctx.enabled:
        return flag
    return bool(any_rank(torch.tensor(flag, device=device), ctx))


# ------------------------------------------------------------------------------ state dicts
def _full_options(cpu_offload: bool = True) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload)


def model_state(model: nn.Module, ctx: DistContext) -> dict[str, Any]:
    """The full (unsharded) model state dict, loadable at any world size. Collective under FSDP."""
    if ctx.strategy == "fsdp" and ctx.enabled:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(model, options=_full_options())
    return unwrap(model).state_dict()


def optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, ctx: DistContext) -> dict:
    if ctx.strategy == "fsdp" and ctx.enabled:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(model, optimizer, options=_full_options())
    return optimizer.state_dict()


def load_model_state(model: nn.Module, state: dict[str, Any], ctx: DistContext) -> None:
    if ctx.strategy == "fsdp" and ctx.enabled:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(model, state, options=_full_options(cpu_offload=False))
        return
    unwrap(model).load_state_dict(state)


def load_optimizer_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, state: dict, ctx: DistContext
) -> None:
    if ctx.strategy == "fsdp" and ctx.enabled:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(model, optimizer, state, options=_full_options(cpu_offload=False))
        return
    optimizer.load_state_dict(state)


def build_scaler_for(ctx: DistContext, device_type: str, **kwargs: Any) -> torch.amp.GradScaler:
    """FSDP shards gradients, so each rank sees only its shard's infs: the sharded scaler
    all-reduces the inf flag so every rank skips together. DDP and single processes use
    torch.amp.GradScaler (DDP's averaged gradients already carry an inf to every rank)."""
    if ctx.enabled and ctx.strategy == "fsdp":
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device_type, **kwargs)
    return torch.amp.GradScaler(device_type, **kwargs)
