"""Which layers become FP8 and how: the per-layer choice (the shared rules of
:mod:`mptrain.precision.selection`, under ``fp8.*``), the conversion, the layer statistics the
report shows, whether a device has FP8 GEMMs, the torchao
bridge (``fp8.backend=torchao``) and :func:`apply_fp8`, the run's one entry point.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import nn

from mptrain.platform.dtypes import dtype_name
from mptrain.precision.quant.fp8 import (
    AMAX_EVENT_COUNTERS,
    GEMM_ALIGNMENT,
    FP8Recipe,
    TensorScaler,
)
from mptrain.precision.quant.fp8_linear import Float8Linear
from mptrain.precision.quant.linear import LayerPlans
from mptrain.precision.selection import (
    LayerChoice,
    LayerRules,
    choose,
    layer_rows,
    linear_flops,
    set_submodule,
)
from mptrain.precision.selection import skip_summary as skip_summary  # FP8's callers


# ------------------------------------------------------------------------------ conversion
def choose_layers(
    model: nn.Module,
    include: list[str],
    exclude: list[str],
    keep_first_last: bool,
    min_features: int = 0,
) -> list[LayerChoice]:
    """Decide, for every nn.Linear in registration order, whether it converts to FP8 and why not:
    the rules of :mod:`mptrain.precision.selection` under the ``fp8.*`` keys, with
    torch._scaled_mm's alignment (in/out features multiples of 16)."""
    rules = LayerRules(
        "fp8", tuple(include), tuple(exclude), keep_first_last, min_features, GEMM_ALIGNMENT
    )
    return choose(model, rules)


def convert_to_fp8(model: nn.Module, choices: list[LayerChoice], recipe: FP8Recipe) -> nn.Module:
    """Replace the chosen nn.Linear layers in place by Float8Linear. Returns ``model``."""
    for choice in choices:
        if choice.converted:
            layer = model.get_submodule(choice.name)
            set_submodule(model, choice.name, Float8Linear.from_linear(layer, recipe))
    return model


def set_gemm_plans(model: nn.Module, plans: LayerPlans, rows: list[dict[str, Any]]) -> None:
    """Give the Float8Linear layers of ``model`` their per-GEMM plan of ``plans`` (precision.gemms:
    its formats are FP8's family, whose layers hold the same scalers) and name their GEMMs'
    formats in the report's ``rows``."""
    for name, layer in model.named_modules():
        plan = plans.for_layer(name)
        if isinstance(layer, Float8Linear) and plan is not None:
            plan.check_features(layer.in_features, layer.out_features)
            layer.plan = plan
    for row in rows:
        if row["converted"]:
            row.update(plans.describe(row["name"]))


def fp8_layer_stats(model: nn.Module) -> list[dict[str, Any]]:
    """Per Float8Linear and role (input, weight, grad): final scale and amax, saturated fraction,
    and ``<role>_zero_amax_casts`` / ``<role>_nonfinite_amax_casts``: the training casts whose
    amax was zero / inf or NaN, from which no scale was taken (reads device values)."""
    stats = []
    for name, layer in model.named_modules():
        if isinstance(layer, Float8Linear):
            row: dict[str, Any] = {"name": name}
            for role in ("input", "weight", "grad"):
                scaler: TensorScaler = getattr(layer, f"{role}_scaler")
                seen = float(scaler.seen)
                row[f"{role}_scale"] = float(scaler.scale)
                row[f"{role}_amax"] = float(scaler.amax_history[0])
                row[f"{role}_saturated_fraction"] = float(scaler.saturated) / seen if seen else 0.0
                for counter in AMAX_EVENT_COUNTERS:
                    row[f"{role}_{counter}"] = int(getattr(scaler, counter))
            stats.append(row)
    return stats


# ------------------------------------------------------------------------------ run glue
def torchao_config(recipe: FP8Recipe) -> Any:
    """torchao's ``Float8LinearConfig`` doing what ``recipe`` says (dynamic scaling only): its
    tensorwise or rowwise recipe, with this recipe's formats (E5M2 gradients in the hybrid format;
    torchao's rowwise recipe alone would use E4M3), power-of-two scales and GEMM (emulated when
    ``recipe.real_gemm`` is false); with ``recipe.fsdp_float8_all_gather`` and tensorwise scales
    (torchao has no rowwise FP8 all-gather), FSDP2 all-gathers the weights in FP8, their scales
    precomputed by mptrain.precision.quant.dist."""
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.config import CastConfig, ScalingGranularity

    rowwise = recipe.granularity == "rowwise"
    granularity = ScalingGranularity.AXISWISE if rowwise else ScalingGranularity.TENSORWISE
    forward = CastConfig(scaling_granularity=granularity, target_dtype=recipe.forward_dtype)
    backward = CastConfig(scaling_granularity=granularity, target_dtype=recipe.backward_dtype)
    return replace(
        Float8LinearConfig.from_recipe_name(recipe.granularity),
        cast_config_input=forward,
        cast_config_input_for_grad_weight=forward,
        cast_config_weight=forward,
        cast_config_weight_for_grad_input=forward,
        cast_config_grad_output=backward,
        cast_config_grad_output_for_grad_weight=backward,
        round_scales_to_power_of_2=recipe.pow2_scales,
        emulate=not recipe.real_gemm,
        enable_fsdp_float8_all_gather=recipe.fsdp_float8_all_gather and not rowwise,
    )


def _torchao_convert(model: nn.Module, converted: set[str], recipe: FP8Recipe) -> None:
    """Convert the chosen layers with torchao's float8 training (:func:`torchao_config`)."""
    from torchao.float8 import convert_to_float8_training

    convert_to_float8_training(
        model,
        config=torchao_config(recipe),
        module_filter_fn=lambda module, name: name in converted,
    )


def apply_fp8(
    model: nn.Module,
    recipe: FP8Recipe,
    sample: torch.Tensor,
    *,
    include: list[str],
    exclude: list[str],
    keep_first_last: bool,
    backend: str = "builtin",
) -> dict[str, Any]:
    """Convert the model's eligible Linear layers in place; return the report's ``fp8`` section:
    the recipe's settings, and per Linear whether it converted and, if not, why.

    ``sample`` is one input batch, used only to count each Linear's FLOPs. Layers with in or out
    features below ``recipe.min_features`` stay in high precision.
    """
    choices = choose_layers(model, include, exclude, keep_first_last, recipe.min_features)
    flops = linear_flops(model, sample)
    converted = {c.name for c in choices if c.converted}
    if backend == "torchao":
        if recipe.scaling != "dynamic":
            raise ValueError("fp8.backend=torchao supports fp8.scaling=dynamic only")
        _torchao_convert(model, converted, recipe)
    else:
        convert_to_fp8(model, choices, recipe)
    share, layers = layer_rows(choices, flops)
    return {
        "backend": backend,
        "gemm": "torch._scaled_mm" if recipe.real_gemm else "emulated (FP8 cast, FP32 matmul)",
        "emulated": not recipe.real_gemm,
        "forward_dtype": dtype_name(recipe.forward_dtype),
        "backward_dtype": dtype_name(recipe.backward_dtype),
        "scaling": recipe.scaling,
        "granularity": recipe.granularity,
        "amax_history_len": recipe.amax_history_len,
        "amax_compute_algo": recipe.amax_compute_algo,
        "margin": recipe.margin,
        "pow2_scales": recipe.pow2_scales,
        "min_features": recipe.min_features,
        "converted_linear_flops_share": share,
        "layers": layers,
    }
