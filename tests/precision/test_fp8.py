"""precision=fp8: quantization, scaling, Float8Linear numerics and layouts, layer selection,
the precision policy and end-to-end runs.

On the CPU every FP8 GEMM is emulated (FP8 cast, FP32 matmul); the tests marked ``gpu`` compare the
real ``torch._scaled_mm`` path against that emulation on an FP8-capable GPU.
"""

from __future__ import annotations

import copy
import importlib.util
import math
import re
from collections import OrderedDict

import pytest
import torch
from support.runs import NoFigure, compose_run, requires_cuda, tiny_run, train
from torch import nn

from mptrain.cli.preflight import check_command_line
from mptrain.config.base import ConfigError
from mptrain.config.models import ViTConfig
from mptrain.config.precision import FP8Config, PrecisionConfig, validate_fp8
from mptrain.models.builtin import build_vit
from mptrain.platform.distributed import DistContext
from mptrain.precision.policy import resolve_precision
from mptrain.precision.quant.convert import (
    apply_quantized,
    choose_layers,
    convert_linears,
    fp8_layer_stats,
    layer_rules,
)
from mptrain.precision.quant.dist import FP8Sync, build_fp8_sync
from mptrain.precision.quant.fp8 import (
    E4M3,
    E5M2,
    FP8_MAX,
    FP8Quantization,
    TensorScaler,
    dequantize,
    quantize,
    scale_from_amax,
)
from mptrain.precision.quant.fp8_linear import Float8Linear
from mptrain.precision.quant.kernels import check_gemm_operands, fp8_gemm, fp8_gemm_available
from mptrain.precision.selection import skip_summary
from mptrain.train import job as run_module
from mptrain.train.build import prepare_run
from mptrain.train.loop import train_loop

CPU = torch.device("cpu")
GPU = torch.device("cuda", 0)
FORMATS = {"hybrid": (E4M3, E5M2), "e4m3": (E4M3, E4M3)}
FP8_PRECISION = PrecisionConfig(name="fp8")

requires_fp8_gpu = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)),
    reason="needs a GPU of compute capability >= 8.9 (torch._scaled_mm)",
)


