"""``mptrain advise`` says each thing once and keeps its console lines readable (issue 39, item
10): where FP8 cannot apply (``model=cnn``) every low-precision recipe's refusal is one line, not
one per recipe in the runners-up, again in Not measured and a third time in the per-layer plan's
reason (a 1,229-character line); and a per-layer plan of many layers is summarised on the console
(the first few names, "… and N more", the command whole) while advise.md keeps every layer."""

from __future__ import annotations

import contextlib
import io
import json
import sys
import textwrap

import pytest
from rich.console import Console
from support.processes import describe, run_mptrain
from support.runs import compose_run, run_cli, tiny_run

from mptrain.commands.advise import choices, concise, layers, measure, plan, report, run, trials
from mptrain.commands.advise.decide import recommend
from mptrain.commands.advise.sensitivity import measure_sensitivity
from mptrain.platform import hardware

REFUSED = "no Linear layer of model=cnn can run in"
LOW = [r.name for r in choices.LOW_PRECISION]  # fp8 … nvfp4: seven recipes


def advice_of(cfg, found_plan=None):
    """advise's record for ``cfg`` from real candidates: each low-precision recipe's pilot built
    (a model none of them converts is refused there, as in a whole advise), nothing trained;
    the per-layer plan ``found_plan`` or, without one, run_plan's verdict on the candidates."""
    device = hardware.resolve_device("cpu")
    cands = measure.candidates(cfg, device)
    found = run.new_findings(cands, cfg.advise)
    for c in cands:
        if c.name in LOW:
            measure.pilot_one(c, trials.Budget(100.0), 100.0, None)
    if found_plan is None:
        layers.run_plan(cands, cfg.advise, trials.Budget(100.0), {}, found["plan"])
    else:
        found["plan"] = found_plan
    decision = recommend(*run.measured_inputs(cfg, found, device))
    result = report.assemble(cfg, device, found, decision, "mptrain precision=fp32")
    result["elapsed_s"] = 1.0
    return result


def console_of(result, tmp_path, capsys) -> str:
    """What advise prints off a terminal (a pipe, a log file)."""
    report.show(Console(file=io.StringIO()), result, tmp_path)
    return capsys.readouterr().out


# ------------------------------------------------------------------------------ said once
def test_a_refusal_every_low_precision_recipe_shares_is_said_once(tmp_path, capsys):
    result = advice_of(compose_run("model=cnn", "device=cpu"))
    console, markdown = console_of(result, tmp_path, capsys), report.render(result)

    for text in (console, markdown):
        assert text.count(REFUSED) == 1, text  # was 21: 7 runners-up, 7 reasons, 7 in the plan's
        lines = text.splitlines()
        assert (
            "- fp8, fp8-rowwise, fp8-delayed, fp8-pow2, fp8-blockwise, mxfp8, nvfp4 (7 precisions): "
            "no Linear layer of model=cnn can run in FP8, blockwise FP8, MXFP8 or NVFP4 (1 layer: "
            "first/last layer kept in BF16); see the include/exclude/keep_first_last/min_features "
            "keys of fp8, mx and nvfp4"
        ) in lines
        assert (
            "- fp8, fp8-rowwise, fp8-delayed, fp8-pow2, fp8-blockwise, mxfp8, nvfp4 (7 precisions): "
            "not measured (why: under Not measured)"
        ) in lines
        assert (
            "- per-layer plan: no low-precision choice was measured (fp8, fp8-rowwise, fp8-delayed, "
            "fp8-pow2, fp8-blockwise, mxfp8, nvfp4: each one's reason is listed with it)"
        ) in lines
        assert max(map(len, lines)) < 400  # the plan's reason was 1,229 characters
    # advise.json keeps each recipe's own words and command
    runners_up = {r["precision"]: r for r in result["recommendation"]["runners_up"]}
    assert runners_up["mxfp8"]["why"] == (
        "not measured: precision=mxfp8: no Linear layer of model=cnn can run in MXFP8 (1 layer: "
        "first/last layer kept in BF16); see mx.include/exclude/keep_first_last/min_features"
    )
    assert all(REFUSED in runners_up[name]["why"] for name in LOW)


