"""The roofline of a per-GEMM plan (``precision.gemms``) on hand-computed cases: a GEMM lifted to
BF16 priced at the BF16 peak with the FP8 casts it no longer needs taken off, an NVFP4 layer's
MXFP8 weight gradient at MXFP8's peak with its own block scales, ``precision.gemms.layers``
changing only the layers it names, a plan between all-FP8 and all-BF16, an all-null plan
predicting what no plan does, and advise's predicted speed of its per-layer and per-GEMM plans."""

from __future__ import annotations

import json

import pytest
import torch
from support.runs import run_cli, tiny_run
from test_roofline import BANDWIDTH, BF16_PEAK, FP8_PEAK, linear_gemm, meta
from torch import nn

from mptrain.commands.advise import choices, measure
from mptrain.commands.advise import gemms as advise_gemms
from mptrain.commands.advise import layers as advise_layers
from mptrain.commands.advise import plan as advise_plan
from mptrain.commands.advise import predict as advise_predict
from mptrain.config.format_table import BF16, FP8, FP8_BLOCKWISE, FP32, MXFP8, NVFP4
from mptrain.perf import gpus
from mptrain.perf.gemms import account
from mptrain.perf.roofline import (
    Step,
    arithmetic_for,
    cast_bytes,
    gemm_formats,
    gemm_passes,
    model_flops_by_format,
    pass_seconds,
    planned_cast_bytes,
    planned_passes,
    predict,
)
from mptrain.perf.speed import Accountant, DataShape, predict_configs
from mptrain.platform import hardware

H100, B200 = gpus.row("h100"), gpus.row("b200")
MXFP8_PEAK, NVFP4_PEAK = 4500e12, 9000e12  # B200, dense
ROWS, WIDTH = 8192, 4096  # a micro-batch of 8192 rows through 4096-wide Linears: compute-bound
LIFT_WG = (FP8, FP8, BF16)  # FP8 forward and input gradient, the weight gradient in BF16


def mlp(layers: int = 3) -> nn.Module:
    """``layers`` equal WIDTH x WIDTH Linears with ReLUs between, on the meta device; named
    "0", "2", "4", ..."""
    body: list[nn.Module] = []
    for i in range(layers):
        body += [nn.Linear(WIDTH, WIDTH, bias=False)] + ([nn.ReLU()] if i < layers - 1 else [])
    return nn.Sequential(*body).to("meta")


def fp8_mlp(**plan):
    """The MLP's accounting under BF16 autocast, its middle layers ("2"; the first and last kept
    in BF16, as FP8's layer choice does) in FP8 tensorwise, with ``plan``'s arithmetic keys."""
    acc = account(mlp(), meta(2, WIDTH), torch.bfloat16)
    return acc, arithmetic_for(FP8, ["2"], **plan)


def step_of(acc, arithmetic, gpu=H100):
    return predict(acc, arithmetic, gpu, Step(ROWS, optimizer_passes=3))


# ------------------------------------------------------------------------------ the roofline
@pytest.mark.parametrize(
    ("fmt", "granularity", "tiles"),
    [
        (FP8, "tensorwise", True),
        (FP8, "rowwise", True),
        (FP8_BLOCKWISE, "blockwise", True),
        (MXFP8, "tensorwise", True),
        (NVFP4, "tensorwise", True),
        (NVFP4, "tensorwise", False),
    ],
)
def test_per_gemm_pricing_of_a_layers_own_format_is_the_layers_pricing(fmt, granularity, tiles):
    """The per-GEMM pricing decomposes the whole-layer one: a plan of the layer's own format in
    all three GEMMs moves what the layer moves, pass by pass and cast by cast."""
    precision = FP8 if fmt == FP8_BLOCKWISE else fmt
    arithmetic = arithmetic_for(precision, ["fc"], granularity, tiles)
    g = linear_gemm(1024, 4096, 2048, a_grad=True, a_bytes=4)  # an FP32 input (after a norm)
    own = (arithmetic.layer_format,) * 3
    assert planned_cast_bytes(g, own, arithmetic, 3) == cast_bytes(
        g, arithmetic.layer_format, arithmetic, 3
    )
    whole = gemm_passes(g, arithmetic.layer_format, 3, arithmetic.tiled_weight)
    assert planned_passes(g, own, arithmetic, 3) == [(arithmetic.layer_format, *p) for p in whole]