# ------------------------------------------------------------------------------------ helpers
def sqnr_db(reference: torch.Tensor, output: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio of ``output`` against ``reference``, in dB."""
    ref, out = reference.double(), output.double()
    return 10 * math.log10(ref.pow(2).sum().item() / (ref - out).pow(2).sum().item())


def recipe(fmt: str = "hybrid", **kwargs) -> FP8Quantization:
    forward, backward = FORMATS[fmt]
    return FP8Quantization(forward_dtype=forward, backward_dtype=backward, **kwargs)


def with_amax(amax: float) -> torch.Tensor:
    """A small tensor whose absolute maximum is ``amax`` (a negative entry included)."""
    return torch.tensor([amax, -amax / 2, amax / 4])


def cast_sequence(scaler: TensorScaler, amaxes: list[float]) -> list[float]:
    """Cast one tensor per amax; return the scale each cast used."""
    return [scaler.cast(with_amax(a))[1].item() for a in amaxes]


def fp8_mlp(fp8_recipe: FP8Quantization, seed: int = 0) -> nn.Sequential:
    """32 -> 64 -> 64 -> 16, every Linear converted to Float8Linear."""
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 16)
    )
    choices = choose_layers(model, include=[], exclude=[], keep_first_last=False)
    convert_linears(model, choices, fp8_recipe)
    return model


def scalers(model: nn.Module) -> dict[str, TensorScaler]:
    return {n: m for n, m in model.named_modules() if isinstance(m, TensorScaler)}


def selection_model() -> nn.Sequential:
    """Linear layers with known names (registration order = this order); never run forward."""
    return nn.Sequential(
        OrderedDict(
            embed=nn.Linear(32, 64),
            attn_qkv=nn.Linear(64, 192),
            attn_proj=nn.Linear(64, 64),
            odd=nn.Linear(64, 40),  # 40 is not a multiple of 16
            mlp_fc=nn.Linear(64, 128),
            head=nn.Linear(128, 16),
        )
    )


def reasons(choices) -> dict[str, str]:
    return {c.name: c.reason for c in choices}


def converted(choices) -> set[str]:
    return {c.name for c in choices if c.converted}


# ------------------------------------------------------------------------- 1. quantization
@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("scale", [None, 7.3], ids=["amax-scale", "fixed-scale"])
def test_quantize_equals_torch_cast_of_clamped_scaled_values(dtype, scale):
    torch.manual_seed(0)
    x = torch.randn(4096) * 3
    scale = scale_from_amax(x.abs().max(), dtype) if scale is None else torch.tensor(scale)
    limit = FP8_MAX[dtype]
    q = quantize(x, scale, dtype)
    expected = (x * scale).clamp(-limit, limit).to(dtype)
    assert q.dtype == dtype
    assert torch.equal(q.view(torch.uint8), expected.view(torch.uint8))
    assert torch.equal(dequantize(q, scale), expected.float() / scale)
    assert not torch.equal(dequantize(q, scale), x), "nothing was rounded: not an FP8 cast"


@pytest.mark.parametrize(("dtype", "limit"), [(E4M3, 448.0), (E5M2, 57344.0)], ids=["e4m3", "e5m2"])
def test_quantize_saturates_huge_finite_values_to_the_format_max(dtype, limit):
    x = torch.tensor([limit * 1.01, -limit * 1.01, 1e6, -1e6, 1e30, -1e30, 3.0e38, -3.0e38])
    out = quantize(x, torch.tensor(1.0), dtype).float()
    assert torch.equal(out, torch.sign(x) * limit)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("amax", [1.0, 1e30, 0.0], ids=["amax-1", "amax-1e30", "amax-0"])
def test_quantize_of_finite_values_is_never_nan_or_inf(dtype, amax):
    x = torch.tensor([0.0, -0.0, 1e-45, -1e-40, 1e-10, -1e-10, 1.0, 1e30, -1e30])
    scale = scale_from_amax(torch.tensor(amax), dtype)
    out = dequantize(quantize(x, scale, dtype), scale)
    assert torch.isfinite(out).all(), out
    assert out[0] == 0 and out[1] == 0


# ----------------------------------------------------------------------- 2. scale_from_amax
@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_scale_maps_amax_onto_the_format_max(dtype):
    amax = torch.tensor(3.7)
    scale = scale_from_amax(amax, dtype)
    assert scale.dtype == torch.float32
    assert (amax * scale).item() == pytest.approx(FP8_MAX[dtype], rel=1e-6)
    assert quantize(amax.reshape(1), scale, dtype).float().item() == FP8_MAX[dtype]


@pytest.mark.parametrize("margin", [1, 2, 5])
def test_margin_divides_the_scale_by_a_power_of_two(margin):
    amax = torch.tensor(0.37)
    assert scale_from_amax(amax, E4M3, margin) == scale_from_amax(amax, E4M3) / 2**margin


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_zero_amax_gives_a_finite_positive_scale(dtype):
    scale = scale_from_amax(torch.tensor(0.0), dtype)
    assert torch.isfinite(scale) and scale > 0


@pytest.mark.parametrize("margin", [0, 3])
@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_scale_is_the_correctly_rounded_fp32_quotient(dtype, margin):
    """``max / 2**margin / amax`` rounded once to FP32, for 100k amaxes over e^±25.

    The reference divides in float64 and rounds to FP32: that double rounding is innocuous for a
    quotient (53 >= 2 * 24 + 2 bits), so it is the correctly rounded FP32 quotient.
    """
    generator = torch.Generator().manual_seed(0)
    amaxes = torch.empty(100_000).uniform_(-25, 25, generator=generator).exp()  # FP32 values
    expected = (FP8_MAX[dtype] / 2**margin / amaxes.double()).float()
    wrong = (scale_from_amax(amaxes, dtype, margin) != expected).sum().item()
    assert wrong == 0, (
        f"{wrong} of {amaxes.numel()} scales differ from the correctly rounded quotient"
    )
    # The scale a cast uses is that quotient too (dynamic: from the tensor's own amax).
    scaler = TensorScaler(dtype, FP8Quantization(scaling="dynamic", margin=margin))
    few = amaxes[:300].tolist()
    assert [scaler.cast(with_amax(a))[1].item() for a in few] == expected[:300].tolist()


# --------------------------------------------------------- 3. Float8Linear against FP32 Linear
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("fmt", ["hybrid", "e4m3"])
def test_float8_linear_forward_and_gradients_match_fp32_linear(fmt, autocast):
    torch.manual_seed(0)
    reference = nn.Linear(64, 48)
    layer = Float8Linear.from_linear(copy.deepcopy(reference), recipe(fmt))
    x = torch.randn(3, 7, 64)  # 21 rows: the weight-gradient GEMM pads K to 32
    assert x[..., 0].numel() % 16
    grad_out = torch.randn(3, 7, 48)

    x_ref = x.clone().requires_grad_()
    y_ref = reference(x_ref)
    y_ref.backward(grad_out)
    x_fp8 = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = layer(x_fp8)
    y.backward(grad_out.to(y.dtype))

    assert y.dtype == (torch.bfloat16 if autocast else torch.float32)
    assert y.shape == y_ref.shape and x_fp8.grad.dtype == torch.float32
    assert sqnr_db(y_ref, y) >= 18
    assert sqnr_db(x_ref.grad, x_fp8.grad) >= 17
    assert sqnr_db(reference.weight.grad, layer.weight.grad) >= 17
    # The bias gradient is the unquantized sum of the incoming gradient (BF16 under autocast).
    torch.testing.assert_close(layer.bias.grad, grad_out.to(y.dtype).float().sum((0, 1)))
    # The gradient was cast in the format's backward dtype: its scale maps amax onto that max.
    backward_dtype = FORMATS[fmt][1]
    g_amax = grad_out.to(y.dtype).abs().max()
    assert layer.grad_scaler.dtype == backward_dtype
    assert layer.grad_scaler.scale.item() == pytest.approx(
        FP8_MAX[backward_dtype] / g_amax.item(), rel=1e-6
    )


def test_float8_linear_computes_exact_products_of_its_quantized_operands():
    """Forward and dW are dequant(x) dequant(W)ᵀ and dequant(dy)ᵀ dequant(x), padding included."""
    torch.manual_seed(1)
    layer = Float8Linear(32, 48, bias=True, quantization=recipe("hybrid"))
    x = torch.randn(5, 32)  # 5 rows: the dW GEMM pads K from 5 to 16
    grad_out = torch.randn(5, 48)
    y = layer(x)
    y.backward(grad_out)

    def dequantized(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        scale = scale_from_amax(t.abs().max(), dtype)
        return dequantize(quantize(t, scale, dtype), scale).double()

    xq, wq = dequantized(x, E4M3), dequantized(layer.weight.detach(), E4M3)
    gq = dequantized(grad_out, E5M2)
    torch.testing.assert_close(y.double(), xq @ wq.T + layer.bias.double(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer.weight.grad.double(), gq.T @ xq, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- 4. layout and alignment rules
def row_major(rows: int, cols: int, dtype: torch.dtype = E4M3) -> torch.Tensor:
    return torch.randn(rows, cols).to(dtype)


def column_major(rows: int, cols: int, dtype: torch.dtype = E4M3) -> torch.Tensor:
    return torch.randn(cols, rows).to(dtype).t()


def test_gemm_accepts_the_scaled_mm_layout_with_any_row_count():
    a, b = row_major(5, 32), column_major(32, 48, E5M2)
    one = torch.tensor(1.0)
    check_gemm_operands(a, one, b, one)
    out = fp8_gemm(a, one, b, one, torch.float32, real=False)
    assert out.shape == (5, 48)
    torch.testing.assert_close(out, a.float() @ b.float())


@pytest.mark.parametrize(
    ("a", "b", "message"),
    [
        (row_major(8, 20), column_major(20, 32), "K=20"),
        (row_major(8, 32), column_major(32, 24), "N=24"),
        (column_major(8, 32), column_major(32, 32), "first operand must be row-major"),
        (row_major(8, 32), row_major(32, 32), "second operand must be column-major"),
        (row_major(8, 32, E5M2), column_major(32, 32, E5M2), "E5M2 x E5M2"),
        (row_major(8, 32), column_major(16, 32), "inner dimensions differ"),
    ],
    ids=["K-unaligned", "N-unaligned", "a-column-major", "b-row-major", "e5m2-e5m2", "K-mismatch"],
)
def test_gemm_rejects_what_scaled_mm_rejects(a, b, message):
    one = torch.tensor(1.0)
    with pytest.raises(ValueError, match=message):
        check_gemm_operands(a, one, b, one)
    with pytest.raises(ValueError, match=message):
        fp8_gemm(a, torch.tensor(1.0), b, torch.tensor(1.0), torch.float32, real=False)


@pytest.mark.parametrize(
    ("in_features", "out_features", "message"),
    [(20, 32, "in_features=20"), (32, 10, "out_features=10")],
)
def test_float8_linear_rejects_features_not_multiples_of_16(in_features, out_features, message):
    with pytest.raises(ValueError, match=message):
        Float8Linear(in_features, out_features, bias=True, quantization=recipe())


def test_float8_linear_accepts_a_transposed_input_like_nn_linear():
    torch.manual_seed(0)
    reference = nn.Linear(32, 16)
    layer = Float8Linear.from_linear(copy.deepcopy(reference), recipe())
    x = torch.randn(32, 24).t()  # (24, 32), column-major
    assert sqnr_db(reference(x), layer(x)) >= 18


def test_float8_linear_accepts_a_transposed_output_gradient():
    torch.manual_seed(0)
    layer = Float8Linear(32, 16, bias=True, quantization=recipe())
    x = torch.randn(24, 32, requires_grad=True)
    weights = torch.randn(16, 24)
    (layer(x).t().contiguous() * weights).sum().backward()  # dy arrives as weights.t()
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_vit_with_fp8_patch_embedding_runs_a_single_image():
    torch.manual_seed(0)
    model = build_vit(ViTConfig(patch_size=4), 1, 8, 10)
    choices = choose_layers(model, include=[], exclude=[], keep_first_last=False)
    assert "patch_embed" in converted(choices)
    convert_linears(model, choices, recipe())
    assert model(torch.randn(2, 1, 8, 8)).shape == (2, 10)  # a batch of two works
    assert model(torch.randn(1, 1, 8, 8)).shape == (1, 10)


# ------------------------------------------------------------------------ 5. delayed scaling
AMAXES = [1.0, 2.0, 8.0, 0.5, 0.5, 0.5, 0.5]


def delayed_scaler(dtype: torch.dtype = E4M3, **kwargs) -> TensorScaler:
    options = {"amax_history_len": 4, "amax_compute_algo": "max", "margin": 0, **kwargs}
    return TensorScaler(dtype, FP8Quantization(scaling="delayed", **options))


def test_delayed_scale_comes_from_the_history_before_each_cast():
    scaler = delayed_scaler()
    histories = []
    used = []
    for amax in AMAXES:
        used.append(scaler.cast(with_amax(amax))[1].item())
        histories.append(scaler.amax_history.tolist())
    # First cast: scale 1 (empty history); then 448 / max(history before the cast).
    assert used == [1.0, 448.0, 224.0, 56.0, 56.0, 56.0, 56.0]
    assert histories == [
        [1.0, 0.0, 0.0, 0.0],
        [2.0, 1.0, 0.0, 0.0],
        [8.0, 2.0, 1.0, 0.0],
        [0.5, 8.0, 2.0, 1.0],
        [0.5, 0.5, 8.0, 2.0],
        [0.5, 0.5, 0.5, 8.0],
        [0.5, 0.5, 0.5, 0.5],  # the 8 rolled out
    ]
    assert scaler.scale.item() == 896.0  # what the next cast will use
    assert scaler.seen.item() == 3 * len(AMAXES)


def test_most_recent_uses_only_the_latest_amax():
    scaler = delayed_scaler(amax_compute_algo="most_recent")
    assert cast_sequence(scaler, AMAXES) == [1.0, 448.0, 224.0, 56.0, 896.0, 896.0, 896.0]


def test_margin_halves_the_delayed_scale():
    plain = cast_sequence(delayed_scaler(), AMAXES)
    with_margin = cast_sequence(delayed_scaler(margin=1), AMAXES)
    assert with_margin[0] == 1.0  # the initial scale is not derived from a history
    assert with_margin[1:] == [s / 2 for s in plain[1:]]


def test_delayed_scaling_counts_values_beyond_the_stale_scale_as_saturated():
    scaler = delayed_scaler()
    scaler.cast(torch.tensor([1.0, -0.5, 0.25, 0.1]))  # sets the scale to 448 / 1
    assert scaler.saturated.item() == 0
    q, scale = scaler.cast(torch.tensor([100.0, -50.0, 25.0, 1.0]))
    assert scale.item() == 448.0
    assert scaler.saturated.item() == 3  # 100, 50 and 25 exceed 448 / 448; 1.0 fits exactly
    assert scaler.seen.item() == 8
    assert q.float().tolist() == [448.0, -448.0, 448.0, 448.0]


def test_dynamic_scaling_never_counts_saturation():
    scaler = TensorScaler(E4M3, FP8Quantization(scaling="dynamic", amax_history_len=4))
    used = [scaler.cast(torch.tensor([a, -a / 2, a / 4]))[1].item() for a in (1.0, 100.0)]
    assert used == pytest.approx([448.0, 4.48])
    assert scaler.saturated.item() == 0 and scaler.seen.item() == 6


def rounds_past_max(value: float, dtype: torch.dtype) -> bool:
    """Whether ``dtype``'s round-to-nearest-even takes ``value`` beyond the format's max.

    Asked of torch's own cast, a quarter of the value lower: at the top of the range the cast
    cannot tell (this torch's E4M3 cast saturates anything above 448 to 448, its E5M2 cast
    overflows to inf), while in the normal range FP8 rounds alike in every binade and /4 is exact.
    """
    return torch.tensor(value / 4).to(dtype).float().item() * 4 > FP8_MAX[dtype]


# Each format's max plus half its ulp there (32 at E4M3's 448, 8192 at E5M2's 57344): the midpoint
# to the next step. A tie goes to the even mantissa: 448 (1.110b x 2^8) is even, so 464 rounds down
# to it; 57344 (1.11b x 2^15) is odd, so 61440 rounds up to 65536, beyond E5M2's max.
@pytest.mark.parametrize(
    ("dtype", "midpoint", "midpoint_saturates"),
    [(E4M3, 464.0, False), (E5M2, 61440.0, True)],
    ids=["e4m3", "e5m2"],
)
def test_saturation_counts_exactly_the_values_a_cast_rounds_past_the_max(
    dtype, midpoint, midpoint_saturates
):
    mid = torch.tensor(midpoint)
    below = torch.nextafter(mid, torch.tensor(0.0)).item()
    above = torch.nextafter(mid, torch.tensor(math.inf)).item()
    for value, saturates in ((below, False), (midpoint, midpoint_saturates), (above, True)):
        assert rounds_past_max(value, dtype) is saturates, value  # the expectation is the format's
        scaler = delayed_scaler(dtype)  # a first delayed cast uses scale 1: the values as they are
        q, scale = scaler.cast(torch.tensor([value, -value, 1.0]))
        assert scale.item() == 1.0
        assert scaler.saturated.item() == 2 * saturates, f"{value}: {scaler.saturated.item()}"
        assert q.float().tolist() == [FP8_MAX[dtype], -FP8_MAX[dtype], 1.0]


@pytest.mark.parametrize(
    ("algo", "history_len"), [("most_recent", 4), ("max", 1)], ids=["most_recent", "history-1"]
)
@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_an_all_zero_tensor_keeps_the_delayed_scale(dtype, algo, history_len):
    scaler = delayed_scaler(dtype, amax_compute_algo=algo, amax_history_len=history_len)
    real = with_amax(2.0)
    good = FP8_MAX[dtype] / 2  # the scale an amax of 2 gives
    scaler.cast(real)
    assert scaler.cast(torch.zeros(3))[1].item() == good
    q, scale = scaler.cast(real)
    assert scale.item() == good, "the zero tensor's amax set the scale"
    assert scaler.saturated.item() == 0
    assert torch.equal(dequantize(q, scale), real)
    assert scaler.scale.item() == good


def test_dynamic_scaling_keeps_the_previous_scale_for_an_all_zero_tensor():
    scaler = TensorScaler(E4M3, FP8Quantization(scaling="dynamic", amax_history_len=4))
    assert scaler.cast(torch.zeros(3))[1].item() == 1.0  # nothing seen yet: the initial scale
    scaler.cast(with_amax(2.0))
    q, scale = scaler.cast(torch.zeros(3))
    assert scale.item() == 224.0 and scaler.scale.item() == 224.0
    assert q.float().tolist() == [0.0, 0.0, 0.0]


# After an amax of 2 (scale 224) one cast holds a non-finite value, then six casts of amax 4 follow.
# max holds the scale while the bad amax is in the history (4 casts), as Transformer Engine does;
# most_recent takes the next amax at once. Either way no cast uses a scale the bad amax made.
@pytest.mark.parametrize(
    ("algo", "later_scales"),
    [("max", [224.0] * 4 + [112.0] * 2), ("most_recent", [224.0] + [112.0] * 5)],
)
@pytest.mark.parametrize("bad", [math.inf, math.nan], ids=["inf", "nan"])
def test_a_non_finite_amax_keeps_the_delayed_scale(bad, algo, later_scales):
    scaler = delayed_scaler(amax_compute_algo=algo)
    scaler.cast(with_amax(2.0))
    q, scale = scaler.cast(torch.tensor([bad, 1.0, -2.0]))
    assert scale.item() == 224.0
    assert q.float()[1:].tolist() == [224.0, -448.0]
    assert cast_sequence(scaler, [4.0] * 6) == later_scales


@pytest.mark.parametrize("bad", [math.inf, math.nan], ids=["inf", "nan"])
def test_dynamic_scaling_keeps_the_previous_scale_for_a_non_finite_amax(bad):
    scaler = TensorScaler(E4M3, FP8Quantization(scaling="dynamic", amax_history_len=4))
    scaler.cast(with_amax(2.0))
    q, scale = scaler.cast(torch.tensor([bad, 1.0, -2.0]))
    assert scale.item() == 224.0 and scaler.scale.item() == 224.0
    assert q.float()[1:].tolist() == [224.0, -448.0]  # the finite values quantized as before
    assert cast_sequence(scaler, [4.0]) == [112.0]


@pytest.mark.parametrize("bad", [math.inf, math.nan], ids=["inf", "nan"])
def test_float8_linear_stays_finite_after_one_non_finite_input(bad):
    """The issue's case: delayed scaling, a history of 16, one input holding an inf or a NaN."""
    torch.manual_seed(0)
    layer = Float8Linear(32, 16, bias=True, quantization=recipe(scaling="delayed"))
    assert layer.quantization.amax_history_len == 16
    batches = [torch.randn(8, 32) for _ in range(24)]
    for x in batches[:4]:
        layer(x)
    spike = batches[4].clone()
    spike[0, 0] = bad
    out = layer(spike)
    # The row holding a NaN is NaN (the product of a NaN); an inf saturates to the format's max.
    assert torch.isfinite(out if math.isinf(bad) else out[1:]).all()
    later = [layer(x) for x in batches[5:]]  # 19 casts: past the 16 the bad amax stays in history
    non_finite = [i for i, y in enumerate(later) if not torch.isfinite(y).all()]
    assert non_finite == [], f"non-finite outputs at the {len(non_finite)} steps {non_finite}"


def test_zero_and_non_finite_amaxes_are_counted_per_scaler_and_reported():
    torch.manual_seed(0)
    model = nn.Sequential(Float8Linear(32, 16, bias=True, quantization=recipe(scaling="delayed")))
    spike, nan_grad = torch.randn(8, 32), torch.randn(8, 16)
    spike[3, 3], nan_grad[2, 2] = math.inf, math.nan
    steps = [  # (input, output gradient)
        (torch.zeros(8, 32), torch.randn(8, 16)),  # the input is all zero
        (spike, torch.zeros(8, 16)),  # the input holds an inf, the gradient is all zero
        (torch.randn(8, 32), nan_grad),  # the gradient holds a NaN
        (torch.randn(8, 32), torch.randn(8, 16)),  # nothing to count
    ]
    for x, grad in steps:
        model(x).backward(grad)
    model.eval()
    with torch.no_grad():
        model(torch.zeros(8, 32))  # evaluation counts nothing
    (row,) = fp8_layer_stats(model)
    counts = {key: value for key, value in row.items() if key.endswith("_amax_casts")}
    assert counts == {
        "input_zero_amax_casts": 1,
        "input_nonfinite_amax_casts": 1,
        "weight_zero_amax_casts": 0,
        "weight_nonfinite_amax_casts": 0,
        "grad_zero_amax_casts": 1,
        "grad_nonfinite_amax_casts": 1,
    }
    assert all(type(value) is int for value in counts.values())
    assert all(math.isfinite(row[f"{role}_scale"]) for role in ("input", "weight", "grad"))


# ------------------------------------------------------------------- 5b. power-of-two scales
def is_power_of_two(value: float) -> bool:
    return value > 0 and math.frexp(value)[0] == 0.5


def amaxes_to_round(dtype: torch.dtype, margin: int) -> list[float]:
    """Amaxes over 80 binades, and some whose exact scale is an FP32 value just below a power of
    two (there ``2**floor(log2(scale))`` rounds up to that power, past the exact scale)."""
    torch.manual_seed(0)
    amaxes = (torch.rand(64) * 80 - 40).exp2().tolist()
    for k in (-20, -3, 0, 5, 12, 30):
        amax = FP8_MAX[dtype] * 2.0 ** (-margin - k) * (1 + 2.0**-23)
        exact = scale_from_amax(torch.tensor(amax), dtype, margin).item()
        assert 2.0**k * (1 - 2.0**-22) < exact < 2.0**k, (k, exact)
        amaxes.append(amax)
    return amaxes


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("scaling", ["dynamic", "delayed"])
def test_pow2_scales_are_the_power_of_two_at_or_below_the_exact_scale(dtype, scaling):
    # A history of one: the delayed scale after each cast comes from that cast's amax.
    fp8_recipe = FP8Quantization(scaling=scaling, amax_history_len=1, margin=1, pow2_scales=True)
    scaler = TensorScaler(dtype, fp8_recipe)
    for amax in amaxes_to_round(dtype, margin=1):
        used = scaler.cast(with_amax(amax))[1].item()
        scale = scaler.scale.item()
        exact = scale_from_amax(torch.tensor(amax), dtype, margin=1).item()
        assert is_power_of_two(scale), (amax, scale)
        assert exact / 2 < scale <= exact, (amax, scale, exact)
        if scaling == "dynamic":
            assert used == scale
    if scaling == "dynamic":
        # Rounded down: a tensor's largest value never lands beyond the format's max.
        assert scaler.saturated.item() == 0


@pytest.mark.parametrize("scaling", ["dynamic", "delayed"])
def test_pow2_scales_keep_the_previous_scale_for_zero_and_non_finite_amaxes(scaling):
    fp8_recipe = FP8Quantization(scaling=scaling, amax_history_len=1, pow2_scales=True)
    scaler = TensorScaler(E4M3, fp8_recipe)
    scaler.cast(with_amax(3.0))
    kept = scaler.scale.item()
    assert kept == 128.0  # 448 / 3 = 149.3, rounded down
    for bad in (0.0, math.inf, math.nan):
        scaler.cast(torch.full((4,), bad))
        assert scaler.scale.item() == kept, bad


@pytest.mark.parametrize(("dtype", "largest"), [(E4M3, 52.0), (E5M2, 5120.0)], ids=["e4m3", "e5m2"])
def test_fp8_values_times_a_power_of_two_round_trip_exactly_with_pow2_scales(dtype, largest):
    # Every FP8 value from 2**-4 up to ``largest`` (max / largest is no power of two), both
    # signs, times 2**-7: a tensor the format can hold exactly, up to a power of two.
    every = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    values = every[every.isfinite() & (every.abs() >= 2.0**-4) & (every.abs() <= largest)]
    x = values * 2.0**-7
    for scaling in ("dynamic", "delayed"):
        scaler = TensorScaler(dtype, FP8Quantization(scaling=scaling, pow2_scales=True))
        if scaling == "delayed":
            scaler.cast(x)  # the history learns x's amax; the next cast uses its scale
        x_fp8, scale = scaler.cast(x)
        assert is_power_of_two(scale.item())
        assert torch.equal(x_fp8.float(), x * scale), "x * scale was rounded before the cast"
        assert torch.equal(dequantize(x_fp8, scale), x), scaling
    # The unrounded scale (no pow2_scales) loses them: the test can tell the two apart.
    x_fp8, scale = TensorScaler(dtype, FP8Quantization()).cast(x)
    assert not torch.equal(dequantize(x_fp8, scale), x)


# ---------------------------------------------------------------------- 5c. rowwise scaling
def rowwise_dequantized(t: torch.Tensor, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """``t`` quantized with one scale per slice along ``dim``, back in float64 (the definition)."""
    scale = scale_from_amax(t.abs().amax(dim=dim, keepdim=True), dtype)
    return dequantize(quantize(t, scale, dtype), scale).double()


def test_rowwise_casts_take_one_scale_per_row_or_column_from_its_own_amax():
    scaler = TensorScaler(E4M3, recipe(granularity="rowwise"))
    x = torch.tensor([[1.0, -2.0, 0.5, 0.25], [0.0, 0.0, 0.0, 0.0], [300.0, 1.0, -3.0, 2.0]])
    rows, row_scale = scaler.cast_along(x, -1)
    assert row_scale.shape == (3, 1)
    # Every nonzero row's largest magnitude lands on the format's max; the zero row stays zero.
    assert rows.float().abs().amax(dim=1).tolist() == [448.0, 0.0, 448.0]
    assert row_scale[0].item() == scale_from_amax(torch.tensor(2.0), E4M3).item()
    cols, col_scale = scaler.cast_along(x, 0, update=False)
    assert col_scale.shape == (1, 4) and cols.float().abs().amax(dim=0).tolist() == [448.0] * 4
    # The counted cast: the tensor's amax enters the history; its scale (the smallest) is kept.
    assert scaler.amax_history[0].item() == 300.0 and float(scaler.seen) == x.numel()
    assert scaler.scale.item() == scale_from_amax(torch.tensor(300.0), E4M3).item()


@pytest.mark.parametrize("fmt", ["hybrid", "e4m3"])
def test_rowwise_float8_linear_computes_the_products_of_its_rowwise_quantized_operands(fmt):
    """y = x Wᵀ with a scale per row of x and per row of W; dx = dy W with one per row of dy and
    per column of W; dW = dyᵀ x with one per column of dy and of x. Rows of very different sizes:
    tensorwise quantization would miss these references by FP8 steps, not BF16 rounding."""
    forward, backward = FORMATS[fmt]
    torch.manual_seed(2)
    layer = Float8Linear(32, 48, bias=True, quantization=recipe(fmt, granularity="rowwise"))
    x = torch.randn(5, 32) * torch.tensor([1e-3, 1.0, 50.0, 1e3, 0.1])[:, None]
    x.requires_grad_()
    grad_out = torch.randn(5, 48) * torch.tensor([1e2, 1e-2, 1.0, 3.0, 1e-4])[:, None]
    y = layer(x)
    y.backward(grad_out)

    w = layer.weight.detach()
    expected_y = (
        rowwise_dequantized(x.detach(), -1, forward) @ rowwise_dequantized(w, -1, forward).T
    )
    expected_dx = rowwise_dequantized(grad_out, -1, backward) @ rowwise_dequantized(w, 0, forward)
    expected_dw = rowwise_dequantized(grad_out, 0, backward).T @ rowwise_dequantized(
        x.detach(), 0, forward
    )
    # The GEMMs write BF16 (torch's rowwise kernels do): equal to one BF16 rounding.
    bf16 = {"rtol": 2**-8, "atol": 0}
    product = (y - layer.bias).detach()  # the bias is added after the GEMM's BF16 rounding
    torch.testing.assert_close(product.double(), expected_y, **bf16)
    torch.testing.assert_close(x.grad.double(), expected_dx, **bf16)
    torch.testing.assert_close(layer.weight.grad.double(), expected_dw, **bf16)
    assert layer.bias.grad.tolist() == pytest.approx(grad_out.sum(0).tolist())


def test_rowwise_keeps_ordinary_rows_accurate_next_to_outlier_rows():
    """One row in 16 is 1e5 times larger: one scale for the tensor pushes the other rows into
    FP8's subnormals (8 dB); a scale per row keeps them at FP8's ~29 dB."""
    torch.manual_seed(0)
    reference = nn.Linear(64, 32, bias=False)
    x = torch.randn(48, 64)
    x[::16] *= 1e5
    ordinary = torch.ones(48, dtype=torch.bool)
    ordinary[::16] = False
    expected = reference(x).detach()[ordinary]
    sqnr = {}
    for granularity in ("tensorwise", "rowwise"):
        layer = Float8Linear.from_linear(copy.deepcopy(reference), recipe(granularity=granularity))
        sqnr[granularity] = sqnr_db(expected, layer(x).detach()[ordinary])
    assert sqnr["rowwise"] > 28 and sqnr["tensorwise"] < 15, sqnr


def test_rowwise_scaled_mm_on_the_cpu_agrees_with_the_emulation():
    """torch._scaled_mm with rowwise scales (the CPU kernel) and the emulated GEMM: same operands
    and scales, BF16 out; they may differ by the FP32 summation order, i.e. one BF16 rounding."""
    if not hasattr(torch, "_scaled_mm"):
        pytest.skip("no torch._scaled_mm")
    torch.manual_seed(3)
    x = torch.randn(40, 64) * torch.logspace(-2, 2, 40)[:, None]
    grad_out = torch.randn(40, 48)
    results = []
    for real in (False, True):
        torch.manual_seed(4)
        layer = Float8Linear(
            64, 48, bias=False, quantization=recipe(granularity="rowwise", real_gemm=real)
        )
        inputs = x.clone().requires_grad_()
        out = layer(inputs)
        out.backward(grad_out)
        results.append((out, inputs.grad, layer.weight.grad))
    for emulated, real in zip(*results, strict=True):
        torch.testing.assert_close(real, emulated, rtol=2**-7, atol=1e-5)


def test_rowwise_needs_dynamic_scaling_and_composes_from_the_command_line():
    assert compose_run().fp8.granularity == "tensorwise"
    assert compose_run("precision=fp8", "fp8.granularity=rowwise").fp8.granularity == "rowwise"
    with pytest.raises(ConfigError) as err:
        check_command_line(["precision=fp8", "fp8.granularity=rowwise", "fp8.scaling=delayed"])
    message = str(err.value)
    assert "\n" not in message and message.startswith("fp8.granularity='rowwise': rowwise scales")
    assert "fp8.scaling=dynamic" in message
    with pytest.raises(
        ConfigError, match=r"^fp8\.granularity='colwise': tensorwise, rowwise or blockwise$"
    ):
        validate_fp8(FP8Config(granularity="colwise"))


# ---------------------------------------------------------------- 6. checkpoint round trip
def test_scaler_state_round_trips_through_a_checkpoint(tmp_path):
    delayed = recipe("hybrid", scaling="delayed", amax_history_len=4)
    model = fp8_mlp(delayed, seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    torch.manual_seed(1)
    for step in range(4):
        x = torch.randn(24, 32) * (50 if step == 3 else 1)  # last step saturates the input scale
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    torch.save(model.state_dict(), tmp_path / "model.pt")

    fresh = fp8_mlp(delayed, seed=2)
    fresh.load_state_dict(torch.load(tmp_path / "model.pt"))

    saved, loaded = scalers(model), scalers(fresh)
    assert saved.keys() == loaded.keys() and len(saved) == 9
    for name, scaler in saved.items():
        for buffer in ("scale", "amax_history", "saturated", "seen"):
            assert torch.equal(getattr(scaler, buffer), getattr(loaded[name], buffer)), name
        assert scaler.seen.item() > 0 and scaler.scale.item() != 1.0, name
    assert saved["0.input_scaler"].saturated.item() > 0
    x = torch.randn(24, 32)
    assert torch.equal(model(x), fresh(x))


AMAX_EVENT_COUNTS = ("zero_amax_casts", "nonfinite_amax_casts")


def without_amax_event_counts(state: dict) -> dict:
    """``state`` as a checkpoint from before the counts holds it: no such keys, scalers at version 1."""
    old = copy.copy(state)  # keeps the state dict's _metadata (the modules' versions)
    for key in [k for k in old if k.rsplit(".", 1)[-1] in AMAX_EVENT_COUNTS]:
        del old[key]
    old._metadata = copy.deepcopy(state._metadata)
    for prefix, meta in old._metadata.items():
        if prefix.endswith("_scaler"):
            meta["version"] = 1
    return old


def test_amax_event_counts_round_trip_and_older_checkpoints_load_without_them(tmp_path):
    delayed = recipe("hybrid", scaling="delayed", amax_history_len=4)
    model = fp8_mlp(delayed, seed=0)
    spike = torch.randn(24, 32)
    spike[0, 0] = math.inf
    for x in (torch.zeros(24, 32), spike, torch.randn(24, 32)):
        model(x).square().mean().backward()
    counted = scalers(model)["0.input_scaler"]
    assert (counted.zero_amax_casts.item(), counted.nonfinite_amax_casts.item()) == (1, 1)
    torch.save(model.state_dict(), tmp_path / "model.pt")
    fresh = fp8_mlp(delayed, seed=2)
    fresh.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True))
    for name, scaler in scalers(model).items():
        for buffer in AMAX_EVENT_COUNTS:
            assert torch.equal(getattr(scaler, buffer), getattr(scalers(fresh)[name], buffer))

    # A checkpoint written before the counts existed loads: counts zero, the rest as saved.
    torch.save(without_amax_event_counts(model.state_dict()), tmp_path / "old.pt")
    older = fp8_mlp(delayed, seed=2)
    older.load_state_dict(torch.load(tmp_path / "old.pt", weights_only=True))
    for name, scaler in scalers(older).items():
        assert scaler.zero_amax_casts.item() == scaler.nonfinite_amax_casts.item() == 0, name
        for buffer in ("scale", "amax_history", "saturated", "seen"):
            assert torch.equal(getattr(scaler, buffer), getattr(scalers(model)[name], buffer))
    model.eval()
    older.eval()
    x = torch.randn(24, 32)
    assert torch.equal(model(x), older(x))

    # A state of this version without them is incomplete, as with any other missing key.
    incomplete = model.state_dict()
    del incomplete["2.grad_scaler.zero_amax_casts"]
    with pytest.raises(RuntimeError, match=r"Missing key.*2\.grad_scaler\.zero_amax_casts"):
        fp8_mlp(delayed).load_state_dict(incomplete)


def test_an_fp8_run_resumes_from_a_checkpoint_without_amax_event_counts(tmp_path, monkeypatch):
    monkeypatch.setattr(run_module, "FigureWorker", NoFigure)  # no curves.png: not read here
    overrides = (
        "precision=fp8",
        "fp8.scaling=delayed",
        "max_steps=8",
        "checkpoint.every_steps=4",
        "checkpoint.keep_last=5",
        "log_every=4",
    )
    reference = train(tiny_run(*overrides), tmp_path / "reference")
    path = tmp_path / "reference" / "checkpoints" / "step_00000004.pt"
    payload = torch.load(path, weights_only=True)
    payload["model"] = without_amax_event_counts(payload["model"])
    torch.save(payload, path)

    report = train(tiny_run(*overrides, f"resume={path}"), tmp_path / "resumed")
    assert report["status"] == "completed" and report["training"]["steps"] == 8
    assert report["resumed"]["step"] == 4
    # Scales, amax and saturation continue from the old checkpoint exactly; nothing was counted.
    assert report["fp8"]["final_layer_stats"] == reference["fp8"]["final_layer_stats"]


# ------------------------------------------------------------------------ 7. layer selection
def test_first_and_last_linear_stay_unconverted_by_default():
    choices = choose_layers(selection_model(), include=[], exclude=[], keep_first_last=True)
    assert [c.name for c in choices] == ["embed", "attn_qkv", "attn_proj", "odd", "mlp_fc", "head"]
    r = reasons(choices)
    assert r["embed"] == r["head"] == "first/last layer kept in BF16"
    assert converted(choices) == {"attn_qkv", "attn_proj", "mlp_fc"}


def test_unaligned_layers_are_skipped_with_the_reason():
    choices = choose_layers(selection_model(), include=[], exclude=[], keep_first_last=True)
    odd = next(c for c in choices if c.name == "odd")
    assert not odd.converted
    assert odd.reason == "in/out features not multiples of 16 (torch._scaled_mm alignment)"
    assert (odd.in_features, odd.out_features) == (64, 40)


def test_include_patterns_select_only_matching_layers():
    choices = choose_layers(selection_model(), include=["attn_*"], exclude=[], keep_first_last=True)
    assert converted(choices) == {"attn_qkv", "attn_proj"}
    assert reasons(choices)["mlp_fc"] == "not matched by fp8.include"


def test_exclude_patterns_keep_matching_layers():
    choices = choose_layers(selection_model(), include=[], exclude=["*proj"], keep_first_last=True)
    assert converted(choices) == {"attn_qkv", "mlp_fc"}
    assert reasons(choices)["attn_proj"] == "excluded by fp8.exclude pattern '*proj'"


def test_keep_first_last_false_converts_aligned_first_and_last():
    choices = choose_layers(selection_model(), include=[], exclude=[], keep_first_last=False)
    assert converted(choices) == {"embed", "attn_qkv", "attn_proj", "mlp_fc", "head"}
    assert (
        reasons(choices)["odd"]
        == "in/out features not multiples of 16 (torch._scaled_mm alignment)"
    )


def test_min_features_keeps_the_small_layers_with_the_reason_and_converts_the_large_ones():
    choices = choose_layers(
        selection_model(), include=[], exclude=[], keep_first_last=False, min_features=64
    )
    # attn_proj is 64/64: at the minimum, not below it.
    assert converted(choices) == {"attn_qkv", "attn_proj", "mlp_fc"}
    r = reasons(choices)
    assert r["embed"] == r["head"] == "smaller than fp8.min_features=64"  # 32/64 and 128/16
    # Unaligned (and small too): the alignment torch._scaled_mm needs is the reason given.
    assert r["odd"] == "in/out features not multiples of 16 (torch._scaled_mm alignment)"
    for c in choices:
        assert c.converted == (c.reason == "converted"), c


def test_fp8_conversion_with_min_features_reports_each_kept_layer_and_why():
    torch.manual_seed(0)
    sizes = [(32, 64), (64, 256), (256, 256), (256, 24)]  # names 0, 2, 4, 6 (ReLUs between)
    model = nn.Sequential(*[m for i, o in sizes for m in (nn.Linear(i, o), nn.ReLU())][:-1])
    fp8_recipe = recipe(min_features=128)
    section = apply_quantized(
        model, fp8_recipe, torch.randn(2, 32), layer_rules(fp8_recipe, [], ["4"], False)
    )
    assert section["min_features"] == 128 and section["pow2_scales"] is False
    layers = {row["name"]: row for row in section["layers"]}
    assert {n: (row["shape"], row["reason"]) for n, row in layers.items()} == {
        "0": ([32, 64], "smaller than fp8.min_features=128"),
        "2": ([64, 256], "smaller than fp8.min_features=128"),
        "4": ([256, 256], "excluded by fp8.exclude pattern '4'"),
        "6": ([256, 24], "in/out features not multiples of 16 (torch._scaled_mm alignment)"),
    }
    assert not any(row["converted"] for row in layers.values())
    assert not any(isinstance(m, Float8Linear) for m in model.modules())
    assert section["converted_linear_flops_share"] == 0
    assert skip_summary(section["layers"]) == (
        "2 layers: smaller than fp8.min_features=128; "
        "1 layer: excluded by fp8.exclude pattern '4'; "
        "1 layer: in/out features not multiples of 16 (torch._scaled_mm alignment)"
    )

    # Without the exclusion, the one layer large enough converts.
    fp8_recipe = recipe(min_features=128)
    section = apply_quantized(
        model, fp8_recipe, torch.randn(2, 32), layer_rules(fp8_recipe, [], [], False)
    )
    assert [row["name"] for row in section["layers"] if row["converted"]] == ["4"]
    assert isinstance(model[4], Float8Linear) and type(model[2]) is nn.Linear


def test_fp8_conversion_of_the_vit_converts_the_blocks_and_keeps_embedding_and_head():
    torch.manual_seed(0)
    model = build_vit(ViTConfig(), 1, 8, 10)
    fp8_recipe = recipe()
    section = apply_quantized(
        model, fp8_recipe, torch.randn(2, 1, 8, 8), layer_rules(fp8_recipe, [], [], True)
    )
    layers = {row["name"]: row for row in section["layers"]}
    block_layers = [n for n in layers if n.startswith("blocks.")]
    assert len(block_layers) == 4 * ViTConfig().depth
    for name in block_layers:
        assert name.rsplit(".", 1)[-1] in ("qkv", "proj", "0", "3"), name
        assert layers[name]["converted"] and isinstance(model.get_submodule(name), Float8Linear)
    for name in ("patch_embed", "head"):
        assert not layers[name]["converted"]
        assert layers[name]["reason"] == "first/last layer kept in BF16"
        assert type(model.get_submodule(name)) is nn.Linear
    assert 0.5 < section["converted_linear_flops_share"] < 1
    assert sum(row["flops_share"] for row in layers.values()) == pytest.approx(1.0)
    assert section["converted_linear_flops_share"] == pytest.approx(
        sum(layers[n]["flops_share"] for n in block_layers)
    )
    assert section["emulated"] is True and section["scaling"] == "dynamic"
    assert model(torch.randn(2, 1, 8, 8)).shape == (2, 10)


def test_conversion_keeps_the_parameter_objects_an_optimizer_holds():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.Linear(32, 16))
    before = list(model.parameters())
    optimizer = torch.optim.SGD(before, lr=0.1)
    fp8_recipe = recipe()
    apply_quantized(model, fp8_recipe, torch.randn(2, 16), layer_rules(fp8_recipe, [], [], True))
    assert isinstance(model[2], Float8Linear)
    after = list(model.parameters())
    assert len(after) == len(before) and all(a is b for a, b in zip(after, before, strict=True))

    weight_before = model[2].weight.detach().clone()
    model(torch.randn(8, 16)).square().mean().backward()
    optimizer.step()
    assert model[2].weight.grad is not None
    assert not torch.equal(model[2].weight.detach(), weight_before)


