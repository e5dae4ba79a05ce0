"""Numerics diagnostics: loss-scale health, the culprit finder, the autocast audit, per-layer FP32
overrides and the FP16 range probe, in isolation and wired into real runs.

CPU-only, Linear-only models (FP16 convolutions are very slow on CPUs). Every failure is built on
purpose: a module that multiplies by 1e5 overflows FP16 in the forward, a large loss scale
overflows FP16 gradients, a 1e-6 output factor pushes gradients below FP16's smallest subnormal,
and ``debug.inject_inf_grad_steps`` makes the loss scale collapse.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import random
import subprocess
import sys
from collections import OrderedDict

import numpy as np
import pytest
import torch
from support.runs import tiny_run, train
from torch import nn

from mptrain.config.base import ConfigError
from mptrain.config.sections import NumericsConfig
from mptrain.data.build import DATASETS
from mptrain.output.metrics import read_metrics
from mptrain.precision.diagnostics.audit import audit_step, render_audit
from mptrain.precision.diagnostics.culprit import find_culprit
from mptrain.precision.diagnostics.hooks import FP16_MIN_SUBNORMAL
from mptrain.precision.diagnostics.probe import range_probe, render_probe
from mptrain.precision.policy import keep_in_fp32
from mptrain.train import build as build_module
from mptrain.train.health import ScaleHealth, describe_culprit
from mptrain.train.job import RunFailed

FP16 = lambda: torch.autocast("cpu", dtype=torch.float16)  # noqa: E731
BF16 = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731
NO_AUTOCAST = contextlib.nullcontext


# ------------------------------------------------------------------------------------------ models
class Scale(nn.Module):
    """Multiplies its input by a constant (in the input's dtype: FP16 stays FP16)."""

    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


class SqrtOfNegative(nn.Module):
    """NaN from finite inputs: sqrt(-|x| - 1)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(-x.abs() - 1)


def blowup_mlp(in_features: int = 16, classes: int = 10) -> nn.Module:
    """Linear -> x1e5 -> ReLU -> Linear, with the multiplier at the qualified name body.blowup."""
    body = nn.Sequential(
        OrderedDict(fc1=nn.Linear(in_features, 32), blowup=Scale(1e5), act=nn.ReLU())
    )
    return nn.Sequential(OrderedDict(flat=nn.Flatten(), body=body, head=nn.Linear(32, classes)))


def plain_mlp(in_features: int = 16, classes: int = 10) -> nn.Module:
    return nn.Sequential(
        OrderedDict(
            fc1=nn.Linear(in_features, 32),
            act1=nn.ReLU(),
            fc2=nn.Linear(32, 32),
            act2=nn.ReLU(),
            head=nn.Linear(32, classes),
        )
    )


def batch(n: int = 8, features: int = 16, classes: int = 10, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, features, generator=g), torch.randint(0, classes, (n,), generator=g)


def snapshot(model: nn.Module) -> dict:
    """Parameters, buffers, grads, training flag and every RNG state, for before/after checks."""
    return {
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "grads": {
            n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()
        },
        "training": model.training,
        "torch_rng": torch.get_rng_state(),
        "np_rng": np.random.get_state()[1].copy(),
        "py_rng": random.getstate(),
    }


def assert_unchanged(before: dict, after: dict) -> None:
    assert before["state"].keys() == after["state"].keys()
    for key, value in before["state"].items():
        assert torch.equal(value, after["state"][key]), f"{key} changed"
    assert before["grads"].keys() == after["grads"].keys()
    for name, grad in before["grads"].items():
        other = after["grads"][name]
        assert (grad is None) == (other is None), f"grad of {name} changed"
        if grad is not None:
            assert torch.equal(grad, other), f"grad of {name} changed"
    assert before["training"] == after["training"]
    assert torch.equal(before["torch_rng"], after["torch_rng"]), "torch RNG state changed"
    assert np.array_equal(before["np_rng"], after["np_rng"]), "numpy RNG state changed"
    assert before["py_rng"] == after["py_rng"], "python RNG state changed"


# ------------------------------------------------------------------------------- culprit finder
def test_forward_overflow_is_named_at_the_multiplying_module_and_state_is_untouched():
    torch.manual_seed(0)
    model = nn.Sequential(
        OrderedDict(
            norm=nn.BatchNorm1d(16),  # buffers that a forward in train mode would update
            body=blowup_mlp().body,
            drop=nn.Dropout(0.5),  # consumes the torch RNG
            head=nn.Linear(32, 10),
        )
    )
    x, y = batch()
    # Pre-existing gradients must survive the diagnostic's own backward/zero_grad.
    nn.functional.cross_entropy(model(x), y).backward()
    before = snapshot(model)

    culprit = find_culprit(model, x, y, FP16)

    assert_unchanged(before, snapshot(model))
    fwd = culprit["forward"]
    assert fwd["module"] == "body.blowup" and fwd["module_type"] == "Scale"
    assert fwd["dtype"] == "float16"
    assert "overflow" in fwd["kind"] and "65504" in fwd["kind"] and "BF16" in fwd["kind"]
    assert math.isfinite(fwd["largest_finite_before"]) and 0 < fwd["largest_finite_before"] < 1e3
    assert culprit["backward"] is None  # no backward after a non-finite forward
    text = describe_culprit(culprit)
    assert text.startswith("forward:") and "body.blowup" in text and "Scale" in text

    # BF16 has FP32's range: 1e5 x O(1) is fine, nothing to name, state still untouched.
    assert find_culprit(model, x, y, BF16) is None
    assert_unchanged(before, snapshot(model))


def test_nan_from_finite_inputs_is_an_invalid_operation():
    torch.manual_seed(0)
    model = nn.Sequential(
        OrderedDict(fc=nn.Linear(16, 16), bad=SqrtOfNegative(), head=nn.Linear(16, 10))
    )
    x, y = batch()
    for autocast, dtype in ((NO_AUTOCAST, "float32"), (FP16, "float16")):
        fwd = find_culprit(model, x, y, autocast)["forward"]
        assert fwd["module"] == "bad" and fwd["dtype"] == dtype
        assert fwd["kind"].startswith("invalid operation"), fwd["kind"]
        assert "overflow" not in fwd["kind"]


def grad_amplifier(factor: float = 3000.0) -> nn.Module:
    """Finite forward; in backward the head's FP16 output gradient is ``factor`` x the logits'.

    The logits' gradient is at most loss_scale / batch (cross-entropy, mean), so with a batch of 64
    the head's FP16 output gradient overflows (> 65504) at a loss scale of 2048 (and above) but
    never at 1024. The 1e-4 input factor keeps weight gradients small; no bias, so no bias gradient
    sums the amplified values over the batch.
    """
    return nn.Sequential(
        OrderedDict(
            flat=nn.Flatten(),
            shrink=Scale(1e-4),
            head=nn.Linear(64, 10, bias=False),
            amp=Scale(factor),
        )
    )


def test_backward_overflow_is_named_at_the_module_whose_output_gradient_overflowed():
    torch.manual_seed(0)
    model = grad_amplifier()
    x, y = batch(n=64, features=64)
    before = snapshot(model)

    culprit = find_culprit(model, x, y, FP16, loss_scale=2048.0)

    assert_unchanged(before, snapshot(model))
    assert culprit["forward"] is None and math.isfinite(culprit["loss"])
    bwd = culprit["backward"]
    assert bwd["module"] == "head" and bwd["module_type"] == "Linear"
    assert bwd["dtype"] == "float16"
    assert culprit["loss_scale"] == 2048.0
    text = describe_culprit(culprit)
    assert text.startswith("backward:") and "head" in text and "2048" in text
    # Half the scale: no overflow; the same batch under BF16: none either.
    assert find_culprit(model, x, y, FP16, loss_scale=1024.0) is None
    assert find_culprit(model, x, y, BF16, loss_scale=2048.0) is None
    assert "did not reproduce" in describe_culprit(None)


def test_nan_that_came_with_the_batch_is_blamed_on_the_batch_not_the_first_module():
    model = plain_mlp()
    x, y = batch()
    x[2, 5], x[3, 0], x[3, 1] = float("nan"), float("inf"), float("nan")
    before = snapshot(model)

    culprit = find_culprit(model, x, y, FP16)

    assert_unchanged(before, snapshot(model))
    assert culprit["input"] == {
        "tensor": "inputs",
        "dtype": "float32",
        "nonfinite": 3,
        "nan": 2,
        "inf": 1,
        "values": 128,
    }
    assert culprit["forward"] is None and culprit["backward"] is None
    text = describe_culprit(culprit)
    assert text.startswith("the input batch is not finite: 3 of 128 values of its inputs (float32)")
    assert "fc1" not in text and "Linear" not in text
    assert find_culprit(model, *batch(), FP16) is None  # a finite batch: back to the modules


def test_culprit_finder_sees_a_weight_gradient_overflow():
    lin = nn.Linear(16, 10)
    with torch.no_grad():
        lin.weight.mul_(1e-3)
        lin.bias.zero_()
    x = torch.full((64, 16), 100.0)
    y = torch.zeros(64, dtype=torch.long)
    # The overflow is real: the same forward + backward leaves an inf weight gradient.
    with FP16():
        out = lin(x)
    assert bool(torch.isfinite(out).all())
    (nn.functional.cross_entropy(out.float(), y) * 2048.0).backward()
    assert not bool(torch.isfinite(lin.weight.grad).all())
    lin.zero_grad(set_to_none=True)

    assert find_culprit(lin, x, y, FP16, loss_scale=2048.0) is not None


def test_nan_parameters_are_not_called_an_invalid_operation():
    model = plain_mlp()
    with torch.no_grad():
        model.fc2.weight[0, 0] = math.nan
    x, y = batch()
    fwd = find_culprit(model, x, y, NO_AUTOCAST)["forward"]
    assert fwd["module"] == "fc2"
    assert "invalid operation" not in fwd["kind"]
    assert "param" in fwd["kind"].lower() or "weight" in fwd["kind"].lower()


class OverflowingBlock(nn.Module):
    """The overflow happens in the block's own forward body (like attention scores), not a leaf."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(16, 32)
        self.out = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.inner(x) * 1e5)


