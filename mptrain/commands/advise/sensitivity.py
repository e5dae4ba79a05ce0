"""The per-layer plan's one-batch measurements (step 1 of :mod:`.layers`; no training): the
choice's own run is built again (the same seeded initial weights and first batch as every short
run, the layers its build converts, with their settings and seeds) and each converted layer gets
a plain ``nn.Linear`` twin sharing its Parameters (:class:`LayerSwitch`). One forward
and backward per configuration — under the choice's autocast, like its runs; the reference pass
in FP32 — gives the loss and the model's gradient, compared with FP32's: no layer in the format,
all of them, each alone, all but each, and then the ranking's prefixes kept in high precision.
With all of them in the format, each layer's own error is measured too: its output, input
gradient and weight gradient against FP32 from the very same input and output gradient.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Collection
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mptrain.commands.advise import gemms
from mptrain.commands.advise import plan as planning
from mptrain.commands.advise.trials import format_layers
from mptrain.config.run import RunConfig
from mptrain.models.task import logits_of
from mptrain.platform.dtypes import dtype_name
from mptrain.precision.formats import to_plain_linear
from mptrain.precision.policy import PrecisionPolicy, resolve_precision, to_model_input
from mptrain.train.build import prepare_run
from mptrain.train.components import Run


# ------------------------------------------------------------------------------ figures
def sqnr_db(reference: torch.Tensor, measured: torch.Tensor) -> float:
    """10·log10(‖reference‖² / ‖reference − measured‖²), in FP64: inf when they are equal; −inf
    when ``measured`` is not finite or ``reference`` is zero and they differ."""
    ref = reference.detach().double()
    noise = float((measured.detach().double() - ref).pow(2).sum())
    signal = float(ref.pow(2).sum())
    if not math.isfinite(noise) or (signal == 0 and noise > 0):
        return -math.inf
    if noise == 0:
        return math.inf
    return 10.0 * math.log10(signal / noise)


def rel_diff(loss: float, reference: float) -> float:
    """|loss − reference| / |reference| (inf for a non-finite loss), as advise's fidelity."""
    if not math.isfinite(loss):
        return math.inf
    return abs(loss - reference) / max(abs(reference), 1e-12)


# ------------------------------------------------------------------------------ one batch
class LayerSwitch:
    """``model``'s layers in a low-precision format (:func:`.trials.format_layers`), each with a
    plain ``nn.Linear`` twin holding the same Parameter objects (:func:`to_plain_linear`);
    :meth:`use` puts exactly the given layers in the format and every other one back in high
    precision. ``names``: the converted layers, in the model's order."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.low = format_layers(model)
        to_plain_linear(model)
        self.plain = {name: model.get_submodule(name) for name in self.low}
        self.names = list(self.low)

    def use(self, names: Collection[str]) -> None:
        for name, plain in self.plain.items():
            self.model.set_submodule(name, self.low[name] if name in names else plain)

    def reseed(self) -> None:
        """Every layer's own random draws (NVFP4's stochastic rounding) from their seeds again:
        each pass draws the same numbers, so passes differ only in which layers are low."""
        for layer in self.low.values():
            generator = getattr(layer, "generator", None)
            if generator is not None:
                generator.manual_seed(layer.seed)


class OneBatch:
    """Forward and backward passes of one training batch on the run's initial weights, each
    reseeded (the same dropout masks and format draws), compared with FP32's pass (taken at
    construction under ``reference``, no layer in the format). Gradients are cleared before each
    pass; nothing is updated."""

    def __init__(self, run: Run, reference: PrecisionPolicy, switch: LayerSwitch) -> None:
        self.run, self.policy, self.switch = run, run.precision.policy, switch
        inputs, self.targets = next(iter(run.data.train.batches(0)))
        self.inputs = to_model_input(inputs, reference, run.cfg.channels_last)
        self.params = [p for p in run.model.parameters() if p.requires_grad]
        switch.use(())
        self.ref_loss, self.ref_grads = self._pass(reference)

    def _pass(self, policy: PrecisionPolicy) -> tuple[float, torch.Tensor]:
        model = self.run.model
        model.zero_grad(set_to_none=True)
        device = self.run.device
        self.switch.reseed()
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(self.run.cfg.seed)
            with policy.autocast():
                loss = self.run.loss_fn(logits_of(model(self.inputs)), self.targets)
            loss.backward()
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = torch.cat([g.detach().float().flatten() for g in grads])
        model.zero_grad(set_to_none=True)
        return float(loss.detach()), flat

    def effect(self, low_names: Collection[str]) -> dict[str, float]:
        """The loss's relative difference and the model gradient's SQNR (dB) against FP32 with
        exactly ``low_names`` in the format and the rest under the choice's autocast."""
        self.switch.use(low_names)
        loss, grads = self._pass(self.policy)
        return {
            "loss_rel": rel_diff(loss, self.ref_loss),
            "grad_sqnr_db": sqnr_db(self.ref_grads, grads),
        }