# ------------------------------------------------------------------------ 8. precision policy
@pytest.fixture
def fake_gpu(monkeypatch):
    """Pretend a CUDA device of a chosen compute capability is present (torch._scaled_mm too)."""

    def install(capability: tuple[int, int]) -> None:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "FakeGPU")

    return install


def test_fp8_on_cpu_is_emulated_and_labelled():
    policy = resolve_precision(FP8_PRECISION, CPU, FP8Config())
    assert (policy.name, policy.label, policy.emulated) == ("fp8", "fp8 (emulated)", True)
    assert policy.autocast_dtype is torch.bfloat16
    assert not policy.loss_scaling
    assert (policy.fp8.forward_dtype, policy.fp8.backward_dtype) == (E4M3, E5M2)
    assert policy.fp8.real_gemm is False
    assert any("emulated" in note for note in policy.notes)
    assert "fp8 (emulated)" in policy.describe()


def test_fp8_format_e4m3_casts_gradients_to_e4m3():
    policy = resolve_precision(FP8_PRECISION, CPU, FP8Config(format="e4m3", scaling="delayed"))
    assert (policy.fp8.forward_dtype, policy.fp8.backward_dtype) == (E4M3, E4M3)
    assert policy.fp8.scaling == "delayed"


def test_emulate_false_on_cpu_names_the_required_and_found_hardware():
    with pytest.raises(ConfigError, match=r"fp8\.emulate") as err:
        resolve_precision(FP8_PRECISION, CPU, FP8Config(emulate=False))
    assert "8.9" in str(err.value) and "CPU" in str(err.value)


