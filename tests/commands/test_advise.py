"""``mptrain advise``: the decision on hand-made measurements (ties, noise, divergence, emulated
FP8, FP16 overflow), the budget's bookkeeping, and end-to-end runs on tiny models (CPU-only)."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from support.processes import describe, run_mptrain
from support.runs import LM, run_cli, tiny_run

from mptrain.commands import bench
from mptrain.commands.advise import choices, measure, run, trials
from mptrain.commands.advise import report as advise_report
from mptrain.commands.advise.decide import (
    Context,
    Fidelity,
    Measured,
    Speed,
    disqualified,
    fidelity_of,
    recommend,
    relative_differences,
)
from mptrain.output import plots
from mptrain.platform import hardware
from mptrain.train.build import prepare_run

CTX = Context(tolerance=0.05, max_skipped_fraction=0.1)
CLOSE = Fidelity(steps=40, max_rel_diff=0.01, final_rel_diff=0.005)
FP32 = Measured("fp32", speed=Speed(1.0, 1.0, 1.0), fidelity=Fidelity(40, 0.0, 0.0))


def faster(name: str, ratio: float, spread: float = 0.05, **kwargs) -> Measured:
    """A precision measured ``ratio``× FP32 (± ``spread``), close to FP32's loss unless told."""
    kwargs.setdefault("fidelity", CLOSE)
    return Measured(name, speed=Speed(ratio, ratio - spread, ratio + spread), **kwargs)


def lost(advice, name: str) -> str:
    return dict(advice.runners_up)[name]


# ------------------------------------------------------------------------------ the decision
def test_the_fastest_faithful_precision_wins_and_fp32_is_a_runner_up():
    advice = recommend([FP32, faster("bf16", 1.8), faster("fp16", 1.3)], CTX)

    assert advice.precision == "bf16"
    assert "1.80× FP32" in advice.reasons[0]
    assert "slower than bf16" in lost(advice, "fp16")
    assert "the reference" in lost(advice, "fp32")


def test_a_tie_goes_to_the_simpler_recipe():
    # FP16's median is higher but its range overlaps BF16's: no loss scaler beats one.
    advice = recommend([FP32, faster("fp16", 1.55, 0.1), faster("bf16", 1.5, 0.1)], CTX)

    assert advice.precision == "bf16"
    assert "ties with bf16" in lost(advice, "fp16")


def test_noisy_speed_overlapping_fp32_is_not_faster():
    advice = recommend([FP32, faster("bf16", 1.3, spread=0.4)], CTX)  # range 0.9–1.7

    assert advice.precision == "fp32"
    assert "not measurably faster" in lost(advice, "bf16")


def test_a_slower_precision_says_so():
    advice = recommend([FP32, faster("fp16", 0.07, spread=0.02)], CTX)

    assert advice.precision == "fp32"
    assert lost(advice, "fp16").startswith("slower here: 0.07×")


def test_a_faster_precision_that_diverges_loses_to_a_slower_faithful_one():
    drifting = Fidelity(40, max_rel_diff=0.4, final_rel_diff=0.4)
    diverged = Fidelity(40, math.inf, math.inf, diverged="loss became nan at step 7")
    advice = recommend(
        [
            FP32,
            faster("fp16", 3.0, fidelity=diverged),
            faster("fp8", 2.5, fidelity=drifting),
            faster("bf16", 1.4),
        ],
        Context(tolerance=0.05, device_type="cuda"),
    )

    assert advice.precision == "bf16"
    assert "diverged" in lost(advice, "fp16") and "nan at step 7" in lost(advice, "fp16")
    assert "leaves FP32's by up to 40.0%" in lost(advice, "fp8")


