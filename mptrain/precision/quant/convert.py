"""Which Linear layers of a model take a quantized format, and the conversion: one path for every
format (FP8 per tensor or row: :class:`~.fp8_linear.Float8Linear`; MXFP8, NVFP4, blockwise FP8:
:class:`~.block_linear.BlockLinear`), undone, as every layer format's, by
:func:`mptrain.precision.formats.to_plain_linear`; the report's section of the format
(:func:`apply_quantized`), the run's handle on its block layers (:class:`BlockLayers`) and the FP8
layers' final figures (:func:`fp8_layer_stats`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mptrain.config.base import ConfigError
from mptrain.config.format_table import FORMAT_TABLE, FP8
from mptrain.platform.dtypes import dtype_name
from mptrain.precision.quant.block_linear import BlockLinear
from mptrain.precision.quant.block_quant import BlockQuantization
from mptrain.precision.quant.fp8 import AMAX_EVENT_COUNTERS, GEMM_ALIGNMENT, FP8Quantization
from mptrain.precision.quant.fp8_linear import Float8Linear
from mptrain.precision.quant.linear import LayerPlans, QuantizedLinear
from mptrain.precision.selection import (
    LayerChoice,
    LayerRules,
    choose,
    layer_rows,
    linear_flops,
    set_submodule,
)

Quantization = FP8Quantization | BlockQuantization  # what a converted layer's formats quantize by


# ------------------------------------------------------------------------------ selection
def layer_rules(
    quantization: Quantization, include: list[str], exclude: list[str], keep_first_last: bool
) -> LayerRules:
    """The selection rules of ``quantization``'s format, under its config keys."""
    chosen = (tuple(include), tuple(exclude), keep_first_last, quantization.min_features)
    if isinstance(quantization, FP8Quantization):  # torch._scaled_mm's alignment and reason
        return LayerRules(FORMAT_TABLE[FP8].config_group, *chosen, alignment=GEMM_ALIGNMENT)
    return LayerRules(
        quantization.row.config_group,
        *chosen,
        alignment=quantization.block_size,
        alignment_why=f"{quantization.row.label} blocks of {quantization.block_size}",
        keep_last_fraction=quantization.keep_last_fraction,
    )


def choose_layers(
    model: nn.Module,
    include: list[str],
    exclude: list[str],
    keep_first_last: bool,
    min_features: int = 0,
) -> list[LayerChoice]:
    """FP8's choice for every nn.Linear of ``model`` (:func:`layer_rules` of an FP8 quantization)."""
    rules = layer_rules(
        FP8Quantization(min_features=min_features), include, exclude, keep_first_last
    )
    return choose(model, rules)


# ------------------------------------------------------------------------------ seeds
def layer_seed(seed: int, index: int) -> int:
    """The seed of the ``index``-th converted block layer (its ``seed``): its Hadamard signs, the
    same on every rank (as torchtitan's replicated sign vector), and through
    :func:`generator_seed` its stochastic-rounding generator. Distinct per layer, the same in
    every run of ``seed`` (a 64-bit mix: torch seeds are 64-bit)."""
    return (seed * 0x9E3779B97F4A7C15 + index + 1) % 2**64


def generator_seed(seed: int, rank: int) -> int:
    """The seed of the stochastic-rounding generator on ``rank`` of a layer seeded ``seed``
    (:func:`layer_seed`): ``seed`` itself on rank 0 (a single process's), on every other rank a
    64-bit mix of it and the rank (splitmix64's finalizer), so data-parallel ranks round their
    gradients with different draws (why: docs/precisions.md, *Under torchrun*)."""
    if rank == 0:
        return seed
    z = (seed + rank * 0x9E3779B97F4A7C15) % 2**64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
    return z ^ (z >> 31)


