"""``precision=auto`` decided by measuring the user's model, where that is affordable (what it
does in words, and what the report says: docs/precisions.md#precisionauto).

On a CPU the device rule (:func:`mptrain.precision.policy.resolve_precision`) is weak: where it
chose BF16, the job times the two candidates — BF16 autocast and FP32, the same FP32 weights, no
loss scaling either way, so the choice changes nothing but the autocast dtype — on copies of the
run's model and its first batch (:func:`mptrain.pace.steptime.time_steps`: the run's weights, data
position and random state are untouched), at each count of :func:`thread_counts`: one warm-up
step per candidate and count, then :data:`ROUNDS` rounds alternating, so a change of load hits
all alike. Each candidate's fastest step counts: other work on the machine only ever slows a step
down, so the fastest is the least disturbed. BF16 is kept only when its step is at least
:data:`FASTER_BY` times faster: at equal speed FP32 computes more faithfully. Paired rounds that
disagree (:func:`_undecided`) are timed again, up to :data:`MAX_ROUNDS`; still undecided, the
device rule's choice stands, and the reason says so. :func:`why_not_measured` says when the rule
stands untimed; a resumed run keeps the precision its checkpoint was trained in.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from mptrain.config.options import AUTO
from mptrain.pace.steptime import time_steps
from mptrain.precision.policy import PRECISIONS, PrecisionPolicy, resolve_precision
from mptrain.report.rows import plural
from mptrain.train.build import with_policy
from mptrain.train.components import Run
from mptrain.train.threads import candidates_for

MIN_STEPS = 200  # 10 timed steps: 5 % of such a run at most
ROUNDS = 4  # timed steps per candidate after its warm-up step
FASTER_BY = 1.05  # the lower precision must be this much faster to be chosen
AGREE = 0.75  # the share of paired rounds one candidate must win for the timing to decide
MAX_ROUNDS = 3 * ROUNDS  # rounds timed at most before the device rule decides instead
CANDIDATES = {"bf16": ("bf16", "fp32")}  # the rule's CPU choice -> what is timed


def why_not_measured(run: Run, steps: int) -> str | None:
    """Why ``precision=auto`` keeps its device rule for ``run`` of ``steps`` steps, or None
    when the candidates are to be timed (in words: docs/precisions.md#precisionauto)."""
    cfg, policy = run.cfg, run.precision.policy
    if not cfg.precision.measure:
        return "precision.measure=false"
    if run.device.type != "cpu":  # BF16 tensor cores: the rule's strong case (and copies cost)
        return "not timed on a GPU"
    if policy.name not in CANDIDATES:
        return "no other candidate on this device"
    if cfg.compile:
        return "compile=true: each candidate would compile"
    if run.dist.enabled:  # each process would time, and all would have to agree
        return "several processes"
    if steps < MIN_STEPS:
        return f"a run of {plural(steps, 'step')}: timing the candidates pays off from {MIN_STEPS}"
    return None


def decide_auto(
    run: Run,
    steps: int,
    trained_in: str | None = None,
    say: Callable[[str], None] | None = None,
) -> Run:
    """``run`` (built with the rule's precision) with the precision ``auto`` settles on.

    ``trained_in``: the precision of the checkpoint a resumed run continues (kept whatever the
    rule or a timing would say now). Otherwise the candidates are timed when
    :func:`why_not_measured` allows; else the rule's choice stays, its reason extended with why
    it was not timed. Only the policy (and the monitor that names it) can change. ``say`` gets
    one line before the timing starts (it takes seconds to a minute).
    """
    policy = run.precision.policy
    if policy.requested != AUTO:
        return run
    if trained_in is not None:  # the signature check refuses a precision the rule cannot give
        if trained_in not in CANDIDATES.get(policy.name, (policy.name,)):
            return run
        reason = f"kept from the checkpoint this run resumes (trained in {trained_in})"
        return with_policy(run, _policy_for(run, trained_in, reason, None))
    skip = why_not_measured(run, steps)
    if skip is not None:  # the rule's choice stays, its reason says why it was not timed
        policy = dataclasses.replace(policy, reason=f"{policy.reason}; {skip}")
        return dataclasses.replace(run, precision=dataclasses.replace(run.precision, policy=policy))
    names = CANDIDATES[policy.name]
    if say is not None:
        say(f"auto: timing {' and '.join(names)} on copies of this model before training")
    timing = time_candidates(run, names)
    while _undecided(timing, policy.name) and len(timing["steps"]["fp32"]) < MAX_ROUNDS:
        timing = _merged(timing, time_candidates(run, names))  # a busy machine: more rounds
    if _undecided(timing, policy.name):
        wins = _wins(timing, policy.name)
        reason = (
            f"{policy.reason}; timed but undecided on a busy machine ({policy.name} faster in "
            f"{wins} of {len(timing['steps']['fp32'])} paired steps): the device rule's choice"
        )
        return with_policy(run, _policy_for(run, policy.name, reason, timing))
    name, reason = choose(timing, lower=policy.name)
    return with_policy(run, _policy_for(run, name, reason, timing))


def _wins(timing: dict[str, Any], lower: str) -> int:
    """In how many paired rounds ``lower``'s step beat FP32's."""
    steps = timing["steps"]
    return sum(low < fp32 for low, fp32 in zip(steps[lower], steps["fp32"], strict=True))


def _undecided(timing: dict[str, Any], lower: str) -> bool:
    """The paired rounds disagree: neither candidate was faster in at least AGREE of them (a busy
    machine, where the fastest steps flip between runs minutes apart)."""
    rounds = len(timing["steps"]["fp32"])
    wins = _wins(timing, lower)
    return max(wins, rounds - wins) < AGREE * rounds


def _merged(timing: dict[str, Any], more: dict[str, Any]) -> dict[str, Any]:
    """The rounds of two timings as one."""
    by_threads = {
        name: {
            count: steps + more["steps_by_threads"][name][count] for count, steps in counts.items()
        }
        for name, counts in timing["steps_by_threads"].items()
    }
    return summarised(by_threads)


def thread_counts(run: Run) -> list[int]:
    """The thread counts the run may train at: with ``threads=auto`` on a CPU its candidates (the
    tuner keeps the fastest on the first training steps, :mod:`mptrain.train.threads`), else the
    one count set. Timing the candidates at the start count alone would compare them at a
    count the tuner may abandon (2 threads here, where a busy machine then trains at 1)."""
    count = run.threads.threads
    return candidates_for(count) if run.threads.measure else [count]


def time_candidates(run: Run, names: tuple[str, ...]) -> dict[str, Any]:
    """Each of ``names`` timed at each of :func:`thread_counts`: one warm-up step per pair, then
    :data:`ROUNDS` rounds alternating (see the module doc); summarised by :func:`summarised`."""
    counts = thread_counts(run)
    pairs = [(name, count) for count in counts for name in names]
    order = pairs * (1 + ROUNDS)
    seconds = time_steps(
        run,
        [PRECISIONS[name].autocast_dtype for name, _ in order],
        threads=[count for _, count in order],
    )
    by_threads: dict[str, dict[str, list[float]]] = {n: {str(c): [] for c in counts} for n in names}
    for (name, count), s in zip(order[len(pairs) :], seconds[len(pairs) :], strict=True):
        by_threads[name][str(count)].append(s)
    return summarised(by_threads)


def summarised(by_threads: dict[str, dict[str, list[float]]]) -> dict[str, Any]:
    """A timing from each candidate's steps per thread count (``{"bf16": {"2": [s, ...]}}``, one
    step per round at each count): per round, the candidate's step at its fastest count in that
    round (``steps``, paired across candidates round by round); ``s_per_step``, its fastest step
    of all; ``threads``, the count that step ran at — the count the thread tuner would keep."""
    steps = {
        name: [min(round_) for round_ in zip(*counts.values(), strict=True)]
        for name, counts in by_threads.items()
    }
    threads = {
        name: int(min(counts, key=lambda c: min(counts[c]))) for name, counts in by_threads.items()
    }
    return {
        "s_per_step": {name: min(t) for name, t in steps.items()},
        "threads": threads,
        "steps": steps,
        "steps_by_threads": by_threads,
        "warmup_steps_each": 1,
        "how": (
            "fastest step per candidate over the thread counts the run may train at, on copies "
            "of the model and the first batch, before training"
        ),
    }


def choose(timing: dict[str, Any], lower: str, faster_by: float = FASTER_BY) -> tuple[str, str]:
    """(precision, reason): ``lower`` (e.g. bf16) when its fastest step beats FP32's by
    ``faster_by`` or more, else fp32."""
    fastest = timing["s_per_step"]
    ratio = fastest["fp32"] / fastest[lower] if fastest[lower] > 0 else float("inf")
    rounds = len(timing.get("steps", {}).get("fp32", ())) or ROUNDS
    figures = (
        f"{lower} {_ms(fastest[lower])}{_at(timing, lower)} vs fp32 {_ms(fastest['fp32'])}"
        f"{_at(timing, 'fp32')} per step (fastest of {rounds}, timed on copies of this model "
        "before training)"
    )
    if ratio >= faster_by:
        return lower, f"measured: {figures}: {lower} {ratio:.2f}x faster"
    if ratio >= 1:
        return "fp32", (
            f"measured: {figures}: {lower} only {ratio:.2f}x faster (< {faster_by:g}x), so fp32, "
            "the more faithful at that speed"
        )
    return "fp32", f"measured: {figures}: fp32 {1 / ratio:.2f}x faster"


def _at(timing: dict[str, Any], name: str) -> str:
    """ " at N threads" when several counts were timed (the count each candidate was fastest at)."""
    by_threads = timing.get("steps_by_threads", {}).get(name, {})
    if len(by_threads) < 2:
        return ""
    return f" at {plural(timing['threads'][name], 'thread')}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.3g} ms" if seconds < 1 else f"{seconds:.3g} s"


def _policy_for(run: Run, name: str, reason: str, timing: dict[str, Any] | None) -> PrecisionPolicy:
    resolved = resolve_precision(
        dataclasses.replace(run.cfg.precision, name=name), run.device, run.cfg.fp8
    )
    return dataclasses.replace(resolved, requested=AUTO, reason=reason, auto_timing=timing)
