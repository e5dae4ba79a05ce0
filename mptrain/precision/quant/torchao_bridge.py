"""``fp8.backend=torchao``: the chosen Linear layers converted by torchao's float8 training
instead of mptrain's :class:`~.fp8_linear.Float8Linear`, with the same recipe
(:func:`torchao_config`); tests/precision/test_fp8_torchao.py compares the two bit for bit.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from torch import nn

from mptrain.precision.quant.fp8 import FP8Recipe


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


def torchao_convert(model: nn.Module, converted: set[str], recipe: FP8Recipe) -> None:
    """Convert the layers named in ``converted`` with torchao's float8 training
    (:func:`torchao_config`); ValueError for delayed scaling, which it cannot run."""
    if recipe.scaling != "dynamic":
        raise ValueError("fp8.backend=torchao supports fp8.scaling=dynamic only")
    from torchao.float8 import convert_to_float8_training

    convert_to_float8_training(
        model,
        config=torchao_config(recipe),
        module_filter_fn=lambda module, name: name in converted,
    )
