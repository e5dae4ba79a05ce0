"""Compare finished runs: the table a precision sweep ends with, and ``mptrain-compare DIR...``
(docs/sweeps.md shows the tables, their columns and notes).

A run is compared with the completed FP32 run whose config is otherwise identical, its baseline
(:func:`compare`); a throughput ratio is never one bare number but a median with a range and,
when that range is wide, too few windows were measured or the jobs ran at the same time, a
*noisy* reason (:func:`speed_spread`). Jobs that differ only in seed get a second table
(:mod:`mptrain.commands.seeds`); one bad run directory never stops a comparison
(:mod:`mptrain.commands.readable`).

After a Hydra multirun, :class:`SweepSummaryCallback` writes ``sweep.md``, ``sweep.json`` and
``sweep_loss.png`` into the sweep directory and prints the table; ``mptrain-compare`` writes them
into a directory of its own (:mod:`mptrain.commands.compare`).
"""

from __future__ import annotations

import datetime as dt
import json
import math
import time
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from rich.console import Console
from rich.markup import escape

from mptrain.commands.readable import curve_rows, readable, visible
from mptrain.commands.runs import (
    RunRecord,
    find_runs,
    this_sweeps_runs,
)
from mptrain.commands.seeds import (
    ACCURACY_COLUMNS,
    LOSS_COLUMNS,
    config_key,
    seed_groups,
    seed_notes,
    seed_table,
)
from mptrain.output.joblog import print_table as show_table
from mptrain.output.joblog import table_console
from mptrain.output.plots import plot_sweep
from mptrain.pace.spread import (
    MIN_SAMPLES,
    NOISY_SPREAD,
    Spread,
    format_ratio,
    window_ratio_spread,
)
from mptrain.platform.contention import busy_words
from mptrain.report.rows import fmt_bytes, fmt_pct, plural
from mptrain.report.schema import RunReport, ThroughputSection
from mptrain.rundir.fileio import atomic_write_text, clean_json
from mptrain.rundir.layout import METRICS_JSONL, SWEEP_PNG

SWEEP_MD, SWEEP_JSON = "sweep.md", "sweep.json"


def _comparison_key(report: RunReport) -> str:
    """The config minus the precision and everything that does not change the computation. The
    seed stays: in a sweep over seeds and precisions each run pairs with its own seed's FP32."""
    return config_key(report, ("precision.", "fp8.", "mx.", "nvfp4."), seed=True)


def _ratio(value: float | None, base: float | None) -> float | None:
    if value is None or base is None or base == 0:
        return None
    return value / base


def compare(runs: list[RunRecord]) -> list[dict[str, Any]]:
    """One row per run with its figures and, where an FP32 twin exists, the ratios against it;
    a run whose report the comparison cannot read (:func:`readable`) is a row with the reason."""
    runs = [readable(run) for run in runs]
    baselines: dict[str, RunReport] = {}
    for run in runs:
        r = run.report
        if r and _fp32_throughout(r):
            baselines.setdefault(_comparison_key(r), r)
    alongside = concurrent_jobs([run.report for run in runs if run.report is not None])
    rows = []
    for run in runs:
        row: dict[str, Any] = {"run": run.label, "directory": str(run.directory)}
        if run.report is None:
            row.update(status="failed", reason=run.reason)
        else:
            row.update(_figures(run.report), ran_alongside=alongside[_job(run.report)])
            base = baselines.get(_comparison_key(run.report))
            if base is not None:
                row.update(_against_baseline(run.report, base, alongside))
        rows.append(row)
    return rows


def _fp32_throughout(r: RunReport) -> bool:
    """A completed run in FP32 from its first step to its last: a baseline. A run that switched
    from FP32 to another precision is not (its accuracy and speed are partly the other's)."""
    return (
        r.status == "completed" and r.precision.effective == "fp32" and r.precision.switch is None
    )


