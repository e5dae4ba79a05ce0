"""Is a precision's final loss the same as FP32's, beyond seed noise? The equivalence verdict of
``advise.seeds``, as pure functions on per-seed final losses.

Two one-sided tests (TOST) of the mean per-seed difference of final losses against the margin
±``advise.tolerance`` × FP32's mean (a relative loss difference, the same tolerance the single run
is held to). The test is paired (:func:`paired_tost`): seed ``k`` gives every precision the same
initial weights and batches, so the seed's own noise, large on short runs (docs/advise.md),
cancels in the differences:

- **equivalent**: both one-sided tests reject at ``advise.alpha`` (p, the larger of their two
  p-values, < alpha); the same as the (1 − 2·alpha) confidence interval of the difference lying
  inside the margin;
- **not equivalent**: that interval lies wholly outside the margin (or the precision's loss was not
  finite in a seed: it diverged);
- **undecided**: neither — fewer than :data:`MIN_SEEDS` seeds of either (too few to test), or the
  interval crosses the margin (too much spread for this many seeds: the verdict says about how many
  would decide it, if the means and spreads held).

Welch's unpaired form (:func:`welch_tost`: unequal variances, Welch–Satterthwaite degrees of
freedom), which ignores the pairing and so sees the seeds' spread, is recorded beside it and decides
nothing. The Student-t distribution comes from ``scipy.stats`` (imported when a test runs).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

EQUIVALENT, NOT_EQUIVALENT, UNDECIDED = "equivalent", "not equivalent", "undecided"
# Per precision: two leave one degree of freedom per variance, no test worth a verdict.
MIN_SEEDS = 3
MAX_SEEDS_TO_DECIDE = 1000  # beyond it "seeds to decide" is not worth a number


@dataclass(frozen=True)
class Tost:
    """A TOST of a difference of mean losses against ±``delta`` (absolute loss units)."""

    difference: float
    se: float  # standard error of the difference
    df: float  # degrees of freedom (inf when there is no spread at all)
    p_lower: float  # H0: difference <= −delta
    p_upper: float  # H0: difference >= +delta
    ci: tuple[float, float]  # the (1 − 2·alpha) confidence interval of the difference

    @property
    def p_value(self) -> float:
        return max(self.p_lower, self.p_upper)


def _tost(d: float, se: float, df: float, delta: float, alpha: float) -> Tost:
    """The two one-sided t-tests of ``d`` (standard error ``se``, ``df`` degrees of freedom)
    against ±``delta``. With no spread (``se`` 0: every seed the same loss) the difference is
    exact: p is 0 inside the margin and 1 outside it."""
    from scipy import stats  # the t distribution's CDF and quantiles, exactly

    if se == 0:
        p = 0.0 if abs(d) < delta else 1.0
        return Tost(d, 0.0, math.inf, p, p, (d, d))
    half = float(stats.t.ppf(1 - alpha, df)) * se
    return Tost(
        difference=d,
        se=se,
        df=df,
        p_lower=float(stats.t.sf((d + delta) / se, df)),
        p_upper=float(stats.t.cdf((d - delta) / se, df)),
        ci=(d - half, d + half),
    )


def _welch_se_df(var_a: float, n_a: int, var_b: float, n_b: int) -> tuple[float, float]:
    """Welch's standard error of a difference of means and its Welch–Satterthwaite df."""
    va, vb = var_a / n_a, var_b / n_b
    if va + vb == 0:
        return 0.0, math.inf
    return math.sqrt(va + vb), (va + vb) ** 2 / (va**2 / (n_a - 1) + vb**2 / (n_b - 1))


def welch_tost(a: Sequence[float], b: Sequence[float], delta: float, alpha: float) -> Tost:
    """TOST of ``mean(a) − mean(b)`` within ±``delta`` at level ``alpha``, in Welch's form
    (unpaired, unequal variances). ``a`` and ``b`` hold at least 2 finite values each."""
    se, df = _welch_se_df(statistics.variance(a), len(a), statistics.variance(b), len(b))
    return _tost(statistics.fmean(a) - statistics.fmean(b), se, df, delta, alpha)


