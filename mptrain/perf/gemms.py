"""What one training step of a model computes, counted from one forward pass on the meta device
(no memory, no arithmetic): every GEMM with its shape, and the bytes the other operations move.

:func:`account` runs the model on a batch of :data:`SAMPLES` meta tensors under a
``TorchFunctionMode`` that sees every torch function call:

- **GEMMs**: ``F.linear`` and the convolutions (by the module that owns the weight: FP8's layer
  choice names Linears this way), ``matmul``/``bmm``/``@``, and
  ``F.scaled_dot_product_attention``, whose two GEMMs (scores ``QKᵀ`` and ``PV``) are counted from
  the shapes of Q, K and V: ``2·L·S·E + 2·L·S·Ev`` per head, the causal mask not applied (model
  FLOPs count attention whole, as PaLM's appendix B does). Each is recorded per sample (weights
  once), with whether its left operand needs a gradient (the input images do not: no data
  gradient for the first convolution).
- **Everything else** (norms, activations, residual additions, pooling, dropout, the loss,
  copies made contiguous): the bytes of its tensor inputs and outputs, one read and one write
  each; views move nothing; an embedding reads only the rows it gathers.
- **Autocast**, emulated where the real one cannot run (meta tensors): with ``autocast`` a low
  dtype, the GEMMs take their floating inputs in it, and the functions autocast runs in FP32
  (norms, softmax, losses, exp/log/pow, sums) take FP32 inputs, as CUDA autocast's lists say;
  the rest runs in the dtypes it is given. The casts autocast makes into the GEMMs are not in
  the elementwise bytes: :mod:`mptrain.perf.roofline` counts them per precision.

The loss is cross-entropy over the logits, as the tasks train. Nothing here scales by batch:
:class:`Accounting` holds per-sample figures and the weights once.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from mptrain.models.task import logits_of

SAMPLES = 2  # the meta batch: two, so batch norm in training mode has more than one value

Tensor = torch.Tensor
LINEAR, CONV, MATMUL, ATTENTION = "linear", "conv", "matmul", "attention"
GEMM_FUNCTIONS: dict[Any, str] = {
    F.linear: LINEAR,
    F.conv1d: CONV,
    F.conv2d: CONV,
    F.conv3d: CONV,
    torch.matmul: MATMUL,
    torch.mm: MATMUL,
    torch.bmm: MATMUL,
    Tensor.matmul: MATMUL,
    Tensor.__matmul__: MATMUL,
    Tensor.mm: MATMUL,
    Tensor.bmm: MATMUL,
    F.scaled_dot_product_attention: ATTENTION,
}
# CUDA autocast's FP32 list, the functions models call (torch.amp autocast op reference).
AUTOCAST_FP32 = {
    F.layer_norm, F.group_norm, F.softmax, F.log_softmax, F.cross_entropy, F.nll_loss,
    F.mse_loss, torch.exp, torch.log, torch.pow, torch.sum, torch.norm, torch.softmax,
    torch.log_softmax, torch.cumsum, Tensor.exp, Tensor.log, Tensor.pow, Tensor.sum,
    Tensor.softmax, Tensor.log_softmax, Tensor.norm, Tensor.cumsum,
}  # fmt: skip


@dataclass(frozen=True)
class Gemm:
    """One GEMM of the forward pass ``C = A·B`` (a fused attention: both of its GEMMs), per
    sample: FLOPs, and the elements of each operand and of the result. ``b_is_weight``: B is a
    parameter (counted once, not per sample). Bytes per element as the operands arrived."""

    name: str  # the module that ran it: its Linear/Conv name, or the caller's for matmul/attention
    kind: str  # linear | conv | matmul | attention
    flops: float  # forward, per sample (attention: whole, mask not applied)
    a_elems: float  # per sample (attention: Q)
    b_elems: float  # the weight's elements, or per sample (attention: K and V)
    out_elems: float  # per sample
    b_is_weight: bool
    a_grad: bool  # A needs its gradient (a data-gradient GEMM runs in the backward)
    b_grad: bool  # B needs its gradient (a weight-gradient GEMM runs)
    a_bytes: int  # bytes per element of A as it arrived, before any autocast cast
    b_bytes: int
    causal: bool = False  # attention with is_causal: kernels skip the masked half


@dataclass
class Accounting:
    """One training step's work per sample (weights once): the GEMMs in the order they ran, the
    bytes the other forward operations moved, how often each of those ran, the parameters."""

    gemms: list[Gemm]
    elementwise_bytes: float  # forward, per sample, every non-GEMM operation
    elementwise_ops: Counter[str] = field(default_factory=Counter)
    parameters: int = 0  # trainable, each shared tensor once
    autocast: str | None = None  # the emulated autocast dtype, "bfloat16" | "float16" | None


def _nbytes(t: Tensor) -> float:
    return t.numel() * t.element_size()


def _tensors(tree: Any) -> list[Tensor]:
    return [x for x in tree_flatten(tree)[0] if isinstance(x, Tensor)]


def _cast(tree: Any, dtype: torch.dtype) -> Any:
    return tree_map(
        lambda x: x.to(dtype) if isinstance(x, Tensor) and x.is_floating_point() else x, tree
    )


class _Recorder(TorchFunctionMode):
    """Records what :func:`account` says, emulating autocast to ``low`` (or not, with None)."""

    def __init__(self, model: nn.Module, low: torch.dtype | None) -> None:
        super().__init__()
        self.low = low
        self.owners = {
            id(m.weight): name
            for name, m in model.named_modules()
            if isinstance(m, nn.Linear | nn.modules.conv._ConvNd)
        }
        self.stack: list[str] = [""]  # the module running now (forward pre/post hooks)
        self.gemms: list[Gemm] = []
        self.bytes = 0.0
        self.ops: Counter[str] = Counter()

    def __torch_function__(
        self, func: Any, types: Any, args: tuple = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        kind = GEMM_FUNCTIONS.get(func)
        if kind is not None:
            return self._gemm(func, kind, args, kwargs)
        if self.low is not None and func in AUTOCAST_FP32:
            before = sum(_nbytes(t) for t in _tensors((args, kwargs)) if t.dtype == self.low)
            args, kwargs = _cast((args, kwargs), torch.float32)
            self.bytes += 3 * before  # autocast's cast: a read of the low copy, a write 2x as big
        out = func(*args, **kwargs)
        self._traffic(func, args, kwargs, out)
        return out

    def _traffic(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        outs = _tensors(out)
        if not outs:
            return
        ins = _tensors((args, kwargs))
        name = getattr(func, "__name__", str(func))
        if _in_place(name, kwargs):
            written = outs
        else:  # an input handed back (.to() of its own dtype, dropout of 0) or a view: no copy
            written = [o for o in outs if not o._is_view() and not any(o is i for i in ins)]
        if not written:
            return
        if func is F.embedding:  # reads the rows it gathers, not the whole table
            ins = [args[0], *written]
        self.bytes += sum(_nbytes(t) for t in ins) + sum(_nbytes(t) for t in written)
        self.ops[name] += 1

    def _gemm(self, func: Any, kind: str, args: tuple, kwargs: dict) -> Any:
        if kind == ATTENTION:
            return self._attention(func, args, kwargs)
        a, b = _tensors((args, kwargs))[:2]
        b_is_weight = isinstance(b, nn.Parameter)
        if isinstance(a, nn.Parameter) and not b_is_weight:  # W @ x: the weight on the left
            a, b, b_is_weight = b, a, True
        name = self.owners.get(id(b), self.stack[-1]) if b_is_weight else self.stack[-1]
        if self.low is not None:
            args, kwargs = _cast((args, kwargs), self.low)
        out = func(*args, **kwargs)
        # A convolution is an implicit GEMM: per output element, C_in/groups x kernel products.
        k = math.prod(b.shape[1:]) if kind == CONV else a.shape[-1]
        per = 1 / SAMPLES
        self.gemms.append(
            Gemm(
                name=name or "(model)",
                kind=kind,
                flops=2.0 * out.numel() * k * per,
                a_elems=a.numel() * per,
                b_elems=b.numel() * (1 if b_is_weight else per),
                out_elems=out.numel() * per,
                b_is_weight=b_is_weight,
                a_grad=a.requires_grad,
                b_grad=b.requires_grad,
                a_bytes=a.element_size(),
                b_bytes=b.element_size(),
            )
        )
        return out

    def _attention(self, func: Any, args: tuple, kwargs: dict) -> Any:
        q, k, v = (list(args) + [kwargs.get(n) for n in ("query", "key", "value")])[:3]
        causal = bool(kwargs.get("is_causal", args[5] if len(args) > 5 else False))
        if self.low is not None:
            args, kwargs = _cast((args, kwargs), self.low)
        out = func(*args, **kwargs)
        length, keys = q.shape[-2], k.shape[-2]
        heads = q.numel() / (length * q.shape[-1])  # batch x heads
        flops = 2.0 * heads * length * keys * (q.shape[-1] + v.shape[-1])
        per = 1 / SAMPLES
        self.gemms.append(
            Gemm(
                name=f"{self.stack[-1] or '(model)'}:attention",
                kind=ATTENTION,
                flops=flops * per,
                a_elems=q.numel() * per,
                b_elems=(k.numel() + v.numel()) * per,
                out_elems=out.numel() * per,
                b_is_weight=False,
                a_grad=q.requires_grad,
                b_grad=k.requires_grad or v.requires_grad,
                a_bytes=q.element_size(),
                b_bytes=k.element_size(),
                causal=causal,
            )
        )
        return out


def _in_place(name: str, kwargs: dict) -> bool:
    """``add_``, ``__iadd__``, ``F.relu(x, inplace=True)``: the result overwrites an input."""
    trailing = name.endswith("_") and not name.endswith("__")
    return trailing or name.startswith("__i") or kwargs.get("inplace") is True


def _track_modules(model: nn.Module, recorder: _Recorder) -> list[Any]:
    """Forward hooks that keep ``recorder.stack`` on the module running now."""
    handles = []
    for name, module in model.named_modules():

        def push(mod: nn.Module, args: Any, name: str = name) -> None:
            recorder.stack.append(name)

        def pop(mod: nn.Module, args: Any, out: Any) -> None:
            recorder.stack.pop()

        handles.append(module.register_forward_pre_hook(push))
        handles.append(module.register_forward_hook(pop))
    return handles


def account(model: nn.Module, sample: Tensor, autocast: torch.dtype | None = None) -> Accounting:
    """One training-mode forward pass of ``model`` (on the meta device) on ``sample`` (a meta
    batch of :data:`SAMPLES`) and the loss, counted as the module doc says; ``autocast``: the
    dtype autocast would compute in (None: none). ``model`` is left as it was (its hooks
    removed, its mode restored); nothing is computed."""
    recorder = _Recorder(model, autocast)
    handles = _track_modules(model, recorder)
    was_training = model.training
    model.train()
    try:
        with recorder:
            logits = logits_of(model(sample))
        targets = torch.zeros(logits.shape[:-1], dtype=torch.long, device=logits.device)
        with recorder:  # the loss, as the tasks train (its targets made outside: data, not work)
            F.cross_entropy(logits.flatten(0, -2), targets.flatten())
    finally:
        model.train(was_training)
        for handle in handles:
            handle.remove()
    unique = {id(p): p for p in model.parameters() if p.requires_grad}
    return Accounting(
        gemms=recorder.gemms,
        elementwise_bytes=recorder.bytes / SAMPLES,
        elementwise_ops=recorder.ops,
        parameters=sum(p.numel() for p in unique.values()),
        autocast=None if autocast is None else str(autocast).removeprefix("torch."),
    )
