"""Image files to model inputs: the imagefolder pipeline's decoding and crops.

Two ways to the same batches (``dataset.decode_device``; docs/custom-code.md says what each does
for a user): ``cpu``, DataLoader workers decoding with PIL (:class:`DecodeCrop`, draft decoding
included), and ``cuda``, workers reading the bytes (:class:`EncodedImages`) and the main process
decoding and cropping the batch on the device (:class:`DeviceDecode`; the same code runs on a CPU
device in the tests). Both draw every sample's crop and flip from that sample's own seed
(:class:`mptrain.data.feeds.SeededTransforms` on the CPU, a ``torch.Generator`` per sample on the
device) with the same algorithm (:func:`crop_params`), so a sample gets the same crop box and flip
either way.

Bad files raise :class:`BadDataFile` naming the path wherever they are found (worker or main
process); ``dataset.skip_bad_files`` turns them into skipped, counted samples.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from mptrain.data.batches import DataError

# Draft scales libjpeg offers (Image.draft): decode at 1/8, 1/4, 1/2 of each side, or full size.
DRAFT_FACTORS = (8, 4, 2, 1)
JPEG_MAGIC = b"\xff\xd8\xff"
# What a decoder may raise on a file that is not a readable image (PIL: OSError, ValueError,
# SyntaxError; torchvision.io: RuntimeError).
_DECODE_ERRORS = (OSError, ValueError, SyntaxError, RuntimeError)


class BadDataFile(DataError):
    """A data file that does not decode; the message is one line naming it (also when raised in
    a DataLoader worker, see :class:`DataError`)."""


def bad_file(path: str, exc: BaseException) -> BadDataFile:
    """The BadDataFile for ``path``: its first line of ``exc`` (or the exception's type)."""
    what = (str(exc).splitlines() or [""])[0] or type(exc).__name__
    return BadDataFile(f"{path}: {what}")


def load_image(path: str) -> Any:
    """An RGB PIL image, or BadDataFile naming ``path`` and what is wrong with it (truncated, not
    an image, unreadable)."""
    from PIL import Image

    try:
        with open(path, "rb") as f:
            image = Image.open(f)
            return image.convert("RGB")  # decodes now: a truncated file fails here
    except (OSError, ValueError, SyntaxError) as exc:
        raise bad_file(path, exc) from exc


# ------------------------------------------------------------------------------------ crop rules
@dataclass(frozen=True)
class CropSpec:
    """What a sample becomes: with ``random`` (training augmentation) torchvision's
    RandomResizedCrop(``image_size``, ``scale``, ``ratio``) and a horizontal flip with probability
    1/2; else Resize(``resize_size``) (shorter side) and CenterCrop(``image_size``)."""

    image_size: int
    resize_size: int
    random: bool
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)


def crop_params(
    height: int, width: int, spec: CropSpec, generator: torch.Generator | None = None
) -> tuple[int, int, int, int]:
    """(top, left, h, w) of a random resized crop: torchvision's ``RandomResizedCrop.get_params``
    with its draws taken from ``generator`` (None: torch's global RNG), the same numbers in the
    same order, so one seed gives one crop on either pipeline."""
    area = height * width
    log_ratio = torch.log(torch.tensor(spec.ratio))
    for _ in range(10):
        fraction = torch.empty(1).uniform_(*spec.scale, generator=generator).item()
        draw = torch.empty(1).uniform_(log_ratio[0], log_ratio[1], generator=generator)
        aspect = torch.exp(draw).item()
        w = round(math.sqrt(area * fraction * aspect))
        h = round(math.sqrt(area * fraction / aspect))
        if 0 < w <= width and 0 < h <= height:
            top = torch.randint(0, height - h + 1, size=(1,), generator=generator).item()
            left = torch.randint(0, width - w + 1, size=(1,), generator=generator).item()
            return int(top), int(left), h, w
    in_ratio = width / height  # ten misses: torchvision's central fallback
    if in_ratio < min(spec.ratio):
        w, h = width, round(width / min(spec.ratio))
    elif in_ratio > max(spec.ratio):
        h, w = height, round(height * max(spec.ratio))
    else:
        h, w = height, width
    return (height - h) // 2, (width - w) // 2, h, w


