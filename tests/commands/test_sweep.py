"""Comparing finished runs: the table a ``-m`` precision sweep ends with, and ``mptrain-compare``.

CPU-only. Two real multiruns run as subprocesses (``python -m mptrain -m ...``), one where every job
completes and one where a job fails at run time; everything else compares tiny in-process runs
(model=mlp, a few steps) made once per module, or run directories assembled by hand.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import pickle
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf
from rich.console import Console
from support.processes import describe, run_command
from support.runs import NoFigure, run_cli, tiny_run, train
from support.sweeps import job_dirs, read_report, run_sweep

from mptrain.commands import compare, sweep
from mptrain.report.render import write_failure
from mptrain.report.rows import fmt_bytes
from mptrain.rundir import layout
from mptrain.rundir.layout import FAILURE_JSON, REPORT_JSON
from mptrain.rundir.lock import RunDirLock
from mptrain.train import job as job_module
from mptrain.train.job import RunFailed

TIMEOUT_S = 240
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
NO_REPORT = "no report.json (the job ended before training)"


# ----------------------------------------------------------------------------------------- helpers
def is_png(path: Path) -> bool:
    return path.is_file() and path.read_bytes()[:8] == PNG_MAGIC


def md_table(text: str) -> list[dict[str, str]]:
    """The rows of the (first) Markdown table in ``text``, each as {header: cell}."""
    lines = [line for line in text.splitlines() if line.startswith("|")]
    cells = [[c.strip() for c in line.strip().strip("|").split("|")] for line in lines]
    header, separator, *rows = cells
    assert all(set(c) <= set("-:") for c in separator), lines[1]
    return [dict(zip(header, row, strict=True)) for row in rows]


def md_headers(text: str) -> list[str]:
    first = next(line for line in text.splitlines() if line.startswith("|"))
    return [c.strip() for c in first.strip().strip("|").split("|")]


def fake_job(sweep_dir: Path, number: int, overrides: list[str]) -> Path:
    """A job directory as Hydra leaves it before the task runs: .hydra/overrides.yaml only."""
    job = sweep_dir / f"{number}_{','.join(overrides)}"
    (job / ".hydra").mkdir(parents=True)
    OmegaConf.save(OmegaConf.create(overrides), job / ".hydra" / "overrides.yaml")
    return job


# ------------------------------------------------------------------- precision sweep (subprocess)
@pytest.fixture(scope="module")
def precision_sweep(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    cwd = tmp_path_factory.mktemp("precision_sweep")
    return run_sweep(
        cwd,
        "precision=fp32,bf16,fp16",
        "model=mlp",
        "max_steps=20",
        "log_every=4",  # 4 windows of 4 steps after warm-up: the speed ratios' spread
        "throughput_warmup_steps=4",
        "probe_every=4",  # zero gradients / updates lost: every column of the table is filled
        "progress=false",
        timeout=TIMEOUT_S,
    )


@pytest.fixture(scope="module")
def sweep_rows(precision_sweep) -> list[dict]:
    result, sweep_dir = precision_sweep
    assert result.returncode == 0, describe(result)
    data = json.loads((sweep_dir / sweep.SWEEP_JSON).read_text(encoding="utf-8"))
    return data["runs"]


@pytest.mark.slow
def test_precision_sweep_exits_0_and_writes_the_comparison(precision_sweep):
    result, sweep_dir = precision_sweep
    assert result.returncode == 0, describe(result)
    assert (sweep_dir / "sweep.md").is_file()
    assert (sweep_dir / "sweep.json").is_file()
    assert is_png(sweep_dir / "sweep_loss.png")


@pytest.mark.slow
def test_sweep_json_has_one_row_per_job_in_job_order(precision_sweep, sweep_rows):
    _, sweep_dir = precision_sweep
    # The overrides common to every job (model, max_steps, ...) are left out of the labels.
    assert [r["run"] for r in sweep_rows] == ["precision=fp32", "precision=bf16", "precision=fp16"]
    assert [r["precision"] for r in sweep_rows] == ["fp32", "bf16", "fp16"]
    assert [r["status"] for r in sweep_rows] == ["completed"] * 3
    assert [Path(r["directory"]).name for r in sweep_rows] == [j.name for j in job_dirs(sweep_dir)]


@pytest.mark.slow  # reads the subprocess sweep (precision_sweep), as this file's other slow tests
def test_fp32_row_is_its_own_baseline(sweep_rows):
    fp32 = sweep_rows[0]
    assert fp32["accuracy_delta"] == 0
    assert fp32["throughput_ratio"] == 1.0  # its windows against themselves: their own spread
    assert fp32["memory_ratio"] == 1.0
    assert Path(fp32["baseline"]).name == Path(fp32["directory"]).name


@pytest.mark.slow
@pytest.mark.parametrize("index", [1, 2], ids=["bf16", "fp16"])
def test_mixed_precision_rows_are_compared_with_the_fp32_job(precision_sweep, sweep_rows, index):
    _, sweep_dir = precision_sweep
    fp32, row = sweep_rows[0], sweep_rows[index]
    assert Path(row["baseline"]).name == Path(fp32["directory"]).name
    assert isinstance(row["accuracy_delta"], float)
    assert row["accuracy_delta"] == pytest.approx(
        row["final_val_accuracy"] - fp32["final_val_accuracy"]
    )
    assert row["throughput_ratio"] > 0
    assert row["throughput_ratio"] == pytest.approx(
        statistics.median(windows(sweep_dir, row)) / statistics.median(windows(sweep_dir, fp32))
    )
    low, high = row["throughput_ratio_range"]
    assert 0 < low <= high and row["throughput_windows"] == 4
    assert row["memory_ratio"] > 0
    assert row["memory_ratio"] == pytest.approx(
        row["peak_memory_bytes"] / fp32["peak_memory_bytes"]
    )


@pytest.mark.slow  # reads the subprocess sweep (precision_sweep), as this file's other slow tests
def test_only_the_fp16_row_has_a_loss_scale(sweep_rows):
    assert [r["final_loss_scale"] for r in sweep_rows] == [None, None, 65536]
    assert [r["skipped_steps"] for r in sweep_rows] == [0, 0, 0]


@pytest.mark.slow  # reads the subprocess sweep (precision_sweep), as this file's other slow tests
def test_every_row_has_the_gradient_probes(sweep_rows):
    for row in sweep_rows:
        assert 0 <= row["zero_grad_fraction"] < 1
        assert 0 <= row["updates_lost_fraction"] <= 1


@pytest.mark.slow
def test_sweep_md_shows_the_table_and_the_figure(precision_sweep, sweep_rows):
    _, sweep_dir = precision_sweep
    text = (sweep_dir / "sweep.md").read_text(encoding="utf-8")
    rows = md_table(text)
    assert [r["run"] for r in rows] == [r["run"] for r in sweep_rows]
    fp32, bf16, fp16 = rows
    assert (fp32["Δ acc vs fp32"], fp32["memory vs fp32"]) == ("+0.00 pt", "1.00×")
    assert fp32["speed vs fp32"].startswith("1.00× (")
    assert bf16["Δ acc vs fp32"].endswith(" pt")
    for md_row, json_row in zip(rows, sweep_rows, strict=True):
        assert md_row["speed vs fp32"] == speed_cell(json_row)
        if json_row["throughput_noisy"]:  # the reason is under the table
            assert f"- {json_row['run']}: speed noisy: {json_row['throughput_noisy']}" in text
    assert (fp32["final scale"], bf16["final scale"], fp16["final scale"]) == ("—", "—", "65536")
    # Every column but the language models' has a value.
    assert list(fp32) == [h for k, h in sweep.CLASSIFY_COLUMNS if k != "final_val_perplexity"]
    for md_row, json_row in zip(rows, sweep_rows, strict=True):
        assert md_row["val acc"] == f"{100 * json_row['final_val_accuracy']:.2f}%"
        # One step's bytes, as the job's report counted them (memory.account is on by default)
        counted = read_report(sweep_dir.parent / json_row["directory"])["memory"]["accounted"]
        assert json_row["activation_bytes"] == counted["total"]["activations"] > 0
        assert md_row["activations"] == fmt_bytes(counted["total"]["activations"])
        assert md_row["accounted"] == fmt_bytes(counted["total_bytes"])
    assert fp32["activations vs fp32"] == "1.00×"
    assert sweep_rows[1]["activation_ratio"] < 1  # BF16 saves the Linear layers' inputs in BF16
    assert "![training loss](sweep_loss.png)" in text


@pytest.mark.slow
def test_each_job_has_its_curves_and_a_report_md_showing_them(precision_sweep):
    _, sweep_dir = precision_sweep
    jobs = job_dirs(sweep_dir)
    assert len(jobs) == 3
    for job in jobs:
        assert is_png(job / "curves.png"), job
        assert "](curves.png)" in (job / "report.md").read_text(encoding="utf-8"), job
        assert read_report(job)["figure"] == "curves.png"


def windows(sweep_dir: Path, row: dict) -> list[float]:
    """The measured windows' samples/s in the report of a sweep row's run (its directory is
    relative to where the sweep was launched)."""
    report = read_report(sweep_dir.parent / row["directory"])
    return report["throughput"]["window_samples_per_s"]


def speed_cell(row: dict) -> str:
    """The speed column's text for a sweep.json row: median (quartiles), noisy when it is."""
    low, high = row["throughput_ratio_range"]
    cell = f"{row['throughput_ratio']:.2f}× ({low:.2f}–{high:.2f})"
    return cell + " noisy" if row["throughput_noisy"] else cell


