"""Precision schedules (``precision.switch.to`` / ``.at``, mptrain.train.switch): the switch really
changes the layers (FP8 and the block-scaled MXFP8, NVFP4, blockwise FP8), the autocast dtype and
the loss scaler between two steps; a resume on either side of it equals the uninterrupted run bit
for bit (NVFP4's generators included); bad settings are refused in one line; the report,
metrics.jsonl and the terminal say what happened.

CPU-only, model=mlp on digits: Linear layers "1" (64->256), "3" (256->256), "5" (256->10); with
keep_first_last=true (FP8's and the block formats') only "3" converts (the 10-class head is not
16-aligned anyway).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.observers import PerStep
from support.runs import NoFigure, tiny_run, train
from torch import nn

from mptrain.checkpoint.file import load_checkpoint
from mptrain.config.base import ConfigError
from mptrain.output.metrics import read_metrics
from mptrain.platform.distributed import DistContext
from mptrain.precision.formats import LAYER_FORMATS, to_plain_linear
from mptrain.precision.policy import PRECISIONS
from mptrain.precision.quant.block_linear import BlockLinear
from mptrain.precision.quant.block_quant import BlockQuantization
from mptrain.precision.quant.fp8_linear import Float8Linear
from mptrain.train import job as job_module
from mptrain.train.build import prepare_run
from mptrain.train.loop import LoopHooks, train_loop
from mptrain.train.switch import WINDOW_STEPS, plan_switch, switch_step


@pytest.fixture(autouse=True)
def no_run_figure(monkeypatch):
    """No curves.png: matplotlib is most of a tiny run's time and nothing here reads it."""
    monkeypatch.setattr(job_module, "FigureWorker", NoFigure)


def switched(first: str, to: str, at: str, *overrides: str):
    return tiny_run(
        f"precision={first}", f"precision.switch.to={to}", f"precision.switch.at={at}", *overrides
    )


def layer_types(run) -> dict[str, str]:
    return {n: type(m).__name__ for n, m in run.model.named_modules() if isinstance(m, nn.Linear)}


