"""Two points of NVIDIA's NVFP4 recipe (arXiv 2509.25149) that mptrain follows faithfully.

1. ``nvfp4.keep_last_fraction`` counts transformer blocks (:func:`selection.block_list`'s rule),
   rounded up, and keeps every Linear in those blocks and after the last one; a model without a
   block list counts Linear layers and its reasons say so. Checked on mptrain's GPT and ViT, its
   MLP, torchvision's VisionTransformer and ResNet.
2. The stochastic-rounding generators draw per data-parallel rank (rank 0 as a single process
   always did), every rank's states are checkpointed, and each rank resumes its own: a resumed
   2-rank run equals the uninterrupted one bit for bit (the slow test at the end).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torchvision.models import VisionTransformer, resnet18

from mptrain.checkpoint.file import load_checkpoint
from mptrain.config.models import MLPConfig
from mptrain.models.builtin import build_mlp
from mptrain.models.gpt import GPT, GPTShape
from mptrain.precision.quant.block_quant import BlockQuantization
from mptrain.precision.quant.convert import (
    BlockLayers,
    convert_linears,
    generator_seed,
    layer_rules,
    layer_seed,
)
from mptrain.precision.selection import LayerRules, block_list, choose

NVFP4 = BlockQuantization("nvfp4", weight_tiles=True, hadamard=True, stochastic_rounding=True)


def gpt(layers: int) -> GPT:
    return GPT(GPTShape(vocab_size=32, block_size=8, layers=layers, heads=2, width=32))


def tiny_vit(layers: int) -> VisionTransformer:
    return VisionTransformer(
        image_size=32, patch_size=16, num_layers=layers, num_heads=2, hidden_dim=32, mlp_dim=64
    )


def kept(model: nn.Module, fraction: float, **rules) -> dict[str, str]:
    """The reasons of the Linear layers that do not convert (NVFP4's rules)."""
    settings = LayerRules("nvfp4", keep_last_fraction=fraction, alignment=16, **rules)
    return {c.name: c.reason for c in choose(model, settings) if not c.converted}


# ---------------------------------------------------------------------- 1. the blocks
def test_the_block_list_rule_on_gpt_vit_mlp_and_resnet():
    name, blocks = block_list(gpt(4))
    assert name == "blocks" and len(blocks) == 4
    name, blocks = block_list(tiny_vit(3))
    assert name == "encoder.layers" and len(blocks) == 3
    # a Sequential of Linear and ReLU layers: mixed classes, and Linear layers are not blocks
    assert block_list(build_mlp(MLPConfig(hidden_sizes=[64, 64, 64]), 1, 8, 10)) is None
    assert block_list(resnet18(num_classes=10)) is None  # its blocks hold no Linear
    assert block_list(nn.Sequential(nn.Sequential(nn.Linear(4, 4)))) is None  # one is no list


def test_the_longest_list_wins_and_a_tie_goes_to_the_later_one():
    def stack(n: int) -> nn.ModuleList:
        return nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.ReLU()) for _ in range(n))

    class EncoderDecoder(nn.Module):
        def __init__(self, encoder: int, decoder: int) -> None:
            super().__init__()
            self.encoder, self.decoder = stack(encoder), stack(decoder)

    assert block_list(EncoderDecoder(3, 2))[0] == "encoder"
    assert block_list(EncoderDecoder(2, 2))[0] == "decoder"


@pytest.mark.parametrize(
    ("layers", "fraction", "blocks_kept"),
    [(4, 0.15, 1), (7, 0.15, 2), (20, 0.15, 3), (20, 0.5, 10), (2, 0.01, 1)],
)
def test_the_fraction_counts_blocks_rounded_up(layers, fraction, blocks_kept):
    """ceil(fraction x blocks): at least the fraction stays in BF16, at least one block for any
    fraction > 0 (0.15 x 20 is 3.0000000000000004 in floating point: still 3)."""
    reasons = kept(gpt(layers), fraction, keep_first_last=False, exclude=("head",))
    first_kept = layers - blocks_kept
    expected = {
        f"blocks.{b}.{linear}": (
            f"in the last {blocks_kept} of the {layers} blocks in 'blocks' "
            f"(nvfp4.keep_last_fraction={fraction:g}), kept in BF16"
        )
        for b in range(first_kept, layers)
        for linear in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")
    }
    assert reasons == {**expected, "head": "excluded by nvfp4.exclude pattern 'head'"}


