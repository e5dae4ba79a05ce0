"""Which precision to train with: the decision, from measurements to a recommendation with reasons.

Pure functions on plain data, no torch: :func:`recommend` takes one :class:`Measured` per precision
(what ``mptrain advise`` found on this machine) and returns an :class:`Advice`; the rules:

1. FP32 is the reference and always a candidate: it wins when nothing else qualifies. When FP32
   itself was not measured (its short run did not fit the budget, or an interrupt came first)
   nothing can be compared: the advice says so (``measured`` false) and recommends nothing.
2. Another precision qualifies only when it was measured; FP16's range probe found no forward
   overflow (loss scaling cannot fix one); it is not emulated (emulation reproduces the numerics,
   never the speed); its short run beside FP32 did not diverge, skipped at most
   ``max_skipped_fraction`` of its optimizer steps (lost updates) and kept its loss within
   :func:`allowed_difference` of FP32's; and it is *measurably* faster: the whole min–max range of
   its speed ratio to FP32 lies above 1 (a range that overlaps 1 is noise, not a speed-up).
3. Among the qualifying, the highest median speed wins; precisions whose ranges overlap the
   fastest one's tie with it, and the tie goes to the simplest choice (:data:`.choices.SIMPLICITY`).
4. With ``advise.seeds``, a finalist's equivalence verdict over seeds (:mod:`.confidence`) decides
   its loss instead of the single run's trajectory: *not equivalent* rules it out, *equivalent*
   lets it pass even where the single run strayed; *undecided* leaves the single run to decide.

The autocast audit's flags (an op that belongs in FP32 but ran in low precision) are not
disqualifying: the fidelity run measures their effect directly. They are stated with the fix.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from mptrain.commands.advise.choices import SIMPLICITY
from mptrain.commands.advise.concise import pct
from mptrain.commands.advise.confidence import EQUIVALENT, NOT_EQUIVALENT, Verdict, verdict_words

# A precision's loss may differ from FP32's by up to this many times the difference a one-ulp nudge
# of FP32's initial weights makes on its own (chaotic training forks whatever the precision).
CHAOS_MARGIN = 2.0
REFERENCE = "fp32"
NOT_MEASURED = "not measured: "  # a runner-up's reason when it did not run (then: why)


@dataclass(frozen=True)
class Fidelity:
    """A short run's loss trajectory against FP32's, from the same weights and batches."""

    steps: int  # optimizer steps compared
    max_rel_diff: float  # largest relative difference of the windowed losses (inf: non-finite)
    final_rel_diff: float  # the last window's
    skipped_steps: int = 0  # optimizer steps the loss scaler skipped
    diverged: str | None = None  # the run stopped: why


@dataclass(frozen=True)
class Speed:
    """Samples/s relative to FP32 in the same repetitions: median and min–max."""

    ratio: float
    low: float
    high: float


@dataclass(frozen=True)
class Measured:
    """What was measured for one precision; ``None`` fields were not measured (``*_note`` says why)."""

    precision: str  # fp32 | tf32 | bf16 | fp16 | fp8 | fp8-rowwise ... (choices.CHOICES)
    not_run: str | None = None  # nothing measured: refused to build, or no budget for its pilot
    speed: Speed | None = None
    speed_note: str | None = None
    fidelity: Fidelity | None = None
    fidelity_note: str | None = None
    emulated: bool = False  # FP8 without FP8 hardware
    fp16_overflow: tuple[str, ...] = ()  # FP16 only: layers whose forward exceeds 65504
    audit_modules: tuple[str, ...] = ()  # modules with an op the autocast audit flagged
    equivalence: Verdict | None = None  # its final loss against FP32's over seeds (advise.seeds)


@dataclass(frozen=True)
class Context:
    """The thresholds and the facts about the machine and model the fixes depend on."""

    tolerance: float = 0.05
    max_skipped_fraction: float = 0.1
    # The largest relative loss difference of FP32 from itself with its initial weights nudged by
    # one ulp (same batches): how much this training forks on its own. None: not measured.
    fp32_spread: float | None = None
    device_type: str = "cpu"
    has_convolutions: bool = False
    channels_last: bool = False
    # Why measuring stopped before the budget's end ("SIGINT"); None: it ran its course.
    interrupted_by: str | None = None
    # Others' work competed for the cores while speed was measured (in words); None: it did
    # not, or could not be told. Then no precision is called faster on those figures.
    busy: str | None = None


@dataclass(frozen=True)
class Advice:
    """The recommended precision, why, the others and why they lost, and fixes worth trying."""

    precision: str
    reasons: tuple[str, ...]
    runners_up: tuple[tuple[str, str], ...]  # (precision, why it lost)
    fixes: tuple[str, ...] = ()  # override strings with a why
    # False when FP32, the reference, was not measured: ``precision`` is then only the default.
    measured: bool = True


def speed_words(speed: Speed) -> str:
    """``1.84× FP32 (1.80–1.90)``."""
    return f"{speed.ratio:.2f}× FP32 ({speed.low:.2f}–{speed.high:.2f})"


def allowed_difference(ctx: Context) -> float:
    """The largest relative loss difference to FP32 a recommended precision may show: the
    tolerance, or CHAOS_MARGIN times FP32's own spread under a one-ulp nudge when that is larger
    (a difference the training makes from any perturbation says nothing about the precision)."""
    spread = (
        ctx.fp32_spread if ctx.fp32_spread is not None and math.isfinite(ctx.fp32_spread) else 0
    )
    return max(ctx.tolerance, CHAOS_MARGIN * spread)


def allowance_words(ctx: Context) -> str:
    """``tolerance 5%`` or ``allowed 61%: 2× FP32's own 30.5% under a one-ulp nudge``."""
    allowed = allowed_difference(ctx)
    if allowed == ctx.tolerance:
        return f"tolerance {ctx.tolerance:.0%}"
    return (
        f"allowed {allowed:.0%}: {CHAOS_MARGIN:g}× FP32's own {ctx.fp32_spread:.1%} under a "
        f"one-ulp nudge of its initial weights, above the {ctx.tolerance:.0%} tolerance"
    )


