"""Which nn.Linear layers a low-precision format converts, and why the others stay in high
precision: one rule set for FP8 and the block-scaled formats
(:mod:`mptrain.precision.quant.convert`), each under its own config keys (``fp8.*``, ``mx.*``,
``nvfp4.*``); the per-layer GEMM FLOPs and the report's layer rows; swapping a module.

Every Linear, in registration order, either converts or is kept with the first reason that holds
(:func:`choose`):

1. not matched by ``<key>.include`` (when given) or matched by ``<key>.exclude``;
2. the first or last Linear with ``<key>.keep_first_last`` (unless ``include`` names layers);
3. in NVFP4's BF16 tail (:func:`tail_reasons`; unless ``include`` names layers);
4. in or out features not a multiple of the format's alignment (``torch._scaled_mm``'s 16 for
   FP8, the block size for block formats: a block never straddles a row);
5. in or out features below ``<key>.min_features`` (too small to gain).
"""

from __future__ import annotations

import fnmatch
import math
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from mptrain.precision.quant.linear import LayerPlans


@dataclass
class LayerChoice:
    name: str
    in_features: int
    out_features: int
    converted: bool
    reason: str


@dataclass(frozen=True)
class LayerRules:
    """The selection settings of one format; ``key`` names its config group in the reasons."""

    key: str  # fp8 | mx | nvfp4
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    keep_first_last: bool = True
    min_features: int = 0
    alignment: int = 16
    alignment_why: str = "torch._scaled_mm alignment"
    keep_last_fraction: float = 0.0


def tail_start(count: int, fraction: float) -> int:
    """The index of the first of the last ``fraction`` of ``count`` items (rounded up: at least
    that share is kept, and one item for any fraction > 0; ``count`` when the fraction is 0)."""
    return count - math.ceil(fraction * count - 1e-9) if fraction > 0 else count


def _holds_linear(module: nn.Module) -> bool:
    return any(isinstance(m, nn.Linear) for m in module.modules())


def block_list(model: nn.Module) -> tuple[str, list[nn.Module]] | None:
    """The model's transformer blocks, (the list's module name, its blocks), or None.

    The rule: among the nn.ModuleList and nn.Sequential modules of ``model`` (itself included)
    whose children number at least 2, are all of one class, are not nn.Linear layers and each
    hold an nn.Linear, the one with the most children (on a tie, the last registered). What that
    finds in GPT, ViT, Hugging Face decoders, an MLP, a CNN or Swin: docs/precisions.md, *The BF16
    tail*.
    """
    found: tuple[str, list[nn.Module]] | None = None
    for name, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(module.children())
        kinds = {type(child) for child in children}
        if len(children) < 2 or len(kinds) != 1 or issubclass(kinds.pop(), nn.Linear):
            continue
        if all(_holds_linear(child) for child in children) and (
            found is None or len(children) >= len(found[1])
        ):
            found = (name, children)
    return found


def tail_reasons(
    model: nn.Module, linears: list[tuple[str, nn.Linear]], rules: LayerRules
) -> dict[str, str]:
    """The Linear layers (by name) that ``rules.keep_last_fraction`` keeps, with the reason;
    empty when the fraction is 0 or ``include`` names layers.

    NVIDIA's NVFP4 quantization keeps the last ~15 % of the network's blocks in BF16 (arXiv
    2509.25149): the fraction counts the blocks of :func:`block_list`, rounded up
    (:func:`tail_start`: a fraction > 0 keeps at least one block), and every Linear inside
    them or registered after the last block (the output head) is kept. Without a block list the
    fraction counts Linear layers, rounded up, and the reason says the model has no block list.
    """
    fraction = rules.keep_last_fraction
    if fraction <= 0 or rules.include:
        return {}
    key, kept_in = f"{rules.key}.keep_last_fraction", "kept in BF16"
    found = block_list(model)
    if found is None:
        why = f"in the last {fraction:g} of Linear layers ({key}; the model has no block list)"
        return {
            name: f"{why}, {kept_in}" for name, _ in linears[tail_start(len(linears), fraction) :]
        }
    where = repr(found[0]) if found[0] else "the model"
    blocks = found[1]
    kept = blocks[tail_start(len(blocks), fraction) :]
    in_kept = {id(m) for block in kept for m in block.modules()}
    in_list = {id(m) for block in blocks for m in block.modules()}
    last = max(i for i, (_, layer) in enumerate(linears) if id(layer) in in_list)
    setting = f"({key}={fraction:g}), {kept_in}"
    inside = f"in the last {len(kept)} of the {len(blocks)} blocks in {where} {setting}"
    after = f"after the last block in {where} {setting}"
    reasons = {}
    for i, (name, layer) in enumerate(linears):
        if id(layer) in in_kept or i > last:
            reasons[name] = inside if id(layer) in in_kept else after
    return reasons