def output_dtypes(model: nn.Module, name: str) -> list[torch.dtype]:
    """The dtype of every training forward's output of layer ``name`` (the autocast dtype)."""
    seen = []

    def hook(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
        if module.training:  # not the evaluations
            seen.append(out.dtype)

    model.get_submodule(name).register_forward_hook(hook)
    return seen


# --------------------------------------------------------------------------------- the switch
def test_fp8_to_bf16_puts_plain_linears_back_on_the_same_parameters():
    run = prepare_run(switched("fp8", "bf16", "3", "max_steps=6"))
    params = [id(p) for p in run.model.parameters()]
    in_optimizer = [id(p) for group in run.optimizer.param_groups for p in group["params"]]
    recorder = PerStep(
        run, lambda r: (layer_types(r)["3"], r.precision.policy.name, r.precision.fp8.get("steps"))
    )
    state = train_loop(run, LoopHooks(observers=(recorder,)))
    assert state.step == 6
    assert recorder.rows == [
        *((s, ("Float8Linear", "fp8", None)) for s in (1, 2, 3)),
        *((s, ("Linear", "bf16", [1, 3])) for s in (4, 5, 6)),
    ]
    assert type(run.model.get_submodule("3")) is nn.Linear  # not a subclass: really plain
    assert [id(p) for p in run.model.parameters()] == params  # the same objects, same order
    assert sorted(params) == sorted(in_optimizer)
    # The FP8 layer's final figures were taken at the switch: 3 steps of casts.
    (stats,) = run.precision.fp8["final_layer_stats"]
    assert stats["name"] == "3" and stats["input_scale"] > 0
    assert run.precision.fp8["steps"] == [1, 3]
    assert run.precision.policy.name == "bf16" and not run.precision.scaler.is_enabled()


def test_fp16_to_bf16_changes_the_autocast_dtype_and_drops_the_scaler():
    run = prepare_run(switched("fp16", "bf16", "0.5", "max_steps=8", "log_every=1"))
    dtypes = output_dtypes(run.model, "5")  # the head: a plain Linear in both phases
    recorder = PerStep(run, lambda r: r.precision.scaler.is_enabled())
    train_loop(run, LoopHooks(observers=(recorder,)))
    assert dtypes == [torch.float16] * 4 + [torch.bfloat16] * 4
    assert [enabled for _, enabled in recorder.rows] == [True] * 4 + [False] * 4
    assert run.monitor.scale is None
    assert run.monitor.scale_stats.initial == 65536.0  # phase 1's history stays


def test_bf16_to_fp16_starts_a_fresh_scaler_at_its_init_scale():
    run = prepare_run(
        switched("bf16", "fp16", "2", "max_steps=4", "precision.scaler.init_scale=1024")
    )
    scales = PerStep(
        run, lambda r: r.precision.scaler.get_scale() if r.precision.scaler.is_enabled() else None
    )
    train_loop(run, LoopHooks(observers=(scales,)))
    assert [s for _, s in scales.rows] == [None, None, 1024.0, 1024.0]
    assert run.monitor.scale_stats.initial == 1024.0


@pytest.mark.parametrize("scaling", ["dynamic", "delayed"])
def test_bf16_to_fp8_converts_on_the_same_parameters_with_fresh_scales(scaling):
    run = prepare_run(switched("bf16", "fp8", "2", "max_steps=4", f"fp8.scaling={scaling}"))
    params = [id(p) for p in run.model.parameters()]
    dtypes = output_dtypes(run.model, "5")
    seen = PerStep(run, lambda r: r.model.get_submodule("3"))
    train_loop(run, LoopHooks(observers=(seen,)))
    layers = [layer for _, layer in seen.rows]
    assert [type(layer).__name__ for layer in layers] == ["Linear"] * 2 + ["Float8Linear"] * 2
    assert [id(p) for p in run.model.parameters()] == params
    assert dtypes == [torch.bfloat16] * 4  # the autocast dtype of fp8's other layers is BF16
    fp8 = layers[-1]
    assert any(p is fp8.weight for group in run.optimizer.param_groups for p in group["params"])
    # The scalers started at the switch: two training steps of casts, no more.
    assert float(fp8.input_scaler.seen) == 2 * 64 * 256
    history = fp8.input_scaler.amax_history
    if scaling == "delayed":  # the history restarted at the switch: two amaxes in it
        assert (history[:2] > 0).all() and (history[2:] == 0).all()
    assert run.precision.fp8["steps"] == [3, 4]
    assert [row["name"] for row in run.precision.fp8["layers"] if row["converted"]] == ["3"]


def test_fp32_modules_stay_in_fp32_across_the_switch():
    cfg = switched(
        "bf16", "fp8", "1", "max_steps=2", "fp8.keep_first_last=false", "numerics.fp32_modules=[3]"
    )
    run = prepare_run(cfg)
    assert run.precision.fp32_modules == ["3"]
    train_loop(run, LoopHooks())
    new, other = run.model.get_submodule("3"), run.model.get_submodule("1")
    assert isinstance(new, Float8Linear) and isinstance(other, Float8Linear)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert new(torch.randn(4, 256)).dtype == torch.float32  # outside autocast again
        assert other(torch.randn(4, 64)).dtype == torch.bfloat16


# ------------------------------------------------------------------- block-scaled formats
# model=mlp: only "3" (256->256) converts (first and last kept; the head is not block-aligned)
BLOCK_FORMATS = [
    ("nvfp4", ()),
    ("mxfp8", ()),
    ("fp8", ("fp8.granularity=blockwise", "fp8.format=e4m3")),
]


@pytest.mark.parametrize(("first", "extra"), BLOCK_FORMATS, ids=["nvfp4", "mxfp8", "blockwise"])
def test_out_of_a_block_format_puts_plain_linears_back_and_keeps_its_figures(first, extra):
    run = prepare_run(switched(first, "bf16", "3", "max_steps=5", "log_every=1", *extra))
    params = [id(p) for p in run.model.parameters()]
    recorder = PerStep(
        run,
        lambda r: (layer_types(r)["3"], r.precision.policy.name, list(r.precision.blocks.layers)),
    )
    train_loop(run, LoopHooks(observers=(recorder,)))
    assert recorder.rows == [
        *((s, ("BlockLinear", first, ["3"])) for s in (1, 2, 3)),
        *((s, ("Linear", "bf16", [])) for s in (4, 5)),
    ]
    assert type(run.model.get_submodule("3")) is nn.Linear
    assert [id(p) for p in run.model.parameters()] == params
    assert run.precision.blocks.state_dict() == {}  # NVFP4's generators went with the layers
    section = run.precision.blocks.section
    assert section["format"] == run.schedule.first.blocks.format and section["steps"] == [1, 3]
    # the figures at the switch: the 3 counted steps of phase 1 (log_every=1), each quantizing
    # its input twice (forward, weight gradient)
    (stats,) = section["final_layer_stats"]
    assert stats["name"] == "3" and stats["input"]["samples"] == 2 * 3
    assert run.precision.fp8 is None and run.precision.policy.name == "bf16"


def test_into_a_block_format_converts_on_the_same_parameters_and_counts_from_the_switch():
    run = prepare_run(switched("bf16", "mxfp8", "2", "max_steps=4", "log_every=1"))
    params = [id(p) for p in run.model.parameters()]
    assert run.precision.blocks.section is None and run.precision.blocks.layers == {}
    train_loop(run, LoopHooks())
    layer = run.model.get_submodule("3")
    assert type(layer).__name__ == "BlockLinear" and list(run.precision.blocks.layers) == ["3"]
    assert run.precision.blocks.layers["3"] is layer
    assert [id(p) for p in run.model.parameters()] == params
    assert any(p is layer.weight for group in run.optimizer.param_groups for p in group["params"])
    assert (
        run.precision.blocks.section["steps"] == [3, 4]
        and run.precision.blocks.section["name"] == "MXFP8"
    )
    assert [r["name"] for r in run.precision.blocks.section["layers"] if r["converted"]] == ["3"]
    (stats,) = run.precision.blocks.layer_stats()
    assert stats["input"]["samples"] == 2 * 2  # phase 2's two steps, nothing before them
    assert run.precision.fp8 is None and run.precision.policy.blocks.format == "mxfp8"


def test_into_nvfp4_seeds_the_layers_as_a_run_built_in_nvfp4():
    """The generators and Hadamard signs made at the switch are those of an NVFP4 build of the
    same seed: a resume after the switch restores its checkpoint's states into alike layers."""
    built = prepare_run(tiny_run("precision=nvfp4", "max_steps=4", "seed=5"))
    run = prepare_run(switched("bf16", "nvfp4", "2", "max_steps=4", "seed=5"))
    rng = torch.get_rng_state()
    run.schedule.before_step(run, 2)
    assert torch.equal(torch.get_rng_state(), rng)  # the conversion draws no global number
    assert [r.keys() for r in run.precision.blocks.state_dict()["ranks"]] == [{"3"}]
    assert [r.keys() for r in built.precision.blocks.state_dict()["ranks"]] == [{"3"}]
    assert_same(
        run.precision.blocks.state_dict(), built.precision.blocks.state_dict(), "generators"
    )
    assert torch.equal(
        run.precision.blocks.layers["3"].rht_signs, built.precision.blocks.layers["3"].rht_signs
    )


def test_fp8_to_nvfp4_keeps_both_sections_with_their_steps():
    run = prepare_run(switched("fp8", "nvfp4", "2", "max_steps=3"))
    train_loop(run, LoopHooks())
    assert (
        run.precision.fp8["steps"] == [1, 2]
        and run.precision.fp8["final_layer_stats"][0]["name"] == "3"
    )
    assert run.precision.blocks.section["steps"] == [3, 3] and list(
        run.precision.blocks.layers
    ) == ["3"]
    assert run.precision.fp8_sync.describe() == {}  # nothing for the ranks to agree on in NVFP4


@pytest.mark.parametrize(("first", "to"), [("nvfp4", "bf16"), ("bf16", "nvfp4")])
def test_a_checkpoint_after_the_switch_restores_the_sections_and_layers(first, to):
    """What restore does before the states load (Switch.load_state_dict): the fresh run takes
    phase 2's layers, and the left format's figures at the switch come from the checkpoint."""
    done = prepare_run(switched(first, to, "2", "max_steps=3"))
    train_loop(done, LoopHooks())
    fresh = prepare_run(switched(first, to, "2", "max_steps=3"))
    assert fresh.schedule.load_state_dict(fresh, done.schedule.state_dict())
    assert layer_types(fresh) == layer_types(done)
    assert (
        list(fresh.precision.blocks.layers)
        == list(done.precision.blocks.layers)
        == ([] if to == "bf16" else ["3"])
    )
    assert fresh.precision.blocks.section == done.precision.blocks.section
    assert ("final_layer_stats" in fresh.precision.blocks.section) == (first == "nvfp4")


@pytest.mark.parametrize(
    ("first", "to", "formats"),
    [(("precision=mxfp8",), "nvfp4", "mxfp8 to nvfp4"),
     (("precision=fp8", "fp8.granularity=blockwise"), "mxfp8", "fp8_blockwise to mxfp8")],
)  # fmt: skip
def test_a_switch_between_two_block_formats_is_refused(first, to, formats):
    cfg = tiny_run(*first, f"precision.switch.to={to}", "precision.switch.at=2", "max_steps=4")
    with pytest.raises(ConfigError) as err:
        prepare_run(cfg)
    assert str(err.value) == (
        f"precision.switch.to={to}: from {formats}: a run has one block format (one blocks "
        "section in its report); switch between a block format (mxfp8, nvfp4, "
        "fp8.granularity=blockwise) and fp32, bf16, fp16 or fp8 (tensorwise, rowwise)"
    )


def test_to_plain_linear_replaces_every_registered_format_and_draws_no_random_number():
    model = nn.Sequential(
        nn.Linear(32, 32), nn.ReLU(), nn.Sequential(nn.Linear(32, 16)), nn.Linear(16, 32)
    )
    recipe = prepare_run(tiny_run("precision=fp8", "max_steps=1")).precision.policy.fp8
    model[0] = Float8Linear.from_linear(model[0], recipe)
    model[2][0] = Float8Linear.from_linear(model[2][0], recipe)
    model[3] = BlockLinear.from_linear(model[3], BlockQuantization("nvfp4"), seed=1)
    weights = [model[0].weight, model[2][0].weight, model[3].weight]
    rng = torch.get_rng_state()
    assert to_plain_linear(model) == ["0", "2.0", "3"]
    assert torch.equal(torch.get_rng_state(), rng)
    assert [type(model[0]), type(model[2][0]), type(model[3])] == [nn.Linear] * 3
    assert [model[0].weight, model[2][0].weight, model[3].weight] == weights
    assert all(issubclass(t, nn.Linear) for f in LAYER_FORMATS.values() for t in f.layer_types)


# ------------------------------------------------------------------------------------ report
def test_report_metrics_and_terminal_name_both_phases(tmp_path, capsys):
    cfg = switched("fp8", "bf16", "0.5", "max_steps=60", "log_every=10", "eval_every=20")
    report = train(cfg, tmp_path)
    sw = report["precision"]["switch"]
    assert report["precision"]["effective"] == "fp8"
    assert (sw["step"], sw["switched_after_step"], sw["from"], sw["to"]) == (30, 30, "fp8", "bf16")
    assert (sw["to_autocast_dtype"], sw["to_loss_scaling"]) == ("bfloat16", False)
    assert sw["window_steps"] == WINDOW_STEPS
    assert sw["train_loss_earlier"] is None  # 30 steps hold no two windows of 20 before it
    before, after = sw["train_loss_before"], sw["train_loss_after"]
    assert (before["steps"], before["count"], after["steps"]) == ([11, 30], 20, [31, 50])
    assert math.isclose(sw["loss_change"], after["mean"] - before["mean"])
    assert sw["eval_before"]["step"] == 20 and sw["eval_after"]["step"] == 40
    assert sw["eval_after"]["val_loss"] == report["evaluation"]["history"][1]["val_loss"]
    # metrics.jsonl: every train row names the precision that computed its steps
    rows = [r for r in read_metrics(tmp_path / "metrics.jsonl") if r["kind"] == "train"]
    assert [(r["step"], r["precision"]) for r in rows] == [
        (10, "fp8"), (20, "fp8"), (30, "fp8"), (40, "bf16"), (50, "bf16"), (60, "bf16")
    ]  # fmt: skip
    # the logged losses are the windows' steps: rows 20 and 30 cover steps 11-30
    assert math.isclose(before["mean"], (rows[1]["loss"] + rows[2]["loss"]) / 2, rel_tol=1e-6)
    assert report["fp8"]["steps"] == [1, 30] and report["fp8"]["final_layer_stats"]
    assert report["throughput"]["comparable"] is False  # phase 1 was emulated FP8
    md = (tmp_path / "report.md").read_text()
    row = next(line for line in md.splitlines() if line.startswith("| precision switch |"))
    assert "fp8 (emulated) -> bf16 (autocast bfloat16, loss scaling off) after step 30" in row
    assert f"(steps 11-30) -> {after['mean']:.4f} (steps 31-50): {sw['loss_change']:+.4f}" in row
    assert "val loss" in row and "(step 20) ->" in row
    said = [line for line in capsys.readouterr().out.splitlines() if "after step 30 of 60" in line]
    assert len(said) == 1 and said[0].startswith("precision: fp8 (emulated) -> bf16")


def test_report_of_nvfp4_then_bf16_says_the_steps_of_the_block_format(tmp_path, capsys):
    """NVIDIA's schedule, shortened: NVFP4 for 85 % of the steps, then BF16."""
    report = train(switched("nvfp4", "bf16", "0.85", "max_steps=20", "log_every=5"), tmp_path)
    sw = report["precision"]["switch"]
    assert (sw["step"], sw["switched_after_step"]) == (17, 17)
    assert (sw["from"], sw["to"]) == ("nvfp4", "bf16")
    blocks = report["blocks"]
    assert blocks["name"] == "NVFP4" and blocks["steps"] == [1, 17]
    (stats,) = blocks["final_layer_stats"]  # the metrics rows of steps 5, 10 and 15
    assert stats["name"] == "3" and stats["input"]["samples"] == 2 * 3
    assert report["fp8"] is None and report["throughput"]["comparable"] is False
    md = (tmp_path / "report.md").read_text()
    row = next(line for line in md.splitlines() if line.startswith("| block format |"))
    assert row.rstrip(" |").endswith("; steps 1-17")
    assert "| 3 | input | 1x16 | 6 |" in md  # the layer table: the counts at the switch
    rows = [r for r in read_metrics(tmp_path / "metrics.jsonl") if r["kind"] == "train"]
    assert [(r["step"], r["precision"]) for r in rows] == [
        (5, "nvfp4"), (10, "nvfp4"), (15, "nvfp4"), (20, "bf16")
    ]  # fmt: skip
    said = [line for line in capsys.readouterr().out.splitlines() if "after step 17 of 20" in line]
    assert said == [
        f"precision: nvfp4 (emulated) -> bf16 (autocast bfloat16, no loss scaling) after step 17 "
        f"of 20; train loss {sw['train_loss_before']['mean']:.4f} over steps 15-17"
    ]


def test_a_run_stopped_before_the_switch_reports_it_not_reached(tmp_path):
    report = train(switched("bf16", "fp32", "8", "max_steps=10", "log_every=1"), tmp_path)
    assert report["precision"]["switch"]["switched_after_step"] == 8
    cfg = switched("bf16", "fp32", "9", "max_steps=10", "epochs=null")
    run = prepare_run(cfg)
    state = train_loop(run, LoopHooks(stop_requested=lambda: True))  # stops after step 1
    assert state.step == 1 and run.precision.policy.name == "bf16"
    described = run.schedule.describe(run, state)
    assert described["switched_after_step"] is None and described["train_loss_after"] is None


# -------------------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["precision=fp8", "precision.switch.to=bf16"],
            "precision.switch.at=None: when to switch to bf16: a share of the run's optimizer "
            "steps in (0, 1), or a whole step number >= 1",
        ),
        (
            ["precision=fp8", "precision.switch.at=0.85"],
            "precision.switch.to=None: to switch at=0.85, name the precision: "
            "fp32, fp16, bf16, fp8, mxfp8, nvfp4, fp16_noscale",
        ),
        (
            ["precision=fp8", "precision.switch.to=bf16_pure", "precision.switch.at=0.5"],
            "precision.switch.to='bf16_pure': a precision with FP32 master weights: fp32, fp16, "
            "bf16, fp8, mxfp8, nvfp4, fp16_noscale (pure precisions keep no FP32 copy of the "
            "weights to switch with)",
        ),
        (
            ["precision=fp8", "precision.switch.to=auto", "precision.switch.at=0.5"],
            "precision.switch.to='auto': a precision with FP32 master weights: fp32, fp16, "
            "bf16, fp8, mxfp8, nvfp4, fp16_noscale",
        ),
        (
            ["precision=fp16_pure", "precision.switch.to=fp16", "precision.switch.at=0.5"],
            "precision='fp16_pure': precision.switch.to=fp16 switches from a named precision "
            "with FP32 master weights: fp32, fp16, bf16, fp8, mxfp8, nvfp4, fp16_noscale (pure "
            "precisions keep no FP32 copy of the weights to switch with)",
        ),
        (
            ["precision=auto", "precision.switch.to=bf16", "precision.switch.at=0.5"],
            "precision='auto': precision.switch.to=bf16 switches from a named precision with "
            "FP32 master weights: fp32, fp16, bf16, fp8, mxfp8, nvfp4, fp16_noscale",
        ),
        (
            ["precision=bf16-mixed", "precision.switch.to=bf16", "precision.switch.at=0.5"],
            "precision.switch.to='bf16': the run already trains in bf16",
        ),
        (
            ["precision=fp8", "precision.switch.to=bf16", "precision.switch.at=1.5"],
            "precision.switch.at=1.5: a share of the run's optimizer steps in (0, 1), or a "
            "whole step number >= 1",
        ),
        (
            ["precision=fp8", "precision.switch.to=bf16", "precision.switch.at=0"],
            "precision.switch.at=0.0: a share of the run's optimizer steps in (0, 1), or a "
            "whole step number >= 1",
        ),
    ],
    ids=["no-at", "no-to", "to-pure", "to-auto", "from-pure", "from-auto", "same", "1.5", "0"],
)
def test_bad_settings_are_refused_in_one_line_naming_the_key(overrides, message):
    with pytest.raises(ConfigError) as err:
        tiny_run(*overrides)
    assert str(err.value) == message