def test_a_bf16_weight_gradient_is_priced_at_the_bf16_peak_and_drops_its_fp8_casts():
    """FP8 forward and input gradient, the weight gradient in BF16 (torchao's
    rowwise_with_gw_hp, tensorwise here), on the MLP's one FP8 layer: by hand."""
    acc, fp8 = fp8_mlp()
    _, lifted = fp8_mlp(plan=LIFT_WG, planned=["2"])
    g = next(g for g in acc.gemms if g.name == "2")
    assert gemm_formats(g, lifted) == LIFT_WG and gemm_formats(g, fp8) == (FP8,) * 3
    assert gemm_formats(acc.gemms[0], lifted) == (BF16,) * 3  # not converted: not planned
    x = dy = ROWS * WIDTH  # the BF16 input and output gradient, elements
    w = WIDTH * WIDTH  # the FP32 weight
    flops = 2 * ROWS * WIDTH * WIDTH
    bf16_dw = max(flops / BF16_PEAK, (2 * dy + 2 * x + 2 * w) / BANDWIDTH)  # dyᵀx, BF16 in/out
    fp8_dw = max(flops / FP8_PEAK, (dy + x + 2 * w) / BANDWIDTH)  # FP8 in, BF16 out
    assert bf16_dw == flops / BF16_PEAK  # compute-bound: twice the FP8 pass
    before, after = step_of(acc, fp8), step_of(acc, lifted)
    assert after.gemm_s - before.gemm_s == pytest.approx(bf16_dw - fp8_dw, rel=1e-9)
    # Tensorwise FP8 transposes its casts of x and dy for the weight gradient: a BF16 weight
    # gradient reads x and dy as they are (BF16 already): their transposed copies (a byte read
    # and written each) go; W's stays (the input gradient reads it in FP8).
    fp8_casts = cast_bytes(g, FP8, fp8, ROWS)
    assert planned_cast_bytes(g, LIFT_WG, lifted, ROWS) == fp8_casts - 2 * (x + dy)
    assert before.cast_s - after.cast_s == pytest.approx(2 * (x + dy) / BANDWIDTH, rel=1e-9)
    assert after.elementwise_s == before.elementwise_s
    assert after.optimizer_s == before.optimizer_s
    each = flops / ROWS  # per sample: one GEMM of the layer
    assert model_flops_by_format(acc, lifted) == {BF16: 7 * each, FP8: 2 * each}
    assert after.model_flops == before.model_flops and after.low_share == pytest.approx(2 / 9)


def test_a_bf16_gemm_quantizes_nothing_it_casts_the_fp32_weight_each_time():
    """All three GEMMs in BF16 through the plan: no quantization; the FP32 weight cast down for
    the forward and again for the input gradient (no autocast cache inside the layer), the
    weight gradient cast back up; an FP32 input cast down for the two GEMMs that read it."""
    _, arithmetic = fp8_mlp(plan=(BF16, BF16, BF16), planned=["2"])
    g = linear_gemm(1024, 4096, 2048, a_grad=True, a_bytes=4)
    x, w = 1024 * 4096, 4096 * 2048
    input_casts = 2 * x * (4 + 2) + x * (2 + 4)  # down for forward and dW; dx back up to FP32
    assert planned_cast_bytes(g, (BF16,) * 3, arithmetic, 1) == 3 * w * (4 + 2) + input_casts
    fp32_dw = (FP8, FP8, FP32)  # an FP32 weight gradient: dy cast up, dW written in FP32
    expected = (
        x * (2 * 4 + 1) + w * (2 * 4 + 1) + x / 2 * (2 * 2 + 1)  # FP8: x, W, dy quantized once
        + 2 * w  # W's transposed copy for the FP8 input gradient
        + x / 2 * (2 + 4)  # dy (BF16) cast up for the FP32 weight gradient
        + x * (2 + 4)  # dx: BF16 result to the FP32 input
    )  # fmt: skip
    assert planned_cast_bytes(g, fp32_dw, arithmetic, 1) == expected


