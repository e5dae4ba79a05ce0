"""The imagefolder data path alone (no model): images/s of the old and new pipelines.

    python -m benchmarks.data_path [--workers 2] [--images 300] [--image-size 224] [--reps 3]
        [--epochs 2] [--batch-size 32] [--device cpu|cuda] [--device-decode]
        [--json benchmarks/results/data_path_cpu.json]

Writes ``--images`` seeded JPEGs of ImageNet-like sizes (sides 400-500 px, aspect ratios 3:4 to
4:3, quality 90, 4 classes) into a temporary directory, then serves ``--epochs`` training epochs
of them to ``--device`` with each pipeline, in alternating order (reversed every other
repetition), a fresh feed per repetition (worker start-up included):

- ``old``: the pipeline as of ce47b3b: full PIL decode, torchvision RandomResizedCrop + flip +
  ToTensor + Normalize in the workers, a new DataLoader (new workers) every epoch;
- ``new``: ``dataset=imagefolder`` as built now: persistent workers, reduced-size JPEG decode
  where the crop allows (``decode_draft``), uint8 crops normalised on the device;
- ``new, draft off``: the same with ``dataset.decode_draft=false``;
- with ``--device-decode``: ``dataset.decode_device=cuda`` (workers read bytes, the device
  decodes); with ``--device cpu`` the same code decodes on the CPU in the main process, labelled
  ``device-decode (cpu)`` (only a check that it runs: nvJPEG is the point of it).

Printed: median and range of images/s (and per worker) over the repetitions, and how many of the
training crops drawn could be decoded at reduced size. Each pipeline's time ends with a device
synchronisation, so copies still queued count. ``--json`` gets the document, rewritten
atomically after every pipeline's repetition (a run stopped midway keeps what it timed); a
pipeline that raises is recorded under ``errors`` and not run again, the others go on; device
decoding records ``host_decoded`` (JPEGs the device decoder refused and the host decoded).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.jsondoc import error_text, write_json
from benchmarks.mptrain_api import (
    CropSpec,
    ImageFolderConfig,
    batches,
    crop_params,
    decode,
    draft_factor,
    feeds,
    folder,
)
from benchmarks.mptrain_api import data_build as data

CLASSES = 4


def write_images(root: Path, count: int, seed: int = 0) -> list[tuple[int, int]]:
    """``count`` JPEGs in root/train/<class>/ (and 2 per class in root/val/); their sizes."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    sizes = []
    for split, n in (("train", count), ("val", 2 * CLASSES)):
        for k in range(n):
            long_side = int(rng.integers(400, 501))
            short_side = int(long_side * rng.uniform(0.75, 1.0))
            w, h = (long_side, short_side) if k % 3 else (short_side, long_side)
            coarse = rng.integers(0, 256, (h // 12, w // 12, 3), dtype=np.uint8)
            image = Image.fromarray(coarse).resize((w, h), Image.Resampling.BICUBIC)
            pixels = np.asarray(image).astype(np.int16) + rng.integers(-6, 7, (h, w, 3))
            class_dir = root / split / f"class{k % CLASSES}"
            class_dir.mkdir(parents=True, exist_ok=True)
            Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(
                class_dir / f"{k}.jpg", quality=90
            )
            if split == "train":
                sizes.append((h, w))
    return sizes


def old_epochs(cfg: ImageFolderConfig, layout: batches.BatchLayout, epochs: int) -> tuple:
    """Serve ``epochs`` epochs the way the code did before: (images served, None)."""
    from torchvision import datasets
    from torchvision import transforms as T

    normalize = T.Normalize(folder.IMAGENET_MEAN, folder.IMAGENET_STD)
    transform = T.Compose(
        [T.RandomResizedCrop(cfg.image_size), T.RandomHorizontalFlip(), T.ToTensor(), normalize]
    )
    train_images = datasets.ImageFolder(str(Path(cfg.root) / "train"), loader=decode.load_image)
    seeded = feeds.SeededTransforms(train_images, transform, layout.seed)
    served = 0
    for epoch in range(epochs):
        seeded.epoch = epoch
        order = feeds.epoch_indices(len(train_images), True, layout.seed, epoch).tolist()
        loader = torch.utils.data.DataLoader(
            seeded,
            batch_size=layout.batch_size,
            sampler=order,
            drop_last=True,
            num_workers=layout.num_workers,
            pin_memory=layout.device.type == "cuda",
            persistent_workers=False,
        )
        for images, labels in loader:
            images = images.to(layout.device, non_blocking=True)
            labels = labels.to(layout.device, non_blocking=True)
            served += len(labels)
    if layout.device.type == "cuda":
        torch.cuda.synchronize()  # the last non-blocking copies are still queued: time them too
    return served, None


def new_epochs(cfg: ImageFolderConfig, layout: batches.BatchLayout, epochs: int) -> tuple:
    """Serve ``epochs`` epochs with the feed ``build_data`` builds now: (images served, JPEGs
    the host decoded because the device decoder refused them; None without device decoding)."""
    bundle = data.build_data(cfg, layout)
    served = 0
    for epoch in range(epochs):
        for _, labels in bundle.train.batches(epoch):
            served += len(labels)
    if layout.device.type == "cuda":
        torch.cuda.synchronize()
    return served, (getattr(bundle.train, "pipeline", None) or {}).get("host_decoded")


def pipelines(args: argparse.Namespace, root: Path) -> dict[str, tuple]:
    """name -> (function, config) of every pipeline timed."""
    resize = round(args.image_size * 256 / 224)
    base = {"root": str(root), "image_size": args.image_size, "resize_size": resize}
    chosen = {
        "old": (old_epochs, ImageFolderConfig(**base)),
        "new": (new_epochs, ImageFolderConfig(**base, decode_draft=True)),
        "new, draft off": (new_epochs, ImageFolderConfig(**base, decode_draft=False)),
    }
    if args.device_decode:
        label = f"device-decode ({args.device})"
        chosen[label] = (new_epochs, ImageFolderConfig(**base, decode_device="cuda"))
    return chosen


class Timings:
    """What the repetitions measured so far: images/s per pipeline and repetition, the first
    error of each pipeline that raised, and device decoding's host fallbacks (summed)."""

    def __init__(self, names: list[str]):
        self.rates: dict[str, list[float]] = {name: [] for name in names}
        self.errors: dict[str, str] = {}
        self.host_decoded: dict[str, int] = {}

    def time(self, name: str, function, cfg: ImageFolderConfig, args, layout) -> None:
        """One pipeline's epochs, timed; an exception is kept in ``errors``."""
        start = time.perf_counter()
        try:
            served, host = function(cfg, layout, args.epochs)
        except Exception as exc:  # recorded in the document, the other pipelines go on
            self.errors[name] = error_text(exc)
            return
        self.rates[name].append(served / (time.perf_counter() - start))
        if host is not None:
            self.host_decoded[name] = self.host_decoded.get(name, 0) + host


def measure(args: argparse.Namespace, root: Path, save) -> Timings:
    """images/s of each pipeline per repetition, alternating (reversed every other one);
    ``save(timings)`` after each pipeline's repetition. A pipeline that raised is not rerun."""
    device = torch.device(args.device)
    layout = batches.BatchLayout(args.batch_size, args.batch_size, device, 0, args.workers)
    if device.type == "cpu":  # device decoding's code on the CPU (the config would refuse it)
        folder._check_decode_device = lambda device: None
    chosen = pipelines(args, root)
    timings = Timings(list(chosen))
    for rep in range(args.reps):
        order = list(chosen) if rep % 2 == 0 else list(reversed(chosen))
        for name in (n for n in order if n not in timings.errors):
            function, cfg = chosen[name]
            timings.time(name, function, cfg, args, layout)
            save(timings)
    return timings


def draft_share(sizes: list[tuple[int, int]], image_size: int, seeds: int = 4) -> float:
    """Share of training crops (``seeds`` draws per image) that decode at reduced size."""
    spec = CropSpec(image_size, image_size, random=True)
    reduced = total = 0
    for k, (h, w) in enumerate(sizes):
        for seed in range(seeds):
            generator = torch.Generator().manual_seed(1000 * k + seed)
            _, _, crop_h, crop_w = crop_params(h, w, spec, generator)
            reduced += draft_factor(crop_h, crop_w, image_size) > 1
            total += 1
    return reduced / total


def summary(rates: dict[str, list[float]], workers: int) -> dict[str, dict]:
    """Median and range per pipeline that was timed at least once."""
    rows = {}
    for name, reps in rates.items():
        if not reps:
            continue
        per = max(workers, 1)
        rows[name] = {
            "reps": reps,
            "images_per_s": {"median": statistics.median(reps), "range": [min(reps), max(reps)]},
            "images_per_s_per_worker": statistics.median(reps) / per,
        }
    return rows


def document(args: argparse.Namespace, timings: Timings, share: float) -> dict:
    settings = {k: v for k, v in vars(args).items() if k != "json"}
    return {
        "benchmark": "imagefolder data path, no model",
        "settings": settings,
        "pipelines": summary(timings.rates, args.workers),
        "errors": timings.errors,
        "host_decoded": timings.host_decoded,
        "draft_share": share,
        "hardware": {"device": args.device, "cpus": torch.get_num_threads()},
        "versions": {"torch": torch.__version__, "python": platform.python_version()},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--images", type=int, default=300)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--device-decode", action="store_true", help="time decode_device=cuda")
    parser.add_argument("--json", "--out", dest="json", type=Path)
    args = parser.parse_args()
    from torchvision import datasets, transforms  # noqa: F401 (imported before any timing)

    with tempfile.TemporaryDirectory() as tmp:
        sizes = write_images(Path(tmp), args.images)
        for path in Path(tmp).rglob("*.jpg"):
            path.read_bytes()  # every pipeline reads from the page cache
        share = draft_share(sizes, args.image_size)
        timings = measure(
            args, Path(tmp), lambda t: write_json(args.json, document(args, t, share))
        )
    for name, row in summary(timings.rates, args.workers).items():
        low, high = row["images_per_s"]["range"]
        host = timings.host_decoded.get(name)
        print(
            f"{name:<22} {row['images_per_s']['median']:8.1f} images/s "
            f"(range {low:.1f}-{high:.1f}; {row['images_per_s_per_worker']:.1f} per worker)"
            + (f"; {host} JPEGs host-decoded" if host else "")
        )
    for name, error in timings.errors.items():
        print(f"{name:<22} failed: {error}")
    print(f"training crops decodable at reduced size: {share:.0%}")
    return 1 if timings.errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