def test_every_precision_offered_has_fp32_master_weights_and_the_pure_ones_none():
    from mptrain.config.options import PRECISION_NAMES
    from mptrain.config.precision import PURE_PRECISIONS

    pure = {n for n in PRECISION_NAMES if PRECISIONS[n].param_dtype != torch.float32}
    assert pure == set(PURE_PRECISIONS)


@pytest.mark.parametrize(
    ("at", "total", "step"), [(0.85, 200, 170), (0.5, 3, 2), (0.5, 2, 1), (7.0, 8, 7), (1.0, 2, 1)]
)
def test_switch_step_is_the_share_rounded_or_the_step_itself(at, total, step):
    assert switch_step(at, total) == step


@pytest.mark.parametrize(
    ("at", "total", "shown"),
    [(0.001, 200, "0.001 x 200 steps = step 0"), (0.999, 200, "0.999 x 200 steps = step 200"),
     (200.0, 200, "step 200"), (500.0, 200, "step 500")],
)  # fmt: skip
def test_a_switch_outside_the_run_is_refused(at, total, shown):
    with pytest.raises(ConfigError) as err:
        switch_step(at, total)
    assert str(err.value) == (
        f"precision.switch.at={at:g}: {shown}, but each precision needs at least one of the "
        f"run's {total} optimizer steps; use a share in (0, 1) or a step from 1 to {total - 1}"
    )