def test_an_nvfp4_layers_mxfp8_weight_gradient_runs_at_mxfp8s_peak_with_its_own_scales():
    g = linear_gemm(8192, 4096, 4096, a_grad=True, a_bytes=2)
    arithmetic = arithmetic_for(NVFP4, ["fc"], plan=(NVFP4, NVFP4, MXFP8), planned=["fc"])
    (f0, *_), _, (fmt, flops, nbytes) = planned_passes(g, arithmetic.plan, arithmetic, 1)
    x, w, dy = 8192 * 4096, 4096 * 4096, 8192 * 4096
    assert (f0, fmt) == (NVFP4, MXFP8) and flops == 2 * 8192 * 4096 * 4096
    assert nbytes == (dy + x) * (1 + 1 / 32) + w * 2  # MXFP8 operands with E8M0 scales, BF16 dW
    assert pass_seconds(flops, nbytes, fmt, B200) == flops / MXFP8_PEAK
    nv_fwd = planned_passes(g, arithmetic.plan, arithmetic, 1)[0]
    assert pass_seconds(*nv_fwd[1:], NVFP4, B200) == flops / NVFP4_PEAK

    def nvfp4(elems, high, tile=False):  # amax read, read, 4-bit codes + E4M3 scales + FP32
        return elems * high * 2 + elems * (0.5 + (1 / 256 if tile else 1 / 16)) + 4

    def mxfp8(elems, high):  # read, one-byte elements + one E8M0 scale per 32
        return elems * high + elems * (1 + 1 / 32)

    expected = (
        nvfp4(x, 2) + mxfp8(x, 2)  # x: for the NVFP4 forward and the MXFP8 weight gradient
        + nvfp4(w, 4, tile=True)  # W: one 16x16-tiled quantization for forward and dx
        + nvfp4(dy, 2) + mxfp8(dy, 2)  # dy: for the NVFP4 dx and the MXFP8 dW
        + w * (2 + 4)  # dW written in BF16, added into the FP32 gradient
    )  # fmt: skip
    assert planned_cast_bytes(g, arithmetic.plan, arithmetic, 1) == pytest.approx(
        expected, rel=1e-12
    )
    assert arithmetic_for(MXFP8, ["fc"], plan=(NVFP4, MXFP8, MXFP8), planned=["fc"]).tiled(NVFP4)


def test_a_plan_for_some_layers_changes_only_those():
    """Four equal Linears, the middle two in FP8: the plan on layer "4" alone changes the step
    by what it changes layer "4" by, half what the plan on both changes."""
    acc = account(mlp(4), meta(2, WIDTH), torch.bfloat16)
    fp8 = arithmetic_for(FP8, ["2", "4"])
    both = arithmetic_for(FP8, ["2", "4"], plan=LIFT_WG, planned=["2", "4"])
    one = arithmetic_for(FP8, ["2", "4"], plan=LIFT_WG, planned=["4"])
    by_layer = {g.name: gemm_formats(g, one) for g in acc.gemms}
    assert by_layer == {"0": (BF16,) * 3, "2": (FP8,) * 3, "4": LIFT_WG, "6": (BF16,) * 3}
    base, all_two, only = step_of(acc, fp8), step_of(acc, both), step_of(acc, one)
    for part in ("gemm_s", "cast_s", "step_time_s"):
        whole = getattr(all_two, part) - getattr(base, part)
        assert getattr(only, part) - getattr(base, part) == pytest.approx(whole / 2, rel=1e-9)
        assert whole != 0
    assert arithmetic_for(BF16, ["2"], plan=LIFT_WG, planned=["2"]).plan is None  # converts none


# ------------------------------------------------------------------------------ from a config
BIG = DataShape(1, 64, 10)  # 64x64 one-channel images: a 4096-wide input
MODEL = ("model.hidden_sizes=[4096,4096,4096,4096]", f"batch_size={ROWS}")


