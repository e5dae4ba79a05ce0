"""The dataset group's schemas: the base ``DatasetConfig`` and one subclass per option, each with
its ``validate()``; the loaders are :data:`mptrain.data.build.DATASETS`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from omegaconf import MISSING

from mptrain.config.base import (
    NOT_TRAINING,
    PATH,
    at_least,
    check_path,
    check_target,
    each_at_least,
    require,
    setting,
)


# ---------------------------------------------------------------------------------------- datasets
@dataclass
class DatasetConfig:
    """Base of every dataset schema; ``name`` is the option's (mptrain.data.build.DATASETS)."""

    name: str = MISSING

    def validate(self) -> None:
        """Range rules of this option's keys; ConfigError naming the first violation."""


@dataclass
class DigitsConfig(DatasetConfig):
    name: str = "digits"
    val_size: int = setting(360, "images held out for validation (stratified, fixed by split_seed)")
    split_seed: int = setting(
        0, "seed of the fixed train/validation split (independent of the run seed)"
    )

    def validate(self) -> None:
        """Range rules of this option's keys; ConfigError naming the first violation."""
        require(0 < self.val_size < 1797, "dataset.val_size", self.val_size, "must be in 1..1796")


@dataclass
class SyntheticConfig(DatasetConfig):
    name: str = "synthetic"
    num_train: int = setting(2048, "training samples")
    num_val: int = setting(512, "validation samples")
    num_classes: int = setting(10, "number of classes (prototypes)")
    channels: int = setting(3, "image channels")
    image_size: int = setting(32, "image side in pixels")
    noise: float = setting(
        1.0, "std of the Gaussian noise added to the prototype (prototypes have std 1)"
    )
    data_seed: int = setting(0, "seed of prototypes and noise (independent of the run seed)")

    def validate(self) -> None:
        """Range rules of this option's keys; ConfigError naming the first violation."""
        each_at_least("dataset", self, ("num_train", "num_val", "channels", "image_size"), 1)
        at_least("dataset.num_classes", self.num_classes, 2)
        require(self.noise >= 0, "dataset.noise", self.noise, "must be >= 0")


@dataclass
class TorchvisionDatasetConfig(DatasetConfig):
    name: str = "cifar10"
    root: str = setting(
        "data",
        "directory holding the dataset files (relative to the launch directory)",
        metadata=PATH | NOT_TRAINING,
    )
    download: bool = setting(
        False,
        "true fetches the files with torchvision (needs internet); false never downloads",
        metadata=NOT_TRAINING,
    )
    augment: bool = setting(
        True, "training augmentation on batches: random crop (pad 4) + horizontal flip"
    )

    def validate(self) -> None:
        """Range rules of this option's keys; ConfigError naming the first violation."""
        check_path("dataset.root", self.root)


@dataclass
class ImageFolderConfig(DatasetConfig):
    name: str = "imagefolder"
    root: str = setting(
        MISSING,
        "required: the directory that holds train_dir and val_dir",
        metadata=PATH | NOT_TRAINING,
    )
    train_dir: str = setting("train", "training split, one sub-directory per class")
    val_dir: str = setting("val", "validation split, same class sub-directories")
    image_size: int = setting(224, "side of the crop the model sees")
    resize_size: int = setting(256, "validation images are resized to this, then center-cropped")
    augment: bool = setting(
        True, "RandomResizedCrop + horizontal flip for training (false: the validation transform)"
    )
    skip_bad_files: bool = setting(
        False,
        (
            "true: skip images that do not decode and count them in the report; false: stop "
            "naming the file"
        ),
    )
    decode_device: str = setting(
        "cpu",
        (
            "cpu: DataLoader workers decode with PIL; cuda: workers only read the files, the "
            "training GPU decodes JPEGs (torchvision.io.decode_jpeg), crops and normalises them "
            "(needs device=cuda/auto on a GPU; other formats are decoded by the workers)"
        ),
    )
    decode_draft: bool = setting(
        True,
        (
            "cpu: decode a JPEG at 1/2, 1/4 or 1/8 size when the crop drawn for it still spans "
            "the output size there (false: always full size)"
        ),
    )

    def validate(self) -> None:
        """Range rules of this option's keys; ConfigError naming the first violation."""
        if self.root is not MISSING:
            check_path("dataset.root", self.root)
        at_least("dataset.image_size", self.image_size, 1)
        at_least("dataset.resize_size", self.resize_size, self.image_size)
        require(
            self.decode_device in ("cpu", "cuda"),
            "dataset.decode_device",
            self.decode_device,
            "cpu (PIL in the DataLoader workers) or cuda (the training GPU decodes JPEGs)",
        )


