"""Precision schedules: ``precision.switch.to`` and ``precision.switch.at`` train the first steps
in the run's precision (phase 1) and the rest in another (phase 2), e.g. NVFP4 for 85 % of the
steps, then BF16 (when, which precisions, what changes and what the report says, in words:
docs/precisions.md#precision-schedules).

Steps 1..k run in phase 1, steps k+1.. in phase 2 (k: :func:`switch_step`); the evaluation and
checkpoint after step k are phase 1's. The switch, by :meth:`Switch.before_step` (the loop calls
it before every step; it acts once, before step k+1), in this order:

1. layers: phase 1's layer format (:data:`mptrain.precision.formats.LAYER_FORMATS`) records its
   layers' final figures and goes back to ``nn.Linear``; phase 2's converts them, chosen by its
   settings as at a build. Every format shares the layers' Parameter objects: the FP32 master
   weights, the optimizer and its state carry on untouched. Layers of ``numerics.fp32_modules``
   stay in FP32;
2. scales of phase 2 start afresh, as in a new run (NVFP4's generators and Hadamard signs are the
   new layers', seeded from ``seed`` as at a build);
3. the run's :class:`~mptrain.precision.plugin.Precision` becomes phase 2's (one swap of
   ``run.precision``): its policy, its layer state and a fresh loss scaler; the FP32-modules
   list, TF32 setting and BF16 update carry over;
4. the health monitor's culprit finder takes phase 2's autocast dtype;
5. the monitor names phase 2 (metrics rows' ``precision``) and reads its scale; the job says one
   line (:attr:`Switch.say`).

A checkpoint records its phase (:meth:`Switch.state_dict`); restoring one saved after the switch
applies the switch to the freshly built run before the states load (:meth:`Switch.load_state_dict`),
so a resume on either side of the switch equals the uninterrupted run bit for bit. The report's
``precision.switch`` is :meth:`Switch.describe`.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from mptrain.config.base import ConfigError
from mptrain.config.precision import PrecisionConfig
from mptrain.config.run import RunConfig
from mptrain.platform.distributed import DistContext, unwrap
from mptrain.platform.dtypes import dtype_name
from mptrain.precision.formats import (
    LAYER_FORMATS,
    convert_layers,
    format_of,
    layer_sync,
    run_sections,
    to_plain_linear,
)
from mptrain.precision.gemm_plans import check_switched_gemms
from mptrain.precision.policy import (
    PrecisionPolicy,
    build_grad_scaler,
    keep_in_fp32,
    resolve_precision,
)
from mptrain.precision.quant.dist import FP8Sync
from mptrain.train.components import PrecisionSchedule, Run
from mptrain.train.health import culprit_finder
from mptrain.train.monitor import LossWindow
from mptrain.train.state import LoopState

# Steps either side of the switch whose mean train loss the report compares (fewer when a phase
# is shorter), and the same number of steps before those: how the loss moved without a switch.
WINDOW_STEPS = 20


def switch_step(at: float, total_steps: int) -> int:
    """The last step of phase 1: ``at`` itself when ``at >= 1`` (a step number), else ``at`` x the
    run's optimizer steps rounded to the nearest step; ConfigError when a phase would be empty."""
    step = int(at) if at >= 1 else math.floor(at * total_steps + 0.5)
    if not 1 <= step < total_steps:
        given = f"step {step}" if at >= 1 else f"{at:g} x {total_steps} steps = step {step}"
        raise ConfigError(
            f"precision.switch.at={at:g}: {given}, but each precision needs at least one of the "
            f"run's {total_steps} optimizer steps; use a share in (0, 1) or a step from 1 to "
            f"{total_steps - 1}"
        )
    return step


