"""The batch contract: what a feed yields (:class:`BatchSource`), what a dataset becomes
(:class:`DataBundle`), where batches go (:class:`BatchLayout`), and :func:`make_bundle`, the one
way a dataset's two feeds are assembled on this rank's shard, with the size and label checks.
"""

from __future__ import annotations

import hashlib
import numbers
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from mptrain.config.base import ConfigError
from mptrain.data.text import TextFacts

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
    # What the data was, cheap to recompute (a digest of the tensors or the text read, or of the
    # image files' names, sizes and mtimes): a resumed run must train on the data its checkpoint
    # saw (mptrain.checkpoint.checkpointer.run_signature). None where nothing cheap names it
    # (datasets of the user's code read by DataLoader workers).
    identity: str | None = None


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


class DataError(RuntimeError):
    """Bad data met while batches are served; the message is one line naming what is wrong.

    Raised in a DataLoader worker, it reaches the main process re-created with the worker's
    traceback in its message; ``str()`` still gives the one line."""

    def __str__(self) -> str:
        last = str(self.args[0]).rstrip().splitlines()[-1] if self.args else ""
        return last.split(f"{type(self).__name__}: ", 1)[-1]


class BadLabel(DataError):
    """A sample whose label is not an int in ``0..num_classes-1``, found as it is read."""


def is_int_label(label: Any) -> bool:
    """Python and NumPy integers, 0-d integer tensors; not bools, not floats."""
    if isinstance(label, torch.Tensor):
        return label.dim() == 0 and not label.is_floating_point() and label.dtype != torch.bool
    return isinstance(label, numbers.Integral) and not isinstance(label, bool)


class WrappedDataset(torch.utils.data.Dataset):
    """A map-style dataset around ``dataset``: its length, and its other attributes (classes,
    epoch, ...) read through."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getattr__(self, name: str) -> Any:
        if name == "dataset":  # not set yet (unpickling in a worker): no recursion
            raise AttributeError(name)
        return getattr(self.dataset, name)


class CheckedLabels(WrappedDataset):
    """A map-style dataset whose every sample's label is checked as it is read (in the DataLoader
    worker that reads it): :class:`BadLabel` naming ``name``, the split, the sample index and the
    accepted range, instead of an IndexError (CPU) or a device-side assert (CUDA) in the loss.
    ``classes_from`` says where ``num_classes`` came from (``dataset.num_classes=10``)."""

    def __init__(
        self, dataset: Any, num_classes: int, name: str, split: str, classes_from: str
    ) -> None:
        super().__init__(dataset)
        self.num_classes = num_classes
        self.where, self.classes_from = f"dataset {name}: {split} sample", classes_from

    def __getitem__(self, index: int) -> Any:
        sample = self.dataset[index]
        label = sample[1]
        if not is_int_label(label) or not 0 <= int(label) < self.num_classes:
            what = "outside" if is_int_label(label) else "not an int in"
            raise BadLabel(
                f"{self.where} {index} has label {label!r}, {what} 0..{self.num_classes - 1} "
                f"({self.classes_from})"
            )
        return sample


def check_labels(labels: torch.Tensor, num_classes: int, where: str) -> None:
    """ConfigError unless every label lies in 0..num_classes-1."""
    if len(labels) and (labels.min() < 0 or labels.max() >= num_classes):
        raise ConfigError(
            f"dataset: {where} labels span {int(labels.min())}..{int(labels.max())}, "
            f"outside 0..{num_classes - 1}"
        )


def check_batch_size(batch_size: int, available: int, what: str) -> None:
    """ConfigError when one training batch needs more than the ``available`` ``what``."""
    if available < batch_size:
        raise ConfigError(f"batch_size={batch_size}: larger than the {available} {what}")


def make_bundle(
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


def tensors_identity(*tensors: torch.Tensor) -> str:
    """``sha256:<digest>`` of the tensors' bytes, in order (a DataBundle's ``identity``)."""
    digest = hashlib.sha256()
    for tensor in tensors:
        flat = tensor.detach().cpu().contiguous().reshape(-1)
        digest.update(memoryview(flat.view(torch.uint8).numpy()))
    return f"sha256:{digest.hexdigest()}"


def files_identity(paths: list[str]) -> str:
    """``files:<digest>`` of each file's name, size and modification time (a DataBundle's
    ``identity`` for data read from files: no file is read, one stat each)."""
    digest = hashlib.sha256()
    for path in paths:
        info = os.stat(path)
        digest.update(f"{path}\0{info.st_size}\0{info.st_mtime_ns}\n".encode())
    return f"files:{digest.hexdigest()}"
