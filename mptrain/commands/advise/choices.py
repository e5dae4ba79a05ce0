"""The choices ``mptrain advise`` considers, as data: each a name, the label people read, the
config keys it sets (the same ones its training command carries) and the hardware its speed needs.

:data:`BASE` holds the precisions :func:`mptrain.commands.bench.bench_precisions` lists;
:data:`LOW_PRECISION` every low-precision choice mptrain runs, each measured for fidelity like the
others and timed only where the device has the hardware it ``needs``. A choice is one line here; a
new kind of hardware it ``needs`` is one line in :data:`.measure.HARDWARE` too.

Every FP8 choice sets all three of its axes (granularity, scaling, power-of-two scales), so each
is what its label says whatever the user's ``fp8.*`` keys were; the user's other keys (format,
layer choice, margin, history length) stay. No torch here: :mod:`.decide` reads the order.
"""

from __future__ import annotations

import dataclasses
import shlex
from dataclasses import dataclass
from typing import Any

from mptrain.config.base import ConfigError
from mptrain.config.format_table import MXFP8, NVFP4
from mptrain.config.precision import FP8Config, PrecisionConfig, validate_fp8
from mptrain.config.run import RunConfig

Override = tuple[str, Any]  # (dotted key, value): ("fp8.granularity", "rowwise")


@dataclass(frozen=True)
class Choice:
    """One candidate: ``name`` keys it in advise.json and the runners-up, ``label`` in the table,
    ``overrides`` are the keys it sets (``precision`` first), ``needs`` the hardware its speed
    needs (None: every device runs it natively where bench lists it)."""

    name: str
    label: str
    overrides: tuple[Override, ...]
    needs: str | None = None


def _fp8(granularity: str, scaling: str = "dynamic", pow2: bool = False) -> tuple[Override, ...]:
    return (
        ("precision", "fp8"),
        ("fp8.granularity", granularity),
        ("fp8.scaling", scaling),
        ("fp8.pow2_scales", pow2),
    )


BASE = (
    Choice("fp32", "fp32", (("precision", "fp32"),)),
    Choice("tf32", "tf32", (("precision", "fp32"), ("precision.allow_tf32", True))),
    Choice("bf16", "bf16", (("precision", "bf16"),)),
    Choice("fp16", "fp16", (("precision", "fp16"),)),
)
# In the order they are measured (a tight budget drops the last first) and of simplicity (a
# speed tie goes to the earlier): tensorwise first (mptrain's default), rowwise next (the recipe
# torchtitan kept when it removed tensorwise), then delayed scaling, then power-of-two scales.
LOW_PRECISION = (
    Choice("fp8", "fp8 tensorwise", _fp8("tensorwise"), needs="FP8 GEMMs"),
    Choice("fp8-rowwise", "fp8 rowwise", _fp8("rowwise"), needs="FP8 GEMMs"),
    Choice("fp8-delayed", "fp8 delayed", _fp8("tensorwise", "delayed"), needs="FP8 GEMMs"),
    Choice("fp8-pow2", "fp8 pow2 scales", _fp8("tensorwise", pow2=True), needs="FP8 GEMMs"),
    # the block-scaled formats (mptrain.precision.quant): blockwise FP8 (DeepSeek-V3), MXFP8, NVFP4
    Choice("fp8-blockwise", "fp8 blockwise", _fp8("blockwise"), needs="block-scaled GEMMs"),
    Choice(MXFP8, MXFP8, (("precision", MXFP8),), needs="block-scaled GEMMs"),
    Choice(NVFP4, NVFP4, (("precision", NVFP4),), needs="block-scaled GEMMs"),
)
CHOICES = {r.name: r for r in (*BASE, *LOW_PRECISION)}
# Ties go to the first: TF32 changes nothing in the loop, BF16 needs no loss scaler, FP16 needs
# one, FP8 adds scales on top of BF16 (and its choices more moving parts, in LOW_PRECISION's order).
SIMPLICITY = ("fp32", "tf32", "bf16", "fp16", *(r.name for r in LOW_PRECISION))


def choice(name: str) -> Choice:
    """The choice called ``name``; KeyError names the known ones."""
    if name not in CHOICES:
        raise KeyError(f"no advise choice {name!r}; known: {', '.join(CHOICES)}")
    return CHOICES[name]


def runs(name: str) -> str:
    """The precision choice ``name`` trains with (``fp8-rowwise``: ``fp8``); ``name`` itself when
    it is not a choice."""
    r = CHOICES.get(name)
    return dict(r.overrides)["precision"] if r else name


def apply(cfg: RunConfig, r: Choice) -> RunConfig:
    """``cfg`` with ``r``'s keys set. ``precision`` starts a fresh precision group (the user's loss
    scaler numbers kept, TF32 off unless the choice turns it on), as bench times it."""
    for key, value in r.overrides:
        if key == "precision":
            fresh = PrecisionConfig(name=value, scaler=dataclasses.replace(cfg.precision.scaler))
            cfg = dataclasses.replace(cfg, precision=fresh)
            continue
        group, field = key.split(".")
        changed = dataclasses.replace(getattr(cfg, group), **{field: value})
        cfg = dataclasses.replace(cfg, **{group: changed})
    return cfg


def refusal(cfg: RunConfig) -> str | None:
    """Why the user's other keys rule out a choice's config (in the config check's words), or
    None: e.g. ``fp8.backend=torchao`` runs dynamic scaling only."""
    try:
        validate_fp8(cfg.fp8)
    except ConfigError as exc:
        return str(exc)
    return None


_DEFAULTS = {"precision": PrecisionConfig(), "fp8": FP8Config()}


def command_overrides(r: Choice) -> list[str]:
    """The overrides that select ``r`` on a command line: ``precision=...`` and every other key
    whose value differs from its default (``fp8.granularity=rowwise``)."""
    out = []
    for key, value in r.overrides:
        if key != "precision":
            group, field = key.split(".")
            if getattr(_DEFAULTS[group], field) == value:
                continue
        out.append(f"{key}={str(value).lower() if isinstance(value, bool) else value}")
    return out


def command_for(overrides: list[str], name: str) -> str:
    """The command that trains with choice ``name``: its overrides, then the user's without what
    only advise reads (advise.*, bench.*, hydra.run.dir) and without the keys the choice sets
    (the user's own precision, ``fp8.granularity`` ...; a default the choice keeps is then the
    default again)."""
    r = choice(name)
    # apply() measured the choice with TF32 off unless the choice turns it on: the user's switch goes
    reset = ("precision.allow_tf32=",)
    own = (f"{key}=" for key, _ in r.overrides)
    dropped = ("advise.", "bench.", "hydra.run.dir=", *reset, *own)
    kept = [o for o in overrides if not o.lstrip("+~").startswith(dropped)]
    return " ".join(["mptrain", *command_overrides(r), *(shlex.quote(o) for o in kept)])


def add_commands(result: dict[str, Any], overrides: list[str]) -> None:
    """advise.json's rows and runners-up each with ``command``: the one that trains with it."""
    for row in (*result["precisions"], *result["recommendation"]["runners_up"]):
        row["command"] = command_for(overrides, row["precision"])
