"""Speed figures from repeated measurements: the median, the spread that says how far to trust it,
and the reason a figure is *noisy* (docs/sweeps.md, "Speed ratios"; docs/advise.md for bench).

One measurement of a speed ratio is not a fact on a shared machine (the same comparison has read
4.85× and 0.08×), so every ratio mptrain prints comes with a spread, and is marked noisy (with the
reason) when that spread is wide or cannot be judged: ``mptrain bench`` pairs each repetition
with the FP32 measurement of the same repetition (:func:`repetition_spread`: median and min–max),
a sweep each measured ``log_every`` window of a run with every window of its FP32 twin
(:func:`window_ratio_spread`: median over median, and the quartiles).

Both ranges cover about the middle half of what was measured (the min–max of 3 repetitions covers
(3-1)/(3+1) = 50 % of the distribution on average, like the interquartile range), so one limit,
:data:`NOISY_SPREAD`, judges both.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from mptrain.report.rows import plural

# A range wider than 10 % of the median cannot tell a 10 % gain from none: smaller differences
# than that are not what anyone picks a precision by, larger ones must be told reliably.
NOISY_SPREAD = 0.10
# Fewer than 3 values have no middle to speak of: their range says nothing about the spread.
MIN_SAMPLES = 3


@dataclass(frozen=True)
class Spread:
    """A figure measured more than once: ``median`` within ``low``–``high`` (see module doc), from
    ``samples`` values; ``noisy`` is the reason not to take the median as fact, None when the
    spread is tight."""

    median: float
    low: float
    high: float
    samples: int
    noisy: str | None = None

    @property
    def relative(self) -> float:
        """The range as a share of the median."""
        return (self.high - self.low) / self.median if self.median else float("inf")

    def marked(self, reason: str | None) -> Spread:
        """This spread, also noisy for ``reason`` (None: unchanged)."""
        if reason is None:
            return self
        noisy = reason if self.noisy is None else f"{self.noisy}; {reason}"
        return dataclasses.replace(self, noisy=noisy)


def _judged(median: float, low: float, high: float, samples: int, what: str) -> Spread:
    """The spread with its verdict: too few ``what`` to judge, or wider than NOISY_SPREAD."""
    spread = Spread(median, low, high, samples)
    counted = plural(samples, what.removesuffix("s"))  # "1 window", not "1 windows"
    if samples < MIN_SAMPLES:
        return spread.marked(f"{counted}: too few to judge the spread (at least {MIN_SAMPLES})")
    if spread.relative > NOISY_SPREAD:
        return spread.marked(
            f"spread {spread.relative:.0%} of the median over {counted} "
            f"(noisy above {NOISY_SPREAD:.0%})"
        )
    return spread


def repetition_spread(values: Sequence[float]) -> Spread:
    """Median and min–max of per-repetition values (at least one), judged for noise."""
    if not values:
        raise ValueError("repetition_spread: no values")
    return _judged(statistics.median(values), min(values), max(values), len(values), "repetitions")


def window_ratio_spread(windows: Sequence[float], base: Sequence[float]) -> Spread:
    """``windows`` (samples/s per measured window of a run) against ``base`` (those of its FP32
    twin): median over median, within the quartiles of every window of the run divided by every
    window of the base. Too few windows on either side (fewer than MIN_SAMPLES) is noisy."""
    if not windows or not base:
        raise ValueError("window_ratio_spread: a run without measured windows")
    ratios = [w / b for w in windows for b in base]
    if len(ratios) > 1:
        low, _, high = statistics.quantiles(ratios, n=4, method="inclusive")
    else:
        low = high = ratios[0]
    median = statistics.median(windows) / statistics.median(base)
    return _judged(median, low, high, min(len(windows), len(base)), "windows")


def format_ratio(spread: Spread) -> str:
    """``4.85× (4.60–5.00)``, with `` noisy`` appended when it is."""
    text = f"{spread.median:.2f}× ({spread.low:.2f}–{spread.high:.2f})"
    return f"{text} noisy" if spread.noisy else text
