"""What a comparison can read of a run directory (mptrain-compare, a sweep's summary): one bad
directory never stops a comparison. A report.json field of the wrong type or an unreadable
number makes that run a row saying so (:func:`readable`); a metrics row cut short by a kill or a
full disk is left out of the curves (:func:`curve_rows`); control characters from files (a
``.hydra/overrides.yaml`` anyone can write) are escaped before they reach a terminal or sweep.md
(:func:`visible`)."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import re
from pathlib import Path
from typing import Any

from mptrain.commands.runs import RunRecord
from mptrain.report.rows import plural
from mptrain.report.schema import RunReport
from mptrain.rundir.layout import REPORT_JSON


class Unreadable(ValueError):
    """A report field the comparison cannot read; the message names the field."""


def readable(run: RunRecord) -> RunRecord:
    """``run``, when the comparison can read every field of its report it uses; else ``run``
    without a report, its reason naming the first field it cannot read ("unreadable
    report.json: evaluation.final_val_accuracy: a string ("high"), not a number"), so one report
    from another tool or a hand edit is a row, not the end of the comparison. A non-finite number
    written as a string (``"nan"``, ``"inf"``: report.json is strict JSON) is read as that float,
    in place."""
    if run.report is None:
        return run
    try:
        _check_report(run.report)
    except Unreadable as exc:
        return dataclasses.replace(run, report=None, reason=f"unreadable {REPORT_JSON}: {exc}")
    return run


# Numbers the rows show or divide, by section; None (not measured) is allowed for each.
NUMBERS = {
    "evaluation": ("final_val_accuracy", "final_val_loss", "final_val_perplexity"),
    "throughput": ("samples_per_s",),
    "memory": ("peak_bytes",),
    "training": ("zero_grad_fraction", "updates_lost_fraction"),
}


def _check_report(r: RunReport) -> None:
    """Unreadable for the first field :func:`compare` and the rendering use that has a type they
    cannot use; converts the non-finite numbers written as strings (see :func:`readable`)."""
    for name in ("status", "output_dir"):
        _expect(getattr(r, name), str, name)
    _expect(r.reason, (str, type(None)), "reason")
    for name in ("started_at", "finished_at"):
        _timestamp(getattr(r, name), name)
    _expect(r.config, dict, "config")
    _expect(r.hardware, dict, "hardware")
    _machine_load(r.hardware.get("machine_load"))
    for section, names in NUMBERS.items():
        values = _section(r, section)
        for name in names:
            setattr(values, name, _number(getattr(values, name), f"{section}.{name}"))
    _expect(r.evaluation.task, str, "evaluation.task")
    _check_precision(_section(r, "precision"))
    _check_throughput(r.throughput)
    _check_training(r.training)


def _check_precision(p: Any) -> None:
    for name in ("effective", "label"):
        _expect(getattr(p, name), (str, type(None)), f"precision.{name}")
    switch = _expect(p.switch, (dict, type(None)), "precision.switch")
    if switch is not None:
        _expect(switch.get("to_label"), str, "precision.switch.to_label")
        _expect(switch.get("step"), int, "precision.switch.step")
        after = switch.get("switched_after_step")
        _expect(after, (int, type(None)), "precision.switch.switched_after_step")


def _check_throughput(t: Any) -> None:
    """The measured windows are divided one by another: positive numbers, one step count each."""
    _expect(t.comparable, bool, "throughput.comparable")
    speeds = _expect(t.window_samples_per_s, (list, type(None)), "throughput.window_samples_per_s")
    steps = _expect(t.window_steps, (list, type(None)), "throughput.window_steps")
    if not speeds:
        return
    for i, v in enumerate(speeds):
        value = _number(v, f"throughput.window_samples_per_s[{i}]")
        if value is None or not value > 0:
            raise Unreadable(f"throughput.window_samples_per_s[{i}]: {_what(v)}, not a speed")
    if steps is None or len(steps) != len(speeds):
        raise Unreadable("throughput.window_steps: not one step count per measured window")
    for i, n in enumerate(steps):
        _expect(n, int, f"throughput.window_steps[{i}]")


def _check_training(t: Any) -> None:
    skipped = _expect(t.skipped_steps, dict, "training.skipped_steps")
    _expect(skipped.get("count"), int, "training.skipped_steps.count")
    scale = _expect(t.loss_scale, (dict, type(None)), "training.loss_scale")
    if scale is not None:
        scale["final"] = _number(scale.get("final"), "training.loss_scale.final")


def _section(r: RunReport, name: str) -> Any:
    """The section ``name`` of ``r``; Unreadable when report.json held no object there."""
    section = getattr(r, name)
    if not dataclasses.is_dataclass(section):
        raise Unreadable(f"{name}: {_what(section)}, not a section (an object)")
    return section


# The JSON types a report's fields are checked for, as a reason names them.
JSON_TYPES = {
    str: "a string",
    int: "an integer",
    bool: "true or false",
    dict: "an object",
    list: "a list",
    type(None): "null",
}


def _expect(value: Any, types: type | tuple[type, ...], name: str) -> Any:
    """``value`` when it is one of ``types`` (a bool is no integer here); else Unreadable."""
    wanted = types if isinstance(types, tuple) else (types,)
    if isinstance(value, wanted) and (bool in wanted or not isinstance(value, bool)):
        return value
    expected = " or ".join(JSON_TYPES[t] for t in wanted)
    raise Unreadable(f"{name}: {_what(value)}, not {expected}")


# How JSON writers spell the numbers JSON has no literal for (mptrain: "nan", "inf", "-inf").
NON_FINITE = re.compile(r"\s*[+-]?(nan|inf|infinity)\s*", re.IGNORECASE)


def _number(value: Any, name: str) -> float | int | None:
    """``value`` as a number (None stays None); a non-finite one written as a string (any case,
    signed or not: "nan", "-inf", "Infinity") as that float; Unreadable for anything else."""
    if value is None or (isinstance(value, int | float) and not isinstance(value, bool)):
        return value
    if isinstance(value, str) and NON_FINITE.fullmatch(value):
        return float(value)
    raise Unreadable(f"{name}: {_what(value)}, not a number")


def _timestamp(value: Any, name: str) -> None:
    """An ISO time with its UTC offset (what mptrain writes): jobs are ordered by these, and a
    time without an offset cannot be compared with one that has one."""
    text = _expect(value, str, name)
    try:
        when = dt.datetime.fromisoformat(text)
    except ValueError:
        raise Unreadable(f"{name}: {_what(value)}, not an ISO date and time") from None
    if when.tzinfo is None:
        raise Unreadable(f"{name}: {_what(value)}, a time without its UTC offset")


def _machine_load(load: Any) -> None:
    """hardware.machine_load: None, or the busy verdict (and its words when busy)."""
    if not load:
        return
    _expect(load, dict, "hardware.machine_load")
    if _expect(load.get("busy"), bool, "hardware.machine_load.busy"):
        _expect(load.get("words"), str, "hardware.machine_load.words")


def _what(value: Any) -> str:
    """A value as a reason names it: its JSON type and, when short, the value itself."""
    if value is None or isinstance(value, dict | list):
        return JSON_TYPES[type(value)]
    kind = "a boolean" if isinstance(value, bool) else JSON_TYPES.get(type(value), "a number")
    text = json.dumps(value)  # JSON's spelling, control characters escaped
    return f"{kind} ({text})" if len(text) <= 40 else kind


# Control characters (C0, DEL, C1: what a terminal obeys, ESC sequences included) and nothing else.
CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def visible(text: str) -> str:
    """``text`` with each control character written as its Python escape (ESC as ``\\x1b``, a
    newline as ``\\n``): run labels come from ``.hydra/overrides.yaml`` and reasons from the
    runs' files, and a terminal would obey what they hold (clear the screen, retitle the window,
    hide text) and a newline would break a Markdown table row."""
    return CONTROL.sub(lambda m: repr(m.group())[1:-1], text)


def curve_rows(path: Path) -> tuple[list[dict[str, Any]], str | None]:
    """The rows of a run's metrics.jsonl the loss curves can use, and a note when some were left
    out: a row cut short (what a kill -9 or a full disk leaves as the last line), or one that is
    not a JSON object, or a training or evaluation row without an integer step. No rows and a
    note when the file cannot be read."""
    try:
        text = path.read_bytes().decode("utf-8", errors="replace")  # a cut character: that row
    except OSError as exc:
        return [], f"{path}: not read ({exc.strerror}); no loss curve for its run"
    rows, left_out = [], 0
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except (ValueError, RecursionError):
            row = None
        usable = isinstance(row, dict) and (
            row.get("kind") not in ("train", "eval") or type(row.get("step")) is int
        )
        if usable:
            rows.append(row)
        else:
            left_out += 1
    if not left_out:
        return rows, None
    why = "cut short by a kill or a full disk, or not mptrain's"
    return rows, f"{path}: left out {plural(left_out, 'unreadable row')} ({why})"
