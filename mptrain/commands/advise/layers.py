"""The per-layer plan's measurements (``advise.plan``), within ``advise.budget_s``, for the
low-precision choice :func:`planned` picks among those measured (:func:`.plan.planned_choice`).

1. **Sensitivity, on one batch** (no training): each converted layer's effect on the loss and
   the model's gradient against FP32's, and its own error (:mod:`.sensitivity`).
2. **Ranking and the plan**: :mod:`.plan`.
3. **Verifying runs**: when the choice's all-layers short run (advise's fidelity run) is not within
   the allowed difference to FP32's loss, short runs of the same length with the planned layers
   in the choice's exclude key (appended to the user's patterns) search for the smallest set
   within (:func:`.plan.next_keep`), as long as the budget lasts; then the per-GEMM plan
   (:mod:`.gemms`). The kept set's step time is recorded beside the all-layers run's and BF16's.

Everything goes into one dict (:func:`new_plan`), filled part by part so an interrupt keeps what
was measured; ``skipped`` names each part not measured and why.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

from mptrain.commands.advise import choices, gemms
from mptrain.commands.advise import decide as advice
from mptrain.commands.advise import plan as planning
from mptrain.commands.advise.measure import Candidate, latest_cost, speed_need
from mptrain.commands.advise.seeds import speed_budget
from mptrain.commands.advise.sensitivity import measure_gemm_sensitivity, measure_sensitivity
from mptrain.commands.advise.trials import PILOT_WARMUP, Budget, estimated, short_run, timed_part
from mptrain.config.commands import AdviseConfig, plan_choice
from mptrain.config.run import RunConfig

SENSITIVITY = "layer plan: sensitivity"  # timings' part names
VERIFY = "layer plan: verifying run"


# ------------------------------------------------------------------------------ within the budget
def new_plan() -> dict[str, Any]:
    """What :func:`run_plan` fills: nothing measured yet (``skipped``: part -> why;
    ``runs``: the verifying runs in order)."""
    return {"skipped": {}, "runs": []}


LOW_NAMES = tuple(r.name for r in choices.LOW_PRECISION)


def planned(cands: list[Candidate], choice: str = "auto") -> Candidate | None:
    """The low-precision candidate the plan is for among those whose pilot ran: the one named by
    ``choice`` (``advise.plan``, normalised), or for "auto" :func:`.plan.planned_choice`'s pick;
    None when there is none."""
    lows = [c for c in cands if c.name in LOW_NAMES and c.pilot is not None and not c.skipped]
    if choice == "auto":
        options = [
            {
                "name": c.name,
                "fidelity": c.fidelity is not None,
                "timed": c.timed,
                "step_s": latest_cost(c).step_s,
            }
            for c in lows
        ]
        choice = planning.planned_choice(options)
    return next((c for c in lows if c.name == choice), None)


def _why_not(c: Candidate) -> str:
    """Why ``c`` cannot be planned for: why it did not run, or what of it was not measured."""
    if "all" in c.skipped:
        return c.skipped["all"]
    if c.pilot is None:
        return "no pilot"
    return next((f"{part}: {why}" for part, why in c.skipped.items()), "no run")


def _not_plannable(
    fp32: Candidate, low: Candidate | None, cands: list[Candidate], settings: AdviseConfig
) -> str | None:
    """Why no per-layer plan can be measured, or None."""
    choice = plan_choice(settings.plan)
    if choice == "false":
        return "advise.plan=false"
    if low is None:
        names = LOW_NAMES if choice == "auto" else (choice,)
        whys = [(c.name, _why_not(c)) for c in cands if c.name in names]
        if len(whys) > 1:  # each one's reason is on its own line already: not said again here
            why = f" ({', '.join(n for n, _ in whys)}: each one's reason is listed with it)"
        else:
            why = "".join(f" ({name}: {w})" for name, w in whys)
        if choice == "auto":
            return f"no low-precision choice was measured{why}"
        return f"advise.plan={choice}: its all-layers short run did not run{why}"
    if fp32.fidelity is None:
        return "no FP32 reference run to compare with"
    return None


def _left_s(cands: list[Candidate], settings: AdviseConfig, budget: Budget) -> float:
    """What the budget leaves once the admitted precisions' speed measurements and the seeds'
    reserve are set aside."""
    admitted = [c for c in cands if c.timed and c.fidelity is not None and not c.skipped]
    speed = speed_budget(cands, settings, budget)
    return speed.left_s() - speed_need(admitted, settings, settings.speed_steps)


def run_plan(
    cands: list[Candidate],
    settings: AdviseConfig,
    budget: Budget,
    timings: dict[str, Any],
    plan: dict[str, Any],
) -> None:
    """The module doc's steps into ``plan`` (:func:`new_plan`), each only when its estimate
    (from the choice's and FP32's measured runs) fits what is left, else skipped with it."""
    fp32, low = cands[0], planned(cands, plan_choice(settings.plan))
    why = _not_plannable(fp32, low, cands, settings)
    if why is not None:
        plan["skipped"]["all"] = why
        return
    plan.update(precision=low.name, label=low.choice.label)
    passes = 3 * low.pilot.converted + 4  # reference, warm-up, none, all; per layer 3
    need = latest_cost(fp32).overhead_s + passes * latest_cost(low).step_s
    left_s = _left_s(cands, settings, budget)
    if need > left_s:
        plan["skipped"]["all"] = estimated(need, f" ({passes} passes of one batch)", left_s)
        return
    with timed_part(timings, SENSITIVITY):
        measure_sensitivity(fp32.cfg, low.cfg, plan, budget.deadline())
    if "ranking" in plan:
        plan["exclude_base"] = list(getattr(low.cfg, planning.exclude_key(low.name)).exclude)
        verify(plan, fp32, low, lambda: _left_s(cands, settings, budget), budget, timings)
        record_speed(plan, low, next((c for c in cands if c.name == "bf16"), None))


def with_kept(cfg: RunConfig, kept: list[str], key: str) -> RunConfig:
    """``cfg`` with ``kept`` appended to the exclude patterns of config group ``key``."""
    group = getattr(cfg, key)
    return dataclasses.replace(
        cfg, **{key: dataclasses.replace(group, exclude=[*group.exclude, *kept])}
    )


def plan_configs(plan: dict[str, Any], candidates: list[Candidate]) -> dict[str, RunConfig]:
    """The per-layer plan's configs, once a set of layers is kept, for :func:`.predict.predict`:
    its choice with them whole in high precision (``kept_layers``: its exclude key) and, where the
    per-GEMM plan ran, with only their lifted GEMMs in BF16 (``per_gemm``: ``precision.gemms``);
    none before."""
    low = next((c for c in candidates if c.name == plan.get("precision")), None)
    kept = plan.get("kept")
    if low is None or not kept:
        return {}
    out = {"kept_layers": with_kept(low.cfg, kept, planning.exclude_key(low.name))}
    per_gemm = plan.get("gemm_plan") or {}
    if "gemms" in per_gemm:
        out["per_gemm"] = gemms.with_lift(low.cfg, per_gemm["layers"], per_gemm["gemms"])
    return out


def record_speed(plan: dict[str, Any], low: Candidate, bf16: Candidate | None) -> None:
    """``plan["speed"]`` once a set is verified: the step time of the run that verified it
    (the all-layers run when nothing is kept) beside the all-layers run's and BF16's short run;
    for an emulated choice only that it is emulated."""
    kept = plan.get("kept")
    if kept is None:
        return
    if low.emulated:
        plan["speed"] = {"emulated": True}
        return
    every = low.fidelity.step_time_s
    verified = next((r for r in plan["runs"] if r["kept"] == kept), None)
    note = None
    if bf16 is None:
        note = "not a candidate here"
    elif bf16.fidelity is None:
        note = next(iter(bf16.skipped.values()), "no short run")
    plan["speed"] = {
        "emulated": False,
        "kept_step_s": verified["step_s"] if verified else every,
        "all_layers_step_s": every,
        "bf16_step_s": bf16.fidelity.step_time_s if note is None else None,
        "bf16_note": note,
    }


def _all_layers(plan: dict[str, Any], fp32: Candidate, low: Candidate) -> float | None:
    """Record the choice's all-layers fidelity run in ``plan`` and return its loss gap (inf when
    it stopped); None, with why, when it was not measured."""
    fidelity = low.fidelity_against(fp32.fidelity)
    if fidelity is None:
        why = low.skipped.get("fidelity and speed", "no run")
        plan["skipped"]["kept set"] = f"{low.name}'s all-layers run was not measured ({why})"
        return None
    f = dataclasses.asdict(fidelity)
    plan["all_layers"] = {**f, "within": planning.within(f, plan["allowed"])}
    return f["max_rel_diff"] if f["diverged"] is None else math.inf


def verify(
    plan: dict[str, Any],
    fp32: Candidate,
    low: Candidate,
    left_s: Callable[[], float],
    budget: Budget,
    timings: dict[str, Any],
) -> None:
    """Step 3 of the module doc: ``kept`` (the layers to keep; [] when the all-layers run is
    within) and ``runs``, or ``skipped`` with why no set was verified. ``left_s()``: seconds
    the plan may still spend."""
    settings = low.cfg.advise
    ctx = advice.Context(tolerance=settings.tolerance, fp32_spread=fp32.nudge_spread)
    plan["allowed"] = advice.allowed_difference(ctx)
    gap_all = _all_layers(plan, fp32, low)
    if gap_all is None:
        return
    dbs = [p["grad_sqnr_db"] for p in plan["prefixes"]]
    plan["predicted"] = planning.predicted_gaps(dbs, gap_all)
    keep, n = planning.first_keep(gap_all, plan["allowed"], plan["predicted"]), len(plan["ranking"])
    if keep == 0:
        plan["kept"] = []
        return
    verified: dict[int, bool] = {}
    while keep is not None and keep < n:
        run = verifying_run(plan["ranking"][:keep], fp32, low, left_s, budget, timings)
        if isinstance(run, str):
            plan["skipped"]["verifying run"] = run
            break
        run["within"] = planning.within(run, plan["allowed"])
        plan["runs"].append(run)
        verified[keep] = run["within"]
        keep = planning.next_keep(verified, n)
    if any(verified.values()):
        plan["kept"] = plan["ranking"][: min(k for k, ok in verified.items() if ok)]
        verify_gemms(plan, fp32, low, left_s, budget, timings)
    elif "verifying run" not in plan["skipped"]:
        short_of = "the only eligible layer" if n == 1 else f"all {n} eligible layers"
        plan["skipped"]["kept set"] = (
            f"no set short of {short_of} brings {low.name}'s loss within {plan['allowed']:.1%} "
            f"of FP32's: {low.name} does not fit this model"
        )


def verify_gemms(
    plan: dict[str, Any],
    fp32: Candidate,
    low: Candidate,
    left_s: Callable[[], float],
    budget: Budget,
    timings: dict[str, Any],
) -> None:
    """Step 2 of :mod:`.gemms`: ``plan["gemm_plan"]``, the kept layers with only their lifted
    GEMMs in BF16 run short against FP32's, or why it was not run."""
    passes = 3 + 4 * len(plan["kept"])  # reference, warm-up, all; per layer 4
    need = latest_cost(fp32).overhead_s + passes * latest_cost(low).step_s
    why = gemms.refusal(low.cfg) if "layers" in plan else "no one-batch figures"
    if why is None and len(plan["kept"]) > gemms.GEMM_LAYERS:
        why = (
            f"{len(plan['kept'])} layers kept: the GEMMs are measured for up to {gemms.GEMM_LAYERS}"
        )
    if why is None and need > left_s():
        why = (
            f"estimated {need:.0f} s ({passes} passes of one batch), {max(left_s(), 0):.0f} s left"
        )
    if why is None:
        with timed_part(timings, f"{SENSITIVITY}, per GEMM"):
            measure_gemm_sensitivity(fp32.cfg, low.cfg, plan, budget.deadline())
        lift = gemms.lift_of(plan)
        why = lift if isinstance(lift, str) else None
    if why is not None:
        plan["gemm_plan"] = {"skipped": why}
        return
    cfg = gemms.with_lift(low.cfg, plan["kept"], lift)
    run = verifying_run(plan["kept"], fp32, low, left_s, budget, timings, cfg)
    if isinstance(run, str):
        plan["gemm_plan"] = {"skipped": run}
        return
    within = planning.within(run, plan["allowed"])
    plan["gemm_plan"] = {"layers": plan["kept"], "gemms": lift, "run": run, "within": within}


