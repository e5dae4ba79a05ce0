"""scheduler.warmup_steps (issue 39, item 9): warm-up existed only in epochs, even for
step-based task=lm runs; Hugging Face's warmup_steps is the same setting."""

from __future__ import annotations

import pytest
from support.runs import compose_run, tiny_run

from mptrain.config.base import ConfigError
from mptrain.config.optim import SchedulerConfig
from mptrain.train.optim import lr_factor_fn


def test_warm_up_over_steps_then_the_schedule():
    cfg = SchedulerConfig(name="constant", warmup_steps=4, warmup_start_factor=0.2)
    factor = lr_factor_fn(cfg, steps_per_epoch=1000, total_steps=50)
    assert [factor(step) for step in range(6)] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0, 1.0])


def test_steps_or_epochs_give_the_same_schedule_for_the_same_length():
    by_steps = lr_factor_fn(SchedulerConfig(warmup_steps=43), 430, 2000)
    by_epochs = lr_factor_fn(SchedulerConfig(warmup_epochs=0.1), 430, 2000)
    assert [by_steps(s) for s in range(0, 2000, 7)] == [by_epochs(s) for s in range(0, 2000, 7)]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["scheduler.warmup_steps=-1"], r"^scheduler\.warmup_steps=-1: must be >= 0$"),
        (
            ["scheduler.warmup_steps=10", "scheduler.warmup_epochs=0.5"],
            r"^scheduler\.warmup_steps=10: give the warm-up in steps or in epochs, not both",
        ),
    ],
)
def test_bad_warm_ups_are_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message):
        tiny_run(*overrides)


def test_the_lm_recipe_warms_up_in_steps():
    cfg = compose_run("recipe=lm_stdlib_cpu", "device=cpu")
    assert (cfg.scheduler.warmup_steps, cfg.scheduler.warmup_epochs) == (43, 0.0)
