"""Tests of mptrain.data.build: the on-disk dataset readers, the in-memory and DataLoader feeds, and errors.

Every dataset is written into pytest's ``tmp_path`` in its real on-disk format (CIFAR python
pickles, MNIST idx files, an ImageFolder tree of PNGs); nothing is downloaded. All tests run on CPU.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from support.datafiles import (
    CPU,
    PUBLISHED_STATS,
    build,
    collect,
    colour_of,
    random_bytes,
    tv_config,
    unnormalise,
    write_cifar10,
    write_cifar100,
    write_cifar_file,
    write_image_folder,
    write_mnist,
)

from mptrain.config.base import ConfigError
from mptrain.config.data import (
    DigitsConfig,
    ImageFolderConfig,
    SyntheticConfig,
    TorchvisionDatasetConfig,
)
from mptrain.data import batches, folder
from mptrain.data import build as data
from mptrain.data.batches import BatchLayout
from mptrain.data.feeds import TensorBatches, random_crop_flip


# ------------------------------------------------------------------------------------------- CIFAR
def test_cifar10_bundle_shape_facts(tmp_path):
    write_cifar10(tmp_path, per_file=2, num_test=3)
    bundle = build(tv_config("cifar10", tmp_path))
    assert bundle.num_classes == 10
    assert bundle.in_channels == 3
    assert bundle.image_size == 32
    assert bundle.num_train == 10  # 2 images from each of the five data_batch files
    assert bundle.num_val == 3


def test_cifar10_val_batches_reproduce_pixels_and_labels_in_file_order(tmp_path):
    written = write_cifar10(tmp_path, num_test=3)
    bundle = build(tv_config("cifar10", tmp_path), eval_batch_size=2)  # 2 batches: 2 + 1
    assert bundle.val.num_batches == 2
    images, labels = collect(bundle.val)
    assert images.shape == (3, 3, 32, 32)
    assert images.dtype == torch.float32
    assert labels.tolist() == written["val_labels"].tolist()
    expected = torch.from_numpy(written["val_images"].reshape(3, 3, 32, 32))
    assert torch.equal(unnormalise(images, "cifar10"), expected)


def test_cifar10_val_batches_are_normalised_with_published_stats(tmp_path):
    written = write_cifar10(tmp_path, num_test=3)
    images, _ = collect(build(tv_config("cifar10", tmp_path)).val)
    raw = written["val_images"].reshape(3, 3, 32, 32)
    mean, std = PUBLISHED_STATS["cifar10"]
    # Pixel (image 0, channel 2, row 5, column 7), normalised by hand.
    expected = (raw[0, 2, 5, 7] / 255 - mean[2]) / std[2]
    assert images[0, 2, 5, 7].item() == pytest.approx(expected, abs=1e-5)


def test_cifar_rows_are_read_as_channel_planes_in_row_major_order(tmp_path):
    written = write_cifar10(tmp_path, num_test=1)
    images, _ = collect(build(tv_config("cifar10", tmp_path)).val)
    pixels = unnormalise(images, "cifar10")[0]
    row = written["val_images"][0]
    # Channel c is bytes c*1024 .. (c+1)*1024; inside it, byte 32*y + x is pixel (y, x).
    for c in range(3):
        plane = torch.from_numpy(row[c * 1024 : (c + 1) * 1024].copy())
        assert torch.equal(pixels[c], plane.view(32, 32))
    assert pixels[1, 3, 17].item() == row[1024 + 32 * 3 + 17]


def test_cifar10_train_epoch_serves_every_image_of_all_five_files_once(tmp_path):
    written = write_cifar10(tmp_path, per_file=2)
    bundle = build(tv_config("cifar10", tmp_path), batch_size=2)
    assert bundle.train.num_batches == 5
    images, labels = collect(bundle.train, epoch=0)
    pixels = unnormalise(images, "cifar10").reshape(10, 3072).numpy()
    served = sorted((int(y), x.tobytes()) for x, y in zip(pixels, labels, strict=True))
    expected = sorted(
        (int(y), x.tobytes())
        for x, y in zip(written["train_images"], written["train_labels"], strict=True)
    )
    assert served == expected


def test_cifar100_reads_fine_labels_and_pixels(tmp_path):
    written = write_cifar100(tmp_path, num_train=6, num_test=4)
    bundle = build(tv_config("cifar100", tmp_path))
    assert (bundle.num_classes, bundle.in_channels, bundle.image_size) == (100, 3, 32)
    assert (bundle.num_train, bundle.num_val) == (6, 4)
    images, labels = collect(bundle.val)
    assert labels.tolist() == written["val_labels"].tolist()  # fine labels, not coarse
    expected = torch.from_numpy(written["val_images"].reshape(4, 3, 32, 32))
    assert torch.equal(unnormalise(images, "cifar100"), expected)


def test_cifar_augmentation_never_touches_validation_batches(tmp_path):
    written = write_cifar10(tmp_path, num_test=3)
    bundle = build(tv_config("cifar10", tmp_path, augment=True))
    images, _ = collect(bundle.val)
    expected = torch.from_numpy(written["val_images"].reshape(3, 3, 32, 32))
    assert torch.equal(unnormalise(images, "cifar10"), expected)


def test_cifar_augmentation_changes_training_images_but_keeps_shape(tmp_path):
    write_cifar10(tmp_path, per_file=2)
    plain, _ = collect(build(tv_config("cifar10", tmp_path, augment=False), batch_size=2).train)
    augmented, _ = collect(build(tv_config("cifar10", tmp_path, augment=True), batch_size=2).train)
    assert augmented.shape == plain.shape == (10, 3, 32, 32)
    assert not torch.equal(augmented, plain)


def test_cifar_labels_outside_the_classes_raise_config_error(tmp_path):
    write_cifar10(tmp_path)
    folder = tmp_path / "cifar-10-batches-py"
    write_cifar_file(folder / "test_batch", random_bytes((2, 3072), 0), {b"labels": [3, 10]})
    with pytest.raises(ConfigError, match=r"validation labels span 3\.\.10, outside 0\.\.9"):
        build(tv_config("cifar10", tmp_path))


# ------------------------------------------------------------------------------------------- MNIST
@pytest.mark.parametrize(
    ("name", "folder"), [("mnist", "MNIST"), ("fashion_mnist", "FashionMNIST")]
)
def test_mnist_style_idx_files_are_read_with_shape_labels_and_pixels(tmp_path, name, folder):
    # Both datasets in the same root, with different contents: each must read its own folder.
    mine = write_mnist(tmp_path, folder, seed=1, num_train=6, num_val=5)
    other = "FashionMNIST" if folder == "MNIST" else "MNIST"
    write_mnist(tmp_path, other, seed=2, num_train=8, num_val=7)

    bundle = build(tv_config(name, tmp_path), batch_size=3, eval_batch_size=2)
    assert (bundle.num_classes, bundle.in_channels, bundle.image_size) == (10, 1, 28)
    assert (bundle.num_train, bundle.num_val) == (6, 5)

    images, labels = collect(bundle.val)
    assert images.shape == (5, 1, 28, 28)
    assert labels.dtype == torch.int64
    assert labels.tolist() == mine["val_labels"].tolist()
    assert torch.equal(unnormalise(images, name)[:, 0], torch.from_numpy(mine["val_images"]))

    train_images, train_labels = collect(bundle.train)
    assert train_images.shape == (6, 1, 28, 28)
    assert sorted(train_labels.tolist()) == sorted(mine["train_labels"].tolist())


# ------------------------------------------------------------------------------------- imagefolder
def test_imagefolder_builds_batches_of_the_crop_size(tmp_path):
    write_image_folder(tmp_path, {"train": {"cat": 3, "dog": 3}, "val": {"cat": 2, "dog": 2}})
    cfg = ImageFolderConfig(root=str(tmp_path), image_size=32, resize_size=36)
    bundle = build(cfg, batch_size=4, eval_batch_size=3)
    assert (bundle.num_classes, bundle.in_channels, bundle.image_size) == (2, 3, 32)
    assert (bundle.num_train, bundle.num_val) == (6, 4)
    assert bundle.train.num_batches == 1  # 6 images, batch 4, last partial batch dropped

    train = list(bundle.train.batches(0))
    assert len(train) == 1
    images, labels = train[0]
    assert images.shape == (4, 3, 32, 32)
    assert labels.min() >= 0 and labels.max() <= 1


def test_imagefolder_val_batches_keep_class_order_and_colours(tmp_path):
    write_image_folder(tmp_path, {"train": {"cat": 2, "dog": 2}, "val": {"cat": 2, "dog": 2}})
    cfg = ImageFolderConfig(root=str(tmp_path), image_size=32, resize_size=36)
    bundle = build(cfg, batch_size=2, eval_batch_size=3)
    images, labels = collect(bundle.val)
    assert images.shape == (4, 3, 32, 32)
    assert labels.tolist() == [0, 0, 1, 1]  # classes sorted by name: cat, dog
    mean = torch.tensor(folder.IMAGENET_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(folder.IMAGENET_STD).view(1, 3, 1, 1)
    pixels = (images * std + mean) * 255
    for k, (image, label) in enumerate(zip(pixels, labels, strict=True)):
        colour = colour_of(("cat", "dog")[label], k % 2)  # files 0.png, 1.png of each class
        expected = torch.tensor(colour, dtype=torch.float32).view(3, 1, 1).expand(3, 32, 32)
        torch.testing.assert_close(image, expected, atol=1.0, rtol=0)


def write_noise_image_folder(root: Path, per_class: int = 3, size: int = 40) -> None:
    """train/ and val/ trees of random-noise PNGs: any crop or flip changes their pixels."""
    from PIL import Image

    for split in ("train", "val"):
        for c, cls in enumerate(("cat", "dog")):
            folder = root / split / cls
            folder.mkdir(parents=True)
            for i in range(per_class):
                pixels = random_bytes((size, size, 3), seed=100 * c + i)
                Image.fromarray(pixels).save(folder / f"{i}.png")


def imagefolder_epoch(root: Path, epoch: int, global_seed: int, augment: bool) -> torch.Tensor:
    """Training images of one epoch, built with seed=0 while torch's global RNG is at global_seed."""
    cfg = ImageFolderConfig(root=str(root), image_size=32, resize_size=36, augment=augment)
    with torch.random.fork_rng():
        torch.manual_seed(global_seed)
        images, _ = collect(build(cfg, batch_size=6).train, epoch)
    return images


