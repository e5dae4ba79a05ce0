"""``mptrain advise``'s entry point: measure every candidate, turn the measurements into
:class:`~mptrain.commands.advise.decide.Measured` records, decide, and write the report.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from rich.console import Console

from mptrain.commands.advise import decide as advice
from mptrain.commands.advise.measure import (
    Candidate,
    candidates,
    measure_numerics,
    run_fidelity,
    run_pilots,
    run_speed,
)
from mptrain.commands.advise.trials import Budget, Trial
from mptrain.config.run import RunConfig
from mptrain.models.build import config_has_convolutions
from mptrain.platform import hardware


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
    from mptrain.commands.advise import report as advise_report

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