def test_what_cannot_switch_is_refused_when_the_run_is_planned():
    cfg = switched("fp8", "bf16", "3", "max_steps=6")
    policy = prepare_run(cfg).precision.policy
    fsdp = DistContext(strategy="fsdp", world_size=2)
    with pytest.raises(ConfigError, match=r"^precision.switch.to=bf16: not under distributed"):
        plan_switch(cfg, policy, torch.device("cpu"), fsdp, 6)
    with pytest.raises(ConfigError, match=r"^debug.inject_inf_grad_steps=\[5\]: after the switch"):
        prepare_run(
            switched("fp16", "bf16", "3", "max_steps=6", "debug.inject_inf_grad_steps=[2,5]")
        )
    with pytest.raises(ConfigError, match=r"^precision.switch.at=9: step 9, but each"):
        prepare_run(switched("fp8", "bf16", "9", "max_steps=6"))


# ------------------------------------------------------------------------- bit-for-bit resume
def final_checkpoint(run_dir: Path, step: int) -> dict:
    return load_checkpoint(run_dir / "checkpoints" / f"step_{step:08d}.pt")


def assert_same(a, b, where: str) -> None:
    """Equal nested states, tensors bit for bit (torch.equal and the same dtype)."""
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b or (a != a and b != b), f"{where}: {a!r} != {b!r}"


