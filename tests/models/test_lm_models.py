"""Language models from outside mptrain: the user's own (``task=lm model=custom``) and Hugging
Face ``transformers`` causal LMs built from a configuration class (``model=hf``), for real and
offline: each is built, checked by its dry forward, trained in every precision, audited, sampled
and evaluated."""

from __future__ import annotations

import json
import math
import re
import socket
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from support.processes import describe, run_mptrain
from support.runs import LM, compose_run, train
from torch import nn

from mptrain.commands.evaluate import load_model
from mptrain.commands.sample import generate
from mptrain.config.base import ConfigError
from mptrain.config.models import CustomModelConfig, HFModelConfig
from mptrain.models.build import build_model, model_facts

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
# The LM task's small run without model=gpt's sizes: each test names its model.
RUN = (*(o for o in LM if not o.startswith("model.")), "model.block_size=32")
TINY_GPT2 = ("+model.config.n_layer=1", "+model.config.n_head=2", "+model.config.n_embd=32")
TINY_LLAMA = (
    "model.config_class=LlamaConfig",
    "+model.config.num_hidden_layers=1",
    "+model.config.num_attention_heads=2",
    "+model.config.num_key_value_heads=2",
    "+model.config.hidden_size=32",
    "+model.config.intermediate_size=64",
)


# ------------------------------------------------------------------------ models for the checks
class ObjectLM(nn.Module):
    """Returns its logits in ``.logits``, as Hugging Face models do; records what it was given."""

    def __init__(self, vocab_size: int, block_size: int, width: int = 16) -> None:
        super().__init__()
        self.given = (vocab_size, block_size)
        self.emb = nn.Embedding(vocab_size, width)
        self.head = nn.Linear(width, vocab_size)

    def forward(self, ids: torch.Tensor) -> SimpleNamespace:
        return SimpleNamespace(logits=self.head(self.emb(ids)))


class WrongVocab(nn.Module):
    """Logits over a fixed 100 tokens, whatever the data's vocabulary."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(300, 100)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.emb(ids)


class LastPosition(nn.Module):
    """A classifier's shape: one row of logits per window."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab_size, vocab_size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.emb(ids)[:, -1]


def custom(name: str, **kwargs) -> CustomModelConfig:
    return CustomModelConfig(_target_=f"{__name__}.{name}", kwargs=kwargs, block_size=8)


def build_lm(cfg, vocab_size: int = 256) -> nn.Module:
    return build_model(cfg, 0, 0, vocab_size, sequence_length=8)