def test_overflow_inside_a_container_forward_is_not_blamed_on_the_next_leaf():
    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict(block=OverflowingBlock(), head=nn.Linear(32, 10)))
    x, y = batch()
    fwd = find_culprit(model, x, y, FP16)["forward"]
    assert fwd["module"] == "block", fwd


# ---------------------------------------------------------------------------- loss-scale health
def health(**overrides) -> ScaleHealth:
    return ScaleHealth(NumericsConfig(**overrides))


def test_consecutive_backoffs_warn_exactly_once():
    h = health(warn_consecutive_backoffs=3, warn_window=1000)
    scale, raised = 65536.0, {}
    for step in range(1, 9):
        scale /= 2
        raised[step] = h.observe(step, skipped=True, scale=scale, grew=False, loss_finite=True)
    assert [s for s, w in raised.items() if w] == [3]
    assert len(raised[3]) == 1 and "3 times in a row" in raised[3][0]
    assert [(w["kind"], w["step"]) for w in h.warnings] == [("consecutive_backoffs", 3)]
    assert h.diverged is None  # 256 is still far above the minimum of 1


def test_a_growth_resets_the_backoff_count():
    h = health(warn_consecutive_backoffs=3, warn_window=1000)
    pattern = [(True, False), (True, False), (False, True), (True, False), (True, False)]
    for step, (skipped, grew) in enumerate(pattern, start=1):
        assert h.observe(step, skipped, 1024.0, grew, True) == []
    assert h.consecutive_backoffs == 2
    assert h.observe(6, True, 512.0, False, True) != []


