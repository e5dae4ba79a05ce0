"""How many intra-op threads a process may use here: the ``threads`` key's starting count.

``threads=auto`` starts from the CPUs this process may run on (``os.sched_getaffinity``), capped
by the cgroup's CPU quota (cgroup v2 ``cpu.max``, v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``),
divided among the jobs that share the machine (a joblib sweep's ``n_jobs``, the processes of one
torchrun node), less the DataLoader worker processes that run on the same cores. ``threads=N``
pins N; so does ``OMP_NUM_THREADS=N`` in the environment under ``threads=auto`` (the user's own
pin, recorded as such), except in a joblib sweep's jobs, whose workers joblib gives one. :func:`resolve_threads` decides and says why; :func:`apply_threads` sets it
(``torch.set_num_threads``). On a CPU device the training loop then measures the count against
fewer on real steps (:mod:`mptrain.train.threads`); nothing here measures.

Why it matters: torch's default is one thread per core, and OpenMP threads spin at barriers, so
with other work on the cores two threads ran 48× slower than one on the 2-core development
machine. ``OMP_WAIT_POLICY`` cannot change once torch has started OpenMP; the thread count can.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from mptrain.config.base import ConfigError
from mptrain.platform.contention import affinity_cpus

CGROUP_ROOT = Path("/sys/fs/cgroup")


@dataclass(frozen=True)
class CpuBudget:
    """The cores one job may use, and what limited them."""

    affinity: int  # CPUs this process may run on
    quota: float | None  # the cgroup's CPU quota in CPUs; None: no quota (or none readable)
    jobs: int  # jobs sharing these cores (joblib sweep jobs x torchrun processes on this node)
    workers: int  # DataLoader worker processes of this job, counted against its cores
    threads: int  # what is left for the intra-op threads, at least 1

    def describe(self) -> str:
        """``affinity 2 CPUs, cgroup quota none, 1 job, 0 DataLoader workers -> 2``."""
        quota = "none" if self.quota is None else f"{self.quota:g} CPUs"
        jobs = f"{self.jobs} job" + ("s sharing them" if self.jobs > 1 else "")
        return (
            f"affinity {self.affinity} CPUs, cgroup quota {quota}, {jobs}, "
            f"{self.workers} DataLoader workers -> {self.threads}"
        )


@dataclass(frozen=True)
class ThreadChoice:
    """What ``threads`` became for this process."""

    requested: str  # "auto" or the pinned count, as given
    threads: int  # set with torch.set_num_threads
    mode: str  # "auto" (measured in training), "pinned", or "auto, not measured" (see basis)
    basis: str  # why this count, in words (the budget, or "pinned by threads=N")

    @property
    def measure(self) -> bool:
        """The training loop measures this count against fewer (``threads=auto`` on a CPU)."""
        return self.mode == "auto"


def cgroup_quota_cpus(root: Path = CGROUP_ROOT) -> float | None:
    """The CPU quota of the cgroup mounted at ``root``, in CPUs; None when there is none.

    cgroup v2: ``cpu.max`` holds ``"<quota> <period>"`` or ``"max <period>"``. cgroup v1: the
    quota and period files under ``cpu/`` (or ``root`` itself when it is the cpu controller);
    a quota of -1 means none. Unreadable or malformed files count as no quota, as a machine
    without cgroups has none.
    """
    v2 = root / "cpu.max"
    if v2.is_file():
        return _quota(*v2.read_text().split()[:2])
    for folder in (root / "cpu", root / "cpu,cpuacct", root):
        quota, period = folder / "cpu.cfs_quota_us", folder / "cpu.cfs_period_us"
        if quota.is_file() and period.is_file():
            return _quota(quota.read_text().strip(), period.read_text().strip())
    return None


def _quota(quota: str, period: str = "100000") -> float | None:
    try:
        q, p = int(quota), int(period)
    except ValueError:  # "max": no quota
        return None
    return q / p if q > 0 and p > 0 else None


def cpu_budget(workers: int = 0, jobs: int = 1, root: Path = CGROUP_ROOT) -> CpuBudget:
    """The intra-op threads one of ``jobs`` jobs may use: min(affinity, quota rounded down, at
    least 1) divided among the jobs, less ``workers``; at least 1."""
    affinity, quota = affinity_cpus(), cgroup_quota_cpus(root)
    cores = affinity if quota is None else max(1, min(affinity, math.floor(quota)))
    threads = max(1, cores // max(1, jobs) - workers)
    return CpuBudget(affinity, quota, max(1, jobs), workers, threads)


def parse_threads(value: str) -> int | None:
    """``"auto"`` -> None; ``"N"`` (N >= 1) -> N; anything else raises ValueError."""
    if str(value).strip().lower() == "auto":
        return None
    count = int(value)
    if count < 1:
        raise ValueError(f"threads={value}: needs at least 1 (or auto)")
    return count


def resolve_threads(
    requested: str,
    device_type: str,
    *,
    workers: int = 0,
    jobs: int = 1,
    measure: bool = True,
    root: Path = CGROUP_ROOT,
) -> ThreadChoice:
    """Decide this process's intra-op thread count (see the module doc).

    ``measure=False``: where the caller times precisions itself (bench, advise) or does not train
    (eval), ``auto`` keeps the budget's count. On a CUDA device the count only sets the host's
    threads (the CPU side of the step); the GPU's speed does not depend on it, so it is not
    measured.
    """
    pinned = parse_threads(requested)
    if pinned is not None:
        _check_sane("threads", pinned)
    on_cuda = device_type == "cuda"
    host = " (CUDA device: host threads only)" if on_cuda else ""
    if pinned is not None:
        return ThreadChoice(str(requested), pinned, "pinned", f"pinned by threads={pinned}{host}")
    # A joblib worker always has OMP_NUM_THREADS (joblib sets cores // n_jobs unless the parent
    # had one): there it is not the user's pin, and auto divides the cores itself.
    from_env = _environment_threads() if jobs == 1 else None
    if from_env is not None:  # the user's own pin, the common workaround: respected as such
        _check_sane("OMP_NUM_THREADS", from_env, " in the environment")
        basis = f"pinned by OMP_NUM_THREADS={from_env} in the environment{host}"
        return ThreadChoice("auto", from_env, "pinned", basis)
    budget = cpu_budget(workers, jobs, root)
    basis = budget.describe()
    if on_cuda:
        mode, basis = "auto, not measured", f"{basis}{host}"
    elif not measure:
        mode = "auto, not measured"
    else:
        mode = "auto"
    return ThreadChoice("auto", budget.threads, mode, basis)


# A pinned count beyond this many threads per usable CPU is refused: oversubscription that large
# only slows a run down, and far beyond it libgomp aborts or the process segfaults (threads=20000
# aborted, 100000 segfaulted, leaving no report and the run directory's lock behind).
MAX_THREADS_PER_CPU = 4


def _check_sane(key: str, count: int, where: str = "") -> None:
    """ConfigError naming ``key`` when ``count`` exceeds MAX_THREADS_PER_CPU x the usable CPUs."""
    cpus = affinity_cpus()
    most = MAX_THREADS_PER_CPU * cpus
    if count > most:
        raise ConfigError(
            f"{key}={count}{where}: more than {MAX_THREADS_PER_CPU} threads per usable CPU "
            f"({cpus} here): at most {most}, or threads=auto"
        )


def _environment_threads() -> int | None:
    """``OMP_NUM_THREADS`` when it holds a count of at least 1 (torch reads it at start-up)."""
    try:
        count = int(os.environ.get("OMP_NUM_THREADS", ""))
    except ValueError:
        return None
    return count if count >= 1 else None


def apply_threads(choice: ThreadChoice) -> None:
    """Set torch's intra-op thread count for this process (what later steps use)."""
    torch.set_num_threads(choice.threads)


def sweep_jobs(n_jobs: int | None) -> int:
    """Concurrent jobs of a joblib sweep from its ``n_jobs`` (joblib's reading: -1 = one per CPU,
    -2 = all but one, ...); 1 for None (jobs one after another)."""
    if n_jobs is None or n_jobs == 0:
        return 1
    if n_jobs < 0:
        return max(1, affinity_cpus() + 1 + n_jobs)
    return n_jobs
