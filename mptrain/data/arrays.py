"""In-memory datasets (:class:`ArrayDataset`): the embedded digits, synthetic data, CIFAR-10/100,
MNIST and Fashion-MNIST read from ``root`` (downloaded only with ``download=true``), their
preprocessing record, and their tensor-fed bundle.
"""

from __future__ import annotations

import json
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mptrain.config.base import ConfigError
from mptrain.config.data import (
    DigitsConfig,
    SyntheticConfig,
    TorchvisionDatasetConfig,
)
from mptrain.data.batches import (
    BatchLayout,
    DataBundle,
    check_batch_size,
    check_labels,
    make_bundle,
    tensors_identity,
)
from mptrain.data.cifarfile import RefusedGlobal, read_cifar_pickle
from mptrain.data.feeds import TensorBatches


# --------------------------------------------------------------------------------------- datasets
@dataclass
class ArrayDataset:
    """A dataset held in memory: NCHW images (uint8 or float32) and int64 labels."""

    train_images: torch.Tensor
    train_labels: torch.Tensor
    val_images: torch.Tensor
    val_labels: torch.Tensor
    num_classes: int
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    classes: list[str] | None = None  # names in label order
    # Set by loaders that transform raw inputs before the feed (digits standardises them): what a
    # user must apply to raw inputs. None: derived from the images' dtype and mean/std.
    preprocessing: dict[str, Any] | None = None


def preprocessing(
    pixel_scale: float,
    mean: tuple[float, ...] | None,
    std: tuple[float, ...] | None,
    shape: tuple[int, int],
    **transforms: Any,
) -> dict[str, Any]:
    """The preprocessing a model's inputs had, in plain types (checkpoints hold it):
    ``x = (raw / pixel_scale - mean[c]) / std[c]`` per channel ``c``, on NCHW float32 inputs of
    ``shape`` = (channels, side); no mean/std: ``x = raw / pixel_scale``. ``transforms``: image
    resizing applied first (imagefolder: ``resize``, ``center_crop``, ``color``)."""
    channels, side = shape
    return {
        "layout": "NCHW",
        "channels": channels,
        "height": side,
        "width": side,
        "pixel_scale": float(pixel_scale),
        "mean": None if mean is None else [float(m) for m in mean],
        "std": None if std is None else [float(s) for s in std],
        "resize": transforms.get("resize"),
        "center_crop": transforms.get("center_crop"),
        "color": transforms.get("color"),
    }


_DIGIT_NAMES = [str(i) for i in range(10)]


def read_digits() -> tuple[np.ndarray, np.ndarray]:
    """(images (1797, 8, 8) float64 of 0..16, labels int64): the file ``load_digits()`` reads,
    found inside the installed scikit-learn without importing it (~0.8 s of every run's start)."""
    import importlib.util

    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            "dataset=digits: reads its file from scikit-learn; pip install scikit-learn"
        )
    csv = Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz"
    data = np.loadtxt(csv, delimiter=",")
    return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(np.int64)


_DIGITS_SPLIT = Path(__file__).with_name("digits_split.json")


def digits_split(labels: np.ndarray, val_size: int, split_seed: int) -> tuple[np.ndarray, ...]:
    """(train indices, validation indices) of scikit-learn's stratified ``train_test_split``.
    The default split (360, seed 0) is stored with mptrain (the same indices, without importing
    scikit-learn); any other asks scikit-learn."""
    stored = json.loads(_DIGITS_SPLIT.read_text())
    if (val_size, split_seed) == (stored["val_size"], stored["split_seed"]):
        return np.array(stored["train"]), np.array(stored["val"])
    from sklearn.model_selection import train_test_split

    train, val = train_test_split(
        np.arange(len(labels)), test_size=val_size, stratify=labels, random_state=split_seed
    )
    return train, val


def load_digits_arrays(cfg: DigitsConfig) -> ArrayDataset:
    """scikit-learn's 8x8 digits with a fixed stratified split, standardised with train statistics."""
    raw_images, labels = read_digits()
    images = raw_images.astype(np.float32) / 16.0
    train, val = digits_split(labels, cfg.val_size, cfg.split_seed)
    x_train, x_val, y_train, y_val = images[train], images[val], labels[train], labels[val]
    mean, std = float(x_train.mean()), float(x_train.std())
    to_tensor = lambda a: torch.from_numpy((a - mean) / std).unsqueeze(1)  # noqa: E731
    return ArrayDataset(
        to_tensor(x_train),
        torch.from_numpy(y_train).long(),
        to_tensor(x_val),
        torch.from_numpy(y_val).long(),
        num_classes=10,
        classes=_DIGIT_NAMES,
        # Raw digits are 0..16 (load_digits().images), standardised above, before the feed.
        preprocessing=preprocessing(16.0, (mean,), (std,), (1, 8)),
    )