def test_skip_rate_warns_once_when_above_threshold():
    # One skip in three: 30% of a 20-step window, above 25%. Backoff warnings kept out of the way.
    h = health(warn_consecutive_backoffs=10_000, warn_skip_rate=0.25, warn_window=20)
    raised = {step: h.observe(step, step % 3 == 0, 1024.0, False, True) for step in range(1, 61)}
    assert [s for s, w in raised.items() if w] == [20]  # measured once the window is full
    assert "30%" in raised[20][0] and "25%" in raised[20][0]
    assert [w["kind"] for w in h.warnings] == ["skip_rate"]

    # One skip in four is 25%: not above the threshold, no warning.
    calm = health(warn_consecutive_backoffs=10_000, warn_skip_rate=0.25, warn_window=20)
    assert not any(calm.observe(s, s % 4 == 0, 1024.0, False, True) for s in range(1, 61))
    assert calm.warnings == []


def test_skip_rate_window_of_one_step():
    h = health(warn_consecutive_backoffs=10_000, warn_skip_rate=0.5, warn_window=1)
    for step in range(1, 4):
        h.observe(step, False, 1024.0, False, True)
    assert h.observe(4, True, 512.0, False, True), "the last (only) step of the window was skipped"
    assert len(h.recent_skips) == 1


