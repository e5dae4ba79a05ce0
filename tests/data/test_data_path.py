"""The imagefolder data path: PIL decode at reduced size, persistent workers with per-epoch seeds,
device decoding (run here on the CPU), the report's pipeline facts and benchmarks/data_path.py.

Small JPEG trees are written into ``tmp_path``; the CUDA test is skipped without a GPU.
"""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from support.processes import describe, run_command
from support.runs import requires_cuda, tiny_run, train

from mptrain.config.base import ConfigError
from mptrain.config.data import ImageFolderConfig
from mptrain.data import batches, decode, folder
from mptrain.data.batches import BatchLayout
from mptrain.data.build import build_data
from mptrain.data.decode import BadDataFile, CropSpec, DecodeCrop, crop_params, draft_factor

CPU = torch.device("cpu")
REPO = Path(__file__).resolve().parents[2]


def photo(width: int, height: int, seed: int) -> np.ndarray:
    """A smooth random RGB image (JPEG-friendly, like a photograph rather than noise)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    coarse = rng.integers(0, 256, (max(height // 16, 2), max(width // 16, 2), 3), dtype=np.uint8)
    image = Image.fromarray(coarse).resize((width, height), Image.Resampling.BICUBIC)
    return np.asarray(image)


def write_jpegs(root: Path, per_class: int = 4, sizes=((96, 72), (80, 100)), fmt="JPEG") -> None:
    """train/ and val/ with classes a, b: ``per_class`` images each, sides cycling ``sizes``."""
    from PIL import Image

    for split in ("train", "val"):
        for c, cls in enumerate(("a", "b")):
            folder = root / split / cls
            folder.mkdir(parents=True)
            for i in range(per_class):
                w, h = sizes[i % len(sizes)]
                pixels = photo(w, h, seed=100 * c + i + (0 if split == "train" else 50))
                suffix = "jpg" if fmt == "JPEG" else fmt.lower()
                Image.fromarray(pixels).save(folder / f"{i}.{suffix}", fmt, quality=92)


def folder_cfg(root: Path, **keys) -> ImageFolderConfig:
    return ImageFolderConfig(root=str(root), image_size=32, resize_size=40, **keys)


def build(cfg, workers: int = 0, batch_size: int = 4, seed: int = 0) -> batches.DataBundle:
    layout = BatchLayout(
        batch_size=batch_size, eval_batch_size=4, device=CPU, seed=seed, num_workers=workers
    )
    return build_data(cfg, layout)


def epoch_of(source, epoch: int) -> tuple[torch.Tensor, torch.Tensor]:
    images, labels = zip(*source.batches(epoch), strict=True)
    return torch.cat(images), torch.cat(labels)


def old_transforms(cfg: ImageFolderConfig):
    """The pipeline before this change: torchvision Compose on the full decode, float output."""
    from torchvision import transforms as T

    normalize = T.Normalize(folder.IMAGENET_MEAN, folder.IMAGENET_STD)
    val = T.Compose(
        [T.Resize(cfg.resize_size), T.CenterCrop(cfg.image_size), T.ToTensor(), normalize]
    )
    train = T.Compose(
        [T.RandomResizedCrop(cfg.image_size), T.RandomHorizontalFlip(), T.ToTensor(), normalize]
    )
    return train, val


# ------------------------------------------------------------------------------------ crop rules
@pytest.mark.parametrize(("height", "width"), [(375, 500), (500, 333), (40, 400), (7, 9)])
def test_crop_params_draw_what_torchvision_draws_from_the_same_seed(height, width):
    from torchvision.transforms import RandomResizedCrop

    spec = CropSpec(224, 256, random=True)
    image = torch.empty((3, height, width), device="meta")
    for seed in range(20):
        torch.manual_seed(seed)
        expected = RandomResizedCrop.get_params(image, [0.08, 1.0], [3 / 4, 4 / 3])
        assert crop_params(height, width, spec, torch.Generator().manual_seed(seed)) == expected


def test_draft_factor_keeps_the_crop_at_least_the_output_size():
    assert draft_factor(448, 500, 224) == 2
    assert draft_factor(447, 2000, 224) == 1  # the shorter side decides
    assert draft_factor(1800, 1800, 224) == 8
    assert draft_factor(100, 100, 224) == 1  # already upsampled: never decode smaller


def test_pipeline_without_a_draft_reproduces_the_old_batches_exactly(tmp_path):
    write_jpegs(tmp_path)
    # decode_draft=true as well where no crop is twice the size it needs (64 px output).
    for cfg in (
        folder_cfg(tmp_path, decode_draft=False),
        ImageFolderConfig(root=str(tmp_path), image_size=64, resize_size=72),
    ):
        old_train, old_val = old_transforms(cfg)
        loaded = folder.load_image_folders(cfg)
        train, val = loaded.train_transform, loaded.val.transform
        paths = sorted(str(p) for p in tmp_path.rglob("*.jpg"))
        mean = torch.tensor(folder.IMAGENET_MEAN).view(1, 3, 1, 1)
        std = torch.tensor(folder.IMAGENET_STD).view(1, 3, 1, 1)
        for path in paths:
            for new, old in ((train, old_train), (val, old_val)):
                torch.manual_seed(7)
                got = decode.normalise(new(path)[None], mean, std)[0]
                torch.manual_seed(7)
                assert torch.equal(got, old(decode.load_image(path)))


def test_draft_decodes_a_large_jpeg_smaller_and_close_to_the_full_decode(tmp_path):
    from PIL import Image

    path = tmp_path / "big.jpg"
    Image.fromarray(photo(1024, 768, seed=3)).save(path, quality=92)
    spec = CropSpec(64, 72, random=True)
    with Image.open(path) as image:
        _, scale = DecodeCrop(spec, draft=True)._decode(image, draft_factor(300, 300, 64))
    assert scale == 4  # a 300 px crop spans 75 px at 1/4 scale, >= 64
    for spec in (CropSpec(64, 72, random=True), CropSpec(64, 72, random=False)):
        for seed in range(5):
            torch.manual_seed(seed)
            drafted = DecodeCrop(spec, draft=True)(str(path)).float()
            torch.manual_seed(seed)
            full = DecodeCrop(spec, draft=False)(str(path)).float()
            assert drafted.shape == full.shape == (3, 64, 64)
            assert (drafted - full).abs().mean() < 4.0  # of 255: the same picture


# ---------------------------------------------------------------------- persistent, seeded epochs
def test_persistent_workers_give_new_epochs_reproducibly_and_resume_exactly(tmp_path):
    write_jpegs(tmp_path, per_class=4)
    cfg = folder_cfg(tmp_path)
    bundle = build(cfg, workers=2)
    first = [epoch_of(bundle.train, e)[0] for e in range(3)]
    assert bundle.train.loader is not None and bundle.train.persistent  # one loader, kept
    assert not torch.equal(first[0], first[1]) and not torch.equal(first[1], first[2])
    again = build(cfg, workers=2)
    assert all(torch.equal(a, epoch_of(again.train, e)[0]) for e, a in enumerate(first))
    resumed = build(cfg, workers=2)  # a run resumed at epoch 2 sees the same batches
    assert torch.equal(epoch_of(resumed.train, 2)[0], first[2])
    in_process = build(cfg, workers=0)  # and the workers change nothing
    assert torch.equal(epoch_of(in_process.train, 1)[0], first[1])
    val = epoch_of(bundle.val, 0)[0]
    assert torch.equal(val, epoch_of(bundle.val, 0)[0])


def test_pipeline_facts_name_what_runs(tmp_path):
    write_jpegs(tmp_path, per_class=2)
    bundle = build(folder_cfg(tmp_path, decode_draft=False), workers=1)
    facts = bundle.train.pipeline
    assert facts == {
        "decode_device": "cpu",
        "decoder": "PIL",
        "draft": False,
        "normalised_on": "cpu",
        "persistent_workers": True,
    }
    assert bundle.train.feed.startswith("DataLoader (1 persistent workers): PIL in the workers")
    assert build(folder_cfg(tmp_path), workers=0).train.pipeline["persistent_workers"] is False


# ------------------------------------------------------------------------------------- bad files
@pytest.mark.slow
def test_bad_files_are_named_or_skipped_on_the_cpu_path(tmp_path):
    write_jpegs(tmp_path, per_class=2)
    (tmp_path / "train" / "a" / "notes.jpg").write_bytes(b"just text")
    with pytest.raises(BadDataFile, match=r"notes\.jpg"):
        decode.load_image(str(tmp_path / "train" / "a" / "notes.jpg"))
    with pytest.raises(BadDataFile, match=r"notes\.jpg: cannot identify"):
        epoch_of(build(folder_cfg(tmp_path), workers=1, batch_size=5).train, 0)
    skipping = build(folder_cfg(tmp_path, skip_bad_files=True), workers=1, batch_size=5)
    images, _ = epoch_of(skipping.train, 0)
    assert len(images) == 4 and skipping.train.bad_files == 1


# --------------------------------------------------------------------------------- device decode
@pytest.fixture
def decode_on_cpu(monkeypatch):
    """Let dataset.decode_device=cuda build on the CPU: the device pipeline's code, CPU device."""
    monkeypatch.setattr(folder, "_check_decode_device", lambda device: None)