def plan_switch(
    cfg: RunConfig,
    first: PrecisionPolicy,
    device: torch.device,
    dist: DistContext,
    total_steps: int,
) -> PrecisionSchedule:
    """The run's schedule: phase 2's policy resolved for ``device`` now, so what cannot run there
    is refused before training (ConfigError, one line naming the key)."""
    to, at = cfg.precision.switch.to, cfg.precision.switch.at
    if to is None:
        return PrecisionSchedule()
    key = f"precision.switch.to={to}"
    step = switch_step(at, total_steps)
    if dist.enabled and dist.strategy == "fsdp":
        raise ConfigError(
            f"{key}: not under distributed.strategy=fsdp, whose shards and compute dtype are "
            "bound to the layers and precision built first; use distributed.strategy=ddp"
        )
    if cfg.fp8.backend == "torchao" and "fp8" in (first.name, to):
        raise ConfigError(f"{key}: switches builtin FP8 layers only; use fp8.backend=builtin")
    late = [s for s in cfg.debug.inject_inf_grad_steps if s > step]
    if late:
        raise ConfigError(
            f"debug.inject_inf_grad_steps={late}: after the switch (step {step}); the injection "
            f"uses {first.name}'s loss scaler, so choose steps up to {step}"
        )
    requested = PrecisionConfig(
        name=to, scaler=cfg.precision.scaler, allow_tf32=cfg.precision.allow_tf32
    )
    policy = resolve_precision(requested, device, cfg.fp8, cfg.mx, cfg.nvfp4)
    if first.blocks is not None and policy.blocks is not None:
        raise ConfigError(
            f"{key}: from {first.blocks.format} to {policy.blocks.format}: a run has one block "
            "format (one blocks section in its report); switch between a block format (mxfp8, "
            "nvfp4, fp8.granularity=blockwise) and fp32, bf16, fp16 or fp8 (tensorwise, rowwise)"
        )
    check_switched_gemms(cfg, first, policy, device)
    reason = f"precision.switch: after step {step} of {total_steps} in {first.label}"
    return Switch(step, at, total_steps, first, replace(policy, reason=reason))