@pytest.mark.slow  # reads the subprocess sweep (precision_sweep), as this file's other slow tests
def test_sequential_jobs_did_not_run_at_the_same_time(sweep_rows):
    for row in sweep_rows:
        assert row["ran_alongside"] == 0, row
        assert "same time" not in (row["throughput_noisy"] or ""), row


def printed_table(result: subprocess.CompletedProcess) -> str:
    """The comparison table the sweep printed last (after every job's own summary)."""
    out = result.stdout
    end = out.index("comparison written to sweep/sweep.md")
    return out[out.rindex("sweep sweep", 0, end) : end]


@pytest.mark.slow
def test_sweep_prints_the_table(precision_sweep, sweep_rows):
    result, _ = precision_sweep
    out = printed_table(result)
    for header in ("status", "precision", "val acc", "skipped"):
        assert header in out
    assert out.count("completed") == 3
    for row in sweep_rows:
        assert f"{100 * row['final_val_accuracy']:.2f}%" in out
        assert speed_cell(row) in out
        if row["throughput_noisy"]:
            assert f"{row['run']}: speed noisy: {row['throughput_noisy']}" in " ".join(out.split())
    assert "65536" in out


@pytest.mark.slow
def test_printed_table_shows_each_run_label_whole(precision_sweep, sweep_rows):
    result, _ = precision_sweep
    table = printed_table(result)
    for row in sweep_rows:
        assert row["run"] in table, table


