"""The AMP loop: skipped steps, scale growth, clipping after unscale, accumulation, FP32 state."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import warnings

import pytest
import torch
from support.runs import tiny_run

import mptrain.train.loop
import mptrain.train.optim
from mptrain.config.run import RunConfig
from mptrain.platform.distributed import DistContext
from mptrain.precision.policy import PrecisionPolicy, resolve_precision
from mptrain.train.build import build_run, resolve_run
from mptrain.train.loop import LoopHooks, UpdateProbe, clear_grads, gradient_norm, train_loop
from mptrain.train.state import LoopState

CPU = torch.device("cpu")


class StepRecorder:
    """Observer keeping, after every step, the parameters, optimizer state, lr and scale."""

    def __init__(self, components) -> None:
        self.parts = components
        self.after: dict[int, dict] = {}
        self.log_rows: list[dict] = []

    def on_step(self, state: LoopState) -> None:
        opt = self.parts.optimizer
        self.after[state.step] = {
            "params": [p.detach().clone() for p in self.parts.model.parameters()],
            "opt_state": [
                {k: v.clone() if torch.is_tensor(v) else v for k, v in opt.state[p].items()}
                for p in self.parts.model.parameters()
                if p in opt.state
            ],
            "lr": opt.param_groups[0]["lr"],
            "scale": self.parts.precision.scaler.get_scale()
            if self.parts.precision.loss_scaling
            else None,
            "grads": [p.grad for p in self.parts.model.parameters()],
        }

    def on_log(self, row: dict) -> None:
        self.log_rows.append(row)

    def on_eval(self, row: dict) -> None:
        pass

    def on_warning(self, message: str) -> None:
        self.warnings = [*getattr(self, "warnings", []), message]


def run_loop(cfg: RunConfig, policy: PrecisionPolicy | None = None):
    """Build the run (with ``policy`` instead of the resolved one) and train it;
    returns (state, recorder, run)."""
    device, resolved, tf32 = resolve_run(cfg, DistContext())
    run = build_run(cfg, device, policy or resolved, tf32, DistContext())
    recorder = StepRecorder(run)
    train_loop(run, LoopHooks(observers=(recorder,)))
    return run.state, recorder, run


def tensors_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def use_implementation(monkeypatch, implementation: str) -> None:
    """Build optimizers ``fused`` (they take the inf flag on the device) or ``foreach`` (the loop
    skips them on the host; what FSDP runs)."""
    monkeypatch.setattr(
        mptrain.train.optim, "_implementation", lambda fused: {implementation: True}
    )


@pytest.mark.parametrize("implementation", ["fused", "foreach"])
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_inf_gradient_skips_the_step_and_halves_the_scale(monkeypatch, optimizer, implementation):
    use_implementation(monkeypatch, implementation)
    cfg = tiny_run(
        f"optimizer={optimizer}",
        "precision=fp16",
        "max_steps=6",
        "scheduler=cosine",
        "scheduler.warmup_epochs=0.1",
        "debug.inject_inf_grad_steps=[3]",
    )
    state, rec, run = run_loop(cfg)

    assert mptrain.train.optim.optimizer_implementation(run.optimizer) == implementation
    assert state.skipped_steps == [3]
    before, during, after = rec.after[2], rec.after[3], rec.after[4]
    assert tensors_equal(during["params"], before["params"]), "skipped step changed parameters"
    for s_before, s_during in zip(before["opt_state"], during["opt_state"], strict=True):
        for key in s_before:
            assert torch.equal(torch.as_tensor(s_before[key]), torch.as_tensor(s_during[key]))
    assert during["lr"] == before["lr"], "the scheduler advanced on a skipped step"
    assert after["lr"] != during["lr"], "the scheduler stopped advancing after the skip"
    assert during["scale"] == before["scale"] * 0.5
    assert not tensors_equal(after["params"], during["params"]), "training did not resume"
    scale = run.monitor.scale_stats
    assert scale.backoffs == 1 and scale.changes == [(3, before["scale"] * 0.5)]


@pytest.mark.parametrize("implementation", ["fused", "foreach"])
def test_skip_on_first_step_does_not_trigger_scheduler_order_warning(monkeypatch, implementation):
    use_implementation(monkeypatch, implementation)
    cfg = tiny_run("precision=fp16", "max_steps=3", "debug.inject_inf_grad_steps=[1]")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state, _, _ = run_loop(cfg)
    assert state.skipped_steps == [1]
    messages = [str(w.message) for w in caught]
    assert not any("lr_scheduler.step()" in m for m in messages), messages


def test_scale_grows_after_growth_interval_clean_steps():
    cfg = tiny_run(
        "precision=fp16",
        "max_steps=7",
        "precision.scaler.init_scale=1024",
        "precision.scaler.growth_interval=3",
    )
    state, rec, run = run_loop(cfg)
    assert state.skipped_steps == []
    assert [rec.after[s]["scale"] for s in range(1, 8)] == [
        1024,
        1024,
        2048,
        2048,
        2048,
        4096,
        4096,
    ]
    scale = run.monitor.scale_stats
    assert scale.growths == 2 and scale.final == 4096 and scale.max == 4096


def test_clipping_after_unscale_equals_fp32_clipping():
    """With a 2^16 loss scale the clipped update must equal the unscaled FP32 one."""
    cfg = tiny_run("precision=fp32", "max_steps=3", "clip_grad_norm=0.05", "log_every=1")
    reference_state, reference, _ = run_loop(cfg)
    scaled_policy = dataclasses.replace(
        resolve_precision(cfg.precision, CPU),
        loss_scaling=True,
        scaler=dataclasses.replace(cfg.precision.scaler, init_scale=2.0**16),
    )
    scaled_state, scaled, _ = run_loop(cfg, scaled_policy)

    assert scaled.after[1]["scale"] == 2.0**16
    for step in (1, 2, 3):
        for p_ref, p_scaled in zip(
            reference.after[step]["params"], scaled.after[step]["params"], strict=True
        ):
            torch.testing.assert_close(p_scaled, p_ref, rtol=1e-6, atol=1e-7)
    # The logged norm is the unscaled pre-clip norm, identical in both runs.
    for row_ref, row_scaled in zip(reference.log_rows, scaled.log_rows, strict=True):
        assert math.isclose(row_ref["grad_norm"], row_scaled["grad_norm"], rel_tol=1e-5)
        assert row_ref["grad_norm"] > 0.05  # clipping was active
    assert reference_state.skipped_steps == scaled_state.skipped_steps == []


def test_accumulation_matches_one_large_batch_in_fp32():
    common = ("precision=fp32", "max_steps=5", "scheduler=constant", "optimizer=sgd")
    state_acc, accumulated, _ = run_loop(tiny_run(*common, "batch_size=8", "grad_accum_steps=4"))
    state_big, big, _ = run_loop(tiny_run(*common, "batch_size=32", "grad_accum_steps=1"))

    assert state_acc.samples_seen == state_big.samples_seen == 5 * 32
    for step in range(1, 6):
        for p_acc, p_big in zip(
            accumulated.after[step]["params"], big.after[step]["params"], strict=True
        ):
            torch.testing.assert_close(p_acc, p_big, rtol=1e-5, atol=1e-6)
    assert not tensors_equal(accumulated.after[5]["params"], accumulated.after[1]["params"])


def test_parameters_and_optimizer_state_stay_fp32_in_mixed_precision():
    for precision in ("fp16", "bf16"):
        _, rec, parts = run_loop(tiny_run(f"precision={precision}", "max_steps=3"))
        assert all(p.dtype == torch.float32 for p in parts.model.parameters()), precision
        states = rec.after[3]["opt_state"]
        assert states, "optimizer state was not created"
        for state in states:
            for key, value in state.items():
                if torch.is_tensor(value) and value.is_floating_point() and key != "step":
                    assert value.dtype == torch.float32, (precision, key, value.dtype)


def test_clear_grads_frees_the_optimizer_gradients_like_zero_grad():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    frozen = model[1].bias  # not in the optimizer: zero_grad() leaves it alone, and so must we
    groups = [{"params": [model[0].weight]}, {"params": [model[0].bias, model[1].weight]}]
    optimizer = torch.optim.SGD(groups, lr=0.1)
    model(torch.randn(5, 4)).sum().backward()

    clear_grads(optimizer)

    assert [p.grad for g in groups for p in g["params"]] == [None, None, None]
    assert frozen.grad is not None


def test_every_step_ends_with_gradients_freed():
    for extra in ("grad_accum_steps=1", "grad_accum_steps=3"):
        _, rec, _ = run_loop(tiny_run("precision=fp16", "max_steps=3", extra))
        assert all(g is None for after in rec.after.values() for g in after["grads"]), extra


def test_gradient_reduction_is_skipped_on_every_micro_batch_but_the_last(monkeypatch):
    calls = []

    def recording_no_sync(model):
        calls.append(model)
        return contextlib.nullcontext()

    monkeypatch.setattr(mptrain.train.loop, "no_sync", recording_no_sync)
    run_loop(tiny_run("precision=fp32", "max_steps=2", "grad_accum_steps=3"))
    assert len(calls) == 2 * 2  # micro-batches 1 and 2 of 3, in each of the 2 steps

    calls.clear()
    run_loop(tiny_run("precision=fp32", "max_steps=2", "grad_accum_steps=1"))
    assert calls == []


def test_gradient_norm_is_fp32_l2_norm():
    model = torch.nn.Linear(3, 2)
    model.weight.grad = torch.full((2, 3), 2.0)
    model.bias.grad = torch.tensor([1.0, 1.0])
    assert math.isclose(
        float(gradient_norm(model.parameters())), math.sqrt(6 * 4 + 2), rel_tol=1e-6
    )


def test_gradient_norm_of_bf16_gradients_is_accumulated_in_fp32():
    model = torch.nn.Linear(256, 256, bias=False).to(torch.bfloat16)
    model.weight.grad = torch.full((256, 256), 0.01, dtype=torch.bfloat16)
    norm = gradient_norm(model.parameters())
    assert norm.dtype == torch.float32
    expected = 256 * float(torch.tensor(0.01, dtype=torch.bfloat16))
    assert math.isclose(float(norm), expected, rel_tol=1e-5)


def test_update_probe_counts_zero_gradients_and_updates_rounded_away():
    """bf16 parameters at 1.0 (spacing 2**-7 above, 2**-8 below): an SGD update of 1e-4 rounds
    away, one of 0.5 does not; zero gradients and a parameter without a gradient count as zero."""
    weight = torch.nn.Parameter(torch.ones(8, dtype=torch.bfloat16))
    unused = torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
    weight.grad = torch.tensor([0, 0, 1e-4, 1e-4, 1e-4, 0.5, 0.5, float("nan")]).bfloat16()
    probe = UpdateProbe([weight, unused])
    assert probe.zero_grad_fraction() == 1 - 6 / 10
    with torch.no_grad():
        weight -= weight.grad  # lr 1: 3 updates of 1e-4 are lost; 0.5 and NaN change the value
    assert math.isclose(probe.updates_lost_fraction(), 3 / 6)


def test_update_probe_without_gradients():
    probe = UpdateProbe([torch.nn.Parameter(torch.ones(3))])
    assert probe.zero_grad_fraction() == 1.0
    assert probe.updates_lost_fraction() == 0.0


def test_eval_every_and_logging_rows():
    cfg = tiny_run("precision=bf16", "max_steps=9", "eval_every=4", "log_every=3")
    state, rec, run = run_loop(cfg)
    assert [e["step"] for e in state.evals] == [4, 8, 9]
    assert [r["step"] for r in rec.log_rows] == [3, 6, 9]
    assert all(0.0 <= e["val_accuracy"] <= 1.0 for e in state.evals)
    throughput = run.monitor.throughput
    assert throughput.measured_steps == 9 - 2  # throughput_warmup_steps=2
    assert throughput.samples_per_s and throughput.samples_per_s > 0


def test_row_samples_per_s_counts_training_time_only(monkeypatch):
    """A fake clock that moves 1 s per training step and 1000 s per evaluation: every row must
    read exactly batch_size samples/s, though evaluations fall between rows."""
    import mptrain.train.loop as loop

    clock = [0.0]
    take_step, evaluate = loop.take_step, loop.evaluate

    def step_then_tick(*args, **kwargs):
        result = take_step(*args, **kwargs)
        clock[0] += 1.0
        return result

    def evaluate_then_tick(*args, **kwargs):
        result = evaluate(*args, **kwargs)
        clock[0] += 1000.0
        return result

    monkeypatch.setattr(loop.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(loop, "take_step", step_then_tick)
    monkeypatch.setattr(loop, "evaluate", evaluate_then_tick)
    cfg = tiny_run("precision=fp32", "max_steps=12", "log_every=6", "eval_every=3")
    _, rec, run = run_loop(cfg)
    assert [r["step"] for r in rec.log_rows] == [6, 12]
    assert [r["samples_per_s"] for r in rec.log_rows] == [cfg.batch_size] * 2
    assert run.monitor.throughput.samples_per_s == cfg.batch_size