def test_imagefolder_training_order_is_a_function_of_seed_and_epoch(tmp_path):
    write_image_folder(tmp_path, {"train": {"cat": 3, "dog": 3}, "val": {"cat": 1, "dog": 1}})
    first = imagefolder_epoch(tmp_path, epoch=1, global_seed=1, augment=False)
    assert torch.equal(first, imagefolder_epoch(tmp_path, epoch=1, global_seed=2, augment=False))
    assert not torch.equal(
        first, imagefolder_epoch(tmp_path, epoch=2, global_seed=1, augment=False)
    )


def test_imagefolder_augmented_epoch_is_a_function_of_seed_and_epoch_without_workers(tmp_path):
    write_noise_image_folder(tmp_path)
    first = imagefolder_epoch(tmp_path, epoch=1, global_seed=1, augment=True)
    assert torch.equal(first, imagefolder_epoch(tmp_path, epoch=1, global_seed=2, augment=True))


def test_imagefolder_with_different_train_and_val_classes_raises_config_error(tmp_path):
    write_image_folder(tmp_path, {"train": {"cat": 2, "dog": 2}, "val": {"cat": 2, "bird": 2}})
    cfg = ImageFolderConfig(root=str(tmp_path), image_size=32, resize_size=36)
    with pytest.raises(ConfigError, match="different classes"):
        build(cfg)


