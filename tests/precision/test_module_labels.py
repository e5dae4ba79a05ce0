"""How the numerics diagnostics name a module: an ``nn.Sequential``'s children are "0", "1", ...,
which read like step numbers, so the human-readable outputs (audit.md, probe.md and the probe's
verdict on the console, the culprit's words in the reason and report.md) print the class beside
the path, ``1 (Linear)``. The JSON outputs keep the plain path as ``module`` (stable, what
``numerics.fp32_modules`` matches) and give the class apart as ``module_type``.

Real tiny runs on CPU, or the real diagnostic functions on Linear-only ``nn.Sequential`` models.
"""

from __future__ import annotations

import json

import pytest
import torch
from support.runs import tiny_run, train
from torch import nn

from mptrain.precision.diagnostics.audit import audit_step, render_audit
from mptrain.precision.diagnostics.culprit import find_culprit
from mptrain.precision.diagnostics.hooks import module_label
from mptrain.precision.diagnostics.probe import range_probe, render_probe
from mptrain.train import build as build_module
from mptrain.train.health import describe_culprit
from mptrain.train.job import RunFailed

FP16 = lambda: torch.autocast("cpu", dtype=torch.float16)  # noqa: E731
BF16 = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731
MLP_LAYERS = [  # model=mlp: Flatten, then Linear + ReLU per hidden size, then the head
    ("0", "Flatten"),
    ("1", "Linear"),
    ("2", "ReLU"),
    ("3", "Linear"),
    ("4", "ReLU"),
    ("5", "Linear"),
]


class Scale(nn.Module):
    """Multiplies its input by a constant (in the input's dtype: FP16 stays FP16)."""

    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


def blowup(features: int = 16) -> nn.Sequential:
    """Flatten -> Linear -> x1e5 -> ReLU -> Linear: FP16 overflows at "2", a Scale."""
    return nn.Sequential(
        nn.Flatten(), nn.Linear(features, 32), Scale(1e5), nn.ReLU(), nn.Linear(32, 10)
    )


def batch(n: int = 8, features: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, features, generator=g), torch.randint(0, 10, (n,), generator=g)


def test_a_label_is_the_path_and_the_class_and_a_pseudo_module_stays_as_it_is():
    assert module_label("0", "Linear") == "0 (Linear)"
    assert module_label("features.3", "Conv2d") == "features.3 (Conv2d)"
    assert module_label("(autograd)", None) == "(autograd)"


# ---------------------------------------------------------------------------------- the audit
def test_audit_md_names_each_index_with_its_class_and_the_json_keeps_the_plain_path():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 10))
    x, y = batch()
    audit = audit_step(model, x, y, BF16, torch.optim.SGD(model.parameters()), mixed=True)

    rows = {(o["op"], o["module"], o["phase"]): o for o in audit["ops"]}
    first, last = rows[("addmm", "0", "forward")], rows[("addmm", "2", "forward")]
    assert first["module_type"] == last["module_type"] == "Linear"
    assert rows[("relu", "1", "forward")]["module_type"] == "ReLU"
    backward = [o for o in audit["ops"] if o["phase"] == "backward"]
    assert backward and all(o["module"] == "(autograd)" for o in backward)
    assert all(o["module_type"] is None for o in backward)
    json.dumps(audit)  # what audit.json holds: plain strings, no classes

    md = render_audit(audit)
    assert "| addmm | 0 (Linear) | forward | bfloat16,bfloat16,bfloat16 | bfloat16 |" in md
    assert "| relu | 1 (ReLU) | forward |" in md
    assert "| addmm | 2 (Linear) | forward |" in md
    assert "| addmm | 0 | forward" not in md  # no bare index left
    assert "| (autograd) | backward |" in md  # not a module: no class to show


def test_audit_flags_name_the_module_with_its_class():
    class HalfSoftmax(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.softmax(x.half(), dim=-1).float()

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 10), HalfSoftmax())
    x, y = batch()
    audit = audit_step(model, x, y, BF16, torch.optim.SGD(model.parameters()), mixed=True)
    assert [(o["op"], o["module"], o["module_type"]) for o in audit["flagged_ops"]] == [
        ("_softmax", "1", "HalfSoftmax")
    ]
    assert "- softmax ran in low precision: _softmax in 1 (HalfSoftmax)" in render_audit(audit)