@dataclass
class CustomDatasetConfig(DatasetConfig):
    """Any importable callable returning ``(train, val)`` torch Datasets (see mptrain.data.build)."""

    accepts_extra_keys: ClassVar[bool] = True
    name: str = "custom"
    _target_: str = setting(
        MISSING, "required: the import path of the callable returning (train, val)"
    )
    num_classes: int | None = setting(
        None,
        (
            "number of classes; null: len(train.classes); also passed to _target_ when it takes "
            "num_classes"
        ),
    )
    in_memory: bool | None = setting(
        None,
        (
            "true: read every sample once into tensors (tensor-indexed feed); false: DataLoader "
            "workers (num_workers); null: tensors for TensorDatasets, workers otherwise"
        ),
    )
    kwargs: dict[str, Any] = setting(
        help="the function's keyword arguments (any key the schema does not declare lands here)",
        factory=dict,
    )

    def validate(self) -> None:
        """Range rules of this option's keys; ConfigError naming the first violation."""
        check_target("dataset._target_", self._target_)
        at_least("dataset.num_classes", self.num_classes, 2, allow_none=True)


@dataclass
class TextDatasetConfig(DatasetConfig):
    """Text for language models (mptrain.data.text): a local file or directory (plain text, or the
    records of .jsonl / .parquet files), or by default the Python standard library's sources that
    ship with the interpreter (no download)."""

    name: str = "text"
    path: str = setting(
        "",
        (
            'a text file, a .jsonl or .parquet file, or a directory of them; "" = the embedded '
            "standard-library corpus"
        ),
        metadata=PATH,
    )
    suffix: str | None = setting(
        None,
        (
            "files a directory contributes (.txt, .jsonl, .parquet, ...); null = .py for the "
            "stdlib, .txt for a path"
        ),
    )
    max_bytes: int = setting(
        2_000_000,
        (
            "read whole files (or records) in order until this many bytes (a single file, or the "
            "first record, is cut here)"
        ),
    )
    vocabulary: str = setting(
        "bytes",
        (
            "bytes: 256 byte values, no tokenizer | chars: the characters of the training text (+"
            " one id for unknown)"
        ),
    )
    tokenizer: str | None = setting(
        None,
        (
            "a local tokenizer.json (Hugging Face tokenizers library) whose tokens replace the "
            "vocabulary"
        ),
        metadata=PATH,
    )
    text_field: str = setting(
        "text",
        ".jsonl: the field of each line's object that holds the document; .parquet: the column",
    )
    val_fraction: float = setting(0.1, "the last 10% of the tokens validates")
    val_windows: int = setting(
        64,
        (
            "fixed, non-overlapping validation windows evaluated each time (model.block_size "
            "tokens each)"
        ),
    )

    def validate(self) -> None:
        """Range rules of this option's keys; ConfigError naming the first violation."""
        if self.path:
            check_path("dataset.path", self.path)
        at_least("dataset.max_bytes", self.max_bytes, 1)
        require(
            self.vocabulary in ("bytes", "chars"),
            "dataset.vocabulary",
            self.vocabulary,
            "bytes (256 byte values) or chars (the training text's characters)",
        )
        if self.tokenizer is not None:
            check_path("dataset.tokenizer", self.tokenizer)
            require(
                self.vocabulary == "bytes",
                "dataset.vocabulary",
                self.vocabulary,
                "left at bytes with dataset.tokenizer (the tokenizer's tokens are the vocabulary)",
            )
        require(bool(self.text_field), "dataset.text_field", self.text_field, "a field name")
        require(
            0 < self.val_fraction < 1,
            "dataset.val_fraction",
            self.val_fraction,
            "must be in (0, 1)",
        )
        at_least("dataset.val_windows", self.val_windows, 1)