def disqualified(m: Measured, ctx: Context) -> str | None:
    """Why ``m`` cannot be recommended over FP32, in plain words; None when it qualifies."""
    absent = _overflow_or_absent(m)
    if absent:
        return absent
    if m.emulated:  # whatever its numerics, emulation never buys speed
        return f"{m.precision} only emulated here (no hardware for it): numerics without a speed-up"
    return unfaithful(m, ctx) or _speed_disqualifies(m, ctx)


def _overflow_or_absent(m: Measured) -> str | None:
    if m.fp16_overflow:  # the probe's finding rules FP16 out whatever else was measured
        return f"FP16 overflows in the forward at {', '.join(m.fp16_overflow)}"
    if m.not_run:
        return f"{NOT_MEASURED}{m.not_run}"
    return None


def unfaithful(m: Measured, ctx: Context) -> str | None:
    """Why ``m``'s numerics rule it out (the range probe, the fidelity run, the seeds), whatever
    its speed; None when its loss stayed with FP32's. Emulation does not count here: the numerics
    are the format's (what fits a GPU that has the hardware, :mod:`.fits`, asks this)."""
    absent = _overflow_or_absent(m)
    if absent:
        return absent
    if m.fidelity is None:
        return f"fidelity not measured ({m.fidelity_note or 'no run'}): cannot vouch for it"
    f = m.fidelity
    if f.diverged:
        return f"diverged in the short run: {f.diverged}"
    if f.skipped_steps > ctx.max_skipped_fraction * f.steps:
        return (
            f"lost updates: {f.skipped_steps} of {f.steps} optimizer steps skipped "
            f"(more than {ctx.max_skipped_fraction:.0%})"
        )
    v = m.equivalence
    if v is not None and v.verdict == NOT_EQUIVALENT:
        return f"final loss over seeds: {verdict_words(m.precision, v)}"
    passed = v is not None and v.verdict == EQUIVALENT  # the seeds decide, not the single run
    if not passed and not f.max_rel_diff <= allowed_difference(ctx):  # also catches NaN
        return (
            f"loss trajectory leaves FP32's by up to {f.max_rel_diff:.1%} ({allowance_words(ctx)})"
        )
    return None


