"""What advise measures of the combination its fit recommends for ``advise.batch_size``
(:mod:`.footprint` predicts it from the accounting):

- :func:`run_fit_cost`: what the combination's state choice and checkpointing cost in step time
  against its precision alone, side by side as bench does, here (before the seeds, which take
  whatever budget is left);
- :func:`run_fit_check`: when advise runs on the GPU ``advise.target`` names, the combination
  trained for :data:`CHECK_STEPS` steps at ``advise.batch_size`` there, its measured peak (CUDA's
  max allocated) set beside the prediction, or the out-of-memory error it met. Anywhere else the
  fit stays predicted, and says so.

Both go into ``found["footprint"]`` (``cost``, ``measured``), or why not into its ``skipped``;
:func:`.footprint.assemble` puts them beside the fit.
"""

from __future__ import annotations

import dataclasses
import gc
from typing import TYPE_CHECKING, Any

from mptrain.commands.advise import fits
from mptrain.commands.advise.footprint import assemble, step_times, with_state
from mptrain.commands.advise.trials import short_run, timed_part

if TYPE_CHECKING:
    import torch

    from mptrain.commands.advise.measure import Candidate
    from mptrain.commands.advise.trials import Budget
    from mptrain.config.run import RunConfig

# Steps of the combination on the target GPU: the first allocates, the optimizer's state appears
# after it, so the second and third hold what every later step holds.
CHECK_STEPS = 3


def provisional_fit(
    cfg: RunConfig, found: dict[str, Any], verdicts: dict[str, str | None], device: torch.device
) -> tuple[dict[str, Any], Any]:
    """(the fit :func:`.footprint.assemble` recommends now, among the precisions whose
    ``verdicts`` are None, or {}; the target GPU or None)."""
    from mptrain.commands.advise import predict

    gpu, _ = predict.target_gpu(cfg, device)
    prediction = predict.predict(cfg, device, found["candidates"]) if gpu else None
    times, time_basis = step_times(found["candidates"], prediction)
    memory = assemble(cfg, found, gpu, times, time_basis, verdicts, device)
    return (memory.get("target") or {}).get("fit") or {}, gpu


def _plain(found: dict[str, Any], fit: dict[str, Any]) -> Candidate:
    return next(c for c in found["candidates"] if c.name == fit["combination"][0])


def run_fit_cost(
    cfg: RunConfig,
    found: dict[str, Any],
    verdicts: dict[str, str | None],
    budget: Budget,
    timings: dict[str, Any],
    device: torch.device,
) -> None:
    """Measure the step-time cost of what the fit recommends beyond its precision (a state
    choice, checkpointing) side by side with the precision alone, bench's rotated repetitions;
    into ``found["footprint"]["cost"]``, or why not (``skipped["speed cost"]``)."""
    from mptrain.commands import bench
    from mptrain.commands.advise.measure import latest_cost, speed_measure

    footprint, settings = found["footprint"], cfg.advise
    if settings.batch_size is None:
        return
    fit, _ = provisional_fit(cfg, found, verdicts, device)
    if not fit.get("overrides"):
        return
    plain = _plain(found, fit)
    if plain.pilot is None:
        footprint["skipped"]["speed cost"] = f"{plain.name} was not run here"
        return
    combo = _combination_config(plain.cfg, fit["combination"], footprint.get("user_state"))
    steps, runs = settings.speed_steps, settings.warmup_steps + settings.speed_steps
    need = 2 * settings.reps * latest_cost(plain).of(runs) * 1.5  # recomputing: up to 1.5×
    if need > budget.left_s():
        footprint["skipped"]["speed cost"] = (
            f"estimated {need:.0f} s; {max(budget.left_s(), 0):.0f} s of advise.budget_s left"
        )
        return
    configs = {"alone": plain.cfg, "combination": combo}
    with timed_part(timings, "memory speed cost"):
        reps, refused = bench.measure_reps(
            configs, settings.warmup_steps, steps, settings.reps, speed_measure(budget.deadline())
        )
    if refused or not reps["alone"] or not reps["combination"]:
        footprint["skipped"]["speed cost"] = "; ".join(refused.values()) or "no repetition fit"
        return
    footprint["cost"] = {"combination": fit["combination"], **_paired(reps), "on": device.type}


def on_target(gpu: Any, device: torch.device) -> bool:
    """Whether this process runs on the GPU ``gpu`` (a row of the peak table) stands for."""
    from mptrain.commands.advise.predict import device_name
    from mptrain.perf import gpus

    here = device_name(device)
    return here is not None and gpus.row_for_device_name(here) == gpu


def run_fit_check(
    cfg: RunConfig,
    found: dict[str, Any],
    verdicts: dict[str, str | None],
    budget: Budget,
    timings: dict[str, Any],
    device: torch.device,
) -> None:
    """On the target GPU itself: train the recommended combination :data:`CHECK_STEPS` steps at
    ``advise.batch_size`` and record its measured peak into ``found["footprint"]["measured"]``
    (see the module doc); elsewhere, why the fit is not measured (``skipped["measured"]``)."""
    from mptrain.commands.advise.measure import latest_cost
    from mptrain.commands.advise.predict import device_name

    footprint = found["footprint"]
    if cfg.advise.batch_size is None:
        return
    fit, gpu = provisional_fit(cfg, found, verdicts, device)
    if "combination" not in fit:
        return
    if not on_target(gpu, device):
        here = device_name(device) or f"the {device.type}"
        footprint["skipped"]["measured"] = f"advise ran on {here}, not on a {gpu.key}"
        return
    plain = _plain(found, fit)
    if plain.pilot is None:
        footprint["skipped"]["measured"] = f"{plain.name} was not run here"
        return
    # Its pilot's cost, scaled to the asked-for micro-batch; recomputing: up to 1.5x.
    need = latest_cost(plain).of(CHECK_STEPS) * fit["batch_size"] / plain.cfg.batch_size * 1.5
    if need > budget.left_s():
        footprint["skipped"]["measured"] = (
            f"estimated {need:.0f} s; {max(budget.left_s(), 0):.0f} s of advise.budget_s left"
        )
        return
    combo = _combination_config(plain.cfg, fit["combination"], footprint.get("user_state"))
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
    import torch

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