def test_device_decode_matches_the_pil_pipeline(tmp_path, decode_on_cpu):
    write_jpegs(tmp_path, per_class=4, sizes=((120, 90), (90, 130)))
    pil = build(folder_cfg(tmp_path), workers=1)
    device = build(folder_cfg(tmp_path, decode_device="cuda"), workers=1)
    assert device.train.pipeline["decoder"] == "torchvision.io.decode_jpeg"
    for split in ("train", "val"):
        expected, expected_labels = epoch_of(getattr(pil, split), 1)
        got, labels = epoch_of(getattr(device, split), 1)
        assert got.shape == expected.shape and got.dtype == expected.dtype == torch.float32
        assert torch.equal(labels, expected_labels)
        # The same crop boxes and flips (one seed per sample); decoders and resizers differ.
        torch.testing.assert_close(got.mean((0, 2, 3)), expected.mean((0, 2, 3)), atol=0.03, rtol=0)
        torch.testing.assert_close(got.std((0, 2, 3)), expected.std((0, 2, 3)), atol=0.03, rtol=0)
        assert (got - expected).abs().mean() < 0.05
    again = build(folder_cfg(tmp_path, decode_device="cuda"), workers=0)
    assert torch.equal(epoch_of(again.train, 1)[0], epoch_of(device.train, 1)[0])
    assert not torch.equal(epoch_of(again.train, 2)[0], epoch_of(device.train, 1)[0])