def process_place() -> tuple[int, int]:
    """(rank, world size) of this process in torch.distributed's default group (the one
    :func:`mptrain.platform.distributed.init_distributed` joins); (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


# ------------------------------------------------------------------------------ conversion
def _quantized(
    linear: nn.Linear,
    quantization: Quantization,
    index: int,
    rank: int,
    plans: LayerPlans | None,
    name: str,
) -> QuantizedLinear:
    """The ``index``-th converted layer, ``name``, made from ``linear`` (sharing its Parameters)."""
    plan = plans.for_layer(name) if plans is not None else None
    try:
        if isinstance(quantization, FP8Quantization):
            return Float8Linear.from_linear(linear, quantization, plan)
        seed = layer_seed(quantization.seed, index)
        layer = BlockLinear.from_linear(linear, quantization, seed, plan)
    except ValueError as exc:  # a plan's GEMM format needs sizes the layer's selection did not
        if plan is None:
            raise
        raise ConfigError(f"precision.gemms: {name}: {exc}") from None
    if layer.generator is not None:
        layer.generator.manual_seed(generator_seed(seed, rank))
    return layer


def convert_linears(
    model: nn.Module,
    choices: list[LayerChoice],
    quantization: Quantization,
    plans: LayerPlans | None = None,
    place: tuple[int, int] | None = None,
) -> dict[str, QuantizedLinear]:
    """Replace the chosen nn.Linear layers of ``model`` in place by ``quantization``'s layer (sharing
    their Parameters; drawing no global random number), each with its plan of ``plans`` (None:
    its format's own); a block layer's generator seeded for the rank of ``place`` ((rank, world
    size); by default this process's, :func:`process_place`). Returns them by name."""
    rank, _ = place or process_place()
    layers = {}
    for index, choice in enumerate(c for c in choices if c.converted):
        linear = model.get_submodule(choice.name)
        layers[choice.name] = _quantized(linear, quantization, index, rank, plans, choice.name)
        set_submodule(model, choice.name, layers[choice.name])
    return layers


def _recipe_section(quantization: Quantization, backend: str) -> dict[str, Any]:
    """The report section's account of ``quantization``: its GEMM (real or emulated) and settings."""
    if isinstance(quantization, FP8Quantization):
        return {
            "backend": backend,
            "gemm": "torch._scaled_mm"
            if quantization.real_gemm
            else "emulated (FP8 cast, FP32 matmul)",
            "emulated": not quantization.real_gemm,
            "forward_dtype": dtype_name(quantization.forward_dtype),
            "backward_dtype": dtype_name(quantization.backward_dtype),
            "scaling": quantization.scaling,
            "granularity": quantization.granularity,
            "amax_history_len": quantization.amax_history_len,
            "amax_compute_algo": quantization.amax_compute_algo,
            "margin": quantization.margin,
            "pow2_scales": quantization.pow2_scales,
        }
    return {
        **quantization.describe(),
        "name": quantization.row.label,
        "gemm": "scaled_mm"
        if quantization.real_gemm
        else "emulated (dequantized operands, FP32 matmul)",
        "emulated": not quantization.real_gemm,
    }


def apply_quantized(
    model: nn.Module,
    quantization: Quantization,
    sample: torch.Tensor,
    rules: LayerRules,
    plans: LayerPlans | None = None,
    backend: str = "builtin",
) -> dict[str, Any]:
    """Convert the model's Linear layers that ``rules`` (:func:`layer_rules`) choose, in place
    (FP8's through torchao's float8 training with ``backend="torchao"``); return the report's
    section of the format: the quantization, the GEMM, the converted share of the Linear FLOPs, and per
    Linear whether it converted and, if not, why. ``sample`` (one input batch) counts each
    Linear's FLOPs."""
    choices = choose(model, rules)
    flops = linear_flops(model, sample)
    if backend == "torchao":
        from mptrain.precision.quant.torchao_bridge import torchao_convert

        if not isinstance(quantization, FP8Quantization):
            raise ValueError("fp8.backend=torchao: FP8 with tensorwise or rowwise scales only")

        torchao_convert(model, {c.name for c in choices if c.converted}, quantization)
    else:
        convert_linears(model, choices, quantization, plans)
    share, rows = layer_rows(choices, flops, plans)
    section = {
        **_recipe_section(quantization, backend),
        "min_features": quantization.min_features,
        "converted_linear_flops_share": share,
    }
    if isinstance(quantization, BlockQuantization):
        # The Linear layers' FLOPs by the format they compute in (the rest stay in BF16).
        section["linear_flops_share"] = {
            quantization.format: share,
            "bf16": 1.0 - share if flops else 0.0,
        }
        section["counted"] = (
            "the quantizations of the steps of the metrics rows (every log_every steps)"
        )
    return {**section, "layers": rows}


# ------------------------------------------------------------------------------ the run's handle
def fp8_layer_stats(model: nn.Module) -> list[dict[str, Any]]:
    """Per Float8Linear and role (input, weight, grad): final scale and amax, saturated fraction,
    and ``<role>_zero_amax_casts`` / ``<role>_nonfinite_amax_casts``: the training casts whose
    amax was zero / inf or NaN, from which no scale was taken (reads device values)."""
    stats = []
    for name, layer in model.named_modules():
        if isinstance(layer, Float8Linear):
            row: dict[str, Any] = {"name": name}
            for role in ("input", "weight", "grad"):
                scaler = getattr(layer, f"{role}_scaler")
                seen = float(scaler.seen)
                row[f"{role}_scale"] = float(scaler.scale)
                row[f"{role}_amax"] = float(scaler.amax_history[0])
                row[f"{role}_saturated_fraction"] = float(scaler.saturated) / seen if seen else 0.0
                for counter in AMAX_EVENT_COUNTERS:
                    row[f"{role}_{counter}"] = int(getattr(scaler, counter))
            stats.append(row)
    return stats


@dataclass
class BlockLayers:
    """The block-scaled layers of a run, by name (empty for a run without block formats: every
    call then does nothing), and this process's ``rank`` of ``world_size`` (their generators
    draw per rank: :func:`generator_seed`)."""

    layers: dict[str, BlockLinear] = field(default_factory=dict)
    section: dict[str, Any] | None = None  # the report's blocks section (apply_quantized's)
    rank: int = 0
    world_size: int = 1

    @classmethod
    def of(
        cls,
        model: nn.Module,
        section: dict[str, Any] | None = None,
        place: tuple[int, int] | None = None,
    ) -> BlockLayers:
        """The BlockLinear layers of ``model`` as they stand, by name in module order (the
        order :func:`convert_linears` made them in), with the report's ``section``, on the rank
        of ``place`` (by default this process's, :func:`process_place`: whose generators'
        states it saves and restores)."""
        layers = {n: m for n, m in model.named_modules() if isinstance(m, BlockLinear)}
        rank, world_size = place or process_place()
        return cls(layers, section, rank=rank, world_size=world_size)

    def sample(self, on: bool) -> None:
        """Count the coming quantizations (:class:`BlockStats`) when ``on``, until called again
        with False (the loop: around the forward and backward of its log rows' steps)."""
        for layer in self.layers.values():
            layer.sampling = on

    def state_dict(self) -> dict[str, Any]:
        """Every rank's stochastic-rounding generators' states (CPU byte tensors):
        ``{"ranks": [{layer name: state}, ...]}``, indexed by rank; empty without generators.
        Under a world of several ranks a collective (all_gather_object): every rank calls it,
        as the checkpointer's payload does, and rank 0 writes what all of them drew."""
        own = {
            name: layer.generator.get_state()
            for name, layer in self.layers.items()
            if layer.generator is not None
        }
        if not own:  # the same on every rank: all of them skip the collective
            return {}
        ranks: list[Any] = [own]
        if self.world_size > 1:
            ranks = [None] * self.world_size
            dist.all_gather_object(ranks, own)
        return {"ranks": ranks}

    def load_state_dict(self, states: dict[str, Any]) -> list[str]:
        """Restore this rank's generators from :meth:`state_dict`'s (a checkpoint's): the draws
        resume where they stopped. A checkpoint written before ranks drew apart holds one flat
        ``{layer name: state}``, rank 0's. Where the layers with generators differ (a checkpoint
        of another precision or quantization, resumed with ``resume_allow_changes``) or the checkpoint
        holds no states for this rank (saved by fewer ranks) nothing is restored: the
        generators start from their seeds, and the returned notes say so."""
        own = {n for n, layer in self.layers.items() if layer.generator is not None}
        if not own:
            return []
        ranks = states["ranks"] if isinstance(states.get("ranks"), list) else [states]
        if not states:  # a checkpoint without generators: none for any rank
            ranks = [{}] * self.world_size
        notes = []
        if len(ranks) != self.world_size:
            notes.append(
                f"stochastic-rounding generators saved by {len(ranks)} rank(s), resumed by "
                f"{self.world_size}: ranks below {min(len(ranks), self.world_size)} continue "
                "their draws, any other starts from its seeds"
            )
        if self.rank >= len(ranks):  # the note above says so
            return notes
        mine = ranks[self.rank]
        if set(mine) != own:
            return [
                *notes,
                f"stochastic-rounding generators not resumed (the checkpoint has them for "
                f"{len(mine)} layers, this run for {len(own)}): they start from their seeds",
            ]
        for name, state in mine.items():
            self.layers[name].generator.set_state(state)
        return notes

    def layer_stats(self) -> list[dict[str, Any]]:
        """Per layer and role (input, weight, grad), the counted quantizations' sums."""
        return [{"name": n, **layer.layer_stats()} for n, layer in self.layers.items()]
