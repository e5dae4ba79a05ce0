"""The scaffolding the numerics diagnostics share: leaf modules and how their names are printed,
hooks installed for one block, the gradient of a module's output, finite maxima, and a model's state
preserved across a diagnostic.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from mptrain.platform.seeding import restore_rng_states, rng_states

# Makes the context a forward runs under, e.g. ``lambda: torch.autocast("cpu", torch.float16)``.
Autocast = Callable[[], contextlib.AbstractContextManager[Any]]

FP16_MAX = 65504.0
FP16_MIN_SUBNORMAL = 2.0**-24  # ~5.96e-8: smaller magnitudes flush to zero in FP16


# ------------------------------------------------------------------------------ shared helpers
def leaf_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(qualified name, module)`` of every module without children, in registration order.

    The root is excluded even when it has no children (its name is empty).
    """
    return [(n, m) for n, m in model.named_modules() if n and not list(m.children())]


def module_label(name: str, module_type: str | None) -> str:
    """A module as the human-readable outputs (audit.md, probe.md, the culprit's words) name it:
    its path and its class, ``0 (Linear)``, ``features.3 (Conv2d)``; an ``nn.Sequential``'s bare
    indices would read like step numbers. The JSON outputs keep the plain path as ``module`` (the
    key, stable, what ``numerics.fp32_modules`` matches) and the class apart as ``module_type``.
    Names of no module (``(autograd)``, ``(top level)``: ``module_type`` None) print as they are.
    """
    return f"{name} ({module_type})" if module_type else name


def row_label(row: dict[str, Any]) -> str:
    """:func:`module_label` of a JSON row's ``module`` and ``module_type``: ``0 (Linear)``."""
    return module_label(row["module"], row.get("module_type"))


@contextlib.contextmanager
def installed(handles: Iterable[RemovableHandle]) -> Iterator[None]:
    """Register hooks by consuming ``handles`` on entry; remove every one of them on exit.

    Pass a generator of ``register_*_hook`` calls: hooks are then registered inside the guarded
    block, so those already registered are removed even if a later registration raises.
    """
    registered: list[RemovableHandle] = []
    try:
        for handle in handles:
            registered.append(handle)
        yield
    finally:
        for handle in registered:
            handle.remove()


def on_output_gradient(callback: Callable[[torch.Tensor], None]) -> Callable[..., None]:
    """A forward hook that calls ``callback(grad)`` with the gradient of each output tensor.

    Only outputs that require grad are watched. A tensor hook on the output receives the gradient
    flowing into the module; module full-backward hooks would break modules that work in place,
    like ``ReLU(inplace=True)``.
    """

    def hook(module: nn.Module, inputs: Any, output: Any) -> None:
        for t in tensors_in(output):
            if t.requires_grad:
                t.register_hook(callback)

    return hook


def tensors_in(value: Any) -> list[torch.Tensor]:
    """The tensors in ``value``, flattening nested lists and tuples; anything else is skipped."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, list | tuple):
        return [t for v in value for t in tensors_in(v)]
    return []


def max_finite(tensors: list[torch.Tensor]) -> float:
    """Largest finite magnitude among the floating-point ``tensors`` (0.0 when there is none)."""
    best = 0.0
    for t in tensors:
        if t.is_floating_point() and t.numel():
            finite = t.detach()[torch.isfinite(t.detach())]
            if finite.numel():
                best = max(best, float(finite.abs().max()))
    return best


def any_nonfinite(tensors: list[torch.Tensor]) -> bool:
    """True when any floating-point tensor holds a NaN or an inf."""
    return any(t.is_floating_point() and not bool(torch.isfinite(t).all()) for t in tensors)


@contextlib.contextmanager
def preserved_state(model: nn.Module) -> Iterator[None]:
    """Run diagnostics without leaving a trace: parameters, buffers, grads and RNG restored.

    The training flag is restored too. Restoring happens on exit whether or not the body raised.
    """
    saved = copy.deepcopy(model.state_dict())
    grads = {
        n: (p.grad.clone() if p.grad is not None else None) for n, p in model.named_parameters()
    }
    rng = rng_states()
    was_training = model.training
    try:
        yield
    finally:
        model.load_state_dict(saved)
        for name, p in model.named_parameters():
            p.grad = grads[name]
        restore_rng_states(rng)
        model.train(was_training)
