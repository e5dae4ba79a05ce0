"""``mptrain advise``'s entry point: measure every candidate, turn the measurements into
:class:`~mptrain.commands.advise.decide.Measured` records, decide, and write the report.

Torch and the training code are imported inside the functions, not here: the budget's clock
starts when :func:`advise_main` is called, and importing them is part of what advise costs.
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from mptrain.commands.advise import decide as advice
from mptrain.commands.advise.choices import add_commands, command_for
from mptrain.platform import contention, hardware
from mptrain.platform.signals import SignalsHeld, Terminated

if TYPE_CHECKING:
    import torch
    from rich.console import Console

    from mptrain.commands.advise.measure import Candidate
    from mptrain.commands.advise.trials import Budget, Trial
    from mptrain.config.commands import AdviseConfig
    from mptrain.config.run import RunConfig


# ------------------------------------------------------------------------------ to a decision
def to_measured(c: Candidate, reference: Trial | None, numerics: dict[str, Any]) -> advice.Measured:
    """The decision's view of a candidate: figures only, reasons for what is missing."""
    ratio = c.speed is not None and "vs_fp32" in c.speed
    speed = advice.Speed(c.speed["vs_fp32"], *c.speed["vs_fp32_range"]) if ratio else None
    audit = numerics.get("audit", {}).get(c.name, {})
    # In the order the step ran them (the model's order), each once: a fix reads like the model.
    flagged = (o["module"] for o in audit.get("flagged_ops", []))
    modules = list(dict.fromkeys(m for m in flagged if m != "(autograd)"))
    probe = numerics["probe"]
    overflow = tuple(probe["overflow_modules"]) if c.name == "fp16" and probe else ()
    return advice.Measured(
        precision=c.name,
        not_run=c.skipped.get("all"),
        speed=speed,
        speed_note=c.skipped.get("speed"),
        fidelity=c.fidelity_against(reference),
        fidelity_note=c.skipped.get("fidelity and speed"),
        emulated=c.emulated,
        fp16_overflow=overflow,
        audit_modules=tuple(modules),
    )


def measured_inputs(
    cfg: RunConfig, found: dict[str, Any], device: torch.device
) -> tuple[list[advice.Measured], advice.Context]:
    """The decision's inputs: one :class:`~.decide.Measured` per candidate (the seeds' verdicts
    included) and the context."""
    from mptrain.commands.advise.seeds import with_verdicts
    from mptrain.models.build import config_has_convolutions

    cands, numerics = found["candidates"], found["numerics"]
    fp32 = cands[0]  # measure.candidates: FP32 first, always
    interrupted = found["interrupted"]
    ctx = advice.Context(
        tolerance=cfg.advise.tolerance,
        fp32_spread=fp32.nudge_spread,
        max_skipped_fraction=cfg.advise.max_skipped_fraction,
        device_type=device.type,
        has_convolutions=config_has_convolutions(cfg.model, cfg.task == "lm"),
        channels_last=cfg.channels_last,
        interrupted_by=interrupted["signal"] if interrupted else None,
        busy=contention.busy_words(found.get("machine_load")),
    )
    measured = [to_measured(c, fp32.fidelity, numerics) for c in cands]
    return with_verdicts(measured, found.get("confidence"), ctx.interrupted_by), ctx


def new_findings(cands: list[Candidate], settings: AdviseConfig) -> dict[str, Any]:
    """What :func:`measure_all` fills in place, so that an interrupt keeps what was measured:
    the candidates, the numerics, each part's seconds, the seeds, and (set after an interrupt)
    which signal came during which part."""
    from mptrain.commands.advise.footprint import new_footprint
    from mptrain.commands.advise.layers import new_plan
    from mptrain.commands.advise.measure import new_numerics
    from mptrain.commands.advise.seeds import new_confidence

    return {
        "confidence": new_confidence(settings),
        "candidates": cands,
        "numerics": new_numerics(),
        "plan": new_plan(),  # the per-layer plan (advise.plan)
        "footprint": new_footprint(),  # one step's accounted bytes (what fits a GPU)
        "timings": {},
        "interrupted": None,
        "machine_load": None,  # set once speed was measured: whether others competed for cores
    }