@pytest.mark.parametrize(
    ("spread", "wins"),
    [(None, "fp32"), (0.01, "fp32"), (0.25, "bf16"), (0.15, "fp32"), (math.inf, "fp32")],
    ids=["not-measured", "calm", "chaotic", "not-chaotic-enough", "nudge-diverged"],
)
def test_fp32s_own_spread_under_a_one_ulp_nudge_widens_the_allowance(spread, wins):
    """A training that forks by 25% when FP32's weights move by one ulp cannot blame a 40%
    difference on the precision (2 x 25% = 50% allowed); at 15% (30% allowed), or calm, it can.
    A nudged run that diverged gives no allowance."""
    drifting = Fidelity(40, max_rel_diff=0.4, final_rel_diff=0.3)
    ctx = Context(tolerance=0.05, fp32_spread=spread)
    advice = recommend([FP32, faster("bf16", 1.5, fidelity=drifting)], ctx)

    assert advice.precision == wins
    if wins == "fp32":
        assert "leaves FP32's by up to 40.0%" in lost(advice, "bf16")
    else:
        assert any(
            "allowed 50%: 2× FP32's own 25.0% under a one-ulp nudge" in r for r in advice.reasons
        )


def test_the_nudge_moves_every_weight_by_one_or_two_ulps():
    """× (1 ± 2⁻²³): a relative step of one FP32 epsilon, one ulp near a power of two and two
    just below the next one."""
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    before = [p.detach().clone() for p in model.parameters()]
    trials.nudge_weights(model)
    for old, new in zip(before, model.parameters(), strict=True):
        ulp = torch.nextafter(old.abs(), torch.tensor(math.inf)) - old.abs()
        ulps = ((new.detach() - old).abs() / ulp).round()
        assert set(ulps.unique().tolist()) <= {1.0, 2.0}, ulps.unique()


def test_lost_updates_disqualify():
    skipping = Fidelity(40, 0.01, 0.01, skipped_steps=6)

    assert "lost updates: 6 of 40" in disqualified(faster("fp16", 2.0, fidelity=skipping), CTX)
    assert disqualified(faster("fp16", 2.0, fidelity=Fidelity(40, 0.01, 0.01, 4)), CTX) is None


def test_emulated_fp8_is_never_recommended_for_speed():
    fp8 = faster("fp8", 5.0, emulated=True)  # even with a (meaningless) speed
    advice = recommend([FP32, fp8], CTX)

    assert advice.precision == "fp32"
    assert "only emulated" in lost(advice, "fp8")
    refused = Measured("fp8", not_run="no Linear layer can run in FP8", emulated=True)
    assert "no Linear layer" in disqualified(refused, CTX)  # why it did not even run


def test_fp16_forward_overflow_names_the_layer_and_the_fixes():
    fp16 = faster("fp16", 2.0, fp16_overflow=("blocks.3.mlp",))
    advice = recommend([FP32, fp16, faster("bf16", 1.2, spread=0.5)], CTX)

    assert advice.precision == "fp32"
    assert "overflows in the forward at blocks.3.mlp" in lost(advice, "fp16")
    assert any("numerics.fp32_modules=[blocks.3.mlp]" in f for f in advice.fixes)
    assert any(f.startswith("precision=bf16") for f in advice.fixes)
    unmeasured = Measured("fp16", not_run="over budget", fp16_overflow=("boost",))
    assert "overflows in the forward at boost" in disqualified(unmeasured, CTX)  # the probe's word


def test_an_unmeasured_precision_cannot_win():
    advice = recommend(
        [
            FP32,
            Measured("bf16", speed=Speed(2, 1.9, 2.1), fidelity_note="over budget"),
            Measured("fp16", not_run="estimated 300 s from its measured pilot"),
        ],
        CTX,
    )

    assert advice.precision == "fp32"
    assert "fidelity not measured (over budget)" in lost(advice, "bf16")
    assert "estimated 300 s" in lost(advice, "fp16")


def test_channels_last_is_suggested_for_convolutions_on_a_gpu_only():
    gpu = Context(device_type="cuda", has_convolutions=True)
    assert any("channels_last=true" in f for f in recommend([FP32], gpu).fixes)
    assert not recommend([FP32], Context(device_type="cpu", has_convolutions=True)).fixes


def test_relative_differences_are_windowed_and_inf_where_not_finite():
    ref = [2.0, 2.0, 1.0, 1.0]
    assert relative_differences([2.2, 1.8, 1.1, 1.1], ref, window=2) == pytest.approx([0.0, 0.1])
    assert relative_differences([2.0, math.nan, 1.0, 1.0], ref, window=2)[0] == math.inf
    stopped = fidelity_of([2.0, 2.0], ref, skipped_steps=0, diverged=None)
    assert stopped.diverged == "stopped after 2 of 4 steps"


