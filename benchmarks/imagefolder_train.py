"""ResNet-50 trained through ``dataset=imagefolder`` on generated JPEGs: PIL workers vs device decode.

For one GPU machine (an H200 with 16 CPU cores: about a minute with the defaults):

    python -m benchmarks.imagefolder_train [--images 4096] [--workers 14] [--batch 256]
        [--steps 40] [--warmup 10] [--precision bf16] [--pipelines cpu,cuda]
        [--out benchmarks/results/imagefolder_train.json]

Writes ``--images`` seeded JPEGs of ImageNet-like sizes with benchmarks/data_path.py's generator
(``write_images``; ``--jobs`` processes write parts of the set, renamed into one tree), reads them
once into the page cache, then trains ResNet-50 (ImageNet stem, channels_last, SGD) through
``mptrain.train.job.train`` — the code ``mptrain dataset=imagefolder ...`` runs — once per pipeline:

- ``cpu``: ``dataset.decode_device=cpu``: PIL decode (reduced-size where the crop allows) in
  ``--workers`` persistent DataLoader workers, uint8 crops normalised on the device;
- ``cuda``: ``dataset.decode_device=cuda``: the workers only read the files, the training GPU
  decodes the JPEGs (nvJPEG through ``torchvision.io.decode_jpeg``), crops and normalises them.

Each run is ``--warmup`` + ``--steps`` optimizer steps (``epochs=null``, no checkpoints, evaluation
only at the end, which the stopwatch excludes). Reported per pipeline, read from the run's report:
training images/s after warm-up, the fraction of that time spent waiting for data, peak memory,
the pipeline facts, the run's wall time and, for ``cuda``, ``host_decoded``: the JPEGs nvJPEG
refused and the host decoded instead (when that is most of them, the figure is not nvJPEG's).
Each run is a child process of this script. Prints a JSON document; ``--out`` also gets it,
rewritten atomically after every pipeline; a pipeline whose run fails is recorded with its
``error`` (exit code 1 then) and the other pipeline's figures are kept.

``--device cpu --images 16 --image-size 32 --batch 4 --steps 2 --warmup 1 --workers 1 --jobs 2
--precision fp32 --model cnn`` runs the same code on a CPU in seconds (a smoke run, as the test
suite does; ``--model`` takes any mptrain model, ResNets get the ImageNet stem at every size):
the ``cuda`` pipeline's code then decodes on the CPU in the main process (the check that refuses
``decode_device=cuda`` without a GPU is bypassed, as data_path.py does), labelled ``cuda (on
cpu)``: only a check that it runs, not a speed.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

from benchmarks.data_path import write_images
from benchmarks.jsondoc import error_text, write_json
from benchmarks.mptrain_api import compose, folder, hardware_info, software_versions

PIPELINES = ("cpu", "cuda")

REPO = Path(__file__).resolve().parents[1]


def _write_part(root: str, count: int, seed: int) -> int:
    write_images(Path(root), count, seed)
    return count


def generate(root: Path, images: int, jobs: int) -> int:
    """``images`` training JPEGs (data_path.write_images) in root/train/<class>/ and validation
    ones in root/val/, written by ``jobs`` processes in parts and renamed into one tree; the
    number of files written. Every file is read once afterwards (page cache)."""
    jobs = max(1, min(jobs, images))
    counts = [images // jobs + (k < images % jobs) for k in range(jobs)]
    parts = [root / f"part{k}" for k in range(jobs)]
    with ProcessPoolExecutor(jobs) as pool:
        list(pool.map(_write_part, map(str, parts), counts, range(jobs)))
    written = 0
    for k, part in enumerate(parts):
        for path in sorted(part.rglob("*.jpg")):
            split, cls = path.parent.parent.name, path.parent.name
            target = root / split / cls / f"p{k}_{path.name}"
            target.parent.mkdir(parents=True, exist_ok=True)
            path.rename(target)
            target.read_bytes()
            written += 1
        shutil.rmtree(part)
    return written


def run_config(args: argparse.Namespace, root: Path, pipeline: str):
    """The typed RunConfig of one pipeline's training run (composed from the shipped YAML)."""
    overrides = [
        f"model={args.model}",
        "dataset=imagefolder",
        f"dataset.root={root}",
        f"dataset.image_size={args.image_size}",
        f"dataset.resize_size={round(args.image_size * 256 / 224)}",
        f"dataset.decode_device={pipeline}",
        f"batch_size={args.batch}",
        f"eval_batch_size={args.batch}",
        f"num_workers={args.workers}",
        f"precision={args.precision}",
        "optimizer=sgd",
        "channels_last=true",
        f"device={args.device}",
        f"max_steps={args.warmup + args.steps}",
        "epochs=null",
        f"throughput_warmup_steps={args.warmup}",
        f"log_every={args.steps}",
        "eval_every=1000000000",  # only the final evaluation, which the stopwatch excludes
        "probe_every=null",
        "checkpoint.enabled=false",
        "progress=false",
    ]
    if args.model in ("resnet18", "resnet50"):
        overrides.append("model.small_stem=false")  # the ImageNet stem at every size
    return compose(*overrides)


