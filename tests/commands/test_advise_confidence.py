"""``advise.seeds``: the equivalence verdict (the TOST paired by seed, and Welch's recorded beside
it, both checked against scipy's own t-tests), the seeds the budget affords, the decision it
changes, and a tiny real run."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import random

import pytest
from scipy import stats
from support.processes import describe, run_mptrain
from support.runs import tiny_run

from mptrain.commands.advise import choices, seeds, trials
from mptrain.commands.advise.confidence import (
    EQUIVALENT,
    NOT_EQUIVALENT,
    UNDECIDED,
    Verdict,
    final_loss,
    paired_tost,
    verdict,
    verdict_words,
    welch_tost,
)
from mptrain.commands.advise.decide import Context, Fidelity, Measured, Speed, recommend
from mptrain.commands.advise.measure import Candidate
from mptrain.config.commands import AdviseConfig, seed_count


def draws(mean: float, sd: float, n: int, seed: int) -> list[float]:
    """``n`` synthetic per-seed final losses around ``mean``."""
    rng = random.Random(seed)
    return [rng.gauss(mean, sd) for _ in range(n)]


# ------------------------------------------------------------------------------ the test itself
@pytest.mark.parametrize("seed", range(4))
def test_welch_tost_is_two_of_scipys_one_sided_welch_t_tests(seed):
    """TOST's two p-values are one-sided Welch t-tests of the difference against -delta and
    +delta: scipy computes them on its own (its own variances and degrees of freedom)."""
    a, b = draws(1.0, 0.02, 5, seed), draws(1.01, 0.05, 7, seed + 100)
    delta = 0.03
    w = welch_tost(a, b, delta, alpha=0.05)

    lower = stats.ttest_ind([x + delta for x in a], b, equal_var=False, alternative="greater")
    upper = stats.ttest_ind([x - delta for x in a], b, equal_var=False, alternative="less")
    assert w.p_lower == pytest.approx(lower.pvalue, rel=1e-9)
    assert w.p_upper == pytest.approx(upper.pvalue, rel=1e-9)
    assert w.df == pytest.approx(lower.df, rel=1e-9)
    # the 90% interval: scipy's two-sided 90% interval of the same Welch statistic
    interval = stats.ttest_ind(a, b, equal_var=False).confidence_interval(0.9)
    assert w.ci == pytest.approx((interval.low, interval.high), rel=1e-9)


@pytest.mark.parametrize("seed", range(3))
def test_paired_tost_is_two_of_scipys_one_sided_paired_t_tests(seed):
    a, b = draws(1.0, 0.05, 6, seed), draws(1.0, 0.05, 6, seed + 50)
    delta = 0.04
    w = paired_tost(a, b, delta, alpha=0.05)

    lower = stats.ttest_rel([x + delta for x in a], b, alternative="greater")
    upper = stats.ttest_rel([x - delta for x in a], b, alternative="less")
    assert (w.p_lower, w.p_upper) == pytest.approx((lower.pvalue, upper.pvalue), rel=1e-9)
    assert w.df == 5
    interval = stats.ttest_rel(a, b).confidence_interval(0.9)
    assert w.ci == pytest.approx((interval.low, interval.high), rel=1e-9)
    with pytest.raises(ValueError, match="one pair per seed"):
        paired_tost(a, b[:-1], delta, 0.05)


def test_pairing_by_seed_cancels_the_seeds_own_noise():
    """Each seed moves both precisions' final loss alike (its weights and batches): Welch's
    test sees that spread and cannot decide; the paired test sees only the precision's."""
    seed_noise = draws(1.0, 0.08, 5, 0)
    fp32 = seed_noise
    bf16 = [x * (1 + e) for x, e in zip(seed_noise, draws(0.0, 0.002, 5, 1), strict=True)]

    assert verdict(bf16, fp32, 0.05, 0.05).verdict == UNDECIDED
    assert verdict(bf16, fp32, 0.05, 0.05, paired=True).verdict == EQUIVALENT


def test_welch_tost_by_hand():
    """a = 1, 2, 3 and b = 2, 4, 6: difference -2, variances 1 and 4, se = sqrt(5/3),
    Welch's df = (5/3)^2 / ((1/3)^2/2 + (4/3)^2/2) = 50/17; against delta 3 the upper test's
    t is (-2 - 3)/se and the lower one's (-2 + 3)/se."""
    w = welch_tost([1.0, 2.0, 3.0], [2.0, 4.0, 6.0], delta=3.0, alpha=0.05)
    se = math.sqrt(5 / 3)

    assert w.difference == -2.0 and w.se == pytest.approx(se)
    assert w.df == pytest.approx(50 / 17)
    assert w.p_upper == pytest.approx(stats.t.cdf(-5 / se, 50 / 17))
    assert w.p_lower == pytest.approx(stats.t.sf(1 / se, 50 / 17))
    assert w.p_value == max(w.p_lower, w.p_upper)


