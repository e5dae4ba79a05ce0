"""threads=auto against torch's default threading, quiet and beside busy processes.

    python -m benchmarks.contention [--busy 0 1 2 4] [--reps 2] [--cnn-steps 30] [--gpt-steps 20]
                                    [--out benchmarks/results/contention_cpu.json]

Two jobs, each run to a fixed number of optimizer steps in this process through
``mptrain.train.job.train`` (the whole job: build, loop, evaluation, report):

- ``cnn``: mptrain's default job (``model=cnn dataset=digits precision=auto``), ``max_steps``;
- ``gpt``: the small GPT (``task=lm``, 2 layers, width 64, block 64, batch 16), ``max_steps``.

For each number of busy processes (pure-Python spin loops, one process each, started before and
stopped after the condition's runs), each job runs with ``threads=auto`` and with
``threads=<os.cpu_count()>`` (torch's default: one thread per core, pinned so nothing measures
it), alternating and in reversed order every other repetition. The figure is samples/s over the
loop's whole training time (``samples_seen / time.training_s``: warm-up and the measuring steps
included, evaluation excluded), so the cost of measuring is counted against threads=auto.

Prints, per job and load, the median samples/s of each mode, auto/default, and auto's throughput
against its fair share: quiet samples/s x 1 / (busy + 1), the share of the cores this job gets
when the busy processes and it share them equally (the issue's done-when: at least 0.5).
--out writes every run's figures, the threads each run used, the CPU and the date.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks.inprocess import CPU_JOB, SMALL_GPT, cpu_document, train_report
from benchmarks.jsondoc import write_json

JOBS = {"cnn": ("model=cnn", "dataset=digits"), "gpt": SMALL_GPT}


def _spin(stop_at: float) -> None:
    while time.monotonic() < stop_at:
        pass


class Busy:
    """``count`` busy processes for the duration of a ``with`` block."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.processes: list[multiprocessing.Process] = []

    def __enter__(self) -> Busy:
        context = multiprocessing.get_context("spawn")
        stop_at = time.monotonic() + 3600  # a safety net: they end with the block
        self.processes = [context.Process(target=_spin, args=(stop_at,)) for _ in range(self.count)]
        for process in self.processes:
            process.start()
        time.sleep(0.5 if self.count else 0)
        return self

    def __exit__(self, *exc: object) -> None:
        for process in self.processes:
            process.terminate()
        for process in self.processes:
            process.join()


def run_once(job: str, threads: str, steps: int) -> dict[str, Any]:
    """One whole job; its samples/s over the training time and the threads it used."""
    report = train_report(*JOBS[job], *CPU_JOB, f"max_steps={steps}", f"threads={threads}")
    t = report["threads"]
    return {
        "samples_per_s": report["training"]["samples_seen"] / report["time"]["training_s"],
        "training_s": report["time"]["training_s"],
        "threads_used": t["threads"],
        "measurements": t["measurements"],
        "changes": t["changes"],
    }


def measure(busy: list[int], reps: int, steps: dict[str, int]) -> list[dict[str, Any]]:
    """Every (job, load) with both modes alternating; one row each (see module doc)."""
    default = str(os.cpu_count() or 1)
    rows = []
    for load in busy:
        with Busy(load):
            for job in JOBS:
                # what else ran: other users' work makes even busy=0 a busy machine
                load_average = os.getloadavg()[0]
                runs: dict[str, list[dict[str, Any]]] = {"auto": [], "default": []}
                for rep in range(reps):
                    order = ["auto", "default"] if rep % 2 == 0 else ["default", "auto"]
                    for mode in order:
                        threads = "auto" if mode == "auto" else default
                        runs[mode].append(run_once(job, threads, steps[job]))
                rows.append(
                    {"job": job, "busy": load, "load_average_1min": load_average, "runs": runs}
                )
                print(_row_text(rows[-1]), flush=True)
    return rows


def median_speed(runs: list[dict[str, Any]]) -> float:
    return statistics.median(r["samples_per_s"] for r in runs)


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """auto/default per row, and auto against its fair share of the quiet throughput."""
    quiet = {r["job"]: median_speed(r["runs"]["auto"]) for r in rows if r["busy"] == 0}
    for row in rows:
        auto, default = median_speed(row["runs"]["auto"]), median_speed(row["runs"]["default"])
        row["auto_samples_per_s"], row["default_samples_per_s"] = auto, default
        row["auto_over_default"] = auto / default
        fair = quiet.get(row["job"])
        row["auto_over_fair_share"] = auto / (fair / (row["busy"] + 1)) if fair else None


def _row_text(row: dict[str, Any]) -> str:
    used = {m: [r["threads_used"] for r in runs] for m, runs in row["runs"].items()}
    speeds = {m: [round(r["samples_per_s"]) for r in runs] for m, runs in row["runs"].items()}
    return (
        f"{row['job']} busy={row['busy']} (load average {row['load_average_1min']:.1f} before): "
        f"samples/s {speeds}, threads used {used}"
    )


def render(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| job | busy processes | threads=auto samples/s (threads used) | default samples/s "
        "| auto / default | auto vs fair share | load average before |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        used = sorted({x["threads_used"] for x in r["runs"]["auto"]})
        fair = r["auto_over_fair_share"]
        lines.append(
            f"| {r['job']} | {r['busy']} | {r['auto_samples_per_s']:.0f} ({', '.join(map(str, used))}) "
            f"| {r['default_samples_per_s']:.0f} | {r['auto_over_default']:.2f} "
            f"| {'' if fair is None else f'{fair:.2f}'} | {r.get('load_average_1min', 0):.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--busy", type=int, nargs="+", default=[0, 1, 2, 4])
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--cnn-steps", type=int, default=30)
    parser.add_argument("--gpt-steps", type=int, default=20)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    rows = measure(args.busy, args.reps, {"cnn": args.cnn_steps, "gpt": args.gpt_steps})
    add_ratios(rows)
    print(render(rows))
    write_json(args.out, cpu_document(vars(args), started, cpu_count=os.cpu_count(), rows=rows))


if __name__ == "__main__":
    main()
