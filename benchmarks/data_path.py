"""The imagefolder data path alone (no model): images/s of the old and new pipelines.

    python benchmarks/data_path.py [--workers 2] [--images 300] [--image-size 224] [--reps 3]
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
training crops drawn could be decoded at reduced size.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from mptrain.config.data import ImageFolderConfig
from mptrain.data import batches, decode, feeds, folder
from mptrain.data import build as data
from mptrain.data.decode import CropSpec, crop_params, draft_factor

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


def old_epochs(cfg: ImageFolderConfig, layout: batches.BatchLayout, epochs: int) -> int:
    """Serve ``epochs`` epochs the way the code did before: images served."""
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
    return served


def new_epochs(cfg: ImageFolderConfig, layout: batches.BatchLayout, epochs: int) -> int:
    """Serve ``epochs`` epochs with the feed ``build_data`` builds now: images served."""
    bundle = data.build_data(cfg, layout)
    served = 0
    for epoch in range(epochs):
        for _, labels in bundle.train.batches(epoch):
            served += len(labels)
    if layout.device.type == "cuda":
        torch.cuda.synchronize()
    return served


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


def measure(args: argparse.Namespace, root: Path) -> dict[str, list[float]]:
    """images/s of each pipeline per repetition, alternating (reversed every other one)."""
    device = torch.device(args.device)
    layout = batches.BatchLayout(args.batch_size, args.batch_size, device, 0, args.workers)
    if device.type == "cpu":  # device decoding's code on the CPU (the config would refuse it)
        folder._check_decode_device = lambda device: None
    chosen = pipelines(args, root)
    rates: dict[str, list[float]] = {name: [] for name in chosen}
    for rep in range(args.reps):
        order = list(chosen) if rep % 2 == 0 else list(reversed(chosen))
        for name in order:
            function, cfg = chosen[name]
            start = time.perf_counter()
            served = function(cfg, layout, args.epochs)
            rates[name].append(served / (time.perf_counter() - start))
    return rates


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
    rows = {}
    for name, reps in rates.items():
        per = max(workers, 1)
        rows[name] = {
            "reps": reps,
            "images_per_s": {"median": statistics.median(reps), "range": [min(reps), max(reps)]},
            "images_per_s_per_worker": statistics.median(reps) / per,
        }
    return rows


def main() -> None:
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
        rates = measure(args, Path(tmp))
    rows = summary(rates, args.workers)
    share = draft_share(sizes, args.image_size)
    for name, row in rows.items():
        low, high = row["images_per_s"]["range"]
        print(
            f"{name:<22} {row['images_per_s']['median']:8.1f} images/s "
            f"(range {low:.1f}-{high:.1f}; {row['images_per_s_per_worker']:.1f} per worker)"
        )
    print(f"training crops decodable at reduced size: {share:.0%}")
    if args.json:
        settings = {k: v for k, v in vars(args).items() if k != "json"}
        doc = {
            "benchmark": "imagefolder data path, no model",
            "settings": settings,
            "pipelines": rows,
            "draft_share": share,
            "hardware": {"device": args.device, "cpus": torch.get_num_threads()},
            "versions": {"torch": torch.__version__, "python": platform.python_version()},
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
