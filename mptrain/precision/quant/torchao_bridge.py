"""``fp8.backend=torchao``: the chosen Linear layers converted by torchao's float8 training
instead of mptrain's :class:`~.fp8_linear.Float8Linear`, with the same quantization
(:func:`torchao_config`); tests/precision/test_fp8_torchao.py compares the two bit for bit.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from torch import nn

from mptrain.precision.quant.fp8 import FP8Quantization


def torchao_config(quantization: FP8Quantization) -> Any:
    """torchao's ``Float8LinearConfig`` doing what ``quantization`` says (dynamic scaling only): its
    tensorwise or rowwise quantization, with this quantization's formats (E5M2 gradients in the hybrid format;
    torchao's rowwise quantization alone would use E4M3), power-of-two scales and GEMM (emulated when
    ``quantization.real_gemm`` is false); with ``quantization.fsdp_float8_all_gather`` and tensorwise scales
    (torchao has no rowwise FP8 all-gather), FSDP2 all-gathers the weights in FP8, their scales
    precomputed by mptrain.precision.quant.dist."""
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.config import CastConfig, ScalingGranularity

    rowwise = quantization.granularity == "rowwise"
    granularity = ScalingGranularity.AXISWISE if rowwise else ScalingGranularity.TENSORWISE
    forward = CastConfig(scaling_granularity=granularity, target_dtype=quantization.forward_dtype)
    backward = CastConfig(scaling_granularity=granularity, target_dtype=quantization.backward_dtype)
    return replace(
        Float8LinearConfig.from_recipe_name(quantization.granularity),
        cast_config_input=forward,
        cast_config_input_for_grad_weight=forward,
        cast_config_weight=forward,
        cast_config_weight_for_grad_input=forward,
        cast_config_grad_output=backward,
        cast_config_grad_output_for_grad_weight=backward,
        round_scales_to_power_of_2=quantization.pow2_scales,
        emulate=not quantization.real_gemm,
        enable_fsdp_float8_all_gather=quantization.fsdp_float8_all_gather and not rowwise,
    )


def torchao_convert(model: nn.Module, converted: set[str], quantization: FP8Quantization) -> None:
    """Convert the layers named in ``converted`` with torchao's float8 training
    (:func:`torchao_config`); ValueError for delayed scaling, which it cannot run."""
    if quantization.scaling != "dynamic":
        raise ValueError("fp8.backend=torchao supports fp8.scaling=dynamic only")
    from torchao.float8 import convert_to_float8_training

    convert_to_float8_training(
        model,
        config=torchao_config(quantization),
        module_filter_fn=lambda module, name: name in converted,
    )
