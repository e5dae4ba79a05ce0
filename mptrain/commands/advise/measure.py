"""Measuring every candidate precision within ``advise.budget_s``: the scout and pilot runs,
the numerics (FP16 range probe, autocast audit), the fidelity runs against FP32 (and FP32
nudged by one ulp), and bench's alternating speed repetitions; what does not fit is skipped
with the estimate that ruled it out.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from mptrain.commands import bench
from mptrain.commands.advise import choices
from mptrain.commands.advise import decide as advice
from mptrain.commands.advise.trials import (
    MIN_TIMED_S,
    NOT_COMPARED,
    PILOT_STEPS,
    PILOT_WARMUP,
    REP_MARGIN,
    RESERVE_S,
    SCOUT_SAMPLES,
    SPEED_SHARE,
    WARM_UP,
    Budget,
    Cost,
    OutOfBudget,
    Trial,
    cost_of,
    estimated,
    short_run,
    timed_part,
)
from mptrain.config.base import ConfigError
from mptrain.config.commands import AdviseConfig
from mptrain.config.run import RunConfig
from mptrain.models.build import config_has_convolutions
from mptrain.precision.diagnostics.audit import audit_step
from mptrain.precision.diagnostics.probe import range_probe
from mptrain.precision.policy import PRECISIONS, block_quantization, to_model_input
from mptrain.train.build import prepare_run


def latest_cost(c: Candidate) -> Cost:
    """From the fidelity run where there is one (tens of steps), else from the pilot (two)."""
    return cost_of(c.fidelity or c.pilot)


# ------------------------------------------------------------------------------ the parts
@dataclass
class Candidate:
    """Everything measured for one precision (what advise.json's ``precisions`` rows hold)."""

    name: str
    cfg: RunConfig
    timed: bool  # its speed is worth measuring (not emulated FP8)
    emulated: bool = False
    skipped: dict[str, str] = field(default_factory=dict)  # part -> why it was not measured
    pilot: Trial | None = None
    fidelity: Trial | None = None
    nudged: Trial | None = None  # FP32 only: its fidelity run again, initial weights nudged
    nudge_note: str | None = None  # FP32 only: why that run did not happen
    nudge_spread: float | None = None  # FP32 only: advice.Context.fp32_spread, from that run
    speed: dict[str, Any] | None = None  # a bench row (median, min–max, ratios)
    choice: choices.Choice | None = None  # what it sets (its label, its command)

    @property
    def label(self) -> str:
        """``fp8 rowwise (emulated)``: the choice's label, and whether it was emulated."""
        label = self.choice.label if self.choice else self.name
        return f"{label} (emulated)" if self.emulated else label

    def fidelity_against(self, reference: Trial | None) -> advice.Fidelity | None:
        """This precision's short run compared with FP32's (``reference``); None if either is
        missing."""
        if self.fidelity is None or reference is None:
            return None
        f = self.fidelity
        return advice.fidelity_of(f.losses, reference.losses, f.skipped_steps, f.diverged)


# Whether a choice's config runs on the device's hardware for what it ``needs``
# (choices.Choice.needs) rather than emulated: then its speed is worth timing.
HARDWARE: dict[str, Callable[[RunConfig, torch.device], bool]] = {
    "FP8 GEMMs": lambda cfg, device: (
        cfg.fp8.emulate is not True and bench.fp8_gemm_available(device)
    ),
    "block-scaled GEMMs": lambda cfg, device: _real_block_gemms(cfg, device),
}


def _real_block_gemms(cfg: RunConfig, device: torch.device) -> bool:
    """Whether the run of ``cfg`` would multiply its block-scaled GEMMs in hardware on
    ``device``: the precision policy's own choice (``emulate=false`` without the kernel is
    refused there: not timed here)."""
    try:
        quantization, _ = block_quantization(cfg.precision.name, device, cfg.fp8, cfg.mx, cfg.nvfp4)
    except ConfigError:
        return False
    return quantization is not None and quantization.real_gemm


def candidates(cfg: RunConfig, device: torch.device) -> list[Candidate]:
    """FP32 first, then every precision the device runs natively, then every low-precision
    choice (:data:`choices.LOW_PRECISION`; emulated, and not timed, where the device lacks the
    hardware it needs). FP16 is kept on CPUs even for convolutions: the pilot measures how slow
    it is. A choice the user's other keys rule out is skipped with the config's own words."""
    out = []
    for name, skip in bench.bench_precisions(
        device, config_has_convolutions(cfg.model, cfg.task == "lm")
    ):
        if name == "fp8":  # bench's one FP8 line: here each of LOW_PRECISION's choices, below
            continue
        r = choices.choice(name)
        if skip and name != "fp16":
            out.append(Candidate(name, cfg, False, skipped={"all": skip}, choice=r))
            continue
        out.append(Candidate(name, choices.apply(cfg, r), True, choice=r))
    for r in choices.LOW_PRECISION:
        low_cfg = choices.apply(cfg, r)
        emulated = not HARDWARE[r.needs](low_cfg, device)
        refused = choices.refusal(low_cfg)
        skipped = {"all": refused} if refused else {}
        out.append(Candidate(r.name, low_cfg, not emulated, emulated, skipped, choice=r))
    return out


def scout(cfg: RunConfig) -> float:
    """Seconds of one step on SCOUT_SAMPLES samples (four steps, the last two timed): cheap
    enough to run before a pilot, so that pathological steps (FP16 convolutions on a CPU: tens of
    seconds each) are foreseen rather than sat through. Raises ConfigError as short_run does."""
    samples = min(cfg.batch_size, SCOUT_SAMPLES)
    trial = short_run(dataclasses.replace(cfg, batch_size=samples, grad_accum_steps=1), 4, 2)
    return cost_of(trial).step_s


@dataclass(frozen=True)
class Yardstick:
    """FP32's step on the scout's samples and on the full batch: a scout's step scales to a
    full step by their ratio (a tiny model's step is mostly fixed costs, a big one's compute)."""

    small_s: float
    full_s: float

    def full_step_s(self, small_s: float) -> float:
        return small_s * self.full_s / self.small_s


def pilot_one(c: Candidate, budget: Budget, share_s: float, yardstick: Yardstick | None) -> None:
    """``c``'s pilot, stopped after ``share_s`` (between steps). Skipped with why when its scout,
    scaled by FP32's ``yardstick``, foresees that not even its fidelity run could fit what is
    left, or when the precision refuses the model."""
    started = time.perf_counter()
    steps = c.cfg.advise.fidelity_steps
    try:
        if yardstick is not None:
            small_s = scout(c.cfg)
            need_s = steps * yardstick.full_step_s(small_s)
            if need_s > budget.left_s():
                c.skipped["all"] = (
                    f"its scout step took {small_s / yardstick.small_s:.1f}× FP32's: its "
                    f"{steps}-step fidelity run (~{need_s:.0f} s) cannot fit the "
                    f"{max(budget.left_s(), 0):.0f} s of advise.budget_s left"
                )
                return
        c.pilot = short_run(c.cfg, PILOT_STEPS, PILOT_WARMUP, deadline=started + share_s)
    except ConfigError as exc:
        c.skipped["all"] = str(exc)


def run_pilots(cands: list[Candidate], budget: Budget, timings: dict[str, Any]) -> None:
    """Each buildable candidate's pilot, each given an equal share of what is left; FP32's first,
    then its scout step, the yardstick for the others' (see :func:`pilot_one`).

    A throw-away FP32 run of two steps goes first: a process's first run pays one-off costs
    (lazy imports, kernel and allocator set-up) that would inflate FP32's estimate tenfold. It is
    also the first estimate of what any run costs at least (its set-up and one step: a run stops
    between steps, never within one); no run starts, the warm-up included, that cannot fit."""
    todo = [c for c in cands if not c.skipped]
    if budget.left_s() <= 0:
        why = f"no advise.budget_s left after {budget.elapsed_s():.1f} s of start-up"
        for c in todo:
            c.skipped["all"] = f"{why} ({RESERVE_S:g} s of advise.budget_s are kept for the report)"
        return
    with timed_part(timings, WARM_UP):
        first_s = cost_of(short_run(cands[0].cfg, 2, 1, deadline=budget.deadline())).of(1)
    yardstick = None
    for i, c in enumerate(todo):
        if first_s > budget.left_s():
            c.skipped["all"] = (
                f"a run's set-up and first step (~{first_s:.1f} s, from FP32's last run) cannot "
                f"fit the {max(budget.left_s(), 0):.1f} s of advise.budget_s left for its pilot"
            )
            continue
        with timed_part(timings, f"pilot {c.name}"):
            pilot_one(c, budget, budget.left_s() / (len(todo) - i), yardstick)
            if c.name == "fp32" and c.pilot is not None:
                first_s = latest_cost(c).of(1)
                if first_s <= budget.left_s():  # the scout costs less than a full step
                    yardstick = Yardstick(scout(c.cfg), latest_cost(c).step_s)


AUDIT_SLOWDOWN = 3.0  # a traced step (every op through a dispatch mode) against a plain one


def new_numerics() -> dict[str, Any]:
    """What :func:`measure_numerics` fills: nothing measured yet."""
    return {"probe": None, "audit": {}, "skipped": {}, "fp8": None, "blocks": {}}


def measure_numerics(
    cfg: RunConfig, cands: list[Candidate], budget: Budget, out: dict[str, Any]
) -> None:
    """Fill ``out`` (:func:`new_numerics`, filled part by part: an interrupt keeps what was
    done) with the FP16 range probe and the autocast audit per low-precision autocast, on FP32's
    initial weights (a fresh seeded build; nothing trains), and FP8's and each block-scaled
    choice's layer report from its pilot. Each part is estimated from the pilots first and skipped (``skipped``: part -> why)
    if it would not fit.
    """
    fp8 = next((c for c in cands if c.name == "fp8"), None)
    out["fp8"] = fp8.pilot.fp8 if fp8 and fp8.pilot else {"skipped": fp8 and fp8.skipped.get("all")}
    # each block-scaled candidate's layer choice (its own keys: mx.*, nvfp4.*, blockwise fp8.*)
    out["blocks"] = {c.name: c.pilot.blocks for c in cands if c.pilot and c.pilot.blocks}
    fp32 = cands[0]
    if fp32.pilot is None:
        out["skipped"]["all"] = "FP32's pilot did not run"
        return
    cost = cost_of(fp32.pilot)
    probe_s = cost.overhead_s + cfg.probe_batches * cost.step_s
    if probe_s > budget.left_s():
        out["skipped"]["fp16 range probe"] = _over(probe_s, budget)
        return
    run = prepare_run(dataclasses.replace(cfg, precision=fp32.cfg.precision))
    batches = run.data.train.batches(0)
    first = [next(batches) for _ in range(cfg.probe_batches)]
    first = [(to_model_input(x, run.precision.policy, cfg.channels_last), y) for x, y in first]
    out["probe"] = range_probe(run.model, first, cfg.precision.scaler.init_scale)
    for c in cands:
        if c.name not in ("bf16", "fp16") or c.skipped or c.pilot is None:
            continue
        audit_s = AUDIT_SLOWDOWN * cost_of(c.pilot).step_s
        if audit_s > budget.left_s():
            out["skipped"][f"{c.name} autocast audit"] = _over(audit_s, budget)
            continue
        dtype = PRECISIONS[c.cfg.precision.name].autocast_dtype
        audit = audit_step(
            run.model,
            *first[0],
            lambda dtype=dtype: torch.autocast(run.device.type, dtype),
            run.optimizer,
            mixed=True,
        )
        out["audit"][c.name] = {k: audit[k] for k in ("flagged_ops", "state_flags")}


def _over(estimate_s: float, budget: Budget) -> str:
    return estimated(estimate_s, " from the measured pilots", budget.left_s())


def pilot_words(c: Candidate, fp32: Candidate) -> str:
    """``1.23 s/step, 25× FP32's``: a pilot's step time (a few steps, not alternated: a hint,
    not a speed measurement)."""
    step_s = latest_cost(c).step_s
    words = f"{step_s:.3g} s/step"
    if fp32.pilot is not None and c is not fp32:
        words += f", {step_s / latest_cost(fp32).step_s:.1f}× FP32's"
    return words


def run_fidelity(
    cands: list[Candidate], settings: AdviseConfig, budget: Budget, timings: dict[str, Any]
) -> None:
    """The short runs, FP32 first (the reference every other run is compared with). Each is
    admitted only when it and its speed measurement fit what is left once the speed parts of
    those already admitted are set aside; otherwise it is skipped with the estimate."""
    admitted: list[Candidate] = []
    for c in cands:
        if c.skipped or c.pilot is None:
            continue
        if c.name != "fp32" and not any(a.name == "fp32" for a in admitted):
            c.skipped["fidelity and speed"] = NOT_COMPARED
            continue
        committed = speed_need([a for a in admitted if a.timed], settings, settings.speed_steps)
        left_s = budget.left_s() - committed
        # its fidelity run and (when timed) its share of the speed part at the least timed steps
        need = latest_cost(c).of(settings.fidelity_steps)
        need += speed_need([c], settings, settings.speed_steps) if c.timed else 0.0
        if need > left_s:
            how = f" from its measured pilot ({pilot_words(c, cands[0])})"
            c.skipped["fidelity and speed"] = estimated(need, how, left_s)
            continue
        with timed_part(timings, f"fidelity {c.name}"):
            trial = short_run(c.cfg, settings.fidelity_steps, PILOT_WARMUP, budget.deadline())
        if trial.cut_short:
            c.skipped["fidelity and speed"] = (
                f"the budget ran out after {trial.steps} of {settings.fidelity_steps} steps"
            )
            continue
        c.fidelity = trial
        admitted.append(c)
        if c.name == "fp32" and len(cands) > 1:
            run_nudged_reference(c, settings, budget, timings)


def run_nudged_reference(
    fp32: Candidate, settings: AdviseConfig, budget: Budget, timings: dict[str, Any]
) -> None:
    """FP32's fidelity run again with its initial weights nudged by one ulp: how far this
    training forks on its own (advice.allowed_difference). Run only when it leaves room for the
    other precisions' runs, estimated at FP32's cost: a check, not the advice."""
    need = latest_cost(fp32).of(settings.fidelity_steps)
    if 3 * need > budget.left_s():
        fp32.nudge_note = (
            f"estimated {need:.0f} s; the time was kept for the other precisions' runs "
            f"({max(budget.left_s(), 0):.0f} s of advise.budget_s left)"
        )
        return
    with timed_part(timings, "fidelity fp32 nudged"):
        trial = short_run(
            fp32.cfg, settings.fidelity_steps, PILOT_WARMUP, budget.deadline(), nudge=True
        )
    if trial.cut_short:
        fp32.nudge_note = f"the budget ran out after {trial.steps} steps"
    else:
        fp32.nudged = trial
        reference = fp32.fidelity.losses
        fp32.nudge_spread = advice.fidelity_of(trial.losses, reference, 0, None).max_rel_diff


def speed_steps(timed: list[Candidate], settings: AdviseConfig, left_s: float) -> int:
    """Timed steps per measurement: enough for the speed part to fill SPEED_SHARE of ``left_s``,
    and at least ``advise.speed_steps`` and enough for the fastest precision to run MIN_TIMED_S
    (a few milliseconds of timing are all noise on a shared machine); halved while the whole
    speed part would not fit ``left_s``."""
    fastest = min(latest_cost(c).step_s for c in timed)
    floor = max(settings.speed_steps, math.ceil(MIN_TIMED_S / max(fastest, 1e-6)))
    fixed_s = speed_need(timed, settings, 0)  # warm-up and overheads: every repetition pays them
    per_step_s = speed_need(timed, settings, 1) - fixed_s
    filling = math.floor((SPEED_SHARE * left_s - fixed_s) / max(per_step_s, 1e-9))
    steps = max(floor, filling)
    while steps > settings.speed_steps and speed_need(timed, settings, steps) > left_s:
        steps = max(settings.speed_steps, steps // 2)
    return steps


def speed_need(group: list[Candidate], settings: AdviseConfig, steps: int) -> float:
    """Estimated seconds of ``settings.reps`` measurements of ``steps`` (+ warm-up) each."""
    runs = settings.warmup_steps + steps
    return sum(settings.reps * latest_cost(c).of(runs) for c in group)


def speed_measure(deadline: float) -> Callable[[RunConfig, int, int], dict[str, Any]]:
    """bench's per-repetition measurement, as a short run that stops at ``deadline``."""

    def measure_one(cfg: RunConfig, warmup: int, steps: int) -> dict[str, Any]:
        trial = short_run(cfg, warmup + steps, warmup, deadline, per_step=False)
        if trial.step_time_s is None:
            raise OutOfBudget(f"the budget ran out after {trial.steps} untimed steps")
        return trial.figures

    return measure_one


def run_speed(
    cands: list[Candidate], settings: AdviseConfig, budget: Budget, timings: dict[str, Any]
) -> None:
    """Alternating repetitions of the timed candidates (:func:`mptrain.commands.bench.measure_reps`); the
    last ones are dropped (and say so) while the estimate does not fit what is left."""
    for c in cands:
        if c.timed and c.fidelity is not None and c.fidelity.diverged:
            c.skipped["speed"] = (
                "diverged in its fidelity run: a speed of skipped steps means nothing"
            )
    timed = [c for c in cands if c.timed and not c.skipped]
    steps = speed_steps(timed, settings, budget.left_s()) if timed else settings.speed_steps
    while len(timed) > 1 and speed_need(timed, settings, steps) > budget.left_s():
        dropped = timed.pop()
        dropped.skipped["speed"] = (
            f"estimated {speed_need([dropped], settings, steps):.0f} s; the fidelity runs left "
            f"{max(budget.left_s(), 0):.0f} s of advise.budget_s"
        )
    if len(timed) < 2:  # FP32 alone: no ratio to measure
        for c in timed:
            c.skipped["speed"] = "no other precision's speed fit the budget"
        return
    with timed_part(timings, "speed"):
        reps = measure_whole_reps(timed, settings, steps, budget)
    if len(reps[timed[0].name]) < settings.reps:
        timings["speed_reps_cut"] = (
            f"{len(reps[timed[0].name])} of {settings.reps} repetitions fit advise.budget_s"
        )
    if reps[timed[0].name]:
        rows = [bench.summarise(name, figures) for name, figures in reps.items()]
        bench.add_ratios(rows)
        for c, row in zip(timed, rows, strict=True):
            c.speed = row
    else:
        for c in timed:
            c.skipped["speed"] = "not one whole repetition fit the budget"
    timings["speed_steps"] = steps


def measure_whole_reps(
    timed: list[Candidate], settings: AdviseConfig, steps: int, budget: Budget
) -> dict[str, list[dict[str, Any]]]:
    """Up to ``settings.reps`` repetitions, each every precision once in bench's rotated order;
    a repetition starts only when its estimate fits, and one the deadline cuts short is dropped
    whole (each ratio pairs a precision with FP32's measurement of the same repetition)."""
    configs = {c.name: c.cfg for c in timed}
    measure_one = speed_measure(budget.deadline())
    reps: dict[str, list[dict[str, Any]]] = {name: [] for name in configs}
    for rep in range(settings.reps):
        if REP_MARGIN * speed_need(timed, settings, steps) / settings.reps > budget.left_s():
            break  # with a margin: a repetition the deadline cuts is lost whole
        order = bench.rotated(list(configs), rep)
        measured, refused = bench.measure_reps(
            {n: configs[n] for n in order}, settings.warmup_steps, steps, 1, measure_one
        )
        if refused:  # cut short by the deadline
            break
        for name, figures in measured.items():
            reps[name] += figures
    return reps


# ------------------------------------------------------------------------------ cut short
def mark_not_reached(
    cands: list[Candidate], numerics: dict[str, Any], timings: dict[str, Any], why: str
) -> None:
    """After an interrupt: every part neither measured nor already skipped (with its own reason)
    is listed as not measured because of ``why`` (``interrupted by SIGINT``)."""
    if "numerics" not in timings:
        part = "autocast audit" if numerics["probe"] is not None else "fp16 range probe and audit"
        numerics["skipped"].setdefault(part, why)
    for c in cands:
        if c.skipped.get("all"):
            continue
        if c.pilot is None:
            c.skipped["all"] = why
        elif c.fidelity is None:
            c.skipped.setdefault("fidelity and speed", why)
        elif c.timed and c.speed is None and "speed" not in c.skipped:
            c.skipped["speed"] = why
        if c.name == "fp32" and c.fidelity is not None and c.nudged is None:
            c.nudge_note = c.nudge_note or why