# ---------------------------------------------------------------------------------- missing files
@pytest.mark.parametrize(
    ("name", "missing"),
    [
        ("cifar10", "cifar-10-batches-py/data_batch_1"),
        ("cifar100", "cifar-100-python/train"),
        ("mnist", "MNIST/raw/train-images-idx3-ubyte"),
        ("fashion_mnist", "FashionMNIST/raw/train-images-idx3-ubyte"),
    ],
)
def test_missing_torchvision_dataset_names_the_path_and_download(tmp_path, name, missing):
    with pytest.raises(ConfigError) as excinfo:
        build(tv_config(name, tmp_path))
    message = str(excinfo.value)
    assert "\n" not in message
    assert str(tmp_path / missing) in message
    assert "download" in message


@pytest.mark.parametrize(
    ("name", "remove"),
    [
        ("cifar10", "cifar-10-batches-py/data_batch_4"),
        ("cifar10", "cifar-10-batches-py/test_batch"),
        ("cifar100", "cifar-100-python/test"),
        ("mnist", "MNIST/raw/t10k-labels-idx1-ubyte"),
    ],
)
def test_one_missing_file_is_named_exactly(tmp_path, name, remove):
    if name == "cifar10":
        write_cifar10(tmp_path)
    elif name == "cifar100":
        write_cifar100(tmp_path)
    else:
        write_mnist(tmp_path, "MNIST", seed=0)
    (tmp_path / remove).unlink()
    with pytest.raises(ConfigError, match="download") as excinfo:
        build(tv_config(name, tmp_path))
    assert str(tmp_path / remove) in str(excinfo.value)