@pytest.mark.parametrize(
    ("capability", "available"), [((9, 0), True), ((8, 9), True), ((8, 6), False), ((8, 0), False)]
)
def test_fp8_gemm_available_needs_compute_capability_8_9(fake_gpu, capability, available):
    fake_gpu(capability)
    assert fp8_gemm_available(GPU) is available
    assert fp8_gemm_available(CPU) is False


def test_fp8_on_an_fp8_gpu_uses_real_gemms(fake_gpu):
    fake_gpu((9, 0))
    policy = resolve_precision(FP8_PRECISION, GPU, FP8Config())
    assert policy.fp8.real_gemm is True
    assert (policy.name, policy.label, policy.emulated) == ("fp8", "fp8", False)
    assert not any("emulated" in note for note in policy.notes)
    assert "torch._scaled_mm" in policy.describe()


def test_emulate_true_on_an_fp8_gpu_still_emulates(fake_gpu):
    fake_gpu((9, 0))
    policy = resolve_precision(FP8_PRECISION, GPU, FP8Config(emulate=True))
    assert policy.label == "fp8 (emulated)" and policy.fp8.real_gemm is False
    assert any("fp8.emulate=true" in note for note in policy.notes)


def test_fp8_on_an_ampere_gpu_emulates_and_says_why(fake_gpu):
    fake_gpu((8, 0))
    policy = resolve_precision(FP8_PRECISION, GPU, FP8Config())
    assert policy.label == "fp8 (emulated)"
    assert any("GPU compute capability 8.0" in note for note in policy.notes)


