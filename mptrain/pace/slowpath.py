"""Whether this run's precision is known to be far slower than FP32 on its device, measured.

torch's CPU kernels for FP16 convolutions are a slow path (docs/cpu.md has the figure), so
``mptrain precision=fp16 model=resnet50`` (a GPU habit) on a CPU can take days. Nothing is
changed: the run trains in the precision asked for, and the progress display says, after its first
step, how much slower it is than one FP32 step of the same model on the same batch, timed here
before training, and what to use instead (:func:`mptrain.pace.estimate.slow_path_note`).
"""

from __future__ import annotations

import dataclasses

import torch

from mptrain.models.build import has_convolutions
from mptrain.pace.estimate import SlowPath
from mptrain.pace.steptime import time_steps
from mptrain.platform import hardware
from mptrain.train.components import Run

FP16_CONV_ON_CPU = "FP16 convolutions are a slow path on this CPU"


def check_slow_path(run: Run) -> SlowPath | None:
    """The run's :class:`SlowPath` with FP32's step timed on its model (see the module doc), or
    None when its precision is not known to be slow here: the one slow path known is FP16
    (autocast or FP16 weights) on a CPU for a model with convolutions. FP32 is not timed (and the
    note says why) under torch.compile (timing would compile the model again) or across processes
    (the model is wrapped for them)."""
    p = run.precision.policy
    fp16 = torch.float16 in (p.autocast_dtype, p.param_dtype)
    if run.device.type != "cpu" or not fp16 or not has_convolutions(run.model):
        return None
    faster = "precision=bf16 (or fp32)" if hardware.cpu_has_native_bf16() else "precision=fp32"
    slow = SlowPath(FP16_CONV_ON_CPU, p.name, faster, fp32_step_s=None)
    if run.cfg.compile:
        return dataclasses.replace(slow, not_timed="compile=true")
    if run.dist.enabled:
        return dataclasses.replace(slow, not_timed="several processes")
    return dataclasses.replace(slow, fp32_step_s=time_fp32_step(run))


def time_fp32_step(run: Run) -> float:
    """Seconds of one FP32 optimizer step of copies of the run's model and optimizer on the first
    batch of the run's epoch; the run is untouched (:func:`mptrain.pace.steptime.time_steps`)."""
    return time_steps(run, [None], fp32_weights=True)[0]
