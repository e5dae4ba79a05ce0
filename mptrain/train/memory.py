"""Where a run's bytes go: one training step counted by tensor kind and dtype, on any device.

:func:`account_step` runs one optimizer step of the run on copies of its model and optimizer
(the run is not touched: a fresh batch iterator of its epoch, the CPU random state forked, as
:mod:`mptrain.pace.steptime` does) and counts, at the step's high-water mark, the bytes of each
kind of :data:`KINDS` (what each holds: docs/report.md#where-the-memory-goes-memoryaccounted):
the model's parameters, gradients, buffers and the low-precision layers' ``scales``, the
optimizer's state after its first step, and what autograd saved for the backward of one
micro-batch (each micro-batch's are freed by its backward; ``saved_tensors_hooks``, each storage
once, parameters and buffers left out), split into autocast's copies of the parameters
(:func:`_cast_of_parameter`) and ``activations``: everything else, a low-precision format's
weight casts included (made inside its autograd function, they have no history of their own).

Each count is exact for what it names: bytes of the storages held, by dtype. The measured peak
is larger (the interpreter, torch's own memory, allocator caches, temporaries never saved); the
report sets the two side by side.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from mptrain.models.task import logits_of
from mptrain.platform.distributed import unwrap
from mptrain.platform.dtypes import dtype_name
from mptrain.precision.quant.linear import QuantizedLinear
from mptrain.train import recompute
from mptrain.train.components import Run
from mptrain.train.optim import copy_for

KINDS = (
    "parameters",
    "gradients",
    "optimizer_states",
    "scales",
    "buffers",
    "parameter_casts",
    "activations",
)
# grad_fn nodes of a dtype cast of a parameter and views of it: a saved tensor reached from a
# parameter through these only (one ToCopy at least) is autocast's copy of that parameter.
_CAST_OR_VIEW = {
    "ToCopyBackward0",
    "TBackward0",
    "TransposeBackward0",
    "PermuteBackward0",
    "ViewBackward0",
    "UnsafeViewBackward0",
    "ExpandBackward0",
    "AliasBackward0",
}
Bytes = dict[str, dict[str, int]]  # kind -> dtype name -> bytes


def account_step(run: Run, samples: int | None = None) -> dict[str, object]:
    """The report's ``memory.accounted`` of one training step of ``run`` (see the module doc):
    ``bytes`` by kind and dtype, each kind's ``total``, and the accounted ``total_bytes``; under
    FSDP, only why it was not counted (``not_counted``: its sharded parameters are not copied).
    ``samples``: the micro-batch cut to its first ``samples`` (advise accounts two batch sizes
    on one built run); None: the run's own."""
    if run.dist.enabled and run.dist.strategy == "fsdp":
        return {"not_counted": "FSDP: the sharded model is not copied to count a step"}
    with torch.random.fork_rng(devices=[run.device] if run.device.type == "cuda" else []):
        inputs, targets = next(iter(run.data.train.batches(run.state.epoch)))
        if samples is not None:  # copies: a view would keep (and count) the whole batch's storage
            inputs, targets = inputs[:samples].clone(), targets[:samples].clone()
        model = copy.deepcopy(unwrap(run.model))
        optimizer = copy_for(run.optimizer, unwrap(run.model), model)
        model.train()
        counted: Bytes = {kind: {} for kind in KINDS}
        held = _storages(model.parameters()) | _storages(model.buffers())
        pack, unpack = _saved_into(counted, held)
        inputs = run.precision.model_input(inputs, run.settings.channels_last)
        recompute.saving_inputs.append(pack)  # a checkpointed block keeps its inputs only
        try:
            with saved_tensors_hooks(pack, unpack), run.precision.forward_context():
                loss = run.loss_fn(logits_of(model(inputs)), targets)
        finally:
            recompute.saving_inputs.remove(pack)
        loss.backward()
        optimizer.step()  # creates the state (Adam: its moments), as the run's first step does
        _count_model(model, counted)
        states = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
        _count(counted["optimizer_states"], states)
    totals = {kind: sum(by_dtype.values()) for kind, by_dtype in counted.items()}
    blocks = recompute.recomputed(model)
    return {
        "bytes": counted,
        "total": totals,
        "total_bytes": sum(totals.values()),
        "recomputed_blocks": blocks,
    }


