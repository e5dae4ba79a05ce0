"""The autocast audit (:func:`audit_step`, :func:`render_audit`): traces one forward + backward
and tables the dtype every ATen op really ran in, flagging low-precision ops and state that the
mixed-precision literature wants in FP32. The model is left as it was found. How modules are
named: :func:`~mptrain.precision.diagnostics.hooks.module_label`.
"""

from __future__ import annotations

import itertools
from collections import Counter
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from mptrain.models.task import cross_entropy, logits_of
from mptrain.platform.dtypes import dtype_name
from mptrain.precision.diagnostics.hooks import (
    Autocast,
    installed,
    preserved_state,
    row_label,
    tensors_in,
)

# ------------------------------------------------------------------------------ autocast audit
# Ops the mixed-precision literature wants in FP32 (flagged when they run in FP16/BF16).
FP32_WANTED = {
    "_softmax": "softmax",
    "softmax": "softmax",
    "_log_softmax": "log-softmax",
    "log_softmax": "log-softmax",
    "nll_loss_forward": "cross-entropy",
    "nll_loss2d_forward": "cross-entropy",
    "native_layer_norm": "normalisation statistics",
    "native_batch_norm": "normalisation statistics",
    "_native_batch_norm_legit": "normalisation statistics",
    "_native_batch_norm_legit_no_training": "normalisation statistics",
    "native_group_norm": "normalisation statistics",
    "linalg_vector_norm": "norm",
    "norm": "norm",
    "sum": "large reduction",
    "mean": "large reduction",
}
LARGE_REDUCTION = 4096  # elements reduced before a low-precision sum/mean is flagged
LOW_PRECISION = (torch.float16, torch.bfloat16)


def _dtype_names(tensors: list[torch.Tensor]) -> str:
    return ",".join(dtype_name(t.dtype) for t in tensors) or "-"


class _AuditMode(TorchDispatchMode):
    """Records every ATen op below autocast: what dtypes it actually ran with, in which module."""

    def __init__(self, module_stack: list[str], module_types: dict[str, str]) -> None:
        super().__init__()
        self.module_stack = module_stack
        self.module_types = module_types  # module name -> class name, for the op table
        self.phase = "forward"  # set to "backward" by the caller before loss.backward()
        self.calls: Counter[tuple[str, str, str, str, str]] = Counter()
        self.flags: dict[tuple[str, str, str, str, str], str] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        ins = [t for t in tensors_in(list(args)) if t.is_floating_point()]
        outs = [t for t in tensors_in(out) if t.is_floating_point()]
        module = self.module_stack[-1] if self.module_stack else "(top level)"
        if self.phase == "backward":
            module = "(autograd)"  # backward ops run outside any module's forward
        key = (name, module, self.phase, _dtype_names(ins), _dtype_names(outs))
        self.calls[key] += 1
        reason = FP32_WANTED.get(name)
        low = any(t.dtype in LOW_PRECISION for t in outs)
        if reason and low:
            large = (
                name not in ("sum", "mean")
                or max((t.numel() for t in ins), default=0) >= LARGE_REDUCTION
            )
            if large:
                self.flags[key] = f"{reason} ran in low precision"
        return out


def _traced_step(
    model: nn.Module,
    images: torch.Tensor,
    labels: torch.Tensor,
    autocast: Autocast,
) -> _AuditMode:
    """Run one forward + backward under ``_AuditMode``; return the mode with its op records.

    The caller restores model state: this leaves fresh gradients behind.
    """
    stack: list[str] = []  # names of the modules whose forward is running, innermost last
    names = {m: n or "(model)" for n, m in model.named_modules()}
    types = {name: type(m).__name__ for m, name in names.items()}

    def push(module: nn.Module, *_: Any) -> None:
        stack.append(names[module])

    def pop(module: nn.Module, *_: Any) -> None:
        if stack:
            stack.pop()

    registrations = itertools.chain(
        (m.register_forward_pre_hook(push) for m in model.modules()),
        (m.register_forward_hook(pop) for m in model.modules()),
    )
    mode = _AuditMode(stack, types)
    with installed(registrations):
        model.zero_grad(set_to_none=True)
        with mode:
            with autocast():
                logits = logits_of(model(images))
                loss = cross_entropy(logits, labels)
            mode.phase = "backward"
            loss.backward()
    return mode


