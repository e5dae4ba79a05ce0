"""precision=auto decided by timing the model (mptrain.train.autoprecision): the choice follows the
timing, the run is untouched by it, the reason says which basis held, resumes keep the precision
they were trained in."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from support.runs import tiny_run, train

from mptrain.platform import hardware
from mptrain.rundir.layout import step_checkpoint_name
from mptrain.train import autoprecision
from mptrain.train.autoprecision import (
    MIN_STEPS,
    choose,
    decide_auto,
    summarised,
    time_candidates,
)
from mptrain.train.build import prepare_run, with_policy
from mptrain.train.threads import ThreadChoice


@pytest.fixture
def native_bf16(monkeypatch):
    """The rule's CPU choice is BF16 (the case that is timed), whatever this CPU has."""
    monkeypatch.setattr(hardware, "cpu_has_native_bf16", lambda: True)


def timing(bf16_s: float, fp32_s: float) -> dict:
    return {"s_per_step": {"bf16": bf16_s, "fp32": fp32_s}}


@pytest.mark.parametrize(
    ("bf16_s", "fp32_s", "chosen", "words"),
    [
        (0.010, 0.013, "bf16", "bf16 1.30x faster"),
        (0.010, 0.0102, "fp32", "bf16 only 1.02x faster (< 1.05x), so fp32"),
        (0.013, 0.010, "fp32", "fp32 1.30x faster"),
    ],
)
def test_choice_follows_the_timing_and_says_it(bf16_s, fp32_s, chosen, words):
    name, reason = choose(timing(bf16_s, fp32_s), lower="bf16")
    assert name == chosen
    assert reason.startswith("measured: bf16 10 ms vs fp32") or reason.startswith(
        "measured: bf16 13 ms"
    )
    assert words in reason


def test_timing_the_candidates_leaves_the_run_untouched(native_bf16):
    """Weights, optimizer state, data position and the random stream are those of a run that
    was never timed: the run trains the same whichever precision the timing favours."""
    run = prepare_run(tiny_run("max_steps=3"))
    weights = {k: v.clone() for k, v in run.model.state_dict().items()}
    rng = torch.random.get_rng_state()
    result = time_candidates(run, ("bf16", "fp32"))
    assert all(torch.equal(v, run.model.state_dict()[k]) for k, v in weights.items())
    assert not run.optimizer.state  # no step was taken on the run's optimizer
    assert all(p.grad is None for p in run.model.parameters())
    assert torch.equal(rng, torch.random.get_rng_state())
    assert run.state.step == 0
    steps = result["steps"]
    assert {len(steps["bf16"]), len(steps["fp32"])} == {autoprecision.ROUNDS}
    assert result["s_per_step"] == {n: min(t) for n, t in steps.items()}


@pytest.mark.parametrize(
    ("overrides", "why"),
    [
        (("precision.measure=false",), "precision.measure=false"),
        (("max_steps=20",), f"a run of 20 steps: timing the candidates pays off from {MIN_STEPS}"),
    ],
)
def test_not_timed_says_why_and_keeps_the_rule(native_bf16, overrides, why):
    cfg = tiny_run("precision.measure=true", *overrides)
    run = prepare_run(cfg)
    settled = decide_auto(run, 20 if "max_steps=20" in overrides else 400)
    assert settled.precision.policy.name == "bf16"
    assert settled.precision.policy.reason.startswith("rule: the CPU executes BF16 natively")
    assert settled.precision.policy.reason.endswith(why)
    assert settled.precision.policy.auto_timing is None