def _speed_disqualifies(m: Measured, ctx: Context) -> str | None:
    if m.speed is None:
        return f"speed not measured ({m.speed_note or 'no run'})"
    if ctx.busy:
        return f"speed not judged: measured on a busy machine ({ctx.busy}); run advise again on a quiet one"
    if m.speed.low > 1.0:
        return None
    if m.speed.high < 1.0:
        return f"slower here: {speed_words(m.speed)}"
    return f"not measurably faster: {speed_words(m.speed)} overlaps FP32"


def _overlap(a: Speed, b: Speed) -> bool:
    return a.low <= b.high and b.low <= a.high


def _rank(m: Measured) -> int:
    return SIMPLICITY.index(m.precision) if m.precision in SIMPLICITY else len(SIMPLICITY)


def choose(qualified: Sequence[Measured]) -> tuple[Measured, list[tuple[str, str]]]:
    """The winner among measurably faster, faithful precisions, and why each other one lost.

    The fastest median wins unless a simpler choice's range overlaps it (a tie, see module doc).
    """
    fastest = max(qualified, key=lambda m: m.speed.ratio)
    tied = [m for m in qualified if _overlap(m.speed, fastest.speed)]
    winner = min(tied, key=_rank)
    lost = []
    for m in qualified:
        if m is winner:
            continue
        if m in tied:
            why = f"ties with {winner.precision} ({speed_words(m.speed)}): the simpler choice wins"
        else:
            why = f"slower than {winner.precision}: {speed_words(m.speed)}"
        lost.append((m.precision, why))
    return winner, lost


def fixes(measured: Sequence[Measured], winner: str, ctx: Context) -> list[str]:
    """Concrete overrides for the flags found: FP32 islands, BF16 for FP16 overflows,
    channels_last for convolutions on a GPU."""
    out = []
    for m in measured:
        if m.fp16_overflow:
            layers = ",".join(m.fp16_overflow)
            out.append(
                f"precision=fp16 numerics.fp32_modules=[{layers}]: keeps the overflowing layers "
                "in FP32 (an FP32 island) so FP16 can run"
            )
            if winner != "bf16":
                out.append("precision=bf16: FP32's exponent range, so no forward overflow")
    flagged = next((m for m in measured if m.precision == winner and m.audit_modules), None)
    if flagged is not None:
        modules = ",".join(flagged.audit_modules)
        out.append(
            f"numerics.fp32_modules=[{modules}]: the autocast audit saw ops there that "
            "belong in FP32 run in low precision; the loss stayed within tolerance, so only if "
            "accuracy drifts on a long run"
        )
    if ctx.device_type == "cuda" and ctx.has_convolutions and not ctx.channels_last:
        out.append("channels_last=true: convolutions run faster in NHWC on GPUs with tensor cores")
    return out


