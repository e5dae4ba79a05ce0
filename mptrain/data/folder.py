"""Image folders (``dataset=imagefolder``): the class folders, the seeded crops, decoding in
DataLoader workers or on the device (``dataset.decode_device=cuda``), bad files skipped or
refused, and the bundle that feeds them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mptrain.config.base import ConfigError
from mptrain.config.data import ImageFolderConfig
from mptrain.data.arrays import preprocessing
from mptrain.data.batches import (
    BatchLayout,
    DataBundle,
    check_batch_size,
    files_identity,
    make_bundle,
)
from mptrain.data.decode import (
    CropSpec,
    DecodeCrop,
    DeviceDecode,
    EncodedImages,
    collate_encoded,
)
from mptrain.data.feeds import (
    LoaderBatches,
    LoaderPlan,
    NormaliseOnDevice,
    SeededTransforms,
    SkipBadFiles,
)
from mptrain.platform.seeding import AUGMENT_STREAM, stream_seed

# ----------------------------------------------------------------------------------- imagefolder
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


@dataclass
class FolderDataset:
    """A file-backed dataset: torchvision ImageFolders whose samples are file paths.

    ``train`` has no transform of its own: :func:`folder_bundle` wraps it with ``train_transform``
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


def load_image_folders(cfg: ImageFolderConfig) -> FolderDataset:
    """root/<train_dir>/<class>/<image> and root/<val_dir>/...; ConfigError when a split is
    missing, holds no class folders or images, the training split holds one class, or the two
    splits hold different classes."""
    from torchvision import datasets

    root = Path(cfg.root)
    for split in (cfg.train_dir, cfg.val_dir):
        if not (root / split).is_dir():
            raise ConfigError(
                f"dataset.root={cfg.root!r}: no directory {root / split} "
                "(expected root/<split>/<class>/<image> folders)"
            )
    # The CPU pipeline's: a file path to a uint8 crop; the feed normalises with ImageNet's stats.
    train_transform, val_transform = (DecodeCrop(s, cfg.decode_draft) for s in _crop_specs(cfg))
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
    # One class: every prediction is that class, so the run would report 100 % accuracy and a
    # loss of 0 without learning anything (no documented use needs it).
    if len(train_folder.classes) < 2:
        raise ConfigError(
            f"dataset.root={cfg.root!r}: {cfg.train_dir}/ holds one class folder "
            f"({train_folder.classes[0]}/); classification needs at least 2 class folders "
            f"(root/{cfg.train_dir}/<class>/<image>), one class is always 100% accurate"
        )
    return FolderDataset(train_folder, val_set, train_transform)


def folder_bundle(
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
    check_batch_size(layout.batch_size, len(train_set), "training images")
    num_classes = len(folders.train.classes)
    bundle = make_bundle(
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
    bundle.identity = files_identity(
        [path for path, _ in folders.train.samples + folders.val.samples]
    )
    bundle.preprocessing = preprocessing(
        255.0,  # ToTensor's scaling of 8-bit RGB
        IMAGENET_MEAN,
        IMAGENET_STD,
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
    finish = NormaliseOnDevice(layout.device, IMAGENET_MEAN, IMAGENET_STD)
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
                spec, layout.device, IMAGENET_MEAN, IMAGENET_STD, seed_of, cfg.skip_bad_files
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