def test_equal_precisions_are_equivalent():
    fp32 = draws(1.0, 0.01, 8, 0)
    same = draws(1.0, 0.01, 8, 1)  # another draw around the same mean
    v = verdict(same, fp32, margin=0.05, alpha=0.05)

    assert v.verdict == EQUIVALENT, v
    assert v.p_value < 0.05 and v.seeds == v.reference_seeds == 8
    assert -0.05 < v.ci[0] < v.difference < v.ci[1] < 0.05


def test_a_known_loss_offset_is_not_equivalent():
    fp32 = draws(1.0, 0.01, 6, 0)
    worse = [x + 0.10 for x in draws(1.0, 0.01, 6, 1)]  # 10% higher loss, tolerance 5%
    v = verdict(worse, fp32, margin=0.05, alpha=0.05)

    assert v.verdict == NOT_EQUIVALENT, v
    assert v.p_value > 0.5 and v.ci[0] > 0.05
    assert v.difference == pytest.approx(0.10, abs=0.02)
    words = verdict_words("fp8-rowwise", v)
    assert words.startswith("fp8-rowwise vs FP32: not equivalent (TOST p = ")
    assert "margin ±5%), 6 seeds each" in words


def test_too_few_seeds_is_undecided_and_says_why():
    v = verdict([1.0, 1.001], [1.0, 0.999], 0.05, 0.05, few="only 2 seeds fit the budget")

    assert v.verdict == UNDECIDED and v.p_value is None
    assert v.why == "only 2 seeds fit the budget; at least 3 are needed to test"
    assert verdict_words("bf16", v) == (
        "bf16 vs FP32: undecided: only 2 seeds fit the budget; at least 3 are needed to test "
        "(2 seeds each)"
    )


def exact(mean: float, sd: float, n: int) -> list[float]:
    """``n`` values whose mean and sample standard deviation are exactly ``mean`` and ``sd``."""
    z = [i - (n - 1) / 2 for i in range(n)]
    scale = sd / math.sqrt(sum(x * x for x in z) / (n - 1))
    return [mean + scale * x for x in z]


def test_too_much_spread_is_undecided_with_the_seeds_that_would_decide():
    fp32, bf16 = exact(1.0, 0.04, 3), exact(1.01, 0.04, 3)
    v = verdict(bf16, fp32, margin=0.05, alpha=0.05)

    assert v.verdict == UNDECIDED, v
    assert v.why.startswith("too much spread for 3 seeds: the interval crosses the margin")
    n = v.seeds_to_decide
    assert n is not None and n > 3 and f"about {n} seeds each would decide it" in v.why
    # with the same means and spreads, n seeds decide and n - 1 do not
    assert verdict(exact(1.01, 0.04, n), exact(1.0, 0.04, n), 0.05, 0.05).verdict == EQUIVALENT
    fewer = verdict(exact(1.01, 0.04, n - 1), exact(1.0, 0.04, n - 1), 0.05, 0.05)
    assert fewer.verdict == UNDECIDED


def test_a_seed_that_diverged_is_not_equivalent_and_fp32_diverging_decides_nothing():
    fp32 = [1.0, 1.01, 0.99]
    assert verdict([1.0, math.inf, 1.0], fp32, 0.05, 0.05).verdict == NOT_EQUIVALENT
    assert "not finite in 1 of 3 seeds" in verdict([1.0, math.nan, 1.0], fp32, 0.05, 0.05).why
    assert verdict(fp32, [1.0, math.inf, 1.0], 0.05, 0.05).verdict == UNDECIDED


def test_no_spread_at_all_is_decided_exactly():
    assert verdict([1.0] * 3, [1.0] * 3, 0.05, 0.05).verdict == EQUIVALENT
    assert verdict([1.2] * 3, [1.0] * 3, 0.05, 0.05).verdict == NOT_EQUIVALENT


def test_final_loss_is_the_mean_of_the_last_tenth():
    assert final_loss([5.0] * 10 + [1.0] * 8 + [2.0, 4.0]) == 3.0  # 20 steps: the last 2
    assert final_loss([3.0, 2.0]) == 2.0  # at least one step
    assert final_loss([1.0] * 18 + [math.nan, 1.0]) == math.inf


# ------------------------------------------------------------------------------ the decision
CTX = Context(tolerance=0.05)
FP32 = Measured("fp32", speed=Speed(1.0, 1.0, 1.0), fidelity=Fidelity(40, 0.0, 0.0))


