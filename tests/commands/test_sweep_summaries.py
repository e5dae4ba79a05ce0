"""What a sweep's summary says (issue 39, item 10): the validation loss of classifiers beside their
accuracy, the mean ± sd of jobs that differ only in seed, the metric a language model's comparison
figure plots, and the layout of advise's per-layer figure.

CPU-only. Tiny in-process runs (model=mlp, a few steps; a one-layer GPT for the language model)
made once per module and compared as ``mptrain-compare`` and a sweep's summary compare them; one
real ``-m seed=1,2,3`` multirun as a subprocess (slow tier).
"""

from __future__ import annotations

import json
import shutil
import statistics
from pathlib import Path
from typing import Any

import pytest
from support.processes import describe
from support.runs import LM, compose_run, tiny_run, train
from support.sweeps import read_report, run_sweep

from mptrain.commands import compare, sweep
from mptrain.output import plots
from mptrain.rundir.layout import REPORT_JSON

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def md_tables(text: str) -> list[list[dict[str, str]]]:
    """Every Markdown table in ``text``, each as its rows of {header: cell}."""
    tables, block = [], []
    for line in [*text.splitlines(), ""]:
        if line.startswith("|"):
            block.append([c.strip() for c in line.strip().strip("|").split("|")])
        elif block:
            header, _, *rows = block
            tables.append([dict(zip(header, row, strict=True)) for row in rows])
            block = []
    return tables


def md_headers(text: str) -> list[str]:
    first = next(line for line in text.splitlines() if line.startswith("|"))
    return [c.strip() for c in first.strip().strip("|").split("|")]


def evaluation(run: Path) -> dict[str, Any]:
    return read_report(run)["evaluation"]


# ------------------------------------------------------------------------ classification runs
@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """fp32 and bf16, each with seeds 1 and 2: two precisions, two seeds each."""
    root = tmp_path_factory.mktemp("runs")
    dirs = {}
    for precision in ("fp32", "bf16"):
        for seed in (1, 2):
            name = f"{precision}_seed{seed}"
            dirs[name] = root / name
            train(tiny_run(f"precision={precision}", f"seed={seed}", "max_steps=6"), dirs[name])
    return dirs


def compared(paths: list[Path], out: Path) -> dict[str, Any]:
    """``mptrain-compare PATHS --out OUT``: sweep.json."""
    compare.compare_main([*(str(p) for p in paths), "--out", str(out)])
    return json.loads((out / sweep.SWEEP_JSON).read_text(encoding="utf-8"))


def test_a_classification_table_has_the_validation_loss_and_its_delta(
    runs, drawn, tmp_path, capsys
):
    fp32, bf16 = runs["fp32_seed1"], runs["bf16_seed1"]
    data = compared([fp32, bf16], tmp_path / "cmp")

    base, other = evaluation(fp32), evaluation(bf16)
    rows = {row["run"]: row for row in data["runs"]}
    assert rows["fp32_seed1"]["final_val_loss"] == base["final_val_loss"]
    assert rows["bf16_seed1"]["final_val_loss"] == other["final_val_loss"]
    assert rows["fp32_seed1"]["loss_delta"] == 0
    assert rows["bf16_seed1"]["loss_delta"] == pytest.approx(
        other["final_val_loss"] - base["final_val_loss"]
    )
    text = (tmp_path / "cmp" / sweep.SWEEP_MD).read_text(encoding="utf-8")
    headers = md_headers(text)
    # A classifier's primary metric, accuracy, comes first; its loss follows; no perplexity.
    assert headers[3:7] == ["val acc", "Δ acc vs fp32", "val loss", "Δ loss vs fp32"]
    assert "perplexity" not in headers
    md = {row["run"]: row for row in md_tables(text)[0]}
    assert md["fp32_seed1"]["val loss"] == f"{base['final_val_loss']:.4f}"
    assert md["fp32_seed1"]["Δ loss vs fp32"] == "+0.0000"
    assert md["bf16_seed1"]["Δ loss vs fp32"] == sweep._loss_delta(rows["bf16_seed1"]["loss_delta"])
    printed = capsys.readouterr().out
    header_line = next(line for line in printed.splitlines() if line.startswith("run "))
    assert header_line.index("val acc") < header_line.index("val loss")
    assert "Δ loss vs fp32" in header_line
    assert f"{base['final_val_loss']:.4f}" in printed
    # The figure stays the training loss (a classifier's table ranks by accuracy, not loss).
    ((fig, _),) = drawn
    assert fig.axes[0].get_ylabel() == "training loss"
    assert "![training loss](sweep_loss.png)" in text


def test_a_loss_difference_below_four_decimals_is_not_shown_as_none():
    rows = [
        {"run": "precision=fp32", "status": "completed", "task": "lm",
         "final_val_loss": 5.061967, "loss_delta": 0.0},
        {"run": "precision=bf16", "status": "completed", "task": "lm",
         "final_val_loss": 5.061975, "loss_delta": 7.15e-06},
        {"run": "precision=fp16", "status": "completed", "task": "lm",
         "final_val_loss": 5.0623, "loss_delta": 3.3e-4},
    ]  # fmt: skip
    md = md_tables(sweep.render_markdown(rows, "t", None))[0]
    assert [r["Δ loss vs fp32"] for r in md] == ["+0.0000", "+7.2e-06", "+0.0003"]