def test_missing_imagefolder_names_the_split_directory(tmp_path):
    cfg = ImageFolderConfig(root=str(tmp_path), image_size=32, resize_size=36)
    with pytest.raises(ConfigError) as excinfo:
        build(cfg)
    message = str(excinfo.value)
    assert "\n" not in message
    assert str(tmp_path / "train") in message


def test_imagefolder_split_without_class_folders_raises_config_error(tmp_path):
    (tmp_path / "train").mkdir()
    (tmp_path / "val").mkdir()
    cfg = ImageFolderConfig(root=str(tmp_path), image_size=32, resize_size=36)
    with pytest.raises(ConfigError, match="train"):
        build(cfg)


# ----------------------------------------------------------------------------------- TensorBatches
def feed(n: int, batch_size: int, *, shuffle=True, drop_last=True, seed=0, **kwargs):
    """A TensorBatches over n 1x2x2 images whose label is their index."""
    images = torch.arange(n, dtype=torch.float32).view(n, 1, 1, 1).expand(n, 1, 2, 2).clone()
    labels = torch.arange(n)
    return TensorBatches(
        images, labels, batch_size, CPU, shuffle=shuffle, drop_last=drop_last, seed=seed, **kwargs
    )


def epoch_order(source, epoch: int) -> list[int]:
    return torch.cat([labels for _, labels in source.batches(epoch)]).tolist()


@pytest.mark.parametrize(
    ("drop_last", "num_batches", "sizes"), [(True, 3, [3, 3, 3]), (False, 4, [3, 3, 3, 1])]
)
def test_tensor_batches_drop_last_decides_the_partial_batch(drop_last, num_batches, sizes):
    for shuffle in (True, False):
        source = feed(10, 3, shuffle=shuffle, drop_last=drop_last)
        assert source.num_batches == len(source) == num_batches
        assert [len(labels) for _, labels in source.batches(0)] == sizes


def test_tensor_batches_shuffled_epoch_serves_every_sample_once():
    source = feed(12, 4)
    order = epoch_order(source, 0)
    assert sorted(order) == list(range(12))
    assert order != list(range(12))  # actually shuffled


def test_tensor_batches_images_travel_with_their_labels():
    source = feed(12, 4)
    for images, labels in source.batches(3):
        assert torch.equal(images[:, 0, 0, 0], labels.float())


def test_tensor_batches_without_shuffle_keep_the_stored_order():
    source = feed(10, 4, shuffle=False, drop_last=False)
    assert epoch_order(source, 0) == list(range(10))
    assert epoch_order(source, 5) == list(range(10))


def test_tensor_batches_order_is_a_function_of_seed_and_epoch():
    first = feed(32, 8, seed=7)
    second = feed(32, 8, seed=7)
    for epoch in range(3):  # history on `first` must not change what epoch 3 serves
        epoch_order(first, epoch)
    assert epoch_order(first, 3) == epoch_order(second, 3)
    assert epoch_order(first, 3) == epoch_order(first, 3)