def _skip_reason(
    name: str, layer: nn.Linear, index: int, count: int, rules: LayerRules, tail: dict[str, str]
) -> str | None:
    """Why ``layer`` (the ``index``-th of ``count`` Linear layers) stays in high precision, or
    None when it converts (see the module doc for the order); ``tail``: :func:`tail_reasons`."""
    key = rules.key
    if rules.include and not any(fnmatch.fnmatchcase(name, p) for p in rules.include):
        return f"not matched by {key}.include"
    matched = [p for p in rules.exclude if fnmatch.fnmatchcase(name, p)]
    if matched:
        return f"excluded by {key}.exclude pattern {matched[0]!r}"
    if rules.keep_first_last and not rules.include and index in (0, count - 1):
        return "first/last layer kept in BF16"
    if name in tail:
        return tail[name]
    n = rules.alignment
    if layer.in_features % n or layer.out_features % n:
        return f"in/out features not multiples of {n} ({rules.alignment_why})"
    if min(layer.in_features, layer.out_features) < rules.min_features:
        return f"smaller than {key}.min_features={rules.min_features}"
    return None


def choose(model: nn.Module, rules: LayerRules) -> list[LayerChoice]:
    """For every nn.Linear of ``model`` in registration order, whether it converts and, if not,
    why (see the module doc)."""
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    tail = tail_reasons(model, linears, rules)
    reasons = [_skip_reason(n, m, i, len(linears), rules, tail) for i, (n, m) in enumerate(linears)]
    return [
        LayerChoice(n, m.in_features, m.out_features, why is None, why or "converted")
        for (n, m), why in zip(linears, reasons, strict=True)
    ]


def skip_summary(layers: list[dict[str, Any]]) -> str:
    """Why the unconverted layers of a report section were kept, each reason once with its count
    ("2 layers: first/last layer kept in BF16; 1 layer: ..."); "no nn.Linear layer" if none."""
    counts = Counter(row["reason"] for row in layers if not row["converted"])
    if not counts:
        return "no nn.Linear layer"
    return "; ".join(f"{n} layer{'s' if n > 1 else ''}: {why}" for why, n in counts.items())


def set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    """Put ``module`` where ``model.get_submodule(name)`` is."""
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


@torch.no_grad()
def linear_flops(model: nn.Module, sample: torch.Tensor) -> dict[str, int]:
    """FLOPs of each nn.Linear (by name) for one forward pass of ``sample``."""
    flops: dict[str, int] = {}
    hooks = []
    for name, layer in model.named_modules():
        if isinstance(layer, nn.Linear):

            def hook(mod: nn.Module, args: tuple, out: torch.Tensor, name: str = name) -> None:
                rows = args[0].numel() // mod.in_features
                flops[name] = flops.get(name, 0) + 2 * rows * mod.in_features * mod.out_features

            hooks.append(layer.register_forward_hook(hook))
    was_training = model.training
    model.eval()
    try:
        model(sample)
    finally:
        model.train(was_training)
        for h in hooks:
            h.remove()
    return flops


def layer_rows(
    choices: list[LayerChoice], flops: dict[str, int], plans: LayerPlans | None = None
) -> tuple[float, list[dict[str, Any]]]:
    """(the converted layers' share of the Linear FLOPs, the report's row per Linear); with
    per-GEMM ``plans``, a converted layer's row names the format of each of its GEMMs."""
    total = sum(flops.values())
    converted = sum(flops.get(c.name, 0) for c in choices if c.converted)
    rows = [
        {
            "name": c.name,
            "shape": [c.in_features, c.out_features],
            "converted": c.converted,
            "reason": c.reason,
            "flops_share": flops.get(c.name, 0) / total if total else 0.0,
            **(plans.describe(c.name) if plans is not None and c.converted else {}),
        }
        for c in choices
    ]
    return (converted / total if total else 0.0), rows