def test_only_the_same_reason_is_folded_and_a_lone_one_keeps_its_words():
    """Real refusals (the four FP8 scalings: one format, one key) beside a reason of their own."""
    cands = measure.candidates(
        compose_run("model=cnn", "device=cpu"), hardware.resolve_device("cpu")
    )
    refused = []
    for c in cands:
        if c.name in LOW:
            measure.pilot_one(c, trials.Budget(100.0), 100.0, None)
            refused.append((c.name, c.skipped["all"]))
    fp8s, mxfp8 = refused[:4], dict(refused)["mxfp8"]
    budget = "a run's set-up and first step (~2.4 s) cannot fit the 1.1 s of advise.budget_s left"

    assert concise.grouped([*fp8s, ("nvfp4", budget)]) == [
        (
            ["fp8", "fp8-rowwise", "fp8-delayed", "fp8-pow2"],
            "precision=fp8: no Linear layer of model=cnn can run in FP8 (1 layer: first/last layer "
            "kept in BF16); see fp8.include/exclude/keep_first_last/min_features",
        ),
        (["nvfp4"], budget),
    ]
    assert concise.grouped([("mxfp8", mxfp8)]) == [(["mxfp8"], mxfp8)]  # alone: word for word
    assert concise.grouped([*fp8s, ("mxfp8", mxfp8)]) == [
        (
            ["fp8", "fp8-rowwise", "fp8-delayed", "fp8-pow2", "mxfp8"],
            "no Linear layer of model=cnn can run in FP8 or MXFP8 (1 layer: first/last layer kept "
            "in BF16); see the include/exclude/keep_first_last/min_features keys of fp8 and mx",
        )
    ]
    assert concise.capped([f"l{i}" for i in range(6)]) == "l0, l1, l2, l3, l4, l5"
    assert concise.capped([f"l{i}" for i in range(9)]) == "l0, l1, l2, l3, l4 … and 4 more"


# ------------------------------------------------------------------------------ many layers
MANY = '''
import torch
from torch import nn


class Block(nn.Module):
    """A Linear layer; with ``spike``, its input carries a constant 1e7 on channel 0 that its
    weights ignore, so tensorwise FP8 flushes every other channel to zero."""

    def __init__(self, spike: bool) -> None:
        super().__init__()
        self.proj = nn.Linear(64, 64)
        s = torch.zeros(64)
        s[0] = 1e7 if spike else 0.0
        self.register_buffer("spike", s)
        mask = torch.ones(64, 64)
        mask[:, 0] = 0
        with torch.no_grad():
            self.proj.weight.mul_(mask)
        self.proj.weight.register_hook(lambda grad: grad * mask)

    def forward(self, h):
        return self.proj(h + self.spike).relu() + h


class ManyNet(nn.Module):
    """Fourteen FP8-eligible layers (the stem and head: kept by keep_first_last), eight fragile."""

    def __init__(self, in_channels: int, num_classes: int) -> None:
        super().__init__()
        self.flatten = nn.Flatten()
        self.stem = nn.Linear(in_channels * 64, 64)
        self.blocks = nn.ModuleList(Block(i < 8) for i in range(14))
        self.head = nn.Linear(64, num_classes)

    def forward(self, x):
        h = self.stem(self.flatten(x)).relu()
        for block in self.blocks:
            h = block(h)
        return self.head(h)
'''
MODEL = ("model=custom", "model._target_=many_net.ManyNet")


@pytest.fixture
def many_module(tmp_path, monkeypatch):
    (tmp_path / "many_net.py").write_text(textwrap.dedent(MANY))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("many_net", None)