# ----------------------------------------------------------- sweep with a failing job (subprocess)
@pytest.fixture(scope="module")
def failing_sweep(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    # cifar10's files are absent under the default root `data`: found at run time, not preflight.
    cwd = tmp_path_factory.mktemp("failing_sweep")
    return run_sweep(
        cwd,
        "dataset=digits,cifar10",
        "model=mlp",
        "max_steps=4",
        "progress=false",
        timeout=TIMEOUT_S,
    )


@pytest.mark.slow
def test_sweep_with_a_failed_job_exits_1(failing_sweep):
    result, _ = failing_sweep
    assert result.returncode == 1, describe(result)
    assert "1 job(s) did not complete" in result.stderr


@pytest.mark.slow
def test_sweep_md_still_lists_every_job_with_the_failure_reason(failing_sweep):
    _, sweep_dir = failing_sweep
    rows = md_table((sweep_dir / "sweep.md").read_text(encoding="utf-8"))
    assert [r["run"] for r in rows] == ["dataset=digits", "dataset=cifar10"]
    digits, cifar = rows
    assert digits["status"] == "completed"
    assert cifar["status"].startswith("failed: ")
    assert "data/cifar-10-batches-py" in cifar["status"]


@pytest.mark.slow
def test_sweep_json_records_the_failed_job_and_its_reason(failing_sweep):
    _, sweep_dir = failing_sweep
    digits, cifar = json.loads((sweep_dir / "sweep.json").read_text(encoding="utf-8"))["runs"]
    assert digits["status"] == "completed" and digits["final_val_accuracy"] > 0
    assert cifar["status"] == "failed"
    assert "data/cifar-10-batches-py" in cifar["reason"]
    failed_job = job_dirs(sweep_dir)[1]
    assert not (failed_job / REPORT_JSON).exists()
    failure = json.loads((failed_job / FAILURE_JSON).read_text(encoding="utf-8"))
    assert failure == {"status": "failed", "reason": cifar["reason"]}


# ------------------------------------------------------------------------- in-process tiny runs
RUNS = {
    # name: overrides (on top of tiny_run's model=mlp, device=cpu); separate directories, as if
    # made on different days
    "fp32_monday": ("precision=fp32",),
    "bf16_tuesday": ("precision=bf16",),
    "fp32_seed1": ("precision=fp32", "seed=1"),
    "bf16_seed1": ("precision=bf16", "seed=1"),
    "bf16_batch32": ("precision=bf16", "batch_size=32"),
    "fp8": ("precision=fp8",),
    # a precision schedule (precision.switch): steps 1-3 in FP8, 4-6 in BF16
    "fp8_to_bf16": ("precision=fp8", "precision.switch.to=bf16", "precision.switch.at=3"),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("runs")
    dirs = {}
    for name, overrides in RUNS.items():
        dirs[name] = root / name
        train(tiny_run(*overrides, "max_steps=6", "log_every=2"), dirs[name])
    dirs["diverged"] = root / "diverged"
    with pytest.raises(RunFailed):
        train(
            tiny_run(
                "precision=fp32", "max_steps=60", "optimizer=sgd", "optimizer.lr=1e6", "log_every=2"
            ),
            dirs["diverged"],
        )
    return dirs


def rows_by_label(paths: list[Path]) -> dict[str, dict]:
    return {row["run"]: row for row in sweep.compare(sweep.find_runs(paths))}


@pytest.mark.slow
def test_compare_main_compares_runs_made_on_different_days(runs, tmp_path, capsys):
    out = tmp_path / "comparison"
    compare.compare_main([str(runs["fp32_monday"]), str(runs["bf16_tuesday"]), "--out", str(out)])

    data = json.loads((out / "sweep.json").read_text(encoding="utf-8"))
    assert data["title"] == "comparison of 2 runs"
    fp32, bf16 = data["runs"]
    assert (fp32["run"], bf16["run"]) == ("fp32_monday", "bf16_tuesday")
    base, other = read_report(runs["fp32_monday"]), read_report(runs["bf16_tuesday"])
    assert bf16["baseline"] == str(runs["fp32_monday"])
    assert bf16["accuracy_delta"] == pytest.approx(
        other["evaluation"]["final_val_accuracy"] - base["evaluation"]["final_val_accuracy"]
    )
    assert bf16["throughput_ratio"] == pytest.approx(
        statistics.median(other["throughput"]["window_samples_per_s"])
        / statistics.median(base["throughput"]["window_samples_per_s"])
    )
    # 6 steps after 2 warm-up, a row every 2: 2 windows, too few to judge the spread.
    assert bf16["throughput_windows"] == 2
    assert "2 windows: too few to judge the spread" in bf16["throughput_noisy"]
    assert bf16["memory_ratio"] == pytest.approx(
        other["memory"]["peak_bytes"] / base["memory"]["peak_bytes"]
    )
    text = (out / "sweep.md").read_text(encoding="utf-8")
    assert [r["run"] for r in md_table(text)] == ["fp32_monday", "bf16_tuesday"]
    # No FP16 run: the loss-scale column is left out; the comparison columns are there.
    headers = md_headers(text)
    assert "final scale" not in headers and "Δ acc vs fp32" in headers
    assert is_png(out / "sweep_loss.png")
    printed = "".join(capsys.readouterr().out.split())  # rich may wrap the long path
    assert "".join(f"comparison written to {out / 'sweep.md'}".split()) in printed


@pytest.mark.slow
def test_mptrain_compare_console_script(runs, tmp_path):
    script = Path(sys.executable).parent / "mptrain-compare"
    assert script.is_file(), f"no console script at {script}"

    result = run_command(
        tmp_path,
        str(script),
        str(runs["fp32_monday"]),
        str(runs["bf16_tuesday"]),
        "--out",
        "cmp",
        timeout=TIMEOUT_S,
    )

    assert result.returncode == 0, describe(result)
    rows = md_table((tmp_path / "cmp" / "sweep.md").read_text(encoding="utf-8"))
    assert [r["run"] for r in rows] == ["fp32_monday", "bf16_tuesday"]
    assert rows[0]["Δ acc vs fp32"] == "+0.00 pt" and rows[1]["Δ acc vs fp32"].endswith(" pt")
    assert "comparison written to" in result.stdout


def test_compare_refuses_a_directory_that_is_neither_a_run_nor_a_sweep(tmp_path, capsys):
    notes = tmp_path / "notes"
    (notes / "drafts").mkdir(parents=True)
    (notes / "readme.txt").write_text("not a run\n")
    out = tmp_path / "out"

    with pytest.raises(SystemExit) as exc:
        compare.compare_main([str(notes), "--out", str(out)])

    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("mptrain-compare: error: ")
    assert str(notes) in err and "neither a run directory nor a sweep" in err
    assert not out.exists(), "nothing is written for bad input"


def failed_run(directory: Path, reason: str = "stopped before training") -> Path:
    """A run directory as a job refused at run time leaves it: failure.json only."""
    write_failure(directory, reason)
    return directory


def test_compare_skips_the_files_a_glob_matches_in_one_note(tmp_path, capsys):
    """`mptrain-compare outputs/*/*` matches curves.png and sweep.md beside the runs."""
    day = tmp_path / "outputs" / "2024-05-01"
    run_a, run_b = failed_run(day / "10-00-00_a"), failed_run(day / "11-00-00_b")
    for name in ("curves.png", "sweep.md"):
        (day / name).write_text("not a run\n")
    bench = tmp_path / "outputs" / "bench"  # mptrain bench's results: no run in them
    (bench / "2024-05-01" / "10-30-00_mlp_digits").mkdir(parents=True)
    out = tmp_path / "cmp"

    compare.compare_main([str(run_a), str(day / "curves.png"), str(run_b), str(day / "sweep.md"),
                        str(bench), "--out", str(out)])  # fmt: skip

    rows = json.loads((out / "sweep.json").read_text(encoding="utf-8"))["runs"]
    assert [r["directory"] for r in rows] == [str(run_a), str(run_b)]
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "mptrain-compare: note: skipped 2 files (not run directories): "
        f"{day / 'curves.png'}, {day / 'sweep.md'}",
        f"mptrain-compare: note: skipped 1 folder holding no run: {bench}",
    ]


def test_compare_of_a_file_alone_says_so_in_one_line(tmp_path, capsys):
    stray = tmp_path / "curves.png"
    stray.write_text("not a run\n")
    with pytest.raises(SystemExit) as exc:
        compare.compare_main([str(stray), "--out", str(tmp_path / "out")])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err == f"mptrain-compare: error: {stray}: a file, not runs\n"
    assert not (tmp_path / "out").exists()


def test_compare_of_outputs_finds_the_dated_runs_and_sweeps_inside(tmp_path):
    outputs = tmp_path / "outputs"
    dated = failed_run(outputs / "2024-05-01" / "10-00-00_fp32_mlp")
    later = failed_run(outputs / "2024-05-02" / "09-00-00_bf16_mlp")
    multirun = tmp_path / "multirun"  # Hydra's sweeps: multirun/<date>/<time>/<job>
    jobs = [failed_run(multirun / "2024-05-03" / "12-00-00" / f"{n}_seed={n}") for n in (10, 2)]
    too_deep = failed_run(outputs / "a" / "b" / "c" / "run")
    out = tmp_path / "cmp"

    compare.compare_main([str(outputs), str(multirun), "--out", str(out)])

    rows = json.loads((out / "sweep.json").read_text(encoding="utf-8"))["runs"]
    assert [Path(r["directory"]) for r in rows] == [dated, later, *reversed(jobs)]
    assert str(too_deep) not in {r["directory"] for r in rows}


@pytest.mark.slow
def test_compare_refuses_a_missing_path(runs, tmp_path, capsys):
    missing = tmp_path / "no_such_run"
    with pytest.raises(SystemExit) as exc:
        compare.compare_main([str(runs["fp32_monday"]), str(missing), "--out", str(tmp_path / "o")])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert str(missing) in err and "no such directory" in err
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
def test_each_run_is_paired_with_the_fp32_run_of_identical_config(runs):
    order = ["fp32_monday", "bf16_seed1", "fp32_seed1", "bf16_batch32"]
    rows = rows_by_label([runs[name] for name in order])

    bf16 = rows["bf16_seed1"]
    assert bf16["baseline"] == str(runs["fp32_seed1"])  # same seed, not the first fp32 run
    seed1 = read_report(runs["fp32_seed1"])["evaluation"]["final_val_accuracy"]
    assert bf16["accuracy_delta"] == bf16["final_val_accuracy"] - seed1
    assert rows["fp32_monday"]["baseline"] == str(runs["fp32_monday"])
    assert rows["fp32_seed1"]["baseline"] == str(runs["fp32_seed1"])
    # batch_size 32: no fp32 run with that config, so no ratios at all.
    other = rows["bf16_batch32"]
    assert "baseline" not in other
    assert [other.get(k) for k in ("accuracy_delta", "throughput_ratio", "memory_ratio")] == [
        None,
        None,
        None,
    ]
    assert other["final_val_accuracy"] is not None

    md = {r["run"]: r for r in md_table(sweep.render_markdown(list(rows.values()), "t", None))}
    cells = md["bf16_batch32"]
    assert (cells["Δ acc vs fp32"], cells["speed vs fp32"], cells["memory vs fp32"]) == (
        "—",
        "—",
        "—",
    )
    assert other.get("activation_ratio") is None and cells["activations vs fp32"] == "—"
    assert cells["activations"] == fmt_bytes(other["activation_bytes"])  # its own, counted
    assert (
        bf16["activation_ratio"]
        == bf16["activation_bytes"] / rows["fp32_seed1"]["activation_bytes"]
    )
    assert md["bf16_seed1"]["Δ acc vs fp32"].endswith(" pt")


@pytest.mark.slow
def test_emulated_fp8_gets_an_accuracy_delta_but_no_speed_ratio(runs):
    report = read_report(runs["fp8"])
    assert report["precision"]["emulated"] is True  # CPU: no FP8 hardware

    rows = rows_by_label([runs["fp32_monday"], runs["fp8"]])

    fp8 = rows["fp8"]
    assert fp8["precision"] == report["precision"]["label"]
    assert fp8["baseline"] == str(runs["fp32_monday"])
    assert fp8["throughput_ratio"] is None
    assert fp8["samples_per_s"] > 0  # measured, just not compared
    base = rows["fp32_monday"]["final_val_accuracy"]
    assert fp8["accuracy_delta"] == pytest.approx(fp8["final_val_accuracy"] - base)
    assert fp8["memory_ratio"] > 0
    md = {r["run"]: r for r in md_table(sweep.render_markdown(list(rows.values()), "t", None))}
    assert md["fp8"]["speed vs fp32"] == "—"
    assert md["fp8"]["Δ acc vs fp32"].endswith(" pt")


@pytest.mark.slow
def test_a_switched_run_shows_both_precisions_apart_from_a_run_of_its_first(runs):
    rows = rows_by_label([runs[name] for name in ("fp32_monday", "fp8", "fp8_to_bf16")])

    switched = "fp8 (emulated) -> bf16 after step 3"
    assert rows["fp8"]["precision"] == "fp8 (emulated)"
    assert rows["fp8_to_bf16"]["precision"] == switched
    assert rows["fp8_to_bf16"]["baseline"] == str(runs["fp32_monday"])  # compared as any run
    md = {r["run"]: r for r in md_table(sweep.render_markdown(list(rows.values()), "t", None))}
    assert (md["fp8"]["precision"], md["fp8_to_bf16"]["precision"]) == ("fp8 (emulated)", switched)
    terminal = io.StringIO()
    sweep.print_table(Console(file=terminal, width=160), list(rows.values()), "t")
    assert switched in terminal.getvalue()


@pytest.mark.slow
def test_a_switch_not_reached_or_reached_late_is_named_so(runs, tmp_path):
    from mptrain.report.schema import load_report

    report = read_report(runs["fp8_to_bf16"])
    assert report["precision"]["switch"]["switched_after_step"] == 3
    named = {}
    for after in (None, 4):  # stopped before the switch; resumed from a checkpoint past step 3
        report["precision"]["switch"]["switched_after_step"] = after
        (tmp_path / str(after)).mkdir()
        (tmp_path / str(after) / REPORT_JSON).write_text(json.dumps(report))
        named[after] = load_report(tmp_path / str(after) / REPORT_JSON).precision.what_ran()
    assert named == {
        None: "fp8 (emulated) -> bf16 after step 3 (not reached)",
        4: "fp8 (emulated) -> bf16 after step 4",
    }


@pytest.mark.slow
def test_failed_and_diverged_runs_appear_with_their_reason(runs, tmp_path):
    # A crashed fp32 run: a real report, rewritten as train() writes it for an exception.
    crashed = tmp_path / "fp32_crashed"
    shutil.copytree(runs["fp32_monday"], crashed)
    report = read_report(crashed)
    report.update(status="failed", reason="RuntimeError: boom | at step 3")
    (crashed / REPORT_JSON).write_text(json.dumps(report), encoding="utf-8")
    diverged_reason = read_report(runs["diverged"])["reason"]
    assert "loss became" in diverged_reason

    runs_ = sweep.find_runs([runs["diverged"], crashed, runs["bf16_tuesday"]])
    rows = {row["run"]: row for row in sweep.compare(runs_)}

    assert (rows["diverged"]["status"], rows["diverged"]["reason"]) == ("diverged", diverged_reason)
    assert rows["fp32_crashed"]["status"] == "failed"
    assert rows["fp32_crashed"]["reason"] == "RuntimeError: boom | at step 3"
    # Neither the diverged nor the crashed fp32 run is a baseline for the bf16 run.
    assert "baseline" not in rows["bf16_tuesday"]
    assert "baseline" not in rows["diverged"]
    md = {r["run"]: r for r in md_table(sweep.render_markdown(list(rows.values()), "t", None))}
    assert md["diverged"]["status"] == f"diverged: {diverged_reason}".replace("|", "/")
    assert md["fp32_crashed"]["status"] == "failed: RuntimeError: boom / at step 3"
    assert md["bf16_tuesday"]["status"] == "completed"


@pytest.mark.slow
def test_jobs_without_a_report_show_why(runs, tmp_path):
    sweep_dir = tmp_path / "sweep"
    completed = fake_job(sweep_dir, 0, ["precision=fp32"])
    for name in ("report.json", "metrics.jsonl"):
        shutil.copy(runs["fp32_monday"] / name, completed / name)
    bad_input = fake_job(sweep_dir, 1, ["precision=fp16"])
    write_failure(bad_input, "dataset.root='x': files not found at x/foo")
    fake_job(sweep_dir, 2, ["precision=bf16"])  # killed before train() got anywhere

    found = sweep.find_runs([sweep_dir])
    rows = sweep.compare(found)

    assert [r["run"] for r in rows] == ["precision=fp32", "precision=fp16", "precision=bf16"]
    assert [r["status"] for r in rows] == ["completed", "failed", "failed"]
    assert rows[1]["reason"] == "dataset.root='x': files not found at x/foo"
    assert rows[2]["reason"] == NO_REPORT
    md = md_table(sweep.render_markdown(rows, "t", None))
    assert md[1]["status"] == "failed: dataset.root='x': files not found at x/foo"
    assert md[2]["status"] == f"failed: {NO_REPORT}"
    assert md[1]["val acc"] == md[2]["val acc"] == "—"


def test_sweep_jobs_are_ordered_by_job_number_not_by_name(tmp_path):
    for number in (10, 2, 0, 11, 1):
        fake_job(tmp_path, number, [f"seed={number}", "model=mlp"])
    labels = [run.label for run in sweep.find_runs([tmp_path])]
    assert labels == ["seed=0", "seed=1", "seed=2", "seed=10", "seed=11"]


@pytest.mark.slow
def test_comparing_two_sweeps_of_the_same_jobs_keeps_every_curve(
    precision_sweep, tmp_path, monkeypatch
):
    _, sweep_dir = precision_sweep
    day1, day2 = tmp_path / "day1", tmp_path / "day2"
    for day in (day1, day2):
        for job in job_dirs(sweep_dir):
            shutil.copytree(job, day / job.name)
    plotted = {}

    def record_plot(curves, title, path):
        plotted.update(curves)
        return path

    monkeypatch.setattr(sweep, "plot_sweep", record_plot)
    rows = sweep.write_comparison(
        sweep.find_runs([day1, day2]), tmp_path, "two days", sweep.wide_console()
    )

    assert len(rows) == 6
    assert len(plotted) == 6, f"curves plotted: {sorted(plotted)}"
    assert len({r["run"] for r in rows}) == 6, [r["run"] for r in rows]


def write_fake_cifar10(root: Path) -> None:
    """The same small CIFAR-10 file set (random pixels, 16 images per batch file) under ``root``."""
    rng = np.random.default_rng(0)
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        entry = {
            b"data": rng.integers(0, 256, (16, 3072), dtype=np.uint8),
            b"labels": [int(x) for x in rng.integers(0, 10, 16)],
        }
        (folder / name).write_bytes(pickle.dumps(entry, protocol=2))


@pytest.fixture(scope="module")
def two_machines(tmp_path_factory) -> dict[str, Path]:
    """An fp32 run on machine A and a bf16 run on machine B: same files, kept in another place."""
    root = tmp_path_factory.mktemp("machines")
    dirs = {}
    for name, precision in (("fp32_machine_a", "fp32"), ("bf16_machine_b", "bf16")):
        data = root / f"data_{name.rsplit('_', 1)[1]}"
        write_fake_cifar10(data)
        dirs[name] = root / name
        cfg = tiny_run(
            f"precision={precision}",
            "dataset=cifar10",
            f"dataset.root={data}",
            "batch_size=16",
            "max_steps=3",
        )
        train(cfg, dirs[name])
    return dirs


def test_runs_on_two_machines_differ_only_in_precision_and_data_root(two_machines):
    configs = [read_report(d)["config"] for d in two_machines.values()]
    roots = [c["dataset"]["root"] for c in configs]
    assert roots[0] != roots[1]
    assert [c["precision"]["name"] for c in configs] == ["fp32", "bf16"]
    for c in configs:
        del c["precision"], c["dataset"]["root"]
    assert configs[0] == configs[1]


def test_runs_whose_data_lives_elsewhere_are_still_compared(two_machines):
    runs_ = sweep.find_runs(list(two_machines.values()))
    fp32, bf16 = sweep.compare(runs_)
    assert fp32["status"] == bf16["status"] == "completed"
    assert bf16.get("baseline") == str(two_machines["fp32_machine_a"])
    assert bf16.get("accuracy_delta") is not None


# ----------------------------------------------------------------------------------- rendering
def test_render_markdown_omits_columns_that_are_all_empty():
    rows = [
        {
            "run": "a",
            "status": "completed",
            "precision": "bf16",
            "final_val_accuracy": 0.5,
            "skipped_steps": 0,
            "final_loss_scale": None,
            "zero_grad_fraction": None,
            "peak_memory_bytes": 2048,
        },
        {"run": "b", "status": "failed", "reason": "boom"},
    ]
    text = sweep.render_markdown(rows, "only some columns", None)
    assert text.startswith("# only some columns\n")
    assert md_headers(text) == ["run", "status", "precision", "val acc", "skipped"]
    assert md_table(text)[1] == {
        "run": "b",
        "status": "failed: boom",
        "precision": "—",
        "val acc": "—",
        "skipped": "—",
    }
    assert "![training loss]" not in text  # no figure given
    assert "Peak memory: a: 2.0 KiB" in text

    rows[1].update(status="completed", reason=None, final_loss_scale=1024.0)
    text = sweep.render_markdown(rows, "t", "sweep_loss.png")
    assert md_headers(text) == ["run", "status", "precision", "val acc", "skipped", "final scale"]
    assert [r["final scale"] for r in md_table(text)] == ["—", "1024"]
    assert "![training loss](sweep_loss.png)" in text


def test_one_steps_activation_and_accounted_bytes_are_columns_blank_where_not_counted():
    rows = [
        {"run": "fp32", "status": "completed", "precision": "fp32", "memory_ratio": 1.0,
         "activation_bytes": 24 * 1024, "activation_ratio": 1.0, "accounted_bytes": 40 * 2**20},
        {"run": "bf16", "status": "completed", "precision": "bf16", "memory_ratio": 1.02,
         "activation_bytes": 13 * 1024, "activation_ratio": 13 / 24, "accounted_bytes": 3 * 2**30},
        # memory.account=false, or a report written before memory.accounted
        {"run": "old", "status": "completed", "precision": "bf16", "memory_ratio": 1.01},
    ]  # fmt: skip
    text = sweep.render_markdown(rows, "t", None)

    assert md_headers(text) == [
        "run", "status", "precision", "memory vs fp32", "activations", "activations vs fp32",
        "accounted",
    ]  # fmt: skip
    cells = [[r[h] for h in md_headers(text)[4:]] for r in md_table(text)]
    assert cells == [
        ["24.0 KiB", "1.00×", "40.0 MiB"],
        ["13.0 KiB", "0.54×", "3.0 GiB"],
        ["—", "—", "—"],
    ]
    assert "Activations: what autograd saved for one micro-batch's backward" in text
    piped = io.StringIO()
    sweep.print_table(Console(file=piped, width=160), rows, "t")
    header, fp32, bf16, old = piped.getvalue().splitlines()[1:5]
    at = header.index("activations ")
    assert (fp32[at:].split("  ")[0], bf16[at:].split("  ")[0], old[at:].split("  ")[0]) == (
        "24.0 KiB",
        "13.0 KiB",
        "—",
    )
    # No run counted: the columns are left out, as any column without a value.
    assert "activations" not in md_headers(sweep.render_markdown(rows[2:], "t", None))


def test_a_log_file_gets_the_comparison_as_plain_text_and_a_terminal_keeps_rich():
    rows = [
        {"run": "precision=fp32", "status": "completed", "precision": "fp32",
         "final_val_accuracy": 0.9722, "skipped_steps": 0},
        {"run": "precision=fp16", "status": "failed", "reason": "boom [at step 3]"},
    ]  # fmt: skip
    box = set("┏┓┗┛┃━│─┡┩╇┳┻┼└┘┌┐")
    piped = io.StringIO()  # `mptrain -m ... > sweep.log`
    sweep.print_table(Console(file=piped, width=160), rows, "sweep multirun/x")
    text = piped.getvalue()
    assert not box & set(text), text
    assert text.splitlines() == [
        "sweep multirun/x",
        "run             status                    precision  val acc  skipped",
        "precision=fp32  completed                 fp32       97.22%   0",
        "precision=fp16  failed: boom [at step 3]  —          —        —",
    ]
    terminal = io.StringIO()
    sweep.print_table(Console(file=terminal, width=160, force_terminal=True), rows, "t")
    assert box & set(terminal.getvalue()) and "boom [at step 3]" in terminal.getvalue()


def test_summary_callback_does_nothing_without_runs(tmp_path):
    callback = sweep.SweepSummaryCallback()
    missing = tmp_path / "missing"
    callback.on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(missing)}}}))
    assert not missing.exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    callback.on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(empty)}}}))
    assert list(empty.iterdir()) == []