# ------------------------------------------------------------------------------ seed groups
def seed_groups(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {g["group"]: g for g in data.get("seed_groups") or []}


def test_runs_differing_only_in_seed_get_mean_and_sample_sd_per_group(runs, tmp_path, capsys):
    data = compared(list(runs.values()), tmp_path / "cmp")

    groups = seed_groups(data)
    assert sorted(groups) == ["bf16", "fp32"]  # one group per precision
    for precision in ("fp32", "bf16"):
        group = groups[precision]
        members = [runs[f"{precision}_seed{seed}"] for seed in (1, 2)]
        bases = [runs[f"fp32_seed{seed}"] for seed in (1, 2)]
        assert (group["n"], group["seeds"]) == (2, [1, 2])
        assert group["runs"] == [f"{precision}_seed1", f"{precision}_seed2"]
        for key in ("final_val_accuracy", "final_val_loss"):
            values = [evaluation(run)[key] for run in members]
            assert group[key]["mean"] == pytest.approx(statistics.fmean(values))
            assert group[key]["sd"] == pytest.approx(statistics.stdev(values))
        # Differences: each seed's run against the FP32 run of its own seed.
        deltas = [
            evaluation(run)["final_val_loss"] - evaluation(base)["final_val_loss"]
            for run, base in zip(members, bases, strict=True)
        ]
        assert group["loss_delta"]["mean"] == pytest.approx(statistics.fmean(deltas))
        assert group["loss_delta"]["sd"] == pytest.approx(statistics.stdev(deltas), abs=1e-12)

    text = (tmp_path / "cmp" / sweep.SWEEP_MD).read_text(encoding="utf-8")
    assert "## Over seeds" in text
    table = {row["group"]: row for row in md_tables(text)[1]}
    bf16 = groups["bf16"]
    acc = bf16["final_val_accuracy"]
    assert table["bf16"]["n"] == "2" and table["bf16"]["seeds"] == "1, 2"
    assert table["bf16"]["val acc"] == f"{100 * acc['mean']:.2f}% ± {100 * acc['sd']:.2f} pt"
    loss = bf16["final_val_loss"]
    assert table["bf16"]["val loss"] == f"{loss['mean']:.4f} ± {loss['sd']:.4f}"
    assert "sample standard deviation" in text
    printed = capsys.readouterr().out
    assert "over seeds (mean ± sd)" in printed
    assert f"{100 * acc['mean']:.2f}% ± {100 * acc['sd']:.2f} pt" in printed


def test_a_seed_that_did_not_complete_or_ran_twice_is_left_out_and_named(runs, tmp_path):
    where = tmp_path / "extra"
    diverged = where / "fp32_seed3"
    shutil.copytree(runs["fp32_seed2"], diverged, ignore=shutil.ignore_patterns("checkpoints"))
    path = diverged / REPORT_JSON
    report = json.loads(path.read_text(encoding="utf-8"))
    report["config"]["seed"] = 3
    report.update(status="diverged", reason="loss nan at step 4")
    path.write_text(json.dumps(report), encoding="utf-8")
    repeat = where / "fp32_seed1_again"
    shutil.copytree(runs["fp32_seed1"], repeat, ignore=shutil.ignore_patterns("checkpoints"))

    paths = [runs["fp32_seed1"], runs["fp32_seed2"], diverged, repeat]
    data = compared(paths, tmp_path / "cmp")

    group = seed_groups(data)["fp32"]
    assert (group["n"], group["seeds"]) == (2, [1, 2])
    assert group["left_out"] == [
        "fp32_seed3: diverged, not counted",
        "fp32_seed1_again: seed 1 again (a repeat, not counted)",
    ]
    text = (tmp_path / "cmp" / sweep.SWEEP_MD).read_text(encoding="utf-8")
    assert "- fp32: fp32_seed3: diverged, not counted" in text


def test_runs_that_differ_in_more_than_the_seed_get_no_seed_table(runs, tmp_path, capsys):
    # Precision differs (and one seed per precision): nothing to average.
    data = compared([runs["fp32_seed1"], runs["bf16_seed2"]], tmp_path / "cmp")

    assert data["seed_groups"] == []
    assert "Over seeds" not in (tmp_path / "cmp" / sweep.SWEEP_MD).read_text(encoding="utf-8")
    assert "over seeds" not in capsys.readouterr().out


@pytest.mark.slow
def test_a_seed_sweep_reports_mean_and_sd_over_its_seeds(tmp_path):
    result, sweep_dir = run_sweep(
        tmp_path,
        "seed=1,2,3",
        "precision=bf16",
        "model=mlp",
        "max_steps=8",
        "log_every=4",
        "throughput_warmup_steps=2",
        "threads=1",
        "progress=false",
    )

    assert result.returncode == 0, describe(result)
    data = json.loads((sweep_dir / sweep.SWEEP_JSON).read_text(encoding="utf-8"))
    assert [r["run"] for r in data["runs"]] == ["seed=1", "seed=2", "seed=3"]
    accuracies = [r["final_val_accuracy"] for r in data["runs"]]
    (group,) = data["seed_groups"]
    assert (group["group"], group["n"], group["seeds"]) == ("bf16", 3, [1, 2, 3])
    assert group["final_val_accuracy"]["mean"] == pytest.approx(statistics.fmean(accuracies))
    assert group["final_val_accuracy"]["sd"] == pytest.approx(statistics.stdev(accuracies))
    text = (sweep_dir / sweep.SWEEP_MD).read_text(encoding="utf-8")
    (row,) = md_tables(text)[1]
    assert (row["group"], row["n"], row["seeds"]) == ("bf16", "3", "1, 2, 3")
    assert row["val acc"].count(" ± ") == 1 and row["val loss"].count(" ± ") == 1
    assert "Δ acc vs fp32" not in row  # no FP32 job: no difference to average
    assert "over seeds (mean ± sd)" in result.stdout


# -------------------------------------------------------------------------------- figures
@pytest.fixture
def drawn(monkeypatch) -> list[Any]:
    """Every figure plots.py saves, laid out as saved, with the renderer that drew it (the PNG is
    still written)."""
    figures = []
    save = plots._save

    def recording_save(fig: Any, path: Path) -> Path:
        fig.canvas.draw()  # runs the layout
        figures.append((fig, fig.canvas.get_renderer()))
        return save(fig, path)

    monkeypatch.setattr(plots, "_save", recording_save)
    return figures


@pytest.fixture(scope="module")
def lm_runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lm")
    dirs = {}
    for precision in ("fp32", "bf16"):
        dirs[precision] = root / precision
        cfg = compose_run(*LM, f"precision={precision}", "max_steps=6", "eval_every=3")
        train(cfg, dirs[precision])
    return dirs


def lines_of(fig: Any) -> dict[str, list[float]]:
    (ax,) = fig.axes
    return {line.get_label(): list(line.get_ydata()) for line in ax.get_lines()}


def test_a_language_models_comparison_plots_the_validation_loss_it_ranks_by(
    lm_runs, drawn, tmp_path
):
    compare.compare_main([str(lm_runs["fp32"]), str(lm_runs["bf16"]), "--out", str(tmp_path)])

    ((fig, _),) = drawn
    assert fig.axes[0].get_ylabel() == "validation loss (nats/token)"
    for label, ys in lines_of(fig).items():
        history = evaluation(lm_runs[label])["history"]
        assert [row["step"] for row in history] == [3, 6]
        assert ys == pytest.approx([row["val_loss"] for row in history])
    text = (tmp_path / sweep.SWEEP_MD).read_text(encoding="utf-8")
    assert "![validation loss](sweep_loss.png)" in text
    assert md_headers(text)[3:6] == ["val loss", "Δ loss vs fp32", "perplexity"]
    assert (tmp_path / sweep.SWEEP_PNG).read_bytes()[:8] == PNG_MAGIC


def layer_rows(count: int) -> list[dict[str, Any]]:
    return [
        {
            "label": f"{i + 1}. net.{i}" + (" (kept)" if i == 0 else ""),
            "output_sqnr_db": 30.0 - i,
            "input_grad_sqnr_db": 25.0 - i,
            "weight_grad_sqnr_db": 28.0 - i,
            "alone_grad_sqnr_db": float("inf") if i == 2 else 35.0 - i,
            "share": 0.5 / (i + 1),
        }
        for i in range(count)
    ]


@pytest.mark.parametrize("count", [1, 2, 3])
def test_the_layer_plans_title_legend_and_panels_do_not_overlap(count, drawn, tmp_path):
    path = tmp_path / "advise_layers.png"
    title = "mptrain advise: mlp on digits: fp8 rowwise per layer"
    plots.plot_layer_plan(layer_rows(count), title, path, "fp8 rowwise")

    assert path.read_bytes()[:8] == PNG_MAGIC
    ((fig, renderer),) = drawn
    suptitle = fig._suptitle.get_window_extent(renderer)  # matplotlib keeps it there
    # Each panel with its title, axis labels and ticks (a legend it holds aside: checked below).
    panels = [ax.get_tightbbox(renderer, bbox_extra_artists=[]) for ax in fig.axes]
    for ax, panel in zip(fig.axes, panels, strict=True):
        assert not suptitle.overlaps(ax.title.get_window_extent(renderer)), ax.get_title()
        assert not suptitle.overlaps(panel), ax.get_title()
    legends = fig.legends + [ax.get_legend() for ax in fig.axes if ax.get_legend()]
    (legend,) = legends
    box = legend.get_window_extent(renderer)
    assert not any(box.overlaps(panel) for panel in panels)
    assert [t.get_text() for t in legend.get_texts()][
        -1
    ] == "model gradient, it alone in fp8 rowwise"