def test_the_console_summarises_a_long_per_layer_plan(many_module, capsys):
    """The one-batch sensitivity of 14 layers, measured; kept: the first 8 ranked, as a verified
    plan would keep them."""
    cfg = tiny_run(*MODEL, "precision=fp32")
    fp8 = choices.choice("fp8")
    found = {**layers.new_plan(), "precision": "fp8", "label": fp8.label}
    fp8_cfg = choices.apply(cfg, fp8)
    measure_sensitivity(cfg, fp8_cfg, found, deadline=float("inf"))
    ranking = found["ranking"]
    assert len(ranking) == 14
    found.update(kept=ranking[:8], exclude_base=list(fp8_cfg.fp8.exclude))
    plan.add_command(found, list(MODEL))
    result = advice_of(compose_run(*MODEL, "device=cpu"), found)

    console, markdown = console_of(result, many_module, capsys), report.render(result)

    lines = console.splitlines()
    assert (
        f"**Keep 8 of 14 eligible layers in high precision: {', '.join(ranking[:5])} … and 3 more**"
        in lines
    )
    assert found["command"] in lines  # whole: it is to be run
    assert all(name in found["command"] for name in ranking[:8])
    assert not any(line.startswith("| 1 | ") for line in lines)  # no per-layer table
    shares = ", ".join(
        f"{row['name']} {row['share']:.2%}"
        for row in sorted(found["layers"], key=lambda row: row["rank"])[:3]
    )
    ranked = (
        f"Ranked by share of the all-layers gradient error (14 layers): {shares} … and 11 more; "
        "every layer's figures: advise.md and advise.json"
    )
    assert ranked in lines
    plan_lines = lines[lines.index("## fp8 tensorwise: layers kept in high precision") :]
    plan_lines = plan_lines[: plan_lines.index("## Evidence")]
    assert max(len(line) for line in plan_lines if line != found["command"]) <= len(ranked)
    # advise.md: every layer
    assert (
        f"**Keep 8 of 14 eligible layers in high precision: {', '.join(ranking[:8])}**" in markdown
    )
    assert sum(line.startswith("| ") and "× 64" in line for line in markdown.splitlines()) == 14


# ------------------------------------------------------------------------------ whole commands
@pytest.mark.slow
def test_advise_cnn_prints_the_refusal_once(tmp_path):
    args = ("device=cpu", "advise.budget_s=20", "advise.fidelity_steps=12", "advise.speed_steps=5")
    result = run_mptrain(
        tmp_path, "advise", "model=cnn", *args, "advise.seeds=1", "hydra.run.dir=out"
    )
    assert result.returncode == 0, describe(result)
    markdown = (tmp_path / "out" / "advise.md").read_text()
    data = json.loads((tmp_path / "out" / "advise.json").read_text())

    assert result.stdout.count(REFUSED) == 1, result.stdout  # was 21
    assert markdown.count(REFUSED) == 1
    assert max(map(len, result.stdout.splitlines())) < 500  # was 1,229
    rows = {r["precision"]: r for r in data["precisions"]}
    assert all(REFUSED in rows[name]["skipped"]["all"] for name in LOW)


@pytest.mark.slow
def test_advise_prints_a_plan_of_many_layers_in_brief_and_writes_it_whole(many_module, monkeypatch):
    """In this process, without the speed part and with fp8 tensorwise alone among the
    low-precision recipes (as test_advise_plan's fragile runs): the budget goes to the plan."""
    monkeypatch.setattr(measure, "run_speed", lambda *args: None)
    monkeypatch.setattr(choices, "LOW_PRECISION", (choices.choice("fp8"),))
    steps = ("advise.fidelity_steps=12", "optimizer.lr=0.005", "advise.budget_s=60")
    args = ["advise", *MODEL, "device=cpu", *steps, "advise.seeds=1", "hydra.run.dir=out"]
    printed = []  # what advise prints: run_cli's own stdout is not the test's to read
    show = report.show

    def shown(*args):
        with contextlib.redirect_stdout(io.StringIO()) as out:
            show(*args)
        printed.append(out.getvalue())

    monkeypatch.setattr(report, "show", shown)
    outcome = run_cli(args, many_module, monkeypatch, jobs=True)
    assert outcome.code in (0, None), outcome
    console = "".join(printed)
    out = many_module / "out"
    markdown = (out / "advise.md").read_text()
    found = json.loads((out / "advise.json").read_text())["layer_plan"]

    assert len(found["ranking"]) == 14, found
    lines = console.splitlines()
    assert any(
        line.startswith("Ranked by share of the all-layers gradient error (14 layers): ")
        and " … and 11 more; every layer's figures: advise.md and advise.json" in line
        for line in lines
    ), console
    assert not any(line.startswith("| 1 | ") for line in lines)
    assert sum(line.startswith("| ") and "× 64" in line for line in markdown.splitlines()) == 14
    kept = found.get("kept") or []
    if len(kept) > concise.FIRST + 1:  # the headline names the first five, the file every one
        assert f"{', '.join(kept[:5])} … and {len(kept) - 5} more**" in console
        assert f"high precision: {', '.join(kept)}**" in markdown