@pytest.mark.slow
def test_a_report_written_before_schema_version_loads_as_version_0(runs, tmp_path):
    """report.json files of earlier mptrain versions (no schema_version) are still compared."""
    from mptrain.report.schema import load_report

    source = next(iter(runs.values())) / REPORT_JSON
    legacy = json.loads(source.read_text())
    del legacy["schema_version"]
    path = tmp_path / REPORT_JSON
    path.write_text(json.dumps(legacy))
    assert load_report(path).schema_version == 0
    legacy["trainning"] = {}
    path.write_text(json.dumps(legacy))
    with pytest.raises(ValueError, match="unknown key 'trainning'"):
        load_report(path)


# ------------------------------------------------------------------------- speed ratios' spread
def test_window_ratio_spread_is_median_over_median_within_the_quartiles():
    from mptrain.pace.spread import window_ratio_spread

    tight = window_ratio_spread([200, 204, 198, 202], [100, 101, 99, 100])
    assert tight.median == pytest.approx(201 / 100)
    assert tight.low < tight.median < tight.high and tight.relative < 0.05
    assert (tight.samples, tight.noisy) == (4, None)

    # A run whose windows were slowed (by another job) half of the time: noisy, with the reason.
    wide = window_ratio_spread([200, 120, 200, 110], [100, 101, 99, 100])
    assert wide.noisy.startswith("spread ") and "over 4 windows (noisy above 10%)" in wide.noisy

    few = window_ratio_spread([200, 200], [100, 100, 100, 100])
    assert few.median == 2 and few.noisy == "2 windows: too few to judge the spread (at least 3)"


