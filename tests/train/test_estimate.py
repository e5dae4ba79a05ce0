"""How long a run is expected to take here (mptrain.train.estimate): the line from a step count and
measured step times, and the observer that times the first steps and says it once. CPU only, with
a fake clock: no run trains here (tests/config/test_recipes.py has the real run that says it)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from mptrain.train.estimate import StepTimer, duration_words, estimate_line, step_time_words


def test_the_line_is_steps_times_the_measured_step_time():
    line = estimate_line("recipe nanogpt_shakespeare_char", 5000, [1.55, 1.56, 1.57, 1.56], 2)
    assert line == (
        "recipe nanogpt_shakespeare_char: 5000 steps, about 2 h 10 min here at 1.56 s/step "
        "(measured over steps 2-5)"
    )


def test_the_median_step_time_counts_so_one_slow_step_does_not():
    # Step 4 paid for a checkpoint write: 12 ms per step, not the mean's 262 ms.
    line = estimate_line("run", 1000, [0.012, 0.012, 1.0, 0.012], 2)
    assert line == "run: 1000 steps, about 12 s here at 12 ms/step (measured over steps 2-5)"


def test_a_resumed_run_counts_the_steps_left():
    line = estimate_line("run", 5000, [2.0, 2.0], 1002, steps_done=1000)
    assert line.startswith("run: 5000 steps (4000 left), about 2 h 13 min here at 2 s/step")
    assert line.endswith("(measured over steps 1002-1003)")


def test_no_step_time_is_no_estimate():
    with pytest.raises(ValueError, match="no step times"):
        estimate_line("run", 10, [], 2)


@pytest.mark.parametrize(
    ("seconds", "words"),
    [
        (45, "45 s"),
        (14 * 60, "14 min"),
        (7800, "2 h 10 min"),
        (17 * 3600, "17 h 0 min"),
        (3 * 86400 + 4 * 3600, "3 d 4 h"),
    ],
)
def test_durations_read_as_a_person_says_them(seconds, words):
    assert duration_words(seconds) == words


def test_step_times_keep_three_figures():
    assert (step_time_words(1.5612), step_time_words(0.01234)) == ("1.56 s", "12.3 ms")


class Clock:
    """Seconds that move only when told."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def steps(timer: StepTimer, clock: Clock, first: int, last: int, seconds: float) -> None:
    for step in range(first, last + 1):
        clock.now += seconds
        timer.on_step(SimpleNamespace(step=step, epoch=0))


def test_timer_skips_the_first_step_and_says_the_line_once():
    said, clock = [], Clock()
    timer = StepTimer("recipe r", 5000, said.append, torch.device("cpu"), clock=clock)
    steps(timer, clock, 1, 1, 30.0)  # compilation, warm-up: not counted
    steps(timer, clock, 2, 20, 1.5)
    assert said == [
        "recipe r: 5000 steps, about 2 h 5 min here at 1.5 s/step (measured over steps 2-5)"
    ]


def test_an_evaluation_inside_the_window_starts_it_again():
    said, clock = [], Clock()
    timer = StepTimer("run", 100, said.append, torch.device("cpu"), clock=clock)
    steps(timer, clock, 1, 3, 1.0)
    clock.now += 50.0  # the evaluation after step 3
    timer.on_eval({"step": 3})
    steps(timer, clock, 4, 7, 1.0)
    assert said == ["run: 100 steps, about 2 min here at 1 s/step (measured over steps 4-7)"]


def test_a_resumed_run_is_timed_from_where_it_started():
    said, clock = [], Clock()
    timer = StepTimer("run", 2000, said.append, torch.device("cpu"), clock=clock)
    steps(timer, clock, 1001, 1005, 0.5)
    assert said == [
        "run: 2000 steps (1000 left), about 8 min here at 500 ms/step "
        "(measured over steps 1002-1005)"
    ]


def test_a_run_over_before_it_is_timed_says_nothing():
    said, clock = [], Clock()
    timer = StepTimer("run", 5, said.append, torch.device("cpu"), clock=clock)
    steps(timer, clock, 1, 5, 1.0)
    assert said == []
