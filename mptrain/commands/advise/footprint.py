"""advise's memory part: one step's accounted bytes per precision, optimizer-state choice and
activation-checkpointing mode, measured here, then what fits ``advise.target``'s GPU
(:mod:`.fits` decides, pure).

:func:`run_footprint` accounts each candidate precision that built (its pilot ran) at the two
micro-batches of :data:`.fits.PROBE_BATCHES`, without checkpointing first, then the optimizer's
state once per state choice (on FP32's run), then the checkpointing modes where the model has
blocks; each accounting waits on the budget's deadline and what does not fit is listed.
:func:`assemble` turns what was found into advise.json's ``memory`` (pure, also after an
interrupt).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mptrain.commands.advise import choices, fits, predict
from mptrain.commands.advise import decide as advice
from mptrain.commands.advise.trials import Cost, cost_of, timed_part
from mptrain.config.base import ConfigError
from mptrain.config.optim import AdamBase, AdamWConfig, LowBitAdamWConfig
from mptrain.platform.distributed import unwrap
from mptrain.train.build import prepare_run
from mptrain.train.memory import account_step, fresh_state_bytes
from mptrain.train.optim import build_optimizer

if TYPE_CHECKING:
    import torch

    from mptrain.commands.advise.measure import Candidate
    from mptrain.commands.advise.trials import Budget
    from mptrain.config.run import RunConfig

# An accounted step (deep copies of the model and optimizer, the saved-tensor hooks) costs about
# this many training steps of as many samples.
ACCOUNT_COST = 3.0


def new_footprint() -> dict[str, Any]:
    """What :func:`run_footprint` fills, part by part: ``{precision: {mode: {batch: bytes}}}``,
    the state choices' bytes, and why anything was not accounted."""
    return {"steps": {}, "states": {}, "skipped": {}, "cost": None, "measured": None}


def _with_batch(cfg: RunConfig, batch: int, mode: str) -> RunConfig:
    memory = dataclasses.replace(cfg.memory, activation_checkpointing=mode, account=True)
    return dataclasses.replace(
        cfg, batch_size=batch, grad_accum_steps=1, memory=memory, probe_every=None
    )


def with_state(cfg: RunConfig, state: fits.StateChoice) -> RunConfig:
    """``cfg`` whose AdamW-family optimizer stores its moments as ``state`` says."""
    base = {f.name: getattr(cfg.optimizer, f.name) for f in dataclasses.fields(AdamBase)}
    base.pop("name")
    if state.optimizer == "adamw":
        return dataclasses.replace(
            cfg, optimizer=AdamWConfig(**base, state_dtype=state.state_dtype or "fp32")
        )
    return dataclasses.replace(cfg, optimizer=LowBitAdamWConfig(**base, name=state.optimizer))


def state_choices(cfg: RunConfig) -> list[fits.StateChoice]:
    """The state choices this run's optimizer has: AdamW's family only (SGD keeps its own),
    torchao's where torchao is installed."""
    if not isinstance(cfg.optimizer, AdamBase):
        return []
    have_torchao = importlib.util.find_spec("torchao") is not None
    return [s for s in fits.STATE_CHOICES if s.optimizer == "adamw" or have_torchao]


def _fits_budget(budget: Budget, need: float, what: str, out: dict[str, Any]) -> bool:
    if time.perf_counter() + need <= budget.deadline():
        return True
    out["skipped"][what] = (
        f"estimated {need:.1f} s; {max(budget.left_s(), 0):.0f} s of advise.budget_s left"
    )
    return False


def run_footprint(
    cfg: RunConfig,
    cands: list[Candidate],
    budget: Budget,
    timings: dict[str, Any],
    out: dict[str, Any],
) -> None:
    """Fill ``out`` (:func:`new_footprint`): see the module doc."""
    out["ran"] = True  # what an interrupt later must not call unreached
    accountable = _accountable(cands)
    if not accountable:
        out["skipped"]["all"] = "FP32's pilot did not run"
        return
    out["skipped"].update(_not_accountable(cands, accountable))
    with timed_part(timings, "memory"):
        fp32_run = None
        for name, item in accountable.items():
            run = _account_lines(name, item, "none", budget, out)
            fp32_run = run if name == "fp32" else fp32_run
        if fp32_run is not None:
            _account_states(cfg, fp32_run, accountable["fp32"], budget, out)
        del fp32_run
        for mode in fits.CHECKPOINTING[1:]:
            for name, item in accountable.items():
                _account_lines(name, item, mode, budget, out)
                refused = out["skipped"].get(f"{name}, checkpointing {mode}", "")
                if NO_BLOCKS in refused:  # the model's, whatever the precision
                    recomputing = (", checkpointing selective", ", checkpointing full")
                    out["skipped"] = {
                        k: v for k, v in out["skipped"].items() if not k.endswith(recomputing)
                    }
                    out["skipped"]["checkpointing"] = refused
                    return