def test_emulate_false_on_an_ampere_gpu_raises_naming_its_capability(fake_gpu):
    fake_gpu((8, 0))
    with pytest.raises(ConfigError, match=r"fp8\.emulate") as err:
        resolve_precision(FP8_PRECISION, GPU, FP8Config(emulate=False))
    assert "8.0" in str(err.value) and "8.9" in str(err.value)


def test_torchao_backend_without_torchao_raises(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(  # as on a machine without torchao (the test extra installs it)
        importlib.util,
        "find_spec",
        lambda name, *args: None if name == "torchao" else real_find_spec(name, *args),
    )
    with pytest.raises(ConfigError, match="torchao is not installed"):
        resolve_precision(FP8_PRECISION, CPU, FP8Config(backend="torchao"))


def test_pow2_scales_and_min_features_compose_from_the_command_line():
    assert (compose_run().fp8.pow2_scales, compose_run().fp8.min_features) == (False, 0)
    fp8 = compose_run("precision=fp8", "fp8.pow2_scales=true", "fp8.min_features=64").fp8
    assert fp8.pow2_scales is True and fp8.min_features == 64


@pytest.mark.parametrize(
    ("override", "pattern"),
    [
        ("fp8.min_features=-1", r"^fp8\.min_features=-1: must be an integer >= 0"),
        ("fp8.min_features=1.5", r"^fp8\.min_features: Value '1\.5' .* Integer"),
        ("fp8.min_features=true", r"^fp8\.min_features: Value 'True' .* Integer"),
        ("fp8.pow2_scales=maybe", r"^fp8\.pow2_scales: Value 'maybe' is not a valid bool"),
    ],
)
def test_preflight_refuses_bad_pow2_scales_and_min_features_in_one_line(override, pattern):
    with pytest.raises(ConfigError) as err:
        check_command_line(["precision=fp8", override])
    message = str(err.value)
    assert "\n" not in message and re.search(pattern, message), message


@pytest.mark.parametrize(
    ("changes", "pattern"),
    [
        ({"pow2_scales": "yes"}, r"^fp8\.pow2_scales='yes': true or false$"),
        ({"pow2_scales": 1}, r"^fp8\.pow2_scales=1: true or false$"),
        ({"min_features": -16}, r"^fp8\.min_features=-16: must be an integer >= 0"),
        ({"min_features": 2.5}, r"^fp8\.min_features=2\.5: must be an integer >= 0"),
        ({"min_features": True}, r"^fp8\.min_features=True: must be an integer >= 0"),
    ],
    ids=str,
)
def test_validate_fp8_names_a_bad_pow2_scales_or_min_features(changes, pattern):
    with pytest.raises(ConfigError, match=pattern):
        validate_fp8(FP8Config(**changes))
    validate_fp8(FP8Config(pow2_scales=True, min_features=0))
    validate_fp8(FP8Config(pow2_scales=False, min_features=4096))


def test_torchao_with_delayed_scaling_is_refused_at_the_config_check():
    """It used to pass the check and fail with a ValueError when the model was built."""
    with pytest.raises(ConfigError, match=r"^fp8\.backend='torchao': .*scales dynamically only"):
        validate_fp8(FP8Config(backend="torchao", scaling="delayed"))
    validate_fp8(FP8Config(backend="torchao", scaling="dynamic"))


# ------------------------------------------------------------------------------ 9. end to end
def val_accuracy(tmp_path, name: str, *overrides: str) -> float:
    report = train(tiny_run(*overrides), tmp_path / name)
    assert report["status"] == "completed"
    return report["evaluation"]["final_val_accuracy"]


def test_fp8_run_reports_emulation_and_its_fp8_layers(tmp_path):
    report = train(tiny_run("precision=fp8", "max_steps=6", "log_every=3"), tmp_path)
    assert report["status"] == "completed" and report["training"]["steps"] == 6
    p = report["precision"]
    assert (p["requested"], p["effective"], p["label"], p["emulated"]) == (
        "fp8",
        "fp8",
        "fp8 (emulated)",
        True,
    )
    assert p["autocast_dtype"] == "bfloat16" and p["loss_scaling"] is False
    assert report["throughput"]["comparable"] is False

    fp8 = report["fp8"]
    assert fp8["emulated"] is True and fp8["gemm"].startswith("emulated")
    assert fp8["pow2_scales"] is False and fp8["min_features"] == 0
    assert (fp8["forward_dtype"], fp8["backward_dtype"]) == ("float8_e4m3fn", "float8_e5m2")
    # mlp on digits: Linear 64->256 (kept, first), 256->256 (FP8), 256->10 (kept, last)
    layers = {row["name"]: row for row in fp8["layers"]}
    assert [n for n, row in layers.items() if row["converted"]] == ["3"]
    assert layers["1"]["reason"] == layers["5"]["reason"] == "first/last layer kept in BF16"
    flops = {"1": 64 * 256, "3": 256 * 256, "5": 256 * 10}
    assert fp8["converted_linear_flops_share"] == pytest.approx(flops["3"] / sum(flops.values()))
    (stats,) = fp8["final_layer_stats"]
    assert stats["name"] == "3"
    for role in ("input", "weight", "grad"):
        assert math.isfinite(stats[f"{role}_scale"]) and stats[f"{role}_scale"] > 0
        assert stats[f"{role}_amax"] > 0
        assert 0 <= stats[f"{role}_saturated_fraction"] <= 1
        assert stats[f"{role}_zero_amax_casts"] == stats[f"{role}_nonfinite_amax_casts"] == 0
    assert report["evaluation"]["final_val_accuracy"] > 0.3


@pytest.mark.slow
def test_fp8_mlp_accuracy_is_within_3_points_of_bf16(tmp_path):
    fp8 = val_accuracy(tmp_path, "fp8", "precision=fp8", "epochs=3")
    bf16 = val_accuracy(tmp_path, "bf16", "precision=bf16", "epochs=3")
    assert bf16 > 0.9, "the BF16 baseline did not learn: the comparison would say nothing"
    assert fp8 >= bf16 - 0.03, (fp8, bf16)


@pytest.mark.slow
def test_fp8_vit_accuracy_is_within_5_points_of_bf16(tmp_path):
    vit = (
        "model=vit",
        "model.depth=2",
        "epochs=6",
        "scheduler.warmup_epochs=1",
        "optimizer.lr=2e-3",
    )
    fp8 = val_accuracy(tmp_path, "fp8", "precision=fp8", *vit)
    bf16 = val_accuracy(tmp_path, "bf16", "precision=bf16", *vit)
    assert bf16 > 0.6, "the BF16 baseline did not learn: the comparison would say nothing"
    assert fp8 >= bf16 - 0.05, (fp8, bf16)


def test_fp8_with_delayed_scaling_trains(tmp_path):
    report = train(tiny_run("precision=fp8", "fp8.scaling=delayed", "max_steps=12"), tmp_path)
    assert report["status"] == "completed"
    assert report["fp8"]["scaling"] == "delayed"
    assert report["evaluation"]["final_val_accuracy"] > 0.5
    (stats,) = report["fp8"]["final_layer_stats"]
    assert all(math.isfinite(stats[f"{r}_scale"]) for r in ("input", "weight", "grad"))


def test_fp8_run_with_pow2_scales_records_them_and_keeps_power_of_two_scales(tmp_path, monkeypatch):
    monkeypatch.setattr(run_module, "FigureWorker", NoFigure)  # no curves.png: not read here
    overrides = ("precision=fp8", "fp8.pow2_scales=true", "max_steps=6", "log_every=3")
    report = train(tiny_run(*overrides), tmp_path)
    assert report["status"] == "completed" and report["training"]["steps"] == 6
    assert report["fp8"]["pow2_scales"] is True
    (stats,) = report["fp8"]["final_layer_stats"]
    for role in ("input", "weight", "grad"):
        assert is_power_of_two(stats[f"{role}_scale"]), (role, stats[f"{role}_scale"])
        # Rounded down from FP8 max / amax: within a factor of two of it, never above.
        dtype = E5M2 if role == "grad" else E4M3
        exact = scale_from_amax(torch.tensor(stats[f"{role}_amax"]), dtype).item()
        assert exact / 2 < stats[f"{role}_scale"] <= exact, role
    assert math.isfinite(report["evaluation"]["final_val_loss"])


def test_fp8_rowwise_run_records_its_granularity_and_trains(tmp_path, monkeypatch):
    monkeypatch.setattr(run_module, "FigureWorker", NoFigure)  # no curves.png: not read here
    report = train(tiny_run("precision=fp8", "fp8.granularity=rowwise", "max_steps=12"), tmp_path)
    assert report["status"] == "completed"
    assert report["fp8"]["granularity"] == "rowwise" and report["fp8"]["scaling"] == "dynamic"
    (stats,) = report["fp8"]["final_layer_stats"]
    for role in ("input", "weight", "grad"):  # the tensor-level (smallest) row scale
        assert math.isfinite(stats[f"{role}_scale"]) and stats[f"{role}_scale"] > 0
    assert report["evaluation"]["final_val_accuracy"] > 0.5
    summary = (tmp_path / "report.md").read_text()
    assert "dynamic rowwise scaling, float8_e4m3fn/float8_e5m2, emulated" in summary


@pytest.mark.slow
def test_fp8_run_compiles_without_graph_breaks_and_says_so(tmp_path, monkeypatch):
    """compile=true with FP8 layers (inductor on the CPU): the report counts the graphs and graph
    breaks torch.compile produced, and the fp8 section records that the layers were compiled."""
    monkeypatch.setattr(run_module, "FigureWorker", NoFigure)
    torch._dynamo.reset()
    overrides = ("precision=fp8", "compile=true", "max_steps=4", "log_every=2", "eval_every=4")
    report = train(tiny_run(*overrides), tmp_path)
    assert report["status"] == "completed" and report["fp8"]["compile"] is True
    model = report["model"]
    assert model["compile"] is True and model["graph_breaks"] == 0
    assert model["compiled_graphs"] >= 2  # training and evaluation (eval mode) forwards
    assert math.isfinite(report["evaluation"]["final_val_loss"])
    assert "| compile | " in (tmp_path / "report.md").read_text()


def test_model_without_convertible_linear_stops_with_config_error(tmp_path):
    with pytest.raises(ConfigError, match="no Linear layer") as err:
        train(tiny_run("precision=fp8", "model=cnn", "max_steps=2"), tmp_path)
    assert "(1 layer: first/last layer kept in BF16)" in str(err.value)


def test_min_features_above_every_layer_stops_naming_the_reasons(tmp_path):
    # mlp on digits: 64->256 and 256->10 are first/last; 256->256 is below the minimum.
    with pytest.raises(ConfigError) as err:
        train(tiny_run("precision=fp8", "fp8.min_features=512", "max_steps=2"), tmp_path)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("precision=fp8: no Linear layer of model=mlp can run in FP8 (")
    assert (
        "(2 layers: first/last layer kept in BF16; 1 layer: smaller than fp8.min_features=512)"
    ) in message


# --------------------------------------------------------------------- 10. FP32 master state
def test_parameters_and_optimizer_state_stay_fp32_after_fp8_training(tmp_path, monkeypatch):
    seen = {}
    real_loop = run_module.train_loop

    def recording_loop(run, hooks):
        seen.update(model=run.model, optimizer=run.optimizer)
        return real_loop(run, hooks)

    monkeypatch.setattr(run_module, "train_loop", recording_loop)
    train(tiny_run("precision=fp8", "max_steps=4"), tmp_path)

    model, optimizer = seen["model"], seen["optimizer"]
    assert any(isinstance(m, Float8Linear) for m in model.modules())
    for name, param in model.named_parameters():
        assert param.dtype == torch.float32, name
    states = [s for s in optimizer.state.values() if s]
    assert len(states) == len(list(model.parameters()))
    for state in states:
        for key, value in state.items():
            assert value.dtype == torch.float32, key


# ------------------------------------------------------------------------ 11. data parallel
def test_a_deferred_delayed_scale_waits_for_update_scale_then_matches_the_undeferred_one():
    """Under data parallelism the delayed scale is computed once the ranks' amaxes are in the
    history (mptrain.precision.quant.dist): casts then use the scale of the last update."""
    eager, deferred = delayed_scaler(), delayed_scaler()
    deferred.defer_scale_update = True
    used = [deferred.cast(with_amax(amax))[1].item() for amax in AMAXES[:3]]
    for amax in AMAXES[:3]:
        eager.cast(with_amax(amax))
    assert used == [1.0, 1.0, 1.0] and deferred.scale.item() == 1.0
    torch.testing.assert_close(deferred.amax_history, eager.amax_history, rtol=0, atol=0)
    deferred.update_scale()
    assert deferred.scale.item() == eager.scale.item() == 56.0  # 448 / max(1, 2, 8)


@pytest.fixture
def one_rank_group():
    """A Gloo process group of one rank in this process (its collectives return their input),
    and a context that says two ranks, so that build_fp8_sync builds the data-parallel sync."""
    torch.distributed.init_process_group(
        "gloo", store=torch.distributed.HashStore(), rank=0, world_size=1
    )
    yield DistContext(rank=0, world_size=2, backend="gloo", strategy="ddp")
    torch.distributed.destroy_process_group()


def test_the_builtin_sync_holds_the_scale_for_a_nan_amax_and_counts_what_was_added(
    one_rank_group,
):
    layer = Float8Linear(16, 16, bias=False, quantization=FP8Quantization(scaling="delayed"))
    sync = build_fp8_sync(layer, one_rank_group, "builtin", layer.quantization)
    assert layer.input_scaler.defer_scale_update and layer.grad_scaler.defer_scale_update
    layer.input_scaler.seen.fill_(1000.0)  # as loaded from a checkpoint: the job's total so far
    sync.begin()
    layer(torch.full((4, 16), 2.0)).sum().backward()
    sync.after_backward()
    assert layer.input_scaler.scale.item() == 224.0  # 448 / 2, computed after the reduction
    assert layer.input_scaler.seen.item() == 1000.0 + 64  # not counted twice
    layer(torch.full((4, 16), math.nan))
    sync.after_backward()
    assert layer.input_scaler.amax_history[0].item() == math.inf  # NaN travels as +inf
    assert layer.input_scaler.scale.item() == 224.0  # held
    assert layer.input_scaler.nonfinite_amax_casts.item() == 1


@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_the_builtin_sync_computes_each_scale_as_the_scaler_itself_would(one_rank_group, algo):
    """The sync computes the scales of many scalers at once (per format and recipe): the same
    as each TensorScaler.update_scale, for both formats, margins and power-of-two scales."""
    recipes = [
        FP8Quantization(scaling="delayed", amax_compute_algo=algo, margin=1, pow2_scales=True),
        FP8Quantization(scaling="delayed", amax_compute_algo=algo, amax_history_len=3),
    ]
    model = nn.Sequential(*(Float8Linear(16, 16, bias=False, quantization=r) for r in recipes))
    sync = build_fp8_sync(model, one_rank_group, "builtin", recipes[0])
    torch.manual_seed(0)
    for _ in range(2):
        model(torch.randn(4, 16) * 5).sum().backward()
    twin = copy.deepcopy(model)
    sync.after_backward()
    scalers = [m for m in twin.modules() if isinstance(m, TensorScaler)]
    assert len(scalers) == 6 and {s.dtype for s in scalers} == {E4M3, E5M2}
    for scaler in scalers:
        scaler.update_scale()
    assert all(s.scale.item() != 1.0 for s in scalers)  # every scale was computed
    for want, got in zip(twin.modules(), model.modules(), strict=True):
        if isinstance(want, TensorScaler):
            assert got.scale.item() == want.scale.item()


def test_a_single_process_has_nothing_to_agree_on():
    layer = Float8Linear(16, 16, bias=False, quantization=FP8Quantization(scaling="delayed"))
    sync = build_fp8_sync(layer, DistContext(), "builtin", layer.quantization)
    assert type(sync) is FP8Sync and sync.describe() == {}
    assert not layer.input_scaler.defer_scale_update


def test_the_loop_calls_the_fp8_sync_after_each_backward_and_each_optimizer_step(tmp_path):
    run = prepare_run(tiny_run("precision=fp8", "max_steps=2", "optimizer=sgd"))
    weight = next(p for n, p in run.model.named_parameters() if n == "3.weight")
    events = []

    class Recorder(FP8Sync):
        def begin(self) -> None:
            events.append("begin")

        def after_backward(self) -> None:  # gradients there, the weight not yet updated
            events.append(("backward", weight.grad is not None, weight.detach().clone()))

        def after_optimizer_step(self) -> None:  # the weight updated
            events.append(("step", weight.detach().clone()))

    run.precision.fp8_sync = Recorder()
    train_loop(run)
    assert events[0] == "begin" and [e[0] for e in events[1:]] == ["backward", "step"] * 2
    for backward, step in zip(events[1::2], events[2::2], strict=True):
        assert backward[1] and not torch.equal(backward[2], step[1])


@pytest.mark.parametrize("fsdp", [True, False], ids=["fsdp", "no-fsdp"])
def test_torchao_conversion_enables_its_fp8_all_gather_only_for_fsdp(fsdp):
    pytest.importorskip("torchao")
    from torchao.float8.float8_linear import Float8Linear as TorchaoFloat8Linear
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
    fp8_recipe = FP8Quantization(fsdp_float8_all_gather=fsdp)
    section = apply_quantized(model, fp8_recipe, torch.randn(2, 32), layer_rules(fp8_recipe, [], [], False), backend="torchao")  # fmt: skip
    assert [layer["converted"] for layer in section["layers"]] == [True, True]
    for layer in (model[0], model[2]):
        assert isinstance(layer, TorchaoFloat8Linear)
        assert layer.config.enable_fsdp_float8_all_gather is fsdp
        assert isinstance(layer.weight, WeightWithDynamicFloat8CastTensor) is fsdp


# ------------------------------------------------------------------------------- GPU checks
@pytest.mark.gpu
@requires_cuda
@requires_fp8_gpu
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize(
    ("a_dtype", "b_dtype"), [(E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2)], ids=["44", "54", "45"]
)
def test_scaled_mm_matches_the_emulated_gemm(a_dtype, b_dtype, out_dtype):
    torch.manual_seed(0)
    a_hp, b_hp = torch.randn(40, 64, device=GPU), torch.randn(48, 64, device=GPU)
    a_scale = scale_from_amax(a_hp.abs().max(), a_dtype)
    b_scale = scale_from_amax(b_hp.abs().max(), b_dtype)
    a = quantize(a_hp, a_scale, a_dtype)
    b = quantize(b_hp, b_scale, b_dtype).t()  # (64, 48) column-major
    real = fp8_gemm(a, a_scale, b, b_scale, out_dtype, real=True)
    emulated = fp8_gemm(a, a_scale, b, b_scale, out_dtype, real=False)
    assert real.dtype == emulated.dtype == out_dtype
    atol = 1e-3 * emulated.float().abs().max().item()
    torch.testing.assert_close(real.float(), emulated.float(), rtol=2**-7, atol=atol)


@pytest.mark.gpu
@requires_cuda
@requires_fp8_gpu
@pytest.mark.parametrize("fmt", ["hybrid", "e4m3"])
def test_real_float8_linear_matches_emulated_under_bf16_autocast(fmt):
    torch.manual_seed(0)
    base = nn.Linear(64, 48).to(GPU)
    layers = {
        real: Float8Linear.from_linear(copy.deepcopy(base), recipe(fmt, real_gemm=real))
        for real in (True, False)
    }
    x = torch.randn(3, 7, 64, device=GPU)
    grad_out = torch.randn(3, 7, 48, device=GPU, dtype=torch.bfloat16)
    results = {}
    for real, layer in layers.items():
        xi = x.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = layer(xi)
        y.backward(grad_out)
        results[real] = (y.float(), xi.grad, layer.weight.grad)
    for got, want in zip(results[True], results[False], strict=True):
        atol = 1e-3 * want.abs().max().item()
        torch.testing.assert_close(got, want, rtol=2**-7, atol=atol)


@pytest.mark.gpu
@requires_cuda
@requires_fp8_gpu
def test_fp8_policy_uses_real_gemms_on_this_gpu():
    policy = resolve_precision(FP8_PRECISION, GPU, FP8Config(emulate=False))
    assert policy.fp8.real_gemm is True and policy.label == "fp8"


def test_evaluation_leaves_fp8_scaling_state_alone():
    """Delayed scaling: eval forwards must not push validation amaxes into the history."""
    from mptrain.precision.quant.fp8 import E4M3, E5M2, FP8Quantization
    from mptrain.precision.quant.fp8_linear import Float8Linear

    recipe = FP8Quantization(
        forward_dtype=E4M3, backward_dtype=E5M2, scaling="delayed", amax_history_len=4
    )
    layer = Float8Linear(32, 32, bias=True, quantization=recipe)
    layer(torch.randn(8, 32)).sum().backward()
    before = {k: v.clone() for k, v in layer.state_dict().items() if "scaler" in k}
    layer.eval()
    with torch.no_grad():
        layer(100 * torch.randn(8, 32))
    after = {k: v for k, v in layer.state_dict().items() if "scaler" in k}
    assert all(torch.equal(before[k], after[k]) for k in before)


# ------------------------------------------------------------------------------ torch.compile
@pytest.mark.slow
@pytest.mark.parametrize(
    ("scaling", "granularity", "real_gemm"),
    [
        ("dynamic", "tensorwise", False),
        ("delayed", "tensorwise", False),
        ("delayed", "tensorwise", True),
        ("dynamic", "rowwise", False),
        ("dynamic", "rowwise", True),
    ],
    ids=["dynamic", "delayed", "delayed-scaled_mm", "rowwise", "rowwise-scaled_mm"],
)
def test_fp8_layers_compile_without_graph_breaks_and_train_like_eager(
    scaling, granularity, real_gemm
):
    """torch.compile(fullgraph=True) of two Float8Linear layers under BF16 autocast: no graph
    break, and four training steps (input scales 0.1/1/10, an all-zero batch, an eval forward)
    give bit-identical outputs, gradients and scaler buffers to eager. Guards three failures seen
    with torch 2.14: `+=` on buffers broke the graph in backward; the compiled backward ran the
    emulated GEMMs under BF16 autocast; AOTAutograd recomputed the delayed scale in the backward
    after the forward had updated it (gradients scaled by the next step's scale)."""
    if real_gemm and not hasattr(torch, "_scaled_mm"):
        pytest.skip("no torch._scaled_mm")
    torch._dynamo.reset()  # each case compiles afresh: no recompile limit shared between cases
    recipe = FP8Quantization(
        scaling=scaling,
        granularity=granularity,
        amax_compute_algo="most_recent",
        real_gemm=real_gemm,
    )
    torch.manual_seed(0)
    eager = nn.Sequential(
        Float8Linear.from_linear(nn.Linear(64, 64), recipe),
        nn.ReLU(),
        Float8Linear.from_linear(nn.Linear(64, 64), recipe),
    )
    twin = copy.deepcopy(eager)
    compiled = torch.compile(twin, backend="aot_eager", fullgraph=True)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, twin)]
    for step, factor in enumerate((0.1, 1.0, 0.0, 10.0)):
        x = torch.randn(32, 64, generator=torch.Generator().manual_seed(step)) * factor
        results = []
        for model, optimizer in zip((eager, compiled), optimizers, strict=True):
            inputs = x.clone().requires_grad_()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(inputs)
            out.float().square().mean().backward()
            grads = [inputs.grad] + [p.grad for p in model.parameters()]
            optimizer.step()
            optimizer.zero_grad()
            results.append((out, grads))
        (out_e, grads_e), (out_c, grads_c) = results
        assert torch.equal(out_e, out_c), f"step {step}: outputs differ"
        for g_e, g_c in zip(grads_e, grads_c, strict=True):
            assert torch.equal(g_e, g_c), f"step {step}: gradients differ"
        for (name, b_e), (_, b_c) in zip(eager.named_buffers(), twin.named_buffers(), strict=True):
            assert torch.equal(b_e, b_c), f"step {step}: buffer {name} differs"
    eager.eval(), twin.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(eager(x), compiled(x))
    assert float(eager[0].input_scaler.zero_amax_casts) == 1  # the all-zero batch, counted