def verifying_run(
    kept: list[str],
    fp32: Candidate,
    low: Candidate,
    left_s: Callable[[], float],
    budget: Budget,
    timings: dict[str, Any],
    cfg: RunConfig | None = None,
) -> dict[str, Any] | str:
    """The choice's short run with ``kept`` in high precision (its exclude key; ``cfg``: the run
    to make instead, a per-GEMM plan of them) against FP32's: its fidelity figures, losses and
    step time; or why it did not run or finish."""
    steps = low.cfg.advise.fidelity_steps
    need = latest_cost(low).of(steps)
    if need > left_s():
        layers = f"{len(kept)} layer{'s' if len(kept) > 1 else ''}"
        return f"keeping {layers}: {estimated(need, '', left_s())}"
    part = f"{VERIFY}, {len(kept)} kept" + (", per GEMM" if cfg is not None else "")
    cfg = cfg or with_kept(low.cfg, kept, planning.exclude_key(low.name))
    with timed_part(timings, part):
        trial = short_run(cfg, steps, PILOT_WARMUP, budget.deadline())
    if trial.cut_short:
        return f"the budget ran out after {trial.steps} of {steps} steps"
    f = advice.fidelity_of(trial.losses, fp32.fidelity.losses, trial.skipped_steps, trial.diverged)
    return {
        "kept": kept,
        **dataclasses.asdict(f),
        "losses": trial.losses,
        "step_s": trial.step_time_s,
    }


def note_not_reached(plan: dict[str, Any], why: str) -> None:
    """After an interrupt: the part of ``plan`` not finished is listed as not measured (``why``)."""
    if "kept" in plan or plan["skipped"]:
        return  # finished, or already said why not
    plan["skipped"]["verifying run" if "ranking" in plan else "all"] = why
