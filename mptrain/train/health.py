"""Numerics health during training: the loss scale's statistics and history (:class:`ScaleStats`),
the early warnings and stops (:class:`ScaleHealth`: consecutive back-offs, skip rate, minimum
scale, non-finite losses), the gradient/update probes, and the words for a culprit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from mptrain.config.sections import NumericsConfig
from mptrain.precision.diagnostics.culprit import describe_input, find_culprit
from mptrain.precision.diagnostics.hooks import Autocast, row_label

# find(images, labels, loss_scale) -> the culprit description, or None when the batch re-ran finite
CulpritFinder = Callable[[torch.Tensor, torch.Tensor, float], "dict[str, Any] | None"]


def culprit_finder(model: torch.nn.Module, autocast: Autocast) -> CulpritFinder:
    """The monitor's culprit search: ``model`` re-run under ``autocast`` (the precision's)."""

    def find(images: torch.Tensor, labels: torch.Tensor, loss_scale: float) -> Any:
        return find_culprit(model, images, labels, autocast, loss_scale)

    return find


@dataclass
class ScaleStats:
    """The dynamic loss scale's history: extremes, backoffs, growths and every change."""

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
class Probes:
    """Averages of the gradient/update probes taken every ``probe_every`` steps."""

    probes: int = 0
    zero_grad_fraction_sum: float = 0.0
    update_probes: int = 0
    updates_lost_fraction_sum: float = 0.0
    # Per optimizer state name (exp_avg, exp_avg_sq, momentum_buffer): how many probes saw it
    # and the sum of the shares of its updates lost to rounding.
    state_probes: dict[str, int] = field(default_factory=dict)
    states_lost_fraction_sums: dict[str, float] = field(default_factory=dict)

    def record(
        self,
        zero_grads: float | None,
        updates_lost: float | None,
        states_lost: dict[str, float] | None = None,
    ) -> None:
        if zero_grads is not None:
            self.probes += 1
            self.zero_grad_fraction_sum += zero_grads
        if updates_lost is not None:
            self.update_probes += 1
            self.updates_lost_fraction_sum += updates_lost
        for name, lost in (states_lost or {}).items():
            self.state_probes[name] = self.state_probes.get(name, 0) + 1
            self.states_lost_fraction_sums[name] = (
                self.states_lost_fraction_sums.get(name, 0.0) + lost
            )

    @property
    def zero_grad_fraction(self) -> float | None:
        return self.zero_grad_fraction_sum / self.probes if self.probes else None

    @property
    def updates_lost_fraction(self) -> float | None:
        return self.updates_lost_fraction_sum / self.update_probes if self.update_probes else None

    @property
    def states_lost_fraction(self) -> dict[str, float] | None:
        """Per optimizer state, the average share of its updates lost; None before any probe
        saw a state (no probe yet, or each probe was a parameter's first step)."""
        sums = self.states_lost_fraction_sums
        return {name: sums[name] / n for name, n in self.state_probes.items()} or None


@dataclass
class ScaleHealth:
    """Watches the loss scale and the loss, step by step; says when to warn and when to stop.

    ``observe`` is called once per optimizer step with values the loop already has on the host.
    A warning is raised at most once per kind; ``diverged`` is set with a reason to stop the run.
    """

    settings: NumericsConfig  # min_loss_scale, warn_* and max_consecutive_nonfinite_loss
    consecutive_backoffs: int = 0
    consecutive_nonfinite_loss: int = 0
    nonfinite_loss_steps: list[int] = field(default_factory=list)
    recent_skips: list[bool] = field(default_factory=list)
    warnings: list[dict[str, Any]] = field(default_factory=list)
    diverged: str | None = None

    def _warn_once(self, kind: str, step: int, message: str) -> str | None:
        if any(w["kind"] == kind for w in self.warnings):
            return None
        self.warnings.append({"kind": kind, "step": step, "message": message})
        return message

    def observe(
        self, step: int, skipped: bool, scale: float | None, grew: bool, loss_finite: bool
    ) -> list[str]:
        """Record one step; return the warnings raised by it (each kind only once per run)."""
        s, raised = self.settings, []
        if loss_finite:
            self.consecutive_nonfinite_loss = 0
        else:
            self.consecutive_nonfinite_loss += 1
            self.nonfinite_loss_steps.append(step)
        if skipped:
            self.consecutive_backoffs += 1
        elif grew:
            self.consecutive_backoffs = 0
        self.recent_skips = [*self.recent_skips, skipped][-s.warn_window :]
        if self.consecutive_backoffs >= s.warn_consecutive_backoffs:
            raised.append(
                self._warn_once(
                    "consecutive_backoffs",
                    step,
                    f"loss scale backed off {self.consecutive_backoffs} times in a row without "
                    f"growing (now {scale:g}) at step {step}: gradients keep overflowing",
                )
            )
        rate = sum(self.recent_skips) / len(self.recent_skips)
        if len(self.recent_skips) >= min(s.warn_window, 20) and rate > s.warn_skip_rate:
            raised.append(
                self._warn_once(
                    "skip_rate",
                    step,
                    f"{rate:.0%} of the last {len(self.recent_skips)} steps were skipped "
                    f"(threshold {s.warn_skip_rate:.0%}) at step {step}",
                )
            )
        if scale is not None and skipped and scale <= s.min_loss_scale:
            self.diverged = (
                f"loss scale collapsed to {scale:g} (minimum {s.min_loss_scale:g}) at step {step}. "
                "A collapsed scale means a real numerical problem (bad data, an unstable component, "
                "a forward overflow), not a tuning issue; try precision=bf16, whose range needs no "
                "scaling"
            )
        elif self.consecutive_nonfinite_loss >= s.max_consecutive_nonfinite_loss:
            self.diverged = (
                f"the loss was non-finite for {self.consecutive_nonfinite_loss} consecutive steps "
                f"(up to step {step}): a forward overflow, which loss scaling cannot fix; try "
                "precision=bf16 or keep the culprit layer in FP32 (numerics.fp32_modules)"
            )
        return [w for w in raised if w]

    def summary(self) -> dict[str, Any]:
        return {
            "nonfinite_loss_steps": {
                "count": len(self.nonfinite_loss_steps),
                "steps": self.nonfinite_loss_steps[:100],
            },
            "warnings": self.warnings,
            "min_loss_scale": self.settings.min_loss_scale,
        }


def describe_culprit(culprit: dict[str, Any] | None) -> str:
    """One line for a :func:`find_culprit` result: a non-finite input batch if so, else the forward
    culprit if any, else the backward. The module is named with its class, ``0 (Linear)``."""
    if culprit is None:
        return "re-running the batch gave finite values (the failure did not reproduce)"
    if culprit.get("input"):  # NaN/inf that came with the data: no module is to blame
        return describe_input(culprit["input"])
    fwd, bwd = culprit.get("forward"), culprit.get("backward")
    if fwd:
        return (
            f"forward: first non-finite output at {row_label(fwd)} in {fwd['dtype']}; largest "
            f"finite value before it {fwd['largest_finite_before']:.4g}; {fwd['kind']}"
        )
    return (
        f"backward: first non-finite gradient at {row_label(bwd)} in {bwd['dtype']} with loss "
        f"scale {culprit['loss_scale']:g}; largest finite incoming gradient "
        f"{bwd['largest_finite_grad_output']:.4g}"
    )