def test_device_decode_takes_png_decoded_by_the_workers(tmp_path, decode_on_cpu):
    write_jpegs(tmp_path, per_class=2, fmt="PNG")
    bundle = build(folder_cfg(tmp_path, decode_device="cuda"), workers=1)
    images, _ = epoch_of(bundle.val, 0)
    assert images.shape == (4, 3, 32, 32)
    pil, _ = epoch_of(build(folder_cfg(tmp_path), workers=0).val, 0)
    assert (images - pil).abs().mean() < 0.05


def test_device_decode_names_or_skips_a_broken_jpeg(tmp_path, decode_on_cpu):
    write_jpegs(tmp_path, per_class=2)
    good = (tmp_path / "train" / "a" / "0.jpg").read_bytes()
    (tmp_path / "train" / "a" / "cut.jpg").write_bytes(good[:40])  # JPEG magic, then nothing
    (tmp_path / "train" / "b" / "notes.jpg").write_bytes(b"just text")
    cfg = folder_cfg(tmp_path, decode_device="cuda")
    with pytest.raises(BadDataFile, match=r"(cut|notes)\.jpg"):
        epoch_of(build(cfg, workers=0, batch_size=6).train, 0)
    skipping = build(folder_cfg(tmp_path, decode_device="cuda", skip_bad_files=True), batch_size=6)
    images, labels = epoch_of(skipping.train, 0)
    assert len(images) == len(labels) == 4 and skipping.train.bad_files == 2