def test_scale_at_minimum_on_a_skipped_step_is_a_collapse():
    h = health(min_loss_scale=1.0)
    h.observe(1, skipped=False, scale=1.0, grew=False, loss_finite=True)
    assert h.diverged is None  # at the minimum without a skip: nothing wrong yet
    h.observe(2, skipped=True, scale=2.0, grew=False, loss_finite=True)
    assert h.diverged is None
    h.observe(3, skipped=True, scale=1.0, grew=False, loss_finite=True)
    assert h.diverged and "collapsed" in h.diverged and "bf16" in h.diverged
    assert "step 3" in h.diverged

    higher = health(min_loss_scale=1024.0)
    higher.observe(1, skipped=True, scale=1024.0, grew=False, loss_finite=True)
    assert higher.diverged and "collapsed to 1024" in higher.diverged


def test_consecutive_nonfinite_losses_diverge_and_are_counted_apart_from_skips():
    h = health(max_consecutive_nonfinite_loss=3, warn_consecutive_backoffs=100)
    # Skipped steps with a finite loss (gradient overflow) are not non-finite losses.
    h.observe(1, skipped=True, scale=32768.0, grew=False, loss_finite=True)
    h.observe(2, skipped=True, scale=16384.0, grew=False, loss_finite=False)
    h.observe(3, skipped=True, scale=8192.0, grew=False, loss_finite=False)
    h.observe(4, skipped=False, scale=8192.0, grew=False, loss_finite=True)  # resets the run
    assert h.diverged is None
    for step in (5, 6):
        h.observe(step, skipped=True, scale=4096.0, grew=False, loss_finite=False)
        assert h.diverged is None
    h.observe(7, skipped=True, scale=2048.0, grew=False, loss_finite=False)
    assert h.diverged and "non-finite" in h.diverged and "3 consecutive" in h.diverged
    assert "bf16" in h.diverged and "fp32_modules" in h.diverged
    assert h.nonfinite_loss_steps == [2, 3, 5, 6, 7]
    summary = h.summary()
    assert summary["nonfinite_loss_steps"] == {"count": 5, "steps": [2, 3, 5, 6, 7]}
    assert sum(h.recent_skips) == 6  # skipped steps are counted separately: 6 of the 7


# ------------------------------------------------------------------------- end to end: collapse
ALWAYS_INF = "debug.inject_inf_grad_steps=[" + ",".join(str(s) for s in range(1, 26)) + "]"


def test_scale_collapse_stops_the_run_as_diverged(tmp_path):
    cfg = tiny_run("precision=fp16", "max_steps=40", ALWAYS_INF)
    with pytest.raises(RunFailed) as err:
        train(cfg, tmp_path)
    assert err.value.status == "diverged"

    report = json.loads((tmp_path / "report.json").read_text())
    assert report["status"] == "diverged"
    reason = report["reason"]
    assert "collapsed to 1" in reason and "bf16" in reason and "step 16" in reason
    # The injected infs are not in the batch: the re-run says honestly that it did not reproduce.
    assert "did not reproduce" in reason
    assert report["numerics"]["culprit"]["reproduced"] is False
    t = report["training"]
    assert t["steps"] == 16  # 65536 = 2^16 halves to 1 after 16 backoffs
    assert t["skipped_steps"] == {"count": 16, "steps": list(range(1, 17))}
    assert t["loss_scale"]["final"] == 1.0 and t["loss_scale"]["backoffs"] == 16
    warnings = report["numerics"]["warnings"]
    assert [(w["kind"], w["step"]) for w in warnings] == [("consecutive_backoffs", 5)]
    assert report["numerics"]["nonfinite_loss_steps"]["count"] == 0  # the losses were finite
    rows = read_metrics(tmp_path / "metrics.jsonl")
    warning_rows = [r for r in rows if r["kind"] == "warning"]
    assert len(warning_rows) == 1 and "5 times in a row" in warning_rows[0]["message"]
    assert not [r for r in rows if r["kind"] == "eval"]  # stopped before any evaluation


def test_higher_min_loss_scale_stops_earlier(tmp_path):
    cfg = tiny_run("precision=fp16", "max_steps=40", ALWAYS_INF, "numerics.min_loss_scale=1024")
    with pytest.raises(RunFailed) as err:
        train(cfg, tmp_path)
    report = err.value.report.to_dict()
    assert report["status"] == "diverged" and "collapsed to 1024" in report["reason"]
    assert report["training"]["steps"] == 6  # 65536 / 2^6 = 1024
    assert report["training"]["loss_scale"]["final"] == 1024.0
    assert report["numerics"]["min_loss_scale"] == 1024.0
    assert report["numerics"]["warnings"][0]["kind"] == "consecutive_backoffs"