def make_synthetic_arrays(cfg: SyntheticConfig) -> ArrayDataset:
    """Class-prototype images: sample = prototype[label] + noise * N(0, 1). Learnable by design."""
    generator = torch.Generator().manual_seed(cfg.data_seed)
    shape = (cfg.channels, cfg.image_size, cfg.image_size)
    prototypes = torch.randn(cfg.num_classes, *shape, generator=generator)

    def sample(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``n`` noisy prototype images and their labels, drawn from the shared generator."""
        labels = torch.randint(0, cfg.num_classes, (n,), generator=generator)
        images = prototypes[labels] + cfg.noise * torch.randn(n, *shape, generator=generator)
        return images, labels

    train_images, train_labels = sample(cfg.num_train)
    val_images, val_labels = sample(cfg.num_val)
    classes = [str(i) for i in range(cfg.num_classes)]
    return ArrayDataset(
        train_images, train_labels, val_images, val_labels, cfg.num_classes, classes=classes
    )


# Published per-channel statistics of the training sets.
_STATS = {
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
    "mnist": ((0.1307,), (0.3081,)),
    "fashion_mnist": ((0.2860,), (0.3530,)),
}
_TORCHVISION_CLASSES = {
    "cifar10": "CIFAR10",
    "cifar100": "CIFAR100",
    "mnist": "MNIST",
    "fashion_mnist": "FashionMNIST",
}
_CIFAR_LAYOUT = {
    # name: (folder, train files, validation files, label key, number of classes)
    "cifar10": (
        "cifar-10-batches-py",
        [f"data_batch_{i}" for i in range(1, 6)],
        ["test_batch"],
        b"labels",
        10,
    ),
    "cifar100": ("cifar-100-python", ["train"], ["test"], b"fine_labels", 100),
}
_MNIST_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "val": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


def _missing(cfg: TorchvisionDatasetConfig, expected: Path) -> ConfigError:
    """The error for a dataset file absent at ``expected``: where to put it, or how to download it."""
    return ConfigError(
        f"dataset.root={cfg.root!r}: {cfg.name} files not found at {expected}; copy them there, "
        f"or run once with dataset.download=true on a machine with internet access"
    )


def _download_if_asked(cfg: TorchvisionDatasetConfig) -> None:
    """Fetch (and checksum) the files into ``cfg.root`` with torchvision, only when the user set
    ``download=true``."""
    if not cfg.download:
        return
    import torchvision

    dataset_class = getattr(torchvision.datasets, _TORCHVISION_CLASSES[cfg.name])
    for train in (True, False):
        dataset_class(cfg.root, train=train, download=True)


def load_cifar_arrays(cfg: TorchvisionDatasetConfig) -> ArrayDataset:
    """CIFAR-10/100 from the python-pickle batches torchvision and the authors distribute."""
    _download_if_asked(cfg)
    folder, train_files, val_files, label_key, num_classes = _CIFAR_LAYOUT[cfg.name]
    base = Path(cfg.root) / folder

    def read(files: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Images (N, 3, 32, 32) uint8 and labels of ``files``, concatenated in that order."""
        images, labels = [], []
        for name in files:
            path = base / name
            if not path.is_file():
                raise _missing(cfg, path)
            try:
                entry = read_cifar_pickle(path)
                images.append(np.asarray(entry[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32))
                labels.extend(entry[label_key])
            except RefusedGlobal as exc:
                raise _refused(cfg, path, exc) from None
            except (pickle.UnpicklingError, EOFError, KeyError, ValueError, TypeError) as exc:
                raise ConfigError(
                    f"dataset.root={cfg.root!r}: {path} is not a readable {cfg.name} batch file "
                    f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else 'truncated'}); "
                    "copy it again, or re-download with dataset.download=true"
                ) from exc
        return torch.from_numpy(np.concatenate(images)), torch.tensor(labels, dtype=torch.long)

    train_images, train_labels = read(train_files)
    val_images, val_labels = read(val_files)
    mean, std = _STATS[cfg.name]
    classes = _cifar_classes(cfg, base)
    return ArrayDataset(
        train_images, train_labels, val_images, val_labels, num_classes, mean, std, classes
    )