def test_tensor_batches_order_differs_across_epochs_and_seeds():
    source = feed(32, 8, seed=7)
    assert epoch_order(source, 0) != epoch_order(source, 1)
    assert epoch_order(source, 1) != epoch_order(source, 2)
    assert epoch_order(feed(32, 8, seed=7), 0) != epoch_order(feed(32, 8, seed=8), 0)


def test_tensor_batches_scale_uint8_and_normalise_per_channel():
    images = torch.zeros(2, 2, 1, 1, dtype=torch.uint8)
    images[:, 0] = 255
    source = TensorBatches(
        images,
        torch.tensor([0, 1]),
        2,
        CPU,
        shuffle=False,
        drop_last=False,
        mean=(0.5, 0.25),
        std=(0.5, 0.5),
    )
    (batch, _), *_ = source.batches(0)
    assert batch.dtype == torch.float32
    torch.testing.assert_close(batch[:, 0].flatten(), torch.tensor([1.0, 1.0]))  # (1 - .5) / .5
    torch.testing.assert_close(batch[:, 1].flatten(), torch.tensor([-0.5, -0.5]))  # (0 - .25) / .5


def first_sample_vertical_offset(batch: torch.Tensor, padding: int) -> int:
    """Crop row offset of sample 0 of a batch of crops of constant non-zero images."""
    rows = (batch[0, 0] != 0).any(1).tolist()
    top_zeros = rows.index(True)
    bottom_zeros = rows[::-1].index(True)
    return padding - top_zeros + bottom_zeros


def test_tensor_batches_crop_offsets_are_independent_of_the_shuffle():
    n, padding = 9, 4
    images = torch.arange(1, n + 1, dtype=torch.float32).view(n, 1, 1, 1).expand(n, 1, 8, 8)
    source = TensorBatches(
        images.clone(),
        torch.arange(n),
        n,
        CPU,
        shuffle=True,
        drop_last=True,
        crop_padding=padding,
    )
    offsets: dict[int, set[int]] = {}
    for epoch in range(60):
        batch, labels = next(iter(source.batches(epoch)))
        offsets.setdefault(int(labels[0]), set()).add(first_sample_vertical_offset(batch, padding))
    # Independent crops: an image that comes first several times gets several different offsets.
    assert any(len(seen) > 1 for seen in offsets.values())


