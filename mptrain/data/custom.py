"""The user's own datasets (``dataset=custom dataset._target_=my_pkg.make_data``; the contract in
full: docs/custom-code.md): the callable returns ``(train, val)`` map-style datasets of ``(image,
label)``; their first samples are checked, then they are fed from memory (``dataset.in_memory``)
or through DataLoader workers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mptrain.config.base import ConfigError
from mptrain.config.data import CustomDatasetConfig
from mptrain.config.targets import call_target, check_keys, locate, offered
from mptrain.data.arrays import ArrayDataset, array_bundle
from mptrain.data.batches import (
    BatchLayout,
    CheckedLabels,
    DataBundle,
    check_batch_size,
    is_int_label,
    make_bundle,
)
from mptrain.data.feeds import LoaderBatches


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
    if not is_int_label(label) or not 0 <= int(label) < num_classes:
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


def custom_bundle(cfg: CustomDatasetConfig, data: CustomDataset, layout: BatchLayout) -> DataBundle:
    """The tensor feed (``data.in_memory``) or DataLoader workers over the user's datasets."""
    channels, side, _ = data.sample_shape
    description = (
        f"custom {data.target}: {len(data.train)} train / {len(data.val)} val, "
        f"{channels}x{side}x{side}, {data.num_classes} classes"
    )
    if data.in_memory:
        arrays = ArrayDataset(*_as_tensors(data.train), *_as_tensors(data.val), data.num_classes)
        bundle = array_bundle(cfg, arrays, layout)
    else:
        check_batch_size(layout.batch_size, len(data.train), "training samples")
        bundle = _custom_loader_bundle(cfg, data, layout)
    bundle.description = description
    bundle.classes = _custom_class_names(data)
    return bundle


def _custom_class_names(data: CustomDataset) -> list[str] | None:
    """The training set's ``classes`` (checkpoints keep them), when it names every class."""
    classes = getattr(data.train, "classes", None)
    if isinstance(classes, list | tuple) and len(classes) == data.num_classes:
        return [str(c) for c in classes]
    return None


def _custom_loader_bundle(
    cfg: CustomDatasetConfig, data: CustomDataset, layout: BatchLayout
) -> DataBundle:
    """DataLoader workers over the user's datasets (preprocessing is the datasets' own), every
    sample's label checked as a worker reads it (only sample 0 was checked before training)."""
    channels, side, _ = data.sample_shape
    classes_from = (
        f"dataset.num_classes={cfg.num_classes}"
        if cfg.num_classes is not None
        else f"the {data.num_classes} classes of the training set's 'classes'"
    )
    train, val = (
        CheckedLabels(dataset, data.num_classes, "custom", split, classes_from)
        for dataset, split in ((data.train, "training"), (data.val, "validation"))
    )
    return make_bundle(
        LoaderBatches,
        (train,),
        (val,),
        layout,
        (data.num_classes, channels, side),
        "",
        ({}, {}),
        num_workers=layout.num_workers,
    )
