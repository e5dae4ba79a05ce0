"""One-off numerics diagnostics: each runs once, on request, and reports; none trains.

This module owns three tools and the hook scaffolding they share:

- the culprit finder (:func:`find_culprit`): re-runs one batch and names the first module whose
  output or gradient went non-finite (:func:`mptrain.train.monitor.describe_culprit` words it);
- the autocast audit (:func:`audit_step`, :func:`render_audit`): traces one forward + backward
  and tables the dtype every ATen op really ran in, flagging low-precision ops and state that
  the mixed-precision recipe wants in FP32;
- the FP16 range probe (:func:`range_probe`, :func:`render_probe`): measures, in FP32, how far
  activations sit below FP16's maximum and how many gradient values FP16 would flush to zero.

Every tool leaves the model as it found it (parameters, buffers, gradients, training flag and
RNG state), so running one never changes what training computes. :func:`write_diagnostics` runs
the audit and the probe before training when ``audit=true`` / ``probe=true``. Per-step health
(``ScaleHealth``) lives in :mod:`mptrain.train.monitor`, per-layer FP32 (``keep_in_fp32``, which changes
the computation) in :mod:`mptrain.precision.policy`.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import itertools
import json
import math
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.hooks import RemovableHandle

if TYPE_CHECKING:
    from rich.console import Console

    from mptrain.train.components import Run

from mptrain.models.task import cross_entropy
from mptrain.output.report import clean_json
from mptrain.platform.dtypes import dtype_name
from mptrain.platform.seeding import restore_rng_states, rng_states
from mptrain.precision.policy import to_model_input
from mptrain.rundir.fileio import atomic_write_text

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
        for t in _tensors(output):
            if t.requires_grad:
                t.register_hook(callback)

    return hook


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in ``value``, flattening nested lists and tuples; anything else is skipped."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, list | tuple):
        return [t for v in value for t in _tensors(v)]
    return []


def _max_finite(tensors: list[torch.Tensor]) -> float:
    """Largest finite magnitude among the floating-point ``tensors`` (0.0 when there is none)."""
    best = 0.0
    for t in tensors:
        if t.is_floating_point() and t.numel():
            finite = t.detach()[torch.isfinite(t.detach())]
            if finite.numel():
                best = max(best, float(finite.abs().max()))
    return best


def _nonfinite(tensors: list[torch.Tensor]) -> bool:
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


# ------------------------------------------------------------------------------ culprit finder
def _forward_kind(
    module: nn.Module, dtype: torch.dtype | None, ins: list[torch.Tensor], outs: list[torch.Tensor]
) -> str:
    """Why ``module`` produced the non-finite ``outs``, most specific cause first."""
    has_inf = any(bool(torch.isinf(t).any()) for t in outs if t.is_floating_point())
    own_params = list(module.parameters(recurse=False))
    if own_params and _nonfinite(own_params):
        return "non-finite parameters: an earlier update already diverged"
    if dtype == torch.float16 and has_inf:
        return "overflow: a value exceeded FP16's maximum 65504; BF16 (FP32's range) fixes it"
    if not _nonfinite(ins):
        return "invalid operation: NaN/inf produced from finite inputs"
    return "non-finite input propagated"


def _backward_entry(where: str, module: nn.Module, grad: torch.Tensor) -> dict[str, Any]:
    """The ``found["backward"]`` record for a non-finite gradient ``grad`` at ``where``."""
    return {
        "module": where,
        "module_type": type(module).__name__,
        "dtype": dtype_name(grad.dtype),
        "largest_finite_grad_output": _max_finite([grad]),
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
            "largest_finite_input": _max_finite(ins),
            "kind": _forward_kind(module, dtype, ins, outs),
        }

    def pre_hook(self, module: nn.Module, inputs: Any) -> None:
        ins = _tensors(inputs)
        if "forward" not in self.found and self.stack and _nonfinite(ins):
            # Non-finite input to a module whose predecessors all produced finite outputs: the
            # value was computed in the enclosing module's own forward, between its submodules.
            self._record_forward(self.stack[-1], [], ins)
            self.found["forward"]["kind"] += " (computed in this module's own forward code)"
        self.stack.append(module)

    def forward_hook(self, module: nn.Module, inputs: Any, output: Any) -> None:
        self.stack.pop()
        if "forward" in self.found:
            return
        outs = _tensors(output)
        if _nonfinite(outs):
            self._record_forward(module, _tensors(inputs), outs)
        else:
            self.largest_before = max(self.largest_before, _max_finite(outs))

    def output_gradient(self, name: str, module: nn.Module, grad: torch.Tensor) -> None:
        if "backward" not in self.found and _nonfinite([grad]):
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
            logits = model(images)
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

    Forward: the first leaf module (in execution order) with a non-finite output. Backward, when the
    forward was finite: the first module whose output gradient went non-finite. For FP16 outputs,
    an inf beyond 65504 is an overflow (BF16's range fixes it); a NaN from finite inputs is an
    invalid operation. Model state and RNG are restored afterwards.

    Returns ``None`` when everything stayed finite, else ``{"forward", "backward", "loss",
    "loss_scale"}`` (``forward``/``backward`` ``None`` where nothing was found).
    """
    hooks = _CulpritHooks(model)
    with preserved_state(model), installed(hooks.registrations(model)):
        loss = hooks.run(model, images, labels, autocast, loss_scale)
    if not hooks.found:
        return None
    return {
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
            if p.grad is not None and _nonfinite([p.grad]):
                where = f"{names[module]}.{pname}" if names[module] else pname
                found["backward"] = _backward_entry(where, module, p.grad)
                return


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

    def push(module: nn.Module, *_: Any) -> None:
        stack.append(names[module])

    def pop(module: nn.Module, *_: Any) -> None:
        if stack:
            stack.pop()

    registrations = itertools.chain(
        (m.register_forward_pre_hook(push) for m in model.modules()),
        (m.register_forward_hook(pop) for m in model.modules()),
    )
    mode = _AuditMode(stack)
    with installed(registrations):
        model.zero_grad(set_to_none=True)
        with mode:
            with autocast():
                logits = model(images)
                loss = cross_entropy(logits, labels)
            mode.phase = "backward"
            loss.backward()
    return mode


def _op_table(mode: _AuditMode) -> list[dict[str, Any]]:
    """One row per distinct (op, module, phase, input dtypes, output dtypes), with count and flag."""
    return [
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


def _state_flags(params: Counter[str], grads: Counter[str], states: Counter[str]) -> list[str]:
    """A flag per non-FP32 dtype among parameters, gradients and optimizer state."""
    flags = []
    for kind, counter in (
        ("parameter", params),
        ("gradient", grads),
        ("optimizer state", states),
    ):
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

    Returns the op table (op, module, phase, input/output dtypes, count, flag) and the dtypes of
    parameters, gradients and optimizer state, flagging non-FP32 ones in a mixed recipe.
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
        f"- {o['op']} in {o['module']}: inputs {o['input_dtypes']}, outputs {o['output_dtypes']}"
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
        f"- {f['flag']}" + (f": {f['op']} in {f['module']}" if "op" in f else "") for f in flags
    ]
    lines += _attention_lines(audit["ops"])
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
class _RangeStats:
    """Per leaf module, running over all probed batches: the largest activation and gradient
    magnitudes, how many non-zero gradient values were seen, and how many of them would flush to
    zero in FP16 unscaled and at ``loss_scale``. Entries appear in first-forward order."""

    def __init__(self, loss_scale: float) -> None:
        self.loss_scale = loss_scale
        self.stats: dict[str, dict[str, float]] = {}

    def entry(self, name: str) -> dict[str, float]:
        return self.stats.setdefault(
            name,
            {
                "act_max": 0.0,
                "grad_max": 0.0,
                "grad_values": 0,
                "under_unscaled": 0,
                "under_scaled": 0,
            },
        )

    def activation(self, name: str, module: nn.Module, inputs: Any, output: Any) -> None:
        e = self.entry(name)
        e["act_max"] = max(e["act_max"], _max_finite(_tensors(output)))

    def gradient(self, name: str, grad: torch.Tensor) -> None:
        e = self.entry(name)
        nonzero = grad.detach().abs()[grad.detach() != 0]
        e["grad_max"] = max(e["grad_max"], float(nonzero.max()) if nonzero.numel() else 0.0)
        e["grad_values"] += nonzero.numel()
        e["under_unscaled"] += int((nonzero < FP16_MIN_SUBNORMAL).sum())
        e["under_scaled"] += int((nonzero * self.loss_scale < FP16_MIN_SUBNORMAL).sum())


def _measure_ranges(
    model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], loss_scale: float
) -> dict[str, dict[str, float]]:
    """Forward + backward each batch through an FP32 copy of ``model``; return the per-leaf stats.

    The model itself is not touched; the torch RNG state is restored afterwards.
    """
    ranges = _RangeStats(loss_scale)
    rng = torch.get_rng_state()
    # Probe an FP32 copy: the true magnitudes, whatever dtype the run keeps its weights in.
    probe_model = copy.deepcopy(model).float()
    leaves = leaf_modules(probe_model)
    registrations = itertools.chain(
        (m.register_forward_hook(functools.partial(ranges.activation, n)) for n, m in leaves),
        (
            m.register_forward_hook(on_output_gradient(functools.partial(ranges.gradient, n)))
            for n, m in leaves
        ),
    )
    try:
        with installed(registrations):
            for images, labels in batches:
                probe_model.zero_grad(set_to_none=True)
                inputs = images.float() if images.is_floating_point() else images  # token ids stay
                loss = cross_entropy(probe_model(inputs), labels)
                loss.backward()
    finally:
        torch.set_rng_state(rng)
    return ranges.stats