def test_the_head_after_the_blocks_is_kept_by_the_tail_or_by_first_last():
    tail = "(nvfp4.keep_last_fraction=0.15), kept in BF16"
    alone = kept(gpt(4), 0.15, keep_first_last=False)
    assert alone["head"] == f"after the last block in 'blocks' {tail}"
    assert alone["blocks.3.mlp.fc"] == f"in the last 1 of the 4 blocks in 'blocks' {tail}"
    both = kept(gpt(4), 0.15, keep_first_last=True)
    assert both["head"] == both["blocks.0.attn.qkv"] == "first/last layer kept in BF16"
    assert len(both) == 1 + 4 + 1  # the first Linear, the last block, the head


def test_torchvisions_vision_transformer_keeps_its_last_blocks_and_head():
    reasons = kept(tiny_vit(7), 0.15, keep_first_last=False)
    where = "blocks in 'encoder.layers' (nvfp4.keep_last_fraction=0.15)"
    assert {n for n, r in reasons.items() if r.startswith(f"in the last 2 of the 7 {where}")} == {
        f"encoder.layers.encoder_layer_{b}.{linear}"
        for b in (5, 6)
        for linear in ("self_attention.out_proj", "mlp.0", "mlp.3")
    }
    assert reasons["heads.head"].startswith("after the last block in 'encoder.layers'")
    assert len(reasons) == 7


def test_a_model_without_blocks_counts_linear_layers_and_says_so():
    mlp = build_mlp(MLPConfig(hidden_sizes=[64] * 6), 1, 8, 16)  # 7 Linear layers
    reasons = kept(mlp, 0.3, keep_first_last=False)
    why = (
        "in the last 0.3 of Linear layers (nvfp4.keep_last_fraction; the model has no block "
        "list), kept in BF16"
    )
    assert reasons == {"9": why, "11": why, "13": why}  # ceil(0.3 x 7) = 3 (0: Flatten)
    (fc,) = kept(resnet18(num_classes=16), 0.15, keep_first_last=False).values()
    assert fc == why.replace("0.3", "0.15")


def test_no_tail_without_a_fraction_or_with_include():
    assert kept(gpt(4), 0.0, keep_first_last=False) == {}
    assert kept(gpt(4), 0.5, keep_first_last=False, include=("blocks.*", "head")) == {}


def test_the_block_formats_rules_carry_the_fraction():
    recipe = BlockQuantization("nvfp4", keep_last_fraction=0.25)
    reasons = {c.name: c.reason for c in choose(gpt(4), layer_rules(recipe, [], ["head"], False))}
    assert [n for n, r in reasons.items() if r != "converted"] == [
        "blocks.3.attn.qkv", "blocks.3.attn.proj", "blocks.3.mlp.fc", "blocks.3.mlp.proj", "head"
    ]  # fmt: skip


# --------------------------------------------------------------- 2. per-rank generators
def converted(place: tuple[int, int]) -> BlockLayers:
    model = gpt(2)
    choices = choose(model, layer_rules(NVFP4, [], ["head"], False))
    convert_linears(model, choices, NVFP4, place=place)
    return BlockLayers.of(model, place=place)


def test_ranks_draw_apart_with_the_same_hadamard_signs_and_rank_0_as_before():
    alone, first, second = converted((0, 1)), converted((0, 2)), converted((1, 2))
    assert (second.rank, second.world_size) == (1, 2)
    for name, layer in alone.layers.items():
        # rank 0 is a single process's generator, seeded as before ranks drew apart
        expected = torch.Generator().manual_seed(layer.seed).get_state()
        assert torch.equal(layer.generator.get_state(), expected)
        assert torch.equal(first.layers[name].generator.get_state(), expected)
        other = second.layers[name]
        assert other.seed == layer.seed and torch.equal(other.rht_signs, layer.rht_signs)
        draws = [torch.rand(64, generator=g.layers[name].generator) for g in (alone, second)]
        assert not torch.equal(*draws)


