"""The dataset group's schemas: the base ``DatasetConfig`` and one subclass per option, each key's
range rule on its field (``validate()`` applies them, then paths and rules across keys); the
loaders are :data:`mptrain.data.build.DATASETS`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from omegaconf import MISSING

from mptrain.config.base import (
    IMPORT_PATH,
    NOT_TRAINING,
    PATH,
    Accepts,
    at_least_rule,
    check_path,
    check_settings,
    in_range_rule,
    non_negative_rule,
    one_of_rule,
    require,
    setting,
)


# ---------------------------------------------------------------------------------------- datasets
@dataclass
class DatasetConfig:
    """Base of every dataset schema; ``name`` is the option's (mptrain.data.build.DATASETS)."""

    name: str = MISSING

    def validate(self) -> None:
        """Range rules of this option's keys; ConfigError naming the first violation. Here, the
        rules on the fields; a subclass adds its path and cross-key rules after them."""
        check_settings(self, "dataset.")


@dataclass
class DigitsConfig(DatasetConfig):
    name: str = "digits"
    val_size: int = setting(
        360,
        "images held out for validation (stratified, fixed by split_seed)",
        accepts=Accepts(lambda v: 0 < v < 1797, "must be in 1..1796"),
    )
    split_seed: int = setting(
        0, "seed of the fixed train/validation split (independent of the run seed)"
    )


@dataclass
class SyntheticConfig(DatasetConfig):
    name: str = "synthetic"
    num_train: int = setting(2048, "training samples", accepts=at_least_rule(1))
    num_val: int = setting(512, "validation samples", accepts=at_least_rule(1))
    num_classes: int = setting(10, "number of classes (prototypes)", accepts=at_least_rule(2))
    channels: int = setting(3, "image channels", accepts=at_least_rule(1))
    image_size: int = setting(32, "image side in pixels", accepts=at_least_rule(1))
    noise: float = setting(
        1.0,
        "std of the Gaussian noise added to the prototype (prototypes have std 1)",
        accepts=non_negative_rule(),
    )
    data_seed: int = setting(0, "seed of prototypes and noise (independent of the run seed)")


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
        super().validate()
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
    image_size: int = setting(224, "side of the crop the model sees", accepts=at_least_rule(1))
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
        accepts=one_of_rule(
            ("cpu", "cuda"),
            "cpu (PIL in the DataLoader workers) or cuda (the training GPU decodes JPEGs)",
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
        super().validate()
        check_path("dataset.root", self.root)  # MISSING: OmegaConf refused it already
        at_least_rule(self.image_size).check("dataset.resize_size", self.resize_size)


@dataclass
class CustomDatasetConfig(DatasetConfig):
    """Any importable callable returning ``(train, val)`` torch Datasets (see mptrain.data.build)."""

    accepts_extra_keys: ClassVar[bool] = True
    name: str = "custom"
    _target_: str = setting(
        MISSING,
        "required: the import path of the callable returning (train, val)",
        accepts=IMPORT_PATH,
    )
    num_classes: int | None = setting(
        None,
        (
            "number of classes; null: len(train.classes); also passed to _target_ when it takes "
            "num_classes"
        ),
        accepts=at_least_rule(2, optional=True),
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
        accepts=at_least_rule(1),
    )
    vocabulary: str = setting(
        "bytes",
        (
            "bytes: 256 byte values, no tokenizer | chars: the characters of the training text (+"
            " one id for unknown)"
        ),
        accepts=one_of_rule(
            ("bytes", "chars"), "bytes (256 byte values) or chars (the training text's characters)"
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
        accepts=Accepts(bool, "a field name"),
    )
    val_fraction: float = setting(
        0.1, "the last 10% of the tokens validates", accepts=in_range_rule("(0, 1)")
    )
    val_windows: int = setting(
        64,
        (
            "fixed, non-overlapping validation windows evaluated each time (model.block_size "
            "tokens each)"
        ),
        accepts=at_least_rule(1),
    )

    def validate(self) -> None:
        super().validate()
        check_path("dataset.path", self.path)
        if self.tokenizer is not None:
            check_path("dataset.tokenizer", self.tokenizer)
            require(
                self.vocabulary == "bytes",
                "dataset.vocabulary",
                self.vocabulary,
                "left at bytes with dataset.tokenizer (the tokenizer's tokens are the vocabulary)",
            )