def flip_draw(generator: torch.Generator | None = None) -> bool:
    """RandomHorizontalFlip's draw: one uniform number, flip below 1/2."""
    return bool(torch.rand(1, generator=generator) < 0.5)


def resize_shape(height: int, width: int, size: int) -> tuple[int, int]:
    """(h, w) after torchvision's Resize(size) of an image ``height`` x ``width``: the shorter
    side becomes ``size``, the longer keeps the aspect ratio (truncated)."""
    if height <= width:
        return size, int(size * width / height)
    return int(size * height / width), size


def draft_factor(covered_h: float, covered_w: float, needed: int) -> int:
    """The largest draft scale (8, 4, 2, 1) at which a region of ``covered_h`` x ``covered_w``
    source pixels still spans at least ``needed`` pixels both ways: decoding smaller then never
    upsamples more than the full-size decode would have."""
    return next(f for f in DRAFT_FACTORS if min(covered_h, covered_w) / f >= needed or f == 1)


# ------------------------------------------------------------------------------------ CPU (PIL)
class DecodeCrop:
    """The CPU pipeline's per-sample transform: a file path to a uint8 ``3 x S x S`` crop.

    Random draws come from torch's global RNG, which :class:`mptrain.data.feeds.SeededTransforms`
    seeds per (seed, epoch, sample). Without a draft (``draft`` false, a crop too small for one,
    or not a JPEG) the output is exactly torchvision's RandomResizedCrop + RandomHorizontalFlip
    (or Resize + CenterCrop) of the full decode.
    """

    def __init__(self, spec: CropSpec, draft: bool) -> None:
        self.spec = spec
        self.draft = draft

    def __call__(self, path: str) -> torch.Tensor:
        """The crop of the image at ``path``; BadDataFile naming it when it does not decode."""
        from PIL import Image
        from torchvision.transforms import functional as F

        try:
            with open(path, "rb") as f:
                image = Image.open(f)
                crop = self._crop(image) if self.spec.random else self._centre(image)
        except (OSError, ValueError, SyntaxError) as exc:
            raise bad_file(path, exc) from exc
        return F.pil_to_tensor(crop)

    def _decode(self, image: Any, factor: int) -> tuple[Any, float]:
        """(the RGB image decoded at 1/``factor`` scale where the file allows, the scale used)."""
        width, height = image.size
        scale = 1.0
        if factor > 1:
            drafted = image.draft("RGB", (width // factor, height // factor))
            if drafted is not None:  # a JPEG: box = the full image in reduced coordinates
                scale = width / drafted[1][2]
        return image.convert("RGB"), scale

    def _crop(self, image: Any) -> Any:
        """RandomResizedCrop + flip, the crop drawn on the full-size header dimensions."""
        from PIL import Image
        from torchvision.transforms import functional as F

        size, (width, height) = self.spec.image_size, image.size
        top, left, h, w = crop_params(height, width, self.spec)
        factor = draft_factor(h, w, size) if self.draft else 1
        image, scale = self._decode(image, factor)
        if scale == 1:
            out = F.resized_crop(image, top, left, h, w, [size, size], antialias=True)
        else:  # the same box in the reduced image's coordinates (sub-pixel)
            box = (left / scale, top / scale, (left + w) / scale, (top + h) / scale)
            out = image.resize((size, size), Image.Resampling.BILINEAR, box=box)
        return F.hflip(out) if flip_draw() else out

    def _centre(self, image: Any) -> Any:
        """Resize (shorter side to resize_size) + CenterCrop, sized from the full-size header."""
        from PIL import Image
        from torchvision.transforms import functional as F

        spec, (width, height) = self.spec, image.size
        factor = draft_factor(height, width, spec.resize_size) if self.draft else 1
        image, scale = self._decode(image, factor)
        if scale == 1:
            resized = F.resize(image, [spec.resize_size], antialias=True)
        else:
            h, w = resize_shape(height, width, spec.resize_size)
            box = (0, 0, width / scale, height / scale)
            resized = image.resize((w, h), Image.Resampling.BILINEAR, box=box)
        return F.center_crop(resized, [spec.image_size])


# -------------------------------------------------------------------------------- device decode
@dataclass
class EncodedBatch:
    """A batch as workers send it for device decoding: every sample's bytes in one flat uint8
    tensor (one shared-memory block per batch, not one per file), cut by ``lengths``; files that
    are not JPEG arrive decoded (``pixels[k]``, uint8 3 x H x W, and length 0)."""

    data: torch.Tensor
    lengths: list[int]
    pixels: dict[int, torch.Tensor]
    indices: list[int]  # dataset indices: each sample's augmentation seed
    paths: list[str]


class EncodedImages(torch.utils.data.Dataset):
    """An ImageFolder's samples as ``((bytes or pixels, index, path), label)`` for device decoding.

    JPEG files are read, not decoded (``torchvision.io.read_file``); other formats are decoded
    here in the worker (``torchvision.io.decode_image``, RGB), since nvJPEG reads only JPEG.
    BadDataFile names a file that cannot be read or decoded here.
    """

    def __init__(self, folder: Any) -> None:
        self.folder = folder  # torchvision.datasets.ImageFolder (its samples)

    def __len__(self) -> int:
        return len(self.folder.samples)

    def __getitem__(self, index: int) -> tuple[tuple[torch.Tensor, int, str], int]:
        """Sample ``index``: its encoded bytes (or decoded pixels), index, path, and label."""
        from torchvision import io

        path, label = self.folder.samples[index]
        try:
            with warnings.catch_warnings():  # torchvision 0.29 deprecates io (for torchcodec)
                warnings.simplefilter("ignore", DeprecationWarning)
                data = io.read_file(path)
                if bytes(data[:3].tolist()) != JPEG_MAGIC:
                    data = io.decode_image(data, mode=io.ImageReadMode.RGB)
        except _DECODE_ERRORS as exc:
            raise bad_file(path, exc) from exc
        return (data, index, path), label


def collate_encoded(samples: list[Any]) -> tuple[EncodedBatch | None, torch.Tensor, int]:
    """Pack :class:`EncodedImages` samples into one :class:`EncodedBatch`, with their labels and
    how many samples were None (unreadable files under ``skip_bad_files``)."""
    good = [s for s in samples if s is not None]
    if not good:
        return None, torch.empty(0, dtype=torch.long), len(samples)
    chunks, lengths, pixels = [], [], {}
    for k, ((data, _, _), _) in enumerate(good):
        if data.dim() == 1:
            chunks.append(data)
            lengths.append(len(data))
        else:
            pixels[k] = data
            lengths.append(0)
    flat = torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.uint8)
    indices = [index for (_, index, _), _ in good]
    paths = [path for (_, _, path), _ in good]
    labels = torch.tensor([label for _, label in good], dtype=torch.long)
    return EncodedBatch(flat, lengths, pixels, indices, paths), labels, len(samples) - len(good)


def normalise(images: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """uint8 ``N x C x H x W`` to float ``(x / 255 - mean) / std``: ToTensor then Normalize, the
    same float32 operations in the same order, so the CPU pipeline's batches are unchanged."""
    return images.float().div_(255).sub_(mean).div_(std)


class DeviceDecode:
    """The main-process half of device decoding: an :class:`EncodedBatch` to normalised float
    crops on ``device``. ``seed_of(epoch, index)``: a sample's augmentation seed (the one
    SeededTransforms uses), so a sample's crop and flip match the CPU pipeline's. A JPEG that the
    device decoder rejects (nvJPEG: CMYK, some progressive files) is decoded on the host instead and
    counted (``host_decoded``); one no decoder reads is a BadDataFile, or skipped with
    ``skip_bad``."""

    def __init__(
        self,
        spec: CropSpec,
        device: torch.device,
        mean: tuple[float, ...],
        std: tuple[float, ...],
        seed_of: Callable[[int, int], int],
        skip_bad: bool,
    ) -> None:
        self.spec, self.device, self.seed_of, self.skip_bad = spec, device, seed_of, skip_bad
        self.mean = torch.tensor(mean, device=device).view(1, -1, 1, 1)
        self.std = torch.tensor(std, device=device).view(1, -1, 1, 1)
        self.host_decoded = 0

    def __call__(
        self, batch: EncodedBatch, labels: torch.Tensor, epoch: int
    ) -> tuple[torch.Tensor | None, torch.Tensor, int]:
        """(images, labels of the samples that decoded, how many did not) of ``epoch``'s batch."""
        decoded = self._decode(batch)
        kept = [k for k, image in enumerate(decoded) if image is not None]
        labels = labels[kept].to(self.device, non_blocking=True)
        if not kept:
            return None, labels, len(decoded)
        crops = [self._crop(decoded[k], epoch, batch.indices[k]) for k in kept]
        return normalise(torch.stack(crops), self.mean, self.std), labels, len(decoded) - len(kept)

    def _decode(self, batch: EncodedBatch) -> list[torch.Tensor | None]:
        """Every sample as uint8 ``3 x H x W`` on the device (None: skipped bad file)."""
        images: list[torch.Tensor | None] = [None] * len(batch.lengths)
        ends = torch.tensor(batch.lengths).cumsum(0).tolist()
        jpegs = [k for k, n in enumerate(batch.lengths) if n]
        encoded = [batch.data[ends[k] - batch.lengths[k] : ends[k]] for k in jpegs]
        with warnings.catch_warnings():  # torchvision 0.29 deprecates io (for torchcodec)
            warnings.simplefilter("ignore", DeprecationWarning)
            decoded = self._decode_jpegs(encoded, [batch.paths[k] for k in jpegs])
        for k, image in zip(jpegs, decoded, strict=True):
            images[k] = image
        for k, pixels in batch.pixels.items():
            images[k] = pixels.to(self.device, non_blocking=True)
        return images

    def _decode_jpegs(self, encoded: list[torch.Tensor], paths: list[str]) -> list[Any]:
        """The JPEGs decoded in one call (nvJPEG decodes a list in one go); when that call fails
        (it fails whole), one at a time to find the file(s)."""
        from torchvision import io

        if not encoded:
            return []
        try:
            return io.decode_jpeg(encoded, mode=io.ImageReadMode.RGB, device=self.device)
        except RuntimeError:
            return [self._decode_one(e, path) for e, path in zip(encoded, paths, strict=True)]

    def _decode_one(self, encoded: torch.Tensor, path: str) -> torch.Tensor | None:
        """One JPEG on the device, else on the host (counted), else BadDataFile (or None)."""
        from torchvision import io

        try:
            return io.decode_jpeg(encoded, mode=io.ImageReadMode.RGB, device=self.device)
        except RuntimeError:
            pass
        try:
            image = io.decode_image(encoded, mode=io.ImageReadMode.RGB)
        except RuntimeError as exc:
            if self.skip_bad:
                return None
            raise bad_file(path, exc) from exc
        self.host_decoded += 1
        return image.to(self.device)

    def _crop(self, image: torch.Tensor, epoch: int, index: int) -> torch.Tensor:
        """The sample's crop: its own generator draws what DecodeCrop draws from the global RNG."""
        from torchvision.transforms.v2 import functional as F

        spec = self.spec
        if not spec.random:
            resized = F.resize(image, [spec.resize_size], antialias=True)
            return F.center_crop(resized, [spec.image_size])
        generator = torch.Generator().manual_seed(self.seed_of(epoch, index))
        _, height, width = image.shape
        top, left, h, w = crop_params(height, width, spec, generator)
        size = [spec.image_size, spec.image_size]
        out = F.resized_crop(image, top, left, h, w, size, antialias=True)
        return F.horizontal_flip(out) if flip_draw(generator) else out
