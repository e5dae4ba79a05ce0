"""What advise measures of the combination its fit recommends for ``advise.batch_size``
(:func:`measure_fit`, once; :mod:`.footprint` predicts it): its speed cost here (its state choice
and checkpointing against its precision alone, side by side as bench times them, before the
seeds), and where advise runs on the GPU ``advise.target`` names its peak there (:data:`CHECK_STEPS`
steps at ``advise.batch_size``: CUDA's max allocated, or the out-of-memory error it met); anywhere
else the fit stays predicted, and says so. Both go into ``found["footprint"]`` (``cost``,
``measured``), or why not into its ``skipped``; :func:`.footprint.assemble` puts them beside the
fit.
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from mptrain.commands import bench
from mptrain.commands.advise import fits, predict
from mptrain.commands.advise.footprint import assemble, with_state
from mptrain.commands.advise.measure import Candidate, latest_cost, speed_measure
from mptrain.commands.advise.trials import short_run, timed_part

if TYPE_CHECKING:
    from mptrain.commands.advise.trials import Budget, Cost
    from mptrain.config.commands import AdviseConfig
    from mptrain.config.run import RunConfig

# Steps of the combination on the target GPU: the first allocates, the optimizer's state appears
# after it, so the second and third hold what every later step holds.
CHECK_STEPS = 3


@dataclass(frozen=True)
class Recommended:
    """The fit advise recommends now (:func:`.footprint.assemble`'s ``target.fit``), the
    candidate of its precision, and that precision's config with the combination's state choice
    and checkpointing mode."""

    fit: dict[str, Any]
    plain: Candidate
    combo: RunConfig


def measure_fit(
    cfg: RunConfig,
    found: dict[str, Any],
    verdicts: dict[str, str | None],
    budget: Budget,
    timings: dict[str, Any],
    device: torch.device,
) -> None:
    """For ``advise.batch_size``: the fit :func:`.footprint.assemble` recommends now (once, among
    the precisions whose ``verdicts`` are None), then its speed cost here and its peak on the
    target GPU itself (the module doc); nothing without a batch asked for or a combination that
    fits it."""
    if cfg.advise.batch_size is None:
        return
    gpu, _ = predict.target_gpu(cfg, device)
    prediction = predict.predict(cfg, device, found["candidates"]) if gpu else None
    memory = assemble(cfg, found, prediction, verdicts, device)
    fit = (memory.get("target") or {}).get("fit") or {}
    if "combination" not in fit:
        return
    footprint = found["footprint"]
    plain = next(c for c in found["candidates"] if c.name == fit["combination"][0])
    combo = _combination_config(plain.cfg, fit["combination"], footprint.get("user_state"))
    recommended = Recommended(fit, plain, combo)
    if fit["overrides"]:  # the precision alone is the recommendation: nothing to cost
        _speed_cost(cfg.advise, footprint, recommended, budget, timings, device)
    _peak_on_target(footprint, recommended, gpu, budget, timings, device)


def _unaffordable(plain: Candidate, need_of: Callable[[Cost], float], budget: Budget) -> str | None:
    """Why ``plain``'s combination cannot be measured now: its precision did not run here (no
    cost to estimate from), or ``need_of(its cost)`` seconds exceed what ``advise.budget_s`` has
    left; None when it can."""
    if plain.pilot is None:
        return f"{plain.name} was not run here"
    need = need_of(latest_cost(plain))
    if need > budget.left_s():
        return f"estimated {need:.0f} s; {max(budget.left_s(), 0):.0f} s of advise.budget_s left"
    return None


def _speed_cost(
    settings: AdviseConfig,
    footprint: dict[str, Any],
    recommended: Recommended,
    budget: Budget,
    timings: dict[str, Any],
    device: torch.device,
) -> None:
    """The step-time cost of what the fit adds to its precision (a state choice, checkpointing),
    side by side with the precision alone, bench's rotated repetitions; into
    ``footprint["cost"]``, or why not (``skipped["speed cost"]``)."""
    fit, plain = recommended.fit, recommended.plain
    steps, runs = settings.speed_steps, settings.warmup_steps + settings.speed_steps
    # both configs, every repetition; recomputing: up to 1.5x
    why = _unaffordable(plain, lambda cost: 2 * settings.reps * cost.of(runs) * 1.5, budget)
    if why:
        footprint["skipped"]["speed cost"] = why
        return
    configs = {"alone": plain.cfg, "combination": recommended.combo}
    with timed_part(timings, "memory speed cost"):
        reps, refused = bench.measure_reps(
            configs, settings.warmup_steps, steps, settings.reps, speed_measure(budget.deadline())
        )
    if refused or not reps["alone"] or not reps["combination"]:
        footprint["skipped"]["speed cost"] = "; ".join(refused.values()) or "no repetition fit"
        return
    footprint["cost"] = {"combination": fit["combination"], **_paired(reps), "on": device.type}


def _peak_on_target(
    footprint: dict[str, Any],
    recommended: Recommended,
    gpu: Any,
    budget: Budget,
    timings: dict[str, Any],
    device: torch.device,
) -> None:
    """On the target GPU itself: the combination trained :data:`CHECK_STEPS` steps at
    ``advise.batch_size``, its measured peak into ``footprint["measured"]``; elsewhere, or
    without the budget for it, why not (``skipped["measured"]``)."""
    if not predict.on_gpu(gpu, device):
        here = predict.device_name(device) or f"the {device.type}"
        footprint["skipped"]["measured"] = f"advise ran on {here}, not on a {gpu.key}"
        return
    fit, plain = recommended.fit, recommended.plain
    # its pilot's cost scaled to the asked-for micro-batch; recomputing: up to 1.5x
    scale = fit["batch_size"] / plain.cfg.batch_size * 1.5
    why = _unaffordable(plain, lambda cost: cost.of(CHECK_STEPS) * scale, budget)
    if why:
        footprint["skipped"]["measured"] = why
        return
    combo = recommended.combo
    memory = dataclasses.replace(combo.memory, account=False)  # its copies would raise the peak
    combo = dataclasses.replace(
        combo, batch_size=fit["batch_size"], grad_accum_steps=1, memory=memory
    )
    with timed_part(timings, "memory check"):
        footprint["measured"] = measure_peak(combo, fit["combination"], budget)


def measure_peak(cfg: RunConfig, combination: list[str], budget: Budget) -> dict[str, Any]:
    """``cfg`` trained :data:`CHECK_STEPS` steps: its micro-batch, the peak its run measured
    (``peak_bytes``, CUDA's max allocated since the run began) and on what, or the first line of
    the out-of-memory error it met instead (``out_of_memory``)."""
    out: dict[str, Any] = {"combination": combination, "batch_size": cfg.batch_size}
    try:
        trial = short_run(cfg, CHECK_STEPS, warmup=1, deadline=budget.deadline(), per_step=False)
    except torch.OutOfMemoryError as error:
        out["out_of_memory"] = str(error).splitlines()[0]
    else:
        return {**out, "steps": trial.steps, "peak_bytes": trial.figures["peak_memory_bytes"]}
    # Outside the handler: its traceback no longer holds the failed run's tensors.
    gc.collect()
    torch.cuda.empty_cache()
    return out


def _combination_config(cfg: RunConfig, combination: list[str], users: str | None) -> RunConfig:
    """``cfg`` (a precision's, timed alone beside it) with the combination's checkpointing mode
    and state choice: nothing else differs between the two."""
    _, state, mode = combination
    memory = dataclasses.replace(cfg.memory, activation_checkpointing=mode)
    combo = dataclasses.replace(cfg, memory=memory)
    chosen = fits.state_choice(state)
    return with_state(combo, chosen) if chosen is not None and state != users else combo


def _paired(reps: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """The combination's step time over the precision alone's, paired per repetition: median,
    min–max, how many pairs."""
    pairs = sorted(
        b["step_time_ms"] / a["step_time_ms"]
        for a, b in zip(reps["alone"], reps["combination"], strict=False)
        if a["step_time_ms"] and b["step_time_ms"]
    )
    if not pairs:
        return {"step_time_vs_alone": None, "range": None, "reps": 0}
    return {
        "step_time_vs_alone": pairs[len(pairs) // 2],
        "range": [pairs[0], pairs[-1]],
        "reps": len(pairs),
    }