def fast(name: str, drift: float, v: Verdict | None) -> Measured:
    return Measured(
        name, speed=Speed(1.8, 1.7, 1.9), fidelity=Fidelity(40, drift, drift), equivalence=v
    )


def test_not_equivalent_over_seeds_rules_out_a_precision_the_single_run_passed():
    worse = verdict([x + 0.1 for x in draws(1.0, 0.01, 5, 1)], draws(1.0, 0.01, 5, 0), 0.05, 0.05)
    advice = recommend([FP32, fast("bf16", 0.01, worse)], CTX)

    assert advice.precision == "fp32"
    assert "final loss over seeds: bf16 vs FP32: not equivalent" in dict(advice.runners_up)["bf16"]


def test_equivalent_over_seeds_decides_where_the_single_run_strayed():
    same = verdict(draws(1.0, 0.01, 5, 1), draws(1.0, 0.01, 5, 0), 0.05, 0.05)
    strayed = fast("bf16", 0.08, same)  # 8% in the single run: past the 5% tolerance

    advice = recommend([FP32, strayed], CTX)
    assert advice.precision == "bf16"
    assert "past the allowance" in advice.reasons[1] and "equivalent" in advice.reasons[1]
    assert advice.reasons[2].startswith("bf16 vs FP32: equivalent (TOST p = ")
    undecided = dataclasses.replace(same, verdict=UNDECIDED)  # then the single run decides
    assert recommend([FP32, fast("bf16", 0.08, undecided)], CTX).precision == "fp32"


# ------------------------------------------------------------------------------ the seeds run
base_cfg = functools.cache(tiny_run)  # composing takes a few tenths of a second


def candidate(name: str, step_s: float = 0.01, loss: float = 1.0) -> Candidate:
    """``name``, its pilot and fidelity run (seed 0) measured: 10 steps of ``step_s``."""
    trial = trials.Trial(name, 10, [loss] * 10, 0, None, step_time_s=step_s, wall_s=10 * step_s)
    c = Candidate(name, choices.apply(base_cfg(), choices.choice(name)), timed=True)
    c.pilot = c.fidelity = trial
    return c


def fake_runs(monkeypatch, offset: dict[str, float], budget: trials.Budget) -> list:
    """seeds.short_run replaced: a loss of 1 + seed noise (shared by every precision, as the
    same seed shares weights and batches) + a little of the precision's own + its ``offset``;
    each run moves ``budget``'s clock on by its 0.1 s."""
    ran = []

    def short_run(cfg, steps, warmup, deadline=None, **kwargs):
        name = cfg.precision.name
        ran.append((name, cfg.seed))
        budget.started -= 0.1
        noise = random.Random(cfg.seed).gauss(0, 0.01) + random.Random(f"{name}{cfg.seed}").gauss(
            0, 0.002
        )
        loss = 1.0 + noise + offset.get(name, 0.0)
        return trials.Trial(name, steps, [loss] * steps, 0, None, 0.01, 0.1)

    monkeypatch.setattr(seeds, "short_run", short_run)
    return ran


def found_for(cands: list[Candidate], settings: AdviseConfig) -> dict:
    return {"candidates": cands, "confidence": seeds.new_confidence(settings)}


@pytest.mark.parametrize(
    ("requested", "budget_s", "runs", "verdict_is"),
    [("4", 100.0, 3, EQUIVALENT), ("auto", 100.0, 9, EQUIVALENT), ("auto", 0.45, 1, UNDECIDED)],
    ids=["four", "auto-affords-10", "auto-affords-2"],
)
def test_the_budget_picks_the_seeds(monkeypatch, requested, budget_s, runs, verdict_is):
    """A round (fp32 and bf16, 0.1 s each) is planned at 0.3 s with the margin: 0.45 s left
    afford one round, then 0.25 s do not."""
    cands = [candidate("fp32"), candidate("bf16")]
    settings = AdviseConfig(seeds=requested, fidelity_steps=10)
    cfg = dataclasses.replace(base_cfg(), advise=settings)
    found = found_for(cands, settings)
    decision = recommend([FP32, Measured("bf16", fidelity=Fidelity(10, 0.0, 0.0))], CTX)
    budget = trials.Budget(trials.RESERVE_S + budget_s)  # composing the configs took time
    ran = fake_runs(monkeypatch, {}, budget)

    seeds.run_seeds(cfg, found, decision, budget, {})
    out = found["confidence"]
    assert len(ran) == 2 * runs  # fp32 and bf16, seeds 1.. (seed 0: their fidelity runs)
    assert [e["seed"] for e in out["finalists"]["bf16"]] == list(range(runs + 1))
    measured = seeds.with_verdicts([FP32, Measured("bf16")], out, None)
    assert measured[1].equivalence.verdict == verdict_is
    assert out["welch"]["bf16"]["seeds"] == runs + 1  # recorded beside it
    if verdict_is == UNDECIDED:  # 2 seeds: the words the report leads with
        assert out["verdicts"]["bf16"]["why"].startswith("only 2 seeds fit the budget")
        assert "seed 3 of each (~" in out["stopped"]