def test_timed_choice_is_what_runs_and_is_recorded(native_bf16, tmp_path, monkeypatch):
    """A run long enough to time: the report's precision is the timed choice (here made the
    slower one for BF16, so FP32 must run), with the figures it was chosen on. The timing is
    given: real steps on a busy machine can leave it undecided (then the rule, BF16, runs)."""
    fake_timings(monkeypatch, ([0.02, 0.02, 0.02, 0.02], [0.01, 0.011, 0.012, 0.013]))
    monkeypatch.setattr(autoprecision, "choose", lambda t, lower: ("fp32", "measured: (test)"))
    monkeypatch.setattr(autoprecision, "MIN_STEPS", 12)  # a short run stands for a long one
    cfg = tiny_run("precision.measure=true", "max_steps=12")
    report = train(cfg, tmp_path)
    precision = report["precision"]
    assert (precision["requested"], precision["effective"]) == ("auto", "fp32")
    assert precision["autocast_dtype"] is None
    assert precision["reason"] == "measured: (test)"
    assert set(precision["auto_timing"]["s_per_step"]) == {"bf16", "fp32"}


def test_resume_with_auto_continues_in_the_checkpoints_precision(native_bf16, tmp_path):
    """The rule says bf16 here; the checkpoint was trained in fp32: the resume is accepted and
    continues in fp32, saying why."""
    source = tmp_path / "source"
    train(tiny_run("precision=fp32", "max_steps=9", "checkpoint.every_steps=3"), source)
    step_6 = source / "checkpoints" / step_checkpoint_name(6)
    report = train(
        tiny_run("max_steps=9", "checkpoint.every_steps=3", f"resume={step_6}"),
        tmp_path / "resumed",
    )
    assert report["resumed"]["step"] == 6
    assert report["precision"]["effective"] == "fp32"
    assert "kept from the checkpoint" in report["precision"]["reason"]


def test_a_resumed_run_keeps_the_precision_its_checkpoint_was_trained_in(native_bf16):
    """Timing again could pick the other precision, which the resume would refuse: the
    checkpoint's precision is kept, and the reason says so."""
    run = prepare_run(tiny_run("precision.measure=true", f"max_steps={MIN_STEPS}"))
    settled = decide_auto(run, MIN_STEPS, trained_in="fp32")
    assert settled.precision.policy.name == "fp32" and settled.precision.policy.requested == "auto"
    assert (
        settled.precision.policy.reason
        == "kept from the checkpoint this run resumes (trained in fp32)"
    )
    assert settled.precision.policy.auto_timing is None
    assert settled.monitor is not run.monitor  # the monitor names the precision that runs


def test_only_the_same_build_can_change_precision():
    """bf16 <-> fp32 share FP32 weights and no scaler; fp16 (a loss scaler) needs another build."""
    run = prepare_run(tiny_run("precision=bf16"))
    fp16 = dataclasses.replace(run.precision.policy, name="fp16", loss_scaling=True)
    with pytest.raises(ValueError, match="not the same build"):
        with_policy(run, fp16)


# ------------------------------------------- issue 39, item 2: an auto that decides the same way
def fake_timings(monkeypatch, *rounds: tuple[list[float], list[float]]):
    """time_candidates returning these (bf16 steps, fp32 steps) batches, one per call."""
    batches = iter(rounds)

    def timed(run, names):
        bf16, fp32 = next(batches)
        return autoprecision.summarised({"bf16": {"1": bf16}, "fp32": {"1": fp32}})

    monkeypatch.setattr(autoprecision, "time_candidates", timed)


def test_rounds_that_disagree_are_timed_again_then_left_to_the_rule(native_bf16, monkeypatch):
    """On a busy machine the fastest steps flipped between runs minutes apart (fp32 3.32x
    faster, then bf16 2.79x faster): paired rounds that disagree are timed again, and if they
    still disagree the device rule decides, saying so."""
    flip = ([0.01, 0.05, 0.01, 0.05], [0.03, 0.01, 0.03, 0.01])  # each wins 2 of 4
    fake_timings(monkeypatch, flip, flip, flip)
    said = []
    run = prepare_run(tiny_run("precision.measure=true", f"max_steps={MIN_STEPS}"))
    settled = decide_auto(run, MIN_STEPS, say=said.append)
    assert said == ["auto: timing bf16 and fp32 on copies of this model before training"]
    policy = settled.precision.policy
    assert policy.name == "bf16" and len(policy.auto_timing["steps"]["fp32"]) == 12
    assert policy.reason.endswith(
        "timed but undecided on a busy machine (bf16 faster in 6 of 12 paired steps): the "
        "device rule's choice"
    )