@pytest.fixture
def offline(monkeypatch):
    """No network: the Hub's offline switch, and any connection attempt fails the test."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def refuse(*args, **kwargs):
        raise AssertionError(f"a network connection was attempted: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)


# ------------------------------------------------------------------------------ your own model
def test_a_custom_lm_gets_vocab_and_block_size_and_may_return_an_object_with_logits():
    model = build_lm(custom("ObjectLM", width=8))
    assert model.given == (256, 8)
    assert model_facts(model).adaptations == [
        "vocab_size=256 passed from the dataset",
        "block_size=8 passed from model.block_size",
    ]


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("WrongVocab", "returns logits over 100 tokens; the data's vocabulary has 256"),
        ("LastPosition", "returns (2, 256) for 2 windows of 8 tokens; a language model must"),
    ],
)
def test_a_custom_lm_with_the_wrong_output_is_one_line_naming_its_target(name, message):
    with pytest.raises(ConfigError) as error:
        build_lm(custom(name))
    text = str(error.value)
    assert f"model._target_='{__name__}.{name}'" in text and message in text
    assert "\n" not in text


def test_model_custom_serves_both_tasks_and_block_size_only_the_lm():
    assert compose_run("task=lm", "model=custom", "model._target_=a.B").model.block_size is None
    assert compose_run("model=custom", "model._target_=a.B").task == "classify"
    with pytest.raises(ConfigError, match=re.escape("model.block_size=64: for language models")):
        compose_run("model=custom", "model._target_=a.B", "model.block_size=64")
    with pytest.raises(ConfigError, match="use model=gpt or model=hf or model=custom"):
        compose_run("task=lm", "model=cnn")


@pytest.mark.slow
def test_a_custom_lm_trains_in_fp8_and_is_audited(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    base = (*RUN, "model=custom", "model._target_=tiny_lm.TinyLM", "+model.width=32")
    report = train(compose_run(*base, "precision=fp8", "max_steps=6", "eval_every=6"), tmp_path)
    assert report["status"] == "completed", report["reason"]
    converted = {layer["name"] for layer in report["fp8"]["layers"] if layer["converted"]}
    assert converted == {"qkv", "proj", "mlp.0", "mlp.2"}  # the head is kept (task=lm)
    audited = tmp_path / "audit"
    train(compose_run(*base, "precision=bf16", "max_steps=1", "audit=true"), audited)
    ops = json.loads((audited / "audit.json").read_text())["ops"]
    assert {"qkv", "proj", "head"} <= {op["module"] for op in ops}
    attention = [o for o in ops if "attention" in o["op"] and o["phase"] == "forward"]
    assert attention and all(o["input_dtypes"].startswith("bfloat16") for o in attention)


# ------------------------------------------------------------------------------- Hugging Face
def test_model_hf_composes_and_refuses_what_mptrain_sets():
    cfg = compose_run("task=lm", "model=hf", *TINY_LLAMA, "model.block_size=64").model
    assert (cfg.config_class, cfg.block_size) == ("LlamaConfig", 64)
    assert cfg.config["hidden_size"] == 32
    with pytest.raises(ConfigError, match=re.escape("model.config.vocab_size=300: set by mptrain")):
        compose_run("task=lm", "model=hf", "+model.config.vocab_size=300")
    with pytest.raises(
        ConfigError, match=re.escape("model.config_class='gpt2': the name of a transformers")
    ):
        compose_run("task=lm", "model=hf", "model.config_class=gpt2")
    with pytest.raises(ConfigError, match="model=hf: for language models; add task=lm"):
        compose_run("model=hf")


@pytest.mark.slow
def test_an_hf_config_model_is_built_offline_with_the_data_s_sizes(offline):
    pytest.importorskip("transformers")
    cfg = HFModelConfig(config={"n_layer": 1, "n_head": 2, "n_embd": 32}, block_size=8)
    model = build_lm(cfg, vocab_size=100)
    assert (model.config.vocab_size, model.config.n_positions) == (100, 8)
    assert not model.config.use_cache
    assert all(p.dtype == torch.float32 for p in model.parameters())
    linears = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert "transformer.h.0.attn.c_attn" in linears and "lm_head" in linears
    assert model_facts(model).source == "hf" and model_facts(model).arch == "GPT2Config"
    with pytest.raises(
        ConfigError, match=re.escape("model.config.n_layer: not a key of LlamaConfig")
    ):
        build_lm(HFModelConfig(config_class="LlamaConfig", config={"n_layer": 1}))
    with pytest.raises(ConfigError, match="did you mean GPT2Config"):
        build_lm(HFModelConfig(config_class="GTP2Config"))
    with pytest.raises(
        ConfigError, match=re.escape("8 positions hold no window of model.block_size=16")
    ):
        build_lm(HFModelConfig(config={"n_positions": 8, "n_layer": 1}, block_size=16))


@pytest.mark.slow
def test_gpt2_conv1d_layers_become_the_equal_linear():
    pytest.importorskip("transformers")
    from transformers.pytorch_utils import Conv1D

    from mptrain.models.hf import conv1d_to_linear

    holder = nn.Sequential(Conv1D(12, 8))
    x = torch.randn(3, 5, 8)
    before = holder(x)
    assert conv1d_to_linear(holder, Conv1D) and isinstance(holder[0], nn.Linear)
    torch.testing.assert_close(holder(x), before)


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16", "fp8"])
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_hf_models_train_in_every_precision(tmp_path, offline, arch, precision):
    pytest.importorskip("transformers")
    sizes = TINY_GPT2 if arch == "gpt2" else TINY_LLAMA
    cfg = compose_run(*RUN, "model=hf", *sizes, f"precision={precision}", "max_steps=8")
    report = train(cfg, tmp_path)
    assert report["status"] == "completed", report["reason"]
    losses = [row["val_loss"] for row in report["evaluation"]["history"]]
    assert losses and all(math.isfinite(v) and v < math.log(256) for v in losses)
    if precision == "fp16":
        assert report["training"]["loss_scale"] is not None
    if precision == "fp8":
        layers = {layer["name"]: layer["converted"] for layer in report["fp8"]["layers"]}
        assert not layers.pop("lm_head") and layers and all(layers.values())


@pytest.mark.slow
def test_an_hf_run_samples_and_evaluates(tmp_path, offline):
    pytest.importorskip("transformers")
    run_dir = tmp_path / "run"
    cfg = compose_run(*RUN, "model=hf", *TINY_LLAMA, "precision=fp32", "max_steps=4")
    train(cfg, run_dir)
    model = load_model(run_dir)
    ids = torch.zeros(1, 3, dtype=torch.long)
    out = generate(model, ids, 40, model.mptrain_sequence_length, temperature=0)
    assert out.shape == (1, 43)  # past the 32-token context: the window slides
    result = run_mptrain(tmp_path, "sample", f"resume={run_dir}", "max_new_tokens=5")
    assert result.returncode == 0, describe(result)
    result = run_mptrain(tmp_path, "eval", f"resume={run_dir}", f"hydra.run.dir={tmp_path / 'e'}")
    assert result.returncode == 0, describe(result)
    final = json.loads((run_dir / "report.json").read_text())["evaluation"]
    assert json.loads((tmp_path / "e" / "eval.json").read_text())["val_loss"] == pytest.approx(
        final["final_val_loss"]
    )