def train_rows(run_dir: Path, after: int) -> list[dict]:
    keep = ("step", "precision", "loss", "lr", "loss_scale", "grad_norm", "skipped")
    rows = read_metrics(run_dir / "metrics.jsonl")
    return [{k: r[k] for k in keep} for r in rows if r["kind"] == "train" and r["step"] > after]


RESUMED = [
    # first, to, extra settings; the switch after step 12 of 24, checkpoints every 4 steps
    ("fp8", "bf16", ("fp8.scaling=delayed", "model.dropout=0.2")),
    ("bf16", "fp8", ("fp8.scaling=delayed",)),
    ("bf16", "fp16", ("precision.scaler.growth_interval=3", "debug.inject_inf_grad_steps=[]")),
    # NVFP4's stochastic-rounding generators: dropped at the switch, or made there and resumed
    ("nvfp4", "bf16", ("model.dropout=0.2",)),
    ("bf16", "nvfp4", ()),
    ("nvfp4", "fp8", ("fp8.scaling=delayed",)),
]


def without_counts(blocks: dict | None) -> dict | None:
    """The blocks section less its counts: counted in buffers a checkpoint does not hold, they
    cover the metrics rows since the run (or its resume) started."""
    return blocks and {k: v for k, v in blocks.items() if k != "final_layer_stats"}