def train_once(args: argparse.Namespace, root: Path, pipeline: str, run_dir: Path) -> dict:
    """Train one pipeline in a child process (this script with ``--child``) and read its
    report.json: the figures this benchmark reports. A child per run, because a feed's persistent
    DataLoader workers, collected inside a process that goes on, take 5 s each to stop (they miss
    the shutdown and are joined with a time-out); at a process's exit they are stopped at once."""
    child = [sys.executable, "-m", "benchmarks.imagefolder_train", *sys.argv[1:]]
    child += ["--child", pipeline, "--root", str(root), "--run-dir", str(run_dir)]
    # the checkout's root first on PYTHONPATH: the child imports this package from any directory
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    code = subprocess.run(child, stdin=subprocess.DEVNULL, env=env, check=False).returncode
    if code != 0:
        raise RuntimeError(f"the {pipeline} pipeline's run failed (exit {code}; output above)")
    report = json.loads((run_dir / "report.json").read_text())
    throughput = report["throughput"]
    return {
        "status": report["status"],
        "images_per_s": throughput["samples_per_s"],
        "data_wait_fraction": throughput["data_wait_fraction"],
        "measured_steps": throughput["measured_steps"],
        "measured_time_s": throughput["measured_time_s"],
        "peak_memory_bytes": report["memory"]["peak_bytes"],
        "pipeline": report["data"]["pipeline"],
        # Device decoding's host fallback (None for the CPU pipeline): see mptrain.decode.
        "host_decoded": (report["data"]["pipeline"] or {}).get("host_decoded"),
        "wall_time_s": report["wall_time_s"],
    }


def child_run(args: argparse.Namespace) -> int:
    """``--child PIPELINE``: one training run (mptrain.train.job.train) into ``--run-dir``."""
    from benchmarks.mptrain_api import train

    if args.device == "cpu":  # device decoding's code on the CPU (the config would refuse it)
        folder._check_decode_device = lambda device: None
    train(run_config(args, args.root, args.child), args.run_dir)
    return 0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=4096)
    parser.add_argument("--jobs", type=int, default=14, help="processes writing the JPEGs")
    parser.add_argument("--workers", type=int, default=14, help="DataLoader workers")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--model", default="resnet50", help="an mptrain model (cnn: a smoke run)")
    parser.add_argument("--pipelines", default="cpu,cuda", help="cpu and/or cuda (decode_device)")
    parser.add_argument("--device", default="cuda", help="cuda (the benchmark) | cpu (a smoke run)")
    parser.add_argument("--root", type=Path, default=None, help="write the JPEGs here (kept)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--child", choices=PIPELINES, help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if min(args.images, args.jobs, args.batch, args.steps, args.warmup) < 1 or args.workers < 0:
        parser.error("--images, --jobs, --batch, --steps and --warmup must be >= 1, --workers >= 0")
    args.pipelines = args.pipelines.split(",")
    if not args.pipelines or set(args.pipelines) - set(PIPELINES):
        parser.error(f"--pipelines: one or more of {', '.join(PIPELINES)}")
    if args.images < args.batch:
        parser.error("--images must be at least --batch (a training epoch drops the last batch)")
    return args


def describe(label: str, row: dict) -> str:
    if row.get("error"):
        return f"{label:>13}: {row['error']}"
    rate, wait = row["images_per_s"], row["data_wait_fraction"]
    rate_text = "no figure" if rate is None else f"{rate:8.1f} images/s"
    wait_text = "no figure" if wait is None else f"{wait:.1%}"
    host = "" if not row["host_decoded"] else f", {row['host_decoded']} JPEGs host-decoded"
    return f"{label:>13}: {rate_text}, data wait {wait_text}{host}"


def measure(args: argparse.Namespace, root: Path, runs_dir: Path, result: dict) -> None:
    """Generate the JPEGs, then one training run per pipeline into ``result["pipelines"]``
    (label -> figures, or ``error``), the document rewritten into ``--out`` after each."""
    written = generate(root, args.images, args.jobs)
    print(f"wrote {written} JPEGs into {root}", flush=True)
    for pipeline in args.pipelines:
        label = pipeline if args.device != "cpu" or pipeline == "cpu" else "cuda (on cpu)"
        try:
            row = train_once(args, root, pipeline, runs_dir / pipeline)
        except Exception as exc:  # recorded in the document, the other pipeline is kept
            row = {"error": error_text(exc)}
        result["pipelines"][label] = row
        print(describe(label, row), flush=True)
        write_json(args.out, result)


def main() -> int:
    args = parse_args()
    if args.child:
        return child_run(args)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("needs a CUDA GPU (or --device cpu for a smoke run)", file=sys.stderr)
        return 2
    hidden = ("out", "root", "child", "run_dir")
    result = {
        "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "benchmark": (
            f"{args.model} through dataset=imagefolder, {args.images} generated JPEGs, "
            f"{args.image_size} px, batch {args.batch}, {args.precision}, {args.workers} workers"
        ),
        "settings": {k: v for k, v in vars(args).items() if k not in hidden},
        "hardware": hardware_info(device),
        "versions": software_versions(),
        "note": None
        if device.type == "cuda"
        else "CPU smoke run: the device-decode code decodes on the CPU; the speeds mean nothing",
        "pipelines": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        root = args.root or Path(tmp) / "jpegs"
        measure(args, root, Path(tmp) / "runs", result)
    print(json.dumps(result, indent=2, default=str))
    return 1 if any(row.get("error") for row in result["pipelines"].values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