def measure_all(cfg: RunConfig, budget: Budget, found: dict[str, Any]) -> None:
    """Steps 1–6 of the package doc within ``budget``, into ``found`` (:func:`new_findings`)."""
    from mptrain.commands.advise.fit_measure import measure_fit
    from mptrain.commands.advise.footprint import faithful, run_footprint
    from mptrain.commands.advise.layers import run_plan
    from mptrain.commands.advise.measure import (
        measure_numerics,
        run_fidelity,
        run_pilots,
        run_speed,
    )
    from mptrain.commands.advise.seeds import run_seeds, speed_budget
    from mptrain.commands.advise.trials import START_UP, timed_part

    cands, timings = found["candidates"], found["timings"]
    timings[START_UP] = budget.elapsed_s()
    run_pilots(cands, budget, timings)
    asked_to_fit = cfg.advise.batch_size is not None  # then the memory is the question: first
    if asked_to_fit:
        run_footprint(cfg, cands, budget, timings, found["footprint"])
    with timed_part(timings, "numerics"):
        measure_numerics(cfg, cands, budget, found["numerics"])
    if not asked_to_fit:
        run_footprint(cfg, cands, budget, timings, found["footprint"])
    run_fidelity(cands, cfg.advise, budget, timings)
    run_plan(cands, cfg.advise, budget, timings, found["plan"])
    before = contention.sample()
    run_speed(cands, cfg.advise, speed_budget(cands, cfg.advise, budget), timings)
    device = hardware.resolve_device(cfg.device)
    found["machine_load"] = contention.judged_since(before, device)
    inputs = measured_inputs(cfg, found, device)
    measure_fit(cfg, found, faithful(*inputs), budget, timings, device)
    run_seeds(cfg, found, advice.recommend(*inputs), budget, timings)  # the finalists'


def note_interrupt(found: dict[str, Any], signal_name: str, budget: Budget) -> None:
    """Record in ``found`` that ``signal_name`` stopped the measuring, during which part and
    when, and list every part not reached as not measured because of it."""
    from mptrain.commands.advise.layers import note_not_reached
    from mptrain.commands.advise.measure import mark_not_reached
    from mptrain.commands.advise.trials import IN_PROGRESS

    timings = found["timings"]
    during = timings.pop(IN_PROGRESS, None)
    found["interrupted"] = {"signal": signal_name, "during": during, "after_s": budget.elapsed_s()}
    why = f"interrupted by {signal_name}" + (f" during {during}" if during else "")
    mark_not_reached(found["candidates"], found["numerics"], timings, why)
    if not found["footprint"].get("ran"):
        found["footprint"]["skipped"].setdefault("memory (part)", why)
    note_not_reached(found["plan"], why)


