"""Small dataset files written for tests: CIFAR-10/100 pickles, MNIST-style IDX files, image
folders of solid colours, and the bundle and batch helpers that read them back (used by
tests/data/test_data.py and tests/commands/test_inference.py)."""

from __future__ import annotations

import pickle
import struct
from pathlib import Path

import numpy as np
import torch

from mptrain.config.data import TorchvisionDatasetConfig
from mptrain.data import batches
from mptrain.data.batches import BatchLayout
from mptrain.data.build import build_data

CPU = torch.device("cpu")

# Per-channel mean and std of the training sets, as published; written out here (not read from
# mptrain.data.build) so that wrong statistics in the code show as wrong pixels.
PUBLISHED_STATS = {
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
    "mnist": ((0.1307,), (0.3081,)),
    "fashion_mnist": ((0.2860,), (0.3530,)),
}


# ----------------------------------------------------------------------------------------- helpers
def build(cfg, batch_size: int = 2, eval_batch_size: int = 4, seed: int = 0) -> batches.DataBundle:
    """build_data on the CPU, without worker processes, as the only rank."""
    layout = BatchLayout(
        batch_size=batch_size, eval_batch_size=eval_batch_size, device=CPU, seed=seed, num_workers=0
    )
    return build_data(cfg, layout)


def collect(source, epoch: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """All batches of one epoch, concatenated."""
    images, labels = zip(*source.batches(epoch), strict=True)
    return torch.cat(images), torch.cat(labels)


def unnormalise(images: torch.Tensor, name: str) -> torch.Tensor:
    """Undo the per-channel normalisation with the published statistics: back to uint8 pixels."""
    mean, std = PUBLISHED_STATS[name]
    mean_t = torch.tensor(mean).view(1, -1, 1, 1)
    std_t = torch.tensor(std).view(1, -1, 1, 1)
    pixels = ((images * std_t + mean_t) * 255).round()
    assert pixels.min() >= 0 and pixels.max() <= 255
    return pixels.to(torch.uint8)


def random_bytes(shape: tuple[int, ...], seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=shape, dtype=np.uint8)


def tv_config(name: str, root: Path, augment: bool = False) -> TorchvisionDatasetConfig:
    return TorchvisionDatasetConfig(name=name, root=str(root), augment=augment)


# CIFAR: pickled dicts with bytes keys, b"data" uint8 (N, 3072) = per image R, G, B planes of 32x32.
def write_cifar_file(path: Path, images: np.ndarray, labels: dict[bytes, list[int]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    entry = {
        b"batch_label": path.name.encode(),
        b"data": images,
        b"filenames": [f"img_{i}.png".encode() for i in range(len(images))],
        **labels,
    }
    with path.open("wb") as f:
        pickle.dump(entry, f, protocol=2)


def write_cifar10(root: Path, per_file: int = 2, num_test: int = 3) -> dict[str, np.ndarray]:
    """data_batch_1..5 and test_batch with random pixels; returns what was written, in file order."""
    folder = root / "cifar-10-batches-py"
    train_images, train_labels = [], []
    for i in range(1, 6):
        images = random_bytes((per_file, 3072), seed=i)
        labels = [(i + k) % 10 for k in range(per_file)]
        write_cifar_file(folder / f"data_batch_{i}", images, {b"labels": labels})
        train_images.append(images)
        train_labels += labels
    test_images = random_bytes((num_test, 3072), seed=100)
    test_labels = [9 - k for k in range(num_test)]
    write_cifar_file(folder / "test_batch", test_images, {b"labels": test_labels})
    return {
        "train_images": np.concatenate(train_images),
        "train_labels": np.array(train_labels),
        "val_images": test_images,
        "val_labels": np.array(test_labels),
    }


def write_cifar100(root: Path, num_train: int = 6, num_test: int = 4) -> dict[str, np.ndarray]:
    """train and test files; coarse labels differ from fine ones so reading the wrong key shows."""
    folder = root / "cifar-100-python"
    written = {}
    for split, n, seed in (("train", num_train, 1), ("test", num_test, 2)):
        images = random_bytes((n, 3072), seed=seed)
        fine = [(99 - 13 * k - seed) % 100 for k in range(n)]
        coarse = [k % 20 for k in range(n)]
        write_cifar_file(folder / split, images, {b"fine_labels": fine, b"coarse_labels": coarse})
        key = "train" if split == "train" else "val"
        written[f"{key}_images"], written[f"{key}_labels"] = images, np.array(fine)
    return written


# MNIST idx: big-endian header (magic 2051, N, 28, 28 for images; 2049, N for labels), uint8 payload.
def write_idx_images(path: Path, images: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    n, height, width = images.shape
    path.write_bytes(struct.pack(">IIII", 2051, n, height, width) + images.tobytes())


def write_idx_labels(path: Path, labels: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(struct.pack(">II", 2049, len(labels)) + labels.astype(np.uint8).tobytes())


def write_mnist(root: Path, folder: str, seed: int, num_train: int = 6, num_val: int = 5) -> dict:
    """root/<folder>/raw/ with the four uncompressed idx files; returns what was written."""
    raw = root / folder / "raw"
    written = {}
    for prefix, key, n in (("train", "train", num_train), ("t10k", "val", num_val)):
        images = random_bytes((n, 28, 28), seed=seed + n)
        labels = (np.arange(n) * 3 + seed) % 10
        write_idx_images(raw / f"{prefix}-images-idx3-ubyte", images)
        write_idx_labels(raw / f"{prefix}-labels-idx1-ubyte", labels)
        written[f"{key}_images"], written[f"{key}_labels"] = images, labels
    return written


# ImageFolder: root/<split>/<class>/<i>.png, each image one solid colour, distinct per image.
COLOURS = {"cat": (200, 30, 60), "dog": (10, 120, 250), "bird": (90, 90, 90)}


def colour_of(cls: str, i: int) -> tuple[int, int, int]:
    red, green, blue = COLOURS[cls]
    return red, green, blue - 5 * i


def write_image_folder(root: Path, splits: dict[str, dict[str, int]], size: int = 40) -> None:
    from PIL import Image

    for split, classes in splits.items():
        for cls, count in classes.items():
            folder = root / split / cls
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(count):
                Image.new("RGB", (size, size), colour_of(cls, i)).save(folder / f"{i}.png")