NO_BLOCKS = "no transformer or residual blocks"  # mptrain.train.recompute's refusal


UNTIMED_SLOWDOWN = 4.0  # a precision without a pilot (emulated here) is costed at FP32's × this


@dataclass(frozen=True)
class Accountable:
    """A precision to account: its config, and what its pilot cost (a build and a step at the
    configured micro-batch)."""

    cfg: RunConfig
    cost: Cost

    def step_need_s(self, samples: int) -> float:
        """Seconds to account one step of ``samples`` on a built run."""
        return ACCOUNT_COST * self.cost.step_s * min(samples / self.cfg.batch_size, 1.0)

    def need_s(self) -> float:
        """Seconds to build it at the larger probe batch and account both probe batches."""
        return self.cost.overhead_s + sum(map(self.step_need_s, fits.PROBE_BATCHES))


def _accountable(cands: list[Candidate]) -> dict[str, Accountable]:
    """The precisions to account, FP32 first: those that built (their pilot ran), and the base
    precisions this device only skipped for speed (BF16 without native BF16: its bytes on a GPU
    are what it would hold there), costed at FP32's pilot × :data:`UNTIMED_SLOWDOWN`."""
    fp32 = next((c for c in cands if c.name == "fp32" and c.pilot is not None), None)
    if fp32 is None:
        return {}
    fp32_cost = cost_of(fp32.pilot)
    slow = Cost(fp32_cost.overhead_s, UNTIMED_SLOWDOWN * fp32_cost.step_s)
    out = {}
    for c in cands:
        if c.pilot is not None:
            out[c.name] = Accountable(c.cfg, cost_of(c.pilot))
        elif c.choice in choices.BASE and c.skipped.get("all") and not c.timed:
            out[c.name] = Accountable(choices.apply(c.cfg, c.choice), slow)
    return out


def _not_accountable(cands: list[Candidate], accountable: dict[str, Any]) -> dict[str, str]:
    """The base precisions left out, with why their pilot did not run (a low-precision choice
    the model cannot take is listed under Not measured already)."""
    return {
        c.name: c.skipped["all"]
        for c in cands
        if c.choice in choices.BASE and c.name not in accountable and c.skipped.get("all")
    }


def _account_lines(
    name: str, item: Accountable, mode: str, budget: Budget, out: dict[str, Any]
) -> Any:
    """:func:`account_line` of ``item`` under checkpointing ``mode`` into ``out["steps"][name]``;
    the run, or None when the budget or the config refused (why: ``out["skipped"]``)."""
    what = f"{name}, checkpointing {mode}"
    if not _fits_budget(budget, item.need_s(), what, out):
        return None
    try:
        points, run = account_line(item.cfg, mode)
    except (ConfigError, RuntimeError) as exc:  # refused, or out of memory on a GPU
        out["skipped"][what] = f"{type(exc).__name__}: {exc}".removeprefix("ConfigError: ")
        return None
    out["steps"].setdefault(name, {})[mode] = points
    return run


def account_line(cfg: RunConfig, mode: str) -> tuple[dict[str, int], Any]:
    """``cfg`` built once at the larger probe batch under checkpointing ``mode`` and one step
    accounted at each probe batch (its micro-batch cut): (``{batch: bytes}``, the run).
    ConfigError when the config refuses (a model without blocks to recompute)."""
    run = prepare_run(_with_batch(cfg, max(fits.PROBE_BATCHES), mode))
    return {str(b): account_step(run, samples=b)["total_bytes"] for b in fits.PROBE_BATCHES}, run