def test_measured_windows_leave_out_a_short_last_window():
    from mptrain.report.schema import ThroughputSection

    t = ThroughputSection(
        samples_per_s=1.0,
        measured_steps=11,
        measured_time_s=1.0,
        warmup_steps=0,
        data_wait_fraction=None,
        window_samples_per_s=[100.0, 110.0, 105.0, 20.0, 90.0],
        window_steps=[4, 4, 4, 1, 2],
    )
    assert sweep.measured_windows(t) == [100.0, 110.0, 105.0, 90.0]
    assert sweep.measured_windows(dataclasses.replace(t, window_samples_per_s=None)) == []


def at(report, directory: str, start: str, end: str):
    """``report`` as if job ``directory`` had run from ``start`` to ``end`` (HH:MM:SS.fff), on a
    quiet machine (the fixture's runs record the load they met: these tests are about jobs)."""
    day = "2030-01-02T"
    return dataclasses.replace(
        report,
        output_dir=directory,
        started_at=f"{day}{start}+00:00",
        finished_at=f"{day}{end}+00:00",
        hardware={**report.hardware, "machine_load": None},
    )


@pytest.mark.slow
def test_jobs_whose_spans_overlap_ran_at_the_same_time(runs):
    from mptrain.report.schema import load_report

    r = load_report(runs["fp32_monday"] / REPORT_JSON)
    a = at(r, "a", "10:00:00.000", "10:00:05.000")
    b = at(r, "b", "10:00:04.900", "10:00:09.000")  # overlaps a by 0.1 s
    c = at(r, "c", "10:00:09.000", "10:00:12.000")  # starts as b finishes: one after the other
    copy_of_c = dataclasses.replace(c)  # the same job compared twice is not a second job
    count = sweep.concurrent_jobs([a, b, c, copy_of_c])
    assert count == {sweep._job(a): 1, sweep._job(b): 1, sweep._job(c): 0}