def paired_tost(a: Sequence[float], b: Sequence[float], delta: float, alpha: float) -> Tost:
    """The same TOST on the per-seed differences ``a[i] − b[i]`` (``a[i]`` and ``b[i]`` ran
    with the same seed: the same initial weights and batches), a one-sample t-test each."""
    if len(a) != len(b):
        raise ValueError(f"paired_tost: {len(a)} and {len(b)} values; one pair per seed")
    diffs = [x - y for x, y in zip(a, b, strict=True)]
    se = statistics.stdev(diffs) / math.sqrt(len(diffs))
    return _tost(statistics.fmean(diffs), se, len(diffs) - 1, delta, alpha)


def seeds_to_decide(
    a: Sequence[float], b: Sequence[float], delta: float, alpha: float, paired: bool = False
) -> int | None:
    """The fewest seeds per precision (more than now) at which the interval would leave the
    margin's edge — inside it or outside — if the means and spreads stayed as measured; None
    when not within :data:`MAX_SEEDS_TO_DECIDE` (a difference on the margin's edge never does)."""
    from scipy import stats

    d = abs(statistics.fmean(a) - statistics.fmean(b))
    sd = statistics.stdev([x - y for x, y in zip(a, b, strict=True)]) if paired else 0.0
    var_a, var_b = statistics.variance(a), statistics.variance(b)
    for n in range(max(len(a), len(b)) + 1, MAX_SEEDS_TO_DECIDE + 1):
        se, df = (sd / math.sqrt(n), n - 1) if paired else _welch_se_df(var_a, n, var_b, n)
        half = float(stats.t.ppf(1 - alpha, df)) * se
        if d + half < delta or d - half > delta:
            return n
    return None


@dataclass(frozen=True)
class Verdict:
    """The equivalence verdict of one precision's final losses against FP32's (figures relative
    to FP32's mean final loss); advise.json keeps it whole."""

    verdict: str  # EQUIVALENT | NOT_EQUIVALENT | UNDECIDED
    why: str  # in words, for people
    seeds: int  # final losses of the precision
    reference_seeds: int  # of FP32
    margin: float  # advise.tolerance: ± this relative difference counts as the same loss
    alpha: float
    p_value: float | None = None  # TOST's; None: not tested (too few seeds, not finite)
    difference: float | None = None  # mean final loss / FP32's − 1
    ci: tuple[float, float] | None = None  # its (1 − 2·alpha) confidence interval
    df: float | None = None
    seeds_to_decide: int | None = None  # undecided by spread: about this many would decide it

    @property
    def confidence_level(self) -> float:
        return 1 - 2 * self.alpha


