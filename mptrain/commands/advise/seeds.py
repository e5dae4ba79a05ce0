"""``advise.seeds``: the finalists' fidelity runs again over more seeds, within the budget, and
their equivalence verdicts (:mod:`.confidence`).

The finalists are the recommended precision and FP32 (when FP32 is recommended, the first
runner-up that ran its fidelity run takes the other place), and the first such runner-up besides
when its seeds are affordable. Seed ``k`` is the fidelity run with ``seed`` raised by ``k`` (new
initial weights and batch order, the same for every finalist); each finalist's fidelity run is its
first seed. Rounds of one seed per finalist run while a round fits what is left of
``advise.budget_s`` (with the speed part's margin) and fewer than ``advise.seeds`` ran (``auto``:
up to :data:`AUTO_MAX_SEEDS`). Before the speed part, the time of the seeds a test needs
(:func:`reserve_s`) is set aside, at most half of what is left.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from mptrain.commands.advise import confidence
from mptrain.commands.advise import decide as advice
from mptrain.commands.advise.measure import Candidate, latest_cost
from mptrain.commands.advise.trials import (
    PILOT_WARMUP,
    REP_MARGIN,
    Budget,
    Trial,
    short_run,
    timed_part,
)
from mptrain.config.commands import seed_count

if TYPE_CHECKING:
    from mptrain.config.commands import AdviseConfig
    from mptrain.config.run import RunConfig

AUTO_MAX_SEEDS = 10  # advise.seeds=auto: no more than this many, however much time is left
RESERVE_SHARE = 0.5  # of what the fidelity runs left: the most the seeds may keep from speed
AUTO_SHARE = 0.5  # of what is left when the seeds begin: the most auto's seeds past 3 may take


def new_confidence(settings: AdviseConfig) -> dict[str, Any]:
    """advise.json's ``confidence``, filled as the seeds run (an interrupt keeps what ran)."""
    return {
        "requested": settings.seeds,
        "alpha": settings.alpha,
        "margin": settings.tolerance,
        "finalists": {},  # name -> one entry per seed (seed_entry)
        "not_run": None,  # why no seed beyond the fidelity runs ran at all
        "stopped": None,  # why fewer seeds ran than wanted
        "skipped": {},  # finalist -> why its seeds were not run (the runner-up's cost)
        "verdicts": {},  # name -> confidence.Verdict's fields, from the figures (with_verdicts)
        "welch": {},  # name -> Welch's unpaired test of the same finals (recorded, not deciding)
    }


def seed_entry(trial: Trial, seed: int) -> dict[str, Any]:
    """One seed's figures: its final loss (inf when it diverged) and every step's loss."""
    final = confidence.final_loss(trial.losses) if not trial.diverged else float("inf")
    return {
        "seed": seed,
        "final_loss": final,
        "steps": trial.steps,
        "skipped_steps": trial.skipped_steps,
        "diverged": trial.diverged,
        "wall_s": trial.wall_s,
        "losses": trial.losses,
    }


def _comparable(c: Candidate) -> bool:
    return c.fidelity is not None and not c.fidelity.diverged


def reserve_s(cands: list[Candidate], settings: AdviseConfig, left_s: float) -> float:
    """Seconds to keep from the speed part for the seeds a test needs (MIN_SEEDS for ``auto``,
    else ``advise.seeds``): FP32's and the costliest other comparable precision's extra runs, at
    most RESERVE_SHARE of ``left_s``; 0 when there is nothing to test."""
    wanted = seed_count(settings.seeds) or confidence.MIN_SEEDS
    fp32 = next((c for c in cands if c.name == advice.REFERENCE), None)
    others = [c for c in cands if c is not fp32 and _comparable(c)]
    if wanted <= 1 or fp32 is None or not _comparable(fp32) or not others:
        return 0.0
    steps = settings.fidelity_steps
    per_round = latest_cost(fp32).of(steps) + max(latest_cost(c).of(steps) for c in others)
    return min((wanted - 1) * REP_MARGIN * per_round, RESERVE_SHARE * max(left_s, 0.0))


def speed_budget(cands: list[Candidate], settings: AdviseConfig, budget: Budget) -> Budget:
    """``budget`` less :func:`reserve_s`: what the speed part may plan with."""
    kept = reserve_s(cands, settings, budget.left_s())
    return dataclasses.replace(budget, total_s=budget.total_s - kept)


def finalists(
    decision: advice.Advice, cands: list[Candidate]
) -> tuple[list[Candidate], Candidate | None]:
    """(the finalists that must run, the runner-up that may) from the provisional decision."""
    by_name = {c.name: c for c in cands}
    fp32 = by_name.get(advice.REFERENCE)
    ranked = [decision.precision, *(p for p, _ in decision.runners_up)]
    names = [p for p in dict.fromkeys(ranked) if p in by_name and p != advice.REFERENCE]
    others = [by_name[p] for p in names if _comparable(by_name[p])]
    if fp32 is None or not _comparable(fp32) or not others:
        return [], None
    return [others[0], fp32], (others[1] if len(others) > 1 else None)