@pytest.mark.slow
@pytest.mark.parametrize(("first", "to", "extra"), RESUMED, ids=[f"{a}-{b}" for a, b, _ in RESUMED])
def test_resume_before_at_and_after_the_switch_is_bit_identical(tmp_path, first, to, extra):
    common = (
        "max_steps=24", "log_every=2", "eval_every=6", "checkpoint.every_steps=4",
        "checkpoint.keep_last=10", *extra,
    )  # fmt: skip
    reference = train(switched(first, to, "0.5", *common), tmp_path / "ref")
    assert reference["precision"]["switch"]["switched_after_step"] == 12
    for stop in (8, 12, 16):  # before, at (phase 1's last step), after the switch
        source = tmp_path / "ref" / "checkpoints" / f"step_{stop:08d}.pt"
        saved = load_checkpoint(source)["precision_switch"]
        assert saved["switched_after"] == (12 if stop > 12 else None)
        out = tmp_path / f"from_{stop}"
        report = train(switched(first, to, "0.5", *common, f"resume={source}"), out)
        assert report["resumed"]["step"] == stop and report["resumed"]["allowed_differences"] == []
        if stop > 12:
            assert report["resumed"]["notes"][0] == (
                f"saved after the precision switch ({first} -> {to} after step 12): resumed in {to}"
            )
        mine, theirs = final_checkpoint(out, 24), final_checkpoint(tmp_path / "ref", 24)
        for part in ("model", "optimizer", "scheduler", "scaler", "loop", "blocks"):
            assert_same(mine[part], theirs[part], f"from step {stop}: {part}")
        switches = mine["precision_switch"], theirs["precision_switch"]
        if first == "nvfp4" and stop <= 12:  # NVFP4 left after the resume: counted since then
            switches = tuple({**sw, "left": without_counts(sw["left"])} for sw in switches)
        assert_same(*switches, f"from step {stop}: precision_switch")
        assert train_rows(out, stop) == train_rows(tmp_path / "ref", stop)
        for section in ("switch", "effective", "autocast_dtype"):
            assert report["precision"][section] == reference["precision"][section], section
        assert report["fp8"] == reference["fp8"]
        assert without_counts(report["blocks"]) == without_counts(reference["blocks"])
        if first == "nvfp4" and stop > 12:  # the figures at the switch, from the checkpoint
            assert report["blocks"] == reference["blocks"]
        assert report["evaluation"] == reference["evaluation"]
        assert report["training"]["loss_scale"] == reference["training"]["loss_scale"]


