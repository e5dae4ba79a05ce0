"""PNG figures: per run (training loss, validation accuracy, loss scale) and per sweep (loss curves).

matplotlib runs headless (Agg backend); figures are written atomically next to the reports.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mptrain.fileio import atomic_write

RUN_PNG = "curves.png"
SWEEP_PNG = "sweep_loss.png"


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: Path) -> None:
    atomic_write(
        path, lambda f: fig.savefig(f, format="png", dpi=110, bbox_inches="tight"), binary=True
    )


def _series(rows: list[dict[str, Any]], kind: str, key: str) -> tuple[list[int], list[float]]:
    points = [
        (r["step"], r[key])
        for r in rows
        if r.get("kind") == kind and isinstance(r.get(key), int | float)
    ]
    return [p[0] for p in points], [p[1] for p in points]


def plot_run(rows: list[dict[str, Any]], title: str, path: Path) -> Path:
    """Three panels over optimizer steps: training loss, validation accuracy, loss scale."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    steps, loss = _series(rows, "train", "loss")
    axes[0].plot(steps, loss)
    axes[0].set(
        title="training loss", xlabel="step", yscale="log" if loss and min(loss) > 0 else "linear"
    )
    steps, acc = _series(rows, "eval", "val_accuracy")
    axes[1].plot(steps, [100 * a for a in acc], marker="o")
    axes[1].set(title="validation accuracy (%)", xlabel="step")
    steps, scale = _series(rows, "train", "loss_scale")
    if scale:
        axes[2].step(steps, scale, where="post")
        axes[2].set(yscale="log")
    else:
        axes[2].text(0.5, 0.5, "no loss scaling", ha="center", va="center")
    axes[2].set(title="loss scale", xlabel="step")
    fig.suptitle(title, y=1.04)
    _save(fig, path)
    plt.close(fig)
    return path


def plot_sweep(curves: dict[str, list[dict[str, Any]]], title: str, path: Path) -> Path:
    """Training-loss curves of every job of a sweep (or comparison) on one axis."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    positive = True
    for label, rows in curves.items():
        steps, loss = _series(rows, "train", "loss")
        if steps:
            ax.plot(steps, loss, label=label)
            positive = positive and min(loss) > 0
    ax.set(
        title=title, xlabel="step", ylabel="training loss", yscale="log" if positive else "linear"
    )
    ax.legend(fontsize=8)
    _save(fig, path)
    plt.close(fig)
    return path
