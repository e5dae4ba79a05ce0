"""A precision schedule's switch (``precision.switch``) in words, for the run's summary and
report.md: when it switched and into what, and the train loss and evaluations either side."""

from __future__ import annotations

from typing import Any


def _num(x: float | None) -> str:
    return "n/a" if x is None else format(x, ".4g")


def switch_rows(switch: dict[str, Any] | None) -> list[tuple[str, str]]:
    """A precision schedule's switch in one row: when, into what, and the loss either side."""
    if switch is None:
        return []
    to = (
        f"{switch['to_label']} (autocast {switch['to_autocast_dtype'] or 'none'}, loss scaling "
        f"{'on' if switch['to_loss_scaling'] else 'off'})"
    )
    words = f"{switch['from_label']} -> {to} after step {switch['step']}"
    if switch["switched_after_step"] is None:
        return [("precision switch", f"{words}: not reached")]
    if switch["switched_after_step"] != switch["step"]:
        words = words.replace(f"step {switch['step']}", f"step {switch['switched_after_step']}")
    return [("precision switch", "; ".join([words, *_switch_effect(switch)]))]


def _switch_effect(switch: dict[str, Any]) -> list[str]:
    """The train loss over the steps either side of the switch and the evaluations around it."""
    parts = []
    before, after = switch["train_loss_before"], switch["train_loss_after"]
    if before and after:
        change = f"train loss {_span(before)} -> {_span(after)}: {switch['loss_change']:+.4f}"
        earlier = switch["train_loss_earlier"]
        if earlier:  # how the loss moved over as many steps without a switch
            steps = f"steps {earlier['steps'][0]}-{earlier['steps'][1]} -> {before['steps'][0]}-"
            change += f"; before it, {steps}{before['steps'][1]}: {switch['trend_before']:+.4f}"
        parts.append(change)
    ev_before, ev_after = switch["eval_before"], switch["eval_after"]
    if ev_before and ev_after:
        parts.append(
            f"val loss {_num(ev_before['val_loss'])} (step {ev_before['step']}) -> "
            f"{_num(ev_after['val_loss'])} (step {ev_after['step']})"
        )
    return parts


def _span(window: dict[str, Any]) -> str:
    """``2.3100 (steps 81-100)``: a mean train loss and the steps it is over."""
    return f"{window['mean']:.4f} (steps {window['steps'][0]}-{window['steps'][1]})"