class Switch(PrecisionSchedule):
    """A switch from ``first`` to ``to`` after step ``step`` (see the module doc)."""

    def __init__(
        self, step: int, at: float, total_steps: int, first: PrecisionPolicy, to: PrecisionPolicy
    ) -> None:
        self.step, self.at, self.total_steps = step, at, total_steps
        self.first, self.to = first, to
        self.window = min(WINDOW_STEPS, step, total_steps - step)
        self.switched_after: int | None = None  # the step after which it switched
        self.left: dict[str, Any] | None = None  # phase 1's layer section, final figures in it
        self.entered: dict[str, Any] | None = None  # phase 2's layer section
        self.say: Callable[[str], None] = lambda line: None  # the job's one line at the switch

    @property
    def emulated(self) -> bool:  # type: ignore[override]
        return self.switched_after is not None and self.to.emulated

    def loss_window(self) -> LossWindow:
        return LossWindow(max(1, self.step - 2 * self.window + 1), self.step + self.window)

    @property
    def switch_step(self) -> int:
        """The step after which the run switched (or will): the planned one, unless a phase-1
        checkpoint resumed past it switched later (what the report's ranges must follow)."""
        return self.switched_after if self.switched_after is not None else self.step

    def before_step(self, run: Run, steps_done: int) -> None:
        # ">=": a checkpoint of phase 1 resumed past the step (a longer run, or an earlier
        # switch.at, allowed by resume_allow_changes) switches before its first step; the report
        # then says after which step it really switched (switch_step).
        if self.switched_after is not None or steps_done < self.step:
            return
        self.switched_after = steps_done
        self._apply(run)
        self.say(self._line(run))

    def _apply(self, run: Run) -> None:
        """Steps 1-5 of the module doc, on the run as it stands between two steps: its precision
        object is swapped for phase 2's (the TF32 flags, FP32 islands and update rule carry on)."""
        model = unwrap(run.model)
        old = run.precision
        replaced = []
        left = format_of(self.first)
        if left is not None:
            layer_format = LAYER_FORMATS[left]
            section = old.fp8 if layer_format.report == "fp8" else old.blocks.section
            stats = layer_format.final_stats(model)
            self.left = {**section, "final_layer_stats": stats, "steps": [1, self.switch_step]}
            replaced += to_plain_linear(model)
        # The FP32 master weights stay in place: a format converts the layers around them.
        section = convert_layers(model, self.to, run.cfg, run.data)
        fp8_sync = FP8Sync()
        if section is not None:
            section["steps"] = [self.switch_step + 1, self.total_steps]
            replaced += [layer["name"] for layer in section["layers"] if layer["converted"]]
            wrapped = getattr(run.model, "_orig_mod", run.model)  # DDP's, not torch.compile's
            fp8_sync, self.entered = layer_sync(wrapped, run.dist, run.cfg, self.to, section)
        # Block layers' generators (nvfp4) are the new layers' own, seeded: a checkpoint saved
        # after the switch restores them into these (mptrain.checkpoint.checkpointer.restore).
        fp8, blocks = run_sections(model, (self.first, self.left), (self.to, self.entered))
        patterns = run.cfg.numerics.fp32_modules
        again = [n for n in replaced if any(fnmatch.fnmatchcase(n, p) for p in patterns)]
        keep_in_fp32(model, again, run.device.type)  # the new layers: outside autocast again
        run.precision = replace(
            old,
            policy=self.to,
            scaler=build_grad_scaler(self.to, run.dist),
            fp8=fp8,
            fp8_sync=fp8_sync,
            blocks=blocks,
        )
        finder = culprit_finder(run.model, self.to.autocast)
        run.monitor.switch_precision(self.to.name, run.precision.scaler, finder)
        run.precision.begin()

    def _line(self, run: Run) -> str:
        before = self._window_means(run)["before"]
        loss = ""
        if before is not None:
            (first, last), mean = before["steps"], before["mean"]
            loss = f"; train loss {mean:.4f} over steps {first}-{last}"
        return (
            f"{self.first.label} -> {self.to.describe()} after step {self.switched_after} of "
            f"{self.total_steps}{loss}"
        )

    def state_dict(self) -> dict[str, Any]:
        return {"to": self.to.name, "switched_after": self.switched_after, "left": self.left}

    def load_state_dict(self, run: Run, saved: dict[str, Any] | None) -> list[str]:
        """A checkpoint saved after the switch: the run switches now, before its states load
        (the checkpoint's model holds phase 2's layers); phase 1's final layer figures come from
        the checkpoint. A checkpoint without a schedule, or of phase 1, changes nothing."""
        if not saved or saved["switched_after"] is None:
            return []
        if saved["to"] != self.to.name:
            raise ConfigError(
                f"precision.switch.to={self.to.name}: the checkpoint was saved after switching "
                f"to {saved['to']}; resume with precision.switch.to={saved['to']}"
            )
        self.switched_after = saved["switched_after"]
        self._apply(run)
        self.left = saved["left"]
        model = unwrap(run.model)
        sections = run_sections(model, (self.first, self.left), (self.to, self.entered))
        run.precision.fp8, run.precision.blocks = sections
        return [
            f"saved after the precision switch ({self.first.name} -> {self.to.name} after "
            f"step {self.switched_after}): resumed in {self.to.name}"
        ]

    def _window_means(self, run: Run) -> dict[str, dict[str, Any] | None]:
        """Mean train loss over the steps before the switch, after it, and before those:
        {"steps": [first, last], "count", "mean"} of the steps that ran (a run that stopped
        early has fewer after the switch); None where none ran or the run is too short."""
        losses = run.monitor.loss_window.values() if run.monitor.loss_window else {}
        k, w = self.switch_step, self.window
        ranges = {"earlier": (k - 2 * w, k - w), "before": (k - w, k), "after": (k, k + w)}
        means: dict[str, dict[str, Any] | None] = {}
        for name, (after, last) in ranges.items():
            steps = [step for step in losses if after < step <= last]
            if after < 0 or not steps:
                means[name] = None
                continue
            mean = math.fsum(losses[step] for step in steps) / len(steps)
            means[name] = {"steps": [steps[0], steps[-1]], "count": len(steps), "mean": mean}
        return means

    def describe(self, run: Run, state: LoopState) -> dict[str, Any]:
        """The report's ``precision.switch``: the step, both precisions, the train loss over the
        :data:`WINDOW_STEPS` steps either side and the evaluations around the switch."""
        means = self._window_means(run)
        before, after, earlier = means["before"], means["after"], means["earlier"]
        evals_before = [e for e in state.evals if e["step"] <= self.switch_step]
        evals_after = [e for e in state.evals if e["step"] > self.switch_step]
        return {
            "at": self.at,
            "step": self.step,
            "switched_after_step": self.switched_after,
            "from": self.first.name,
            "from_label": self.first.label,
            "to": self.to.name,
            "to_label": self.to.label,
            "to_autocast_dtype": dtype_name(self.to.autocast_dtype),
            "to_loss_scaling": self.to.loss_scaling,
            "to_notes": list(self.to.notes),
            "window_steps": self.window,
            "train_loss_earlier": earlier,
            "train_loss_before": before,
            "train_loss_after": after,
            "loss_change": after["mean"] - before["mean"] if before and after else None,
            "trend_before": before["mean"] - earlier["mean"] if before and earlier else None,
            "eval_before": _eval_figures(evals_before[-1]) if evals_before else None,
            "eval_after": _eval_figures(evals_after[0]) if evals_after else None,
        }


def _eval_figures(row: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in row.items() if k not in ("kind", "epoch")}
