"""Host reads per optimizer step: one with loss scaling (FP16), none without (BF16, FP32).

On a GPU every read of a device value drains the queue. A TorchFunctionMode sees every Python
call that brings a tensor's value to the host (``item``, ``tolist``, ``bool``, ...), so the
count holds for whatever the loop, the scaler and the optimizer do in Python; the GPU test
(tests/e2e/test_gpu.py) checks the same with ``torch.cuda.set_sync_debug_mode``.
"""

from __future__ import annotations

import pytest
import torch
from support.runs import tiny_run
from torch.overrides import TorchFunctionMode

import mptrain.train.optim
from mptrain.train.build import prepare_run
from mptrain.train.loop import LoopHooks, host_reads_per_step, take_step, train_loop

HOST_READS = {
    "item",
    "tolist",
    "numpy",
    "__bool__",
    "__float__",
    "__int__",
    "__index__",
    "__complex__",
    "__array__",
}


class HostReadCounter(TorchFunctionMode):
    """Counts calls that read a device tensor's value into Python.

    Everything is on the CPU here, so the tensors a GPU run keeps on the host must be named:
    ``host_resident`` holds the optimizer's ``step`` counters, which torch keeps on the CPU for
    non-fused, non-capturable optimizers (foreach Adam reads them each step at no device cost).
    """

    def __init__(self, host_resident: _LazyCounters) -> None:
        super().__init__()
        self.host_resident = host_resident
        self.reads: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in HOST_READS and id(args[0]) not in self.host_resident:
            self.reads.append(name)
        return func(*args, **(kwargs or {}))


def optimizer_step_counters(optimizer: torch.optim.Optimizer) -> set[int]:
    """ids of the optimizer's ``step`` tensors that torch keeps on the host on a GPU."""
    if optimizer.defaults.get("fused") or optimizer.defaults.get("capturable"):
        return set()  # then they live on the device, and a read would be one
    return {id(s["step"]) for s in optimizer.state.values() if torch.is_tensor(s.get("step"))}


def counted(fn, run, *args):
    """(device reads of ``fn(run, *args)``, its result)."""
    with HostReadCounter(_LazyCounters(run.optimizer)) as counter:
        result = fn(run, *args)
    return counter.reads, result


class _LazyCounters:
    """``id in ...`` against the optimizer's step counters as they are now (they appear on the
    first step)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def __contains__(self, key: int) -> bool:
        return key in optimizer_step_counters(self.optimizer)


def use_implementation(monkeypatch, implementation: str) -> None:
    monkeypatch.setattr(
        mptrain.train.optim, "_implementation", lambda fused: {implementation: True}
    )


def step_reads(run, inject_at: int | None = None) -> tuple[list[int], list[bool]]:
    """Host reads and skips of each of three steps taken one by one (no log row, no probe); an
    inf gradient at step ``inject_at`` (0-based)."""
    params = [p for p in run.model.parameters() if p.requires_grad]
    batches = run.data.train.batches(0)
    reads, skips = [], []
    for step in range(3):
        micro = iter([next(batches) for _ in range(run.settings.grad_accum_steps)])
        hook = None
        if step == inject_at:
            hook = params[0].register_hook(lambda g: torch.full_like(g, float("inf")))
        these, outcome = counted(take_step, run, params, micro)
        reads.append(len(these))
        skips.append(outcome.skipped)
        if hook is not None:
            hook.remove()
    return reads, skips


@pytest.mark.parametrize("implementation", ["fused", "foreach"])
@pytest.mark.parametrize(
    ("precision", "expected"), [("fp16", 1), ("bf16", 0), ("fp32", 0), ("fp16_noscale", 0)]
)
def test_reads_per_step(monkeypatch, implementation, precision, expected):
    use_implementation(monkeypatch, implementation)
    run = prepare_run(tiny_run(f"precision={precision}", "max_steps=3"))
    assert mptrain.train.optim.optimizer_implementation(run.optimizer) == implementation
    assert host_reads_per_step(run) == expected
    assert step_reads(run) == ([expected] * 3, [False] * 3)


@pytest.mark.parametrize("implementation", ["fused", "foreach"])
def test_one_read_with_accumulation_clipping_and_a_skipped_step(monkeypatch, implementation):
    use_implementation(monkeypatch, implementation)
    cfg = tiny_run("precision=fp16", "grad_accum_steps=2", "clip_grad_norm=1.0", "max_steps=3")
    run = prepare_run(cfg)
    scale = run.precision.scaler.get_scale()
    assert step_reads(run, inject_at=1) == ([1, 1, 1], [False, True, False])
    assert run.precision.scaler.get_scale() == scale / 2


@pytest.mark.parametrize(("precision", "per_step"), [("fp16", 1), ("bf16", 0)])
def test_loop_reads_grow_by_the_per_step_count(precision, per_step):
    """The whole loop (monitor, health watch, stopwatch) between the first and last log rows:
    eight steps read exactly ``4 * per_step`` more than four."""

    def loop_reads(steps: int) -> int:
        cfg = tiny_run(
            f"precision={precision}",
            f"max_steps={steps}",
            "epochs=null",
            "log_every=1000",
            "probe_every=null",
            "checkpoint.enabled=false",
        )
        run = prepare_run(cfg)
        return len(counted(train_loop, run, LoopHooks())[0])

    assert loop_reads(8) - loop_reads(4) == 4 * per_step
