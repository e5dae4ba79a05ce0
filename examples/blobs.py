"""A small custom dataset for mptrain: ``dataset=custom dataset._target_=blobs.make_blobs``.

It makes its own data (nothing is downloaded): each class is a bright square at its own place in
an otherwise noisy image. The contract mptrain expects: a callable returning ``(train, val)``,
two torch Datasets whose samples are ``(float C x H x W tensor, int label)``; the number of
classes comes from the training set's ``classes`` attribute (or ``+dataset.num_classes=N``).
TensorDatasets are fed from memory by tensor indexing; other datasets go through DataLoader
workers.
"""

import torch
from torch.utils.data import TensorDataset


def _split(n: int, num_classes: int, size: int, generator: torch.Generator) -> TensorDataset:
    labels = torch.randint(0, num_classes, (n,), generator=generator)
    images = torch.randn(n, 1, size, size, generator=generator) * 0.5
    side = size // 2
    for label in range(num_classes):
        row, col = divmod(label, 2)  # the class's quadrant (2 x 2 grid, wrapping after 4)
        row %= 2
        mask = labels == label
        images[mask, :, row * side : (row + 1) * side, col * side : (col + 1) * side] += 1.5
    return TensorDataset(images, labels)


def make_blobs(
    num_train: int = 512, num_val: int = 128, size: int = 8, seed: int = 0
) -> tuple[TensorDataset, TensorDataset]:
    """(train, val) of 1 x size x size images in 4 classes, the same for a given seed."""
    generator = torch.Generator().manual_seed(seed)
    train = _split(num_train, 4, size, generator)
    val = _split(num_val, 4, size, generator)
    train.classes = ["top-left", "top-right", "bottom-left", "bottom-right"]
    return train, val