def _job(r: RunReport) -> tuple[str, str]:
    """What tells one job from another: a report copied elsewhere is still the same job."""
    return (r.output_dir, r.started_at)


def concurrent_jobs(reports: list[RunReport]) -> dict[tuple[str, str], int]:
    """For each job (:func:`_job`), how many other jobs among ``reports`` ran at the same time:
    their started_at–finished_at spans overlap, whatever launched them (a joblib launcher, a
    second terminal; runs on two machines at once count too). A job sharing the machine's time
    disturbs the other's speed."""
    spans = {
        _job(r): (dt.datetime.fromisoformat(r.started_at), dt.datetime.fromisoformat(r.finished_at))
        for r in reports
    }
    return {
        job: sum(1 for other, (s, e) in spans.items() if other != job and s < end and start < e)
        for job, (start, end) in spans.items()
    }


def measured_windows(t: ThroughputSection) -> list[float]:
    """samples/s of the run's measured windows, leaving out those shorter than half the longest
    (a run's last window may hold a few steps: mostly timer noise); [] without windows."""
    if not t.window_samples_per_s:
        return []
    longest = max(t.window_steps)
    return [
        v for v, n in zip(t.window_samples_per_s, t.window_steps, strict=True) if 2 * n >= longest
    ]


def _parallel(count: int, whose: str) -> str | None:
    return f"{whose} ran at the same time as {plural(count, 'other job')}" if count else None


NO_WINDOWS = (
    "one measurement: no log_every window measured whole after warm-up (a report written before "
    "mptrain recorded them, or a run shorter than warm-up + log_every)"
)


def speed_spread(
    r: RunReport, base: RunReport, alongside: dict[tuple[str, str], int]
) -> Spread | None:
    """``r``'s speed against its FP32 twin ``base`` (see :mod:`mptrain.pace.spread`), marked noisy when
    either ran alongside another job or on a busy machine; None when either speed is not
    comparable or measured."""
    if not (r.throughput.comparable and base.throughput.comparable):
        return None
    windows, base_windows = measured_windows(r.throughput), measured_windows(base.throughput)
    if windows and base_windows:
        spread = window_ratio_spread(windows, base_windows)
    else:
        ratio = _ratio(r.throughput.samples_per_s, base.throughput.samples_per_s)
        if ratio is None:
            return None
        spread = Spread(ratio, ratio, ratio, 1, NO_WINDOWS)
    judged = [(r, "this job")] + ([(base, "its FP32 baseline")] if _job(base) != _job(r) else [])
    for run, who in judged:
        spread = spread.marked(_parallel(alongside[_job(run)], who)).marked(_busy(run, who))
    return spread


def _busy(r: RunReport, who: str) -> str | None:
    """Why ``r``'s speed is a busy machine's (others' work competed for the cores), or None."""
    busy = busy_words(r.hardware.get("machine_load"))
    return None if busy is None else f"{who} ran on a busy machine ({busy})"


def _figures(r: RunReport) -> dict[str, Any]:
    t, scale = r.training, r.training.loss_scale
    return {
        "status": r.status,
        "reason": r.reason,
        "precision": r.precision.what_ran(),
        "task": r.evaluation.task,
        "final_val_accuracy": r.evaluation.final_val_accuracy,
        # Every task's loss: two classifiers of the same accuracy still differ in it.
        "final_val_loss": r.evaluation.final_val_loss,
        "final_val_perplexity": r.evaluation.final_val_perplexity,
        "samples_per_s": r.throughput.samples_per_s,
        "peak_memory_bytes": r.memory.peak_bytes,
        **accounted_figures(r),
        "skipped_steps": t.skipped_steps["count"],
        "final_loss_scale": scale["final"] if scale else None,
        "zero_grad_fraction": t.zero_grad_fraction,
        "updates_lost_fraction": t.updates_lost_fraction,
    }