def fresh_state_bytes(optimizer: torch.optim.Optimizer) -> dict[str, int] | None:
    """The bytes by dtype of the state torchao's low-bit AdamW creates at its first step (a step
    counter and its quantized moments per parameter), made by its own ``_new_buffer`` as its step
    makes them, without the step: torchao compiles its step, 5 to 60 s on a CPU per state kind.
    None for any other optimizer (step it: :func:`account_step`)."""
    make = getattr(optimizer, "_new_buffer", None)
    if make is None:
        return None
    tensors = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad:
                tensors += [torch.tensor(0.0), make(p, True), make(p, False)]
                tensors += [make(p, False)] if group.get("amsgrad") else []
    by_dtype: dict[str, int] = {}
    _count(by_dtype, tensors)
    return by_dtype


def _count_model(model: nn.Module, counted: Bytes) -> None:
    params = list(model.parameters())
    _count(counted["parameters"], params)
    _count(counted["gradients"], [p.grad for p in params if p.grad is not None])
    scale_buffers = {
        id(b) for m in model.modules() if isinstance(m, QuantizedLinear) for b in m.buffers()
    }
    buffers = list(model.buffers())
    _count(counted["scales"], [b for b in buffers if id(b) in scale_buffers])
    _count(counted["buffers"], [b for b in buffers if id(b) not in scale_buffers])


def _storage(t: torch.Tensor) -> tuple[int, int]:
    """(a key of ``t``'s storage, its bytes); a wrapper subclass without a storage of its own
    (torchao's float8 tensors) by its elements."""
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return id(t), t.numel() * t.element_size()
    return storage.data_ptr(), storage.nbytes()


def _add(into: dict[str, int], seen: set[int], t: torch.Tensor) -> None:
    """Add ``t``'s storage bytes to ``into`` under its dtype, unless ``seen`` holds it; a
    wrapper subclass's (torchao's quantized optimizer states) are its inner tensors' (codes and
    scales), each under its own dtype."""
    if is_traceable_wrapper_subclass(t):
        for inner in (getattr(t, name) for name in t.__tensor_flatten__()[0]):
            if torch.is_tensor(inner):
                _add(into, seen, inner)
        return
    key, nbytes = _storage(t)
    if key in seen or nbytes == 0:
        return
    seen.add(key)
    name = dtype_name(t.dtype)
    into[name] = into.get(name, 0) + nbytes


def _count(into: dict[str, int], tensors: Iterable[torch.Tensor]) -> None:
    """Add each storage's bytes once, under its tensor's dtype."""
    seen: set[int] = set()
    for t in tensors:
        _add(into, seen, t)


def _storages(tensors: Iterable[torch.Tensor]) -> set[int]:
    return {_storage(t)[0] for t in tensors}


def _saved_into(
    counted: Bytes, held: set[int]
) -> tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]:
    """saved_tensors_hooks' (pack, unpack) that add each saved storage's bytes once, to
    ``parameter_casts`` (autocast's copy of a parameter) or ``activations`` (anything else);
    ``held`` (parameters and buffers, counted as such) left out."""
    seen = set(held)

    def pack(t: torch.Tensor) -> torch.Tensor:
        _add(counted["parameter_casts" if _cast_of_parameter(t) else "activations"], seen, t)
        return t

    return pack, lambda t: t  # unpack: the tensor itself


def _cast_of_parameter(t: torch.Tensor) -> bool:
    """``t`` is a dtype cast of a parameter, or a view of one: its autograd history is casts and
    views only (one cast at least) back to a leaf that requires grad."""
    fn, cast = t.grad_fn, False
    while fn is not None:
        name = type(fn).__name__
        if name == "AccumulateGrad":
            return cast
        if name not in _CAST_OR_VIEW:
            return False
        cast = cast or name == "ToCopyBackward0"
        inputs = [f for f, _ in fn.next_functions if f is not None]
        if len(inputs) != 1:
            return False
        fn = inputs[0]
    return False
