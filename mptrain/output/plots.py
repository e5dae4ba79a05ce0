"""PNG figures: per run (training loss, validation accuracy, the loss scale where there is one)
and per sweep (loss curves: training loss, a language model's validation loss).

matplotlib runs headless (Agg backend); figures are written atomically next to the reports.

A run draws its figure in a :class:`FigureWorker`, a child process started with the job, which
imports matplotlib on another core while the job sets up and trains (BENCHMARKS.md: the figure).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

from mptrain.rundir.fileio import atomic_write


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: Path) -> Path:
    """Write ``fig`` to ``path`` as a PNG (atomically), close it and return ``path``."""
    atomic_write(
        path, lambda f: fig.savefig(f, format="png", dpi=110, bbox_inches="tight"), binary=True
    )
    _pyplot().close(fig)
    return path


def _series(rows: list[dict[str, Any]], kind: str, key: str) -> tuple[list[int], list[float]]:
    points = [
        (r["step"], r[key])
        for r in rows
        if r.get("kind") == kind and isinstance(r.get(key), int | float)
    ]
    return [p[0] for p in points], [p[1] for p in points]


def plot_run(rows: list[dict[str, Any]], title: str, path: Path) -> Path:
    """Panels over optimizer steps: training loss, validation accuracy, and the loss scale when
    the run scaled its loss (FP16; other precisions have none to draw). A language model's rows
    (evaluations with a perplexity) put the validation loss beside the training loss, and the
    accuracy panel is its next-token accuracy."""
    plt = _pyplot()
    scale_steps, scale = _series(rows, "train", "loss_scale")
    panels = 3 if scale else 2
    fig, axes = plt.subplots(1, panels, figsize=(13 * panels / 3, 3.6))
    lm = any("val_perplexity" in r for r in rows if r.get("kind") == "eval")
    steps, loss = _series(rows, "train", "loss")
    axes[0].plot(steps, loss, label="training", marker=_marker(steps))
    if lm:
        val_steps, val_loss = _series(rows, "eval", "val_loss")
        axes[0].plot(val_steps, val_loss, marker="o", label="validation")
        axes[0].legend(fontsize=8)
        loss = loss + val_loss
    axes[0].set(
        title="loss (nats/token)" if lm else "training loss",
        xlabel="step",
        yscale="log" if loss and min(loss) > 0 else "linear",
    )
    steps, acc = _series(rows, "eval", "val_accuracy")
    axes[1].plot(steps, [100 * a for a in acc], marker="o")
    accuracy = "next-token accuracy" if lm else "validation accuracy"
    axes[1].set(title=f"{accuracy} (%)", xlabel="step")
    if scale:
        axes[2].step(scale_steps, scale, where="post", marker=_marker(scale_steps))
        axes[2].set(title="loss scale", xlabel="step", yscale="log")
    fig.suptitle(title, y=1.04)
    return _save(fig, path)


def _marker(steps: list[int]) -> str | None:
    """A dot where a curve has one point: a line through one point draws nothing."""
    return "o" if len(steps) == 1 else None


def plot_sweep(curves: dict[str, list[dict[str, Any]]], title: str, path: Path) -> Path:
    """Training-loss curves of every job of a sweep (or comparison) on one axis; a job with one
    logged point (a short run) is drawn as a dot. A language model's sweep (evaluations with a
    perplexity, as :func:`plot_run` tells them) draws the validation-loss curves instead, a dot at
    each evaluation: what its table ranks by."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    validation = any(
        r.get("kind") == "eval" and "val_perplexity" in r for rows in curves.values() for r in rows
    )
    kind, key = ("eval", "val_loss") if validation else ("train", "loss")
    positive = True
    for label, rows in curves.items():
        steps, loss = _series(rows, kind, key)
        if steps:
            ax.plot(steps, loss, label=label, marker="o" if validation else _marker(steps))
            positive = positive and min(loss) > 0
    ylabel = "validation loss (nats/token)" if validation else "training loss"
    ax.set(title=title, xlabel="step", ylabel=ylabel, yscale="log" if positive else "linear")
    ax.legend(fontsize=8)
    return _save(fig, path)


