"""What fits a GPU's memory, as pure functions on accounted bytes (no torch; :mod:`.footprint`
measures them).

One training step's memory is accounted exactly (:func:`mptrain.train.memory.account_step`);
every kind but the saved activations is independent of the batch and the activations grow with
it, so the step's bytes at a micro-batch ``B`` are a line, ``fixed + B × per_sample``
(:class:`Line`, through two accounted batches; a test checks it against a third). The optimizer's
state is counted once per state choice (:data:`STATE_CHOICES`) and swapped into the line (it does
not depend on the precision: every autocast precision keeps FP32 master weights).

On ``advise.target``'s GPU, a combination fits a micro-batch when its bytes stay within
:func:`usable_bytes` of the GPU's memory (what the accounting leaves out is kept back:
:data:`RESERVED_FRACTION`, :data:`CONTEXT_BYTES`); the largest batch is the line solved for that
budget. Both are *predicted*, and labelled so.

:func:`choose` recommends, for ``advise.batch_size``, the cheapest combination (precision, state
choice, checkpointing mode) that fits: recomputing costs a second forward of the checkpointed
blocks (1.2–1.5× the step measured here), so no checkpointing beats any; then the fastest
precision (its predicted step on the target where there is one, else its speed measured here);
then the fuller state (FP32 moments, then BF16, then torchao's 8-bit, FP8 and 4-bit). Only a
precision whose loss stayed with FP32's in the fidelity run is considered (the decision's
numerics rules, :func:`mptrain.commands.advise.decide.unfaithful`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StateChoice:
    """How AdamW's moments are stored: ``optimizer=<optimizer>``, ``state_dtype`` for AdamW's own."""

    name: str
    label: str
    optimizer: str
    state_dtype: str | None = None


# In order of preference, the fullest state first; torchao's only where torchao is installed.
STATE_CHOICES = (
    StateChoice("fp32", "fp32 states", "adamw", "fp32"),
    StateChoice("bf16", "bf16 states", "adamw", "bf16"),
    StateChoice("adamw8bit", "8-bit states (torchao)", "adamw8bit"),
    StateChoice("adamw_fp8", "fp8 states (torchao)", "adamw_fp8"),
    StateChoice("adamw4bit", "4-bit states (torchao)", "adamw4bit"),
)
STATE_ORDER = tuple(s.name for s in STATE_CHOICES)
CHECKPOINTING = ("none", "selective", "full")  # memory.activation_checkpointing, cheapest first
PROBE_BATCHES = (2, 4)  # two micro-batches: a line through them (batch norm needs 2 or more)
RESERVED_FRACTION = 0.1  # of the GPU's memory: the allocator's caches, fragmentation, temporaries
CONTEXT_BYTES = 2**30  # the CUDA context and cuBLAS's workspaces, about 1 GiB on recent GPUs


@dataclass(frozen=True)
class Line:
    """One step's accounted bytes at micro-batch ``B``: ``fixed + B × per_sample``."""

    fixed: float
    per_sample: float

    def at(self, batch: int) -> int:
        return round(self.fixed + batch * self.per_sample)

    def largest_batch(self, budget: float) -> int:
        """The largest micro-batch whose bytes stay within ``budget``; 0 when not even one
        sample fits; ``-1`` when the bytes do not grow with the batch (no bound)."""
        if self.fixed + self.per_sample > budget:
            return 0
        if self.per_sample <= 0:
            return -1
        return math.floor((budget - self.fixed) / self.per_sample)


def line_through(points: Mapping[int, int]) -> Line:
    """The line through two accounted steps, ``{batch: bytes}``."""
    (b1, y1), (b2, y2) = sorted(points.items())
    per_sample = (y2 - y1) / (b2 - b1)
    return Line(y1 - b1 * per_sample, per_sample)


