"""Numerics diagnostics: loss-scale health, the module that produced a non-finite value, the
autocast audit, per-layer FP32 overrides, and the FP16 range probe.

Everything here observes the model; nothing changes what the training loop computes except
:func:`keep_in_fp32`, which the user asks for explicitly.
"""

from __future__ import annotations

import contextlib
import copy
import fnmatch
import math
import random
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from mptrain.config import NumericsConfig

FP16_MAX = 65504.0
FP16_MIN_SUBNORMAL = 2.0**-24  # ~5.96e-8: smaller magnitudes flush to zero in FP16


# ------------------------------------------------------------------------------ loss-scale health
@dataclass
class ScaleHealth:
    """Watches the loss scale and the loss, step by step; says when to warn and when to stop.

    ``observe`` is called once per optimizer step with values the loop already has on the host.
    A warning is raised at most once per kind; ``diverged`` is set with a reason to stop the run.
    """

    settings: NumericsConfig  # min_loss_scale, warn_* and max_consecutive_nonfinite_loss
    consecutive_backoffs: int = 0
    consecutive_nonfinite_loss: int = 0
    nonfinite_loss_steps: list[int] = field(default_factory=list)
    recent_skips: list[bool] = field(default_factory=list)
    warnings: list[dict[str, Any]] = field(default_factory=list)
    diverged: str | None = None

    def _warn_once(self, kind: str, step: int, message: str) -> str | None:
        if any(w["kind"] == kind for w in self.warnings):
            return None
        self.warnings.append({"kind": kind, "step": step, "message": message})
        return message

    def observe(
        self, step: int, skipped: bool, scale: float | None, grew: bool, loss_finite: bool
    ) -> list[str]:
        """Record one step; return the warnings raised by it (each kind only once per run)."""
        s, raised = self.settings, []
        if loss_finite:
            self.consecutive_nonfinite_loss = 0
        else:
            self.consecutive_nonfinite_loss += 1
            self.nonfinite_loss_steps.append(step)
        if skipped:
            self.consecutive_backoffs += 1
        elif grew:
            self.consecutive_backoffs = 0
        self.recent_skips = [*self.recent_skips, skipped][-s.warn_window :]
        if self.consecutive_backoffs >= s.warn_consecutive_backoffs:
            raised.append(
                self._warn_once(
                    "consecutive_backoffs",
                    step,
                    f"loss scale backed off {self.consecutive_backoffs} times in a row without "
                    f"growing (now {scale:g}) at step {step}: gradients keep overflowing",
                )
            )
        rate = sum(self.recent_skips) / len(self.recent_skips)
        if len(self.recent_skips) >= min(s.warn_window, 20) and rate > s.warn_skip_rate:
            raised.append(
                self._warn_once(
                    "skip_rate",
                    step,
                    f"{rate:.0%} of the last {len(self.recent_skips)} steps were skipped "
                    f"(threshold {s.warn_skip_rate:.0%}) at step {step}",
                )
            )
        if scale is not None and skipped and scale <= s.min_loss_scale:
            self.diverged = (
                f"loss scale collapsed to {scale:g} (minimum {s.min_loss_scale:g}) at step {step}. "
                "A collapsed scale means a real numerical problem (bad data, an unstable component, "
                "a forward overflow), not a tuning issue; try precision=bf16, whose range needs no "
                "scaling"
            )
        elif self.consecutive_nonfinite_loss >= s.max_consecutive_nonfinite_loss:
            self.diverged = (
                f"the loss was non-finite for {self.consecutive_nonfinite_loss} consecutive steps "
                f"(up to step {step}): a forward overflow, which loss scaling cannot fix; try "
                "precision=bf16 or keep the culprit layer in FP32 (numerics.fp32_modules)"
            )
        return [w for w in raised if w]

    def summary(self) -> dict[str, Any]:
        return {
            "nonfinite_loss_steps": {
                "count": len(self.nonfinite_loss_steps),
                "steps": self.nonfinite_loss_steps[:100],
            },
            "warnings": self.warnings,
            "min_loss_scale": self.settings.min_loss_scale,
        }


