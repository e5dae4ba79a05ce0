"""Hugging Face ``transformers`` causal language models (``model=hf``), built from a
configuration class and its keyword arguments with fresh weights: no checkpoint, tokenizer or
code is read from the Hub (``AutoModelForCausalLM.from_config``, ``trust_remote_code=False``).
What mptrain sets (:func:`hf_config`, :func:`conv1d_to_linear`, FP32 parameters) is recorded in
the report's ``model.adaptations``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import torch
from torch import nn

from mptrain.config.base import ConfigError
from mptrain.config.models import HFModelConfig
from mptrain.config.targets import first_line
from mptrain.models.external import ModelFacts, _recorded, _suggest

POSITIONS = "max_position_embeddings"  # transformers' common name (GPT-2 maps it to n_positions)
# torch (2.14) logs this (a logging record of torch.utils._pytree, not warnings.warn) when torchao,
# imported by transformers' quantizers the first time a model class loads, registers its Enums as
# pytree constants: torchao's deprecation to fix, nothing the user did or can change.
_PYTREE_LOGGER = "torch.utils._pytree"
_ENUM_CONSTANT_NOTICE = (
    "is an Enum subclass and is now natively supported by torch.compile",
    "Calling register_constant() on Enum subclasses is deprecated",
)


def config_class(transformers: ModuleType, name: str) -> type:
    """The configuration class ``transformers.<name>``; ConfigError with close names otherwise."""
    found = getattr(transformers, name, None)
    if isinstance(found, type) and issubclass(found, transformers.PretrainedConfig):
        return found
    names = [n for n in dir(transformers) if n.endswith("Config")]
    hint = _suggest(name, names)
    raise ConfigError(f"model.config_class={name!r}: not a transformers configuration class{hint}")


def check_config_keys(cls: type, keys: list[str]) -> None:
    """ConfigError for a ``model.config`` key the class does not know. A configuration class
    keeps any unknown keyword as an attribute without a word, so a GPT-2 key given to a Llama
    configuration would otherwise change nothing; the known keys are its defaults' and aliases."""
    known = set(cls().to_dict()) | set(getattr(cls, "attribute_map", {}))
    unknown = [key for key in keys if key not in known]
    if unknown:
        hint = _suggest(unknown[0], sorted(known))
        raise ConfigError(
            f"model.config.{unknown[0]}: not a key of {cls.__name__}{hint} "
            f"(its keys: {cls.__name__}().to_dict())"
        )


def hf_config(transformers: ModuleType, cfg: HFModelConfig, vocab_size: int) -> tuple[Any, list]:
    """The configuration ``model.config_class(**model.config)`` with the vocabulary the data's,
    the position table ``model.block_size`` (unless ``model.config`` gives a longer one) and no
    key-value cache (training feeds whole windows); and what was set."""
    cls = config_class(transformers, cfg.config_class)
    check_config_keys(cls, list(cfg.config))
    config = cls(**cfg.config)
    config.vocab_size = vocab_size
    config.use_cache = False
    adaptations = [f"vocab_size={vocab_size} passed from the dataset", "use_cache=False"]
    if hasattr(config, POSITIONS):
        positions_given = POSITIONS in cfg.config or cls.attribute_map.get(POSITIONS) in cfg.config
        positions = getattr(config, POSITIONS)
        if positions_given and positions < cfg.block_size:
            raise ConfigError(
                f"model.config: {positions} positions hold no window of model.block_size="
                f"{cfg.block_size} tokens; raise them or lower model.block_size"
            )
        if not positions_given:
            setattr(config, POSITIONS, cfg.block_size)
            adaptations.append(f"{POSITIONS}={cfg.block_size} passed from model.block_size")
    return config, adaptations


@contextlib.contextmanager
def quiet_enum_constant_notice() -> Iterator[None]:
    """Inside: torch's ``_pytree`` deprecation notice about Enums registered as constants (see
    ``_ENUM_CONSTANT_NOTICE``) is dropped; every other record of that logger, and every warning,
    still shows."""
    logger = logging.getLogger(_PYTREE_LOGGER)

    def drop(record: logging.LogRecord) -> bool:
        return not all(part in str(record.msg) for part in _ENUM_CONSTANT_NOTICE)

    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


def conv1d_to_linear(model: nn.Module, conv1d: type) -> list[str]:
    """Replace every GPT-2 style ``Conv1D`` (``x @ W + b``, ``W`` of shape ``(in, out)``) by the
    ``nn.Linear`` computing the same (weight ``W.T``; same values), so that FP8 layer selection
    and the audit, which select ``nn.Linear``, see them. Returns what was done."""
    names = [name for name, module in model.named_modules() if isinstance(module, conv1d)]
    for name in names:
        old = model.get_submodule(name)
        new = nn.Linear(old.nx, old.nf, device=old.weight.device, dtype=old.weight.dtype)
        with torch.no_grad():
            new.weight.copy_(old.weight.t())
            new.bias.copy_(old.bias)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, new)
    if not names:
        return []
    return [f"{len(names)} Conv1D layers replaced by the equal nn.Linear (for FP8 and the audit)"]


def build_hf(cfg: HFModelConfig, in_channels: int, image_size: int, num_classes: int) -> nn.Module:
    """``AutoModelForCausalLM.from_config`` of :func:`hf_config` with FP32 parameters; the
    vocabulary is ``num_classes`` (token data: ``in_channels`` and ``image_size`` are 0)."""
    try:
        import transformers
    except ImportError as exc:
        raise ConfigError(
            "model=hf: transformers is not installed; install it with pip install 'mptrain[hf]'"
        ) from exc
    config, adaptations = hf_config(transformers, cfg, num_classes)
    try:
        with quiet_enum_constant_notice():  # transformers imports torchao here (see the notice)
            model = transformers.AutoModelForCausalLM.from_config(
                config, dtype=torch.float32, trust_remote_code=False
            )
    except (ValueError, TypeError, KeyError, AttributeError, RuntimeError) as exc:
        raise ConfigError(
            f"model.config_class={cfg.config_class!r}: transformers cannot build a causal "
            f"language model of it ({first_line(exc)})"
        ) from exc
    from transformers.pytorch_utils import Conv1D

    adaptations += conv1d_to_linear(model, Conv1D)
    facts = ModelFacts("hf", cfg.config_class, adaptations=adaptations)
    return _recorded(model, facts)