def configs(*plans: tuple[str, ...], precision: str = FP8) -> list:
    return [tiny_run(f"precision={precision}", *MODEL, *plan) for plan in plans]


def test_precision_gemms_plans_the_layers_it_names_and_refuses_what_a_run_refuses():
    """The MLP's Linears are "1", "3", "5", "7", "9": FP8 converts "3", "5" and "7"."""
    wg, layers = "precision.gemms.weight_grad=bf16", "precision.gemms.layers=['5','7']"
    planned, every, blockwise = configs(
        (wg, layers), (wg,), ("precision.gemms.forward=fp8", "fp8.granularity=blockwise")
    )
    accountant = Accountant(planned, BIG)
    one = accountant.arithmetic(FP8, cfg=planned)
    assert (one.plan, one.planned, one.layers) == (LIFT_WG, {"5", "7"}, {"3", "5", "7"})
    assert accountant.arithmetic(FP8, cfg=every).planned == {"3", "5", "7"}
    blocks = accountant.arithmetic(FP8, cfg=blockwise)  # fp8 as fp8.* sets it: blockwise
    assert blocks.plan == (FP8_BLOCKWISE,) * 3 and blocks.layer_format == FP8_BLOCKWISE
    none, other = configs(
        (wg, "precision.gemms.layers=[head]"), ("precision.gemms.input_grad=mxfp8",)
    )
    (bf16,) = configs((wg,), precision=BF16)
    found = predict_configs({"none": none, "other": other, "bf16": bf16}, BIG, H100)
    assert found["none"] == (
        "precision.gemms.layers=['head']: no converted layer matches; the converted layers are "
        "3, 5, 7"
    )
    assert found["other"] == (
        "precision.gemms.input_grad=mxfp8: precision=fp8 converts its layers into fp8; a GEMM "
        "may run in fp8, bf16 or fp32 (a layer holds one family's quantizer state)"
    )  # the run's own refusal (gemm_plans.format_name), word for word
    assert found["bf16"].flops_by_format.keys() == {BF16}  # no layer format: no plan


@pytest.mark.parametrize(
    ("precision", "extra", "gpu"),
    [(FP8, (), H100), (FP8, ("fp8.granularity=rowwise",), H100), (MXFP8, (), B200),
     (NVFP4, (), B200), (FP8, ("fp8.granularity=blockwise",), H100)],
)  # fmt: skip
def test_an_all_null_plan_predicts_what_no_plan_does(precision, extra, gpu):
    nulls = ("precision.gemms.layers=[5]", "precision.gemms.weight_grad=null")
    plain, null = configs(extra, (*extra, *nulls), precision=precision)
    found = predict_configs({"plain": plain, "null": null}, BIG, gpu)
    assert found["null"] == found["plain"] and not isinstance(found["plain"], str)
    assert Accountant(null, BIG).arithmetic(precision, cfg=null).plan is None


def test_a_plan_lifting_gemms_to_bf16_sits_between_all_fp8_and_all_bf16():
    """Compute-bound Linears on an H100: each GEMM lifted to BF16 costs time, never more than
    BF16 everywhere; MXFP8's weight gradient of an NVFP4 layer sits between NVFP4 and MXFP8."""
    lift = "precision.gemms.weight_grad=bf16"
    fp8, one, every, two, bf16 = configs(
        (),
        (lift, "precision.gemms.layers=[5]"),
        (lift,),
        (lift, "precision.gemms.input_grad=bf16"),
        precision=FP8,
    ) + configs((), precision=BF16)
    names = ("fp8", "one", "every", "two", "bf16")
    found = predict_configs(dict(zip(names, (fp8, one, every, two, bf16), strict=True)), BIG, H100)
    steps = [found[name].step_time_s for name in names]
    assert steps == sorted(steps) and len(set(steps)) == len(steps), steps
    big, head = WIDTH * WIDTH, WIDTH * 10  # Linears "1", "3", "5", "7"; the head "9"
    low = [3 * big, 3 * big - big / 3, 2 * big, big, 0]  # FP8 GEMMs' FLOPs, 3 per layer
    shares = [found[n].low_share for n in names]
    assert shares == pytest.approx([f / (4 * big + head) for f in low], rel=1e-12)
    nvfp4, mixed = configs((), ("precision.gemms.weight_grad=mxfp8",), precision=NVFP4)
    block = predict_configs({"nvfp4": nvfp4, "mixed": mixed}, BIG, B200)
    assert block["mixed"].gemm_s > block["nvfp4"].gemm_s  # at half NVFP4's peak
    by_format = block["mixed"].flops_by_format
    assert by_format[MXFP8] * 3 == block["nvfp4"].flops_by_format[NVFP4]
    assert by_format[NVFP4] == 2 * by_format[MXFP8]


