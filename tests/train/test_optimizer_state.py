"""Optimizer states in low precision (issue 42, item 2): optimizer.state_dtype=bf16 (AdamW's
moments stored in BF16, updated in FP32) and torchao's low-bit AdamW (optimizer=adamw8bit, ...),
counted by the memory accounting, named in the report, refused in one line when they cannot run.
Bit-for-bit resume: tests/train/test_checkpoint.py::test_low_precision_optimizer_states_resume_bit_for_bit."""

from __future__ import annotations

import sys

import pytest
import torch
from support.runs import run_cli, tiny_run
from support.runs import train as run_train

from mptrain.config.base import ConfigError
from mptrain.report.schema import load_report
from mptrain.train.build import prepare_run
from mptrain.train.loop import UpdateProbe
from mptrain.train.memory import account_step
from mptrain.train.optim import AdamWLowState

WIDE = "model.hidden_sizes=[512,512]"  # most parameters in tensors torchao quantizes (>= 4096)


def states(*overrides: str) -> dict[str, int]:
    return account_step(prepare_run(tiny_run(*overrides)))["bytes"]["optimizer_states"]


def test_bf16_states_halve_the_moments_bytes():
    fp32, bf16 = states(), states("optimizer.state_dtype=bf16")
    counters = 4 * len(list(prepare_run(tiny_run()).model.parameters()))  # one FP32 step each
    assert fp32 == {"float32": 2 * bf16["bfloat16"] + counters}
    assert bf16 == {"bfloat16": bf16["bfloat16"], "float32": counters}


def test_bf16_states_train_like_fp32_states(tmp_path):
    """Same data, same seed: the moments' rounding moves the final loss by little."""
    fp32 = run_train(tiny_run("max_steps=40"), tmp_path / "fp32")
    bf16 = run_train(tiny_run("max_steps=40", "optimizer.state_dtype=bf16"), tmp_path / "bf16")
    a, b = (r["evaluation"]["final_val_loss"] for r in (fp32, bf16))
    assert abs(a - b) < 0.02 * a, (a, b)


def test_stochastic_rounding_of_the_states_is_unbiased_and_seeded():
    """A moment between two BF16 values is stored as either, in proportion (nearest: always the
    nearer); the same seed draws the same roundings."""
    p = torch.nn.Parameter(torch.zeros(20000))
    p.grad = torch.full_like(p, 1.0 + 2**-9)  # exp_avg = 0.1 x this: between two BF16 values
    stored = []
    for _ in range(2):
        torch.manual_seed(0)
        opt = AdamWLowState([{"params": [p]}], 0.0, (0.9, 0.999), 1e-8, 0.0, stochastic=True)
        opt.step()
        stored.append(opt.state[p]["exp_avg"])
    assert torch.equal(stored[0], stored[1])
    exact = 0.1 * p.grad[0].item()
    assert abs(stored[0].float().mean().item() - exact) < 1e-5 * exact * 50
    assert len(set(stored[0].float().tolist())) == 2  # both neighbours drawn


def probe_second_step(optimizer_class, **kwargs) -> dict[str, float]:
    """Step once with unit gradients (the moments exist), then probe a step whose squared
    gradient is 1.5x ``exp_avg_sq``: its update moves ``exp_avg_sq`` by 0.05%, under half a BF16
    spacing (0.2-0.4%) and far over FP32's; a quarter of the gradients are zero."""
    p = torch.nn.Parameter(torch.zeros(4000))
    opt = optimizer_class([p], lr=1e-3, **kwargs)
    p.grad = torch.ones_like(p)
    opt.step()
    grad = (1.5 * opt.state[p]["exp_avg_sq"].float()).sqrt()
    grad[:1000] = 0.0
    p.grad = grad
    probe = UpdateProbe([p], optimizer=opt)
    opt.step()
    return probe.states_lost_fraction()