@pytest.mark.slow
def test_command_line_collapse_exits_1_with_the_report(tmp_path):
    steps = ",".join(str(s) for s in range(1, 26))
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mptrain",
            "precision=fp16",
            "model=mlp",
            "device=cpu",
            "max_steps=40",
            f"debug.inject_inf_grad_steps=[{steps}]",
            "progress=false",
            "hydra.run.dir=run",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 1, result.stderr
    assert "diverged" in result.stderr
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["status"] == "diverged" and report["training"]["steps"] == 16


def test_collapse_from_a_real_backward_overflow_names_the_module(tmp_path, monkeypatch):
    monkeypatch.setattr(build_module, "build_model", lambda *args: grad_amplifier())
    cfg = tiny_run("precision=fp16", "max_steps=20", "numerics.min_loss_scale=1024")
    with pytest.raises(RunFailed) as err:
        train(cfg, tmp_path)
    report = err.value.report.to_dict()
    assert "collapsed to 1024" in report["reason"]  # the overflow is real: every step skipped
    assert report["training"]["skipped_steps"]["steps"] == [1, 2, 3, 4, 5, 6]
    backward = report["numerics"]["culprit"]["backward"]
    assert backward is not None and backward["module"] == "head"


# ------------------------------------------------------------------ end to end: forward overflow
def test_forward_overflow_in_a_run_names_the_culprit(tmp_path, monkeypatch):
    monkeypatch.setattr(build_module, "build_model", lambda *args: blowup_mlp(in_features=64))
    cfg = tiny_run("precision=fp16", "max_steps=30")
    with pytest.raises(RunFailed) as err:
        train(cfg, tmp_path)
    assert err.value.status == "diverged"
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["status"] == "diverged"
    numerics = report["numerics"]
    assert numerics["nonfinite_loss_steps"] == {"count": 5, "steps": [1, 2, 3, 4, 5]}
    assert report["training"]["steps"] == 5
    assert report["training"]["skipped_steps"]["count"] == 5
    assert report["training"]["loss_scale"]["final"] == 65536.0 / 32  # not a collapse
    fwd = numerics["culprit"]["forward"]
    assert fwd["module"] == "body.blowup" and fwd["dtype"] == "float16"
    assert "overflow" in fwd["kind"]
    reason = report["reason"]
    assert "non-finite for 5 consecutive steps" in reason
    assert "body.blowup" in reason and "bf16" in reason and "BF16" in reason


@pytest.mark.slow
def test_a_run_fed_nan_says_the_input_batch_is_not_finite(tmp_path, monkeypatch):
    digits = DATASETS["digits"]

    def poisoned(cfg):
        arrays = digits.build(cfg)
        arrays.train_images[:, :, 3, 3] = float("nan")  # every batch: whichever the run stops at
        return arrays

    monkeypatch.setitem(DATASETS, "digits", dataclasses.replace(digits, build=poisoned))
    with pytest.raises(RunFailed) as err:
        train(tiny_run("dataset=digits", "precision=fp32", "max_steps=5"), tmp_path)
    report = err.value.report.to_dict()
    assert report["status"] == "diverged"
    assert "the input batch is not finite" in report["reason"], report["reason"]
    assert report["numerics"]["culprit"]["input"]["tensor"] == "inputs"
    assert report["numerics"]["culprit"]["forward"] is None


def test_the_same_run_in_bf16_trains(tmp_path, monkeypatch):
    monkeypatch.setattr(build_module, "build_model", lambda *args: blowup_mlp(in_features=64))
    report = train(tiny_run("precision=bf16", "max_steps=5"), tmp_path)
    assert report["status"] == "completed" and report["numerics"]["culprit"] is None
    assert math.isfinite(report["training"]["final_train_loss"])


# -------------------------------------------------------------------------------- autocast audit
class TinyAttention(nn.Module):
    """LayerNorm -> q/k/v Linear -> softmax(q k^T) v -> Linear head over the mean token.

    ``scores``: "fp32" casts the scores to FP32 before the softmax (the usual fix), "autocast"
    leaves them as autocast made them, "half" casts them to FP16 (a bug the audit must flag).
    """

    def __init__(self, scores: str = "fp32", dim: int = 16, classes: int = 10) -> None:
        super().__init__()
        self.scores = scores
        self.norm = nn.LayerNorm(dim)
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        v = self.v(h)
        scores = self.q(h) @ self.k(h).transpose(-2, -1) / 4.0
        if self.scores == "fp32":
            scores = scores.float()
        elif self.scores == "half":
            scores = scores.half()
        attn = torch.softmax(scores, dim=-1)
        return self.head((attn.to(v.dtype) @ v).mean(dim=1))


