"""``mptrain advise``'s "what fits": the line through two accounted steps (checked against an
accounting at a third batch), the largest batch, the cheapest combination that fits, the
torchao states counted without their compiled step, and the part inside advise."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from support.processes import describe, run_mptrain
from support.runs import LM, compose_run, tiny_run

from mptrain.commands.advise import fit_measure, fit_report, fits, footprint, predict
from mptrain.commands.advise.measure import candidates, run_pilots
from mptrain.commands.advise.trials import Budget
from mptrain.perf import gpus
from mptrain.report.rows import fmt_bytes
from mptrain.train.build import prepare_run
from mptrain.train.memory import account_step, fresh_state_bytes

GIB = 2**30


# ------------------------------------------------------------------------------ pure
def test_the_line_through_two_steps_and_the_largest_batch_under_a_budget():
    line = fits.line_through({4: 1_400, 2: 1_200})  # 100 bytes per sample, 1,000 fixed

    assert (line.fixed, line.per_sample) == (1_000, 100)
    assert line.at(64) == 7_400
    assert line.largest_batch(7_400) == 64
    assert line.largest_batch(7_499) == 64
    assert line.largest_batch(1_099) == 0  # not one sample
    assert fits.Line(1_000, 0).largest_batch(5_000) == -1  # no bound from the batch


def test_usable_memory_keeps_back_a_fraction_and_the_cuda_context():
    assert fits.usable_bytes(80) == pytest.approx(80e9 * 0.9 - GIB)


def combos(by_precision: dict[str, dict[str, tuple[float, float]]], states: dict[str, int]):
    lines = {p: {m: fits.Line(*fl) for m, fl in modes.items()} for p, modes in by_precision.items()}
    return fits.combinations(lines, states, "fp32")


def test_the_state_choices_replace_the_accounted_state():
    [fp32, bf16] = combos({"fp32": {"none": (1_000, 10)}}, {"fp32": 400, "bf16": 200})

    assert (fp32.state, fp32.line.fixed) == ("fp32", 1_000)
    assert (bf16.state, bf16.line.fixed, bf16.line.per_sample) == ("bf16", 800, 10)


def test_no_checkpointing_beats_any_then_the_fastest_precision_then_the_fuller_state():
    found = combos(
        {
            "fp32": {"none": (1_000, 10), "full": (1_000, 2)},
            "bf16": {"none": (900, 6), "full": (900, 1)},
        },
        {"fp32": 400, "bf16": 200},
    )
    times = {"fp32": 2.0, "bf16": 1.0}
    faithful = ["fp32", "bf16"]

    def chosen(batch, budget, accepted=faithful):
        c = fits.choose(found, batch, budget, times, accepted)
        return c and (c.precision, c.state, c.checkpointing)

    assert chosen(10, 10_000) == ("bf16", "fp32", "none")  # the fastest that fits whole
    assert chosen(10, 10_000, ["fp32"]) == ("fp32", "fp32", "none")  # bf16 not faithful
    assert chosen(100, 1_500) == ("bf16", "fp32", "none")  # 900 + 600: just
    assert chosen(100, 1_400) == ("bf16", "bf16", "none")  # 700 + 600: states halved
    assert chosen(100, 1_100) == ("bf16", "fp32", "full")  # 900 + 100: recompute
    assert chosen(1_000, 1_200) is None


@pytest.mark.parametrize(
    ("state", "own", "mode", "overrides"),
    [
        ("fp32", "fp32", "none", []),
        ("bf16", "fp32", "none", ["optimizer.state_dtype=bf16"]),
        ("fp32", "bf16", "none", ["optimizer.state_dtype=fp32"]),
        (
            "adamw8bit",
            "fp32",
            "full",
            ["optimizer=adamw8bit", "memory.activation_checkpointing=full"],
        ),
        ("bf16", "adamw8bit", "none", ["optimizer=adamw", "optimizer.state_dtype=bf16"]),
        ("fp32", "adamw4bit", "none", ["optimizer=adamw"]),
    ],
)
def test_a_combination_is_the_overrides_it_adds_to_the_users_own(state, own, mode, overrides):
    c = fits.Combination("bf16", state, mode, fits.Line(0, 0))

    assert fits.combination_overrides(c, own) == overrides


# ------------------------------------------------------------------------------ accounted
@pytest.mark.parametrize(
    "overrides",
    [
        ("model=resnet18", "precision=fp32"),
        ("model=resnet18", "precision=bf16", "memory.activation_checkpointing=selective"),
        (*LM, "precision=bf16"),
        (*LM, "precision=fp32", "memory.activation_checkpointing=full"),
    ],
    ids=["resnet18-fp32", "resnet18-bf16-selective", "gpt-bf16", "gpt-fp32-full"],
)
def test_a_steps_bytes_are_a_line_in_the_batch(overrides):
    """The line through batches 2 and 4 (advise's: one run built at 4, its micro-batch cut to 2
    and copied) gives the same accounting of a run built at batch 8 to the byte; the run's own
    count differs by at most a token per sample: a language model's inputs and targets are two
    views of one window buffer of block_size + 1 tokens, which the cut copies apart."""
    cfg = compose_run("threads=1", *overrides) if "task=lm" in overrides else tiny_run(*overrides)
    points, _ = footprint.account_line(cfg, cfg.memory.activation_checkpointing)
    run_at_8 = prepare_run(dataclasses.replace(cfg, batch_size=8))
    cut_at_8 = account_step(run_at_8, samples=8)["total_bytes"]
    own_at_8 = account_step(run_at_8)["total_bytes"]

    assert fits.line_through({int(b): n for b, n in points.items()}).at(8) == cut_at_8
    assert 0 <= own_at_8 - cut_at_8 <= (8 * 8 if cfg.task == "lm" else 0)


@pytest.mark.slow  # torchao compiles its optimizer step (seconds on a CPU)
def test_torchaos_states_made_without_the_step_are_the_stepped_ones():
    cfg = tiny_run("optimizer=adamw8bit", "model.hidden_sizes=[128]")  # 8,192 weights: quantized
    stepped = account_step(prepare_run(cfg))["bytes"]["optimizer_states"]

    assert fresh_state_bytes(prepare_run(cfg).optimizer) == stepped
    assert stepped["uint8"] == 2 * 8_192  # the two moments of the 128×64 weight, one byte each


# ------------------------------------------------------------------------------ in advise
def test_the_footprint_accounts_each_built_precision_and_the_state_choices():
    cfg = tiny_run("advise.target=h100", "advise.batch_size=256")
    cands = candidates(cfg, torch.device("cpu"))[:3]  # fp32, bf16, fp16
    budget = Budget(120)
    run_pilots(cands, budget, {})
    found = {"candidates": cands, "footprint": footprint.new_footprint()}
    footprint.run_footprint(cfg, cands, budget, {}, found["footprint"])
    out = found["footprint"]

    # BF16 too where this CPU skips it for speed: its bytes on a GPU are what it would hold there
    assert list(out["steps"]) == ["fp32", "bf16", "fp16"]
    assert all(set(pts) == {"2", "4"} for modes in out["steps"].values() for pts in modes.values())
    params = list(prepare_run(cfg).model.parameters())
    counters = 4 * len(params)  # AdamW's step counters: an FP32 scalar per parameter
    assert (out["states"]["bf16"] - counters) * 2 == out["states"]["fp32"] - counters
    assert "no transformer or residual blocks" in out["skipped"]["checkpointing"]
    memory = footprint.assemble(
        cfg, found, None, {"fp32": None, "fp16": "no fidelity run"}, torch.device("cpu")
    )
    fit = memory["target"]["fit"]
    assert fit["combination"] == ["fp32", "fp32", "none"]
    assert (
        fit["bytes"]
        == memory["rows"]["fp32"]["none"]["at_batch_size_bytes"]
        + 192 * (memory["rows"]["fp32"]["none"]["per_sample_bytes"])
    )
    section = "\n".join(fit_report.section(memory))
    assert "## What fits" in section and "largest batch, bf16 states" in section
    assert "What fits h100-sxm at micro-batch 256 (predicted): fp32, fp32 states" in section


def test_the_recommended_combination_is_measured_on_the_target_gpu_only(monkeypatch):
    """Elsewhere the fit stays predicted and advise.json says why; on the target GPU itself (this
    CPU stands in for it: only the device check is replaced) the combination trains 3 steps at
    the asked-for micro-batch and its measured peak goes beside the prediction."""
    cpu = torch.device("cpu")
    cfg = tiny_run("advise.target=h100", "advise.batch_size=256")
    found, verdicts = fitted(cfg, cpu)
    budget = Budget(120)

    fit_measure.measure_fit(cfg, found, verdicts, budget, {}, cpu)
    assert found["footprint"]["measured"] is None
    assert found["footprint"]["skipped"]["measured"] == "advise ran on the cpu, not on a h100-sxm"

    monkeypatch.setattr(predict, "on_gpu", lambda gpu, device: True)
    fit_measure.measure_fit(cfg, found, verdicts, budget, {}, cpu)
    measured = found["footprint"]["measured"]
    assert measured["combination"] == ["fp32", "fp32", "none"]
    assert (measured["batch_size"], measured["steps"]) == (256, fit_measure.CHECK_STEPS)
    assert measured["peak_bytes"] > 0
    memory = footprint.assemble(cfg, found, None, verdicts, cpu)
    assert memory["target"]["fit"]["measured"] == measured
    line = fit_report.fit_lines(memory)[0]
    peak = fmt_bytes(measured["peak_bytes"])
    assert f"Measured on this h100-sxm: peak {peak} at micro-batch 256 over 3 steps" in line


def test_an_out_of_memory_on_the_target_gpu_is_said():
    measured = {"batch_size": 512, "out_of_memory": "CUDA out of memory. Tried to allocate 2 GiB"}
    said = fit_report._measured(measured, "h100-sxm")
    assert said == (
        " Measured on this h100-sxm: out of memory at micro-batch 512 "
        "(CUDA out of memory. Tried to allocate 2 GiB)."
    )


def fitted(cfg, device: torch.device):
    """advise's memory part for FP32 alone, up to the fit: (found, the verdicts)."""
    cands = candidates(cfg, device)[:1]  # fp32
    budget = Budget(120)
    run_pilots(cands, budget, {})
    found = {"candidates": cands, "footprint": footprint.new_footprint()}
    footprint.run_footprint(cfg, cands, budget, {}, found["footprint"])
    return found, {"fp32": None}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_the_target_gpu_the_recommendation_is_measured_there():
    row = gpus.row_for_device_name(torch.cuda.get_device_name())
    if row is None:
        pytest.skip(f"{torch.cuda.get_device_name()} is not in the peak table")
    gpu = torch.device("cuda")
    cfg = tiny_run("device=cuda", f"advise.target={row.key}", "advise.batch_size=512")
    found, verdicts = fitted(cfg, gpu)
    fit_measure.measure_fit(cfg, found, verdicts, Budget(60), {}, gpu)
    measured = found["footprint"]["measured"]
    assert measured["batch_size"] == 512 and "out_of_memory" not in measured, measured
    memory = footprint.assemble(cfg, found, None, verdicts, gpu)
    predicted = memory["target"]["fit"]["bytes"]
    # The accounting counts what one step holds; the allocator's peak adds the data on the
    # device, its block rounding and the optimizer's scratch: the same order of magnitude.
    assert 0.5 < measured["peak_bytes"] / predicted < 4, (measured, predicted)
    assert f"Measured on this {row.key}: peak" in fit_report.fit_lines(memory)[0]


