"""advise's per-GEMM plan: which of a fragile layer's three GEMMs carry its error, and the plan
that keeps only those in BF16.

1. **Which GEMM, on the one batch** of :mod:`.sensitivity`, once whole layers are verified as
   the kept set (:mod:`.layers`) of at most :data:`GEMM_LAYERS` layers: with every converted
   layer in the format, each kept layer has each of its GEMMs (forward,
   input gradient, weight gradient) alone lifted to BF16 (:class:`HighPrecisionGemm` in its
   plan), then its two best together; each pass gives the model gradient's SQNR against FP32.
   The GEMM whose lift recovers most carries the layer's error; the layer's *lift* is the fewest
   GEMMs, best first, whose SQNR comes within :data:`LIFT_DB` of the whole layer's in high
   precision (its ``all_but`` pass), else all three.
2. **A verifying run** (:mod:`.layers`): a short run with only the kept layers' lifted GEMMs in BF16 (``precision.gemms.<gemm>=bf16
   precision.gemms.layers=[the kept layers]``; their other GEMMs stay in the format). Within the
   tolerance, it is the plan to train with, cheaper than keeping whole layers, and its command is
   given beside the whole-layer one, and with ``advise.target`` its predicted step
   (:func:`.predict.per_gemm_line`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import shlex
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from mptrain.commands.advise import choices, concise, predict
from mptrain.config.run import RunConfig
from mptrain.precision.quant.linear import GEMMS, HighPrecisionGemm

GEMM_LAYERS = 3  # the most kept layers whose GEMMs are measured one by one (4 passes each)
LIFT_DB = 1.0  # a lift within this of the whole layer's gradient SQNR recovers the layer
LIFTED_TO = "bf16"  # the lifted GEMMs' format (precision.gemms' name for HighPrecisionGemm)
WORDS = {"forward": "forward", "input_grad": "input gradient", "weight_grad": "weight gradient"}


@contextlib.contextmanager
def lifted(layer: torch.nn.Module, gemms: Sequence[str]) -> Iterator[None]:
    """``layer`` (a QuantizedLinear) with ``gemms`` computed in BF16, the others as before."""
    own = layer.plan
    layer.plan = dataclasses.replace(own, **dict.fromkeys(gemms, HighPrecisionGemm()))
    try:
        yield
    finally:
        layer.plan = own


def _reaches(db: float, target: float) -> bool:
    return db >= target - LIFT_DB if math.isfinite(target) else db == target


def measure_gemms(
    effect: Callable[[], dict[str, float]],
    low: dict[str, torch.nn.Module],
    plan: dict[str, Any],
    deadline: float,
) -> None:
    """Step 1 of the module doc: ``gemms`` in the rows of the kept layers (``plan["kept"]``).
    ``effect()``: the one-batch pass with every layer in the format; ``low``: the layers in it,
    by name; stops between layers once ``time.perf_counter()`` passes ``deadline`` (the layers
    not reached are listed in ``plan["skipped"]``)."""
    rows, names = {row["name"]: row for row in plan["layers"]}, plan["kept"]
    for i, name in enumerate(names):
        if time.perf_counter() > deadline:
            plan["skipped"]["gemms"] = f"the budget ran out after {i} of {len(names)} layers"
            return
        singles = {}
        for gemm in GEMMS:
            with lifted(low[name], [gemm]):
                singles[gemm] = effect()
        order = sorted(GEMMS, key=lambda g: -singles[g]["grad_sqnr_db"])
        with lifted(low[name], order[:2]):
            pair = effect()
        target = rows[name]["all_but"]["grad_sqnr_db"]
        if _reaches(singles[order[0]]["grad_sqnr_db"], target):
            lift = order[:1]
        elif _reaches(pair["grad_sqnr_db"], target):
            lift = order[:2]
        else:
            lift = list(GEMMS)
        rows[name]["gemms"] = {"lifted": singles, "pair": pair, "carrier": order[0], "lift": lift}


def lift_of(plan: dict[str, Any]) -> list[str] | str:
    """The GEMMs to lift in the kept layers (the union of their lifts, in GEMM order), or why no
    per-GEMM plan is worth a run."""
    kept = plan.get("kept") or []
    rows = {row["name"]: row for row in plan.get("layers", [])}
    unmeasured = [name for name in kept if "gemms" not in rows.get(name, {})]
    if not kept:
        return "no layer is kept"
    if unmeasured:
        return f"the GEMMs of {', '.join(unmeasured)} were not measured"
    lift = {gemm for name in kept for gemm in rows[name]["gemms"]["lift"]}
    if lift == set(GEMMS):
        return "each kept layer needs all three GEMMs in high precision"
    return [gemm for gemm in GEMMS if gemm in lift]


def refusal(cfg: RunConfig) -> str | None:
    """Why the choice cannot run a per-GEMM plan (mptrain.precision.gemm_plans), or None."""
    if cfg.precision.name == "fp8" and cfg.fp8.scaling == "delayed":
        return "fp8.scaling=delayed keeps one amax history per tensor across the three GEMMs"
    if cfg.precision.name == "fp8" and cfg.fp8.backend == "torchao":
        return "fp8.backend=torchao has one recipe for all three GEMMs"
    return None


def with_lift(cfg: RunConfig, kept: list[str], lift: list[str]) -> RunConfig:
    """``cfg`` with ``lift`` in BF16 for the ``kept`` layers (precision.gemms)."""
    gemms = dataclasses.replace(
        cfg.precision.gemms, **dict.fromkeys(lift, LIFTED_TO), layers=list(kept)
    )
    return dataclasses.replace(cfg, precision=dataclasses.replace(cfg.precision, gemms=gemms))


def overrides_of(kept: Sequence[str], lift: Sequence[str], quote: Callable[[str], str]) -> str:
    """``precision.gemms.weight_grad=bf16 'precision.gemms.layers=[fragile]'`` (``quote``: how a
    module name is written in a Hydra list, :func:`.plan.list_item`)."""
    layers = f"precision.gemms.layers=[{','.join(quote(n) for n in kept)}]"
    return " ".join([*(f"precision.gemms.{g}={LIFTED_TO}" for g in lift), shlex.quote(layers)])


def add_command(plan: dict[str, Any], overrides: list[str], quote: Callable[[str], str]) -> None:
    """``plan["gemm_plan"]["command"]`` once its run is within: the user's command with the
    plan's choice and the kept layers' lifted GEMMs in BF16."""
    found = plan.get("gemm_plan") or {}
    if not found.get("within"):
        return
    own = choices.command_for(overrides, plan["precision"])
    found["command"] = f"{own} {overrides_of(found['layers'], found['gemms'], quote)}"


# ------------------------------------------------------------------------------ the words
def carrier_lines(plan: dict[str, Any]) -> list[str]:
    """A line per kept layer whose GEMMs were measured:
    the GEMM that carries its error, with the figures. Layers not kept are left out: lifting a
    GEMM of a layer that carries little of the error moves nothing worth reading."""
    rows = {row["name"]: row for row in plan.get("layers", [])}
    lines = []
    for row in (rows[n] for n in plan.get("kept") or [] if "gemms" in rows.get(n, {})):
        found = row["gemms"]
        singles = ", ".join(
            f"{WORDS[g]} {concise.db(found['lifted'][g]['grad_sqnr_db'])}" for g in GEMMS
        )
        lift = " and ".join(WORDS[g] for g in found["lift"])
        lines += [
            f"- {row['name']}: its {lift} in BF16 recover the layer (its "
            f"{WORDS[found['carrier']]} carries most of the error)",
            f"  model-gradient SQNR with one of its GEMMs in BF16: {singles}; the whole layer "
            f"{concise.db(row['all_but']['grad_sqnr_db'])}; "
            f"none {concise.db(plan['all']['grad_sqnr_db'])}",
        ]
    return lines


def plan_lines(
    plan: dict[str, Any],
    gap_words: Callable[[dict[str, Any]], str],
    names: Callable[[list[str]], str],
) -> list[str]:
    """The per-GEMM plan's verdict and command (Markdown), after the whole-layer plan's
    (``names``: how a list of layers is written, cut on the console)."""
    found = plan.get("gemm_plan")
    if not found:
        return []
    if "skipped" in found:
        return [f"Per-GEMM plan: not run ({found['skipped']})."]
    gemms = " and ".join(WORDS[g] for g in found["gemms"])
    verdict = "verified" if found["within"] else "out of tolerance"
    lines = [
        f"**Or keep only the {gemms} of {names(found['layers'])} in BF16**, the rest in "
        f"{plan['label']}: {verdict}, {gap_words(found['run'])}"
    ]
    if predicted := predict.per_gemm_line(plan):
        lines += ["", predicted]
    if found.get("command"):
        lines += concise.command_lines(found["command"])
    return lines
