"""Activation checkpointing (memory.activation_checkpointing, mptrain.train.recompute): the same
gradients bit for bit in every precision it accepts, fewer saved activations, names and
checkpoints unchanged, and one line for what it refuses."""

from __future__ import annotations

import pytest
import torch
from support.runs import LM, compose_run, run_cli

from mptrain.config.base import ConfigError
from mptrain.models.task import logits_of
from mptrain.train.build import prepare_run
from mptrain.train.memory import account_step
from mptrain.train.recompute import recomputed

QUIET = ("threads=1", "precision.measure=false", "model.layers=2")
RESNET = ("model=resnet18", "dataset=synthetic", "dataset.image_size=32", "batch_size=8")
RESNET += ("device=cpu", "threads=1", "precision.measure=false", "progress=false")


def one_step(*overrides: str):
    """(loss, gradients by parameter name, the run) of one forward and backward on the first
    batch, as the loop runs them."""
    run = prepare_run(compose_run(*overrides))
    inputs, targets = next(iter(run.data.train.batches(0)))
    inputs = run.precision.model_input(inputs, run.settings.channels_last)
    with run.precision.forward_context():
        loss = run.loss_fn(logits_of(run.model(inputs)), targets)
    run.precision.scale(loss).backward()
    return loss, {n: p.grad for n, p in run.model.named_parameters()}, run


@pytest.mark.parametrize(
    "precision",
    [
        ("precision=fp32",),
        ("precision=bf16",),
        ("precision=fp16",),
        ("precision=fp8",),
        ("precision=fp8", "fp8.granularity=rowwise"),
        ("precision=fp8", "fp8.granularity=blockwise", "model.width=128"),  # blocks of 128
        ("precision=mxfp8",),
        ("precision=nvfp4",),  # stochastic rounding: backward draws only, in the same order
    ],
    ids=["fp32", "bf16", "fp16", "fp8", "fp8-rowwise", "fp8-blockwise", "mxfp8", "nvfp4"],
)
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_a_checkpointed_step_has_the_plain_steps_gradients_bit_for_bit(precision, mode):
    plain_loss, plain, _ = one_step(*LM, *QUIET, *precision)
    loss, grads, run = one_step(*LM, *QUIET, *precision, f"memory.activation_checkpointing={mode}")
    assert recomputed(run.model) == (2 if mode == "full" else 1)
    assert torch.equal(loss, plain_loss)
    assert grads.keys() == plain.keys()
    different = [n for n in plain if not torch.equal(grads[n], plain[n])]
    assert different == []


def test_residual_blocks_recompute_with_the_same_gradients():
    plain_loss, plain, _ = one_step(*RESNET, "precision=bf16")
    loss, grads, run = one_step(*RESNET, "precision=bf16", "memory.activation_checkpointing=full")
    assert recomputed(run.model) == 8  # ResNet-18's BasicBlocks
    assert torch.equal(loss, plain_loss)
    assert all(torch.equal(grads[n], plain[n]) for n in plain)


def test_full_checkpointing_keeps_a_third_or_less_of_the_gpts_activations():
    def activations(mode: str) -> int:
        cfg = compose_run(*LM, *QUIET, "model.layers=4", f"memory.activation_checkpointing={mode}")
        return account_step(prepare_run(cfg))["total"]["activations"]

    plain, full, selective = (activations(m) for m in ("none", "full", "selective"))
    assert plain >= 3 * full, (plain, full)
    assert full < selective < plain


def test_names_and_state_dict_are_the_plain_models():
    _, _, plain = one_step(*LM, *QUIET)
    _, _, run = one_step(*LM, *QUIET, "memory.activation_checkpointing=full")
    assert [n for n, _ in run.model.named_modules()] == [n for n, _ in plain.model.named_modules()]
    assert run.model.state_dict().keys() == plain.model.state_dict().keys()


def test_a_model_without_blocks_is_refused_in_one_line(tmp_path, monkeypatch):
    result = run_cli(
        ["model=mlp", "memory.activation_checkpointing=full", "max_steps=1"], tmp_path, monkeypatch,
        jobs=True,
    )  # fmt: skip
    assert result.code == 2, result
    assert result.stderr.strip().startswith(
        "mptrain: error: memory.activation_checkpointing=full: model=mlp has no transformer or "
        "residual blocks to recompute"
    )


def test_fp8_delayed_scaling_is_refused():
    cfg = compose_run(*LM, *QUIET, "precision=fp8", "fp8.scaling=delayed",
                      "memory.activation_checkpointing=full")  # fmt: skip
    with pytest.raises(ConfigError, match=r"fp8\.scaling=delayed would record each amax twice"):
        prepare_run(cfg)


def test_an_unknown_mode_is_refused_in_one_line(tmp_path, monkeypatch):
    result = run_cli(["memory.activation_checkpointing=some"], tmp_path, monkeypatch)
    assert result.code == 2 and not result.launched
    assert result.stderr.strip() == (
        "mptrain: error: memory.activation_checkpointing='some': one of none, full, selective"
    )
