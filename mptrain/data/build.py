"""Datasets and how batches reach the model.

Two feeds, chosen by where the data lives:

- :class:`TensorBatches` for data held in memory (digits, synthetic, CIFAR, MNIST, Fashion-MNIST):
  one shuffled index per epoch, batches gathered by tensor indexing, augmentation applied to whole
  batches on the device. No per-sample Python, no worker processes: on small models this is ~1.7x
  faster than a per-sample DataLoader.
- :class:`LoaderBatches` for file-backed data too large for memory (imagefolder): a DataLoader with
  worker processes decoding images, pinned memory and non-blocking copies on CUDA.

``dataset=custom dataset._target_=my_pkg.make_data`` (:func:`load_custom`) takes the user's own
datasets. Contract: ``_target_`` names a callable (built by ``hydra.utils.instantiate`` with the
``+dataset.*`` keys, and ``num_classes`` when it takes it and ``dataset.num_classes`` is set) that
returns ``(train, val)``, two map-style ``torch.utils.data.Dataset`` objects (``__len__`` and
``__getitem__``) whose samples are ``(image, label)``: a float tensor ``C x H x W`` with
``H == W`` (normalised and augmented by the dataset itself: mptrain adds nothing) and an ``int``
label in ``0 .. num_classes-1``. ``num_classes`` is ``dataset.num_classes``, else
``len(train.classes)``. Feed: ``dataset.in_memory=true`` reads every sample once into tensors
(:class:`TensorBatches`); ``false`` serves them through DataLoader workers (:class:`LoaderBatches`,
``num_workers``); ``null`` (default) picks the tensor feed when both sets are
``torch.utils.data.TensorDataset`` (their tensors are used as they are) and the DataLoader
otherwise. The first sample of each set is checked (shape, dtype, label) before training.

Both yield ``(images, labels)`` already on the training device, and are deterministic given
``(seed, epoch)``: the data order of epoch ``e`` does not depend on what ran before it.

Entry point: :func:`build_data` with the dataset config and a :class:`BatchLayout`;
:data:`DATASETS` maps each ``dataset.name`` to its schema and the function that loads it.

Raw files are only read from ``root``; nothing downloads unless ``download=true`` is set. A missing
dataset raises :class:`~mptrain.config.base.ConfigError` naming the path and how to get the files.
"""

from __future__ import annotations

import functools
import json
import numbers
import pickle
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from mptrain.config.data import CustomDatasetConfig, DigitsConfig, ImageFolderConfig, SyntheticConfig, TextDatasetConfig, TorchvisionDatasetConfig
from mptrain.config.base import ConfigError, Option
from mptrain.data.decode import (
    BadDataFile,
    CropSpec,
    DecodeCrop,
    DeviceDecode,
    EncodedImages,
    collate_encoded,
    normalise,
)
from mptrain.platform.hardware import MAX_DEVICE_RESIDENT_BYTES
from mptrain.platform.seeding import AUGMENT_STREAM, ORDER_STREAM, epoch_generator, stream_seed
from mptrain.config.targets import call_target, check_keys, locate, offered
from mptrain.data.text import (
    TextFacts,
    TokenText,
    TrainWindows,
    ValWindows,
    fixed_windows,
    read_text_dataset,
    split_tokens,
    unigram_loss,
)

Batch = tuple[torch.Tensor, torch.Tensor]


class BatchSource(Protocol):
    """What the training loop reads: batches per epoch, their size, and a name for the feed."""

    num_batches: int
    batch_size: int
    feed: str

    def batches(self, epoch: int) -> Iterator[Batch]:
        """This rank's ``(images, labels)`` batches of ``epoch``, on the training device."""
        ...


@dataclass
class DataBundle:
    """Training and validation batches plus the shape facts the model builder needs."""

    train: BatchSource
    val: BatchSource
    num_classes: int
    in_channels: int
    image_size: int
    num_train: int
    num_val: int
    description: str
    # What a user needs to feed new data to a trained model (saved in every checkpoint): the class
    # names in label order, and the preprocessing raw inputs get (see :func:`preprocessing`).
    classes: list[str] | None = None
    preprocessing: dict[str, Any] | None = None
    # Token data (dataset=text): window length and what was read; num_classes is the vocabulary.
    sequence_length: int | None = None
    text: TextFacts | None = None


@dataclass(frozen=True)
class BatchLayout:
    """How the batches are cut and where they go, whatever the dataset.

    ``batch_size`` for training (full batches only), ``eval_batch_size`` for validation; ``seed``
    fixes the training order and augmentation; ``num_workers`` serves file-backed data; this process
    is rank ``rank`` of ``world`` and gets its own shard.
    """

    batch_size: int
    eval_batch_size: int
    device: torch.device
    seed: int
    num_workers: int
    rank: int = 0
    world: int = 1
    sequence_length: int | None = None  # token data: the window length (the model's block_size)


# ------------------------------------------------------------------------------------------ feeds
def shard_length(n: int, rank: int, world: int, drop_uneven: bool) -> int:
    """Samples rank ``rank`` gets of ``n``; with ``drop_uneven`` every rank gets the same count."""
    if drop_uneven:
        return n // world
    return len(range(rank, n, world))


def batch_count(n: int, batch_size: int, rank: int, world: int, drop_last: bool) -> int:
    """Batches per epoch of this rank's shard: full batches only with ``drop_last``."""
    shard = shard_length(n, rank, world, drop_uneven=drop_last)
    return shard // batch_size if drop_last else -(-shard // batch_size)


