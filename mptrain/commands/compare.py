"""``mptrain-compare PATH... [--out DIR]``: compare finished runs made at any time, on any
machine (the comparison itself: :mod:`mptrain.commands.sweep`), into a directory of its own."""

from __future__ import annotations

import argparse
import datetime as dt
import sys
from pathlib import Path
from typing import NoReturn

from mptrain.commands.readable import visible
from mptrain.commands.runs import NO_RUNS, SEARCH_DEPTH, find_runs, run_dirs_in
from mptrain.commands.sweep import wide_console, write_comparison
from mptrain.config.base import ConfigError
from mptrain.report.rows import plural
from mptrain.rundir.lock import check_creatable


def compare_main(argv: list[str] | None = None) -> None:
    """``mptrain-compare PATH... [--out DIR]``: compare runs made at any time, on any machine.

    Each PATH is a run, a sweep, or a folder searched for runs (:func:`run_dirs_in`). A shell glob
    (``outputs/*/*``) also matches files (curves.png, sweep.md) and folders without runs: they
    are skipped, named in one note line each on stderr. The comparison goes to ``--out DIR``, by
    default a directory of its own (:func:`default_out_dir`). Exit 2, writing nothing, when a
    path does not exist, no path holds a run, or the output directory cannot be made.
    """
    parser = argparse.ArgumentParser(
        prog="mptrain-compare",
        description="Compare finished mptrain runs (run directories, sweep directories, or "
        f"folders holding runs up to {SEARCH_DEPTH} levels down, such as outputs).",
    )
    parser.add_argument("paths", nargs="+", type=Path, help="run or sweep directories, or folders")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help=f"where to write sweep.md, sweep.json and sweep_loss.png (default: {COMPARE_DIR}/"
        "<date>/<time>, a directory of its own per comparison)",
    )
    args = parser.parse_args(argv)
    for path in args.paths:
        if not path.exists():
            _refuse(f"{path}: no such directory")
    found = {path: run_dirs_in(path) for path in args.paths if path.is_dir()}
    files = [path for path in args.paths if not path.is_dir()]
    empty = [path for path, dirs in found.items() if not dirs]
    if len(empty) == len(found):  # nothing to compare
        _refuse(_nothing_found(empty, files))
    out = args.out if args.out is not None else default_out_dir()
    try:
        check_creatable(out, "--out")
    except ConfigError as exc:
        _refuse(str(exc))
    for line in skipped_notes(files, empty):
        print(f"mptrain-compare: note: {visible(line)}", file=sys.stderr)
    runs = find_runs([d for dirs in found.values() for d in dirs])
    out.mkdir(parents=True, exist_ok=True)
    title = f"comparison of {plural(len(runs), 'run')}"
    write_comparison(runs, out, title, wide_console())


# mptrain-compare's comparisons, beside the commands' own outputs (outputs/bench, outputs/eval).
COMPARE_DIR = Path("outputs") / "compare"


def default_out_dir() -> Path:
    """``outputs/compare/<date>/<time>`` in the current directory: each comparison in a directory
    of its own, so none writes over the sweep.md of a sweep or of another comparison (the current
    directory may be a sweep's); a second one within the same second gets ``_2``, ``_3``, ..."""
    stamped = COMPARE_DIR / dt.datetime.now().strftime("%Y-%m-%d/%H-%M-%S")
    out, n = stamped, 1
    while out.exists():
        n += 1
        out = stamped.with_name(f"{stamped.name}_{n}")
    return out


def _refuse(message: str) -> NoReturn:
    print(f"mptrain-compare: error: {visible(message)}", file=sys.stderr)
    raise SystemExit(2)


def _nothing_found(empty: list[Path], files: list[Path]) -> str:
    """The one line when no path holds a run: each folder said so, and the files named."""
    parts = [NO_RUNS.format(path=path) for path in empty]
    if files:
        parts.append(f"{_names(files)}: {'a file' if len(files) == 1 else 'files'}, not runs")
    return "; ".join(parts)


def skipped_notes(files: list[Path], empty: list[Path]) -> list[str]:
    """One line for the files among the paths, one for the folders without runs (none when
    there are none of either)."""
    lines = []
    if files:
        lines.append(f"skipped {plural(len(files), 'file')} (not run directories): {_names(files)}")
    if empty:
        lines.append(f"skipped {plural(len(empty), 'folder')} holding no run: {_names(empty)}")
    return lines


def _names(paths: list[Path], shown: int = 5) -> str:
    """Up to ``shown`` paths, then how many more (a glob may match hundreds of files)."""
    names = ", ".join(str(p) for p in paths[:shown])
    return names + (f" and {len(paths) - shown} more" if len(paths) > shown else "")
