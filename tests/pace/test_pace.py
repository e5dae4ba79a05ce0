"""The estimate of a run's time: its arithmetic, its line, when it is made, and the slow-path note."""

from __future__ import annotations

import pytest

from mptrain.pace.estimate import (
    Pace,
    SlowPath,
    estimate_line,
    estimate_run,
    rough_duration,
    slow_path_note,
    slow_path_so_far_note,
    step_time_text,
)


def test_the_estimate_is_all_steps_at_the_pace_measured_after_the_first():
    assert estimate_run(5000, (4, 6.24)) == pytest.approx(7800.0)
    assert estimate_line(5000, (4, 6.24)) == (
        "about 2 h 10 min for 5,000 steps at 1.56 s/step (measured over steps 2-5)"
    )
    assert estimate_line(3, (1, 41.2)) == (
        "about 2 min 4 s for 3 steps at 41.2 s/step (measured over step 2)"
    )
    assert estimate_line(300, (4, 0.05), first_measured=102) == (
        "about 3.8 s for 300 steps at 12.5 ms/step (measured over steps 102-105)"
    )
    with pytest.raises(ValueError, match="at least one measured step"):
        estimate_run(10, (0, 0.0))


@pytest.mark.parametrize(
    ("seconds", "words"),
    [
        (0.42, "0.42 s"),
        (41.2, "41 s"),
        (200, "3 min 20 s"),
        (180, "3 min"),
        (754, "12 min"),
        (7800, "2 h 10 min"),
        (7200, "2 h"),
        (3 * 86400 + 4 * 3600 + 59, "3 d 4 h"),
    ],
)
def test_rough_duration_gives_two_units_at_most(seconds, words):
    assert rough_duration(seconds) == words


@pytest.mark.parametrize(
    ("seconds", "words"),
    [
        (0.29, "0.29 s"),  # not 0.28: 0.29 * 100 is 28.999999999999996 in binary
        (0.137, "0.13 s"),
        (9.97, "9.9 s"),
        (29.7, "29 s"),
        (119.6, "1 min 59 s"),
        (7199.6, "1 h 59 min"),
        (1_000_000.0, "11 d 13 h"),
    ],
)
def test_a_lower_bound_or_a_time_so_far_is_rounded_down(seconds, words):
    assert rough_duration(seconds, down=True) == words


def test_step_time_in_seconds_or_milliseconds():
    assert step_time_text(1.5612) == "1.56 s/step"
    assert step_time_text(0.01234) == "12.3 ms/step"


def _steps(pace: Pace, times: list[float]) -> list:
    """Tell ``pace`` that steps start_step+1, +2, ... finished at ``times``; what each returned."""
    return [pace.step_done(pace.start_step + i + 1, t) for i, t in enumerate(times)]


def test_the_estimate_is_made_once_after_four_steps_past_the_first():
    pace = Pace(total_steps=1000)
    pace.start(100.0)
    made = _steps(pace, [105.0, 106.0, 107.0, 108.0, 109.0, 110.0])  # first step 5 s (one-offs)
    assert made[:4] == [None] * 4 and made[5] is None
    estimate = made[4]
    assert pace.first_step_s == 5.0 and pace.step_s == 1.0
    assert (estimate.steps, estimate.measured_steps, estimate.first_measured) == (1000, 4, 2)
    assert estimate.total_s == 1000.0 and estimate.made_after_s == 9.0
    assert pace.remaining_s(6) == 994.0
    record = estimate.record(actual_s=1003.0, actual_steps=1000)
    assert record["measured_steps"] == [2, 5] and record["made_at_step"] == 5
    assert record["estimated_s"] == 1000.0 and record["actual_s"] == 1003.0


def test_a_slow_run_is_estimated_after_its_second_step():
    pace = Pace(total_steps=5000, start_step=1000)  # resumed: 4,000 steps left
    pace.start(0.0)
    assert pace.remaining_s(1000) is None
    assert pace.step_done(1001, 45.0) is None
    assert pace.remaining_s(1001) == 45.0 * 3999  # the first step's pace, one-offs included
    second = pace.step_done(1002, 85.0)
    assert (second.steps, second.measured_steps, second.first_measured) == (4000, 1, 1002)
    assert second.line() == "about 1 d 20 h for 4,000 steps at 40 s/step (measured over step 1002)"


def test_the_slow_path_note_gives_the_ratio_and_the_faster_choice():
    slow = SlowPath(
        "FP16 convolutions are a slow path on this CPU", "fp16", "precision=bf16 (or fp32)", 0.62
    )
    assert slow_path_note(slow, 41.2) == (
        "FP16 convolutions are a slow path on this CPU: one step took 41.2 s in fp16 vs 0.62 s "
        "in fp32 (66×); precision=bf16 (or fp32) is the fast choice here"
    )
    untimed = SlowPath(slow.what, "fp16", "precision=fp32", None, "compile=true")
    assert slow_path_note(untimed, 3.0) == (
        "FP16 convolutions are a slow path on this CPU: one step took 3 s in fp16 (FP32 not "
        "timed: compile=true); precision=fp32 is the fast choice here"
    )


def test_while_the_first_step_runs_the_note_gives_a_lower_bound_of_the_ratio():
    slow = SlowPath(
        "FP16 convolutions are a slow path on this CPU", "fp16", "precision=bf16 (or fp32)", 0.98
    )
    # 30.9 / 0.98 = 31.5: rounded down, as a lower bound must be (the nearest would say 32)
    assert slow_path_so_far_note(slow, 1, 30.9) == (
        "FP16 convolutions are a slow path on this CPU: step 1 has run 30 s in fp16 so far vs "
        "0.98 s for a whole fp32 step (≥31×); precision=bf16 (or fp32) is the fast choice here"
    )
    assert "(≥9.9×)" in slow_path_so_far_note(slow, 1001, 9.77)  # 9.969...: one decimal, down
    assert "step 1001 has run 9.7 s" in slow_path_so_far_note(slow, 1001, 9.77)
    untimed = SlowPath(slow.what, "fp16", "precision=fp32", None, "compile=true")
    assert slow_path_so_far_note(untimed, 1, 30.0) is None  # the note after the step says why