# ------------------------------------------------------------------------------ advise
@pytest.fixture
def bf16_cpu(monkeypatch):
    monkeypatch.setattr(hardware, "cpu_has_native_bf16", lambda: True)


def found_plan(per_gemm: bool = True) -> dict:
    """A per-layer plan for fp8 tensorwise on the tiny MLP (hidden 256, 256, 256: FP8 converts
    its Linears "3" and "5") keeping "5", and its per-GEMM plan: the weight gradient in BF16."""
    plan = {"precision": "fp8", "label": "fp8 tensorwise", "kept": ["5"], "skipped": {}}
    if per_gemm:
        run = {"diverged": None, "max_rel_diff": 0.01, "final_rel_diff": 0.005}
        plan["gemm_plan"] = {"layers": ["5"], "gemms": ["weight_grad"], "run": run, "within": True}
    return plan


def predicted(cfg, cands, plan) -> dict:
    """advise's prediction with the per-layer ``plan``'s configs, as advise's run makes it."""
    configs = advise_layers.plan_configs(plan, cands)
    return advise_predict.predict(cfg, torch.device("cpu"), cands, plan, configs)


def test_advise_predicts_the_kept_and_per_gemm_plans_beside_the_all_layers_figure(bf16_cpu):
    cfg = tiny_run("advise.target=h100", "model.hidden_sizes=[256,256,256]")
    cands = measure.candidates(cfg, torch.device("cpu"))
    plan = found_plan()
    prediction = predicted(cfg, cands, plan)
    speed = plan["predicted_speed"]
    rows = speed["rows"]
    assert speed["gpu"] == "h100-sxm" and list(rows) == ["all_layers", "kept_layers", "per_gemm"]
    assert "plan: per_gemm" not in prediction["rows"]  # the table's rows: the candidates'
    fp8, bf16 = prediction["rows"]["fp8"], prediction["rows"]["bf16"]
    assert rows["all_layers"]["step_time_s"] == fp8["step_time_s"]
    low = next(c for c in cands if c.name == "fp8").cfg
    kept_cfg = advise_gemms.with_lift(low, ["5"], ["weight_grad"])
    alone = predict_configs({"p": kept_cfg}, DataShape(1, 8, 10), gpus.row("h100"))["p"]
    assert rows["per_gemm"]["step_time_s"] == alone.step_time_s
    for row in rows.values():
        assert row["vs_bf16"] == bf16["step_time_s"] / row["step_time_s"]
        assert row["vs_all_layers"] == row["step_time_s"] / fp8["step_time_s"]
    assert (
        rows["per_gemm"]["flops_by_format"]["fp8"] > rows["kept_layers"]["flops_by_format"]["fp8"]
    )  # the kept layer's forward and input gradient stay in FP8
    evidence = advise_plan.evidence_lines({**plan, "runs": []})
    assert evidence[-1].startswith(
        "- predicted on h100-sxm (roofline, at best; not measured): every eligible layer in "
        "fp8 tensorwise "
    )
    assert "; with the kept layers " in evidence[-1] and " step time, " in evidence[-1]
    words = advise_gemms.plan_lines(plan, lambda run: "within", ", ".join)
    assert words[2].startswith("- predicted on h100-sxm (roofline, at best; not measured): ")
    assert " step time on every eligible layer in fp8 tensorwise, " in words[2]
    assert "; the kept layers whole " in words[2]


