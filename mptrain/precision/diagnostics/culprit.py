"""The culprit finder (:func:`find_culprit`): re-runs one batch and names the first module whose
output or gradient went non-finite (:func:`mptrain.train.health.describe_culprit` words it), or,
before any module, the batch itself when NaN/inf came with the data (:func:`describe_input`).
The model is left as it was found (parameters, buffers, gradients, training flag, RNG state).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from mptrain.models.task import cross_entropy, logits_of
from mptrain.platform.dtypes import dtype_name
from mptrain.precision.diagnostics.hooks import (
    Autocast,
    any_nonfinite,
    installed,
    leaf_modules,
    max_finite,
    on_output_gradient,
    preserved_state,
    tensors_in,
)


# ------------------------------------------------------------------------------- the input batch
def nonfinite_input(images: torch.Tensor, labels: torch.Tensor) -> dict[str, Any] | None:
    """The first tensor of the batch holding NaN or inf, as ``{"tensor", "dtype", "nonfinite",
    "nan", "inf", "values"}`` (``tensor``: "inputs" or "labels"); None when both are finite.
    Integer tensors (class indices, token ids) are finite by construction."""
    for name, tensor in (("inputs", images), ("labels", labels)):
        if not tensor.is_floating_point():
            continue
        nan, inf = int(torch.isnan(tensor).sum()), int(torch.isinf(tensor).sum())
        if nan or inf:
            return {
                "tensor": name,
                "dtype": dtype_name(tensor.dtype),
                "nonfinite": nan + inf,
                "nan": nan,
                "inf": inf,
                "values": tensor.numel(),
            }
    return None


def describe_input(record: dict[str, Any]) -> str:
    """One line for a :func:`nonfinite_input` record."""
    return (
        f"the input batch is not finite: {record['nonfinite']} of {record['values']} values of "
        f"its {record['tensor']} ({record['dtype']}) are NaN or inf ({record['nan']} NaN, "
        f"{record['inf']} inf); they came with the data, before any module, so no precision "
        "setting fixes them: check the dataset and its transforms"
    )


# ------------------------------------------------------------------------------ culprit finder
def _forward_kind(
    module: nn.Module, dtype: torch.dtype | None, ins: list[torch.Tensor], outs: list[torch.Tensor]
) -> str:
    """Why ``module`` produced the non-finite ``outs``, most specific cause first."""
    has_inf = any(bool(torch.isinf(t).any()) for t in outs if t.is_floating_point())
    if any_nonfinite(list(module.parameters(recurse=False))):
        return "non-finite parameters: an earlier update already diverged"
    if dtype == torch.float16 and has_inf:
        return "overflow: a value exceeded FP16's maximum 65504; BF16 (FP32's range) fixes it"
    if not any_nonfinite(ins):
        return "invalid operation: NaN/inf produced from finite inputs"
    return "non-finite input propagated"


def _backward_entry(where: str, module: nn.Module, grad: torch.Tensor) -> dict[str, Any]:
    """The ``found["backward"]`` record for a non-finite gradient ``grad`` at ``where``."""
    return {
        "module": where,
        "module_type": type(module).__name__,
        "dtype": dtype_name(grad.dtype),
        "largest_finite_grad_output": max_finite([grad]),
    }


class _CulpritHooks:
    """Hook state for one :func:`find_culprit` run.

    ``found`` gets at most one ``"forward"`` and one ``"backward"`` record, each the first seen.
    ``stack`` holds the modules whose forward is running, so that a non-finite input to a module
    can be blamed on the enclosing module's own code.
    """

    def __init__(self, model: nn.Module) -> None:
        self.found: dict[str, Any] = {}
        self.largest_before = 0.0  # largest finite output of any module before the culprit
        self.names = {m: n for n, m in model.named_modules()}
        self.stack: list[nn.Module] = []

    def registrations(self, model: nn.Module) -> Iterator[RemovableHandle]:
        """Register the hooks lazily, for :func:`installed`. Per module, the forward hook that
        pops the stack runs before the one that watches output gradients (registration order)."""
        yield from (m.register_forward_pre_hook(self.pre_hook) for m in model.modules())
        yield from (m.register_forward_hook(self.forward_hook) for m in model.modules())
        for name, module in leaf_modules(model):
            watch = functools.partial(self.output_gradient, name, module)
            yield module.register_forward_hook(on_output_gradient(watch))

    def _record_forward(
        self, module: nn.Module, ins: list[torch.Tensor], outs: list[torch.Tensor]
    ) -> None:
        dtype = next((t.dtype for t in outs if t.is_floating_point()), None)
        self.found["forward"] = {
            "module": self.names[module] or "(model)",
            "module_type": type(module).__name__,
            "dtype": str(dtype_name(dtype)),  # "None" when no output was floating point
            "largest_finite_before": self.largest_before,
            "largest_finite_input": max_finite(ins),
            "kind": _forward_kind(module, dtype, ins, outs),
        }

    def pre_hook(self, module: nn.Module, inputs: Any) -> None:
        ins = tensors_in(inputs)
        if "forward" not in self.found and self.stack and any_nonfinite(ins):
            # Non-finite input to a module whose predecessors all produced finite outputs: the
            # value was computed in the enclosing module's own forward, between its submodules.
            self._record_forward(self.stack[-1], [], ins)
            self.found["forward"]["kind"] += " (computed in this module's own forward code)"
        self.stack.append(module)

    def forward_hook(self, module: nn.Module, inputs: Any, output: Any) -> None:
        self.stack.pop()
        if "forward" in self.found:
            return
        outs = tensors_in(output)
        if any_nonfinite(outs):
            self._record_forward(module, tensors_in(inputs), outs)
        else:
            self.largest_before = max(self.largest_before, max_finite(outs))

    def output_gradient(self, name: str, module: nn.Module, grad: torch.Tensor) -> None:
        if "backward" not in self.found and any_nonfinite([grad]):
            self.found["backward"] = _backward_entry(name, module, grad)

    def run(
        self,
        model: nn.Module,
        images: torch.Tensor,
        labels: torch.Tensor,
        autocast: Autocast,
        loss_scale: float,
    ) -> torch.Tensor:
        """One forward (and, when it and the loss are finite, one backward); returns the loss."""
        model.zero_grad(set_to_none=True)
        with autocast():
            logits = logits_of(model(images))
        loss = cross_entropy(logits, labels)
        if "forward" not in self.found and torch.isfinite(loss):
            (loss * loss_scale).backward()
            if "backward" not in self.found:
                _check_weight_gradients(model, self.names, self.found)
        return loss


def find_culprit(
    model: nn.Module,
    images: torch.Tensor,
    labels: torch.Tensor,
    autocast: Autocast,
    loss_scale: float = 1.0,
) -> dict[str, Any] | None:
    """Re-run one batch with hooks; name the first module whose output or gradient went non-finite.

    The batch is checked first: NaN/inf that came with the data would otherwise be blamed on the
    first module that reads it. A non-finite batch is the answer, and the model is not run.
    Forward: the first leaf module (in execution order) with a non-finite output. Backward, when the
    forward was finite: the first module whose output gradient went non-finite. For FP16 outputs,
    an inf beyond 65504 is an overflow (BF16's range fixes it); a NaN from finite inputs is an
    invalid operation. Model state and RNG are restored afterwards.

    Returns ``None`` when everything stayed finite, else ``{"input", "forward", "backward",
    "loss", "loss_scale"}``: ``input`` the :func:`nonfinite_input` record (then ``forward``,
    ``backward`` and ``loss`` are None: nothing ran), else None and ``forward``/``backward``
    ``None`` where nothing was found.
    """
    bad_input = nonfinite_input(images, labels)
    if bad_input is not None:
        return {
            "input": bad_input,
            "forward": None,
            "backward": None,
            "loss": None,
            "loss_scale": loss_scale,
        }
    hooks = _CulpritHooks(model)
    with preserved_state(model), installed(hooks.registrations(model)):
        loss = hooks.run(model, images, labels, autocast, loss_scale)
    if not hooks.found:
        return None
    return {
        "input": None,
        "forward": hooks.found.get("forward"),
        "backward": hooks.found.get("backward"),
        "loss": float(loss.detach()),
        "loss_scale": loss_scale,
    }


def _check_weight_gradients(model: nn.Module, names: dict[nn.Module, str], found: dict) -> None:
    """Output gradients were finite: a weight gradient (e.g. dW's batch sum) may still overflow.

    Records the first non-finite parameter gradient as ``found["backward"]``, named
    ``module.param``.
    """
    for module in model.modules():
        for pname, p in module.named_parameters(recurse=False):
            if p.grad is not None and any_nonfinite([p.grad]):
                where = f"{names[module]}.{pname}" if names[module] else pname
                found["backward"] = _backward_entry(where, module, p.grad)
                return