def final_loss(losses: Sequence[float]) -> float:
    """A run's final loss: the mean of its last tenth of steps (at least one; the same windows
    as the single-run comparison), non-finite if any of them is."""
    window = losses[-max(1, len(losses) // 10) :]
    return statistics.fmean(window) if all(math.isfinite(x) for x in window) else math.inf


def verdict(
    values: Sequence[float],
    reference: Sequence[float],
    margin: float,
    alpha: float,
    few: str | None = None,
    paired: bool = False,
) -> Verdict:
    """The verdict of the module doc for a precision's per-seed final losses ``values`` against
    FP32's ``reference``; ``few`` says why fewer than MIN_SEEDS ran (``only 2 seeds fit the
    budget``), when that is known. ``paired``: ``values[i]`` and ``reference[i]`` ran with the
    same seed, and the test is on their differences (:func:`paired_tost`), not Welch's."""
    counts = {"seeds": len(values), "reference_seeds": len(reference), "margin": margin}
    base = {**counts, "alpha": alpha}
    if not all(math.isfinite(x) for x in values):
        lost = sum(not math.isfinite(x) for x in values)
        why = f"its loss was not finite in {lost} of {len(values)} seeds (diverged)"
        return Verdict(NOT_EQUIVALENT, why, **base)
    if not all(math.isfinite(x) for x in reference):
        return Verdict(UNDECIDED, "FP32's own loss was not finite in a seed", **base)
    n = min(len(values), len(reference))
    if n < MIN_SEEDS:
        why = few or f"only {n} seed{'s' if n != 1 else ''}"
        return Verdict(UNDECIDED, f"{why}; at least {MIN_SEEDS} are needed to test", **base)
    scale = abs(statistics.fmean(reference)) or 1e-12
    w = (paired_tost if paired else welch_tost)(values, reference, margin * scale, alpha)
    figures = {
        "p_value": w.p_value,
        "difference": w.difference / scale,
        "ci": (w.ci[0] / scale, w.ci[1] / scale),
        "df": w.df,
    }
    if w.p_value < alpha:
        return Verdict(EQUIVALENT, "the interval lies inside the margin", **base, **figures)
    if w.ci[0] > margin * scale or w.ci[1] < -margin * scale:
        return Verdict(NOT_EQUIVALENT, "the interval lies outside the margin", **base, **figures)
    more = seeds_to_decide(values, reference, margin * scale, alpha, paired)
    why = f"too much spread for {n} seeds: the interval crosses the margin" + (
        f"; about {more} seeds each would decide it at this spread" if more else ""
    )
    return Verdict(UNDECIDED, why, **base, **figures, seeds_to_decide=more)


def _pct(x: float) -> str:
    return f"{x:+.2%}".replace("-", "−")


def verdict_words(name: str, v: Verdict) -> str:
    """``bf16 vs FP32: equivalent (TOST p = 0.003 < α 0.05): final loss +0.40% (90% CI
    −0.80%…+1.60%, margin ±5%), 5 seeds each``."""
    seeds = (
        f"{v.seeds} seeds each"
        if v.seeds == v.reference_seeds
        else f"{v.seeds} seeds, FP32 {v.reference_seeds}"
    )
    if v.p_value is None:
        return f"{name} vs FP32: {v.verdict}: {v.why} ({seeds})"
    low, high = v.ci
    figures = (
        f"final loss {_pct(v.difference)} ({v.confidence_level:.0%} CI "
        f"{_pct(low)}…{_pct(high)}, margin ±{v.margin:.0%}), {seeds}"
    )
    sign = "<" if v.p_value < v.alpha else "≥"
    test = f"TOST p = {v.p_value:.3g} {sign} α {v.alpha:g}"
    if v.verdict == UNDECIDED:
        return f"{name} vs FP32: undecided ({test}): {v.why}; {figures}"
    return f"{name} vs FP32: {v.verdict} ({test}): {figures}"


# ------------------------------------------------------------------------------ in the report
def _from_record(record: dict[str, Any]) -> Verdict:
    ci = record.get("ci")
    return Verdict(**{**record, "ci": tuple(ci) if ci is not None else None})


def lead_lines(conf: dict[str, Any] | None, interrupted: dict[str, Any] | None) -> list[str]:
    """advise.md's first words after the headline: each finalist's verdict and p-value
    (advise.json's ``confidence``), or why none was tested."""
    if conf is None:
        return []
    verdicts = conf.get("verdicts") or {}
    if verdicts:
        return [f"Confidence: {verdict_words(n, _from_record(v))}." for n, v in verdicts.items()]
    why = conf.get("not_run") or (
        f"interrupted by {interrupted['signal']} before the seeds" if interrupted else "not reached"
    )
    return [f"Confidence: not tested ({why})."]


def method_line(conf: dict[str, Any] | None) -> str | None:
    """How the verdicts were reached and what Welch's unpaired test says, for the evidence's notes;
    None when none was tested."""
    if not conf or not conf.get("verdicts"):
        return None
    seeds = sorted({e["seed"] for entries in conf["finalists"].values() for e in entries})
    which = f"seed {seeds[0]}" if len(seeds) == 1 else f"seeds {seeds[0]}–{seeds[-1]}"
    level = 1 - 2 * conf["alpha"]
    welch = [
        f"{name} {v['verdict']}"
        + (f" (p = {v['p_value']:.3g})" if v["p_value"] is not None else "")
        for name, v in conf.get("welch", {}).items()
    ]
    return (
        f"Confidence: each finalist's fidelity run over {which} "
        f"(advise.seeds={conf['requested']}); final loss: the mean of its last tenth of steps; "
        "two one-sided t-tests of the mean per-seed difference of final losses (each seed's runs "
        f"share initial weights and batches) against ±{conf['margin']:.0%} of FP32's "
        f"(α {conf['alpha']:g}; {level:.0%} confidence intervals). Welch's unpaired form of the "
        f"same test, which decides nothing: {', '.join(welch)}. Every seed's figures are in "
        "advise.json."
    )


def skipped_lines(conf: dict[str, Any] | None) -> list[str]:
    """The seeds that did not fit, for "Not measured"."""
    if not conf:
        return []
    lines = [f"- {name} seeds: {why}" for name, why in conf.get("skipped", {}).items()]
    if conf.get("stopped"):
        lines.append(f"- seeds: {conf['stopped']}")
    return lines
