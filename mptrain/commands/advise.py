"""``mptrain advise [overrides]``: which precision to train this model with on this machine.

For every precision :func:`mptrain.commands.bench.bench_precisions` lists for the device (FP32, BF16 where
native, FP16, TF32 on GPUs; FP8 always, emulated and labelled where there is no FP8 hardware) it
measures, on the configured model and data, in this order:

1. **pilot**: builds the run and trains a few steps, timed: what a step and a run's set-up cost
   here. A scout step on 4 samples goes before each (scaled by FP32's own small-to-full ratio):
   that is how the budget learns that FP16 convolutions crawl on a CPU — measured, not assumed.
2. **numerics** (on FP32's initial weights, before any training): the FP16 range probe, the
   autocast audit under each low-precision autocast, and the FP8 layer choice (from FP8's pilot).
3. **fidelity**: ``advise.fidelity_steps`` optimizer steps per precision from the same seed (the
   same initial weights and batches) as an FP32 run; the loss trajectories are compared
   (:func:`mptrain.commands.advise_decide.fidelity_of`), skipped steps and divergence recorded.
4. **speed**: bench's alternating repetitions (:func:`mptrain.commands.bench.measure_reps`), in rotated
   order, ``advise.reps`` times; ratios to FP32 with their min–max (emulated FP8 is not timed).

The measured costs decide what fits ``advise.budget_s``: FP32 first (the reference), then each
precision whole (its fidelity run and its speed measurement together: one without the other
cannot be recommended), each estimated from what was measured when its turn comes; what does not
fit is skipped and listed with the estimate that ruled it out. Every run also stops at the
budget's deadline between steps (a step cannot be interrupted). :func:`mptrain.commands.advise_decide.recommend`
decides; :mod:`mptrain.commands.advise_report` writes advise.md, advise.json and advise.png into
``outputs/advise/<date>/<time>_<model>_<dataset>`` (or ``hydra.run.dir=DIR``) and prints the
recommendation and the table.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from rich.console import Console

from mptrain.commands import advise_decide as advice
from mptrain.commands import bench
from mptrain.config.base import ConfigError
from mptrain.config.commands import AdviseConfig
from mptrain.config.run import RunConfig
from mptrain.models.build import config_has_convolutions
from mptrain.platform import hardware
from mptrain.precision.diagnostics.audit import audit_step
from mptrain.precision.diagnostics.probe import range_probe
from mptrain.precision.policy import PRECISIONS, to_model_input
from mptrain.train.build import prepare_run
from mptrain.train.loop import LoopHooks, train_loop

PILOT_STEPS = 6  # a run's first steps pay one-off costs (kernel set-up, lazy imports), so
PILOT_WARMUP = 3  # 3 untimed steps, then 3 timed ones
SCOUT_SAMPLES = 4  # a scout step's batch: cheap, and enough to extrapolate a full step from
MIN_TIMED_S = 0.5  # the fastest precision's timed seconds per measurement, at least
REP_MARGIN = 1.5  # a busy machine runs slower than the estimates taken a minute earlier
# The share of the budget left after the fidelity runs that the speed repetitions may fill: longer
# timing windows average out a shared machine's bursts (the rest is the estimates' safety margin).
SPEED_SHARE = 0.5
RESERVE_S = 5.0  # kept back for the report and the figure (matplotlib's import alone ~1.8 s)
NOT_COMPARED = "not compared: the FP32 reference run did not fit"


# ------------------------------------------------------------------------------ one short run
class _Losses:
    """Loop observer keeping every logged training loss (``log_every=1``: one per step)."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_step(self, state: Any) -> None:
        pass

    def on_log(self, row: dict[str, Any]) -> None:
        self.losses.append(row["loss"])

    def on_eval(self, row: dict[str, Any]) -> None:
        pass

    def on_warning(self, message: str) -> None:
        pass


@dataclass
class Trial:
    """One short training run: its losses, what went wrong, what it measured and cost."""

    label: str
    steps: int  # optimizer steps run (fewer than asked when the deadline cut it short)
    losses: list[float]
    skipped_steps: int
    diverged: str | None
    step_time_s: float | None  # after the warm-up steps; None when none was timed
    wall_s: float  # build + steps
    cut_short: bool = False
    figures: dict[str, Any] = field(default_factory=dict)  # bench's figures (run_figures)
    fp8: dict[str, Any] | None = None  # the FP8 layer report, for precision=fp8