# ------------------------------------------------------------------------------ culprit finder
@contextlib.contextmanager
def preserved_state(model: nn.Module) -> Iterator[None]:
    """Run diagnostics without leaving a trace: parameters, buffers, grads and RNG restored."""
    saved = copy.deepcopy(model.state_dict())
    grads = {
        n: (p.grad.clone() if p.grad is not None else None) for n, p in model.named_parameters()
    }
    rng = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    was_training = model.training
    try:
        yield
    finally:
        model.load_state_dict(saved)
        for name, p in model.named_parameters():
            p.grad = grads[name]
        random.setstate(rng[0])
        np.random.set_state(rng[1])
        torch.set_rng_state(rng[2])
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        model.train(was_training)


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, list | tuple):
        return [t for v in value for t in _tensors(v)]
    return []


def _max_finite(tensors: list[torch.Tensor]) -> float:
    best = 0.0
    for t in tensors:
        if t.is_floating_point() and t.numel():
            finite = t.detach()[torch.isfinite(t.detach())]
            if finite.numel():
                best = max(best, float(finite.abs().max()))
    return best


def _nonfinite(tensors: list[torch.Tensor]) -> bool:
    return any(t.is_floating_point() and not bool(torch.isfinite(t).all()) for t in tensors)


def find_culprit(
    model: nn.Module,
    images: torch.Tensor,
    labels: torch.Tensor,
    autocast: Callable[[], contextlib.AbstractContextManager[Any]],
    loss_scale: float = 1.0,
) -> dict[str, Any] | None:
    """Re-run one batch with hooks; name the first module whose output or gradient went non-finite.

    Forward: the first leaf module (in execution order) with a non-finite output. Backward, when the
    forward was finite: the first module whose output gradient went non-finite. For FP16 outputs,
    an inf beyond 65504 is an overflow (BF16's range fixes it); a NaN from finite inputs is an
    invalid operation. Model state and RNG are restored afterwards.
    """
    found: dict[str, Any] = {}
    largest_before = [0.0]

    names = {m: n for n, m in model.named_modules()}
    stack: list[nn.Module] = []

    def record_forward(
        module: nn.Module, where: str, ins: list[torch.Tensor], outs: list[torch.Tensor]
    ) -> None:
        dtype = next((t.dtype for t in outs if t.is_floating_point()), None)
        has_inf = any(bool(torch.isinf(t).any()) for t in outs if t.is_floating_point())
        own_params = list(module.parameters(recurse=False))
        if own_params and _nonfinite(own_params):
            kind = "non-finite parameters: an earlier update already diverged"
        elif dtype == torch.float16 and has_inf:
            kind = "overflow: a value exceeded FP16's maximum 65504; BF16 (FP32's range) fixes it"
        elif not _nonfinite(ins):
            kind = "invalid operation: NaN/inf produced from finite inputs"
        else:
            kind = "non-finite input propagated"
        found["forward"] = {
            "module": where,
            "module_type": type(module).__name__,
            "dtype": str(dtype).replace("torch.", ""),
            "largest_finite_before": largest_before[0],
            "largest_finite_input": _max_finite(ins),
            "kind": kind,
        }

    def pre_hook(module: nn.Module, inputs: Any) -> None:
        ins = _tensors(inputs)
        if "forward" not in found and stack and _nonfinite(ins):
            # Non-finite input to a module whose predecessors all produced finite outputs: the
            # value was computed in the enclosing module's own forward, between its submodules.
            parent = stack[-1]
            record_forward(parent, names[parent] or "(model)", [], ins)
            found["forward"]["kind"] += " (computed in this module's own forward code)"
        stack.append(module)

    def forward_hook(module: nn.Module, inputs: Any, output: Any) -> None:
        stack.pop()
        if "forward" in found:
            return
        outs = _tensors(output)
        if _nonfinite(outs):
            record_forward(module, names[module] or "(model)", _tensors(inputs), outs)
        else:
            largest_before[0] = max(largest_before[0], _max_finite(outs))

    def gradient_hook(name: str, module: nn.Module) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            if "backward" not in found and _nonfinite([grad]):
                found["backward"] = {
                    "module": name,
                    "module_type": type(module).__name__,
                    "dtype": str(grad.dtype).replace("torch.", ""),
                    "largest_finite_grad_output": _max_finite([grad]),
                }

        return hook

    def backward_hook(name: str) -> Callable[..., None]:
        # A tensor hook on the module's output receives the gradient flowing into the module.
        # (Module full-backward hooks would break modules that work in place, like ReLU(inplace).)
        def hook(module: nn.Module, inputs: Any, output: Any) -> None:
            for t in _tensors(output):
                if t.requires_grad:
                    t.register_hook(gradient_hook(name, module))

        return hook

    leaves = [(n, m) for n, m in model.named_modules() if n and not list(m.children())]
    with preserved_state(model):
        handles = [m.register_forward_pre_hook(pre_hook) for m in model.modules()]
        handles += [m.register_forward_hook(forward_hook) for m in model.modules()]
        handles += [m.register_forward_hook(backward_hook(n)) for n, m in leaves]
        try:
            model.zero_grad(set_to_none=True)
            with autocast():
                logits = model(images)
            loss = nn.functional.cross_entropy(logits.float(), labels)
            if "forward" not in found and torch.isfinite(loss):
                (loss * loss_scale).backward()
                if "backward" not in found:
                    _check_weight_gradients(model, names, found)
        finally:
            for h in handles:
                h.remove()
    if not found:
        return None
    return {
        "forward": found.get("forward"),
        "backward": found.get("backward"),
        "loss": float(loss.detach()),
        "loss_scale": loss_scale,
    }