# ------------------------------------------------------------------------------ the budget
def test_costs_come_from_the_measured_trial():
    trial = trials.Trial("fp16", 6, [1.0] * 6, 0, None, step_time_s=0.5, wall_s=4.0)
    cost = trials.cost_of(trial)

    assert cost.step_s == 0.5 and cost.overhead_s == pytest.approx(1.0)
    assert cost.of(10) == pytest.approx(6.0)


@pytest.mark.parametrize(("small_s", "skipped"), [(0.3, True), (0.01, False)])
def test_the_scout_skips_a_precision_whose_fidelity_run_cannot_fit(monkeypatch, small_s, skipped):
    monkeypatch.setattr(measure, "scout", lambda cfg: small_s)
    pilots = []
    monkeypatch.setattr(measure, "short_run", lambda *args, **kwargs: pilots.append(args))
    fp16 = measure.Candidate("fp16", cfg=tiny_cfg(fidelity_steps=40), timed=True)
    fp32_steps = measure.Yardstick(small_s=0.01, full_s=0.08)  # 8× on the full batch

    measure.pilot_one(fp16, trials.Budget(100.0), share_s=30.0, yardstick=fp32_steps)

    assert bool(fp16.skipped) == skipped and len(pilots) == (not skipped)
    if skipped:  # 40 steps of 30× FP32's 0.08 s cannot fit ~95 s: said with the figures
        assert "scout step took 30.0× FP32's" in fp16.skipped["all"]
        assert "40-step fidelity run (~96 s)" in fp16.skipped["all"]


def tiny_cfg(**advise_settings):
    from mptrain.config.commands import AdviseConfig

    class Cfg:  # only what pilot_one reads
        advise = AdviseConfig(**advise_settings)

    return Cfg()


@pytest.mark.parametrize("fp8_gemm", [True, False])
def test_gpu_candidates_add_tf32_and_label_fp8_by_the_hardware(monkeypatch, fp8_gemm):
    monkeypatch.setattr(hardware, "cuda_has_native_bf16", lambda device: True)
    monkeypatch.setattr(bench, "fp8_gemm_available", lambda device: fp8_gemm)
    cands = measure.candidates(tiny_run(), torch.device("cuda"))
    by_name = {c.name: c for c in cands}

    fp8s = ["fp8", "fp8-rowwise", "fp8-delayed", "fp8-pow2"]
    blocks = ["fp8-blockwise", "mxfp8", "nvfp4"]  # CUDA not available: no block-scaled kernel
    assert list(by_name) == ["fp32", "tf32", "fp16", "bf16", *fp8s, *blocks]
    assert by_name["tf32"].cfg.precision.allow_tf32 and by_name["tf32"].timed
    for name in fp8s:
        assert by_name[name].emulated == (not fp8_gemm) and by_name[name].timed == fp8_gemm
    for name in blocks:
        assert by_name[name].emulated and not by_name[name].timed
    assert not any(c.skipped for c in cands)  # FP8 without FP8 GEMMs: emulated, not skipped
    assert by_name["fp8"].label == "fp8 tensorwise" + ("" if fp8_gemm else " (emulated)")


def test_every_fp8_recipe_is_a_candidate_with_its_keys_and_the_users_others():
    """Each recipe sets its three axes whatever the user's were (fp8.granularity=rowwise given)
    and keeps the user's other FP8 keys (format, margin)."""
    cfg = tiny_run("fp8.granularity=rowwise", "fp8.format=e4m3", "fp8.margin=1")
    by_name = {c.name: c for c in measure.candidates(cfg, torch.device("cpu"))}
    axes = {
        name: (c.cfg.fp8.granularity, c.cfg.fp8.scaling, c.cfg.fp8.pow2_scales)
        for name, c in by_name.items()
        if c.cfg.precision.name == "fp8"
    }

    assert axes == {
        "fp8": ("tensorwise", "dynamic", False),
        "fp8-rowwise": ("rowwise", "dynamic", False),
        "fp8-delayed": ("tensorwise", "delayed", False),
        "fp8-pow2": ("tensorwise", "dynamic", True),
        "fp8-blockwise": ("blockwise", "dynamic", False),
    }
    assert by_name["mxfp8"].cfg.precision.name == "mxfp8"
    assert by_name["nvfp4"].cfg.precision.name == "nvfp4"
    assert all(by_name[n].cfg.fp8.format == "e4m3" and by_name[n].cfg.fp8.margin == 1 for n in axes)
    assert by_name["fp8-rowwise"].label == "fp8 rowwise (emulated)"
    assert by_name["bf16"].cfg.fp8.granularity == "rowwise"  # unused there: left as given
    assert all(not by_name[n].timed and not by_name[n].skipped for n in axes)