def nudge_weights(model: torch.nn.Module) -> None:
    """Move every floating-point parameter by one FP32 epsilon relative (× (1 ± 2⁻²³), the sign
    drawn from a fixed generator; one or two ulps): about the smallest perturbation there is, to
    see how far the training forks on its own."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point():
                sign = torch.randint(0, 2, p.shape, generator=generator).to(p) * 2 - 1
                p.mul_(1 + sign * 2.0**-23)


def short_run(
    cfg: RunConfig,
    steps: int,
    warmup: int,
    deadline: float | None = None,
    per_step: bool = True,
    nudge: bool = False,
) -> Trial:
    """Build ``cfg`` fresh (seeded: the same initial weights and batches for every precision) and
    train ``steps`` optimizer steps — fewer when ``time.perf_counter()`` passes ``deadline``
    (checked after each step: at least one runs). ``per_step``: log the loss every step (a host
    read per step; off for speed measurements). ``nudge``: the initial weights moved by one ulp
    (:func:`nudge_weights`). No evaluation, nothing written to disk.

    Raises ConfigError when the precision cannot run this model (FP8 without an eligible layer).
    """
    started = time.perf_counter()
    cfg = dataclasses.replace(
        cfg,
        max_steps=steps + 1,  # one more than run: the loop's final evaluation never comes
        epochs=None,
        log_every=1 if per_step else steps,
        eval_every=10**9,
        probe_every=None,  # the update probe copies every parameter: not needed here
        throughput_warmup_steps=min(warmup, steps - 1),
        progress=False,
    )
    run = prepare_run(cfg)
    if nudge:
        nudge_weights(run.model)
    losses = _Losses()

    def stop() -> bool:
        return run.state.step >= steps or (deadline is not None and time.perf_counter() > deadline)

    state = train_loop(run, LoopHooks(observers=(losses,), stop_requested=stop))
    t = run.monitor.throughput
    return Trial(
        label=run.policy.label,
        steps=state.step,
        losses=losses.losses,
        skipped_steps=len(state.skipped_steps),
        diverged=run.monitor.diverged_reason,
        step_time_s=t.measured_time_s / t.measured_steps if t.measured_steps else None,
        wall_s=time.perf_counter() - started,
        cut_short=state.step < steps and run.monitor.diverged_reason is None,
        figures=bench.run_figures(run),
        fp8=run.fp8,
    )


# ------------------------------------------------------------------------------ the budget
@dataclass(frozen=True)
class Cost:
    """What a run of this precision costs here, from its pilot."""

    overhead_s: float  # build + first step + final evaluation
    step_s: float

    def of(self, steps: int) -> float:
        return self.overhead_s + steps * self.step_s


def cost_of(trial: Trial) -> Cost:
    """A run's cost model from a measured ``trial``: its timed steps' mean and the rest."""
    step_s = trial.step_time_s if trial.step_time_s is not None else trial.wall_s / trial.steps
    return Cost(max(0.0, trial.wall_s - trial.steps * step_s), step_s)


def latest_cost(c: Candidate) -> Cost:
    """From the fidelity run where there is one (tens of steps), else from the pilot (two)."""
    return cost_of(c.fidelity or c.pilot)


@dataclass
class Budget:
    """``advise.budget_s`` seconds from ``started``."""

    total_s: float
    started: float = field(default_factory=time.perf_counter)

    def elapsed_s(self) -> float:
        return time.perf_counter() - self.started

    def left_s(self) -> float:
        return self.total_s - self.elapsed_s() - RESERVE_S

    def deadline(self) -> float:
        """When measuring must stop (``time.perf_counter()``): the report's reserve is kept."""
        return self.started + self.total_s - RESERVE_S


class OutOfBudget(ConfigError):
    """A speed measurement the budget cut short before it timed a step (measure_reps records
    the reason and does not measure that precision again)."""


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
    # FP32 only: the nudged run's largest relative loss difference from FP32's (advice.Context)
    nudge_spread: float | None = None
    speed: dict[str, Any] | None = None  # a bench row (median, min–max, ratios)

    def fidelity_against(self, reference: Trial | None) -> advice.Fidelity | None:
        """This precision's short run compared with FP32's (``reference``); None if either is
        missing."""
        if self.fidelity is None or reference is None:
            return None
        f = self.fidelity
        return advice.fidelity_of(f.losses, reference.losses, f.skipped_steps, f.diverged)