def _check_weight_gradients(model: nn.Module, names: dict[nn.Module, str], found: dict) -> None:
    """Output gradients were finite: a weight gradient (e.g. dW's batch sum) may still overflow."""
    for module in model.modules():
        for pname, p in module.named_parameters(recurse=False):
            if p.grad is not None and _nonfinite([p.grad]):
                found["backward"] = {
                    "module": f"{names[module]}.{pname}" if names[module] else pname,
                    "module_type": type(module).__name__,
                    "dtype": str(p.grad.dtype).replace("torch.", ""),
                    "largest_finite_grad_output": _max_finite([p.grad]),
                }
                return


def describe_culprit(culprit: dict[str, Any] | None) -> str:
    if culprit is None:
        return "re-running the batch gave finite values (the failure did not reproduce)"
    fwd, bwd = culprit.get("forward"), culprit.get("backward")
    if fwd:
        return (
            f"forward: first non-finite output at {fwd['module']} ({fwd['module_type']}, "
            f"{fwd['dtype']}); largest finite value before it {fwd['largest_finite_before']:.4g}; "
            f"{fwd['kind']}"
        )
    return (
        f"backward: first non-finite gradient at {bwd['module']} ({bwd['module_type']}, "
        f"{bwd['dtype']}) with loss scale {culprit['loss_scale']:g}; largest finite incoming "
        f"gradient {bwd['largest_finite_grad_output']:.4g}"
    )


# ------------------------------------------------------------------------------ FP32 overrides
def keep_in_fp32(model: nn.Module, patterns: list[str], device_type: str) -> list[str]:
    """Run the modules matching ``patterns`` outside autocast, in FP32. Returns their names.

    The module's own forward is wrapped on the instance: parameters and state_dict keys are
    unchanged. Floating-point inputs are cast to FP32; the output stays FP32.
    """
    matched = []
    for name, module in model.named_modules():
        if name and any(fnmatch.fnmatchcase(name, p) for p in patterns):
            original = module.forward

            def forward(*args: Any, _original: Callable[..., Any] = original, **kwargs: Any) -> Any:
                args = tuple(
                    a.float() if torch.is_tensor(a) and a.is_floating_point() else a for a in args
                )
                with torch.autocast(device_type, enabled=False):
                    return _original(*args, **kwargs)

            module.forward = forward  # type: ignore[method-assign]
            matched.append(name)
    return matched


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
    return ",".join(str(t.dtype).replace("torch.", "") for t in tensors) or "-"