@pytest.mark.slow
def test_a_speed_ratio_is_noisy_when_either_job_ran_alongside_another(runs):
    from mptrain.report.schema import load_report

    fp32 = at(load_report(runs["fp32_monday"] / REPORT_JSON), "fp32", "10:00:00", "10:00:05")
    bf16 = at(load_report(runs["bf16_tuesday"] / REPORT_JSON), "bf16", "10:00:06", "10:00:09")
    other = at(bf16, "other", "10:00:08", "10:00:20")
    alongside = sweep.concurrent_jobs([fp32, bf16, other])

    speed = sweep.speed_spread(bf16, fp32, alongside)
    assert "this job ran at the same time as 1 other job" in speed.noisy
    assert "baseline" not in speed.noisy
    assert "same time" not in (sweep.speed_spread(fp32, fp32, alongside).noisy or "")

    late_fp32 = at(fp32, "late_fp32", "10:00:07", "10:00:19")  # alongside bf16 and other
    alongside = sweep.concurrent_jobs([late_fp32, bf16, other])
    speed = sweep.speed_spread(bf16, late_fp32, alongside)
    assert "this job ran at the same time as 2 other jobs" in speed.noisy
    assert speed.noisy.endswith("its FP32 baseline ran at the same time as 2 other jobs")


