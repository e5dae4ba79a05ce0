"""Shared helpers: compose the real YAML configs (Hydra compose API) into typed RunConfigs."""

from __future__ import annotations

import pytest
import torch
from hydra import compose, initialize_config_module

import mptrain.cli  # noqa: F401  (registers the schemas in Hydra's ConfigStore)
from mptrain.config import RunConfig, to_run_config


def compose_run(*overrides: str) -> RunConfig:
    """The typed config `mptrain <overrides>` would run, composed from the shipped YAML."""
    with initialize_config_module(config_module="mptrain.conf", version_base="1.3"):
        return to_run_config(compose(config_name="config", overrides=list(overrides)))


def tiny_run(*overrides: str) -> RunConfig:
    """A CPU run of a few steps on digits with a Linear-only model (fast in every precision)."""
    base = ("model=mlp", "device=cpu", "progress=false", "throughput_warmup_steps=2")
    return compose_run(*base, *overrides)


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