def _op_table(mode: _AuditMode) -> list[dict[str, Any]]:
    """One row per distinct (op, module, phase, input dtypes, output dtypes), with count and flag.

    ``module`` is the plain path (``"0"``, ``"(autograd)"``), ``module_type`` its class (None where
    no module ran the op).
    """
    return [
        {
            "op": k[0],
            "module": k[1],
            "module_type": mode.module_types.get(k[1]),
            "phase": k[2],
            "input_dtypes": k[3],
            "output_dtypes": k[4],
            "count": n,
            "flag": mode.flags.get(k),
        }
        for k, n in mode.calls.items()
    ]


def _state_flags(params: Counter[str], grads: Counter[str], states: Counter[str]) -> list[str]:
    """A flag per non-FP32 dtype among parameters, gradients and optimizer state."""
    flags = []
    for kind, counter in (("parameter", params), ("gradient", grads), ("optimizer state", states)):
        flags += [f"{kind} in {d} (expected float32)" for d in counter if d != "float32"]
    return flags


def audit_step(
    model: nn.Module,
    images: torch.Tensor,
    labels: torch.Tensor,
    autocast: Autocast,
    optimizer: torch.optim.Optimizer,
    mixed: bool,
) -> dict[str, Any]:
    """Trace one forward + backward under the run's autocast policy (state restored afterwards).

    Returns the op table (op, module, module_type, phase, input/output dtypes, count, flag) and the
    dtypes of parameters, gradients and optimizer state, flagging non-FP32 ones in a mixed precision.
    """
    with preserved_state(model):
        mode = _traced_step(model, images, labels, autocast)
        # Counted before the state is restored: the gradients are the traced step's own.
        params = Counter(dtype_name(p.dtype) for p in model.parameters())
        grads = Counter(dtype_name(p.grad.dtype) for p in model.parameters() if p.grad is not None)
    states = Counter(
        dtype_name(v.dtype)
        for s in optimizer.state.values()
        for k, v in s.items()
        if torch.is_tensor(v) and v.is_floating_point() and k != "step"
    )
    ops = _op_table(mode)
    return {
        "ops": ops,
        "flagged_ops": [o for o in ops if o["flag"]],
        "parameter_dtypes": dict(params),
        "gradient_dtypes": dict(grads),
        "optimizer_state_dtypes": dict(states) or "not created yet (before the first step)",
        "state_flags": _state_flags(params, grads, states) if mixed else [],
    }


def _attention_lines(ops: list[dict[str, Any]]) -> list[str]:
    """What attention ran in: the forward rows of attention kernels, and how to read them."""
    rows = [o for o in ops if "attention" in o["op"] and o["phase"] == "forward"]
    if not rows:
        return []
    lines = [
        "",
        "Attention: fused kernels (flash, memory-efficient, cuDNN) take Q, K, V in the input dtype "
        "below and keep the softmax's running max and sum in FP32 (their float32 output is the "
        "log-sum-exp); an unfused path shows its own _softmax rows, flagged when they run in "
        'low precision. numerics.fp32_modules=["blocks.*.attn"] runs attention wholly in FP32.',
    ]
    return lines + [
        f"- {o['op']} in {row_label(o)}: inputs {o['input_dtypes']}, outputs {o['output_dtypes']}"
        for o in rows
    ]


def render_audit(audit: dict[str, Any]) -> str:
    """Markdown for an :func:`audit_step` result: state dtypes, the flags, then the op table."""
    lines = [
        "# Autocast audit (one forward + backward step)",
        "",
        f"Parameters: {audit['parameter_dtypes']}; gradients: {audit['gradient_dtypes']}; "
        f"optimizer state: {audit['optimizer_state_dtypes']}",
        "",
    ]
    flags = audit["flagged_ops"] + [{"flag": f} for f in audit["state_flags"]]
    lines.append(f"Flags: {len(flags)}")
    lines += [
        f"- {f['flag']}" + (f": {f['op']} in {row_label(f)}" if "op" in f else "") for f in flags
    ]
    lines += _attention_lines(audit["ops"])
    lines += [
        "",
        "| op | module | phase | inputs | outputs | count | flag |",
        "|---|---|---|---|---|---:|---|",
    ]
    for o in sorted(audit["ops"], key=lambda o: (o["phase"] != "forward", o["module"], o["op"])):
        lines.append(
            f"| {o['op']} | {row_label(o)} | {o['phase']} | {o['input_dtypes']} | "
            f"{o['output_dtypes']} | {o['count']} | {o['flag'] or ''} |"
        )
    return "\n".join(lines) + "\n"
