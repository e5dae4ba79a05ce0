"""One bad run directory never stops a comparison (issue 39, item 20), and ``mptrain-compare``
writes into a directory of its own (item 5).

Two tiny in-process runs (model=mlp, a few steps) are made once per module; each test copies one
and breaks it the way a kill, a full disk, another tool or a hand edit leaves it, then compares it
with the other through ``mptrain-compare``'s entry point or a sweep's summary.
"""

from __future__ import annotations

import datetime as dt
import io
import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from rich.console import Console
from support.runs import tiny_run, train

from mptrain.commands import compare, sweep
from mptrain.report.rows import fmt_bytes
from mptrain.rundir.layout import METRICS_JSONL, REPORT_JSON

# ESC ] 0 ; ... BEL retitles a terminal window, ESC [ 31 m turns text red, a newline breaks a row.
HOSTILE = "\x1b]0;pwned\x07\x1b[31mred\nrow"


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("made")
    runs = {"fp32": root / "fp32", "bf16": root / "bf16"}
    for name, directory in runs.items():
        train(tiny_run(f"precision={name}", "max_steps=6", "log_every=2"), directory)
    return runs


def copied(made: dict[str, Path], where: Path, name: str = "broken") -> Path:
    """A copy of the bf16 run at ``where/name`` (its checkpoints left behind)."""
    target = where / name
    shutil.copytree(made["bf16"], target, ignore=shutil.ignore_patterns("checkpoints"))
    return target


def edit_report(run: Path, change: Callable[[dict], object]) -> Path:
    path = run / REPORT_JSON
    report = json.loads(path.read_text(encoding="utf-8"))
    change(report)
    path.write_text(json.dumps(report), encoding="utf-8")
    return run


def compared(made: dict[str, Path], other: Path, out: Path) -> dict[str, dict]:
    """``mptrain-compare FP32_RUN OTHER --out OUT``: sweep.json's rows by directory name."""
    compare.compare_main([str(made["fp32"]), str(other), "--out", str(out)])
    rows = json.loads((out / "sweep.json").read_text(encoding="utf-8"))["runs"]
    return {Path(row["directory"]).name: row for row in rows}


# ------------------------------------------------------------------------------ metrics.jsonl
def test_a_cut_last_metrics_row_is_left_out_of_the_curves_with_a_note(made, tmp_path, capsys):
    run = copied(made, tmp_path)
    with (run / METRICS_JSONL).open("a", encoding="utf-8") as f:
        f.write('{"kind": "train", "step": 8, "lo')  # a kill -9 in the middle of a write

    rows = compared(made, run, tmp_path / "out")

    assert rows["broken"]["status"] == "completed"
    assert rows["broken"]["accuracy_delta"] is not None, "still compared with its FP32 run"
    assert (tmp_path / "out" / "sweep_loss.png").is_file()
    out = capsys.readouterr().out
    assert f"note: {run / METRICS_JSONL}: left out 1 unreadable row" in " ".join(out.split())


# -------------------------------------------------------------------------------- report.json
BAD_REPORTS = {
    # name: (how report.json is broken, the field the row names)
    "accuracy_as_text": (
        lambda r: r["evaluation"].update(final_val_accuracy="high"),
        'evaluation.final_val_accuracy: a string ("high"), not a number',
    ),
    "precision_not_an_object": (
        lambda r: r.update(precision="bf16"),
        'precision: a string ("bf16"), not a section (an object)',
    ),
    "start_as_a_number": (
        lambda r: r.update(started_at=5),
        "started_at: an integer (5), not a string",
    ),
    "start_without_offset": (
        lambda r: r.update(started_at="2030-01-02T10:00:00"),
        'started_at: a string ("2030-01-02T10:00:00"), a time without its UTC offset',
    ),
    "windows_without_steps": (
        lambda r: r["throughput"].update(window_steps=[2]),
        "throughput.window_steps: not one step count per measured window",
    ),
    "zero_speed_window": (
        lambda r: r["throughput"].update(window_samples_per_s=[0.0, 1.0]),
        "throughput.window_samples_per_s[0]: a number (0.0), not a speed",
    ),
    "skipped_count_as_text": (
        lambda r: r["training"]["skipped_steps"].update(count="none"),
        'training.skipped_steps.count: a string ("none"), not an integer',
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_REPORTS))
def test_a_report_the_comparison_cannot_read_is_a_row_naming_the_field(
    made, tmp_path, case, capsys
):
    change, field = BAD_REPORTS[case]
    broken = edit_report(copied(made, tmp_path), change)

    rows = compared(made, broken, tmp_path / "out")

    assert rows["broken"]["status"] == "failed"
    assert rows["broken"]["reason"] == f"unreadable report.json: {field}"
    assert rows["fp32"]["status"] == "completed" and rows["fp32"]["accuracy_delta"] == 0.0
    table = (tmp_path / "out" / "sweep.md").read_text(encoding="utf-8")
    assert f"failed: unreadable report.json: {field}" in table
    assert "comparison written to" in capsys.readouterr().out