def _layer_row(name: str, e: dict[str, float]) -> dict[str, Any]:
    """One ``layers`` row of the probe: maxima, headroom to 65504 and underflow fractions."""
    n = e["grad_values"]
    return {
        "module": name,
        "activation_max": e["act_max"],
        "headroom_to_fp16_max": FP16_MAX / e["act_max"] if e["act_max"] else math.inf,
        "gradient_max": e["grad_max"],
        "underflow_unscaled_fraction": e["under_unscaled"] / n if n else 0.0,
        "underflow_at_scale_fraction": e["under_scaled"] / n if n else 0.0,
    }


def _probe_verdict(overflow: list[str], unscaled: float, scaled: float, loss_scale: float) -> str:
    """Forward overflow first (scaling cannot fix it), then underflow needing scaling, else safe."""
    if overflow:
        return (
            f"FP16 overflows in the forward at {', '.join(overflow)} → use BF16, or keep those "
            "layers in FP32 (numerics.fp32_modules)"
        )
    if unscaled > 1e-3:
        return (
            f"FP16 needs loss scaling: {unscaled:.2%} of gradient values would flush to zero "
            f"unscaled, {scaled:.2%} at scale {loss_scale:g}"
        )
    return "FP16 safe: activations below 65504 and gradients above FP16's smallest subnormal"