def candidates(cfg: RunConfig, device: torch.device) -> list[Candidate]:
    """FP32 first, then every precision the device runs natively, then FP8 (emulated here or
    not). FP16 is kept on CPUs even for convolutions: the pilot measures how slow it is."""
    out = []
    for name, skip in bench.bench_precisions(device, config_has_convolutions(cfg.model)):
        emulated = name == "fp8" and not bench.fp8_gemm_available(device)
        if skip and name not in ("fp16", "fp8"):
            out.append(Candidate(name, cfg, False, skipped={"all": skip}))
            continue
        precision = bench.precision_config(name, cfg.precision)
        out.append(
            Candidate(name, dataclasses.replace(cfg, precision=precision), not emulated, emulated)
        )
    return out


def scout(cfg: RunConfig) -> float:
    """Seconds of one step on SCOUT_SAMPLES samples (four steps, the last two timed): cheap
    enough to run before a pilot, so that pathological steps (FP16 convolutions on a CPU: tens of
    seconds each) are foreseen rather than sat through. Raises ConfigError as short_run does."""
    samples = min(cfg.batch_size, SCOUT_SAMPLES)
    trial = short_run(dataclasses.replace(cfg, batch_size=samples, grad_accum_steps=1), 4, 2)
    return trial.step_time_s if trial.step_time_s is not None else trial.wall_s / trial.steps


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
    (lazy imports, kernel and allocator set-up) that would inflate FP32's estimate tenfold."""
    started = time.perf_counter()
    short_run(cands[0].cfg, 2, warmup=1, deadline=budget.deadline())
    timings["process warm-up"] = time.perf_counter() - started
    todo = [c for c in cands if not c.skipped]
    yardstick = None
    for i, c in enumerate(todo):
        if budget.left_s() <= 0:
            c.skipped["all"] = "no advise.budget_s left for its pilot"
            continue
        started = time.perf_counter()
        pilot_one(c, budget, budget.left_s() / (len(todo) - i), yardstick)
        if c.name == "fp32" and c.pilot is not None:
            yardstick = Yardstick(scout(c.cfg), latest_cost(c).step_s)
        timings[f"pilot {c.name}"] = time.perf_counter() - started


AUDIT_SLOWDOWN = 3.0  # a traced step (every op through a dispatch mode) against a plain one


def measure_numerics(cfg: RunConfig, cands: list[Candidate], budget: Budget) -> dict[str, Any]:
    """The FP16 range probe and the autocast audit per low-precision autocast, on FP32's initial
    weights (a fresh seeded build; nothing trains); FP8's layer report from its pilot. Each part
    is estimated from the pilots first and skipped (``skipped``: part -> why) if it would not fit.
    """
    fp8 = next((c for c in cands if c.name == "fp8"), None)
    out: dict[str, Any] = {"probe": None, "audit": {}, "skipped": {}}
    out["fp8"] = fp8.pilot.fp8 if fp8 and fp8.pilot else {"skipped": fp8 and fp8.skipped.get("all")}
    fp32 = cands[0]
    if fp32.pilot is None:
        out["skipped"]["all"] = "FP32's pilot did not run"
        return out
    cost = cost_of(fp32.pilot)
    probe_s = cost.overhead_s + cfg.probe_batches * cost.step_s
    if probe_s > budget.left_s():
        out["skipped"]["fp16 range probe"] = _over(probe_s, budget)
        return out
    run = prepare_run(dataclasses.replace(cfg, precision=fp32.cfg.precision))
    batches = run.data.train.batches(0)
    first = [next(batches) for _ in range(cfg.probe_batches)]
    first = [(to_model_input(x, run.policy, cfg.channels_last), y) for x, y in first]
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
    return out


def _over(estimate_s: float, budget: Budget) -> str:
    return (
        f"estimated {estimate_s:.0f} s from the measured pilots, "
        f"{max(budget.left_s(), 0):.0f} s of advise.budget_s left"
    )


def fidelity_need(c: Candidate, settings: AdviseConfig) -> float:
    """Estimated seconds of ``c``'s fidelity run and (when timed) its share of the speed part
    at the least number of timed steps."""
    need = latest_cost(c).of(settings.fidelity_steps)
    return need + (speed_need([c], settings, settings.speed_steps) if c.timed else 0.0)


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
        left_s, need = budget.left_s() - committed, fidelity_need(c, settings)
        if need > left_s:
            c.skipped["fidelity and speed"] = (
                f"estimated {need:.0f} s from its measured pilot ({pilot_words(c, cands[0])}), "
                f"{max(left_s, 0):.0f} s of advise.budget_s left"
            )
            continue
        started = time.perf_counter()
        trial = short_run(c.cfg, settings.fidelity_steps, PILOT_WARMUP, budget.deadline())
        timings[f"fidelity {c.name}"] = time.perf_counter() - started
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
    started = time.perf_counter()
    trial = short_run(
        fp32.cfg, settings.fidelity_steps, PILOT_WARMUP, budget.deadline(), nudge=True
    )
    timings["fidelity fp32 nudged"] = time.perf_counter() - started
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
    started = time.perf_counter()
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
    timings["speed"] = time.perf_counter() - started
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


