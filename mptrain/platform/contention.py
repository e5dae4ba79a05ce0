"""Whether this machine was busy while something was timed: speed figures taken while other work
competed for the cores say little about the code (measured here: torch's default threads ran 48×
slower under load 8.5 on 2 cores). :func:`judge` compares a :func:`sample` taken before the timed
work with one taken after it. Linux only for the CPU time counters; elsewhere the load average
alone (or nothing) is judged, and the result says so.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# Others' load (runnable tasks not ours, on average) at or above this share of the usable cores,
# or stolen CPU time at or above STEAL_SHARE of the elapsed CPU time: the machine was busy.
BUSY_LOAD_SHARE = 0.5
STEAL_SHARE = 0.05
_PROC_STAT = Path("/proc/stat")


@dataclass(frozen=True)
class LoadSample:
    """The machine's load at one moment: ``load_1m`` (None where the OS has no load average) and
    the aggregate CPU time counters (user nice system idle iowait irq softirq steal ...; None
    without /proc/stat)."""

    load_1m: float | None
    cpu_times: tuple[int, ...] | None
    at: float


def affinity_cpus() -> int:
    """CPUs this process may run on (``os.cpu_count()`` where affinity is not available)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def sample(proc_stat: Path = _PROC_STAT) -> LoadSample:
    """The load average and the CPU time counters now (cheap: two small reads)."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        load = None
    try:
        first = proc_stat.read_text().splitlines()[0].split()
        times = tuple(int(v) for v in first[1:]) if first[0] == "cpu" else None
    except (OSError, IndexError, ValueError):
        times = None
    return LoadSample(load, times, time.monotonic())


def judge(before: LoadSample, after: LoadSample, own_threads: int, cores: int) -> dict[str, Any]:
    """Whether the machine was busy between ``before`` and ``after`` (plain types, for reports).

    Others' load is estimated from the load average both ways round, keeping the larger: before
    the work, less the one task this process may have been (it was starting up), and after it,
    less the ``own_threads`` the work kept busy. Steal is the share of CPU time a hypervisor took
    between the samples. ``busy`` when others' load reaches :data:`BUSY_LOAD_SHARE` of the
    usable ``cores`` or steal reaches :data:`STEAL_SHARE`.
    """
    others = _others_load(before, after, own_threads)
    steal = _steal_share(before, after)
    busy = (others is not None and others >= BUSY_LOAD_SHARE * cores) or (
        steal is not None and steal >= STEAL_SHARE
    )
    return {
        "busy": busy,
        "cores": cores,
        "others_load": None if others is None else round(others, 2),
        "load_1m": [before.load_1m, after.load_1m],
        "steal_share": None if steal is None else round(steal, 4),
        "words": describe(busy, others, steal, cores),
    }


def judged_since(before: LoadSample, device: torch.device) -> dict[str, Any]:
    """:func:`judge` from ``before`` to now, for work timed on ``device``: on a CPU it kept
    torch's intra-op threads busy, on a GPU one host thread; the cores are this process's
    (:func:`affinity_cpus`)."""
    import torch  # here: readers of busy_words (mptrain-compare, report rendering) need no torch

    own = torch.get_num_threads() if device.type == "cpu" else 1
    return judge(before, sample(), own, affinity_cpus())


def busy_words(machine_load: dict[str, Any] | None) -> str | None:
    """The words of a :func:`judge` result that found the machine busy; None when it was quiet
    or not judged (reports written before it was measured have none)."""
    return machine_load["words"] if machine_load and machine_load["busy"] else None


def describe(busy: bool, others: float | None, steal: float | None, cores: int) -> str:
    """``busy: others' load ~3.4 on 2 cores`` / ``quiet (others' load ~0.1 on 2 cores)``."""
    if others is None and steal is None:
        return "unknown (no load average or CPU counters here)"
    parts = []
    if others is not None:
        parts.append(f"others' load ~{others:.1f} on {cores} core{'s' if cores != 1 else ''}")
    if steal:
        parts.append(f"{steal:.0%} of CPU time stolen")
    return f"busy: {', '.join(parts)}" if busy else f"quiet ({', '.join(parts)})"


def others_load(at: LoadSample, own_threads: int) -> float | None:
    """Others' load at one sample: the 1-minute load average less the ``own_threads`` this
    process kept runnable, at least 0; None where the OS has no load average."""
    return None if at.load_1m is None else max(0.0, at.load_1m - own_threads)


def _others_load(before: LoadSample, after: LoadSample, own_threads: int) -> float | None:
    estimates = [others_load(before, 1), others_load(after, own_threads)]
    return max((e for e in estimates if e is not None), default=None)


def _steal_share(before: LoadSample, after: LoadSample) -> float | None:
    """Stolen CPU time (the 8th counter) over all CPU time elapsed between the samples."""
    if before.cpu_times is None or after.cpu_times is None or len(after.cpu_times) < 8:
        return None
    deltas = [a - b for a, b in zip(after.cpu_times, before.cpu_times, strict=False)]
    total = sum(deltas[:8])  # guest times are already counted in user/nice
    return deltas[7] / total if total > 0 else None