# ---------------------------------------------------------------------------------- the probe
def test_probe_verdict_and_md_name_an_overflowing_index_with_its_class():
    torch.manual_seed(0)
    probe = range_probe(blowup(), [batch()], loss_scale=65536.0)

    # Plain paths, from the first overflow on: what advise turns into numerics.fp32_modules=[2].
    assert probe["overflow_modules"] == ["2", "3", "4"]
    assert [(x["module"], x["module_type"]) for x in probe["layers"]] == [
        ("0", "Flatten"),
        ("1", "Linear"),
        ("2", "Scale"),
        ("3", "ReLU"),
        ("4", "Linear"),
    ]
    assert probe["verdict"].startswith(
        "FP16 overflows in the forward at 2 (Scale), 3 (ReLU), 4 (Linear) → use BF16"
    )
    md = render_probe(probe)
    assert "| 2 (Scale) | " in md and "| 4 (Linear) | " in md


# ---------------------------------------------------------------------------------- the culprit
def test_culprit_words_name_the_forward_index_with_its_class():
    torch.manual_seed(0)
    culprit = find_culprit(blowup(), *batch(), FP16)
    fwd = culprit["forward"]
    assert (fwd["module"], fwd["module_type"], fwd["dtype"]) == ("2", "Scale", "float16")
    assert describe_culprit(culprit).startswith(
        "forward: first non-finite output at 2 (Scale) in float16; largest finite value before it"
    )


def test_culprit_words_name_the_backward_index_with_its_class():
    torch.manual_seed(0)
    # Finite forward; the head's FP16 output gradient is 3000x the logits': over 65504 at 2048.
    model = nn.Sequential(nn.Flatten(), Scale(1e-4), nn.Linear(64, 10, bias=False), Scale(3000.0))
    culprit = find_culprit(model, *batch(n=64, features=64), FP16, loss_scale=2048.0)
    bwd = culprit["backward"]
    assert (bwd["module"], bwd["module_type"]) == ("2", "Linear")
    assert describe_culprit(culprit).startswith(
        "backward: first non-finite gradient at 2 (Linear) in float16 with loss scale 2048;"
    )


# ---------------------------------------------------------------------------------- real runs
def test_a_run_writes_labelled_audit_md_and_probe_md_and_plain_json(tmp_path, capsys):
    cfg = tiny_run("precision=bf16", "audit=true", "probe=true", "max_steps=1")
    assert train(cfg, tmp_path)["status"] == "completed"

    audit = json.loads((tmp_path / "audit.json").read_text())
    linears = [o for o in audit["ops"] if o["op"] == "addmm" and o["phase"] == "forward"]
    assert sorted((o["module"], o["module_type"]) for o in linears) == [
        ("1", "Linear"),
        ("3", "Linear"),
        ("5", "Linear"),
    ]
    md = (tmp_path / "audit.md").read_text()
    for index in ("1", "3", "5"):
        assert f"| addmm | {index} (Linear) | forward | " in md, index

    probe = json.loads((tmp_path / "probe.json").read_text())
    assert [(x["module"], x["module_type"]) for x in probe["layers"]] == MLP_LAYERS
    md = (tmp_path / "probe.md").read_text()
    for index, cls in MLP_LAYERS:
        assert f"\n| {index} ({cls}) | " in md, index
    assert "FP16 range probe: FP16 safe" in capsys.readouterr().out


def test_a_run_prints_the_probe_verdict_with_the_class(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(build_module, "build_model", lambda *args: blowup(features=64))
    cfg = tiny_run("precision=fp32", "probe=true", "max_steps=1")
    assert train(cfg, tmp_path)["status"] == "completed"
    words = "FP16 range probe: FP16 overflows in the forward at 2 (Scale), 3 (ReLU), 4 (Linear) →"
    assert words in capsys.readouterr().out
    assert json.loads((tmp_path / "probe.json").read_text())["overflow_modules"] == ["2", "3", "4"]


def test_a_diverged_run_names_the_culprit_with_its_class(tmp_path, monkeypatch):
    monkeypatch.setattr(build_module, "build_model", lambda *args: blowup(features=64))
    with pytest.raises(RunFailed) as err:
        train(tiny_run("precision=fp16", "max_steps=30"), tmp_path)
    assert err.value.status == "diverged"
    report = json.loads((tmp_path / "report.json").read_text())
    fwd = report["numerics"]["culprit"]["forward"]
    assert (fwd["module"], fwd["module_type"]) == (
        "2",
        "Scale",
    )  # the JSON: plain path, class apart
    words = "first non-finite output at 2 (Scale) in float16"
    assert words in report["reason"]
    assert words in (tmp_path / "report.md").read_text()