# ------------------------------------------------------------------------------ to a decision
def to_measured(c: Candidate, reference: Trial | None, numerics: dict[str, Any]) -> advice.Measured:
    """The decision's view of a candidate: figures only, reasons for what is missing."""
    not_run = c.skipped.get("all")
    speed = None
    if c.speed is not None and "vs_fp32" in c.speed:
        low, high = c.speed["vs_fp32_range"]
        speed = advice.Speed(c.speed["vs_fp32"], low, high)
    audit = numerics.get("audit", {}).get(c.name, {})
    # In the order the step ran them (the model's order), each once: a fix reads like the model.
    flagged = (o["module"] for o in audit.get("flagged_ops", []))
    modules = list(dict.fromkeys(m for m in flagged if m != "(autograd)"))
    probe = numerics["probe"]
    overflow = tuple(probe["overflow_modules"]) if c.name == "fp16" and probe else ()
    return advice.Measured(
        precision=c.name,
        not_run=not_run,
        speed=speed,
        speed_note=c.skipped.get("speed"),
        fidelity=c.fidelity_against(reference),
        fidelity_note=c.skipped.get("fidelity and speed"),
        emulated=c.emulated,
        fp16_overflow=overflow,
        audit_modules=tuple(modules),
    )


def command_for(overrides: list[str], precision: str) -> str:
    """The command that trains with ``precision``: the user's overrides without what only
    advise reads (advise.*, bench.*, hydra.run.dir) and without their own precision."""
    import shlex

    dropped = ("precision=", "advise.", "bench.", "hydra.run.dir=")
    kept = [o for o in overrides if not o.lstrip("+~").startswith(dropped)]
    return " ".join(["mptrain", f"precision={precision}", *(shlex.quote(o) for o in kept)])


def decide(
    cfg: RunConfig, cands: list[Candidate], numerics: dict[str, Any], device: torch.device
) -> advice.Advice:
    reference = next((c.fidelity for c in cands if c.name == "fp32"), None)
    ctx = advice.Context(
        tolerance=cfg.advise.tolerance,
        fp32_spread=next((c.nudge_spread for c in cands if c.name == "fp32"), None),
        max_skipped_fraction=cfg.advise.max_skipped_fraction,
        device_type=device.type,
        has_convolutions=config_has_convolutions(cfg.model),
        channels_last=cfg.channels_last,
    )
    return advice.recommend([to_measured(c, reference, numerics) for c in cands], ctx)


def measure_all(cfg: RunConfig, device: torch.device, budget: Budget) -> dict[str, Any]:
    """Steps 1–4 of the module doc within ``budget``; returns candidates, numerics, timings."""
    timings: dict[str, float] = {}
    cands = candidates(cfg, device)
    run_pilots(cands, budget, timings)
    started = time.perf_counter()
    numerics = measure_numerics(cfg, cands, budget)
    timings["numerics"] = time.perf_counter() - started
    run_fidelity(cands, cfg.advise, budget, timings)
    run_speed(cands, cfg.advise, budget, timings)
    return {"candidates": cands, "numerics": numerics, "timings": timings}


def run_advise(
    cfg: RunConfig, overrides: list[str], output_dir: Path, console: Console, budget: Budget
) -> dict[str, Any]:
    """Measure (see module doc) within ``budget``, decide, write advise.md/.json/.png, print;
    return the result."""
    from mptrain.commands import advise_report

    device = hardware.resolve_device(cfg.device)
    found = measure_all(cfg, device, budget)
    decision = decide(cfg, found["candidates"], found["numerics"], device)
    result = advise_report.assemble(
        cfg, device, found, decision, command_for(overrides, decision.precision)
    )
    advise_report.write(result, output_dir, budget.elapsed_s)
    advise_report.show(console, result, output_dir)
    return result


def advise_main(overrides: list[str]) -> None:
    """``mptrain advise [overrides]`` (the CLI's subcommand table calls this). Bad input raises
    ConfigError (one line; exit 2)."""

    from mptrain.compose.preflight import subcommand_job
    from mptrain.output.joblog import job_console

    started = time.perf_counter()  # the budget covers composing the config too
    cfg, output_dir = subcommand_job(overrides, "advise")
    run_advise(cfg, overrides, output_dir, job_console(), Budget(cfg.advise.budget_s, started))