def tokens(n: int = 4, length: int = 6, dim: int = 16):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, length, dim, generator=g), torch.randint(0, 10, (n,), generator=g)


def forward_ops(audit: dict, op: str, module: str | None = None) -> list[dict]:
    return [
        o
        for o in audit["ops"]
        if o["phase"] == "forward" and o["op"] == op and (module is None or o["module"] == module)
    ]


def test_audit_of_an_attention_model_under_bf16():
    torch.manual_seed(0)
    model = TinyAttention("fp32")
    x, y = tokens()
    optimizer = torch.optim.AdamW(model.parameters())
    before = snapshot(model)

    audit = audit_step(model, x, y, BF16, optimizer, mixed=True)

    assert_unchanged(before, snapshot(model))
    # FP32 where the numerics need it.
    (softmax,) = forward_ops(audit, "_softmax")
    assert softmax["output_dtypes"] == "float32" and softmax["flag"] is None
    assert softmax["module"] == "(model)"
    (log_softmax,) = forward_ops(audit, "_log_softmax")
    assert log_softmax["output_dtypes"] == "float32"
    (nll,) = forward_ops(audit, "nll_loss_forward")
    assert set(nll["output_dtypes"].split(",")) == {"float32"}
    (norm,) = forward_ops(audit, "native_layer_norm", "norm")
    assert set(norm["output_dtypes"].split(",")) == {"float32"}
    # The matmuls in BF16: every Linear's addmm and the two attention bmm's.
    for name in ("q", "k", "v", "head"):
        (addmm,) = forward_ops(audit, "addmm", name)
        assert addmm["input_dtypes"] == "bfloat16,bfloat16,bfloat16", name
        assert addmm["output_dtypes"] == "bfloat16", name
    (bmm,) = forward_ops(audit, "bmm")
    assert bmm["count"] == 2 and bmm["output_dtypes"] == "bfloat16"
    assert any(o["phase"] == "backward" for o in audit["ops"])
    # Mixed-precision state: FP32 parameters and gradients, nothing flagged.
    assert audit["parameter_dtypes"] == {"float32": 10}
    assert audit["gradient_dtypes"] == {"float32": 10}
    assert audit["optimizer_state_dtypes"].startswith("not created yet")
    assert audit["flagged_ops"] == [] and audit["state_flags"] == []
    md = render_audit(audit)
    assert "Flags: 0" in md
    assert "| addmm | head (Linear) | forward | bfloat16,bfloat16,bfloat16 |" in md


def test_audit_reports_the_dtype_softmax_really_ran_in():
    """Without an explicit cast, the softmax runs in whatever autocast gives it on this device
    (on CPU autocast does not promote softmax to FP32): the audit must say so, and flag it."""
    with BF16():
        reference = torch.softmax(torch.ones(2, 2, dtype=torch.bfloat16), dim=-1).dtype
    torch.manual_seed(0)
    model = TinyAttention("autocast")
    x, y = tokens()
    audit = audit_step(model, x, y, BF16, torch.optim.SGD(model.parameters()), mixed=True)
    (softmax,) = forward_ops(audit, "_softmax")
    assert softmax["output_dtypes"] == str(reference).replace("torch.", "")
    low = reference in (torch.float16, torch.bfloat16)
    assert (softmax["flag"] == "softmax ran in low precision") is low
    assert (softmax in audit["flagged_ops"]) is low


def test_audit_flags_a_softmax_forced_to_fp16():
    torch.manual_seed(0)
    model = TinyAttention("half")
    x, y = tokens()
    audit = audit_step(model, x, y, BF16, torch.optim.SGD(model.parameters()), mixed=True)
    (softmax,) = forward_ops(audit, "_softmax")
    assert softmax["output_dtypes"] == "float16"
    assert softmax["flag"] == "softmax ran in low precision"
    assert [(o["op"], o["module"]) for o in audit["flagged_ops"]] == [("_softmax", "(model)")]
    md = render_audit(audit)
    assert "softmax ran in low precision: _softmax in (model) (TinyAttention)" in md
    assert audit["state_flags"] == []