def _capture(
    store: dict[str, list[torch.Tensor]],
    name: str,
    module: nn.Module,
    args: tuple,
    out: torch.Tensor,
) -> None:
    """Forward hook: keep the layer's input, and its output gradient once the backward has it."""
    store[name] = [args[0].detach()]
    if out.requires_grad:
        out.register_hook(lambda grad: store[name].append(grad.detach()))


def _local(
    layer: nn.Linear, x: torch.Tensor, grad_out: torch.Tensor | None, policy: PrecisionPolicy
) -> dict[str, float | None]:
    """The layer's own error in its format from input ``x`` and output gradient ``grad_out``: the
    SQNR of its output, input gradient and weight gradient against the same computed in FP32
    (both through the weight's own hooks, if any); a gradient is None when there is none (no
    ``grad_out``, a frozen weight)."""
    wanted = [layer.weight] if layer.weight.requires_grad else []
    xl, xr = x.clone().requires_grad_(True), x.float().requires_grad_(True)
    with policy.autocast():
        yl = layer(xl)
    with torch.autocast(x.device.type, enabled=False):
        yr = F.linear(xr, layer.weight, layer.bias)
    figures: dict[str, float | None] = {
        "output_sqnr_db": sqnr_db(yr, yl),
        "input_grad_sqnr_db": None,
        "weight_grad_sqnr_db": None,
    }
    if grad_out is not None:
        gradsl = torch.autograd.grad(yl, [xl, *wanted], grad_out)
        gradsr = torch.autograd.grad(yr, [xr, *wanted], grad_out.float())
        figures["input_grad_sqnr_db"] = sqnr_db(gradsr[0], gradsl[0])
        if wanted:
            figures["weight_grad_sqnr_db"] = sqnr_db(gradsr[1], gradsl[1])
    return figures


def all_low(one: OneBatch) -> tuple[dict[str, float], dict[str, dict]]:
    """The pass with every converted layer in the format, and each layer's own error in it
    (:func:`_local`, the format's draws reseeded first)."""
    store: dict[str, list[torch.Tensor]] = {}
    switch = one.switch
    hooks = [
        switch.low[n].register_forward_hook(functools.partial(_capture, store, n))
        for n in switch.names
    ]
    try:
        effect = one.effect(switch.names)
    finally:
        for hook in hooks:
            hook.remove()
    local = {}
    for name in switch.names:
        x, *grad = store[name]  # no output gradient when nothing upstream or in it trains
        switch.reseed()
        local[name] = _local(switch.low[name], x, grad[0] if grad else None, one.policy)
    return effect, local


def choice_words(policy: PrecisionPolicy) -> str:
    """The choice the plan measured, for people: FP8's scaling and dtypes, or a block format's
    element and scale formats and block shapes per operand; and whether its GEMMs are real."""
    if policy.blocks is not None:
        b = policy.blocks.describe()
        ops = ", ".join(
            f"{role} {op['element']} in {op['block']} blocks with {op['scale']} scales"
            for role, op in b["operands"].items()
        )
        gemm = "scaled_mm" if policy.blocks.real_gemm else "emulated GEMMs"
        return f"{policy.blocks.row.label}: {ops}; {gemm}"
    r = policy.fp8
    gemm = "torch._scaled_mm" if r.real_gemm else "emulated GEMMs"
    return (
        f"FP8 {r.granularity} {r.scaling} scaling{', power-of-two scales' if r.pow2_scales else ''}"
        f", {dtype_name(r.forward_dtype)} forward, {dtype_name(r.backward_dtype)} gradients, the "
        f"built-in FP8 layers; {gemm}"
    )