def test_rounds_that_agree_decide_at_once(native_bf16, monkeypatch):
    fake_timings(monkeypatch, ([0.01, 0.011, 0.012, 0.05], [0.02, 0.02, 0.02, 0.02]))
    run = prepare_run(tiny_run("precision.measure=true", f"max_steps={MIN_STEPS}"))
    policy = decide_auto(
        run, MIN_STEPS
    ).precision.policy  # bf16 wins 3 of 4: decided, no more rounds
    assert policy.name == "bf16" and len(policy.auto_timing["steps"]["bf16"]) == 4
    assert policy.reason.startswith("measured: bf16 10 ms vs fp32 20 ms")


def test_a_run_stopped_while_auto_times_reports_it(native_bf16, monkeypatch, tmp_path):
    """A run killed in that window reported "precision choice: rule"."""

    def interrupted(run, names):
        raise KeyboardInterrupt

    monkeypatch.setattr(autoprecision, "time_candidates", interrupted)
    with pytest.raises(KeyboardInterrupt):
        train(tiny_run("precision.measure=true", f"max_steps={MIN_STEPS}"), tmp_path)
    import json

    report = json.loads((tmp_path / "report.json").read_text())
    assert report["status"] == "interrupted"
    assert report["precision"]["reason"].endswith(
        "stopped while precision=auto timed its candidates"
    )


def test_candidates_are_timed_at_every_count_threads_auto_may_keep(native_bf16):
    """threads=auto starts at the budget (here 2) and its tuner may keep 1: each candidate is
    timed at both, judged at its fastest, and the count in effect is restored."""
    run = prepare_run(tiny_run(f"max_steps={MIN_STEPS}"))
    run.threads = ThreadChoice("auto", 2, "auto", "a budget of 2 (test)")  # as the job builds it
    before = torch.get_num_threads()
    counts = autoprecision.thread_counts(run)
    assert counts[0] == run.threads.threads and counts[-1] == 1
    result = time_candidates(run, ("bf16", "fp32"))
    assert torch.get_num_threads() == before
    for name in ("bf16", "fp32"):
        by_count = result["steps_by_threads"][name]
        assert set(by_count) == {str(c) for c in counts}
        assert all(len(steps) == autoprecision.ROUNDS for steps in by_count.values())
        fastest = min(min(steps) for steps in by_count.values())
        assert result["s_per_step"][name] == fastest
        assert min(by_count[str(result["threads"][name])]) == fastest


def test_a_pinned_count_is_the_only_one_timed(native_bf16):
    run = prepare_run(tiny_run("threads=1", f"max_steps={MIN_STEPS}"))
    assert autoprecision.thread_counts(run) == [1]
    assert set(time_candidates(run, ("bf16", "fp32"))["steps_by_threads"]["bf16"]) == {"1"}


def test_the_reason_names_the_count_each_candidate_was_timed_fastest_at():
    """Two candidates judged at different counts: the reason says which (bf16 at 1 thread is
    what the run would do after the tuner's switch, not bf16 at 2)."""
    timing = summarised(
        {
            "bf16": {"2": [0.040, 0.041], "1": [0.010, 0.011]},
            "fp32": {"2": [0.020, 0.021], "1": [0.030, 0.031]},
        }
    )
    assert timing["threads"] == {"bf16": 1, "fp32": 2}
    assert timing["steps"] == {"bf16": [0.010, 0.011], "fp32": [0.020, 0.021]}
    name, reason = choose(timing, lower="bf16")
    assert name == "bf16"
    assert reason.startswith("measured: bf16 10 ms at 1 thread vs fp32 20 ms at 2 threads")
    assert "(fastest of 2," in reason