def test_generator_seeds_are_distinct_per_layer_and_rank():
    seeds = {generator_seed(layer_seed(0, i), r) for i in range(50) for r in range(16)}
    assert len(seeds) == 50 * 16
    assert all(0 <= s < 2**64 for s in seeds)
    assert generator_seed(12345, 0) == 12345


def advance(layers: BlockLayers) -> None:
    for layer in layers.layers.values():
        torch.rand(7, generator=layer.generator)


def states(layers: BlockLayers) -> dict[str, torch.Tensor]:
    return {n: layer.generator.get_state() for n, layer in layers.layers.items()}


def test_each_rank_resumes_its_own_states():
    ranks = [converted((r, 2)) for r in range(2)]
    for layers in ranks:
        advance(layers)
    # what the checkpoint holds: the gathered states, indexed by rank
    saved = {"ranks": [states(layers) for layers in ranks]}
    for rank in range(2):
        fresh = converted((rank, 2))
        assert fresh.load_state_dict(saved) == []
        for name, state in states(fresh).items():
            assert torch.equal(state, saved["ranks"][rank][name])


def test_fewer_or_more_ranks_and_old_flat_checkpoints_are_noted():
    two = [converted((r, 2)) for r in range(2)]
    for layers in two:
        advance(layers)
    saved = {"ranks": [states(layers) for layers in two]}
    alone = converted((0, 1))
    (note,) = alone.load_state_dict(saved)
    assert note == (
        "stochastic-rounding generators saved by 2 rank(s), resumed by 1: ranks below 1 "
        "continue their draws, any other starts from its seeds"
    )
    assert all(torch.equal(s, saved["ranks"][0][n]) for n, s in states(alone).items())
    # a checkpoint from before ranks drew apart: one flat dict, rank 0's
    flat = states(two[0])
    assert converted((0, 1)).load_state_dict(flat) == []
    second = converted((1, 2))
    before = states(second)
    (note,) = second.load_state_dict(flat)
    assert note.startswith("stochastic-rounding generators saved by 1 rank(s), resumed by 2")
    assert all(torch.equal(s, before[n]) for n, s in states(second).items())  # its own seeds
    (note,) = converted((1, 2)).load_state_dict({})
    assert "not resumed (the checkpoint has them for 0 layers" in note


@pytest.mark.slow
def test_a_resumed_two_rank_run_equals_the_uninterrupted_one(tmp_path):
    """2 Gloo ranks, NVFP4 with stochastic rounding: the checkpoint holds both ranks' generator
    states, which differ; a run resumed at step 4 writes a step-8 checkpoint equal to the
    uninterrupted run's bit for bit (weights, optimizer state, both ranks' generators), and the
    replicas agree."""
    from e2e.test_distributed import torchrun

    common = (
        "model=mlp",
        "precision=nvfp4",
        "max_steps=8",
        "log_every=2",
        "checkpoint.every_steps=4",
    )
    straight = torchrun(tmp_path / "straight", *common, "checkpoint.keep_last=3")
    stop = tmp_path / "straight" / "run" / "checkpoints" / "step_00000004.pt"
    resumed = torchrun(tmp_path / "resumed", *common, f"resume={stop}")
    whole, again = (
        load_checkpoint(tmp_path / d / "run" / "checkpoints" / "step_00000008.pt")
        for d in ("straight", "resumed")
    )
    assert whole["world_size"] == 2 and len(whole["blocks"]["ranks"]) == 2
    first, second = whole["blocks"]["ranks"]
    assert first.keys() == second.keys() == {"3"} and not torch.equal(first["3"], second["3"])
    for rank in range(2):
        assert torch.equal(whole["blocks"]["ranks"][rank]["3"], again["blocks"]["ranks"][rank]["3"])
    for key, value in whole["model"].items():
        assert torch.equal(value, again["model"][key]), key
    for index, state in whole["optimizer"]["state"].items():
        for key, value in state.items():
            assert torch.equal(again["optimizer"]["state"][index][key], value), (index, key)
    for ranks in (straight, resumed):
        for key, value in ranks[0]["params"].items():
            assert torch.equal(value, ranks[1]["params"][key]), key  # the replicas agree
