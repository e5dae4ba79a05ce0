"""The first estimate was 4-17x too high when threads=auto switched 2 -> 1 right after it
(issue 39, item 3): the estimate is made again from the steps after the thread count changed."""

from __future__ import annotations

from mptrain.pace.estimate import Pace


def test_a_restart_estimates_again_from_the_steps_after_it():
    pace = Pace(total_steps=1000)
    pace.start(0.0)
    now = 0.0
    for step, seconds in enumerate([5.0, 1.0, 1.0, 1.0, 1.0], start=1):  # two threads, busy
        now += seconds
        first = pace.step_done(step, now)
    assert first is not None and first.step_s == 1.0
    pace.restart(5, now, "threads 2 -> 1 at step 5")
    estimates = []
    for step in range(6, 12):  # one thread: 10x faster
        now += 0.1
        estimates.append(pace.step_done(step, now))
    again = next(e for e in estimates if e is not None)
    assert abs(again.step_s - 0.1) < 1e-9 and again.first_measured == 6
    assert abs(again.total_s - 100.0) < 1e-6  # not 1000 s
    assert pace.restarted_why == "threads 2 -> 1 at step 5"
    assert estimates.count(None) == len(estimates) - 1  # once


def test_the_thread_tuner_reports_a_change_of_count():
    """Steps at 2 threads take 10x the time of steps at 1 (a busy machine): the warm-up chooses
    1 and says so to whoever listens (the progress display, which estimates again)."""
    from mptrain.platform.contention import LoadSample
    from mptrain.train.threads import ThreadChoice, ThreadTuner

    clock = {"t": 0.0, "calls": 0}

    def tick() -> float:  # before_step reads the start, after_step the end of a step
        clock["calls"] += 1
        if clock["calls"] % 2 == 0:
            clock["t"] += 1.0 if tuner._running == 2 else 0.1
        return clock["t"]

    changes = []
    tuner = ThreadTuner(
        ThreadChoice("auto", 2, "auto", "2 CPUs"), window=20, set_threads=lambda n: None,
        clock=tick, load=lambda: LoadSample(None, None, 0.0),
    )  # fmt: skip
    tuner.on_change = lambda step, why: changes.append((step, why))
    for step in range(12):
        tuner.before_step(step)
        tuner.after_step(step)
    (decided,) = tuner.measurements
    assert decided["chose"] == 1
    assert changes == [(decided["step"], f"threads 2 -> 1 at step {decided['step']}")]