def usable_bytes(memory_gb: float) -> float:
    """What a step's accounted bytes may take of a GPU with ``memory_gb`` (10⁹ bytes)."""
    return memory_gb * 1e9 * (1 - RESERVED_FRACTION) - CONTEXT_BYTES


def basis(device: str) -> str:
    """advise.json's ``memory.basis``: how the figures were found, in words."""
    b1, b2 = PROBE_BATCHES
    return (
        "predicted: one step's accounted bytes (parameters, gradients, optimizer states, scales, "
        f"buffers, parameter casts, saved activations) at micro-batches {b1} and {b2} on {device}, "
        f"a line in the batch; fits when within {1 - RESERVED_FRACTION:.0%} of the GPU's memory "
        f"less {CONTEXT_BYTES // 2**30} GiB for the CUDA context (the allocator's caches and "
        "unsaved temporaries are not accounted)"
    )


@dataclass(frozen=True)
class Combination:
    """One way to train: a precision, an optimizer-state choice, a checkpointing mode; its line."""

    precision: str
    state: str
    checkpointing: str
    line: Line


def combinations(
    lines: Mapping[str, Mapping[str, Line]],
    states: Mapping[str, int],
    state_in_lines: str,
) -> list[Combination]:
    """Every (precision, state, checkpointing) with a line: ``lines[precision][mode]`` was
    accounted with the state ``state_in_lines`` (bytes ``states[state_in_lines]``), which each
    other state's bytes replace."""
    base = states[state_in_lines]
    return [
        Combination(precision, state, mode, Line(line.fixed - base + nbytes, line.per_sample))
        for precision, by_mode in lines.items()
        for mode, line in by_mode.items()
        for state, nbytes in states.items()
    ]


def cost_key(c: Combination, step_time: Mapping[str, float]) -> tuple[int, float, int]:
    """Cheapest first (see the module doc): checkpointing, then the step time, then the state."""
    return (
        CHECKPOINTING.index(c.checkpointing),
        step_time.get(c.precision, math.inf),
        STATE_ORDER.index(c.state) if c.state in STATE_ORDER else len(STATE_ORDER),
    )


def choose(
    combos: Sequence[Combination],
    batch: int,
    budget: float,
    step_time: Mapping[str, float],
    faithful: Sequence[str],
) -> Combination | None:
    """The cheapest of ``combos`` among the ``faithful`` precisions whose bytes at ``batch`` stay
    within ``budget``; None when none does. ``step_time``: each precision's step, any unit (a
    precision without one goes after those with one)."""
    fitting = [c for c in combos if c.precision in faithful and c.line.at(batch) <= budget]
    return min(fitting, key=lambda c: cost_key(c, step_time), default=None)


def state_choice(name: str) -> StateChoice | None:
    return next((s for s in STATE_CHOICES if s.name == name), None)


def user_state(optimizer: str, state_dtype: str | None) -> str:
    """The state choice the user's optimizer makes (``sgd``: its own name, no choice)."""
    return state_dtype if optimizer == "adamw" and state_dtype else optimizer


def combination_overrides(c: Combination, users: str, users_mode: str = "none") -> list[str]:
    """The command-line overrides of ``c``'s state and checkpointing beyond the user's own
    (``users``: the state choice, ``users_mode``: the checkpointing mode); its precision's are
    the precision's command."""
    out = []
    chosen, own = state_choice(c.state), state_choice(users)
    if chosen is not None and c.state != users:
        if own is None or own.optimizer != chosen.optimizer:
            out.append(f"optimizer={chosen.optimizer}")
        was_bf16 = own is not None and own.state_dtype == "bf16"
        if chosen.state_dtype is not None and (chosen.state_dtype != "fp32" or was_bf16):
            out.append(f"optimizer.state_dtype={chosen.state_dtype}")
    if c.checkpointing != users_mode:
        out.append(f"memory.activation_checkpointing={c.checkpointing}")
    return out


def state_label(name: str) -> str:
    found = state_choice(name)
    return found.label if found else f"{name} states"
