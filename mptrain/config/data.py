"""The dataset group's schemas: the base ``DatasetConfig`` and one subclass per option, each with
its ``validate()``; the loaders are :data:`mptrain.data.build.DATASETS`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
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
    val_size: int = 360
    split_seed: int = 0

    def validate(self) -> None:
        """Range rules of this option's keys; ConfigError naming the first violation."""
        require(0 < self.val_size < 1797, "dataset.val_size", self.val_size, "must be in 1..1796")


@dataclass
class SyntheticConfig(DatasetConfig):
    name: str = "synthetic"
    num_train: int = 2048
    num_val: int = 512
    num_classes: int = 10
    channels: int = 3
    image_size: int = 32
    noise: float = 1.0
    data_seed: int = 0

    def validate(self) -> None:
        """Range rules of this option's keys; ConfigError naming the first violation."""
        each_at_least("dataset", self, ("num_train", "num_val", "channels", "image_size"), 1)
        at_least("dataset.num_classes", self.num_classes, 2)
        require(self.noise >= 0, "dataset.noise", self.noise, "must be >= 0")


@dataclass
class TorchvisionDatasetConfig(DatasetConfig):
    name: str = "cifar10"
    root: str = field(default="data", metadata=PATH | NOT_TRAINING)
    download: bool = field(default=False, metadata=NOT_TRAINING)
    augment: bool = True

    def validate(self) -> None:
        """Range rules of this option's keys; ConfigError naming the first violation."""
        check_path("dataset.root", self.root)


@dataclass
class ImageFolderConfig(DatasetConfig):
    name: str = "imagefolder"
    root: str = field(default=MISSING, metadata=PATH | NOT_TRAINING)
    train_dir: str = "train"
    val_dir: str = "val"
    image_size: int = 224
    resize_size: int = 256
    augment: bool = True
    skip_bad_files: bool = False  # true: skip images that do not decode (counted in the report)
    decode_device: str = "cpu"  # cpu: PIL in the workers | cuda: bytes from the workers, GPU decode
    decode_draft: bool = True  # cpu: JPEGs decoded at 1/2..1/8 size when the crop allows it

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
    _target_: str = MISSING
    num_classes: int | None = None  # None: len(train.classes)
    in_memory: bool | None = None  # None: tensor feed for TensorDatasets, DataLoader otherwise
    kwargs: dict[str, Any] = field(default_factory=dict)

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
    path: str = field(default="", metadata=PATH)  # "": the embedded standard-library corpus
    suffix: str | None = None  # files a directory contributes; None: .py (stdlib) / .txt (path)
    max_bytes: int = 2_000_000  # whole files (or records) in sorted order until this many bytes
    vocabulary: str = "bytes"  # bytes (256 ids) | chars (built from the training text)
    tokenizer: str | None = field(default=None, metadata=PATH)  # a tokenizer.json: its tokens
    text_field: str = "text"  # the field (JSONL) or column (Parquet) that holds each document
    val_fraction: float = 0.1  # the last share of the tokens validates
    val_windows: int = 64  # fixed validation windows (model.block_size tokens each)

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