def test_a_recipe_the_users_keys_rule_out_is_skipped_in_their_words():
    """torchao runs dynamic scaling only: the delayed recipe is listed, not run (elsewhere
    the torchao backend refuses a CPU when the pilot builds it)."""
    cfg = tiny_run("fp8.backend=torchao")
    by_name = {c.name: c for c in measure.candidates(cfg, torch.device("cpu"))}

    assert "scales dynamically only" in by_name["fp8-delayed"].skipped["all"]
    assert not by_name["fp8-rowwise"].skipped


def test_every_recipe_names_hardware_advise_can_check():
    for r in choices.LOW_PRECISION:
        assert r.needs in measure.HARDWARE, r
    assert set(choices.SIMPLICITY) == set(choices.CHOICES)
    names = [b for b in choices.BASE] + list(choices.LOW_PRECISION)
    assert len({r.name for r in names}) == len(names)


def test_a_cpu_without_native_bf16_skips_it_and_keeps_fp16_for_convolutions(monkeypatch):
    monkeypatch.setattr(hardware, "cpu_has_native_bf16", lambda: False)
    by_name = {c.name: c for c in measure.candidates(tiny_run("model=cnn"), torch.device("cpu"))}

    assert "no native BF16" in by_name["bf16"].skipped["all"]
    assert not by_name["fp16"].skipped  # measured (the scout and pilot say how slow), not assumed


def test_the_command_keeps_the_users_overrides_but_not_advises_own():
    command = run.command_for(
        [
            "model=mlp",
            "precision=fp16",
            "advise.budget_s=30",
            "hydra.run.dir=x",
            "model.hidden_sizes=[32, 32]",
        ],
        "bf16",
    )
    assert command == "mptrain precision=bf16 model=mlp 'model.hidden_sizes=[32, 32]'"


@pytest.mark.parametrize(
    ("name", "command"),
    [
        (
            "tf32",  # the FP8 keys it does not set are the user's, unused by TF32
            "mptrain precision=fp32 precision.allow_tf32=true model=mlp fp8.granularity=rowwise "
            "fp8.margin=1",
        ),
        ("fp8", "mptrain precision=fp8 model=mlp fp8.margin=1"),
        ("fp8-rowwise", "mptrain precision=fp8 fp8.granularity=rowwise model=mlp fp8.margin=1"),
        ("fp8-delayed", "mptrain precision=fp8 fp8.scaling=delayed model=mlp fp8.margin=1"),
        ("fp8-pow2", "mptrain precision=fp8 fp8.pow2_scales=true model=mlp fp8.margin=1"),
    ],
)
def test_each_recipes_command_sets_its_keys_and_drops_the_users_of_them(name, command):
    """The user's own fp8.granularity is dropped (the recipe decides it; its default is
    tensorwise), their fp8.margin kept; TF32 is FP32 with TF32 allowed (no precision=tf32), and
    only there: every recipe was measured with TF32 off unless it turns it on."""
    given = ["model=mlp", "fp8.granularity=rowwise", "fp8.margin=1", "precision.allow_tf32=true"]
    assert run.command_for(given, name) == command


# ------------------------------------------------------------------------------ end to end
TINY = ("device=cpu", "advise.budget_s=20", "advise.fidelity_steps=12", "advise.speed_steps=5")