def state_bytes(cfg: RunConfig, run: Any, state: fits.StateChoice) -> int:
    """The optimizer-state bytes of ``state`` for ``run``'s model (a fresh optimizer of that
    choice): AdamW's from an accounted step at the smaller probe batch, torchao's made as its
    step makes them (its compiled step is not run: :func:`mptrain.train.memory.fresh_state_bytes`)."""
    optimizer = build_optimizer(with_state(cfg, state).optimizer, unwrap(run.model))
    fresh = fresh_state_bytes(optimizer)
    if fresh is not None:
        return sum(fresh.values())
    counted = account_step(dataclasses.replace(run, optimizer=optimizer), fits.PROBE_BATCHES[0])
    return counted["total"]["optimizer_states"]


def _account_states(
    cfg: RunConfig, run: Any, item: Accountable, budget: Budget, out: dict[str, Any]
) -> None:
    """The optimizer-state bytes of each state choice (:func:`state_bytes`) on FP32's built
    ``run``, each waiting on the budget; the user's own state choice and checkpointing mode."""
    users = fits.user_state(cfg.optimizer.name, getattr(cfg.optimizer, "state_dtype", None))
    out["user_state"] = users
    out["user_checkpointing"] = cfg.memory.activation_checkpointing
    samples = fits.PROBE_BATCHES[0]
    offered = state_choices(cfg)
    if not any(s.name == users for s in offered):  # SGD, or a choice not listed: its own only
        out["states"][users] = account_step(run, samples)["total"]["optimizer_states"]
        return
    for state in offered:
        if not _fits_budget(budget, item.step_need_s(samples), state.label, out):
            continue
        try:
            out["states"][state.name] = state_bytes(cfg, run, state)
        except RuntimeError as exc:  # out of memory on a GPU: said, the others still counted
            out["skipped"][state.label] = f"{type(exc).__name__}: {exc}"


# ------------------------------------------------------------------------------ the decision
def lines_of(found: dict[str, Any]) -> dict[str, dict[str, fits.Line]]:
    """The accounted steps as lines, ``{precision: {mode: Line}}``."""
    return {
        precision: {
            mode: fits.line_through({int(b): n for b, n in points.items()})
            for mode, points in by_mode.items()
        }
        for precision, by_mode in found["steps"].items()
    }


def step_times(
    cands: list[Candidate], prediction: dict[str, Any] | None
) -> tuple[dict[str, float], str]:
    """Each precision's step time to rank by (any unit), and where it comes from: predicted on
    the target GPU where there is a prediction (a precision it has no kernel for gets none: it
    would be emulated there), else measured here relative to FP32."""
    rows = (prediction or {}).get("rows") or {}
    if rows:
        times = {n: r["step_time_s"] for n, r in rows.items() if "step_time_s" in r}
        return times, "predicted step time on the target"
    times = {"fp32": 1.0}
    for c in cands:
        if c.speed is not None and c.speed.get("vs_fp32"):
            times[c.name] = 1.0 / c.speed["vs_fp32"]
    return times, "step time measured here relative to fp32"


def faithful(inputs: list[advice.Measured], ctx: advice.Context) -> dict[str, str | None]:
    """Each precision's numerics verdict: None where the fidelity run (and the seeds) accepted
    it (FP32 always, the reference), else why not (:func:`.decide.unfaithful`)."""
    verdicts = {m.precision: advice.unfaithful(m, ctx) for m in inputs}
    return {**verdicts, advice.REFERENCE: None}