@pytest.mark.slow
def test_decode_device_cuda_without_a_gpu_is_a_one_line_config_error(tmp_path):
    write_jpegs(tmp_path, per_class=2)
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    with pytest.raises(ConfigError, match=r"^dataset.decode_device='cuda': no CUDA device"):
        build(folder_cfg(tmp_path, decode_device="cuda"))
    with pytest.raises(ConfigError, match=r"dataset.decode_device=.gpu.: cpu .* or cuda"):
        folder_cfg(tmp_path, decode_device="gpu").validate()
    result = run_command(
        tmp_path,
        sys.executable,
        "-m",
        "mptrain",
        "dataset=imagefolder",
        f"dataset.root={tmp_path}",
        "dataset.decode_device=cuda",
        "max_steps=1",
        f"hydra.run.dir={tmp_path / 'run'}",
        timeout=120,
    )
    assert result.returncode == 2, describe(result)
    lines = [line for line in result.stderr.splitlines() if "decode_device" in line]
    assert len(lines) == 1 and "no CUDA device is visible" in lines[0]


@pytest.mark.gpu
@requires_cuda
def test_cuda_decode_matches_the_pil_pipeline(tmp_path):
    write_jpegs(tmp_path, per_class=4, sizes=((120, 90), (90, 130)))
    layout = BatchLayout(4, 4, torch.device("cuda"), seed=0, num_workers=1)
    device = build_data(folder_cfg(tmp_path, decode_device="cuda"), layout)
    pil = build_data(folder_cfg(tmp_path), layout)
    for split in ("train", "val"):
        got, _ = epoch_of(getattr(device, split), 1)
        expected, _ = epoch_of(getattr(pil, split), 1)
        assert got.is_cuda and got.shape == expected.shape and got.dtype == torch.float32
        assert (got - expected).abs().mean() < 0.05
    again = build_data(folder_cfg(tmp_path, decode_device="cuda"), layout)
    assert torch.equal(epoch_of(again.train, 1)[0], epoch_of(device.train, 1)[0])


# ------------------------------------------------------------------------------------- benchmark
@pytest.mark.slow
def test_data_path_benchmark_smoke_run(tmp_path):
    out = tmp_path / "result.json"
    result = run_command(
        tmp_path, sys.executable, "-m", "benchmarks.data_path", "--workers", "1", "--images", "12",
        "--image-size", "32", "--reps", "1", "--epochs", "2", "--batch-size", "4",
        "--device-decode", "--json", str(out), timeout=240, env={"PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert result.returncode == 0, describe(result)
    doc = json.loads(out.read_text())
    assert {"old", "new", "device-decode (cpu)"} <= set(doc["pipelines"])
    for row in doc["pipelines"].values():
        assert row["images_per_s"]["median"] > 0 and len(row["reps"]) == 1
    assert doc["settings"]["workers"] == 1 and doc["settings"]["epochs"] == 2
    # Device decoding counts the JPEGs its decoder refused (the host decoded them): none here.
    assert doc["errors"] == {} and doc["host_decoded"] == {"device-decode (cpu)": 0}


def test_png_bytes_are_decoded_in_the_worker_and_jpeg_bytes_are_not(tmp_path):
    from PIL import Image

    write_jpegs(tmp_path, per_class=1)
    png = tmp_path / "train" / "a" / "x.png"
    buffer = io.BytesIO()
    Image.fromarray(photo(20, 10, seed=1)).save(buffer, "PNG")
    png.write_bytes(buffer.getvalue())
    train = folder.load_image_folders(folder_cfg(tmp_path)).train
    encoded = decode.EncodedImages(train)
    kinds = {Path(p).suffix: encoded[i][0][0].dim() for i, (p, _) in enumerate(train.samples)}
    assert kinds == {".jpg": 1, ".png": 3}


@pytest.mark.figure
def test_a_whole_job_with_persistent_workers_ends_with_its_figure(tmp_path):
    """The job's figure process was started before the DataLoader workers were forked, and they
    hold copies of its pipe: the figure request must not wait for an end of file (it hung)."""
    write_jpegs(tmp_path / "data")
    cfg = tiny_run(
        "dataset=imagefolder",
        f"dataset.root={tmp_path / 'data'}",
        "dataset.image_size=32",
        "num_workers=2",
        "batch_size=4",
        "max_steps=3",
        "epochs=null",
    )
    report = train(cfg, tmp_path / "run")
    assert report["status"] == "completed"
    assert "persistent" in report["data"]["feed"]
    assert report["figure"] == "curves.png" and (tmp_path / "run" / "curves.png").is_file()