def sensitivity_config(cfg: RunConfig) -> RunConfig:
    """The choice's run as the one-batch passes build it: not compiled (layers are swapped
    between passes), FP8 on mptrain's built-in layers whatever ``fp8.backend`` (the same
    numerics; torchao's layers do not switch back)."""
    return dataclasses.replace(
        cfg, compile=False, fp8=dataclasses.replace(cfg.fp8, backend="builtin")
    )


def measure_sensitivity(
    fp32_cfg: RunConfig, low_cfg: RunConfig, plan: dict[str, Any], deadline: float
) -> None:
    """Step 1 of the module doc into ``plan``: ``none``, ``all``, one row per converted layer
    (its own errors, ``alone``, ``all_but``, its ``share`` and ``rank``), ``ranking``, and
    ``prefixes`` (k = 0..n: the ranking's first k kept in high precision). Stops between layers
    at ``deadline`` (``skipped`` says after how many). ``low_cfg``: the choice's run config."""
    run, one = one_batch(fp32_cfg, low_cfg)
    switch = one.switch
    names = switch.names
    if not names:  # the choice's own build refused the model first; said for any other way here
        plan["skipped"]["all"] = f"no Linear layer of the model runs in {low_cfg.precision.name}"
        return
    plan["autocast"] = dtype_name(run.precision.policy.autocast_dtype)
    plan["choice"] = choice_words(run.precision.policy)
    one.effect(names)  # a warm-up: delayed scaling takes its scales from earlier amaxes
    plan["none"] = one.effect(())
    plan["all"], local = all_low(one)
    plan["layers"] = []
    for i, name in enumerate(names):
        if time.perf_counter() > deadline:
            plan["skipped"]["sensitivity"] = f"the budget ran out after {i} of {len(names)} layers"
            return
        layer = switch.low[name]
        plan["layers"].append(
            {
                "name": name,
                "shape": [layer.in_features, layer.out_features],
                **local[name],
                "alone": one.effect({name}),
                "all_but": one.effect(set(names) - {name}),
            }
        )
    rank_layers(plan)
    ranking = plan["ranking"]
    # k = 1 is the top layer's all-but pass, already measured; k = n is the no-format pass.
    top = next(row for row in plan["layers"] if row["name"] == ranking[0])
    middle = [one.effect(set(names) - set(ranking[:k])) for k in range(2, len(names))]
    plan["prefixes"] = [
        plan["all"],
        *([top["all_but"]] if len(names) > 1 else []),
        *middle,
        plan["none"],
    ]


def one_batch(fp32_cfg: RunConfig, low_cfg: RunConfig) -> tuple[Run, OneBatch]:
    """The choice's run built for the one-batch passes, and its passes against FP32's."""
    run = prepare_run(sensitivity_config(low_cfg))
    switch = LayerSwitch(run.model)
    return run, OneBatch(run, resolve_precision(fp32_cfg.precision, run.device), switch)


def measure_gemm_sensitivity(
    fp32_cfg: RunConfig, low_cfg: RunConfig, plan: dict[str, Any], deadline: float
) -> None:
    """:func:`.gemms.measure_gemms` for ``plan``'s kept layers, on the same one
    batch as :func:`measure_sensitivity` (built again: the same seeded weights and draws)."""
    _, one = one_batch(fp32_cfg, low_cfg)
    names = one.switch.names
    one.effect(names)  # the warm-up, as measure_sensitivity's
    gemms.measure_gemms(lambda: one.effect(names), one.switch.low, plan, deadline)


def rank_layers(plan: dict[str, Any]) -> None:
    """``plan["ranking"]`` and each row's ``rank`` and ``share`` (:mod:`.plan`)."""
    none_db, all_db = plan["none"]["grad_sqnr_db"], plan["all"]["grad_sqnr_db"]
    ranking = planning.rank(plan["layers"], none_db, all_db)
    for row in plan["layers"]:
        row["rank"] = ranking.index(row["name"]) + 1
        row["share"] = planning.share(row, none_db, all_db)
    plan["ranking"] = ranking