class FigureWorker:
    """A child process that imports matplotlib now and draws one run figure when asked.

    Use as a context manager (the child is killed on exit if it was never asked, e.g. after a
    failed setup). It runs in its own session, so a Ctrl-C meant for the job does not kill it
    before the interrupted run's figure is drawn; it exits by itself when the job dies (its stdin
    closes).
    """

    def __init__(self) -> None:
        root = str(Path(__file__).resolve().parents[2])  # this mptrain, however it was found
        code = f"import sys; sys.path.insert(0, {root!r}); from mptrain.output.plots import serve; serve()"
        try:
            self._child: subprocess.Popen[str] | None = subprocess.Popen(
                [sys.executable, "-c", code],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
        except OSError:  # no interpreter to start (an embedded Python), no processes left
            self._child = None  # plot_run draws here instead

    def __enter__(self) -> FigureWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._child is not None:
            if self._child.poll() is None:
                self._child.kill()
            self._child.communicate()

    def plot_run(self, rows: list[dict[str, Any]], title: str, path: Path) -> Path:
        """:func:`plot_run` in the child (in this process when it could not start); RuntimeError
        with the child's last line if it fails."""
        if self._child is None:
            return plot_run(rows, title, path)
        # One line (JSON escapes newlines in strings), see serve().
        request = json.dumps({"rows": rows, "title": title, "path": str(path)}) + "\n"
        try:
            _, err = self._child.communicate(request, timeout=300)
        except (BrokenPipeError, subprocess.TimeoutExpired) as exc:
            self._child.kill()
            raise RuntimeError(f"the figure process did not answer ({exc})") from exc
        if self._child.returncode != 0:
            last = (err.strip().splitlines() or ["no message"])[-1]
            raise RuntimeError(f"the figure process failed: {last}")
        return path


def serve() -> None:
    """The worker's side: import matplotlib, then draw the figure asked for in one line of stdin
    (JSON with ``rows``, ``title``, ``path``); nothing when stdin closes first.

    One line, not "until end of file": DataLoader workers forked by the job after this child
    started hold copies of the pipe's write end, so the end of file may never come.
    """
    _pyplot()
    request = sys.stdin.readline()
    if request:
        job = json.loads(request)
        plot_run(job["rows"], job["title"], Path(job["path"]))


def plot_advice(
    curves: dict[str, list[float]],
    speeds: list[tuple[str, float, float, float]],
    title: str,
    path: Path,
) -> Path:
    """``mptrain advise``: the short runs' training loss per step (the first curve is FP32's),
    each other precision's relative difference to it per step, and each precision's speed ratio
    to FP32 as a bar with its min–max."""
    plt = _pyplot()
    fig, (loss_ax, diff_ax, speed_ax) = plt.subplots(1, 3, figsize=(16, 4))
    reference = next(iter(curves.values()), [])
    for i, (label, losses) in enumerate(curves.items()):
        color = f"C{i}"  # the same precision, the same colour in both panels
        loss_ax.plot(range(1, len(losses) + 1), losses, label=label, color=color)
        diffs = [
            100 * abs(a - b) / abs(b) if b and math.isfinite(a) else math.nan
            for a, b in zip(losses, reference, strict=False)
        ]
        if losses is not reference:
            diff_ax.plot(range(1, len(diffs) + 1), diffs, label=label, color=color)
    finite = [x for losses in curves.values() for x in losses if math.isfinite(x)]
    loss_ax.set(
        title="training loss, same weights and batches",
        xlabel="step",
        yscale="log" if finite and min(finite) > 0 else "linear",
    )
    diff_ax.set(title="|loss − FP32's| / FP32's (%)", xlabel="step")
    for ax in (loss_ax, diff_ax):
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    if speeds:
        labels = [s[0] for s in speeds]
        medians = [s[1] for s in speeds]
        errors = [[s[1] - s[2] for s in speeds], [s[3] - s[1] for s in speeds]]
        speed_ax.bar(labels, medians, yerr=errors, capsize=4, color="tab:blue")
        speed_ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    else:
        speed_ax.text(0.5, 0.5, "speed not measured", ha="center", va="center")
    speed_ax.set(title="samples/s vs FP32 (median, min–max)", ylabel="×")
    fig.suptitle(title, y=1.03)
    return _save(fig, path)


def plot_layer_plan(layers: list[dict[str, Any]], title: str, path: Path, fmt: str = "FP8") -> Path:
    """``mptrain advise``'s per-layer map for the low-precision recipe ``fmt`` (its label, e.g.
    "fp8 rowwise", "mxfp8"), one row per eligible layer, the most sensitive at the top: the SQNR
    (dB) of its output, its gradients and the model's gradient with it alone in ``fmt``; and its
    share of the all-layers gradient error (%). Each row of ``layers`` holds
    ``label`` and those figures; a non-finite SQNR (exact, or no signal left) draws no bar."""
    plt = _pyplot()
    # Constrained layout places the suptitle above the panels' titles and the legend below the
    # panels, each with room of its own whatever the layer count; 2.2 in: titles, axis labels
    # and legend.
    height = 2.2 + 0.45 * len(layers)
    fig, (sqnr_ax, share_ax) = plt.subplots(
        1, 2, figsize=(14, height), sharey=True, layout="constrained"
    )
    labels = [row["label"] for row in layers]
    places = list(range(len(layers)))
    series = (
        ("output_sqnr_db", "its output"),
        ("input_grad_sqnr_db", "its input gradient"),
        ("weight_grad_sqnr_db", "its weight gradient"),
        ("alone_grad_sqnr_db", f"model gradient, it alone in {fmt}"),
    )
    bar = 0.8 / len(series)
    for i, (key, name) in enumerate(series):
        values = [_finite_or_nan(row[key]) for row in layers]
        sqnr_ax.barh([p + (i - 1.5) * bar for p in places], values, height=bar, label=name)
    sqnr_ax.set(title="SQNR against FP32 (dB; lower: more error)", xlabel="dB")
    # Below the panels: inside, it would cover the top rows' bars.
    fig.legend(fontsize=8, loc="outside lower left", ncol=4)
    shares = [100 * _finite_or_nan(row["share"]) for row in layers]
    share_ax.barh(places, shares, color="tab:red")
    share_ax.set(title=f"share of the all-layers {fmt} gradient error (%)", xlabel="%")
    sqnr_ax.set_yticks(places, labels)
    sqnr_ax.invert_yaxis()  # rank 1 at the top
    fig.suptitle(title)
    return _save(fig, path)


def _finite_or_nan(x: float | None) -> float:
    return x if x is not None and math.isfinite(x) else math.nan
