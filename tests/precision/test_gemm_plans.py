"""Per-GEMM recipes (issue 40, items 3 and 4): one quantized Linear whose three GEMMs each run in
a format of its plan. A mixed plan's output and gradients equal a hand-written reference of the
same three GEMMs; ``precision.gemms.*`` trains the classifier and the GPT, resumes bit for bit,
is reported per GEMM, and is refused in one line where it cannot run."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from support.runs import LM, compose_run, tiny_run, train
from torch import nn

from mptrain.checkpoint.file import load_checkpoint
from mptrain.config.base import ConfigError
from mptrain.platform.distributed import DistContext
from mptrain.precision.policy import resolve_precision
from mptrain.precision.quant.block_linear import BlockGemm, BlockLinear
from mptrain.precision.quant.block_quant import BlockQuantization
from mptrain.precision.quant.fp8 import E4M3, E5M2, FP8Quantization, quantize, scale_from_amax
from mptrain.precision.quant.fp8_linear import Float8Linear, FP8RowwiseGemm, FP8TensorwiseGemm
from mptrain.precision.quant.linear import GemmPlan, HighPrecisionGemm
from mptrain.precision.quant.mx import quantize_mx
from mptrain.precision.quant.nvfp4 import quantize_nvfp4
from mptrain.train.build import check_run


def _inputs(tokens: int, fan_in: int, fan_out: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    linear = nn.Linear(fan_in, fan_out)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(fan_out, fan_in, generator=g) * 0.1)
        linear.bias.copy_(torch.randn(fan_out, generator=g) * 0.1)
    x = torch.randn(tokens, fan_in, generator=g)
    dy = torch.randn(tokens, fan_out, generator=g) * 1e-2
    return linear, x, dy


def _run(layer: nn.Module, x: torch.Tensor, dy: torch.Tensor):
    x = x.clone().requires_grad_(True)
    y = layer(x)
    y.backward(dy)
    return y.detach(), x.grad, layer.weight.grad, layer.bias.grad


def _fp8_product(a, a_dtype, b, b_dtype):
    """a @ b with both quantized to FP8 at one scale per tensor, the exact products rescaled
    once (what a tensorwise-scaled GEMM with FP32 accumulation computes)."""
    a_scale = scale_from_amax(a.abs().max(), a_dtype)
    b_scale = scale_from_amax(b.abs().max(), b_dtype)
    a_q, b_q = quantize(a, a_scale, a_dtype), quantize(b, b_scale, b_dtype)
    return torch.mm(a_q.float(), b_q.float()) * (a_scale.reciprocal() * b_scale.reciprocal())


def test_fp8_forward_and_input_grad_with_a_bf16_weight_grad_equal_hand_written_gemms():
    linear, x, dy = _inputs(24, 32, 48)
    recipe = FP8Quantization()
    fp8 = FP8TensorwiseGemm(recipe)
    plan = GemmPlan(fp8, fp8, HighPrecisionGemm(torch.bfloat16))
    layer = Float8Linear.from_linear(linear, recipe, plan)
    y, dx, dw, db = _run(layer, x, dy)

    w = linear.weight.detach()
    assert torch.equal(y, _fp8_product(x, E4M3, w.t(), E4M3) + linear.bias.detach())
    assert torch.equal(dx, _fp8_product(dy, E5M2, w, E4M3))
    assert torch.equal(dw, torch.mm(dy.bfloat16().t(), x.bfloat16()).float())
    assert torch.equal(db, dy.sum(0))
    # the weight gradient ran unquantized: not the FP8 one of the uniform recipe
    uniform = Float8Linear.from_linear(_inputs(24, 32, 48)[0], recipe)
    assert not torch.equal(dw, _run(uniform, x, dy)[2])


def test_nvfp4_with_an_mxfp8_weight_grad_equals_hand_written_gemms():
    linear, x, dy = _inputs(64, 64, 32, seed=1)
    nvfp4, mxfp8 = BlockQuantization("nvfp4"), BlockQuantization("mxfp8")
    plan = GemmPlan(BlockGemm(nvfp4), BlockGemm(nvfp4), BlockGemm(mxfp8))
    layer = BlockLinear.from_linear(linear, nvfp4, plan=plan)
    y, dx, dw, db = _run(layer, x, dy)

    def nv(t, dim):
        return quantize_nvfp4(t, dim).dequantize(torch.float32)

    def mx(t, dim):
        return quantize_mx(t, dim, elem_dtype=E4M3, rounding="rceil").dequantize(torch.float32)

    w = linear.weight.detach()
    assert torch.equal(y, torch.mm(nv(x, 1), nv(w, 1).t()) + linear.bias.detach())
    assert torch.equal(dx, torch.mm(nv(dy, 1), nv(w, 0)))
    assert torch.equal(dw, torch.mm(mx(dy, 0).t(), mx(x, 0)))  # along the tokens
    assert torch.equal(db, dy.sum(0))


def test_a_uniform_plan_is_the_formats_own_layer_bit_for_bit():
    """precision.gemms unset builds the uniform plan: the same figures as naming each GEMM."""
    for recipe, fmt in ((FP8Quantization(granularity="rowwise"), FP8RowwiseGemm),):
        linear, x, dy = _inputs(16, 32, 16)
        own = _run(Float8Linear.from_linear(linear, recipe), x, dy)
        linear.weight.grad = linear.bias.grad = None
        named = GemmPlan(fmt(recipe), fmt(recipe), fmt(recipe))
        same = _run(Float8Linear.from_linear(linear, recipe, named), x, dy)
        for a, b in zip(own, same, strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("lifted", [None, "forward", "input_grad"])
def test_rowwise_counts_each_roles_cast_once_whatever_gemm_runs_in_bf16(lifted):
    """The rowwise scalers' report figures: the input, weight and grad casts of a step, each
    counted once, also when the GEMM that counts a role runs in BF16 (a later one counts it)."""
    recipe = FP8Quantization(granularity="rowwise")
    own = FP8RowwiseGemm(recipe)
    plan = GemmPlan(own, own, own)
    if lifted is not None:
        plan = dataclasses.replace(plan, **{lifted: HighPrecisionGemm()})
    linear, x, dy = _inputs(8, 32, 16)
    layer = Float8Linear.from_linear(linear, recipe, plan)
    _run(layer, x, dy)
    seen = [float(s.seen) for s in (layer.input_scaler, layer.weight_scaler, layer.grad_scaler)]
    assert seen == [8 * 32, 16 * 32, 8 * 16]


def test_a_format_whose_blocks_do_not_divide_the_layer_is_refused():
    with pytest.raises(ValueError, match="block size 32"):
        plan = GemmPlan(
            BlockGemm(BlockQuantization("nvfp4")), *[BlockGemm(BlockQuantization("mxfp8"))] * 2
        )
        BlockLinear(48, 16, True, BlockQuantization("nvfp4"), plan=plan)


def _final_state(run_dir, step):
    return load_checkpoint(run_dir / "checkpoints" / f"step_{step:08d}.pt")["model"]


@pytest.mark.parametrize(
    "overrides",
    [
        ("precision=fp8", "fp8.granularity=rowwise", "precision.gemms.weight_grad=bf16"),
        ("precision=nvfp4", "precision.gemms.weight_grad=mxfp8"),
    ],
    ids=["fp8-rowwise+bf16-wgrad", "nvfp4+mxfp8-wgrad"],
)
def test_a_per_gemm_recipe_trains_reports_and_resumes_bit_for_bit(tmp_path, overrides):
    common = (*overrides, "max_steps=8", "checkpoint.every_steps=4", "checkpoint.keep_last=5")
    reference = train(tiny_run(*common), tmp_path / "ref")
    gemms = reference["precision"]["gemms"]
    assert gemms["weight_grad"] == overrides[-1].split("=")[1]
    assert gemms["forward"] == gemms["input_grad"] != gemms["weight_grad"]
    section = reference["fp8"] or reference["blocks"]
    converted = [layer for layer in section["layers"] if layer["converted"]]
    assert gemms["layers"] == "*"  # every converted layer
    formats = {gemm: gemms[gemm] for gemm in ("forward", "input_grad", "weight_grad")}
    assert converted and all(layer["gemms"] == formats for layer in converted)
    # a recipe of its own: not the precision's uniform one
    uniform = train(tiny_run(*overrides[:-1], "max_steps=8"), tmp_path / "uniform")
    assert uniform["precision"]["gemms"] is None
    assert uniform["evaluation"]["final_val_loss"] != reference["evaluation"]["final_val_loss"]

    step4 = tmp_path / "ref" / "checkpoints" / "step_00000004.pt"
    train(tiny_run(*common, f"resume={step4}"), tmp_path / "resumed")
    mine, theirs = _final_state(tmp_path / "resumed", 8), _final_state(tmp_path / "ref", 8)
    assert mine.keys() == theirs.keys()
    for key in mine:
        assert torch.equal(mine[key], theirs[key]), key


def test_the_gpt_trains_with_nvfp4_and_an_mxfp8_weight_gradient(tmp_path):
    cfg = compose_run(*LM, "precision=nvfp4", "precision.gemms.weight_grad=mxfp8", "max_steps=3")
    report = train(cfg, tmp_path)
    assert report["status"] == "completed"
    assert report["precision"]["gemms"] == {
        "forward": "nvfp4",
        "input_grad": "nvfp4",
        "weight_grad": "mxfp8",
        "layers": "*",
    }


@pytest.mark.parametrize(
    "precision",
    [("precision=nvfp4",), ("precision=fp8", "fp8.granularity=blockwise", "model.width=128")],
)
def test_a_tiled_weight_with_its_forward_in_bf16_trains(tmp_path, precision):
    """NVFP4's 16x16 and blockwise FP8's 128x128 weight tiles serve the input gradient from the
    forward's quantization; with the forward in BF16 the input gradient tiles the weight itself."""
    cfg = compose_run(*LM, *precision, "precision.gemms.forward=bf16", "max_steps=2")
    report = train(cfg, tmp_path)
    assert report["status"] == "completed"
    assert report["precision"]["gemms"]["forward"] == "bf16"