def test_non_finite_numbers_written_as_strings_read_as_numbers(made, tmp_path):
    """report.json is strict JSON: mptrain writes a NaN as "nan"; "NaN" and "Infinity" are how
    other JSON writers spell them."""

    def diverged(r: dict) -> None:
        r["evaluation"].update(final_val_accuracy="NaN", final_val_loss="nan")
        r["memory"]["peak_bytes"] = "Infinity"

    rows = compared(made, edit_report(copied(made, tmp_path), diverged), tmp_path / "out")

    row = rows["broken"]
    assert row["status"] == "completed"
    assert row["final_val_accuracy"] == "nan" and row["accuracy_delta"] == "nan"  # sweep.json
    assert row["memory_ratio"] == "inf"
    table = (tmp_path / "out" / "sweep.md").read_text(encoding="utf-8")
    assert "| n/a | nan | " in table  # val acc (a percentage: n/a) and its delta
    assert "| inf× |" not in table and "| inf |" in table


# --------------------------------------------------------------------- control characters
def hostile_run(made: dict[str, Path], where: Path, number: int) -> Path:
    """A sweep job whose .hydra/overrides.yaml holds terminal control characters."""
    run = copied(made, where, f"{number}_job")
    (run / ".hydra").mkdir()
    overrides = ["precision=bf16", f"mlflow.run_name={HOSTILE}"]
    OmegaConf.save(OmegaConf.create(overrides), run / ".hydra" / "overrides.yaml")
    return run


def test_control_characters_from_the_overrides_are_escaped_on_stdout_and_in_sweep_md(
    made, tmp_path, capsys
):
    run = hostile_run(made, tmp_path, 1)

    compare.compare_main([str(made["fp32"]), str(run), "--out", str(tmp_path / "out")])

    escaped = r"\x1b]0;pwned\x07\x1b[31mred\nrow"
    printed = capsys.readouterr().out
    md = (tmp_path / "out" / "sweep.md").read_text(encoding="utf-8")
    for text in (printed, md):
        assert "\x1b" not in text and "\x07" not in text
        assert escaped in text
    assert md.count("\n| ") == 3, "header and two rows: the newline did not break the table"
    data = json.loads((tmp_path / "out" / "sweep.json").read_text(encoding="utf-8"))
    assert HOSTILE in data["runs"][1]["run"], "sweep.json keeps the label as it is, JSON-escaped"


def test_a_terminal_gets_the_control_characters_escaped_too(made, tmp_path):
    """On a terminal the table is rich's (its own colour codes are fine, the run's are not)."""
    rows = sweep.compare(sweep.find_runs([made["fp32"], hostile_run(made, tmp_path, 1)]))
    terminal = Console(file=io.StringIO(), force_terminal=True, width=300)

    sweep.print_table(terminal, rows, f"sweep {HOSTILE}")

    shown = terminal.file.getvalue()
    assert "pwned\x07" not in shown and "\x1b]0;" not in shown
    assert r"\x1b]0;pwned\x07" in shown