def recommend(measured: Sequence[Measured], ctx: Context) -> Advice:
    """The decision of the module doc; ``measured`` holds one entry per precision considered."""
    others = [m for m in measured if m.precision != REFERENCE]
    why_not = {m.precision: disqualified(m, ctx) for m in others}
    qualified = [m for m in others if why_not[m.precision] is None]
    runners_up = [(m.precision, why_not[m.precision]) for m in others if why_not[m.precision]]
    fp32 = next((m for m in measured if m.precision == REFERENCE), None)
    compared = fp32 is not None and fp32.fidelity is not None  # else nothing to compare with
    if not compared or not qualified:
        why = _fp32_wins(others, ctx) if compared else f"nothing measured {_shortfall(ctx)}"
        fp32_fixes = tuple(fixes(measured, REFERENCE, ctx))
        return Advice(REFERENCE, (why,), tuple(runners_up), fp32_fixes, compared)
    winner, lost = choose(qualified)
    f = winner.fidelity
    reasons = (
        f"fastest measurable speed-up here: {speed_words(winner.speed)}",
        _loss_reason(winner, ctx),
        *([verdict_words(winner.precision, winner.equivalence)] if winner.equivalence else []),
        f"{f.skipped_steps} skipped optimizer steps; no forward overflow",
    )
    fp32 = (REFERENCE, f"the reference: {winner.precision} is {speed_words(winner.speed)}")
    return Advice(
        winner.precision,
        reasons,
        (*lost, fp32, *runners_up),
        tuple(fixes(measured, winner.precision, ctx)),
    )


def _loss_reason(winner: Measured, ctx: Context) -> str:
    """The single run's loss against FP32's; where it strayed past the allowance the seeds'
    verdict (equivalent) let the precision through, and this says so."""
    f = winner.fidelity
    words = "within" if f.max_rel_diff <= allowed_difference(ctx) else "up to (past the allowance)"
    line = (
        f"loss {words} {pct(f.max_rel_diff)} of FP32's over {f.steps} steps from the same "
        f"weights and batches ({allowance_words(ctx)}), final {pct(f.final_rel_diff)}"
    )
    if words != "within":
        line += "; its final loss over seeds is equivalent, which decides"
    return line


def _shortfall(ctx: Context) -> str:
    """What stopped the measuring and what to do: ``within the budget; raise advise.budget_s``."""
    if ctx.interrupted_by:
        return f"before {ctx.interrupted_by} interrupted advise; run it again to measure the rest"
    return "within the budget; raise advise.budget_s"


def _fp32_wins(others: Sequence[Measured], ctx: Context) -> str:
    """Why FP32 stays: nothing else qualified, or nothing else got as far as a fidelity run
    (then that is said, not a comparison that never happened)."""
    if all(m.not_run or m.fidelity is None for m in others):
        return f"FP32, the reference: no other precision was compared with it {_shortfall(ctx)}"
    return (
        "no other precision is measurably faster here with its loss as close to FP32's as "
        f"allowed ({allowance_words(ctx)}) and no numerical flags"
    )


def relative_differences(
    losses: Sequence[float], reference: Sequence[float], window: int
) -> list[float]:
    """|mean(losses) − mean(reference)| / |mean(reference)| over consecutive windows of
    ``window`` steps (a single step's loss is noisy; the same batches make windows comparable).

    Compares the common prefix; a non-finite loss in a window makes that window's value inf.
    """
    n = min(len(losses), len(reference))
    out = []
    for start in range(0, n, window):
        a = losses[start : min(start + window, n)]
        b = reference[start : min(start + window, n)]
        mean_a, mean_b = sum(a) / len(a), sum(b) / len(b)
        finite = math.isfinite(mean_a) and math.isfinite(mean_b)
        out.append(abs(mean_a - mean_b) / max(abs(mean_b), 1e-12) if finite else math.inf)
    return out


def fidelity_of(
    losses: Sequence[float],
    reference: Sequence[float],
    skipped_steps: int,
    diverged: str | None,
) -> Fidelity:
    """A :class:`Fidelity` from two loss trajectories (windows of a tenth of the run, at least
    one step); a run shorter than the reference counts as diverged (it stopped)."""
    window = max(1, len(reference) // 10)
    diffs = relative_differences(losses, reference, window) or [math.inf]
    if len(losses) < len(reference) and diverged is None:
        diverged = f"stopped after {len(losses)} of {len(reference)} steps"
    return Fidelity(len(reference), max(diffs), diffs[-1], skipped_steps, diverged)