def test_a_schedule_of_two_converting_precisions_is_refused_before_training(tmp_path):
    overrides = (
        "precision=nvfp4",
        "precision.switch.to=fp8",
        "precision.switch.at=2",
        "precision.gemms.weight_grad=mxfp8",
        "max_steps=4",
    )
    with pytest.raises(ConfigError, match="both convert Linear layers"):
        train(tiny_run(*overrides), tmp_path)
    assert not (tmp_path / "checkpoints").exists()


@pytest.mark.parametrize(
    ("first", "to", "refused"), [("bf16", "fp32", True), ("bf16", "nvfp4", False)]
)
def test_a_schedule_is_checked_for_a_converting_phase_before_anything_is_built(first, to, refused):
    """check_run, before the data or the model exist: precision.gemms needs a phase that
    converts layers (phase 2's by its name: its policy is resolved later, by plan_switch)."""
    cfg = tiny_run(
        f"precision={first}",
        f"precision.switch.to={to}",
        "precision.switch.at=2",
        "precision.gemms.weight_grad=bf16",
    )
    policy = resolve_precision(cfg.precision, torch.device("cpu"), cfg.fp8, cfg.mx, cfg.nvfp4)
    if refused:
        with pytest.raises(ConfigError, match="computes no Linear layers in a format of its own"):
            check_run(cfg, policy, DistContext())
    else:
        check_run(cfg, policy, DistContext())