def test_a_sweep_summary_escapes_them_and_compares_the_rest(made, tmp_path, capsys):
    sweep_dir = tmp_path / "sweep"
    hostile_run(made, sweep_dir, 0)
    broken = edit_report(
        copied(made, sweep_dir, "1_job"), lambda r: r["evaluation"].update(task=["lm"])
    )
    (broken / ".hydra").mkdir()
    OmegaConf.save(OmegaConf.create(["seed=1"]), broken / ".hydra" / "overrides.yaml")

    runs = sweep.write_sweep_summary(sweep_dir, None)

    assert len(runs) == 2
    md = (sweep_dir / "sweep.md").read_text(encoding="utf-8")
    assert "\x1b" not in md and r"\x1b]0;pwned" in md
    assert "unreadable report.json: evaluation.task: a list, not a string" in md
    assert "\x1b]0;" not in capsys.readouterr().out


# -------------------------------------------------------------------------- output directory
def test_compare_writes_to_a_directory_of_its_own_by_default(made, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    before = dt.datetime.now()

    compare.compare_main([str(made["fp32"]), str(made["bf16"])])
    compare.compare_main([str(made["fp32"])])  # within the same second, most likely

    assert not (tmp_path / "sweep.md").exists(), "nothing in the current directory"
    made_dirs = sorted(p.parent for p in (tmp_path / "outputs" / "compare").glob("*/*/sweep.md"))
    assert len(made_dirs) == 2, "each comparison in a directory of its own"
    first = made_dirs[0].relative_to(tmp_path / "outputs" / "compare")
    stamp = dt.datetime.strptime(str(first), "%Y-%m-%d/%H-%M-%S")
    assert before.replace(microsecond=0) <= stamp <= dt.datetime.now()
    assert {p.name for p in made_dirs[0].iterdir()} >= {"sweep.md", "sweep.json"}
    printed = " ".join(capsys.readouterr().out.split())
    assert f"comparison written to {Path('outputs', 'compare', first, 'sweep.md')}" in printed


def test_help_names_the_default_output_directory(capsys):
    with pytest.raises(SystemExit):
        compare.compare_main(["--help"])
    assert "(default: outputs/compare/<date>/<time>" in " ".join(capsys.readouterr().out.split())


def test_an_output_path_that_is_a_file_is_refused_in_one_line(made, tmp_path, capsys):
    taken = tmp_path / "notes.txt"
    taken.write_text("mine\n")

    with pytest.raises(SystemExit) as exc:
        compare.compare_main([str(made["fp32"]), "--out", str(taken)])

    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err == f"mptrain-compare: error: --out={taken}: exists and is not a directory\n"
    assert taken.read_text() == "mine\n"


# ------------------------------------------------- left to the report reader (not sweep.py)
def test_a_report_nested_too_deeply_to_read_is_a_row(made, tmp_path):
    run = copied(made, tmp_path)
    (run / REPORT_JSON).write_text('{"config": ' + "[" * 100_000 + "]" * 100_000 + "}")

    rows = compared(made, run, tmp_path / "out")

    assert rows["broken"]["reason"].startswith("unreadable report.json: ")


def test_a_sweep_summary_with_a_report_whose_start_is_not_a_time_compares_the_rest(made, tmp_path):
    sweep_dir = tmp_path / "sweep"
    started = time.time() - 1
    edit_report(copied(made, sweep_dir, "0_job"), lambda r: r.update(started_at=5))
    now = dt.datetime.now().astimezone().isoformat()  # a job of this sweep
    edit_report(copied(made, sweep_dir, "1_job"), lambda r: r.update(started_at=now))

    sweep.write_sweep_summary(sweep_dir, started)

    rows = json.loads((sweep_dir / "sweep.json").read_text(encoding="utf-8"))["runs"]
    assert [row["status"] for row in rows] == ["failed", "completed"]
    assert rows[0]["reason"] == "unreadable report.json: started_at: an integer (5), not a string"


# --------------------------------------------------- one step's bytes (issue 42, item 1 leftover)
def accounted(run: Path) -> dict:
    return json.loads((run / REPORT_JSON).read_text(encoding="utf-8"))["memory"]["accounted"]


def md_rows(md: str) -> dict[str, dict[str, str]]:
    """sweep.md's (first) table: each row as {header: cell}, by its run label."""
    lines = [line for line in md.splitlines() if line.startswith("| ")]
    header, *rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in lines]
    return {row[0]: dict(zip(header, row, strict=True)) for row in rows}


