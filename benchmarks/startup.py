"""Start-up cost: a one-step mptrain run against the floor any PyTorch training script pays.

    python -m benchmarks.startup [--reps 5] [--out benchmarks/results/startup.json]

- ``floor``: ``python -c "import torch; torch.optim.AdamW(torch.nn.Linear(2, 2).parameters())"``
  (importing torch, and torch._dynamo, which the first optimizer imports);
- ``one-step``: ``python -m mptrain max_steps=1 epochs=null checkpoint.enabled=false`` on the
  default job (CNN on digits), with its report and figure.

The two alternate, in reversed order every other repetition, in fresh processes run from a temporary
directory; printed: the median wall time of each, the median and range of the per-repetition ratios
one-step / floor (the goal is 1.3x). Then one one-step run under ``-X importtime`` and one under
cProfile give the breakdown: the cumulative import time of the packages that matter (scikit-learn,
matplotlib, torch._dynamo, Hydra, ...) and the time in mptrain's phases (Hydra compositions and how
many, the build, the training loop, the report and its figure).
"""

from __future__ import annotations

import argparse
import json
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FLOOR = [
    sys.executable,
    "-c",
    "import torch; torch.optim.AdamW(torch.nn.Linear(2, 2).parameters())",
]
ONE_STEP_ARGS = ["max_steps=1", "epochs=null", "checkpoint.enabled=false", "progress=false"]
PACKAGES = (
    "torch",
    "torch._dynamo",
    "torchvision",
    "sklearn",
    "scipy",
    "matplotlib",
    "matplotlib.pyplot",
    "hydra",
    "omegaconf",
    "rich",
    "PIL",
)
# (label, function name as cProfile records it, file fragment)
PHASES = (
    ("Hydra: compose a config", "load_configuration", "config_loader_impl.py"),
    ("mptrain: preflight", "check_jobs", "mptrain/preflight.py"),
    ("mptrain: build the run", "build_run", "mptrain/build.py"),
    ("mptrain: load the data", "build_data", "mptrain/data.py"),
    ("mptrain: training loop", "train_loop", "mptrain/loop.py"),
    ("mptrain: the report's figure (waiting for its process)", "plot_run", "mptrain/plots.py"),
    (
        "torch: first optimizer (imports torch._dynamo)",
        "add_param_group",
        "torch/optim/optimizer.py",
    ),
)


def one_step(run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "mptrain", *ONE_STEP_ARGS, f"hydra.run.dir={run_dir}"]


def timed(command: list[str], cwd: Path) -> float:
    start = time.perf_counter()
    subprocess.run(command, cwd=cwd, check=True, capture_output=True)
    return time.perf_counter() - start


def measure(reps: int, cwd: Path) -> dict[str, list[float]]:
    """Alternating repetitions; the first pair is a warm-up (file cache) and not kept."""
    times: dict[str, list[float]] = {"floor": [], "one-step": []}
    for rep in range(reps + 1):
        order = ["floor", "one-step"] if rep % 2 else ["one-step", "floor"]
        for name in order:
            command = FLOOR if name == "floor" else one_step(cwd / f"run{rep}")
            seconds = timed(command, cwd)
            if rep:
                times[name].append(seconds)
    return times


def import_breakdown(cwd: Path) -> dict[str, float]:
    """Cumulative seconds of each package's first import in a one-step run (-X importtime)."""
    command = [sys.executable, "-X", "importtime", *one_step(cwd / "importtime")[1:]]
    stderr = subprocess.run(command, cwd=cwd, check=True, capture_output=True, text=True).stderr
    found: dict[str, float] = {}
    for line in stderr.splitlines():
        if not line.startswith("import time:") or "cumulative" in line:
            continue
        _, cumulative, name = (part.strip() for part in line.split(":", 1)[1].split("|"))
        if name in PACKAGES and name not in found:
            found[name] = int(cumulative) / 1e6
    return found


def phase_breakdown(cwd: Path) -> dict[str, dict[str, float]]:
    """Seconds (and calls) in each of PHASES in a one-step run, from cProfile."""
    profile = cwd / "one_step.prof"
    command = [sys.executable, "-m", "cProfile", "-o", str(profile), *one_step(cwd / "prof")[1:]]
    subprocess.run(command, cwd=cwd, check=True, capture_output=True)
    stats = pstats.Stats(str(profile)).stats  # type: ignore[attr-defined]
    found = {}
    for label, function, fragment in PHASES:
        entries = [
            (calls, cumulative)
            for (file, _, name), (_, calls, _, cumulative, _) in stats.items()
            if name == function and fragment in file
        ]
        if entries:
            calls = sum(c for c, _ in entries)
            found[label] = {"seconds": max(t for _, t in entries), "calls": calls}
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cwd = Path(tmp)
        times = measure(args.reps, cwd)
        imports = import_breakdown(cwd)
        phases = phase_breakdown(cwd)
    ratios = [s / f for s, f in zip(times["one-step"], times["floor"], strict=True)]
    result = {
        "floor_s": statistics.median(times["floor"]),
        "one_step_s": statistics.median(times["one-step"]),
        "ratio_median": statistics.median(ratios),
        "ratio_range": [min(ratios), max(ratios)],
        "times": times,
        "imports_s": imports,
        "phases": phases,
    }
    print(f"floor (import torch + first optimizer): {result['floor_s']:.2f} s (median)")
    print(f"one-step mptrain run:                   {result['one_step_s']:.2f} s (median)")
    low, high = result["ratio_range"]
    print(f"ratio one-step / floor: {result['ratio_median']:.2f}x (range {low:.2f}-{high:.2f})")
    print("\nfirst import, cumulative (one one-step run):")
    for name, seconds in imports.items():
        print(f"  {name:<20} {seconds:6.2f} s")
    print("\nphases (one one-step run under cProfile, which slows Python code):")
    for label, found in phases.items():
        print(f"  {label:<48} {found['seconds']:6.2f} s  ({found['calls']} call(s))")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