def accounted_figures(r: RunReport) -> dict[str, Any]:
    """One step's ``activation_bytes`` and all its ``accounted_bytes`` (``memory.accounted``); None
    where not counted (memory.account=false, FSDP, a report written before the accounting)."""
    accounted = r.memory.accounted
    if not isinstance(accounted, dict) or not isinstance(accounted.get("total"), dict):
        return {"activation_bytes": None, "accounted_bytes": None}  # not_counted: no totals
    return {
        "activation_bytes": accounted["total"].get("activations"),
        "accounted_bytes": accounted.get("total_bytes"),
    }


def _against_baseline(
    r: RunReport, base: RunReport, alongside: dict[tuple[str, str], int]
) -> dict[str, Any]:
    """Accuracy delta, throughput (median, quartiles, noisy reason), peak-memory and activation
    ratios against the FP32 twin ``base``."""
    acc, base_acc = r.evaluation.final_val_accuracy, base.evaluation.final_val_accuracy
    loss, base_loss = r.evaluation.final_val_loss, base.evaluation.final_val_loss
    speed = speed_spread(r, base, alongside)
    return {
        "baseline": base.output_dir,
        "accuracy_delta": None if acc is None or base_acc is None else acc - base_acc,
        "loss_delta": None if None in (loss, base_loss) else loss - base_loss,
        "throughput_ratio": speed.median if speed else None,
        "throughput_ratio_range": [speed.low, speed.high] if speed else None,
        "throughput_noisy": speed.noisy if speed else None,
        "throughput_windows": speed.samples if speed else None,
        "memory_ratio": _ratio(r.memory.peak_bytes, base.memory.peak_bytes),
        "activation_ratio": _ratio(*(accounted_figures(x)["activation_bytes"] for x in (r, base))),
    }


# ---------------------------------------------------------------------------------- rendering
_HEAD = (("run", "run"), ("status", "status"), ("precision", "precision"))
_TAIL = (
    ("throughput_ratio", "speed vs fp32"),
    ("memory_ratio", "memory vs fp32"),
    ("activation_bytes", "activations"),
    ("activation_ratio", "activations vs fp32"),
    ("accounted_bytes", "accounted"),
    ("skipped_steps", "skipped"),
    ("final_loss_scale", "final scale"),
    ("zero_grad_fraction", "zero grads"),
    ("updates_lost_fraction", "updates lost"),
)
# The primary metric first: a language model's loss, a classifier's accuracy.
COLUMNS = (*_HEAD, *LOSS_COLUMNS, *ACCURACY_COLUMNS, *_TAIL)
CLASSIFY_COLUMNS = (*_HEAD, *ACCURACY_COLUMNS, *LOSS_COLUMNS, *_TAIL)


def _cell(row: dict[str, Any], key: str) -> str:
    """The text of ``row``'s ``key`` column, control characters escaped (:func:`visible`)."""
    return visible(_text(row, key))


def _loss_delta(value: float) -> str:
    """``+0.0003``; a difference too small for four decimals in two significant digits
    (``+7.2e-06``), so that ``+0.0000`` means none."""
    text = f"{value:+.4f}"
    return f"{value:+.1e}" if value and float(text) == 0 else text


# The columns whose text is a format of their (finite) value alone.
_FORMATS = {
    "final_val_loss": "{:.4f}".format,
    "final_val_perplexity": "{:.2f}".format,
    "memory_ratio": "{:.2f}×".format,
    "activation_ratio": "{:.2f}×".format,
    "final_loss_scale": "{:g}".format,
    "loss_delta": _loss_delta,
    "accuracy_delta": lambda value: f"{100 * value:+.2f} pt",
    "activation_bytes": fmt_bytes,
    "accounted_bytes": fmt_bytes,
}


