"""Every random number generator a run uses: seeding them, and saving and restoring their states.

Python's ``random``, NumPy's global generator, torch's CPU generator and every CUDA device's. The
data order does not depend on them (each epoch has its own generator, see :mod:`mptrain.data.feeds`);
weights initialisation, dropout and anything a user's code draws does.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device


def rng_states() -> dict[str, Any]:
    """The state of every generator (CUDA only where CUDA is available), in tensors and plain
    Python types only, so a checkpoint holding it loads with ``torch.load(weights_only=True)``."""
    name, keys, position, has_gauss, cached_gaussian = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": (
            name,
            torch.from_numpy(keys.astype(np.int64)),
            position,
            has_gauss,
            cached_gaussian,
        ),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def restore_rng_states(states: dict[str, Any]) -> None:
    """Put back what :func:`rng_states` returned."""
    random.setstate(tuple(states["python"]))
    name, keys, position, has_gauss, cached_gaussian = states["numpy"]
    keys = keys.numpy().astype(np.uint32)  # stored as int64 (see rng_states)
    np.random.set_state((name, keys, position, has_gauss, cached_gaussian))
    torch.set_rng_state(states["torch"])
    if states.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


# Independent random streams per (seed, epoch): the data order and the augmentation must not
# share draws (a crop offset would otherwise repeat the index that chose the sample). The
# stochastic rounding of weight updates (precision.update) draws from its own (epoch 0).
ORDER_STREAM, AUGMENT_STREAM, ROUNDING_STREAM = 0, 1, 2


def stream_seed(seed: int, epoch: int, stream: int, index: int = 0) -> int:
    """A 63-bit seed for sample ``index`` of ``stream`` in ``epoch``, the same on every platform."""
    # SeedSequence mixes the four numbers into well-separated seeds.
    entropy = [seed % 2**32, epoch, stream, index]
    return int(np.random.SeedSequence(entropy).generate_state(1, np.uint64)[0] >> 1)


def epoch_generator(
    seed: int, epoch: int, stream: int, device: torch.device | str = "cpu"
) -> torch.Generator:
    """A fresh generator on ``device`` seeded by (seed, epoch, stream) alone.

    An epoch's data never depends on earlier epochs, so a run resumed at epoch e sees the same
    batches as an uninterrupted one.
    """
    return torch.Generator(device=device).manual_seed(stream_seed(seed, epoch, stream))