def test_the_probe_sees_bf16_moments_lose_the_updates_fp32_moments_keep():
    fp32 = probe_second_step(torch.optim.AdamW)
    bf16 = probe_second_step(
        lambda params, lr: AdamWLowState([{"params": params}], lr, (0.9, 0.999), 1e-8, 0.0)
    )
    assert fp32 == {"exp_avg": 0.0, "exp_avg_sq": 0.0}
    # exp_avg moves by ~60% (0.1 -> ~0.04): kept in BF16 too; exp_avg_sq's 0.05% is rounded
    # away on every element that had a gradient (the zero ones are not counted).
    assert bf16 == {"exp_avg": 0.0, "exp_avg_sq": 1.0}


def test_the_probe_leaves_out_parameters_on_their_first_step_and_step_counters():
    p = torch.nn.Parameter(torch.zeros(10))
    p.grad = torch.ones_like(p)
    opt = torch.optim.AdamW([p])
    probe = UpdateProbe([p], optimizer=opt)
    opt.step()
    assert probe.states_lost_fraction() == {}
    p.grad = torch.ones_like(p)
    probe = UpdateProbe([p], optimizer=opt)
    opt.step()
    assert set(probe.states_lost_fraction()) == {"exp_avg", "exp_avg_sq"}


def test_the_probe_compares_each_parameters_own_elements():
    """Two parameters, the first without state yet (its first step): only the second's state is
    compared, against the second's gradients (a wrong slice of the gradient mask would not even
    have the state's length)."""
    fresh, stale = torch.nn.Parameter(torch.zeros(10)), torch.nn.Parameter(torch.zeros(4000))
    opt = AdamWLowState([{"params": [fresh, stale]}], 1e-3, (0.9, 0.999), 1e-8, 0.0)
    stale.grad = torch.ones_like(stale)
    opt.step()  # fresh has no gradient: no state
    grad = (1.5 * opt.state[stale]["exp_avg_sq"].float()).sqrt()
    grad[:1000] = 0.0
    fresh.grad, stale.grad = torch.ones_like(fresh), grad
    probe = UpdateProbe([fresh, stale], optimizer=opt)
    assert [i for i, _ in probe.states_before["exp_avg_sq"]] == [1]
    opt.step()
    assert probe.states_lost_fraction() == {"exp_avg": 0.0, "exp_avg_sq": 1.0}


def test_the_report_gives_each_states_lost_updates(tmp_path):
    report = run_train(
        tiny_run("max_steps=6", "probe_every=2", "optimizer.state_dtype=bf16"), tmp_path
    )
    lost = load_report(tmp_path).training.states_lost_fraction
    assert set(lost) == {"exp_avg", "exp_avg_sq"} and lost["exp_avg_sq"] > lost["exp_avg"], lost
    assert report["training"]["states_lost_fraction"] == lost


def test_the_report_names_the_state_dtypes(tmp_path):
    run_train(tiny_run("optimizer.state_dtype=bf16"), tmp_path)
    assert load_report(tmp_path).optimizer.state_dtypes == ["bfloat16"]


@pytest.mark.slow  # torchao compiles its optimizer step: ~20 s on a CPU
def test_adamw8bit_cuts_the_states_by_more_than_3_5x(tmp_path):
    pytest.importorskip("torchao")
    fp32 = sum(states(WIDE).values())
    int8 = states(WIDE, "optimizer=adamw8bit")
    assert "uint8" in int8 and fp32 / sum(int8.values()) >= 3.5, (fp32, int8)
    run_train(tiny_run(WIDE, "optimizer=adamw8bit", "max_steps=3"), tmp_path)
    assert load_report(tmp_path).optimizer.state_dtypes == ["float32", "uint8"]


def test_an_unknown_state_dtype_is_refused_in_one_line(tmp_path, monkeypatch):
    result = run_cli(["optimizer.state_dtype=fp16"], tmp_path, monkeypatch)
    assert result.code == 2 and not result.launched
    assert (
        result.stderr.strip() == "mptrain: error: optimizer.state_dtype='fp16': one of fp32, bf16"
    )


def test_adamw8bit_without_torchao_is_refused_in_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.optim", None)  # import torchao.optim fails
    with pytest.raises(ConfigError, match=r"^optimizer=adamw8bit: needs torchao, which is not"):
        prepare_run(tiny_run("optimizer=adamw8bit"))