def test_a_plan_for_some_layers_leaves_the_others_in_the_precisions_own_recipe(tmp_path):
    cfg = compose_run(
        *LM,
        "model.layers=2",
        "precision=nvfp4",
        "precision.gemms.weight_grad=bf16",
        "precision.gemms.layers=[blocks.0.mlp.*]",
        "max_steps=2",
    )
    report = train(cfg, tmp_path)
    assert report["precision"]["gemms"]["layers"] == "blocks.0.mlp.*"
    rows = {row["name"]: row for row in report["blocks"]["layers"] if row["converted"]}
    planned = {name for name, row in rows.items() if "gemms" in row}
    assert planned == {"blocks.0.mlp.fc", "blocks.0.mlp.proj"} and len(rows) > len(planned)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (("precision=bf16", "precision.gemms.forward=fp8"), "precision.gemms.forward=fp8: "),
        (("precision=fp8", "precision.gemms.weight_grad=mxfp8"), "a GEMM may run in fp8, bf16"),
        (
            ("precision=fp8", "fp8.scaling=delayed", "precision.gemms.weight_grad=bf16"),
            "fp8.scaling=delayed keeps one amax history",
        ),
        (("precision=fp8", "precision.gemms.input_grad=fp4"), "null (the precision's own)"),
        (
            ("precision=fp8", "precision.gemms.weight_grad=bf16", "precision.gemms.layers=[x]"),
            "no converted layer matches; the converted layers are 3",
        ),
    ],
)
def test_a_per_gemm_recipe_that_cannot_run_is_refused_in_one_line(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")) as exc:
        train(tiny_run(*overrides, "max_steps=2"), tmp_path)
    assert "\n" not in str(exc.value)


def _saved(layer: nn.Module, x: torch.Tensor) -> list[tuple[torch.dtype, tuple[int, ...]]]:
    """(dtype, shape) of each tensor the layer's forward saves for its backward."""
    saved = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append((t.dtype, tuple(t.shape)))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x.clone().requires_grad_(True))
    return saved