_CIFAR10_NAMES = [
    "airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"
]  # fmt: skip


def _refused(cfg: TorchvisionDatasetConfig, path: Path, exc: RefusedGlobal) -> ConfigError:
    """The one-line refusal of a batch file whose pickle names code to run (none of it ran)."""
    return ConfigError(
        f"dataset.root={cfg.root!r}: {path} is not a {cfg.name} batch: {exc}; refused (a CIFAR "
        "batch holds only dicts, lists, bytes, ints and numpy arrays); copy the files again from "
        "the authors or with dataset.download=true"
    )


def _cifar_classes(cfg: TorchvisionDatasetConfig, base: Path) -> list[str] | None:
    """CIFAR-10's names; CIFAR-100's from its ``meta`` file (None when the file is absent or
    unreadable: the names are a convenience). A ``meta`` whose pickle names code is refused."""
    if cfg.name == "cifar10":
        return _CIFAR10_NAMES
    path = base / "meta"
    try:
        return [n.decode() for n in read_cifar_pickle(path)[b"fine_label_names"]]
    except RefusedGlobal as exc:
        raise _refused(cfg, path, exc) from None
    except (OSError, pickle.UnpicklingError, EOFError, KeyError, TypeError, AttributeError):
        return None


def load_mnist_arrays(cfg: TorchvisionDatasetConfig) -> ArrayDataset:
    """MNIST / Fashion-MNIST from the uncompressed idx files in root/<Class>/raw/."""
    from torchvision.datasets.mnist import read_image_file, read_label_file

    _download_if_asked(cfg)
    raw = Path(cfg.root) / _TORCHVISION_CLASSES[cfg.name] / "raw"

    def read(split: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Images (N, 1, 28, 28) uint8 and labels of ``split`` (train | val)."""
        image_file, label_file = (raw / name for name in _MNIST_FILES[split])
        for path in (image_file, label_file):
            if not path.is_file():
                raise _missing(cfg, path)
        images = read_image_file(str(image_file)).unsqueeze(1)
        return images, read_label_file(str(label_file)).long()

    train_images, train_labels = read("train")
    val_images, val_labels = read("val")
    mean, std = _STATS[cfg.name]
    from torchvision.datasets import FashionMNIST

    classes = list(FashionMNIST.classes) if cfg.name == "fashion_mnist" else _DIGIT_NAMES
    return ArrayDataset(train_images, train_labels, val_images, val_labels, 10, mean, std, classes)


def array_bundle(cfg: Any, arrays: ArrayDataset, layout: BatchLayout) -> DataBundle:
    """Tensor-indexed feeds of an in-memory dataset; with ``cfg.augment`` training batches get
    4-pixel crops, and on CIFAR horizontal flips too."""
    check_labels(arrays.train_labels, arrays.num_classes, "training")
    check_labels(arrays.val_labels, arrays.num_classes, "validation")
    num_train, num_val = len(arrays.train_labels), len(arrays.val_labels)
    check_batch_size(layout.batch_size, num_train, "training samples")
    augment = getattr(cfg, "augment", False)
    _, channels, height, _ = arrays.train_images.shape
    bundle = make_bundle(
        TensorBatches,
        (arrays.train_images, arrays.train_labels),
        (arrays.val_images, arrays.val_labels),
        layout,
        (arrays.num_classes, channels, height),
        f"{cfg.name}: {num_train} train / {num_val} val, "
        f"{channels}x{height}x{height}, {arrays.num_classes} classes",
        (
            {"crop_padding": 4 if augment else 0, "flip": augment and cfg.name.startswith("cifar")},
            {},
        ),
        mean=arrays.mean,
        std=arrays.std,
    )
    bundle.classes = arrays.classes
    bundle.identity = tensors_identity(
        arrays.train_images, arrays.train_labels, arrays.val_images, arrays.val_labels
    )
    # uint8 images are scaled to [0, 1] by the feed; float ones are fed as they are.
    scale = 255.0 if arrays.train_images.dtype == torch.uint8 else 1.0
    bundle.preprocessing = arrays.preprocessing or preprocessing(
        scale, arrays.mean, arrays.std, (channels, height)
    )
    return bundle