# ------------------------------------------------------------------------------------- DDP
WORKER = Path(__file__).resolve().parents[1] / "support" / "distributed_worker.py"


def run_two_ranks(tmp_path: Path, *overrides: str) -> tuple[list[dict], dict]:
    """model=mlp under two Gloo ranks: each rank's final state (distributed_worker) and the
    report."""
    common = ("model=mlp", "device=cpu", "progress=false", "threads=1", "batch_size=16")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        str(WORKER), str(tmp_path), *common, *overrides,
    ]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    return ranks, json.loads((tmp_path / "run" / "report.json").read_text())


@pytest.mark.slow
def test_a_switch_into_fp8_under_ddp_keeps_the_ranks_alike(tmp_path):
    """Two Gloo ranks switch BF16 -> FP8 (delayed scaling) after step 2 of 4: the FP8 state the
    ranks agree on is set up at the switch, so both hold the same weights and FP8 buffers, and
    the counters count both ranks' casts of the two FP8 steps."""
    ranks, report = run_two_ranks(
        tmp_path, "precision=bf16", "precision.switch.to=fp8", "precision.switch.at=2",
        "max_steps=4", "fp8.scaling=delayed",
    )  # fmt: skip
    for part in ("params", "buffers"):
        assert_same(ranks[0][part], ranks[1][part], part)
    assert float(ranks[0]["buffers"]["3.input_scaler.seen"]) == 2 * 2 * 16 * 256
    assert report["fp8"]["amax_reduction"].startswith("max over 2 ranks")
    assert report["precision"]["switch"]["switched_after_step"] == 2