@pytest.mark.slow
def test_advise_mlp_writes_the_advice_its_evidence_and_the_figure(tmp_path):
    budget = "advise.budget_s=30"  # FP32's runs fit even with other jobs on the cores
    # the seeds and the layer plan have tests of their own: here the budget goes to the table
    only_table = ("advise.seeds=1", "advise.plan=false")
    result = run_mptrain(
        tmp_path, "advise", "model=mlp", *TINY, budget, *only_table, "hydra.run.dir=out"
    )
    assert result.returncode == 0, describe(result)
    out = tmp_path / "out"
    data = json.loads((out / "advise.json").read_text())
    markdown = (out / "advise.md").read_text()
    rec = data["recommendation"]

    assert rec["precision"] in ("fp32", "bf16", "fp16")
    assert rec["command"].startswith(f"mptrain precision={rec['precision']} model=mlp")
    assert markdown.index("**Recommendation:") < markdown.index("## Evidence")
    assert f"**Recommendation: {rec['precision']}**" in result.stdout  # piped: plain text
    assert "\x1b[" not in result.stdout
    rows = {r["precision"]: r for r in data["precisions"]}
    fp8s = {
        "fp8": ("fp8 tensorwise", "precision=fp8"),
        "fp8-rowwise": ("fp8 rowwise", "precision=fp8 fp8.granularity=rowwise"),
        "fp8-delayed": ("fp8 delayed", "precision=fp8 fp8.scaling=delayed"),
        "fp8-pow2": ("fp8 pow2 scales", "precision=fp8 fp8.pow2_scales=true"),
    }
    assert list(rows)[: 3 + len(fp8s)] == ["fp32", "bf16", "fp16", *fp8s]
    # then the block-scaled formats, as far as the budget went
    assert set(list(rows)[3 + len(fp8s) :]) <= {"fp8-blockwise", "mxfp8", "nvfp4"}
    runners_up = {r["precision"]: r for r in rec["runners_up"]}
    for name, (label, keys) in fp8s.items():  # each in the table, with the command that runs it
        command = f"mptrain {keys} model=mlp device=cpu"
        assert rows[name]["emulated"] and rows[name]["speed"] is None
        assert rows[name]["command"] == runners_up[name]["command"] == command
        assert f"\n| {label} (emulated) | not " in markdown
        assert "only emulated" in runners_up[name]["why"]
        assert f"- {name}: {runners_up[name]['why']} (`{command}`)" in markdown
    assert rows["fp32"]["fidelity"]["max_rel_diff"] == 0.0
    assert len(rows["fp32"]["losses"]) == 12
    assert data["elapsed_s"] <= 30  # the budget, and the process's own start-up
    assert (out / "advise.png").stat().st_size > 10_000


OVERFLOW_NET = '''
from torch import nn


class OverflowNet(nn.Module):
    """Its ``boost`` layer multiplies activations far past FP16's 65504."""

    def __init__(self, in_channels: int, num_classes: int) -> None:
        super().__init__()
        self.flatten = nn.Flatten()
        self.body = nn.Linear(in_channels * 64, 32)
        self.boost = nn.Linear(32, 32)
        self.head = nn.Linear(32, num_classes)
        with torch.no_grad():
            self.boost.weight.mul_(1e5)

    def forward(self, x):
        return self.head(self.boost(self.body(self.flatten(x)).relu()) * 1e-5)
'''


@pytest.mark.slow
def test_a_model_that_overflows_fp16_gets_the_layer_named_and_a_fix(tmp_path):
    (tmp_path / "overflow_net.py").write_text("import torch\n" + textwrap.dedent(OVERFLOW_NET))
    result = run_mptrain(
        tmp_path,
        "advise",
        "model=custom",
        "model._target_=overflow_net.OverflowNet",
        *TINY,
        "hydra.run.dir=out",
    )
    assert result.returncode == 0, describe(result)
    data = json.loads((tmp_path / "out" / "advise.json").read_text())
    rec = data["recommendation"]

    assert rec["precision"] != "fp16"
    fp16_row = next(r for r in data["precisions"] if r["precision"] == "fp16")
    assert fp16_row["speed"] is None  # diverged (or not measured): not timed
    assert data["numerics"]["fp16_probe"]["overflow_modules"] == ["boost"]
    fp16 = next(r["why"] for r in rec["runners_up"] if r["precision"] == "fp16")
    assert "overflows in the forward at boost" in fp16
    assert any("numerics.fp32_modules=[boost]" in f for f in rec["fixes"])
    assert rec["precision"] == "bf16" or any(f.startswith("precision=bf16") for f in rec["fixes"])


