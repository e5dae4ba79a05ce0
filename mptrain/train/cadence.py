"""When periodic work is due by the clock: ``eval_every_minutes`` and ``checkpoint.every_minutes``.

Step and epoch cadences are exact and the same on every rank. A clock is not: two ranks of a
distributed run would read their clocks at slightly different moments, and a checkpoint (a
collective under FSDP) or an evaluation (an all-reduce) taken by one rank and not the other would
hang the job. So in a distributed run the clock is consulted only at log rows (every
``log_every`` steps), where rank 0's answer is broadcast to all ranks; a single process consults it
after every step (one ``time.monotonic()`` call).
"""

from __future__ import annotations

import time

import torch

from mptrain.platform.distributed import DistContext, broadcast_flag


def now() -> float:
    """The clock cadences read (seconds; tests replace it)."""
    return time.monotonic()


class TimeCadence:
    """Due once ``minutes`` have passed since :meth:`restart` (made at construction: the loop's
    start; then each time the work is done). ``minutes=None``: never due."""

    def __init__(self, minutes: float | None) -> None:
        self.minutes = minutes
        self.last = now()

    def restart(self) -> None:
        self.last = now()

    def due(self, step: int, log_every: int, dist: DistContext, device: torch.device) -> bool:
        """Whether the work is due after ``step``, the same answer on every rank (module doc)."""
        if self.minutes is None:
            return False
        if not dist.enabled:
            return self._elapsed()
        if step % log_every:
            return False
        return broadcast_flag(self._elapsed() and dist.is_main, dist, device)

    def _elapsed(self) -> bool:
        return now() - self.last >= 60.0 * self.minutes