def test_advise_predicts_no_plan_without_a_kept_layer_or_a_target(bf16_cpu):
    cfg = tiny_run("advise.target=h100", "model.hidden_sizes=[256,256,256]")
    cands = measure.candidates(cfg, torch.device("cpu"))
    nothing_kept = {**found_plan(), "kept": []}
    predicted(cfg, cands, nothing_kept)
    assert "predicted_speed" not in nothing_kept and advise_predict.kept_line(nothing_kept) is None
    whole = found_plan(per_gemm=False)
    predicted(cfg, cands, whole)
    assert list(whole["predicted_speed"]["rows"]) == ["all_layers", "kept_layers"]
    assert advise_predict.per_gemm_line(whole) is None
    on_cpu = found_plan()
    predicted(tiny_run("model.hidden_sizes=[256,256,256]"), cands, on_cpu)
    assert "predicted_speed" not in on_cpu  # advise.target=auto on a CPU: no prediction
    mx = {**found_plan(per_gemm=False), "precision": MXFP8, "label": MXFP8}
    predicted(cfg, cands, mx)
    line = advise_predict.kept_line(mx)
    assert line.startswith("- predicted on h100-sxm (roofline, at best; not measured): none (")
    assert "no hardware kernel for mxfp8" in line


@pytest.mark.slow
def test_advise_prints_the_per_gemm_plans_predicted_speed(fragile_module, monkeypatch):
    """The fragile classifier (tests/commands/test_advise_plan.py) with advise.target=h100: the
    kept layer's lifted GEMMs in BF16, verified, and their predicted step on an H100 beside the
    all-layers FP8 one and the kept layer whole, in advise.md and advise.json."""
    monkeypatch.setattr(measure, "run_speed", lambda *args: None)
    monkeypatch.setattr(choices, "LOW_PRECISION", (choices.choice(FP8),))
    args = ["advise", "model=custom", "model._target_=fragile_net.FragileNet", "device=cpu",
            "advise.fidelity_steps=30", "optimizer.lr=0.005", "advise.seeds=1",
            "advise.target=h100", "hydra.run.dir=out"]  # fmt: skip
    outcome = run_cli(args, fragile_module, monkeypatch, jobs=True)
    assert outcome.code in (0, None), outcome
    out = fragile_module / "out"
    found = json.loads((out / "advise.json").read_text())["layer_plan"]
    assert found["kept"] == ["fragile"] and found["gemm_plan"]["within"], found
    rows = found["predicted_speed"]["rows"]
    assert list(rows) == ["all_layers", "kept_layers", "per_gemm"]
    assert (
        rows["kept_layers"]["flops_by_format"]["fp8"]
        < rows["per_gemm"]["flops_by_format"]["fp8"]
        < rows["all_layers"]["flops_by_format"]["fp8"]
    )
    markdown = (out / "advise.md").read_text()
    lines = markdown.splitlines()
    kept = next(line for line in lines if line.startswith("- predicted on h100-sxm"))
    assert "every eligible layer in fp8 tensorwise " in kept and "; with the kept layers " in kept
    verdict = next(i for i, line in enumerate(lines) if line.startswith("**Or keep only the "))
    assert lines[verdict + 2].startswith(
        "- predicted on h100-sxm (roofline, at best; not measured): "
    )
    assert "step time on every eligible layer in fp8 tensorwise" in lines[verdict + 2]


def test_a_candidate_skipped_on_this_cpu_is_predicted_in_its_own_precision(monkeypatch):
    """BF16 on a CPU without native BF16 is not measured, but an H100 runs it: its config is
    the arithmetic's (it was the user's, precision=auto: "precision 'auto': one of tf32, ...")."""
    monkeypatch.setattr(hardware, "cpu_has_native_bf16", lambda: False)
    cfg = tiny_run("advise.target=h100")
    cands = measure.candidates(cfg, torch.device("cpu"))
    assert "all" in next(c for c in cands if c.name == "bf16").skipped
    rows = advise_predict.predict(cfg, torch.device("cpu"), cands)["rows"]
    assert rows["bf16"]["flops_by_format"].keys() == {BF16}
    assert rows["fp8"]["vs_bf16"] == rows["bf16"]["step_time_s"] / rows["fp8"]["step_time_s"]