@pytest.mark.slow
def test_advise_a_language_model_measures_or_says_why_not(tmp_path):
    tiny = [o for o in LM if not o.startswith(("progress", "log_every", "throughput"))]
    result = run_mptrain(tmp_path, "advise", *tiny, *TINY[1:], "hydra.run.dir=out")
    assert result.returncode == 0, describe(result)
    data = json.loads((tmp_path / "out" / "advise.json").read_text())

    assert data["task"] == "lm"
    assert data["recommendation"]["command"].startswith(
        f"mptrain precision={data['recommendation']['precision']} task=lm"
    )
    for row in data["precisions"]:  # a busy machine may not fit everything: then it says why
        assert row["speed"] or row["skipped"] or row["emulated"], row
        if row["speed"]:
            assert row["speed"]["tokens_per_s"] == pytest.approx(row["speed"]["samples_per_s"] * 32)


def test_the_table_gives_tokens_per_second_for_language_models():
    speed = {
        "samples_per_s": 10.0,
        "samples_per_s_range": [9.0, 11.0],
        "tokens_per_s": 320.0,
        "tokens_per_s_range": [288.0, 352.0],
        "vs_fp32": 1.5,
        "vs_fp32_range": [1.4, 1.6],
        "vs_fp32_noisy": None,
        "peak_memory_bytes": 2**20,
    }
    row = {"precision": "bf16", "speed": speed, "skipped": {}, "emulated": False}

    assert advise_report._speed_cells(row, lm=True) == [
        "320 tokens/s (288–352)",
        "1.50× (1.40–1.60)",
        "1.0 MiB",
    ]
    assert advise_report._speed_cells(row, lm=False)[0] == "10 samples/s (9–11)"
    alone = {k: v for k, v in speed.items() if not k.startswith("vs_")}  # FP32 cut short
    assert advise_report._speed_cells({**row, "speed": alone}, lm=False)[1] == "n/a: FP32 not timed"


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("advise.budget_s=0", "advise.budget_s=0.0: must be > 0 and finite"),
        ("advise.tolerance=-1", "advise.tolerance=-1.0: must be > 0 and finite"),
        ("advise.reps=0", "advise.reps=0: must be an integer >= 1"),
        ("advise.max_skipped_fraction=1", "advise.max_skipped_fraction=1.0: must be in [0, 1)"),
        ("advise.seeds=0", "advise.seeds='0': auto (as many seeds as the budget affords) or a"),
        ("advise.seeds=many", "advise.seeds='many': auto (as many seeds"),
        ("advise.alpha=0.5", "advise.alpha=0.5: must be in the open interval (0, 0.5)"),
        ("--multirun", "takes config overrides"),
    ],
)
def test_bad_input_is_one_line_naming_the_key(tmp_path, monkeypatch, override, message):
    result = run_cli(["advise", "model=mlp", override], tmp_path, monkeypatch)  # in this process

    assert result.code == 2, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mptrain: error: "), result.stderr
    assert message in lines[0]


# ------------------------------------------------------------------------------ cut short
def test_with_fp32_unmeasured_nothing_is_recommended_as_if_measured():
    """Issue 27, item 15: a budget that measured nothing worded its verdict as if it had ("no
    other precision is measurably faster") for a model whose FP16 overflows."""
    advice = recommend(
        [
            Measured("fp32", not_run="no advise.budget_s left"),
            Measured("fp16", not_run="no advise.budget_s left", fp16_overflow=("boost",)),
        ],
        CTX,
    )

    assert not advice.measured
    assert advice.reasons == ("nothing measured within the budget; raise advise.budget_s",)
    assert "overflows in the forward at boost" in lost(advice, "fp16")  # the probe did measure
    alone = recommend([FP32, Measured("bf16", not_run="no advise.budget_s left")], CTX)
    assert alone.measured and "no other precision was compared" in alone.reasons[0]