def epoch_indices(
    n: int,
    shuffle: bool,
    seed: int,
    epoch: int,
    rank: int = 0,
    world: int = 1,
    drop_uneven: bool = True,
) -> torch.Tensor:
    """This rank's sample indices for ``epoch``: its stride of the epoch's permutation.

    Ranks never overlap; with ``drop_uneven`` (training) the permutation is cut to a multiple of
    the world size so every rank runs the same number of steps.
    """
    order = (
        torch.randperm(n, generator=epoch_generator(seed, epoch, ORDER_STREAM))
        if shuffle
        else torch.arange(n)
    )
    if world > 1:
        if drop_uneven:
            order = order[: (n // world) * world]
        order = order[rank::world]
    return order


def random_crop_flip(
    images: torch.Tensor, padding: int, flip: bool, generator: torch.Generator
) -> torch.Tensor:
    """Batched augmentation: a random crop of each zero-padded image, and a random horizontal flip."""
    batch, _, height, width = images.shape
    device = images.device
    if padding:
        padded = torch.nn.functional.pad(images, (padding, padding, padding, padding))
        dy = torch.randint(0, 2 * padding + 1, (batch,), device=device, generator=generator)
        dx = torch.randint(0, 2 * padding + 1, (batch,), device=device, generator=generator)
        rows = (dy[:, None] + torch.arange(height, device=device))[:, None, :, None]
        cols = (dx[:, None] + torch.arange(width, device=device))[:, None, None, :]
        channels = torch.arange(images.shape[1], device=device)[None, :, None, None]
        samples = torch.arange(batch, device=device)[:, None, None, None]
        images = padded[samples, channels, rows, cols]
    if flip:
        mask = torch.rand(batch, device=device, generator=generator) < 0.5
        images = torch.where(mask[:, None, None, None], images.flip(-1), images)
    return images


class TensorBatches:
    """Batches by indexing in-memory tensors.

    ``images`` may be uint8 (scaled to [0, 1] per batch) or float; ``mean``/``std`` normalise
    per channel. With ``shuffle`` and ``drop_last`` every epoch is a fresh permutation and only
    full batches are served.
    """

    def __init__(  # noqa: PLR0913 (a constructor: the feed's settings, named)
        self,
        images: torch.Tensor,
        labels: torch.Tensor,
        batch_size: int,
        device: torch.device,
        *,
        shuffle: bool,
        drop_last: bool,
        seed: int = 0,
        mean: tuple[float, ...] | None = None,
        std: tuple[float, ...] | None = None,
        crop_padding: int = 0,
        flip: bool = False,
        rank: int = 0,
        world: int = 1,
    ) -> None:
        self.device = device
        self.rank, self.world = rank, world
        resident = device.type == "cuda" and images.nbytes <= MAX_DEVICE_RESIDENT_BYTES
        storage = device if resident else torch.device("cpu")
        if device.type == "cuda" and not resident:
            images, labels = images.pin_memory(), labels.pin_memory()
        self.images = images.to(storage)
        self.labels = labels.to(storage)
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.seed = seed
        shape = (1, -1, 1, 1)
        self.mean = torch.tensor(mean, device=device).view(shape) if mean else None
        self.std = torch.tensor(std, device=device).view(shape) if std else None
        self.crop_padding = crop_padding
        self.flip = flip
        self.num_batches = batch_count(len(self.labels), batch_size, rank, world, drop_last)
        where = "on the GPU" if resident else "in host memory"
        self.feed = f"tensor-indexed ({where})"

    def __len__(self) -> int:
        """Batches per epoch."""
        return self.num_batches

    def _prepare(self, images: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        """On the device, as float in [0, 1]; augmented when a generator is given; normalised."""
        images = images.to(self.device, non_blocking=True)
        if images.dtype == torch.uint8:
            images = images.float().div_(255)
        if generator is not None and (self.crop_padding or self.flip):
            images = random_crop_flip(images, self.crop_padding, self.flip, generator)
        if self.mean is not None:
            images = (images - self.mean) / self.std
        return images

    def batches(self, epoch: int) -> Iterator[Batch]:
        """This rank's batches of ``epoch``: shuffled and augmented when training, else in order."""
        storage = self.images.device
        generator = None
        if self.shuffle:
            # Per-rank augmentation stream: ranks see different samples, so different crops.
            generator = epoch_generator(self.seed + self.rank, epoch, AUGMENT_STREAM, self.device)
        sharded = self.shuffle or self.world > 1
        if sharded:
            order = epoch_indices(
                len(self.labels),
                self.shuffle,
                self.seed,
                epoch,
                self.rank,
                self.world,
                self.drop_last,
            ).to(storage)
        for b in range(self.num_batches):
            window = slice(b * self.batch_size, (b + 1) * self.batch_size)
            if sharded:
                index = order[window]
                images, labels = self.images[index], self.labels[index]
            else:  # contiguous slices: no gather needed
                images, labels = self.images[window], self.labels[window]
            yield self._prepare(images, generator), labels.to(self.device, non_blocking=True)


def collate_samples(samples: list[Any]) -> tuple[Any, Any, int]:
    """The default collation of the samples that decoded, and how many were None (files that did
    not decode under ``skip_bad_files``)."""
    good = [s for s in samples if s is not None]
    images, labels = torch.utils.data.default_collate(good) if good else (None, None)
    return images, labels, len(samples) - len(good)


class ToDevice:
    """A collated batch to ``device`` as it is (custom datasets: their own preprocessing)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __call__(self, images: Any, labels: Any, epoch: int) -> tuple[Any, Any, int]:
        """(images, labels) on the device; nothing dropped."""
        del epoch  # the batch is complete: nothing here depends on the epoch
        to = {"device": self.device, "non_blocking": True}
        return images.to(**to), labels.to(**to), 0


class NormaliseOnDevice(ToDevice):
    """uint8 crops from the workers to normalised float on ``device``: a quarter of the bytes
    through shared and pinned memory, and one batched operation instead of one per sample."""

    def __init__(self, device: torch.device, mean: tuple[float, ...], std: tuple[float, ...]):
        super().__init__(device)
        self.mean = torch.tensor(mean, device=device).view(1, -1, 1, 1)
        self.std = torch.tensor(std, device=device).view(1, -1, 1, 1)

    def __call__(self, images: Any, labels: Any, epoch: int) -> tuple[Any, Any, int]:
        """(normalised images, labels) on the device; nothing dropped."""
        images, labels, _ = super().__call__(images, labels, epoch)
        return normalise(images, self.mean, self.std), labels, 0


class EpochSampler(torch.utils.data.Sampler):
    """The sample order of the epoch being served, set before each epoch in the main process
    (where a DataLoader draws its indices, persistent workers or not). With ``keyed`` it yields
    ``(epoch, index)``: the epoch reaches the workers with every index, so a dataset copied into
    workers once (``persistent_workers``) still seeds each sample by its epoch."""

    def __init__(self, keyed: bool) -> None:
        self.keyed = keyed
        self.epoch, self.indices = 0, []

    def __len__(self) -> int:
        return len(self.indices)

    def __iter__(self) -> Iterator[Any]:
        if self.keyed:
            return iter([(self.epoch, index) for index in self.indices])
        return iter(self.indices)


@dataclass(frozen=True)
class LoaderPlan:
    """How a :class:`LoaderBatches` serves its dataset: ``persistent`` workers (kept across
    epochs), ``keyed`` indices (:class:`EpochSampler`), the worker-side ``collate`` (samples ->
    (payload, labels, dropped)) and the main-process ``finish`` ((payload, labels, epoch) ->
    (images, labels, dropped) on the device; None: :class:`ToDevice`), and the facts the report
    records about it."""

    persistent: bool = False
    keyed: bool = False
    collate: Callable[[list[Any]], tuple[Any, Any, int]] = collate_samples
    finish: Callable[[Any, Any, int], tuple[Any, Any, int]] | None = None
    facts: dict[str, Any] | None = None


class LoaderBatches:
    """Batches from a DataLoader with worker processes (file-backed data)."""

    def __init__(  # noqa: PLR0913 (a constructor: the feed's settings, named)
        self,
        dataset: torch.utils.data.Dataset,
        batch_size: int,
        device: torch.device,
        *,
        shuffle: bool,
        drop_last: bool,
        num_workers: int,
        seed: int = 0,
        rank: int = 0,
        world: int = 1,
        plan: LoaderPlan | None = None,
    ) -> None:
        self.dataset = dataset
        self.rank, self.world = rank, world
        self.device = device
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.num_workers = num_workers
        self.seed = seed
        self.plan = plan = plan or LoaderPlan()
        self.persistent = plan.persistent and num_workers > 0  # no workers: nothing to keep
        self.finish = plan.finish or ToDevice(device)
        self.sampler = EpochSampler(plan.keyed)
        self.loader: torch.utils.data.DataLoader | None = None
        self.num_batches = batch_count(len(dataset), batch_size, rank, world, drop_last)  # type: ignore[arg-type]
        kept = "persistent " if self.persistent else ""
        self.feed = f"DataLoader ({num_workers} {kept}workers)"
        # skip_bad_files: samples dropped because their file did not decode, counted each time
        # one is read (every epoch and evaluation that reads it).
        self.bad_files = 0

    def __len__(self) -> int:
        """Batches per epoch."""
        return self.num_batches

    @property
    def pipeline(self) -> dict[str, Any] | None:
        """What this feed runs (the report's data facts), with counts kept by the finish step."""
        if self.plan.facts is None:
            return None
        counts = (
            {"host_decoded": self.finish.host_decoded}
            if hasattr(self.finish, "host_decoded")
            else {}
        )
        return {**self.plan.facts, "persistent_workers": self.persistent, **counts}

    def _loader(self) -> torch.utils.data.DataLoader:
        """The DataLoader: the one kept with persistent workers, else a fresh one per epoch."""
        if self.loader is not None:
            return self.loader
        loader = torch.utils.data.DataLoader(
            self.dataset,
            batch_size=self.batch_size,
            sampler=self.sampler,  # this rank's order for the epoch being served
            drop_last=self.drop_last,
            num_workers=self.num_workers,
            pin_memory=self.device.type == "cuda" and not isinstance(self.finish, DeviceDecode),
            persistent_workers=self.persistent,
            collate_fn=self.plan.collate,
        )
        if self.persistent:
            self.loader = loader
        return loader

    def batches(self, epoch: int) -> Iterator[Batch]:
        """This rank's batches of ``epoch``, decoded by the DataLoader's workers."""
        seeded = self.dataset.dataset if isinstance(self.dataset, SkipBadFiles) else self.dataset
        if isinstance(seeded, SeededTransforms):
            seeded.epoch = epoch  # unkeyed use: before a fresh loader copies it into workers
        self.sampler.epoch = epoch
        self.sampler.indices = epoch_indices(
            len(self.dataset), self.shuffle, self.seed, epoch, self.rank, self.world, self.drop_last
        ).tolist()
        for payload, labels, bad in self._loader():
            images, dropped = None, 0
            if payload is not None:
                images, labels, dropped = self.finish(payload, labels, epoch)
            self.bad_files += bad + dropped
            if images is None:  # skipping the batch would shorten the epoch: stop instead
                raise BadDataFile(f"every file of a batch of {bad + dropped} failed to decode")
            yield images, labels


class SeededTransforms(torch.utils.data.Dataset):
    """Applies a random transform with a seed fixed by (seed, epoch, sample index).

    Augmentation is then the same with or without worker processes and whatever else consumed
    torch's global RNG; the global RNG state is restored after each sample.
    """

    def __init__(self, dataset: Any, transform: Any, seed: int) -> None:
        self.dataset = dataset
        self.transform = transform
        self.seed = seed
        self.epoch = 0

    def __len__(self) -> int:
        """Samples in the wrapped dataset."""
        return len(self.dataset)

    def __getitem__(self, key: int | tuple[int, int]) -> tuple[Any, int]:
        """Sample ``index`` transformed with its own (seed, epoch, index) seed, and its label.

        ``key``: ``(epoch, index)`` (:class:`EpochSampler`, persistent workers), or ``index`` of
        the epoch last set in ``self.epoch``."""
        epoch, index = key if isinstance(key, tuple) else (self.epoch, key)
        image, label = self.dataset[index]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(stream_seed(self.seed, epoch, AUGMENT_STREAM, index))
            return self.transform(image), label


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


# What a dataset's loader returns, from its config: in-memory arrays or image folders.
DatasetLoader = Callable[[Any], "ArrayDataset | FolderDataset | CustomDataset"]


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

    indices = np.arange(len(labels))
    train, val = train_test_split(
        indices, test_size=val_size, stratify=labels, random_state=split_seed
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


def _download(cfg: TorchvisionDatasetConfig) -> None:
    """Fetch (and checksum) the files with torchvision; only when the user set download=true."""
    import torchvision

    dataset_class = getattr(torchvision.datasets, _TORCHVISION_CLASSES[cfg.name])
    for train in (True, False):
        dataset_class(cfg.root, train=train, download=True)


def load_cifar_arrays(cfg: TorchvisionDatasetConfig) -> ArrayDataset:
    """CIFAR-10/100 from the python-pickle batches torchvision and the authors distribute."""
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
                with path.open("rb") as f:
                    entry = pickle.load(f, encoding="bytes")
                images.append(np.asarray(entry[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32))
                labels.extend(entry[label_key])
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
    classes = _cifar_classes(base, cfg.name)
    return ArrayDataset(
        train_images, train_labels, val_images, val_labels, num_classes, mean, std, classes
    )


_CIFAR10_NAMES = [
    "airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"
]  # fmt: skip


def _cifar_classes(base: Path, name: str) -> list[str] | None:
    """CIFAR-10's names; CIFAR-100's from its ``meta`` file (None when the file is absent)."""
    if name == "cifar10":
        return _CIFAR10_NAMES
    try:
        with (base / "meta").open("rb") as f:
            return [n.decode() for n in pickle.load(f, encoding="bytes")[b"fine_label_names"]]
    except (OSError, pickle.UnpicklingError, EOFError, KeyError, TypeError, AttributeError):
        return None


def load_mnist_arrays(cfg: TorchvisionDatasetConfig) -> ArrayDataset:
    """MNIST / Fashion-MNIST from the uncompressed idx files in root/<Class>/raw/."""
    from torchvision.datasets.mnist import read_image_file, read_label_file

    raw = Path(cfg.root) / _TORCHVISION_CLASSES[cfg.name] / "raw"

    def read(split: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Images (N, 1, 28, 28) uint8 and labels of ``split`` (train | val)."""
        image_file, label_file = (raw / name for name in _MNIST_FILES[split])
        for path in (image_file, label_file):
            if not path.is_file():
                raise _missing(cfg, path)
        return read_image_file(str(image_file)).unsqueeze(1), read_label_file(
            str(label_file)
        ).long()

    train_images, train_labels = read("train")
    val_images, val_labels = read("val")
    mean, std = _STATS[cfg.name]
    from torchvision.datasets import FashionMNIST

    classes = list(FashionMNIST.classes) if cfg.name == "fashion_mnist" else _DIGIT_NAMES
    return ArrayDataset(train_images, train_labels, val_images, val_labels, 10, mean, std, classes)


def _with_download(read: Callable[[TorchvisionDatasetConfig], ArrayDataset]) -> DatasetLoader:
    """``read`` preceded by torchvision's download when the config sets ``download=true``."""

    def load(cfg: TorchvisionDatasetConfig) -> ArrayDataset:
        """Download the files into ``cfg.root`` if asked to, then read them from there."""
        if cfg.download:
            _download(cfg)
        return read(cfg)

    return load


# ----------------------------------------------------------------------------------- imagefolder
_IMAGENET_MEAN, _IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


@dataclass
class FolderDataset:
    """A file-backed dataset: torchvision ImageFolders whose samples are file paths.

    ``train`` has no transform of its own: :func:`build_data` wraps it with ``train_transform``
    seeded per (seed, epoch, sample), or reads its bytes for device decoding. ``val`` carries its
    deterministic evaluation transform (used by the CPU pipeline).
    """

    train: Any  # torchvision.datasets.ImageFolder
    val: Any  # torchvision.datasets.ImageFolder
    train_transform: Any


def _crop_specs(cfg: ImageFolderConfig) -> tuple[CropSpec, CropSpec]:
    """(train, val) crops: resize + centre crop for validation; a random resized crop and
    horizontal flip for training when ``augment``, else the validation crop."""
    val = CropSpec(cfg.image_size, cfg.resize_size, random=False)
    train = CropSpec(cfg.image_size, cfg.resize_size, random=True) if cfg.augment else val
    return train, val


def _imagefolder_transforms(cfg: ImageFolderConfig) -> tuple[DecodeCrop, DecodeCrop]:
    """(train, val) transforms of the CPU pipeline: a file path to a uint8 crop (decoded at
    reduced size with ``decode_draft``); the feed normalises with the ImageNet statistics."""
    train, val = _crop_specs(cfg)
    return DecodeCrop(train, cfg.decode_draft), DecodeCrop(val, cfg.decode_draft)


def load_image_folders(cfg: ImageFolderConfig) -> FolderDataset:
    """root/<train_dir>/<class>/<image> and root/<val_dir>/...; ConfigError when a split is
    missing, holds no class folders or images, or the two splits hold different classes."""
    from torchvision import datasets

    root = Path(cfg.root)
    for split in (cfg.train_dir, cfg.val_dir):
        if not (root / split).is_dir():
            raise ConfigError(
                f"dataset.root={cfg.root!r}: no directory {root / split} "
                "(expected root/<split>/<class>/<image> folders)"
            )
    train_transform, val_transform = _imagefolder_transforms(cfg)
    try:
        # loader=str: samples stay paths; the transform (or the device pipeline) decodes them.
        train_folder = datasets.ImageFolder(str(root / cfg.train_dir), loader=str)
        val_set = datasets.ImageFolder(str(root / cfg.val_dir), transform=val_transform, loader=str)
    except FileNotFoundError as exc:  # a split without class folders or without images
        raise ConfigError(f"dataset.root={cfg.root!r}: {exc}") from exc
    if train_folder.classes != val_set.classes:
        raise ConfigError(
            f"dataset.root={cfg.root!r}: {cfg.train_dir}/ and {cfg.val_dir}/ hold different classes"
        )
    return FolderDataset(train_folder, val_set, train_transform)


class SkipBadFiles(torch.utils.data.Dataset):
    """``dataset.skip_bad_files=true``: a sample whose file does not decode becomes None, which
    :func:`collate_samples` drops and counts."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        try:
            return self.dataset[index]
        except BadDataFile:
            return None

    def __getattr__(self, name: str) -> Any:  # epoch, classes, ... of the wrapped dataset
        if name == "dataset":
            raise AttributeError(name)
        return getattr(self.dataset, name)


# ---------------------------------------------------------------------------------------- custom
@dataclass
class CustomDataset:
    """A user's ``(train, val)`` datasets (see the module doc for the contract), checked."""

    train: Any  # torch.utils.data.Dataset
    val: Any
    num_classes: int
    sample_shape: tuple[int, int, int]  # C, H, W of every image
    in_memory: bool  # the tensor feed (True) or DataLoader workers (False)
    target: str


def load_custom(cfg: CustomDatasetConfig) -> CustomDataset:
    """Call ``dataset._target_`` and check what it returns; ConfigError naming the key."""
    key, target = "dataset._target_", cfg._target_
    factory = locate(key, target)
    facts = {"num_classes": cfg.num_classes} if cfg.num_classes is not None else {}
    kwargs = offered(factory, dict(cfg.kwargs), facts)
    check_keys(key, target, factory, kwargs)
    result = call_target(key, target, kwargs)
    if not (isinstance(result, tuple | list) and len(result) == 2 and all(map(_map_style, result))):
        raise ConfigError(
            f"{key}={target!r}: returned a {type(result).__name__}; expected a (train, val) pair "
            "of torch.utils.data.Dataset objects with __len__ and __getitem__"
        )
    train, val = result
    num_classes = _custom_num_classes(cfg, train)
    shape = _check_sample(key, target, train, "training", num_classes)
    val_shape = _check_sample(key, target, val, "validation", num_classes)
    if val_shape != shape:
        raise ConfigError(
            f"{key}={target!r}: training images are {_side(shape)} but validation images "
            f"{_side(val_shape)}; both sets must hold images of one shape"
        )
    tensors = all(isinstance(d, torch.utils.data.TensorDataset) for d in result)
    in_memory = tensors if cfg.in_memory is None else cfg.in_memory
    return CustomDataset(train, val, num_classes, shape, in_memory, target)


def _map_style(dataset: Any) -> bool:
    return hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")


def _side(shape: tuple[int, ...]) -> str:
    return "x".join(map(str, shape))


def _custom_num_classes(cfg: CustomDatasetConfig, train: Any) -> int:
    """``dataset.num_classes``, else ``len(train.classes)``; ConfigError when neither is there."""
    if cfg.num_classes is not None:
        return cfg.num_classes
    classes = getattr(train, "classes", None)
    if classes is None or len(classes) < 2:
        raise ConfigError(
            f"dataset.num_classes: not set, and the training set of {cfg._target_} has no "
            "'classes' attribute listing at least 2 classes; set +dataset.num_classes=N"
        )
    return len(classes)


def _check_sample(
    key: str, target: str, dataset: Any, split: str, num_classes: int
) -> tuple[int, int, int]:
    """The (C, H, W) of ``dataset[0]``; ConfigError unless it is ``(float CxHxW tensor with
    H == W, int label in range)``."""
    if len(dataset) == 0:
        raise ConfigError(f"{key}={target!r}: the {split} set is empty")
    sample = dataset[0]
    where = f"{key}={target!r}: {split} sample 0"
    if not (isinstance(sample, tuple | list) and len(sample) == 2):
        raise ConfigError(f"{where} is a {type(sample).__name__}; expected (image, label)")
    image, label = sample
    if not (isinstance(image, torch.Tensor) and image.dim() == 3 and image.is_floating_point()):
        what = (
            f"a {tuple(image.shape)} {image.dtype} tensor"
            if isinstance(image, torch.Tensor)
            else (f"a {type(image).__name__}")
        )
        raise ConfigError(f"{where}: the image is {what}; expected a float C x H x W tensor")
    if image.shape[1] != image.shape[2]:
        raise ConfigError(f"{where}: the image is {_side(tuple(image.shape))}; expected H == W")
    # Python and NumPy integers, 0-d integer tensors; not bools, not floats.
    is_int = (isinstance(label, numbers.Integral) and not isinstance(label, bool)) or (
        isinstance(label, torch.Tensor) and label.dim() == 0 and not label.is_floating_point()
    )
    if not is_int or not 0 <= int(label) < num_classes:
        raise ConfigError(
            f"{where}: the label is {label!r}; expected an int in 0..{num_classes - 1}"
        )
    return tuple(image.shape)  # type: ignore[return-value]


def _as_tensors(dataset: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(images, int64 labels) of a dataset held in memory: a TensorDataset's own tensors, or
    every sample read once."""
    if isinstance(dataset, torch.utils.data.TensorDataset) and len(dataset.tensors) == 2:
        images, labels = dataset.tensors
        return images, labels.long()
    samples = [dataset[i] for i in range(len(dataset))]
    images = torch.stack([image for image, _ in samples])
    return images, torch.tensor([int(label) for _, label in samples], dtype=torch.long)


def _custom_bundle(
    cfg: CustomDatasetConfig, data: CustomDataset, layout: BatchLayout
) -> DataBundle:
    """The tensor feed (``data.in_memory``) or DataLoader workers over the user's datasets."""
    channels, side, _ = data.sample_shape
    description = (
        f"custom {data.target}: {len(data.train)} train / {len(data.val)} val, "
        f"{channels}x{side}x{side}, {data.num_classes} classes"
    )
    if data.in_memory:
        arrays = ArrayDataset(*_as_tensors(data.train), *_as_tensors(data.val), data.num_classes)
        bundle = _array_bundle(cfg, arrays, layout)
    else:
        _check_batch_size(layout.batch_size, len(data.train), "training samples")
        bundle = _custom_loader_bundle(data, layout)
    bundle.description = description
    bundle.classes = _custom_class_names(data)
    return bundle


def _custom_class_names(data: CustomDataset) -> list[str] | None:
    """The training set's ``classes`` (checkpoints keep them), when it names every class."""
    classes = getattr(data.train, "classes", None)
    if isinstance(classes, list | tuple) and len(classes) == data.num_classes:
        return [str(c) for c in classes]
    return None


def _custom_loader_bundle(data: CustomDataset, layout: BatchLayout) -> DataBundle:
    """DataLoader workers over the user's datasets (preprocessing is the datasets' own)."""
    channels, side, _ = data.sample_shape
    return _bundle(
        LoaderBatches,
        (data.train,),
        (data.val,),
        layout,
        (data.num_classes, channels, side),
        "",
        ({}, {}),
        num_workers=layout.num_workers,
    )


# ------------------------------------------------------------------------------------------- text
def load_text(cfg: TextDatasetConfig) -> TokenText:
    """The text ``dataset.path`` names (default: the standard library's sources), tokenised."""
    try:
        return read_text_dataset(
            cfg.path, cfg.max_bytes, cfg.suffix, cfg.vocabulary, cfg.val_fraction
        )
    except (FileNotFoundError, NotADirectoryError, PermissionError) as exc:
        where = cfg.path or "the standard library"
        raise ConfigError(f"dataset.path={where!r}: {exc}") from exc


def _text_bundle(cfg: TextDatasetConfig, text: TokenText, layout: BatchLayout) -> DataBundle:
    """Random training windows and fixed validation windows of ``layout.sequence_length``
    tokens, with the unigram baseline of the split."""
    block = layout.sequence_length
    if block is None:
        raise ConfigError("dataset=text: needs a language model (task=lm model=gpt)")
    try:
        split = split_tokens(text.tokens, cfg.val_fraction, block)
    except ValueError as exc:
        raise ConfigError(f"dataset.max_bytes={cfg.max_bytes}: {exc}") from exc
    where = {"rank": layout.rank, "world": layout.world}
    train = TrainWindows(
        split.train, block, layout.batch_size, layout.device, seed=layout.seed, **where
    )
    if train.num_batches < 1:
        raise ConfigError(
            f"batch_size={layout.batch_size}: one batch needs more than the "
            f"{len(split.train) // block} windows of {block} tokens the training text holds"
        )
    val = ValWindows(
        split.val, block, cfg.val_windows, layout.eval_batch_size, layout.device, **where
    )
    vocab = text.vocabulary
    facts = TextFacts(
        text.corpus,
        vocab,
        block,
        len(split.train),
        len(split.val),
        val.windows,
        # On the very tokens the validation loss is measured on.
        unigram_loss(split.train, fixed_windows(split.val, block, cfg.val_windows)[1], vocab.size),
    )
    kind = "bytes" if vocab.chars is None else f"{vocab.size} characters"
    return DataBundle(
        train=train,
        val=val,
        num_classes=vocab.size,
        in_channels=0,
        image_size=0,
        num_train=len(split.train) // block,
        num_val=val.windows,
        description=f"text: {text.corpus.files} files, {len(split.train)} train / "
        f"{len(split.val)} val tokens ({kind}), windows of {block}",
        sequence_length=block,
        text=facts,
    )


# ------------------------------------------------------------------------------------ entry point
# The one list of datasets: dataset.name -> its schema and the function that loads it. Each name
# is also an option file conf/dataset/<name>.yaml (a test keeps the two in step). ArrayDataset
# results are fed from memory, FolderDataset results from files.
DATASETS: dict[str, Option] = {
    "digits": Option(DigitsConfig, load_digits_arrays),
    "synthetic": Option(SyntheticConfig, make_synthetic_arrays),
    "cifar10": Option(TorchvisionDatasetConfig, _with_download(load_cifar_arrays)),
    "cifar100": Option(TorchvisionDatasetConfig, _with_download(load_cifar_arrays)),
    "mnist": Option(TorchvisionDatasetConfig, _with_download(load_mnist_arrays)),
    "fashion_mnist": Option(TorchvisionDatasetConfig, _with_download(load_mnist_arrays)),
    "imagefolder": Option(ImageFolderConfig, load_image_folders),
    "custom": Option(CustomDatasetConfig, load_custom),
    "text": Option(TextDatasetConfig, load_text),
}


def load_dataset(cfg: Any) -> ArrayDataset | FolderDataset | CustomDataset:
    """Load the dataset ``cfg.name`` names, through :data:`DATASETS`."""
    option = DATASETS.get(cfg.name)
    if option is None:
        raise ConfigError(f"dataset.name={cfg.name!r}: one of {', '.join(DATASETS)}")
    return option.build(cfg)


def build_data(cfg: Any, layout: BatchLayout) -> DataBundle:
    """Load the configured dataset and wrap it in the feed that suits it: in-memory tensors for an
    :class:`ArrayDataset`, a DataLoader for a :class:`FolderDataset`. ConfigError for missing
    files, labels outside the classes, or a training set smaller than one batch."""
    dataset = load_dataset(cfg)
    if isinstance(dataset, FolderDataset):
        return _folder_bundle(cfg, dataset, layout)
    if isinstance(dataset, CustomDataset):
        return _custom_bundle(cfg, dataset, layout)
    if isinstance(dataset, TokenText):
        return _text_bundle(cfg, dataset, layout)
    return _array_bundle(cfg, dataset, layout)


def _check_labels(labels: torch.Tensor, num_classes: int, where: str) -> None:
    """ConfigError unless every label lies in 0..num_classes-1."""
    if len(labels) and (labels.min() < 0 or labels.max() >= num_classes):
        raise ConfigError(
            f"dataset: {where} labels span {int(labels.min())}..{int(labels.max())}, "
            f"outside 0..{num_classes - 1}"
        )


def _check_batch_size(batch_size: int, available: int, what: str) -> None:
    """ConfigError when one training batch needs more than the ``available`` ``what``."""
    if available < batch_size:
        raise ConfigError(f"batch_size={batch_size}: larger than the {available} {what}")


def _array_bundle(cfg: Any, arrays: ArrayDataset, layout: BatchLayout) -> DataBundle:
    """Tensor-indexed feeds of an in-memory dataset; with ``cfg.augment`` training batches get
    4-pixel crops, and on CIFAR horizontal flips too."""
    _check_labels(arrays.train_labels, arrays.num_classes, "training")
    _check_labels(arrays.val_labels, arrays.num_classes, "validation")
    num_train, num_val = len(arrays.train_labels), len(arrays.val_labels)
    _check_batch_size(layout.batch_size, num_train, "training samples")
    augment = getattr(cfg, "augment", False)
    _, channels, height, _ = arrays.train_images.shape
    bundle = _bundle(
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
    # uint8 images are scaled to [0, 1] by the feed; float ones are fed as they are.
    scale = 255.0 if arrays.train_images.dtype == torch.uint8 else 1.0
    bundle.preprocessing = arrays.preprocessing or preprocessing(
        scale, arrays.mean, arrays.std, (channels, height)
    )
    return bundle


def _folder_bundle(
    cfg: ImageFolderConfig, folders: FolderDataset, layout: BatchLayout
) -> DataBundle:
    """DataLoader feeds of an image folder, decoded as ``dataset.decode_device`` says."""
    if cfg.decode_device == "cuda":
        train_set, val_set, plans = _device_decode_sets(cfg, folders, layout)
    else:
        train_set = SeededTransforms(folders.train, folders.train_transform, layout.seed)
        val_set = folders.val
        plans = _cpu_decode_plans(cfg, layout)
    if cfg.skip_bad_files:
        train_set, val_set = SkipBadFiles(train_set), SkipBadFiles(val_set)
    _check_batch_size(layout.batch_size, len(train_set), "training images")
    num_classes = len(folders.train.classes)
    bundle = _bundle(
        LoaderBatches,
        (train_set,),
        (val_set,),
        layout,
        (num_classes, 3, cfg.image_size),
        f"imagefolder {Path(cfg.root)}: {len(train_set)} train / {len(folders.val)} val, "
        f"{num_classes} classes, {cfg.image_size} px crops",
        ({"plan": plans[0]}, {"plan": plans[1]}),
        num_workers=layout.num_workers,
    )
    for source in (bundle.train, bundle.val):
        source.feed += f": {_pipeline_words(source.pipeline)}"  # type: ignore[attr-defined]
    bundle.classes = list(folders.train.classes)  # the class folders' names, sorted
    bundle.preprocessing = preprocessing(
        255.0,  # ToTensor's scaling of 8-bit RGB
        _IMAGENET_MEAN,
        _IMAGENET_STD,
        (3, cfg.image_size),
        resize=cfg.resize_size,
        center_crop=cfg.image_size,
        color="RGB",
    )
    return bundle


def _pipeline_words(facts: dict[str, Any]) -> str:
    """The feed's one-line description of what decodes: ``PIL in the workers (draft decode on),
    normalised on cuda:0``."""
    if facts["decode_device"] == "cpu":
        draft = "on" if facts["draft"] else "off"
        return f"PIL in the workers (draft decode {draft}), normalised on {facts['normalised_on']}"
    return (
        f"workers read bytes; JPEG decoded, cropped and normalised on {facts['normalised_on']} "
        "(torchvision.io.decode_jpeg, transforms.v2); other formats decoded by the workers"
    )


def _cpu_decode_plans(cfg: ImageFolderConfig, layout: BatchLayout) -> tuple[LoaderPlan, ...]:
    """(train, val) plans of the CPU pipeline: persistent workers, keyed training indices, uint8
    crops normalised on the training device."""
    facts = {
        "decode_device": "cpu",
        "decoder": "PIL",
        "draft": cfg.decode_draft,
        "normalised_on": str(layout.device),
    }
    finish = NormaliseOnDevice(layout.device, _IMAGENET_MEAN, _IMAGENET_STD)
    train = LoaderPlan(persistent=True, keyed=True, finish=finish, facts=facts)
    return train, LoaderPlan(persistent=True, finish=finish, facts=facts)


def _device_decode_sets(
    cfg: ImageFolderConfig, folders: FolderDataset, layout: BatchLayout
) -> tuple[Any, Any, tuple[LoaderPlan, ...]]:
    """(train set, val set, their plans) of device decoding; ConfigError unless the run trains
    on a CUDA device (``mptrain.data.decode`` runs on any device; only the tests use it on the CPU)."""
    _check_decode_device(layout.device)
    facts = {
        "decode_device": "cuda",
        "decoder": "torchvision.io.decode_jpeg",
        "draft": None,  # nvJPEG decodes full size
        "normalised_on": str(layout.device),
    }
    train_spec, val_spec = _crop_specs(cfg)
    seed_of = functools.partial(_sample_seed, layout.seed)
    plans = tuple(
        LoaderPlan(
            persistent=True,
            collate=collate_encoded,
            finish=DeviceDecode(
                spec, layout.device, _IMAGENET_MEAN, _IMAGENET_STD, seed_of, cfg.skip_bad_files
            ),
            facts=facts,
        )
        for spec in (train_spec, val_spec)
    )
    return EncodedImages(folders.train), EncodedImages(folders.val), plans


def _sample_seed(seed: int, epoch: int, index: int) -> int:
    """Sample ``index``'s augmentation seed in ``epoch``: the one SeededTransforms uses."""
    return stream_seed(seed, epoch, AUGMENT_STREAM, index)


def _check_decode_device(device: torch.device) -> None:
    """ConfigError unless ``dataset.decode_device=cuda`` can run: a CUDA device trains."""
    accepted = "cpu (PIL in the DataLoader workers), or cuda when the run trains on a CUDA GPU"
    if not torch.cuda.is_available():
        raise ConfigError(
            f"dataset.decode_device='cuda': no CUDA device is visible; accepted: {accepted}"
        )
    if device.type != "cuda":
        raise ConfigError(
            f"dataset.decode_device='cuda': the run trains on {device}; accepted: {accepted}"
        )


def _bundle(
    feed: Callable[..., BatchSource],
    train: tuple[Any, ...],
    val: tuple[Any, ...],
    layout: BatchLayout,
    shape: tuple[int, int, int],
    description: str,
    options: tuple[dict[str, Any], dict[str, Any]],
    **shared: Any,
) -> DataBundle:
    """A DataBundle of two ``feed`` sources (TensorBatches or LoaderBatches) on this rank's shard.

    ``train``/``val``: the leading data arguments of ``feed``; the last one's length is the sample
    count (labels, or the dataset). ``shape``: (num_classes, in_channels, image_size). Training is
    shuffled with ``layout.seed`` and keeps full batches only; validation keeps every sample in
    order; ``options``: (training's, validation's) own keyword arguments; both get ``shared``.
    """
    where = {"rank": layout.rank, "world": layout.world, **shared}
    train_feed = feed(
        *train,
        layout.batch_size,
        layout.device,
        shuffle=True,
        drop_last=True,
        seed=layout.seed,
        **options[0],
        **where,
    )
    val_feed = feed(
        *val,
        layout.eval_batch_size,
        layout.device,
        shuffle=False,
        drop_last=False,
        **options[1],
        **where,
    )
    num_classes, in_channels, image_size = shape
    return DataBundle(
        train=train_feed,
        val=val_feed,
        num_classes=num_classes,
        in_channels=in_channels,
        image_size=image_size,
        num_train=len(train[-1]),
        num_val=len(val[-1]),
        description=description,
    )