def _summarise_ranges(stats: dict[str, dict[str, float]], loss_scale: float) -> dict[str, Any]:
    """Turn the per-leaf stats into the probe result: totals over all leaves and a verdict."""
    layers = [_layer_row(name, e) for name, e in stats.items()]
    total = sum(e["grad_values"] for e in stats.values())
    under = sum(e["under_unscaled"] for e in stats.values())
    under_scaled = sum(e["under_scaled"] for e in stats.values())
    overflow = [layer["module"] for layer in layers if layer["activation_max"] > FP16_MAX]
    unscaled = under / total if total else 0.0
    scaled = under_scaled / total if total else 0.0
    return {
        "verdict": _probe_verdict(overflow, unscaled, scaled, loss_scale),
        "loss_scale": loss_scale,
        "underflow_unscaled_fraction": unscaled,
        "underflow_at_scale_fraction": scaled,
        "overflow_modules": overflow,
        "layers": layers,
    }


def range_probe(
    model: nn.Module,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    loss_scale: float,
) -> dict[str, Any]:
    """Per leaf module, over ``batches`` in FP32: activation and gradient magnitudes, the share of
    non-zero gradient values FP16 would flush to zero unscaled and at ``loss_scale``, and the
    headroom of activations below 65504. Ends with a verdict. Model state is restored.

    Returns ``{"verdict", "loss_scale", "underflow_unscaled_fraction",
    "underflow_at_scale_fraction", "overflow_modules", "layers"}``; the fractions are over all
    non-zero gradient values of all leaves.
    """
    return _summarise_ranges(_measure_ranges(model, batches, loss_scale), loss_scale)


def render_probe(probe: dict[str, Any]) -> str:
    """Markdown for a :func:`range_probe` result: the verdict, then one table row per layer."""
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


# ------------------------------------------------------------------------------ before training
def write_diagnostics(run: Run, output_dir: Path, console: Console) -> None:
    """audit=true / probe=true: trace one step, or probe FP16 ranges, into files of the run
    directory (audit.md/.json, probe.md/.json); the model is left untouched."""
    cfg, policy = run.cfg, run.policy
    if not (cfg.audit or cfg.probe):
        return
    batches = run.data.train.batches(0)
    first = [next(batches) for _ in range(cfg.probe_batches if cfg.probe else 1)]
    first = [(to_model_input(x, policy, cfg.channels_last), y) for x, y in first]
    if cfg.audit:
        audit = audit_step(
            run.model, *first[0], policy.autocast, run.optimizer, mixed=policy.master_weights
        )
        atomic_write_text(output_dir / "audit.json", json.dumps(audit, indent=2) + "\n")
        atomic_write_text(output_dir / "audit.md", render_audit(audit))
        flags = len(audit["flagged_ops"]) + len(audit["state_flags"])
        console.print(f"audit: {len(audit['ops'])} op kinds traced, {flags} flagged -> audit.md")
    if cfg.probe:
        probe = range_probe(run.model, first, policy.scaler.init_scale)
        atomic_write_text(output_dir / "probe.json", json.dumps(clean_json(probe), indent=2) + "\n")
        atomic_write_text(output_dir / "probe.md", render_probe(probe))
        console.print(f"FP16 range probe: {probe['verdict']} -> probe.md")