def test_audit_flags_low_precision_state_in_a_mixed_recipe():
    torch.manual_seed(0)
    model = plain_mlp().to(torch.bfloat16)
    x, y = batch()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    nn.functional.cross_entropy(model(x.bfloat16()).float(), y).backward()
    optimizer.step()  # creates BF16 optimizer state
    optimizer.zero_grad(set_to_none=True)

    audit = audit_step(model, x.bfloat16(), y, BF16, optimizer, mixed=True)
    assert audit["parameter_dtypes"] == {"bfloat16": 6}
    assert audit["optimizer_state_dtypes"] == {"bfloat16": 12}  # exp_avg, exp_avg_sq
    assert sorted(audit["state_flags"]) == [
        "gradient in bfloat16 (expected float32)",
        "optimizer state in bfloat16 (expected float32)",
        "parameter in bfloat16 (expected float32)",
    ]
    assert "parameter in bfloat16 (expected float32)" in render_audit(audit)
    # A "pure" recipe expects exactly this: no state flags.
    pure = audit_step(model, x.bfloat16(), y, BF16, optimizer, mixed=False)
    assert pure["state_flags"] == []


# ---------------------------------------------------------------------------- per-layer FP32
def test_keep_in_fp32_runs_the_head_in_fp32_and_keeps_the_state_dict():
    torch.manual_seed(0)
    model = plain_mlp()
    keys = list(model.state_dict())
    reference = plain_mlp()
    reference.load_state_dict(model.state_dict())

    assert keep_in_fp32(model, ["head"], "cpu") == ["head"]

    assert list(model.state_dict()) == keys
    x, y = batch()
    audit = audit_step(model, x, y, BF16, torch.optim.SGD(model.parameters()), mixed=True)
    (head,) = forward_ops(audit, "addmm", "head")
    assert head["input_dtypes"] == "float32,float32,float32"
    assert head["output_dtypes"] == "float32"
    for name in ("fc1", "fc2"):
        (addmm,) = forward_ops(audit, "addmm", name)
        assert addmm["output_dtypes"] == "bfloat16", name
    with BF16():
        logits = model(x)
        ref_logits = reference(x)
    assert logits.dtype == torch.float32 and ref_logits.dtype == torch.bfloat16
    # Outside autocast the wrapper changes nothing.
    assert torch.equal(model(x), reference(x))

    assert keep_in_fp32(plain_mlp(), ["fc*"], "cpu") == ["fc1", "fc2"]
    assert keep_in_fp32(plain_mlp(), ["nope"], "cpu") == []


def test_fp32_modules_matching_nothing_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match=r"numerics\.fp32_modules"):
        train(tiny_run("numerics.fp32_modules=[nope]", "max_steps=2"), tmp_path)
    assert not (tmp_path / "report.json").exists()


def test_run_with_fp32_module_and_audit(tmp_path):
    cfg = tiny_run("precision=bf16", "audit=true", "numerics.fp32_modules=[5]", "max_steps=2")
    report = train(cfg, tmp_path)
    assert report["status"] == "completed"
    assert report["numerics"]["fp32_modules"] == ["5"]
    audit = json.loads((tmp_path / "audit.json").read_text())
    (last,) = forward_ops(audit, "addmm", "5")
    assert last["input_dtypes"] == "float32,float32,float32" and last["output_dtypes"] == "float32"
    for hidden in ("1", "3"):
        (addmm,) = forward_ops(audit, "addmm", hidden)
        assert addmm["output_dtypes"] == "bfloat16", hidden
    assert audit["parameter_dtypes"] == {"float32": 6} and audit["state_flags"] == []
    md = (tmp_path / "audit.md").read_text()
    assert "| addmm | 5 (Linear) | forward | float32,float32,float32 | float32 |" in md


def test_fp32_modules_with_a_pure_precision(tmp_path):
    """Refused before training: a pure precision holds its weights in BF16, so an FP32 island
    would run FP32 arithmetic on BF16 weights and say it kept the layer in FP32."""
    cfg = tiny_run("precision=bf16_pure", "numerics.fp32_modules=[5]", "max_steps=2")
    with pytest.raises(ConfigError) as refused:
        train(cfg, tmp_path)
    assert str(refused.value) == (
        "numerics.fp32_modules: precision=bf16_pure keeps its weights in bfloat16, so no layer "
        "can run in FP32; use a mixed precision (fp16, bf16) instead"
    )
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "metrics.jsonl").exists()


