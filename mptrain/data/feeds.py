"""The two feeds. :class:`TensorBatches` for data held in memory: one shuffled index per epoch,
batches gathered by tensor indexing, augmentation on whole batches on the device (no per-sample
Python, no workers; BENCHMARKS.md compares it with a per-sample DataLoader).
:class:`LoaderBatches` for file-backed data: a DataLoader with workers, pinned memory and
non-blocking copies on CUDA. Both yield batches already on the training device, shard by rank,
and are deterministic given ``(seed, epoch)``: an epoch's order does not depend on earlier ones.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from mptrain.data.batches import Batch, WrappedDataset
from mptrain.data.decode import (
    BadDataFile,
    DeviceDecode,
    normalise,
)
from mptrain.platform.hardware import MAX_DEVICE_RESIDENT_BYTES
from mptrain.platform.seeding import AUGMENT_STREAM, ORDER_STREAM, epoch_generator, stream_seed


# ------------------------------------------------------------------------------------------ feeds
def batch_count(n: int, batch_size: int, rank: int, world: int, drop_last: bool) -> int:
    """Batches per epoch of rank ``rank``'s shard of ``n`` samples: with ``drop_last`` every rank
    gets the same count of samples (:func:`epoch_indices`) and only full batches."""
    if drop_last:
        return (n // world) // batch_size
    return -(-len(range(rank, n, world)) // batch_size)


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


class SkipBadFiles(WrappedDataset):
    """``dataset.skip_bad_files=true``: a sample whose file does not decode becomes None, which
    :func:`collate_samples` drops and counts."""

    def __getitem__(self, index: int) -> Any:
        try:
            return self.dataset[index]
        except BadDataFile:
            return None


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
        facts = {**self.plan.facts, "persistent_workers": self.persistent}
        if hasattr(self.finish, "host_decoded"):
            facts["host_decoded"] = self.finish.host_decoded
        return facts

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