def test_the_runner_up_runs_when_affordable_and_fp32_always(monkeypatch):
    cands = [candidate("fp32"), candidate("bf16"), candidate("fp16", step_s=0.2, loss=1.2)]
    budget = trials.Budget(100.0)
    fake_runs(monkeypatch, {"fp16": 0.2}, budget)
    settings = AdviseConfig(seeds="3", fidelity_steps=10)
    cfg = dataclasses.replace(base_cfg(), advise=settings)
    decision = recommend(
        [
            FP32,
            Measured("bf16", speed=Speed(1.5, 1.4, 1.6), fidelity=Fidelity(10, 0.0, 0.0)),
            Measured("fp16", speed=Speed(1.2, 1.1, 1.3), fidelity=Fidelity(10, 0.0, 0.0)),
        ],
        CTX,
    )
    assert decision.precision == "bf16"

    found = found_for(cands, settings)
    seeds.run_seeds(cfg, found, decision, budget, {})
    assert list(found["confidence"]["finalists"]) == ["bf16", "fp32", "fp16"]
    measured = seeds.with_verdicts([FP32, Measured("fp16")], found["confidence"], None)
    assert measured[1].equivalence.verdict == NOT_EQUIVALENT  # 20% higher loss

    # 2 more rounds with fp16 (1.5 x (0.1 + 0.1 + 2.0) s each): 6.6 s do not fit 6 s
    found = found_for(cands, settings)
    budget = trials.Budget(trials.RESERVE_S + 6.0)
    seeds.run_seeds(cfg, found, decision, budget, {})
    assert list(found["confidence"]["finalists"]) == ["bf16", "fp32"]
    assert "its 3 seeds (~" in found["confidence"]["skipped"]["fp16"]


def test_seeds_keep_time_from_the_speed_part_but_at_most_half():
    cands = [candidate("fp32", step_s=0.1), candidate("bf16", step_s=0.2)]
    settings = AdviseConfig(seeds="auto", fidelity_steps=10)
    # 2 more seeds of fp32 (1 s) and bf16 (2 s), with the speed part's margin
    assert seeds.reserve_s(cands, settings, 100.0) == pytest.approx(2 * trials.REP_MARGIN * 3.0)
    assert seeds.reserve_s(cands, settings, 10.0) == pytest.approx(5.0)
    assert seeds.reserve_s(cands, AdviseConfig(seeds="1"), 100.0) == 0.0
    assert seeds.reserve_s(cands[:1], settings, 100.0) == 0.0  # nothing to compare


@pytest.mark.parametrize(
    ("text", "count"), [("auto", None), ("3", 3), (" 12", 12), (7, 7)], ids=str
)
def test_seed_count(text, count):
    assert seed_count(text) == count


# ------------------------------------------------------------------------------ end to end
@pytest.mark.slow
def test_advise_with_three_seeds_writes_the_verdict(tmp_path):
    args = ("model=mlp", "device=cpu", "advise.fidelity_steps=12", "advise.speed_steps=5")
    result = run_mptrain(
        tmp_path, "advise", *args, "advise.seeds=3", "advise.budget_s=45", "hydra.run.dir=out"
    )
    assert result.returncode == 0, describe(result)
    data = json.loads((tmp_path / "out" / "advise.json").read_text())
    markdown = (tmp_path / "out" / "advise.md").read_text()
    conf = data["confidence"]

    assert conf["requested"] == "3" and conf["alpha"] == 0.05
    assert "fp32" in conf["finalists"] and conf["verdicts"]
    for name, v in conf["verdicts"].items():
        entries = conf["finalists"][name]
        assert [e["seed"] for e in entries] == [0, 1, 2], conf.get("stopped")
        assert all(len(e["losses"]) == 12 and "final_loss" in e for e in entries)
        assert v["verdict"] in (EQUIVALENT, NOT_EQUIVALENT, UNDECIDED)
        assert 0 <= v["p_value"] <= 1 and v["seeds"] == 3
    first = next(iter(conf["verdicts"]))
    lines = markdown.splitlines()
    headline = next(i for i, line in enumerate(lines) if line.startswith("**Recommendation: "))
    lead = lines[headline + 2]  # the verdict and its p-value first
    assert lead.startswith(f"Confidence: {first} vs FP32: "), markdown
    assert "TOST p = " in lead
