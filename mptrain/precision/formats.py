"""The precisions that compute Linear layers in a format of their own, and the one place each
registers how a model's layers convert into it: :data:`LAYER_FORMATS`.

A layer format is a subclass of ``nn.Linear`` that shares the converted layer's Parameter objects
(``weight``, ``bias``), so an optimizer built on the model, its FP32 state and a data-parallel
wrapper keep working across a conversion; it may add buffers of its own (scales, histories).
Every such format converts back the same way: :func:`to_plain_linear` puts an ``nn.Linear``
holding the same Parameters where each of its layers was (what a precision schedule does when it
leaves the format: :mod:`mptrain.train.switch`).

A new format (a precision of :data:`mptrain.precision.policy.PRECISIONS` whose Linear layers are
not nn.Linear) adds one :class:`LayerFormat` entry under its precision's name: the layer types it
makes and its ``convert`` function. The build (:func:`mptrain.train.build.build_model_for_run`)
and a precision schedule's switch then call it; nothing else needs to know the format.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from mptrain.config.base import ConfigError
from mptrain.config.run import RunConfig
from mptrain.data.batches import DataBundle
from mptrain.platform.distributed import DistContext
from mptrain.precision.fp8.convert import apply_fp8, fp8_layer_stats, skip_summary
from mptrain.precision.fp8.dist import FP8Sync, build_fp8_sync
from mptrain.precision.fp8.linear import Float8Linear
from mptrain.precision.policy import PrecisionPolicy

# (model, policy, cfg, data, fsdp) -> the report's section of the format
Convert = Callable[[nn.Module, PrecisionPolicy, RunConfig, DataBundle, bool], dict[str, Any]]


@dataclass(frozen=True)
class LayerFormat:
    """How a precision's Linear layers are made: ``convert(model, policy, cfg, data, fsdp)``
    replaces the eligible ``nn.Linear`` layers of ``model`` in place by ``layer_types`` (sharing
    their Parameters) and returns the report's section of the format; it raises
    :class:`~mptrain.config.base.ConfigError` when no layer can convert. ``data``: the run's
    (e.g. a validation batch to count FLOPs on; drawing one uses no global random state);
    ``fsdp``: the model will be sharded with FSDP2. ``final_stats(model)``: the per-layer
    figures the report shows at the end of the format's use (the section's
    ``final_layer_stats``; reads device values)."""

    layer_types: tuple[type[nn.Linear], ...]
    convert: Convert
    final_stats: Callable[[nn.Module], list[dict[str, Any]]]


def _into_fp8(
    model: nn.Module, policy: PrecisionPolicy, cfg: RunConfig, data: DataBundle, fsdp: bool
) -> dict[str, Any]:
    """precision=fp8: the eligible Linear layers become Float8Linear (fp8.* settings)."""
    sample, _ = next(iter(data.val.batches(0)))
    fp8 = apply_fp8(
        model,
        replace(policy.fp8, fsdp_float8_all_gather=fsdp),
        sample[:2],
        include=list(cfg.fp8.include),
        exclude=list(cfg.fp8.exclude),
        keep_first_last=cfg.fp8.keep_first_last,
        backend=cfg.fp8.backend,
    )
    fp8["compile"] = cfg.compile  # the report's model section counts the graphs and breaks
    if not any(layer["converted"] for layer in fp8["layers"]):
        raise ConfigError(
            f"precision=fp8: no Linear layer of model={cfg.model.name} can run in FP8 "
            f"({skip_summary(fp8['layers'])}); "
            "see fp8.include/exclude/keep_first_last/min_features"
        )
    return fp8


# The one registry: a precision's name -> how its Linear layers are made. Precisions not listed
# compute with plain nn.Linear layers (under their autocast dtype).
LAYER_FORMATS: dict[str, LayerFormat] = {
    "fp8": LayerFormat((Float8Linear,), _into_fp8, fp8_layer_stats),
}


def convert_layers(
    model: nn.Module,
    policy: PrecisionPolicy,
    cfg: RunConfig,
    data: DataBundle,
    fsdp: bool = False,
) -> dict[str, Any] | None:
    """Convert ``model``'s layers into ``policy``'s format, if it has one (see
    :class:`LayerFormat`); its report section, or None for a precision of plain layers."""
    layer_format = LAYER_FORMATS.get(policy.name)
    if layer_format is None:
        return None
    return layer_format.convert(model, policy, cfg, data, fsdp)


def to_plain_linear(model: nn.Module) -> list[str]:
    """Replace, in place, every layer of a registered format by an ``nn.Linear`` holding the same
    Parameter objects (so optimizer state and wrappers carry on); return the names replaced.

    The new layers are made on the meta device: no initialisation runs, no random number is
    drawn, so a run switched here and one resumed past this point stay bit for bit alike. The
    format's own buffers (scales, amax histories) go with the old layers.
    """
    formats = tuple(t for f in LAYER_FORMATS.values() for t in f.layer_types)
    replaced = []
    for name, layer in list(model.named_modules()):
        if not isinstance(layer, formats):
            continue
        with torch.device("meta"):
            plain = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None)
        plain.weight, plain.bias = layer.weight, layer.bias
        plain.train(layer.training)
        model.set_submodule(name, plain)
        replaced.append(name)
    return replaced


def layer_sync(
    model: nn.Module,
    dist: DistContext,
    cfg: RunConfig,
    policy: PrecisionPolicy,
    section: dict[str, Any] | None,
) -> tuple[FP8Sync, dict[str, Any] | None]:
    """What the ranks agree on for the wrapped ``model``'s FP8 layers (nothing for other
    precisions, or a single process), and the format's ``section`` with a record of it."""
    if section is None or policy.fp8 is None:
        return FP8Sync(), section
    fp8_sync = build_fp8_sync(model, dist, cfg.fp8.backend, policy.fp8)
    return fp8_sync, {**section, **fp8_sync.describe()}