def test_compare_shows_one_steps_activations_and_accounted_bytes_blank_where_not_counted(
    made, tmp_path, capsys
):
    # A report written before memory.accounted existed, and one whose step was not counted.
    old = edit_report(copied(made, tmp_path, "old"), lambda r: r["memory"].pop("accounted"))
    fsdp = edit_report(
        copied(made, tmp_path, "fsdp"),
        lambda r: r["memory"].update(accounted={"not_counted": "FSDP: not copied"}),
    )
    out = tmp_path / "out"

    compare.compare_main(
        [str(made["fp32"]), str(made["bf16"]), str(old), str(fsdp), "--out", str(out)]
    )

    rows = {row["run"]: row for row in json.loads((out / "sweep.json").read_text())["runs"]}
    fp32, bf16 = rows["fp32"], rows["bf16"]
    for row, run in ((fp32, made["fp32"]), (bf16, made["bf16"])):
        counted = accounted(run)
        assert row["activation_bytes"] == counted["total"]["activations"] > 0
        assert row["accounted_bytes"] == counted["total_bytes"] > row["activation_bytes"]
    assert fp32["activation_ratio"] == 1.0
    assert bf16["activation_ratio"] == bf16["activation_bytes"] / fp32["activation_bytes"] < 1
    for name in ("old", "fsdp"):
        assert rows[name]["status"] == "completed" and rows[name]["accuracy_delta"] is not None
        figures = [
            rows[name][k] for k in ("activation_bytes", "activation_ratio", "accounted_bytes")
        ]
        assert figures == [None, None, None]
    md = md_rows((out / "sweep.md").read_text(encoding="utf-8"))
    columns = ("activations", "activations vs fp32", "accounted")
    shown = {name: [md[name][c] for c in columns] for name in md}
    assert shown["fp32"] == [
        fmt_bytes(fp32["activation_bytes"]),
        "1.00×",
        fmt_bytes(fp32["accounted_bytes"]),
    ]
    assert shown["bf16"] == [
        fmt_bytes(bf16["activation_bytes"]),
        f"{bf16['activation_ratio']:.2f}×",
        fmt_bytes(bf16["accounted_bytes"]),
    ]
    assert shown["old"] == shown["fsdp"] == ["—", "—", "—"]
    printed = capsys.readouterr().out.splitlines()
    header = next(line for line in printed if line.startswith("run "))
    assert "memory vs fp32  activations  activations vs fp32  accounted  " in header
    fp32_line = next(line for line in printed if line.startswith("fp32 "))
    assert fp32_line[header.index("activations ") :].startswith(fmt_bytes(fp32["activation_bytes"]))


def test_a_comparison_of_reports_without_the_count_has_no_such_columns(made, tmp_path):
    old = [
        edit_report(copied(made, tmp_path, name), lambda r: r["memory"].pop("accounted"))
        for name in ("old_a", "old_b")
    ]

    compare.compare_main([*(str(run) for run in old), "--out", str(tmp_path / "out")])

    md = (tmp_path / "out" / "sweep.md").read_text(encoding="utf-8")
    header = next(line for line in md.splitlines() if line.startswith("| "))
    assert "| val acc |" in header and "activations" not in header and "accounted" not in header


def test_a_sweep_summary_shows_each_jobs_count_and_blanks_for_a_report_without_it(made, tmp_path):
    sweep_dir = tmp_path / "sweep"
    shutil.copytree(made["fp32"], sweep_dir / "0_job", ignore=shutil.ignore_patterns("checkpoints"))
    copied(made, sweep_dir, "1_job")
    edit_report(copied(made, sweep_dir, "2_job"), lambda r: r["memory"].update(accounted=None))

    sweep.write_sweep_summary(sweep_dir, None)

    md = md_rows((sweep_dir / "sweep.md").read_text(encoding="utf-8"))
    bf16 = accounted(made["bf16"])
    assert md["1_job"]["activations"] == fmt_bytes(bf16["total"]["activations"])
    assert md["1_job"]["accounted"] == fmt_bytes(bf16["total_bytes"])
    assert md["0_job"]["activations vs fp32"] == "1.00×"
    assert md["1_job"]["activations vs fp32"].endswith("×")
    assert [md["2_job"][c] for c in ("activations", "activations vs fp32", "accounted")] == [
        "—"
    ] * 3