def assemble(
    cfg: RunConfig,
    found: dict[str, Any],
    prediction: dict[str, Any] | None,
    verdicts: dict[str, str | None],
    device: torch.device,
) -> dict[str, Any]:
    """advise.json's ``memory`` from what was found (its ``footprint`` and ``candidates``): per
    precision and mode the line and its bytes at the configured micro-batch; the state choices'
    bytes; on the GPU ``advise.target`` names (:func:`.predict.target_gpu`) the largest
    micro-batch of every combination and, for ``advise.batch_size``, the recommended combination
    (or why none) among the precisions whose ``verdicts`` are None, ranked by ``prediction``'s
    step times where it has them, else by the speed measured here (:func:`step_times`). Pure:
    the fit :mod:`.fit_measure` measures while advise runs and the one advise.json reports come
    from here alike, each from what was found by then."""
    gpu, _ = predict.target_gpu(cfg, device)
    footprint = found["footprint"]
    lines = lines_of(footprint)
    out: dict[str, Any] = {
        "basis": fits.basis(device.type),
        "batch_size": cfg.batch_size,
        "rows": _rows(lines, cfg.batch_size),
        "states": dict(footprint["states"]),
        "user_state": footprint.get("user_state"),
        "skipped": dict(footprint["skipped"]),
        "target": None,
    }
    users = footprint.get("user_state")
    if not lines or users not in footprint["states"] or gpu is None:
        if gpu is None:
            out["skipped"].setdefault("fit", "no target GPU: name one with advise.target")
        return out
    usable = fits.usable_bytes(gpu.memory_gb)
    combos = fits.combinations(lines, footprint["states"], users)
    out["target"] = _target(gpu, usable, combos)
    wanted = cfg.advise.batch_size
    if wanted is not None:
        times, time_basis = step_times(found["candidates"], prediction)
        own = (users, footprint.get("user_checkpointing", "none"))
        fit = out["target"]["fit"] = _fit(combos, wanted, usable, times, time_basis, verdicts, own)
        for key, found_key in (("speed_cost", "cost"), ("measured", "measured")):
            measured = footprint.get(found_key)  # of the combination recommended then
            if measured and fit.get("combination") == measured.get("combination"):
                fit[key] = measured
    return out


def _rows(lines: dict[str, dict[str, fits.Line]], batch: int) -> dict[str, Any]:
    """Per precision and mode: the line's fixed bytes, bytes per sample, and bytes at ``batch``."""
    return {
        p: {
            mode: {
                "fixed_bytes": round(line.fixed),
                "per_sample_bytes": round(line.per_sample),
                "at_batch_size_bytes": line.at(batch),
            }
            for mode, line in by_mode.items()
        }
        for p, by_mode in lines.items()
    }


def _target(gpu: Any, usable: float, combos: list[fits.Combination]) -> dict[str, Any]:
    """The target GPU's memory and the largest micro-batch of every combination on it."""
    return {
        "gpu": gpu.key,
        "memory_bytes": round(gpu.memory_gb * 1e9),
        "usable_bytes": round(usable),
        "largest_batch": [
            {
                "precision": c.precision,
                "state": c.state,
                "checkpointing": c.checkpointing,
                "largest_batch": c.line.largest_batch(usable),
            }
            for c in combos
        ],
    }


def _fit(
    combos: list[fits.Combination],
    wanted: int,
    usable: float,
    times: dict[str, float],
    time_basis: str,
    verdicts: dict[str, str | None],
    own: tuple[str, str],
) -> dict[str, Any]:
    considered = [p for p, why in verdicts.items() if why is None]
    not_considered = {
        p: verdicts.get(p) or "no fidelity run"
        for p in dict.fromkeys(c.precision for c in combos)
        if p not in considered
    }
    chosen = fits.choose(combos, wanted, usable, times, considered)
    if chosen is None:
        return {
            "batch_size": wanted,
            "none": _none_fits(combos, wanted, usable, considered),
            "not_considered": not_considered,
        }
    return {
        "batch_size": wanted,
        "combination": [chosen.precision, chosen.state, chosen.checkpointing],
        "bytes": chosen.line.at(wanted),
        "largest_batch": chosen.line.largest_batch(usable),
        "overrides": fits.combination_overrides(chosen, *own),
        "ranked_by": f"checkpointing, then {time_basis}, then the state's precision",
        "considered": [p for p in considered if any(c.precision == p for c in combos)],
        "not_considered": not_considered,
    }


def _none_fits(
    combos: list[fits.Combination], wanted: int, usable: float, considered: list[str]
) -> str:
    """Why nothing is recommended for micro-batch ``wanted``: the largest micro-batch the
    considered precisions fit, or that a precision not vouched for would fit it."""
    largest = max(
        (c.line.largest_batch(usable) for c in combos if c.precision in considered), default=0
    )
    unvouched = [c for c in combos if c.precision not in considered and c.line.at(wanted) <= usable]
    said = f"no combination fits micro-batch {wanted:,}"
    if unvouched:
        return (
            f"{said} among the precisions whose numerics were vouched for ({unvouched[0].precision}"
            " would: measure its fidelity with a larger advise.budget_s)"
        )
    return (
        f"{said}: the largest that fits is {largest:,}; lower batch_size and raise grad_accum_steps"
    )
