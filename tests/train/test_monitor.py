"""The monitor (measurements, health, saved state) and the fault injection installed at build time,
tested directly on built runs."""

from __future__ import annotations

import math
import time

import torch
from support.observers import PerStep
from support.runs import tiny_run

from mptrain.checkpoint.checkpointer import Checkpointer
from mptrain.train import loop
from mptrain.train.build import prepare_run
from mptrain.train.loop import LoopHooks, train_loop
from mptrain.train.monitor import StepOutcome

# The keys a checkpoint's "loop" entry has always held: old checkpoints must keep loading.
LOOP_PAYLOAD_KEYS = {
    "step",
    "epoch",
    "samples_seen",
    "skipped_steps",
    "evals",
    "last_train_loss",
    "scale",
    "health",
    "probes",
}


def test_monitor_state_round_trips_into_a_fresh_run():
    cfg = tiny_run(
        "precision=fp16", "max_steps=6", "probe_every=2", "debug.inject_inf_grad_steps=[2]"
    )
    run = prepare_run(cfg)
    train_loop(run)
    saved = run.monitor.state_dict()

    fresh = prepare_run(cfg)
    fresh.monitor.load_state_dict(saved)
    assert fresh.monitor.scale_stats == run.monitor.scale_stats
    assert fresh.monitor.scale_stats.backoffs == 1
    assert fresh.monitor.probes == run.monitor.probes and run.monitor.probes.probes == 3
    assert fresh.monitor.health.recent_skips == run.monitor.health.recent_skips
    assert (
        fresh.monitor.health.settings is cfg.numerics
        or fresh.monitor.health.settings == cfg.numerics
    )


def test_checkpoint_loop_payload_keeps_its_keys(tmp_path):
    run = prepare_run(tiny_run("precision=fp16", "max_steps=2"))
    train_loop(run)
    payload = Checkpointer(tmp_path, run, {"sig": 1}).payload(run.state)
    assert set(payload["loop"]) == LOOP_PAYLOAD_KEYS


def test_throughput_counts_only_steps_after_warm_up():
    run = prepare_run(tiny_run("precision=fp32", "max_steps=7"))  # throughput_warmup_steps=2
    train_loop(run)
    throughput = run.monitor.throughput
    assert throughput.measured_steps == 5
    assert throughput.measured_samples == 5 * run.monitor.settings.samples_per_step
    assert throughput.measured_time_s > 0 and 0 <= throughput.data_wait_fraction < 1


def test_throughput_windows_are_whole_measured_log_intervals_without_evaluation(monkeypatch):
    evaluate = loop._evaluate_into

    def slow_evaluation(run, state):  # 0.3 s of evaluation the windows must not count
        time.sleep(0.3)
        evaluate(run, state)

    monkeypatch.setattr(loop, "_evaluate_into", slow_evaluation)
    run = prepare_run(tiny_run("max_steps=13", "log_every=3", "eval_every=6"))  # warm-up 2
    started = time.perf_counter()
    train_loop(run)
    wall = time.perf_counter() - started

    throughput = run.monitor.throughput
    # Rows at steps 3 (holds warm-up steps: left out), 6, 9, 12 and 13 (the last step).
    assert [steps for steps, _ in throughput.windows] == [3, 3, 3, 1]
    assert all(seconds > 0 for _, seconds in throughput.windows)
    # The windows lie within the stopwatch's time, which leaves out the three evaluations (at
    # steps 6, 12 and 13): timing-independent, whatever else loads the machine.
    assert sum(s for _, s in throughput.windows) <= throughput.measured_time_s <= wall - 0.9


def test_non_finite_loss_without_scaler_diverges_with_the_precision_named():
    run = prepare_run(tiny_run("precision=bf16", "max_steps=3", "log_every=1"))
    monitor = run.monitor
    monitor.begin(run.precision.scaler, run.optimizer, ())
    run.state.step = 1
    images, labels = next(iter(run.data.train.batches(0)))
    outcome = StepOutcome(
        torch.tensor(math.inf), skipped=False, scale=None, grad_norm=None, batch=(images, labels)
    )
    monitor.after_step(run.state, outcome, logged=True)
    assert monitor.diverged_reason.startswith("training loss became inf by step 1 (bf16, no loss")


def test_injection_hits_only_the_chosen_steps_with_accumulation():
    """With 3 micro-batches per step, the inf lands once per chosen step (not per micro-batch)."""
    cfg = tiny_run(
        "precision=fp16", "max_steps=6", "grad_accum_steps=3", "debug.inject_inf_grad_steps=[2,5]"
    )
    run = prepare_run(cfg)
    # whether each step's update was skipped, seen right after it
    recorder = PerStep(run, lambda r: r.state.skipped_steps[-1:] == [r.state.step])
    train_loop(run, LoopHooks(observers=(recorder,)))
    assert run.state.skipped_steps == [2, 5]
    assert [s for s, skipped in recorder.rows if skipped] == [2, 5]


def test_injection_counts_steps_from_a_resumed_state():
    """The injector reads the run's step count, so after a resume step 5 is still step 5."""
    cfg = tiny_run("precision=fp16", "max_steps=6", "debug.inject_inf_grad_steps=[5]")
    run = prepare_run(cfg)
    run.state.step = 3  # as restore() leaves it
    train_loop(run)
    assert run.state.skipped_steps == [5]


def test_without_debug_options_the_scaler_is_not_wrapped():
    run = prepare_run(tiny_run("precision=fp16", "max_steps=1"))
    assert "scale" not in vars(run.precision.scaler) and "unscale_" not in vars(
        run.precision.scaler
    )