@pytest.mark.slow
def test_a_report_without_windows_gives_one_measurement_marked_noisy(runs, tmp_path):
    for name in ("fp32_monday", "bf16_tuesday"):
        legacy = read_report(runs[name])
        del legacy["throughput"]["window_samples_per_s"], legacy["throughput"]["window_steps"]
        legacy["hardware"].pop("machine_load", None)  # as reports before it: no busy note either
        (tmp_path / name).mkdir()
        (tmp_path / name / REPORT_JSON).write_text(json.dumps(legacy))

    fp32, bf16 = sweep.compare(
        sweep.find_runs([tmp_path / "fp32_monday", tmp_path / "bf16_tuesday"])
    )

    assert bf16["throughput_ratio"] == pytest.approx(bf16["samples_per_s"] / fp32["samples_per_s"])
    assert bf16["throughput_windows"] == 1 and bf16["throughput_noisy"] == sweep.NO_WINDOWS
    md = md_table(sweep.render_markdown([fp32, bf16], "t", None))
    assert md[1]["speed vs fp32"].endswith(" noisy")


# ------------------------------------------------------------- jobs in parallel (joblib launcher)
@pytest.fixture(scope="module")
def parallel_sweep(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    cwd = tmp_path_factory.mktemp("parallel_sweep")
    return run_sweep(
        cwd,
        "hydra/launcher=joblib",
        "hydra.launcher.n_jobs=2",
        "precision=fp32,bf16",
        "model=mlp",
        "device=cpu",
        "max_steps=40",
        "log_every=8",
        "throughput_warmup_steps=4",
        "progress=false",
        "checkpoint.enabled=false",
        timeout=TIMEOUT_S,
    )


@pytest.mark.slow
def test_jobs_run_in_parallel_mark_every_speed_ratio_noisy(parallel_sweep):
    result, sweep_dir = parallel_sweep
    assert result.returncode == 0, describe(result)
    spans = [(r["started_at"], r["finished_at"]) for r in map(read_report, job_dirs(sweep_dir))]
    (s1, e1), (s2, e2) = spans
    assert s1 < e2 and s2 < e1, f"the joblib jobs did not overlap: {spans}"

    fp32, bf16 = json.loads((sweep_dir / "sweep.json").read_text(encoding="utf-8"))["runs"]
    assert fp32["ran_alongside"] == bf16["ran_alongside"] == 1
    assert "this job ran at the same time as 1 other job" in fp32["throughput_noisy"]
    assert "its FP32 baseline ran at the same time as 1 other job" in bf16["throughput_noisy"]
    text = (sweep_dir / "sweep.md").read_text(encoding="utf-8")
    md = md_table(text)
    assert [r["speed vs fp32"] for r in md] == [speed_cell(fp32), speed_cell(bf16)]
    assert all(r["speed vs fp32"].endswith(" noisy") for r in md)
    printed = " ".join(printed_table(result).split())
    for row in (fp32, bf16):
        line = f"{row['run']}: speed noisy: {row['throughput_noisy']}"
        assert f"- {line}" in text and line in printed


# ------------------------------------------------------------------ two sweeps into one directory
SWEEP = (
    "-m",
    "model=mlp",
    "device=cpu",
    "progress=false",
    "epochs=null",
    "max_steps=2",
    "throughput_warmup_steps=0",
    "hydra.sweep.dir=sweep",
)


@pytest.mark.slow
def test_a_sweep_over_precision_schedules_tells_each_run_by_both_precisions(tmp_path, monkeypatch):
    """A real -m sweep of plain and switched runs: the summary names a switched job by both
    precisions and the step, and pairs every job with the job in FP32 throughout, not with the
    job that switched from FP32 (the first job in FP32)."""
    monkeypatch.setattr(job_module, "FigureWorker", NoFigure)  # no curves.png: not read here
    schedules = "precision.switch={to:bf16,at:1},{to:null,at:null}"  # Hydra's dict values
    result = run_cli([*SWEEP, "precision=fp32,fp8", schedules], tmp_path, monkeypatch, jobs=True)
    assert result.code == 0, result

    rows = json.loads((tmp_path / "sweep" / sweep.SWEEP_JSON).read_text())["runs"]
    switched, plain = "precision.switch={to:bf16,at:1}", "precision.switch={to:null,at:null}"
    assert [(r["run"], r["precision"]) for r in rows] == [
        (f"precision=fp32 {switched}", "fp32 -> bf16 after step 1"),
        (f"precision=fp32 {plain}", "fp32"),
        (f"precision=fp8 {switched}", "fp8 (emulated) -> bf16 after step 1"),
        (f"precision=fp8 {plain}", "fp8 (emulated)"),
    ]
    assert {r["baseline"] for r in rows} == {str(tmp_path / rows[1]["directory"])}
    md = md_table((tmp_path / "sweep" / sweep.SWEEP_MD).read_text(encoding="utf-8"))
    assert [r["precision"] for r in md] == [r["precision"] for r in rows]


@pytest.fixture(scope="module")
def earlier_run(tmp_path_factory) -> Path:
    """A finished run whose report.json the tests below leave in another job's directory."""
    directory = tmp_path_factory.mktemp("earlier") / "run"
    train(tiny_run("max_steps=2", "checkpoint.enabled=false"), directory)
    return directory


def test_a_sweep_into_a_directory_another_sweep_holds_is_refused(tmp_path, monkeypatch):
    (tmp_path / "sweep").mkdir()
    held = RunDirLock(
        tmp_path / "sweep", layout.SWEEP_LOCK_NAME, kind="sweep", key="hydra.sweep.dir"
    )
    with held:  # another sweep, running (this process holds it: the kernel's flock is per open)
        result = run_cli([*SWEEP, "seed=1,2"], tmp_path, monkeypatch)
    assert result.code == 2 and not result.launched, result
    (line,) = result.stderr.splitlines()
    assert line.startswith(
        f"mptrain: error: sweep directory sweep: in use by another sweep (pid {os.getpid()} on "
    )
    assert line.endswith("; choose another hydra.sweep.dir or wait for it to finish")
    assert not list((tmp_path / "sweep").iterdir())  # nothing written, the lock file gone


@pytest.mark.slow
def test_a_job_refused_at_run_time_is_not_credited_with_another_runs_report(
    earlier_run, tmp_path, monkeypatch
):
    """Another run takes a job's directory after the preflight checked it and writes its report
    while the sweep runs: the sweep's job, refused, did not complete (exit 1), in the summary too."""
    from mptrain.cli import app as cli

    job_dir = tmp_path / "sweep" / "job0"
    run_and_report = cli.run_and_report

    def launch_while_another_run_holds_the_job_dir(start):
        job_dir.mkdir(parents=True)
        with RunDirLock(job_dir):
            shutil.copy(
                earlier_run / REPORT_JSON, job_dir / REPORT_JSON
            )  # written during the sweep
            run_and_report(start)

    monkeypatch.setattr(cli, "run_and_report", launch_while_another_run_holds_the_job_dir)
    subdir = "hydra.sweep.subdir=job${hydra.job.num}"
    result = run_cli([*SWEEP, "seed=1", subdir], tmp_path, monkeypatch, jobs=True)
    assert result.code == 1, result
    assert "mptrain: 1 job(s) did not complete:\n  sweep/job0: " in result.stderr
    (row,) = json.loads((tmp_path / "sweep" / sweep.SWEEP_JSON).read_text())["runs"]
    assert row["status"] == "failed" and row["reason"], row


@pytest.mark.slow
def test_only_this_sweeps_jobs_are_judged_and_never_by_an_earlier_report(earlier_run, tmp_path):
    def job_with_the_earlier_report(number: int, overrides: list[str]) -> Path:
        job = fake_job(tmp_path, number, overrides)
        shutil.copy(earlier_run / REPORT_JSON, job / REPORT_JSON)
        return job

    earlier_sweeps = job_with_the_earlier_report(0, ["seed=1"])
    for path in (earlier_sweeps / REPORT_JSON, earlier_sweeps / ".hydra" / "overrides.yaml"):
        os.utime(path, (time.time() - 3600,) * 2)
    started = time.time() - 1  # the sweep began before its jobs below were written
    kept = job_with_the_earlier_report(1, ["seed=2"])  # Hydra's record new, the report not
    os.utime(kept / REPORT_JSON, (time.time() - 3600,) * 2)
    refused = job_with_the_earlier_report(2, ["seed=3"])
    write_failure(refused, "run directory: in use by another run")

    runs = sweep.this_sweeps_runs(tmp_path, started)
    assert [run.directory for run in runs] == [kept, refused]
    assert [run.report for run in runs] == [None, None]
    assert runs[0].reason.startswith(
        "no report.json from this sweep (the one there: a run started "
    )
    assert runs[1].reason == "run directory: in use by another run"
    assert [run.label for run in runs] == ["seed=2", "seed=3"]


@pytest.mark.slow
def test_the_same_sweep_with_resume_auto_continues_its_jobs_where_they_are(tmp_path, monkeypatch):
    """resume, resume_allow_changes and overwrite are not part of a job's directory name: the
    same sweep again with resume=auto used to open new directories and resume nothing. Its
    finished jobs say "already completed" and keep their reports, measurements included (issue
    39, item 16: they were rewritten with 0 steps and sweep.md lost its speed column)."""
    first = run_cli([*SWEEP, "seed=1,2"], tmp_path, monkeypatch, jobs=True)
    assert first.code == 0, first
    jobs = sorted(p.name for p in (tmp_path / "sweep").iterdir() if p.is_dir())
    before = [(tmp_path / "sweep" / job / "report.json").read_text() for job in jobs]
    summary = json.loads((tmp_path / "sweep" / sweep.SWEEP_JSON).read_text())["runs"]
    again = run_cli([*SWEEP, "seed=1,2", "resume=auto"], tmp_path, monkeypatch, jobs=True)
    assert again.code == 0, again
    assert sorted(p.name for p in (tmp_path / "sweep").iterdir() if p.is_dir()) == jobs
    assert [(tmp_path / "sweep" / job / "report.json").read_text() for job in jobs] == before
    rows = json.loads((tmp_path / "sweep" / sweep.SWEEP_JSON).read_text())["runs"]
    assert [row["status"] for row in rows] == ["completed", "completed"]
    assert [row["samples_per_s"] for row in rows] == [r["samples_per_s"] for r in summary]


@pytest.mark.slow
def test_a_second_sweep_into_a_finished_sweeps_directory_answers_for_its_own_jobs(
    tmp_path, monkeypatch
):
    first = run_cli([*SWEEP, "seed=1"], tmp_path, monkeypatch, jobs=True)
    assert first.code == 0, first
    # The same job again would start fresh over the first one's checkpoints: refused up front,
    # before Hydra rewrites that job's .hydra/ record.
    again = run_cli([*SWEEP, "seed=1"], tmp_path, monkeypatch, jobs=True)
    assert again.code == 2, again
    (line,) = again.stderr.splitlines()
    assert "sweep/0_" in line and "seed=1" in line and "holds another run's checkpoints" in line
    # Other jobs into the same directory run; the summary and the exit code are theirs alone.
    other = run_cli([*SWEEP, "seed=2"], tmp_path, monkeypatch, jobs=True)
    assert other.code == 0, other
    rows = json.loads((tmp_path / "sweep" / sweep.SWEEP_JSON).read_text())["runs"]
    assert [(row["status"], "seed=2" in row["directory"]) for row in rows] == [("completed", True)]