def test_a_forward_keeps_only_what_a_backward_gemm_of_its_format_reads():
    """FP8 tensorwise with a BF16 weight gradient saves the input rows for it, not also the
    input's FP8 cast; with a BF16 input gradient, not the weight's cast; a tiled NVFP4 weight's
    forward quantization is kept only for an NVFP4 input gradient."""
    linear, x, _ = _inputs(24, 32, 48)
    recipe, bf16 = FP8Quantization(), HighPrecisionGemm(torch.bfloat16)
    fp8 = FP8TensorwiseGemm(recipe)
    e4m3_x, e4m3_w = (E4M3, (24, 32)), (E4M3, (48, 32))

    def fp8_saved(plan: GemmPlan) -> list:
        return _saved(Float8Linear.from_linear(linear, recipe, plan), x)

    uniform = fp8_saved(GemmPlan.uniform(fp8))
    assert e4m3_x in uniform and e4m3_w in uniform and (torch.float32, (24, 32)) not in uniform
    bf16_dw = fp8_saved(GemmPlan(fp8, fp8, bf16))
    assert e4m3_x not in bf16_dw and e4m3_w in bf16_dw and (torch.float32, (24, 32)) in bf16_dw
    bf16_dx = fp8_saved(GemmPlan(fp8, bf16, fp8))
    assert e4m3_x in bf16_dx and e4m3_w not in bf16_dx

    nvfp4 = BlockGemm(BlockQuantization("nvfp4", weight_tiles=True))
    linear, x, _ = _inputs(32, 64, 64)

    def tiles_saved(plan: GemmPlan) -> int:
        layer = BlockLinear.from_linear(linear, nvfp4.quantization, plan=plan)
        return sum(shape == (64, 64) for _, shape in _saved(layer, x))  # the weight: 1, tiles: +1

    assert tiles_saved(GemmPlan.uniform(nvfp4)) == 2
    assert tiles_saved(GemmPlan(nvfp4, bf16, nvfp4)) == 1