def run_seeds(
    cfg: RunConfig,
    found: dict[str, Any],
    decision: advice.Advice,
    budget: Budget,
    timings: dict[str, Any],
) -> None:
    """The rounds of the module doc into ``found["confidence"]`` (:func:`new_confidence`)."""
    out, settings = found["confidence"], cfg.advise
    wanted = seed_count(settings.seeds)
    must, optional = finalists(decision, found["candidates"])
    if not must:
        out["not_run"] = "nothing to compare: FP32 and another precision need a fidelity run"
        return
    group = must + ([optional] if optional else [])
    for c in group:
        out["finalists"][c.name] = [seed_entry(c.fidelity, cfg.seed)]
    target = wanted or AUTO_MAX_SEEDS
    if optional is not None:
        planned = min(target, confidence.MIN_SEEDS) if wanted is None else target
        need = _round_s(group, settings) * (planned - 1)
        if need > budget.left_s():
            out["skipped"][optional.name] = _words(f"its {planned} seeds", need, budget)
            del out["finalists"][optional.name]
            group = must
    with timed_part(timings, "seeds"):
        _rounds(cfg, group, target, budget, out)


def _round_s(group: list[Candidate], settings: AdviseConfig) -> float:
    return REP_MARGIN * sum(latest_cost(c).of(settings.fidelity_steps) for c in group)


def _words(what: str, need: float, budget: Budget) -> str:
    return f"{what} (~{need:.0f} s) did not fit the {max(budget.left_s(), 0):.0f} s of advise.budget_s left"


def _rounds(
    cfg: RunConfig, group: list[Candidate], target: int, budget: Budget, out: dict[str, Any]
) -> None:
    """Seeds 2 .. ``target`` of each of ``group``, a round at a time while one fits (with
    ``advise.seeds=auto``, past MIN_SEEDS, within AUTO_SHARE of the time left at the start)."""
    steps, auto = cfg.advise.fidelity_steps, seed_count(cfg.advise.seeds) is None
    start_left_s = budget.left_s()
    for k in range(1, target):
        need = _round_s(group, cfg.advise)
        past_minimum = auto and k >= confidence.MIN_SEEDS
        kept_s = (1 - AUTO_SHARE) * start_left_s if past_minimum else 0.0
        if need > budget.left_s() - kept_s:
            out["stopped"] = (
                f"advise.seeds=auto stopped at {k}: seed {k + 1} of each (~{need:.0f} s) "
                f"would pass {AUTO_SHARE:.0%} of the {start_left_s:.0f} s left when the seeds "
                "began (the rest is the estimates' margin)"
                if past_minimum
                else _words(f"seed {k + 1} of each", need, budget)
            )
            return
        for c in group:
            seeded = dataclasses.replace(c.cfg, seed=cfg.seed + k)
            trial = short_run(seeded, steps, PILOT_WARMUP, budget.deadline())
            if trial.cut_short:
                out["stopped"] = f"the budget ran out during seed {k + 1} of {c.name}"
                return
            out["finalists"][c.name].append(seed_entry(trial, cfg.seed + k))


def few_words(out: dict[str, Any], interrupted_by: str | None) -> str:
    """Why a finalist has fewer than MIN_SEEDS seeds: ``only 2 seeds fit the budget``."""
    n = min((len(entries) for entries in out["finalists"].values()), default=0)
    seeds = f"only {n} seed{'s' if n != 1 else ''}"
    requested = seed_count(out["requested"])
    if requested is not None and requested < confidence.MIN_SEEDS:
        return f"{seeds}: advise.seeds={requested}"
    if interrupted_by:
        return f"{seeds} before {interrupted_by} interrupted advise"
    return f"{seeds} fit the budget"


def with_verdicts(
    measured: list[advice.Measured], out: dict[str, Any] | None, interrupted_by: str | None
) -> list[advice.Measured]:
    """``measured`` with each finalist's verdict against FP32 (kept in ``out["verdicts"]``): the
    TOST on the per-seed differences of the seeds both ran; Welch's unpaired test beside it
    (``out["welch"]``: it decides nothing)."""
    if not out or advice.REFERENCE not in out["finalists"]:
        return measured
    by_seed = {
        name: {e["seed"]: e["final_loss"] for e in entries}
        for name, entries in out["finalists"].items()
    }
    reference = by_seed.pop(advice.REFERENCE)
    few = few_words(out, interrupted_by)
    verdicts, welch = {}, {}
    for name, finals in by_seed.items():
        both = [s for s in finals if s in reference]
        verdicts[name] = confidence.verdict(
            [finals[s] for s in both],
            [reference[s] for s in both],
            out["margin"],
            out["alpha"],
            few,
            paired=True,
        )
        welch[name] = confidence.verdict(
            list(finals.values()), list(reference.values()), out["margin"], out["alpha"], few
        )
    out["verdicts"] = {name: dataclasses.asdict(v) for name, v in verdicts.items()}
    out["welch"] = {name: dataclasses.asdict(v) for name, v in welch.items()}
    return [dataclasses.replace(m, equivalence=verdicts.get(m.precision)) for m in measured]