class _AuditMode(TorchDispatchMode):
    """Records every ATen op below autocast: what dtypes it actually ran with, in which module."""

    def __init__(self, module_stack: list[str]) -> None:
        super().__init__()
        self.module_stack = module_stack
        self.phase = "forward"  # set to "backward" by the caller before loss.backward()
        self.calls: Counter[tuple[str, str, str, str, str]] = Counter()
        self.flags: dict[tuple[str, str, str, str, str], str] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        ins = [t for t in _tensors(list(args)) if t.is_floating_point()]
        outs = [t for t in _tensors(out) if t.is_floating_point()]
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


def audit_step(
    model: nn.Module,
    images: torch.Tensor,
    labels: torch.Tensor,
    autocast: Callable[[], contextlib.AbstractContextManager[Any]],
    optimizer: torch.optim.Optimizer,
    mixed: bool,
) -> dict[str, Any]:
    """Trace one forward + backward under the run's autocast policy (state restored afterwards).

    Returns the op table (op, module, phase, input/output dtypes, count, flag) and the dtypes of
    parameters, gradients and optimizer state, flagging non-FP32 ones in a mixed recipe.
    """
    stack: list[str] = []
    names = {m: n or "(model)" for n, m in model.named_modules()}

    def push(module: nn.Module, *_: Any) -> None:
        stack.append(names[module])

    def pop(module: nn.Module, *_: Any) -> None:
        if stack:
            stack.pop()

    with preserved_state(model):
        handles = [m.register_forward_pre_hook(push) for m in model.modules()]
        handles += [m.register_forward_hook(pop) for m in model.modules()]
        mode = _AuditMode(stack)
        try:
            model.zero_grad(set_to_none=True)
            with mode:
                with autocast():
                    logits = model(images)
                    loss = nn.functional.cross_entropy(logits.float(), labels)
                mode.phase = "backward"
                loss.backward()
        finally:
            for h in handles:
                h.remove()
        params = Counter(str(p.dtype).replace("torch.", "") for p in model.parameters())
        grads = Counter(
            str(p.grad.dtype).replace("torch.", "")
            for p in model.parameters()
            if p.grad is not None
        )
    states = Counter(
        str(v.dtype).replace("torch.", "")
        for s in optimizer.state.values()
        for k, v in s.items()
        if torch.is_tensor(v) and v.is_floating_point() and k != "step"
    )
    ops = [
        {
            "op": k[0],
            "module": k[1],
            "phase": k[2],
            "input_dtypes": k[3],
            "output_dtypes": k[4],
            "count": n,
            "flag": mode.flags.get(k),
        }
        for k, n in mode.calls.items()
    ]
    state_flags = []
    if mixed:
        for kind, counter in (
            ("parameter", params),
            ("gradient", grads),
            ("optimizer state", states),
        ):
            state_flags += [f"{kind} in {d} (expected float32)" for d in counter if d != "float32"]
    return {
        "ops": ops,
        "flagged_ops": [o for o in ops if o["flag"]],
        "parameter_dtypes": dict(params),
        "gradient_dtypes": dict(grads),
        "optimizer_state_dtypes": dict(states) or "not created yet (before the first step)",
        "state_flags": state_flags,
    }


