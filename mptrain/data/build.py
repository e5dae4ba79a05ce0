"""The one list of datasets (:data:`DATASETS`: ``dataset.name`` -> schema and loader) and
:func:`build_data`, which loads the configured one and wraps it in the feed that suits it.
"""

from __future__ import annotations

from typing import Any

from mptrain.config.base import ConfigError, Option
from mptrain.config.data import (
    CustomDatasetConfig,
    DigitsConfig,
    ImageFolderConfig,
    SyntheticConfig,
    TextDatasetConfig,
    TorchvisionDatasetConfig,
)
from mptrain.data.arrays import (
    array_bundle,
    load_cifar_arrays,
    load_digits_arrays,
    load_mnist_arrays,
    make_synthetic_arrays,
)
from mptrain.data.batches import BatchLayout, DataBundle
from mptrain.data.custom import CustomDataset, custom_bundle, load_custom
from mptrain.data.folder import FolderDataset, folder_bundle, load_image_folders
from mptrain.data.lm import load_text, text_bundle
from mptrain.data.text import TokenText

# ------------------------------------------------------------------------------------ entry point
# Each name is also an option file conf/dataset/<name>.yaml (a test keeps the two in step).
DATASETS: dict[str, Option] = {
    "digits": Option(DigitsConfig, load_digits_arrays),
    "synthetic": Option(SyntheticConfig, make_synthetic_arrays),
    "cifar10": Option(TorchvisionDatasetConfig, load_cifar_arrays),
    "cifar100": Option(TorchvisionDatasetConfig, load_cifar_arrays),
    "mnist": Option(TorchvisionDatasetConfig, load_mnist_arrays),
    "fashion_mnist": Option(TorchvisionDatasetConfig, load_mnist_arrays),
    "imagefolder": Option(ImageFolderConfig, load_image_folders),
    "custom": Option(CustomDatasetConfig, load_custom),
    "text": Option(TextDatasetConfig, load_text),
}


def build_data(cfg: Any, layout: BatchLayout) -> DataBundle:
    """Load the configured dataset (:data:`DATASETS`) and wrap it in the feed that suits it (the
    ``*_bundle`` of its kind). ConfigError for an unknown name, missing files, labels outside the
    classes, or a training set smaller than one batch."""
    option = DATASETS.get(cfg.name)
    if option is None:
        raise ConfigError(f"dataset.name={cfg.name!r}: one of {', '.join(DATASETS)}")
    dataset = option.build(cfg)
    if isinstance(dataset, FolderDataset):
        return folder_bundle(cfg, dataset, layout)
    if isinstance(dataset, CustomDataset):
        return custom_bundle(cfg, dataset, layout)
    if isinstance(dataset, TokenText):
        return text_bundle(cfg, dataset, layout)
    return array_bundle(cfg, dataset, layout)
