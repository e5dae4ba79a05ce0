"""Which layers take a block-scaled format and how: the conversion (undone, as every layer
format's, by :func:`mptrain.precision.formats.to_plain_linear`), the run's handle on the converted
layers (:class:`BlockLayers`: counting on the loop's log rows, the stochastic-rounding generators
a checkpoint saves, the per-layer figures of the report), and :func:`apply_blocks`, which returns
the report's ``blocks`` section: the conversion that :data:`mptrain.precision.formats.LAYER_FORMATS`
registers for mxfp8, nvfp4 and fp8_blockwise.

Layer selection is FP8's (:mod:`mptrain.precision.selection`) under the format's keys, with the
block size as the alignment: a Linear whose in or out features are not multiples of it stays in
BF16, with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mptrain.config.base import ConfigError
from mptrain.precision.quant.block_linear import BlockLinear
from mptrain.precision.quant.block_recipe import BlockRecipe
from mptrain.precision.quant.linear import LayerPlans
from mptrain.precision.selection import (
    LayerChoice,
    LayerRules,
    choose,
    layer_rows,
    linear_flops,
    set_submodule,
)


def layer_rules(
    recipe: BlockRecipe, include: list[str], exclude: list[str], keep_first_last: bool
) -> LayerRules:
    """The selection rules of ``recipe``'s format, under its config keys."""
    return LayerRules(
        key=recipe.config_key,
        include=tuple(include),
        exclude=tuple(exclude),
        keep_first_last=keep_first_last,
        min_features=recipe.min_features,
        alignment=recipe.block_size,
        alignment_why=f"{recipe.row.label} blocks of {recipe.block_size}",
        keep_last_fraction=recipe.keep_last_fraction,
    )


def layer_seed(seed: int, index: int) -> int:
    """The seed of the ``index``-th converted layer (its ``seed``): its Hadamard signs, the same
    on every rank (as torchtitan's replicated sign vector), and through :func:`generator_seed`
    its stochastic-rounding generator. Distinct per layer, the same in every run of ``seed`` (a
    64-bit mix: torch seeds are 64-bit)."""
    return (seed * 0x9E3779B97F4A7C15 + index + 1) % 2**64


def generator_seed(seed: int, rank: int) -> int:
    """The seed of the stochastic-rounding generator on ``rank`` of a layer seeded ``seed``
    (:func:`layer_seed`). Rank 0, a single process's, keeps ``seed`` itself (so single-process
    runs draw what they drew before ranks had their own); every other rank a 64-bit mix of it
    and the rank (splitmix64's finalizer), so data-parallel ranks round their gradients with
    different draws: the same draws on every rank would correlate the rounding errors that the
    gradient all-reduce averages (torchtitan seeds NVFP4's rounding per rank too)."""
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


@dataclass
class BlockLayers:
    """The converted layers of a run, by name (empty for a run without block formats: every
    call then does nothing), and this process's ``rank`` of ``world_size`` (their generators
    draw per rank: :func:`generator_seed`)."""

    layers: dict[str, BlockLinear] = field(default_factory=dict)
    section: dict[str, Any] | None = None  # the report's blocks section (apply_blocks's)
    rank: int = 0
    world_size: int = 1

    @classmethod
    def of(cls, model: nn.Module, section: dict[str, Any] | None = None) -> BlockLayers:
        """The BlockLinear layers of ``model`` as they stand, by name in module order (the
        order :func:`convert_to_blocks` made them in), with the report's ``section``, on this
        process's rank (:func:`process_place`: whose generators' states it saves and restores)."""
        layers = {n: m for n, m in model.named_modules() if isinstance(m, BlockLinear)}
        rank, world_size = process_place()
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
        of another precision or recipe, resumed with ``resume_allow_changes``) or the checkpoint
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


def convert_to_blocks(
    model: nn.Module,
    choices: list[LayerChoice],
    recipe: BlockRecipe,
    place: tuple[int, int] | None = None,
    plans: LayerPlans | None = None,
) -> BlockLayers:
    """Replace the chosen nn.Linear layers of ``model`` in place by :class:`BlockLinear`
    (sharing their parameters), each seeded by :func:`layer_seed`, its generator by
    :func:`generator_seed` for the rank of ``place`` ((rank, world size); by default this
    process's, :func:`process_place`)."""
    rank, world_size = place or process_place()
    layers = {}
    for index, choice in enumerate(c for c in choices if c.converted):
        linear = model.get_submodule(choice.name)
        seed = layer_seed(recipe.seed, index)
        try:
            plan = plans.for_layer(choice.name) if plans is not None else None
            layer = BlockLinear.from_linear(linear, recipe, seed, plan)
        except ValueError as exc:  # a GEMM's format has larger blocks than the layer's selection
            raise ConfigError(f"precision.gemms: {choice.name}: {exc}") from None
        if layer.generator is not None:
            layer.generator.manual_seed(generator_seed(seed, rank))
        set_submodule(model, choice.name, layer)
        layers[choice.name] = layer
    return BlockLayers(layers, rank=rank, world_size=world_size)


def apply_blocks(
    model: nn.Module,
    recipe: BlockRecipe,
    sample: torch.Tensor,
    *,
    include: list[str],
    exclude: list[str],
    keep_first_last: bool,
    plans: LayerPlans | None = None,
) -> tuple[BlockLayers, dict[str, Any]]:
    """Convert the model's eligible Linear layers in place: (the converted layers, the report's
    ``blocks`` section: the recipe, the GEMM, the share of Linear FLOPs per format, and per
    Linear whether it converted and, if not, why). ``sample`` (one input batch) counts FLOPs."""
    choices = choose(model, layer_rules(recipe, include, exclude, keep_first_last))
    flops = linear_flops(model, sample)
    layers = convert_to_blocks(model, choices, recipe, plans=plans)
    share, rows = layer_rows(choices, flops, plans)
    section = {
        **recipe.describe(),
        "name": recipe.row.label,
        "gemm": "scaled_mm" if recipe.real_gemm else "emulated (dequantized operands, FP32 matmul)",
        "emulated": not recipe.real_gemm,
        "min_features": recipe.min_features,
        "converted_linear_flops_share": share,
        # The Linear layers' FLOPs by the format they compute in (the rest stay in BF16).
        "linear_flops_share": {recipe.format: share, "bf16": 1.0 - share if flops else 0.0},
        "counted": "the quantizations of the steps of the metrics rows (every log_every steps)",
        "layers": rows,
    }
    return layers, section
