"""What rank 0 knows of the other ranks when a distributed run ends early: which ranks asked to
stop and by which signal (agreed at the step they stopped after: :func:`stop_words`), and which
rank was lost (:class:`LastWords`; what the report says, in words:
docs/distributed.md#a-lost-rank-is-named).

Each rank leaves its last word in the job's key-value store (the one the ranks met in: rank 0's
process group hosts it, or torchrun's agent): ``training`` once its job starts, then how it ended.
When a collective fails on rank 0, a rank still ``training`` :data:`SILENCE_S` seconds later went
without a word (:data:`LOST`), and a rank that failed on its own (not in a collective) says how.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import signal
import time

import torch.distributed as dist

from mptrain.platform.distributed import DistContext
from mptrain.train.loop import STOP_ASKED

KEY = "mptrain/last_word/"
TRAINING = "training"
SILENCE_S = 5.0  # how long rank 0 waits for the other ranks' words once a collective failed
LOST = "gave no word: killed (SIGKILL, the out-of-memory killer), hung, or its node was lost"
COLLECTIVE = "failed in a collective"  # a rank that failed because another went: not a cause
# Gloo raises a plain RuntimeError from its transport when a peer's connection goes; NCCL and the
# store raise torch.distributed's own errors (DistBackendError, DistNetworkError, ...).
_GLOO_TRANSPORT = "gloo/transport/"


def failure_word(exc: BaseException) -> str:
    """A failing rank's last word: :data:`COLLECTIVE` when a collective failed (a peer went, or
    the timeout passed), else ``failed: <its exception>``."""
    if isinstance(exc, dist.DistError) or _GLOO_TRANSPORT in str(exc):
        return f"{COLLECTIVE}: {type(exc).__name__}"
    return f"failed: {type(exc).__name__}: {str(exc)[:200]}"


class LastWords:
    """This rank's last word in the job's store, and rank 0's reading of the others' (see the
    module doc). Does nothing for a single process, or where the store cannot be reached."""

    def __init__(self, ctx: DistContext) -> None:
        self.ctx = ctx
        self.store = _store(ctx) if ctx.enabled else None

    def say(self, word: str) -> None:
        if self.store is None:
            return
        with contextlib.suppress(RuntimeError, OSError):  # the store went with its host
            self.store.set(f"{KEY}{self.ctx.rank}", word)

    def heard(self) -> dict[int, str | None]:
        """Every other rank's last word (None: none yet)."""
        out: dict[int, str | None] = {}
        for rank in range(self.ctx.world_size):
            if rank == self.ctx.rank:
                continue
            key = f"{KEY}{rank}"
            try:
                out[rank] = self.store.get(key).decode() if self.store.check([key]) else None
            except (RuntimeError, OSError):
                out[rank] = None
        return out

    def lost(self, wait_s: float = SILENCE_S) -> dict[int, str]:
        """The ranks that caused the end, each with how: those still without a word after
        ``wait_s`` (:data:`LOST`), and those that failed on their own, in their words."""
        if self.store is None:
            return {}
        deadline = time.monotonic() + wait_s
        words = self.heard()
        while any(w in (None, TRAINING) for w in words.values()) and time.monotonic() < deadline:
            time.sleep(0.2)
            words = self.heard()
        out = {rank: LOST for rank, w in words.items() if w in (None, TRAINING)}
        for rank, word in words.items():
            if word and word.startswith("failed:"):  # on its own, not in a collective
                out[rank] = word
        return out


def _store(ctx: DistContext) -> dist.Store | None:
    """A client of the store the ranks met in (MASTER_ADDR:MASTER_PORT), or None."""
    try:
        return dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=dt.timedelta(seconds=SILENCE_S),
        )
    except (KeyError, ValueError, RuntimeError, OSError):
        return None


def lost_words(lost: dict[int, str]) -> str:
    """``rank 1 lost: ...`` for the report's reason."""
    return "; ".join(f"rank {rank} lost: {how}" for rank, how in sorted(lost.items()))


def stop_words(asked: dict[int, int], world_size: int) -> str | None:
    """Which ranks asked to stop and how, in words (None: none, or one process): the signal's
    name alone when every rank got the same one (torchrun passes its signal on), ``SIGTERM on
    rank 1`` when not."""
    if not asked:
        return None
    names = {rank: _signal_name(code) for rank, code in sorted(asked.items())}
    if len(asked) == world_size and len(set(names.values())) == 1:
        return next(iter(names.values()))
    by_name: dict[str, list[int]] = {}
    for rank, name in names.items():
        by_name.setdefault(name, []).append(rank)
    return ", ".join(
        f"{name} on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
        for name, ranks in by_name.items()
    )


def _signal_name(code: int) -> str:
    return "a stop request" if code == STOP_ASKED else signal.Signals(code).name


def stop_exit_code(asked: dict[int, int]) -> int:
    """128 + the first signal a rank got (this rank's exit code when another rank got it)."""
    return 128 + next((c for c in asked.values() if c != STOP_ASKED), 0)
