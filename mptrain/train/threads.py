"""The intra-op thread count, the ``threads`` key: where it starts and how training measures it
(the rules in words, with the measurements behind them: docs/configuration.md#cpu-threads-threads).

:func:`resolve_threads` decides where it starts, and says why: the cores this job may use
(:func:`cpu_budget`), or a pin (``threads=N``, or the user's ``OMP_NUM_THREADS``);
:func:`mptrain.train.build.choose_threads` sets it (``torch.set_num_threads``; ``OMP_WAIT_POLICY``
cannot change once torch has started OpenMP, the count can). With ``threads=auto`` on a CPU a
:class:`ThreadTuner` times real training steps at the candidate counts: only the step time tells
which is fastest now (OpenMP threads spin at barriers, so on a busy machine fewer can be far
faster); the load only says when to look again. What was measured and every change of the count
go to the report (:func:`threads_section`).

Call order: :meth:`ThreadTuner.before_step` and :meth:`ThreadTuner.after_step` around every
optimizer step (the monitor calls them; CPU steps are synchronous, so the clock measures the
step). Evaluations and checkpoints between steps are not timed.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mptrain.checkpoint.file import Found
from mptrain.config.base import ConfigError
from mptrain.platform import contention
from mptrain.platform.contention import affinity_cpus
from mptrain.report.schema import ThreadsSection

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
    on_cuda = device_type == "cuda"
    host = " (CUDA device: host threads only)" if on_cuda else ""
    if pinned is not None:
        _check_sane("threads", pinned)
        return ThreadChoice(str(requested), pinned, "pinned", f"pinned by threads={pinned}{host}")
    # A joblib worker always has OMP_NUM_THREADS (joblib sets cores // n_jobs unless the parent
    # had one): there it is not the user's pin, and auto divides the cores itself.
    from_env = _environment_threads() if jobs == 1 else None
    if from_env is not None:  # the user's own pin, the common workaround: respected as such
        _check_sane("OMP_NUM_THREADS", from_env, " in the environment")
        basis = f"pinned by OMP_NUM_THREADS={from_env} in the environment{host}"
        return ThreadChoice("auto", from_env, "pinned", basis)
    budget = cpu_budget(workers, jobs, root)
    mode = "auto" if measure and not on_cuda else "auto, not measured"
    return ThreadChoice("auto", budget.threads, mode, f"{budget.describe()}{host}")


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


def sweep_jobs(n_jobs: int | None) -> int:
    """Concurrent jobs of a joblib sweep from its ``n_jobs`` (joblib's reading: -1 = one per CPU,
    -2 = all but one, ...); 1 for None (jobs one after another)."""
    if n_jobs is None or n_jobs == 0:
        return 1
    if n_jobs < 0:
        return max(1, affinity_cpus() + 1 + n_jobs)
    return n_jobs


def kept_from_checkpoint(choice: ThreadChoice, found: Found | None) -> ThreadChoice:
    """A resumed ``threads=auto`` run on a CPU (``found``: the checkpoint resumed, as
    :func:`mptrain.checkpoint.file.resolve_resume` gives it): the count in effect when the
    checkpoint was written (recorded there), set, and not measured again. The count changes the order of
    floating-point sums, so resuming at another count (or measuring counts again) would not
    reproduce the uninterrupted run bit for bit. ``choice`` itself without a checkpoint, for
    checkpoints that recorded no count, or where the count is pinned or not measured."""
    payload = found[1] if found is not None else {}
    saved = payload.get("threads")
    if not choice.measure or not isinstance(saved, int) or saved < 1:
        return choice
    step = payload.get("loop", {}).get("step")
    kept = ThreadChoice(
        choice.requested, saved, "auto, kept from the checkpoint",
        f"{saved}, the count in effect at the checkpoint's step {step} (resumed bit for bit; "
        f"this machine's budget: {choice.threads})",
    )  # fmt: skip
    torch.set_num_threads(saved)
    return kept


# The re-check compares windows of log_every steps, but never fewer than this: with log_every=1
# one slow step (a page fault, a scheduler hiccup) would start a measurement.
MIN_WINDOW_STEPS = 20
# Below the starting count, the candidates are measured again after this many windows, doubling
# after each upward re-check that keeps a lower count, up to the cap: under a load that stays, a
# collapsed count's one slow step is then paid every 32 windows, not every window.
RECHECK_FIRST_WINDOWS = 2
RECHECK_MAX_WINDOWS = 32
# Others' load has fallen when it is at most this share of its peak since the last measurement
# and at least this many cores lower: the 1-minute load average moves by a few tenths on its own.
LOAD_FALL_SHARE = 0.5
LOAD_FALL_CORES = 1.0


def load_fell(peak: float | None, now: float | None) -> bool:
    """Others' load fell from ``peak`` to ``now`` (see :data:`LOAD_FALL_SHARE`); False when
    either is unknown."""
    if peak is None or now is None:
        return False
    return now <= LOAD_FALL_SHARE * peak and peak - now >= LOAD_FALL_CORES


def candidates_for(start: int) -> list[int]:
    """The counts measured: ``start``, ``start // 2`` when start > 2, and 1 (no duplicates)."""
    counts = [start, start // 2 if start > 2 else 1, 1]
    return list(dict.fromkeys(counts))


class ThreadTuner:
    """Measures thread counts on real training steps (nothing is repeated) from the starting
    count N, and keeps the fastest:

    1. the first step runs at N untimed (lazy initialisation makes it slow whatever the count);
    2. ``rounds`` rounds of one step per candidate (:func:`candidates_for`), alternating, so a
       change of load hits every candidate alike; a candidate whose fastest step took more than
       ``drop_ratio`` x the fastest step seen is dropped (a collapsed count costs one step, not
       ``rounds``); the lowest median step time is kept;
    3. then, every ``window`` steps, the window's steps/s is compared with the best window at the
       kept count: below ``slow_ratio`` x that best, the candidates are measured again (the best
       restarts after each measurement, so a load that stays does not trigger one every window);
    4. below N, a window does not get faster when the load leaves, so two upward re-checks
       measure again: when others' load fell (:func:`load_fell`), and periodically
       (:data:`RECHECK_FIRST_WINDOWS`), whatever the load (a wrong or missing reading cannot keep
       the count low for good). Back at N, neither runs.
    """

    def __init__(  # noqa: PLR0913 (a constructor: the tuner's settings, named)
        self,
        choice: ThreadChoice,
        window: int = 50,
        rounds: int = 3,
        slow_ratio: float = 0.5,
        drop_ratio: float = 4.0,
        set_threads: Callable[[int], None] = torch.set_num_threads,
        clock: Callable[[], float] = time.perf_counter,
        say: Callable[[str], None] | None = None,
        load: Callable[[], contention.LoadSample] = contention.sample,
    ) -> None:
        self.choice = choice
        self.say = say  # one line per measurement (the job's log: terminal and .log file)
        # Told (step, why) when the count changes: the progress display estimates again.
        self.on_change: Callable[[int, str], None] | None = None
        self.start_count = choice.threads
        self.current = choice.threads
        self.window, self.rounds = max(1, window), rounds
        self.slow_ratio, self.drop_ratio = slow_ratio, drop_ratio
        self._set, self._clock, self._load = set_threads, clock, load
        self.measurements: list[dict[str, Any]] = []
        self.changes: list[dict[str, Any]] = []
        self._warm = False  # the untimed first step has run
        self._schedule: list[int] = []  # the counts of the coming measured steps
        self._times: dict[int, list[float]] = {}
        self._why = "warm-up"
        self._running: int | None = None  # the count the step under way runs at
        self._started = 0.0
        self._window_steps, self._window_s = 0, 0.0
        self._best_window: float | None = None  # steps/s
        self._applied = choice.threads  # apply_threads set it
        # Below the starting count (the upward re-checks): windows since the last measurement,
        # the windows the next periodic re-check waits for, others' load's peak since then.
        self._windows_since, self._period = 0, RECHECK_FIRST_WINDOWS
        self._load_peak: float | None = None
        self._upward = False  # the measurement under way is an upward re-check
        if len(candidates_for(self.start_count)) > 1:
            self._plan("warm-up")

    # ------------------------------------------------------------------------------ per step
    def before_step(self, step: int) -> None:
        """Before optimizer step ``step + 1``: set the count it runs at; start the clock."""
        count = self._schedule[0] if self._schedule and self._warm else self.current
        self._use(count)
        self._running = count
        self._started = self._clock()

    def after_step(self, step: int) -> None:
        """After step ``step`` (1-based, done): record its time; decide when a measurement ends."""
        elapsed = self._clock() - self._started
        if not self._warm:
            self._warm = True  # the first step: initialisation, not the count
        elif self._schedule:
            self._record(self._running, elapsed)
            if not self._schedule:
                self._decide(step)
        else:
            self._watch(step, elapsed)

    # ------------------------------------------------------------------------------ measuring
    def _plan(self, why: str, upward: bool = False) -> None:
        counts = candidates_for(self.start_count)
        self._schedule = [c for _ in range(self.rounds) for c in counts]
        self._times = {c: [] for c in counts}
        self._why, self._upward = why, upward

    def _record(self, count: int, elapsed: float) -> None:
        self._schedule.pop(0)
        self._times[count].append(elapsed)
        best = {c: min(t) for c, t in self._times.items() if t}
        fastest = min(best.values())
        collapsed = {c for c, t in best.items() if t > self.drop_ratio * fastest}
        self._schedule = [c for c in self._schedule if c not in collapsed]  # not worth more steps

    def _decide(self, step: int) -> None:
        medians = {c: statistics.median(t) for c, t in self._times.items() if t}
        best = min(medians, key=medians.__getitem__)
        self.measurements.append(
            {
                "step": step,
                "why": self._why,
                "steps_per_s": {str(c): round(1.0 / medians[c], 3) for c in medians},
                "steps": {str(c): len(self._times[c]) for c in medians},
                "chose": best,
            }
        )
        if best != self.current:
            if self.on_change is not None:
                self.on_change(step, f"threads {self.current} -> {best} at step {step}")
            speedup = medians[self.current] / medians[best] if self.current in medians else None
            gain = f", {speedup:.2f}x the steps/s" if speedup else ""
            self.changes.append(
                {
                    "step": step,
                    "from": self.current,
                    "to": best,
                    "why": f"{self._why}: {best} thread(s) measured fastest{gain}",
                }
            )
        self.current = best
        self._use(best)
        if self.say is not None:
            speeds = ", ".join(f"{c}: {1.0 / m:.3g}" for c, m in medians.items())
            self.say(f"{self._why} at step {step}: steps/s by thread count {speeds}; using {best}")
        self._window_steps, self._window_s, self._best_window = 0, 0.0, None
        self._after_measurement()

    def _after_measurement(self) -> None:
        """Restart the upward re-checks' counters: the period doubles after an upward re-check
        that kept a count below the start and restarts once the start is back."""
        self._windows_since = 0
        if self.current == self.start_count:
            self._period, self._load_peak = RECHECK_FIRST_WINDOWS, None
            return
        if self._upward:
            self._period = min(2 * self._period, RECHECK_MAX_WINDOWS)
        self._load_peak = self._others_load()

    def _watch(self, step: int, elapsed: float) -> None:
        """At each window's end: measure again when the window was slow, or (below the starting
        count) when others' load fell or the periodic re-check is due."""
        self._window_steps += 1
        self._window_s += elapsed
        if self._window_steps < self.window:
            return
        speed = self._window_steps / self._window_s if self._window_s > 0 else float("inf")
        self._window_steps, self._window_s = 0, 0.0
        slow = self._slow_window(step, speed)
        if slow is not None:
            self._plan(slow)
            return
        if self.current < self.start_count:
            upward = self._upward_due(step)
            if upward is not None:
                self._plan(upward, upward=True)

    def _slow_window(self, step: int, speed: float) -> str | None:
        """Why to measure when the window ran below slow_ratio x the best; else keep the best."""
        best = self._best_window
        if best is not None and speed < self.slow_ratio * best and len(self._times) > 1:
            return (
                f"re-check at step {step}: window {speed:.3g} steps/s < "
                f"{self.slow_ratio:g} x the best window {best:.3g}"
            )
        self._best_window = speed if best is None else max(best, speed)
        return None

    def _upward_due(self, step: int) -> str | None:
        """Why to measure again below the starting count: others' load fell, or the period."""
        self._windows_since += 1
        now, peak = self._others_load(), self._load_peak
        if load_fell(peak, now):
            return f"re-check at step {step}: others' load fell from {peak:.1f} to {now:.1f}"
        if now is not None:
            self._load_peak = now if peak is None else max(peak, now)
        if self._windows_since >= self._period:
            return (
                f"periodic re-check at step {step} "
                f"(kept {self.current} of {self.start_count} threads)"
            )
        return None

    def _others_load(self) -> float | None:
        """Others' 1-minute load now, less this run's threads at the kept count."""
        return contention.others_load(self._load(), self.current)

    def _use(self, count: int) -> None:
        if self._applied != count:
            self._set(count)
            self._applied = count


def threads_section(
    choice: ThreadChoice | None, tuner: ThreadTuner | None
) -> ThreadsSection | None:
    """The report's threads section: the choice, and the tuner's measurements and changes; its
    ``threads``, the count in force at the end (what the last steps ran at), read rather than
    assumed. None before the choice was made."""
    if choice is None:
        return None
    return ThreadsSection(
        requested=choice.requested,
        threads=torch.get_num_threads(),
        initial=choice.threads,
        mode=choice.mode,
        basis=choice.basis,
        measurements=list(tuner.measurements) if tuner else [],
        changes=list(tuner.changes) if tuner else [],
    )