@pytest.mark.slow
def test_a_switch_into_nvfp4_under_ddp_keeps_the_ranks_alike(tmp_path):
    """Two Gloo ranks switch BF16 -> NVFP4 after step 2 of 4: the layers made at the switch are
    seeded alike on both ranks (Hadamard signs, generators), and the weights stay equal."""
    ranks, report = run_two_ranks(
        tmp_path, "precision=bf16", "precision.switch.to=nvfp4", "precision.switch.at=2",
        "max_steps=4",
    )  # fmt: skip
    assert_same(ranks[0]["params"], ranks[1]["params"], "params")
    signs = [rank["buffers"]["3.rht_signs"] for rank in ranks]
    assert_same(*signs, "3.rht_signs")
    assert report["blocks"]["steps"] == [3, 4]
    assert report["precision"]["switch"]["switched_after_step"] == 2


def test_a_resume_with_switch_at_before_its_checkpoint_reports_where_it_switched(tmp_path):
    """Issue 39, item 23: a phase-1 checkpoint at step 12 resumed with switch.at=6 (allowed)
    switches after step 12; the report said the first format ran steps 1-6 and compared two
    evaluations of the same format as either side of the switch."""
    common = ("max_steps=20", "log_every=2", "eval_every=4", "checkpoint.every_steps=12")
    train(switched("nvfp4", "bf16", "15", *common, "checkpoint.keep_last=5"), tmp_path / "a")
    step12 = tmp_path / "a" / "checkpoints" / "step_00000012.pt"  # phase 1: NVFP4
    resumed = ("resume_allow_changes=true", f"resume={step12}")
    report = train(switched("nvfp4", "bf16", "6", *common, *resumed), tmp_path / "b")
    sw = report["precision"]["switch"]
    assert (sw["step"], sw["switched_after_step"]) == (6, 12)
    assert report["blocks"]["steps"] == [1, 12]  # NVFP4 ran steps 1-12, not 1-6
    assert sw["eval_before"]["step"] == 12 and sw["eval_after"]["step"] == 16