def _text(row: dict[str, Any], key: str) -> str:
    value = row.get(key)
    if key == "status" and row.get("reason") and value != "completed":
        return f"{value}: {row['reason']}"
    if value is None:
        return "—"
    if key in ("final_val_accuracy", "zero_grad_fraction", "updates_lost_fraction"):
        return fmt_pct(value)
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # nan, inf: as report.json spells them (a diverged run's loss)
    if key in _FORMATS:
        return _FORMATS[key](value)
    if key == "throughput_ratio":
        low, high = row["throughput_ratio_range"]
        spread = Spread(value, low, high, row["throughput_windows"], row["throughput_noisy"])
        return format_ratio(spread)
    return str(value)


def _lm_rows(rows: list[dict[str, Any]]) -> bool:
    return any(row.get("task") == "lm" for row in rows)


def _columns(rows: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """The columns with at least one value (a sweep without FP16 has no loss-scale column), the
    primary metric's first (a language model's loss where a row is one, else accuracy)."""
    order = COLUMNS if _lm_rows(rows) else CLASSIFY_COLUMNS
    return [(k, h) for k, h in order if any(row.get(k) is not None for row in rows)]


def _md_table(headers: list[str], cells: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return lines + ["| " + " | ".join(c.replace("|", "/") for c in row) + " |" for row in cells]


def figure_metric(rows: list[dict[str, Any]]) -> str:
    """What sweep_loss.png plots: the validation loss a language model's table ranks by, else
    the training loss."""
    return "validation loss" if _lm_rows(rows) else "training loss"


def render_markdown(
    rows: list[dict[str, Any]],
    title: str,
    figure: str | None,
    groups: list[dict[str, Any]] | None = None,
) -> str:
    """sweep.md: the comparison, its notes, the over-seeds table of ``groups``
    (:func:`~mptrain.commands.seeds.seed_groups`) when there is one, the figure."""
    columns = _columns(rows)
    lines = [f"# {visible(title)}", ""]
    lines += _md_table(
        [h for _, h in columns], [[_cell(row, k) for k, _ in columns] for row in rows]
    )
    lines += [
        "",
        "Δ loss, Δ acc, speed, memory and activations compare each run with the completed FP32 "
        "run of otherwise identical config (— where there is none; a run that switched precision "
        "is none). Activations: what autograd saved for one micro-batch's backward; accounted: "
        "all of one step's counted bytes (parameters, gradients, optimizer states, casts, "
        "activations; — where the run did not count them). Zero grads and updates lost are "
        "averages of the probes taken every probe_every steps.",
        "",
        *(f"- {line}" for line in speed_notes(rows)),
    ]
    if groups:
        lines += ["", "## Over seeds", "", *_md_table(*seed_table(groups)), ""]
        lines += [f"- {line}" for line in seed_notes(groups)]
    if figure:
        lines += ["", f"![{figure_metric(rows)}]({figure})"]
    peak = [r for r in rows if r.get("peak_memory_bytes")]
    if peak:
        lines += [
            "",
            "Peak memory: "
            + ", ".join(
                f"{visible(r['run'] or '?')}: {fmt_bytes(r['peak_memory_bytes'])}" for r in peak
            ),
        ]
    return "\n".join(lines) + "\n"


def speed_notes(rows: list[dict[str, Any]]) -> list[str]:
    """What the speed column means, then one line per noisy speed ratio with its reason (nothing
    when no row has a speed ratio)."""
    if not any(r.get("throughput_ratio") is not None for r in rows):
        return []
    lines = [
        "Speed: the median samples/s of the run's log_every windows (after warm-up, evaluation "
        "excluded) over the FP32 run's, with the quartiles of every window against every FP32 "
        f"window in brackets. Noisy: that range is wider than {NOISY_SPREAD:.0%} of the median, "
        f"fewer than {MIN_SAMPLES} windows, or a job ran at the same time as another: do not "
        "read it as fact. Emulated FP8 gets no speed ratio."
    ]
    lines += [
        visible(f"{r['run']}: speed noisy: {r['throughput_noisy']}")
        for r in rows
        if r.get("throughput_noisy")
    ]
    return lines


def print_table(
    console: Console,
    rows: list[dict[str, Any]],
    title: str,
    groups: list[dict[str, Any]] | None = None,
) -> None:
    """The comparison on ``console`` (:func:`~mptrain.output.joblog.print_table`: rich on a
    terminal, plain text in a log file), then the speed notes, then the over-seeds table of
    ``groups`` and its notes when there is one."""
    columns = _columns(rows)
    cells = [[_cell(row, k) for k, _ in columns] for row in rows]
    # Labels and speeds (noisy marks) stay whole; the other figures' columns give way.
    whole = frozenset(h for k, h in columns if k in ("run", "throughput_ratio"))
    show_table(console, visible(title), [h for _, h in columns], cells, whole)
    for line in speed_notes(rows):
        console.print(escape(line))
    if groups:
        show_table(console, "over seeds (mean ± sd)", *seed_table(groups), frozenset({"group"}))
        for line in seed_notes(groups):
            console.print(escape(line))


def write_comparison(
    runs: list[RunRecord], out_dir: Path, title: str, console: Console
) -> list[dict[str, Any]]:
    """Write sweep.md, sweep.json and sweep_loss.png into ``out_dir``; print the table (and the
    over-seeds table where jobs differ only in seed: :func:`seed_groups`), then a note per
    metrics.jsonl whose rows were not all read (:func:`curve_rows`). sweep.json keeps
    the runs' text as it is (JSON escapes control characters) and non-finite numbers as
    report.json does ("nan")."""
    runs = [readable(run) for run in runs]
    rows = compare(runs)
    curves, notes = {}, []
    for run in runs:
        metrics = run.directory / METRICS_JSONL
        if run.report is not None and metrics.is_file():
            curve, note = curve_rows(metrics)
            curves[visible(run.label or run.directory.name)] = curve
            notes += [note] if note else []
    figure = None
    if curves:
        plot_sweep(curves, visible(title), out_dir / SWEEP_PNG)
        figure = SWEEP_PNG
    groups = seed_groups(runs, rows)
    data = clean_json({"title": title, "runs": rows, "seed_groups": groups})
    atomic_write_text(out_dir / SWEEP_JSON, json.dumps(data, indent=2) + "\n")
    atomic_write_text(out_dir / SWEEP_MD, render_markdown(rows, title, figure, groups))
    print_table(console, rows, title, groups)
    for note in notes:
        console.print(escape(f"note: {visible(note)}"))
    console.print(escape(visible(f"comparison written to {out_dir / SWEEP_MD}")))
    return rows


# -------------------------------------------------------------------------------- entry points
def wide_console() -> Console:
    return table_console(160)  # up to 17 columns, speeds with their range


class SweepSummaryCallback(Callback):
    """Hydra callback: after a multirun, compare its jobs (configured in conf/config.yaml)."""

    def __init__(self) -> None:
        self.started: float | None = None

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        self.started = time.time()  # the jobs of this sweep are those written since

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        """Compare this sweep's jobs (:func:`this_sweeps_runs`); every run in the directory when
        the sweep's start was not seen (called on its own)."""
        sweep_dir = Path(config.hydra.sweep.dir)
        if not sweep_dir.is_dir():
            return
        write_sweep_summary(sweep_dir, self.started)


def write_sweep_summary(sweep_dir: Path, started: float | None) -> list[RunRecord]:
    """Write and print the comparison of the sweep that started at ``started`` in ``sweep_dir``
    (:func:`this_sweeps_runs`; every run there when ``started`` is None) and return its runs;
    nothing when it has none."""
    try:
        runs = find_runs([sweep_dir]) if started is None else this_sweeps_runs(sweep_dir, started)
    except FileNotFoundError:
        return []
    if runs:
        write_comparison(runs, sweep_dir, f"sweep {sweep_dir}", wide_console())
    return runs