@pytest.mark.slow
def test_advise_says_what_fits_a_gpu_its_cost_and_its_command(tmp_path):
    """The tiny GPT's activations take ~105 KiB a sample without recomputing and ~45 KiB with:
    a million samples fit an H100 only recomputed, so the fit needs checkpointing (its one
    block: selective and full alike) and measures what that costs here."""
    result = run_mptrain(
        tmp_path,
        "advise",
        *LM,
        "threads=1",
        "advise.budget_s=90",
        "advise.seeds=1",
        "advise.plan=false",
        "advise.target=h100",
        "advise.batch_size=1000000",
        "hydra.run.dir=out",
    )
    assert result.returncode == 0, describe(result)
    data = json.loads((tmp_path / "out" / "advise.json").read_text())
    memory = data["memory"]
    fit = memory["target"]["fit"]

    assert set(memory["rows"]["fp32"]) == {"none", "selective", "full"}
    assert fit["combination"][1:] == ["fp32", "selective"]
    assert (
        fit["bytes"]
        <= memory["target"]["usable_bytes"]
        < memory["rows"]["fp32"]["none"]["per_sample_bytes"] * 1_000_000
    )
    assert fit["command"].startswith(f"mptrain precision={fit['combination'][0]} ")
    assert fit["command"].endswith("batch_size=1000000 memory.activation_checkpointing=selective")
    cost = fit.get("speed_cost")
    if cost is None:  # the budget decides; then the reason is given
        assert memory["skipped"]["speed cost"]
    else:
        assert cost["reps"] >= 1 and cost["step_time_vs_alone"] > 0.5
    assert "What fits h100-sxm at micro-batch 1,000,000 (predicted)" in result.stdout