def render_audit(audit: dict[str, Any]) -> str:
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
        f"- {f['flag']}" + (f": {f['op']} in {f['module']}" if "op" in f else "") for f in flags
    ]
    lines += [
        "",
        "| op | module | phase | inputs | outputs | count | flag |",
        "|---|---|---|---|---|---:|---|",
    ]
    for o in sorted(audit["ops"], key=lambda o: (o["phase"] != "forward", o["module"], o["op"])):
        lines.append(
            f"| {o['op']} | {o['module']} | {o['phase']} | {o['input_dtypes']} | "
            f"{o['output_dtypes']} | {o['count']} | {o['flag'] or ''} |"
        )
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------ FP16 range probe
def range_probe(
    model: nn.Module,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    loss_scale: float,
) -> dict[str, Any]:
    """Per leaf module, over ``batches`` in FP32: activation and gradient magnitudes, the share of
    non-zero gradient values FP16 would flush to zero unscaled and at ``loss_scale``, and the
    headroom of activations below 65504. Ends with a verdict. Model state is restored.
    """
    stats: dict[str, dict[str, float]] = {}

    def entry(name: str) -> dict[str, float]:
        return stats.setdefault(
            name,
            {
                "act_max": 0.0,
                "grad_max": 0.0,
                "grad_values": 0,
                "under_unscaled": 0,
                "under_scaled": 0,
            },
        )

    def fwd(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, inputs: Any, output: Any) -> None:
            e = entry(name)
            e["act_max"] = max(e["act_max"], _max_finite(_tensors(output)))

        return hook

    def record_gradient(name: str) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            e = entry(name)
            nonzero = grad.detach().abs()[grad.detach() != 0]
            e["grad_max"] = max(e["grad_max"], float(nonzero.max()) if nonzero.numel() else 0.0)
            e["grad_values"] += nonzero.numel()
            e["under_unscaled"] += int((nonzero < FP16_MIN_SUBNORMAL).sum())
            e["under_scaled"] += int((nonzero * loss_scale < FP16_MIN_SUBNORMAL).sum())

        return hook

    def bwd(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, inputs: Any, output: Any) -> None:
            for t in _tensors(output):
                if t.requires_grad:
                    t.register_hook(record_gradient(name))

        return hook

    # Probe an FP32 copy: the true magnitudes, whatever dtype the run keeps its weights in.
    rng = torch.get_rng_state()
    probe_model = copy.deepcopy(model).float()
    leaves = [(n, m) for n, m in probe_model.named_modules() if n and not list(m.children())]
    handles = [m.register_forward_hook(fwd(n)) for n, m in leaves]
    handles += [m.register_forward_hook(bwd(n)) for n, m in leaves]
    try:
        for images, labels in batches:
            probe_model.zero_grad(set_to_none=True)
            loss = nn.functional.cross_entropy(probe_model(images.float()).float(), labels)
            loss.backward()
    finally:
        for h in handles:
            h.remove()
        torch.set_rng_state(rng)
    layers = []
    total = under = under_scaled = 0
    for name, e in stats.items():
        n = e["grad_values"]
        total, under, under_scaled = (
            total + n,
            under + e["under_unscaled"],
            under_scaled + e["under_scaled"],
        )
        layers.append(
            {
                "module": name,
                "activation_max": e["act_max"],
                "headroom_to_fp16_max": FP16_MAX / e["act_max"] if e["act_max"] else math.inf,
                "gradient_max": e["grad_max"],
                "underflow_unscaled_fraction": e["under_unscaled"] / n if n else 0.0,
                "underflow_at_scale_fraction": e["under_scaled"] / n if n else 0.0,
            }
        )
    overflow = [layer["module"] for layer in layers if layer["activation_max"] > FP16_MAX]
    unscaled = under / total if total else 0.0
    scaled = under_scaled / total if total else 0.0
    if overflow:
        verdict = (
            f"FP16 overflows in the forward at {', '.join(overflow)} → use BF16, or keep those "
            "layers in FP32 (numerics.fp32_modules)"
        )
    elif unscaled > 1e-3:
        verdict = (
            f"FP16 needs loss scaling: {unscaled:.2%} of gradient values would flush to zero "
            f"unscaled, {scaled:.2%} at scale {loss_scale:g}"
        )
    else:
        verdict = "FP16 safe: activations below 65504 and gradients above FP16's smallest subnormal"
    return {
        "verdict": verdict,
        "loss_scale": loss_scale,
        "underflow_unscaled_fraction": unscaled,
        "underflow_at_scale_fraction": scaled,
        "overflow_modules": overflow,
        "layers": layers,
    }


def render_probe(probe: dict[str, Any]) -> str:
    lines = [
        "# FP16 range probe",
        "",
        f"**Verdict:** {probe['verdict']}",
        "",
        "| module | activation max | headroom to 65504 | gradient max | underflow unscaled | "
        f"underflow at scale {probe['loss_scale']:g} |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for layer in probe["layers"]:
        lines.append(
            f"| {layer['module']} | {layer['activation_max']:.4g} | "
            f"{layer['headroom_to_fp16_max']:.4g} | {layer['gradient_max']:.4g} | "
            f"{layer['underflow_unscaled_fraction']:.2%} | {layer['underflow_at_scale_fraction']:.2%} |"
        )
    return "\n".join(lines) + "\n"