# ------------------------------------------------------------------------------- random_crop_flip
def generator(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def distinct_images(batch: int = 16, channels: int = 2, size: int = 6) -> torch.Tensor:
    """Every pixel of the batch a different value > 0 (so padding zeros are recognisable)."""
    n = batch * channels * size * size
    return torch.arange(1, n + 1, dtype=torch.float32).view(batch, channels, size, size)


def test_random_crop_flip_keeps_the_shape():
    images = distinct_images(batch=8, channels=3, size=5)
    assert random_crop_flip(images, padding=2, flip=True, generator=generator()).shape == (
        8,
        3,
        5,
        5,
    )


def test_random_crop_flip_without_padding_or_flip_is_identity():
    images = distinct_images()
    assert torch.equal(random_crop_flip(images, 0, False, generator()), images)


def test_random_flip_gives_each_image_or_its_mirror():
    images = distinct_images(batch=64)
    out = random_crop_flip(images, 0, True, generator())
    kept = [torch.equal(o, i) for o, i in zip(out, images, strict=True)]
    mirrored = [torch.equal(o, i.flip(-1)) for o, i in zip(out, images, strict=True)]
    assert all(k or m for k, m in zip(kept, mirrored, strict=True))
    assert any(kept) and any(mirrored)


def test_random_crop_of_constant_image_holds_only_its_value_or_zeros():
    values = torch.arange(1, 65, dtype=torch.float32)
    images = values.view(64, 1, 1, 1).expand(64, 3, 8, 8).clone()
    out = random_crop_flip(images, 4, False, generator())
    for image, value in zip(out, values, strict=True):
        assert set(image.unique().tolist()) <= {0.0, value.item()}
    assert (out == 0).any() and (out != 0).any()


def test_random_crop_is_a_window_of_the_zero_padded_image():
    padding, size = 2, 6
    images = distinct_images(batch=32, size=size)
    out = random_crop_flip(images, padding, False, generator(3))
    padded = torch.nn.functional.pad(images, (padding,) * 4)
    offsets = set()
    for image, source in zip(out, padded, strict=True):
        windows = [
            (dy, dx)
            for dy in range(2 * padding + 1)
            for dx in range(2 * padding + 1)
            if torch.equal(image, source[:, dy : dy + size, dx : dx + size])
        ]
        assert len(windows) == 1  # all channels cut at the same offset
        offsets.add(windows[0])
    assert len(offsets) > 1
    assert any(dy != dx for dy, dx in offsets)  # rows and columns shift independently


def test_random_crop_flip_is_reproducible_from_the_generator_seed():
    images = distinct_images()
    first = random_crop_flip(images, 2, True, generator(5))
    assert torch.equal(first, random_crop_flip(images, 2, True, generator(5)))
    assert not torch.equal(first, random_crop_flip(images, 2, True, generator(6)))


# ------------------------------------------------------------------------------------------ digits
@pytest.fixture(scope="module")
def digits_bundle() -> batches.DataBundle:
    # One batch holding the whole training set, so the statistics cover every sample.
    return build(DigitsConfig(), batch_size=1437, eval_batch_size=360)


def test_digits_sizes_and_shape(digits_bundle):
    bundle = digits_bundle
    assert (bundle.num_train, bundle.num_val) == (1437, 360)
    assert (bundle.num_classes, bundle.in_channels, bundle.image_size) == (10, 1, 8)
    images, labels = collect(bundle.val)
    assert images.shape == (360, 1, 8, 8)
    assert images.dtype == torch.float32
    assert set(labels.tolist()) == set(range(10))


def test_digits_split_is_fixed_across_builds(digits_bundle):
    again = build(DigitsConfig(), batch_size=64, eval_batch_size=100, seed=123)
    first_images, first_labels = collect(digits_bundle.val)
    second_images, second_labels = collect(again.val)
    assert torch.equal(first_labels, second_labels)
    assert torch.equal(first_images, second_images)


def test_digits_split_is_stratified(digits_bundle):
    _, train_labels = collect(digits_bundle.train)
    _, val_labels = collect(digits_bundle.val)
    total = torch.bincount(torch.cat([train_labels, val_labels]), minlength=10)
    expected = total * 360 / 1797  # each class's share of the validation set
    assert (torch.bincount(val_labels, minlength=10) - expected).abs().max() <= 1


def test_digits_split_seed_changes_the_split(digits_bundle):
    other = build(DigitsConfig(split_seed=1), batch_size=64, eval_batch_size=360)
    assert not torch.equal(collect(digits_bundle.val)[1], collect(other.val)[1])


def test_digits_training_data_is_standardised(digits_bundle):
    images, labels = collect(digits_bundle.train)
    assert len(labels) == 1437
    assert images.mean().item() == pytest.approx(0.0, abs=1e-4)
    assert images.std().item() == pytest.approx(1.0, abs=1e-3)


# --------------------------------------------------------------------------------------- synthetic
def synthetic(**overrides) -> SyntheticConfig:
    fields = dict(num_train=64, num_val=40, num_classes=4, channels=2, image_size=6, noise=1.0)
    return SyntheticConfig(**{**fields, **overrides})


def test_synthetic_shapes_follow_the_config():
    bundle = build(synthetic(), batch_size=16, eval_batch_size=40)
    assert (bundle.num_classes, bundle.in_channels, bundle.image_size) == (4, 2, 6)
    assert (bundle.num_train, bundle.num_val) == (64, 40)
    images, labels = next(iter(bundle.train.batches(0)))
    assert images.shape == (16, 2, 6, 6)
    assert labels.shape == (16,)
    val_images, val_labels = collect(bundle.val)
    assert val_images.shape == (40, 2, 6, 6)
    assert val_labels.min() >= 0 and val_labels.max() <= 3


def test_synthetic_same_data_seed_gives_identical_data():
    first = build(synthetic(data_seed=3), batch_size=64, eval_batch_size=40)
    second = build(synthetic(data_seed=3), batch_size=64, eval_batch_size=40)
    other = build(synthetic(data_seed=4), batch_size=64, eval_batch_size=40)
    for a, b in zip(collect(first.val), collect(second.val), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(collect(first.train), collect(second.train), strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(collect(first.val)[0], collect(other.val)[0])


def test_synthetic_data_is_learnable_by_nearest_class_mean():
    bundle = build(synthetic(num_train=200, num_val=100), batch_size=200, eval_batch_size=100)
    train_images, train_labels = collect(bundle.train)
    val_images, val_labels = collect(bundle.val)
    assert set(train_labels.tolist()) == set(range(4))
    means = torch.stack([train_images[train_labels == c].mean(0) for c in range(4)])
    distances = torch.cdist(val_images.flatten(1), means.flatten(1))
    accuracy = (distances.argmin(1) == val_labels).float().mean().item()
    assert accuracy > 0.9  # chance is 0.25


# ------------------------------------------------------------------------------------- batch_size
def test_batch_size_larger_than_training_set_raises_config_error():
    with pytest.raises(ConfigError, match=r"batch_size=65: .*64 training samples"):
        build(synthetic(num_train=64), batch_size=65)


def test_batch_size_equal_to_training_set_is_accepted():
    bundle = build(synthetic(num_train=64), batch_size=64)
    assert bundle.train.num_batches == 1


def test_imagefolder_batch_size_larger_than_training_set_raises_config_error(tmp_path):
    write_image_folder(tmp_path, {"train": {"cat": 2, "dog": 2}, "val": {"cat": 1, "dog": 1}})
    cfg = ImageFolderConfig(root=str(tmp_path), image_size=32, resize_size=36)
    with pytest.raises(ConfigError, match="batch_size=5"):
        build(cfg, batch_size=5)


# ------------------------------------------------------------------------------- loader table
def test_every_dataset_option_file_is_a_dataset_of_the_table():
    options = sorted(
        p.stem for p in (Path(__file__).parents[2] / "conf" / "dataset").glob("*.yaml")
    )
    assert sorted(data.DATASETS) == options


def test_unknown_dataset_name_raises_config_error():
    with pytest.raises(ConfigError, match=r"dataset\.name='svhn'"):
        build(TorchvisionDatasetConfig(name="svhn"))


def test_batch_layout_is_immutable():
    layout = BatchLayout(batch_size=2, eval_batch_size=4, device=CPU, seed=0, num_workers=0)
    assert (layout.rank, layout.world) == (0, 1)
    with pytest.raises(AttributeError):
        layout.batch_size = 3


@pytest.mark.parametrize(("val_size", "split_seed"), [(360, 0), (100, 3)])
def test_digits_are_scikit_learns_split_exactly(val_size, split_seed):
    # The default split is stored with mptrain (no scikit-learn import at start-up); it and any
    # other split must be exactly what load_digits() + train_test_split give.
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    from mptrain.config.data import DigitsConfig
    from mptrain.data.arrays import load_digits_arrays

    arrays = load_digits_arrays(DigitsConfig(val_size=val_size, split_seed=split_seed))
    digits = load_digits()
    images = digits.images.astype(np.float32) / 16.0
    x_train, x_val, y_train, y_val = train_test_split(
        images, digits.target, test_size=val_size, stratify=digits.target, random_state=split_seed
    )
    mean, std = float(x_train.mean()), float(x_train.std())
    assert torch.equal(arrays.train_images, torch.from_numpy((x_train - mean) / std).unsqueeze(1))
    assert torch.equal(arrays.val_images, torch.from_numpy((x_val - mean) / std).unsqueeze(1))
    assert torch.equal(arrays.train_labels, torch.from_numpy(y_train).long())
    assert torch.equal(arrays.val_labels, torch.from_numpy(y_val).long())


def test_a_default_run_does_not_import_scikit_learn():
    import subprocess
    import sys

    code = (
        "import sys; from mptrain.config.data import DigitsConfig; "
        "from mptrain.data.arrays import load_digits_arrays; load_digits_arrays(DigitsConfig()); "
        "print('sklearn' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.stdout.strip() == "False", result.stderr