# ------------------------------------------------------------------------------ FP16 range probe
def test_probe_says_tiny_gradients_need_loss_scaling():
    torch.manual_seed(0)
    model = nn.Sequential(
        OrderedDict(fc1=nn.Linear(16, 32), act=nn.ReLU(), fc2=nn.Linear(32, 10), shrink=Scale(1e-6))
    )
    batches = [batch(n=64, seed=s) for s in range(2)]
    before = snapshot(model)

    probe = range_probe(model, batches, loss_scale=65536.0)

    assert_unchanged(before, snapshot(model))
    assert probe["verdict"].startswith("FP16 needs loss scaling")
    assert "65536" in probe["verdict"]
    assert probe["underflow_unscaled_fraction"] > 0.5
    assert probe["underflow_at_scale_fraction"] < 0.01
    assert probe["overflow_modules"] == []
    layers = {layer["module"]: layer for layer in probe["layers"]}
    assert layers["fc2"]["gradient_max"] < FP16_MIN_SUBNORMAL < layers["shrink"]["gradient_max"]
    assert layers["fc2"]["underflow_unscaled_fraction"] == 1.0
    assert layers["shrink"]["underflow_unscaled_fraction"] == 0.0
    assert "needs loss scaling" in render_probe(probe)


def test_probe_names_a_forward_overflow_and_suggests_bf16():
    torch.manual_seed(0)
    probe = range_probe(blowup_mlp(), [batch()], loss_scale=65536.0)
    assert "overflows in the forward" in probe["verdict"]
    assert "body.blowup" in probe["verdict"] and "BF16" in probe["verdict"]
    assert probe["overflow_modules"][0] == "body.blowup"
    assert "body.fc1" not in probe["overflow_modules"]
    layers = {layer["module"]: layer for layer in probe["layers"]}
    assert (
        layers["body.blowup"]["headroom_to_fp16_max"]
        < 1
        < layers["body.fc1"]["headroom_to_fp16_max"]
    )


def test_probe_calls_a_plain_mlp_fp16_safe():
    torch.manual_seed(0)
    probe = range_probe(plain_mlp(), [batch(seed=s) for s in range(3)], loss_scale=65536.0)
    assert probe["verdict"].startswith("FP16 safe"), probe["verdict"]
    assert probe["overflow_modules"] == []
    assert probe["underflow_unscaled_fraction"] <= 1e-3
    assert all(layer["activation_max"] < 65504 for layer in probe["layers"])


def test_run_with_probe_writes_probe_files(tmp_path):
    report = train(tiny_run("precision=fp16", "probe=true", "max_steps=2"), tmp_path)
    assert report["status"] == "completed"
    probe = json.loads((tmp_path / "probe.json").read_text())
    assert probe["verdict"].startswith("FP16 safe") and probe["loss_scale"] == 65536.0
    assert [layer["module"] for layer in probe["layers"]] == ["0", "1", "2", "3", "4", "5"]
    md = (tmp_path / "probe.md").read_text()
    assert md.startswith("# FP16 range probe") and probe["verdict"] in md


def test_probe_with_a_pure_precision(tmp_path):
    """The FP16 range probe runs under a pure precision too (it asks whether FP16 would hold
    this model's values, whatever the run trains in): every layer probed, the run unchanged."""
    report = train(tiny_run("precision=bf16_pure", "probe=true", "max_steps=2"), tmp_path)
    assert report["status"] == "completed" and report["training"]["steps"] == 2
    assert report["precision"]["master_weights_dtype"] == "bfloat16"
    probe = json.loads((tmp_path / "probe.json").read_text())
    assert [layer["module"] for layer in probe["layers"]] == ["0", "1", "2", "3", "4", "5"]
    assert probe["verdict"].startswith("FP16 safe") and probe["overflow_modules"] == []
    assert (tmp_path / "probe.md").read_text().startswith("# FP16 range probe")


# ------------------------------------------------------------- diagnostics don't change training
@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_audit_and_probe_leave_training_bit_identical(tmp_path, precision):
    common = (f"precision={precision}", "max_steps=6", "log_every=3", "eval_every=3")
    plain = train(tiny_run(*common), tmp_path / "plain")
    diagnosed = train(tiny_run(*common, "audit=true", "probe=true"), tmp_path / "diagnosed")
    assert (tmp_path / "diagnosed" / "audit.json").is_file()
    assert (tmp_path / "diagnosed" / "probe.json").is_file()
    assert not (tmp_path / "plain" / "audit.json").exists()
    assert diagnosed["training"]["final_train_loss"] == plain["training"]["final_train_loss"]
    assert diagnosed["evaluation"]["history"] == plain["evaluation"]["history"]
    assert diagnosed["training"]["loss_scale"] == plain["training"]["loss_scale"]
    plain_rows = [
        r["loss"] for r in read_metrics(tmp_path / "plain" / "metrics.jsonl") if "loss" in r
    ]
    diag_rows = [
        r["loss"] for r in read_metrics(tmp_path / "diagnosed" / "metrics.jsonl") if "loss" in r
    ]
    assert plain_rows == diag_rows and len(plain_rows) == 2