def test_no_run_starts_that_the_budget_cannot_fit(monkeypatch):
    """Issue 27, item 15: ``budget_s=5`` took 42 s. Nothing starts once nothing is left (the
    process warm-up included), and no pilot whose set-up and first step, estimated from the last
    run, cannot fit what is left."""
    monkeypatch.setattr(hardware, "cpu_has_native_bf16", lambda: True)  # BF16 is a candidate
    runs = []
    slow = trials.Trial("fp32", 2, [1.0, 1.0], 0, None, step_time_s=None, wall_s=60.0)
    monkeypatch.setattr(measure, "short_run", lambda *a, **k: runs.append(a) or slow)
    cands = measure.candidates(tiny_run(), torch.device("cpu"))

    measure.run_pilots(cands, trials.Budget(5.0), {})  # 5 s: all kept for the report
    assert runs == []
    assert all("no advise.budget_s left after" in c.skipped["all"] for c in cands)

    cands = measure.candidates(tiny_run(), torch.device("cpu"))
    measure.run_pilots(cands, trials.Budget(30.0), {})  # the warm-up: 30 s a step, ~25 s left
    assert len(runs) == 1
    assert "set-up and first step (~30.0 s" in cands[0].skipped["all"]


def test_a_budget_too_small_to_measure_says_so_and_how_long_it_took(tmp_path, monkeypatch):
    outcome = run_cli(
        ["advise", "model=mlp", "device=cpu", "advise.budget_s=5", "hydra.run.dir=out"],
        tmp_path,
        monkeypatch,
    )
    assert outcome.code == 0, outcome
    data = json.loads((tmp_path / "out" / "advise.json").read_text())
    markdown = (tmp_path / "out" / "advise.md").read_text()

    assert not data["recommendation"]["measured"]
    assert "**No recommendation**" in markdown and "Train with it" not in markdown
    assert "- nothing measured within the budget; raise advise.budget_s" in markdown
    assert {trials.START_UP, trials.REPORT} <= set(data["timings_s"])
    # start-up and the report are fixed costs no budget cuts: on a loaded machine they overrun it
    took, over = data["elapsed_s"], data["elapsed_s"] - 5
    if over > 0:
        assert f"Time: {took:.1f} s against a 5 s budget: {over:.1f} s over" in markdown
    else:
        assert f"Time: {took:.1f} s of a 5 s budget" in markdown
    assert "Fixed costs in it, which no budget cuts: start-up (config, imports)" in markdown