class StopOnce(SignalsHeld):
    """While active, the first SIGINT, SIGTERM or SIGHUP raises :class:`Terminated` where the
    measuring is, as long as it is ``armed``; every later signal, and any once disarmed, is
    recorded (``signum`` keeps the first) and otherwise ignored, so that the advice — partial
    or whole — is written to its end. No gap between the two: the handler stays installed."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = True

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        first = self.signum is None
        super()._handle(signum, frame)
        if first and self.armed:
            raise Terminated(signum)


def run_advise(
    cfg: RunConfig, overrides: list[str], output_dir: Path, console: Console, budget: Budget
) -> dict[str, Any]:
    """Measure (see module doc) within ``budget``, decide, write advise.md/.json/.png, print;
    return the result.

    A stop signal while measuring ends the measuring: what was measured is written all the same,
    with the parts not reached listed as interrupted; then one line on stderr says where, and
    SystemExit(128 + the signal: 130, 143, 129) ends the command like an interrupted training
    run. A signal once measuring is over is ignored until the advice is written."""
    from mptrain.commands.advise.measure import candidates

    device = hardware.resolve_device(cfg.device)
    with StopOnce() as stop:
        found = new_findings(candidates(cfg, device), cfg.advise)
        output_dir.mkdir(parents=True, exist_ok=True)  # where the advice goes, from the start
        try:
            measure_all(cfg, budget, found)
        except KeyboardInterrupt:  # Terminated too; without a handler (not the main thread) SIGINT
            note_interrupt(found, stop.name or "SIGINT", budget)
        stop.armed = False
        result = write_advice(cfg, overrides, output_dir, console, budget, found, device)
    if found["interrupted"]:
        signal_name = found["interrupted"]["signal"]
        from mptrain.commands.advise.report import ADVISE_MD  # imported by now

        where = output_dir / ADVISE_MD
        print(
            f"mptrain: advise interrupted by {signal_name}; what was measured: {where}",
            file=sys.stderr,
        )
        raise SystemExit(128 + signal.Signals[signal_name])
    return result


def write_advice(
    cfg: RunConfig,
    overrides: list[str],
    output_dir: Path,
    console: Console,
    budget: Budget,
    found: dict[str, Any],
    device: torch.device,
) -> dict[str, Any]:
    """Predict the speed on ``advise.target`` (:mod:`.predict`: the candidates' and the per-layer
    plan's), decide on ``found``, write advise.png/.json/.md into ``output_dir``, print; the
    result."""
    from mptrain.commands.advise import footprint, gemms, predict
    from mptrain.commands.advise import report as advise_report
    from mptrain.commands.advise.layers import plan_configs
    from mptrain.commands.advise.plan import add_command, list_item
    from mptrain.commands.advise.trials import timed_part

    with timed_part(found["timings"], "prediction"):
        cands, plan = found["candidates"], found["plan"]
        found["prediction"] = predict.predict(cfg, device, cands, plan, plan_configs(plan, cands))
    inputs = measured_inputs(cfg, found, device)
    decision = advice.recommend(*inputs)
    verdicts = footprint.faithful(*inputs)
    found["memory"] = footprint.assemble(cfg, found, found["prediction"], verdicts, device)
    add_command(plan, overrides)
    gemms.add_command(plan, overrides, list_item)
    result = advise_report.assemble(
        cfg, device, found, decision, command_for(overrides, decision.precision)
    )
    result["memory"] = found["memory"]
    add_commands(result, overrides)
    add_fit_command(result["memory"], overrides)
    advise_report.write(result, output_dir, budget)
    advise_report.show(console, result, output_dir)
    return result


def add_fit_command(memory: dict[str, Any], overrides: list[str]) -> None:
    """The recommended combination's training command into its ``fit``: its precision's
    command, the asked-for micro-batch and the state and checkpointing overrides, the user's own
    keys for those dropped."""
    fit = (memory.get("target") or {}).get("fit") or {}
    if "combination" not in fit:
        return
    replaced = ["batch_size=", *(o.split("=")[0] + "=" for o in fit["overrides"])]
    if any(o.startswith("optimizer=") for o in fit["overrides"]):  # another schema: its keys only
        replaced += [f"optimizer.{k}=" for k in ("state_dtype", "state_rounding")]
    kept = [o for o in overrides if not o.lstrip("+~").startswith(tuple(replaced))]
    command = command_for(kept, fit["combination"][0])
    fit["command"] = " ".join([command, f"batch_size={fit['batch_size']}", *fit["overrides"]])


def advise_main(overrides: list[str]) -> None:
    """``mptrain advise [overrides]`` (the CLI's subcommand table calls this). Bad input raises
    ConfigError (one line; exit 2); a stop signal exits 128 + its number after writing what was
    measured (:func:`run_advise`)."""
    started = time.perf_counter()  # the budget covers composing the config and the imports
    from mptrain.cli.preflight import subcommand_job
    from mptrain.commands.advise.trials import Budget
    from mptrain.output.joblog import job_console
    from mptrain.rundir.lock import RunDirLock, check_output_dir

    cfg, output_dir = subcommand_job(overrides, "advise")
    check_output_dir(output_dir)
    # A second advise command into this directory is refused, naming the first.
    with RunDirLock(output_dir, kind="advise"):
        budget = Budget(cfg.advise.budget_s, started)
        run_advise(cfg, overrides, output_dir, job_console(), budget)