@pytest.fixture
def stop_signals_handled():
    """The stop signals' handlers put back after the test, and never the default action while it
    runs: a signal a test sends itself must not end pytest."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGHUP)}
    for sig in saved:
        signal.signal(sig, lambda signum, frame: pytest.fail(f"{signum} reached the test"))
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def send(sig: int) -> None:
    assert signal.getsignal(sig) not in (signal.SIG_DFL, signal.SIG_IGN)
    os.kill(os.getpid(), sig)


@pytest.mark.slow
def test_an_interrupted_advise_writes_what_it_measured(tmp_path, monkeypatch, stop_signals_handled):
    """Issue 27, item 8: SIGHUP during FP16's pilot; a SIGTERM while the partial advice is
    written does not cut it short; exit 129, the file named on one line."""
    real_run, real_write = measure.short_run, advise_report.write

    def short_run(cfg, steps, *args, **kwargs):
        if steps == trials.PILOT_STEPS and cfg.precision.name == "fp16":
            send(signal.SIGHUP)
        return real_run(cfg, steps, *args, **kwargs)

    def write(*args):
        send(signal.SIGTERM)
        real_write(*args)

    monkeypatch.setattr(measure, "short_run", short_run)
    monkeypatch.setattr(advise_report, "write", write)
    monkeypatch.setattr(plots, "plot_advice", lambda *args: None)  # not this test's subject
    args = ["advise", "model=mlp", *TINY, "advise.budget_s=60", "hydra.run.dir=out"]
    outcome = run_cli(args, tmp_path, monkeypatch)

    out = tmp_path / "out"
    assert outcome.code == 129, outcome
    assert outcome.stderr.strip().splitlines() == [
        f"mptrain: advise interrupted by SIGHUP; what was measured: {Path('out') / 'advise.md'}"
    ]
    data = json.loads((out / "advise.json").read_text())
    markdown = (out / "advise.md").read_text()
    assert data["interrupted"]["signal"] == "SIGHUP"
    assert data["interrupted"]["during"] == "pilot fp16"
    rows = {r["precision"]: r for r in data["precisions"]}
    assert rows["fp32"]["pilot"] is not None  # measured before the signal: kept
    assert rows["fp32"]["skipped"] == {
        "fidelity and speed": "interrupted by SIGHUP during pilot fp16"
    }
    assert rows["fp16"]["skipped"] == {"all": "interrupted by SIGHUP during pilot fp16"}
    # the candidates the signal stopped share one line (concise.grouped_parts): fp8 among them
    assert (
        "- fp16, fp8, fp8-rowwise, fp8-delayed, fp8-pow2, fp8-blockwise, mxfp8, nvfp4 "
        "(8 precisions): interrupted by SIGHUP during pilot fp16"
    ) in markdown.splitlines()
    assert "Interrupted by SIGHUP after" in markdown
    assert "- nothing measured before SIGHUP interrupted advise" in markdown
    assert not [p.name for p in out.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_stop_signal_and_a_burst_after_it_keep_the_partial_advice(tmp_path, sig):
    """Issue 27, item 8, with real signals to a real process: the first stops the measuring, the
    burst after it (``timeout -k``, an impatient user) cannot cut the partial advice short."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    args = ["model=mlp", *TINY, "advise.budget_s=120", "hydra.run.dir=out"]
    process = subprocess.Popen(
        [sys.executable, "-m", "mptrain", "advise", *args],
        cwd=tmp_path,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while not (tmp_path / "out").is_dir() and time.monotonic() < deadline:
        time.sleep(0.05)  # the directory appears once the handlers are in and measuring starts
    time.sleep(0.5)
    for signum in (sig, signal.SIGTERM, signal.SIGTERM, signal.SIGTERM):
        process.send_signal(signum)
        time.sleep(0.05)
    stdout, stderr = process.communicate(timeout=60)

    assert process.returncode == 128 + sig, f"{process.returncode}\n{stdout}\n{stderr}"
    name = signal.Signals(sig).name
    assert f"mptrain: advise interrupted by {name}; what was measured: " in stderr
    data = json.loads((tmp_path / "out" / "advise.json").read_text())
    assert data["interrupted"]["signal"] == name
    assert f"Interrupted by {name} after" in (tmp_path / "out" / "advise.md").read_text()


def test_the_numerics_column_gives_each_recipe_its_own_layer_choice():
    """A block-scaled recipe's cell counts its own layers (mx.*, nvfp4.* keys), not FP8's."""
    fp8 = {"layers": [{"converted": True}] * 3, "converted_linear_flops_share": 1.0}
    mx = prepare_run(
        tiny_run("precision=mxfp8", "mx.keep_first_last=true")
    ).precision.blocks.section
    numerics = {"fp16_probe": None, "audit": {}, "fp8": fp8, "blocks": {"mxfp8": mx}}

    def count(section: dict) -> str:
        converted = sum(layer["converted"] for layer in section["layers"])
        return f"{converted} of {len(section['layers'])} Linear layers in"

    assert advise_report.numerics_cell("fp8-rowwise", numerics).startswith(f"{count(fp8)} FP8, ")
    mx_cell = advise_report.numerics_cell("mxfp8", numerics)
    assert mx_cell.startswith(f"{count(mx)} MXFP8, ") and count(mx) != count(fp8)
    assert mx_cell.endswith(f"{mx['converted_linear_flops_share']:.0%} of Linear FLOPs")
    assert advise_report.numerics_cell("fp8-blockwise", numerics) == ""  # its pilot did not run


def test_a_second_advise_into_a_directory_in_use_is_refused(tmp_path, monkeypatch):
    """Issue 39, item 25: two advise commands into one directory both "succeeded" and the first
    result was overwritten without a word."""
    from mptrain.rundir.lock import RunDirLock

    (tmp_path / "adv").mkdir()
    with RunDirLock(tmp_path / "adv", kind="advise"):  # the first advise, still measuring
        outcome = run_cli(
            ["advise", "model=mlp", "hydra.run.dir=adv"], tmp_path, monkeypatch, jobs=True
        )
    assert outcome.code == 2, outcome
    assert outcome.stderr.startswith("mptrain: error: advise directory adv: in use by another")
    assert not (tmp_path / "adv" / "advise.json").exists()
