"""The FP8 per-layer plan's measurements (``advise.plan``), within ``advise.budget_s``.

1. **Sensitivity, on one batch** (no training): FP32's run is built again (the same seeded
   initial weights and first batch as every short run) and each eligible Linear gets an FP8 twin
   sharing its parameters (:class:`FP8Switch`), with the recipe precision=fp8 would use. One
   forward and backward per configuration — under precision=fp8's autocast, like its runs; the
   reference pass in FP32 — gives the loss and the model's gradient, compared with FP32's: no
   layer in FP8, all of them, each alone, all but each, and then the ranking's prefixes kept in
   high precision. With all of them in FP8, each layer's own error is measured too: its output,
   input gradient and weight gradient against FP32 from the very same input and output gradient.
2. **Ranking and the plan**: :mod:`.plan`.
3. **Verifying runs**: when FP8's all-layers short run (advise's fidelity run) is not within the
   allowed difference to FP32's loss, a short run of the same length with the planned layers in
   ``fp8.exclude`` (appended to the user's patterns); while one misses, the next ranked layer is
   added and run again, as long as the budget lasts.

Everything goes into one dict (:func:`new_plan`), filled part by part so an interrupt keeps what
was measured; ``skipped`` names each part not measured and why.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable, Collection
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mptrain.commands.advise import decide as advice
from mptrain.commands.advise import plan as planning
from mptrain.commands.advise.measure import Candidate, latest_cost, speed_need
from mptrain.commands.advise.seeds import speed_budget
from mptrain.commands.advise.trials import PILOT_WARMUP, Budget, short_run, timed_part
from mptrain.config.commands import AdviseConfig
from mptrain.config.run import RunConfig
from mptrain.models.task import logits_of
from mptrain.platform.dtypes import dtype_name
from mptrain.precision.fp8.convert import LayerChoice, choose_layers
from mptrain.precision.fp8.linear import Float8Linear
from mptrain.precision.fp8.quant import FP8Recipe
from mptrain.precision.policy import PrecisionPolicy, resolve_precision, to_model_input
from mptrain.train.build import prepare_run
from mptrain.train.components import Run

SENSITIVITY = "layer plan: sensitivity"  # timings' part names
VERIFY = "layer plan: verifying run"


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
class FP8Switch:
    """``model``'s eligible Linear layers (``names``), each with an FP8 twin
    (:meth:`Float8Linear.from_linear`: the same Parameter objects); :meth:`use` puts exactly the
    given layers in FP8 and every other one back in high precision."""

    def __init__(self, model: nn.Module, names: list[str], recipe: FP8Recipe) -> None:
        self.model = model
        self.plain = {name: model.get_submodule(name) for name in names}
        self.fp8 = {name: Float8Linear.from_linear(m, recipe) for name, m in self.plain.items()}

    def use(self, names: Collection[str]) -> None:
        for name, plain in self.plain.items():
            self.model.set_submodule(name, self.fp8[name] if name in names else plain)


class OneBatch:
    """Forward and backward passes of one training batch on the run's initial weights, each
    reseeded (the same dropout masks), compared with FP32's pass (taken at construction, no layer
    in FP8). Gradients are cleared before each pass; nothing is updated."""

    def __init__(self, run: Run, fp8_policy: PrecisionPolicy, switch: FP8Switch) -> None:
        self.run, self.fp8_policy, self.switch = run, fp8_policy, switch
        inputs, self.targets = next(iter(run.data.train.batches(0)))
        self.inputs = to_model_input(inputs, run.policy, run.cfg.channels_last)
        self.params = [p for p in run.model.parameters() if p.requires_grad]
        switch.use(())
        self.ref_loss, self.ref_grads = self._pass(run.policy)

    def _pass(self, policy: PrecisionPolicy) -> tuple[float, torch.Tensor]:
        model = self.run.model
        model.zero_grad(set_to_none=True)
        device = self.run.device
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(self.run.cfg.seed)
            with policy.autocast():
                loss = self.run.loss_fn(logits_of(model(self.inputs)), self.targets)
            loss.backward()
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = torch.cat([g.detach().float().flatten() for g in grads])
        model.zero_grad(set_to_none=True)
        return float(loss.detach()), flat

    def effect(self, fp8_names: Collection[str]) -> dict[str, float]:
        """The loss's relative difference and the model gradient's SQNR (dB) against FP32 with
        exactly ``fp8_names`` in FP8 and the rest under precision=fp8's autocast."""
        self.switch.use(fp8_names)
        loss, grads = self._pass(self.fp8_policy)
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
    layer: Float8Linear, x: torch.Tensor, grad_out: torch.Tensor | None, policy: PrecisionPolicy
) -> dict[str, float | None]:
    """The layer's own FP8 error from input ``x`` and output gradient ``grad_out``: the SQNR of
    its output, input gradient and weight gradient against the same computed in FP32 (both through
    the weight's own hooks, if any); a gradient is None when there is none (no ``grad_out``, a
    frozen weight)."""
    wanted = [layer.weight] if layer.weight.requires_grad else []
    x8, xr = x.clone().requires_grad_(True), x.float().requires_grad_(True)
    with policy.autocast():
        y8 = layer(x8)
    with torch.autocast(x.device.type, enabled=False):
        yr = F.linear(xr, layer.weight, layer.bias)
    figures: dict[str, float | None] = {
        "output_sqnr_db": sqnr_db(yr, y8),
        "input_grad_sqnr_db": None,
        "weight_grad_sqnr_db": None,
    }
    if grad_out is not None:
        grads8 = torch.autograd.grad(y8, [x8, *wanted], grad_out)
        gradsr = torch.autograd.grad(yr, [xr, *wanted], grad_out.float())
        figures["input_grad_sqnr_db"] = sqnr_db(gradsr[0], grads8[0])
        if wanted:
            figures["weight_grad_sqnr_db"] = sqnr_db(gradsr[1], grads8[1])
    return figures


def all_in_fp8(one: OneBatch, names: list[str]) -> tuple[dict[str, float], dict[str, dict]]:
    """The pass with every eligible layer in FP8, and each layer's own error in it (:func:`_local`)."""
    store: dict[str, list[torch.Tensor]] = {}
    twins = one.switch.fp8
    hooks = [twins[n].register_forward_hook(functools.partial(_capture, store, n)) for n in names]
    try:
        effect = one.effect(names)
    finally:
        for hook in hooks:
            hook.remove()
    local = {}
    for name in names:
        x, *grad = store[name]  # no output gradient when nothing upstream or in it trains
        local[name] = _local(twins[name], x, grad[0] if grad else None, one.fp8_policy)
    return effect, local


def eligible(run: Run, cfg: RunConfig, recipe: FP8Recipe) -> list[LayerChoice]:
    """The Linear layers precision=fp8 would convert in ``run``'s model (its LayerChoices)."""
    f = cfg.fp8
    choices = choose_layers(
        run.model, list(f.include), list(f.exclude), f.keep_first_last, recipe.min_features
    )
    return [c for c in choices if c.converted]


def measure_sensitivity(
    fp32_cfg: RunConfig, fp8_cfg: RunConfig, plan: dict[str, Any], deadline: float
) -> None:
    """Step 1 of the module doc into ``plan``: ``none``, ``all``, one row per eligible layer
    (its own errors, ``alone``, ``all_but``, its ``share`` and ``rank``), ``ranking``, and
    ``prefixes`` (k = 0..n: the ranking's first k kept in high precision). Stops between layers
    at ``deadline`` (``skipped`` says after how many)."""
    run = prepare_run(dataclasses.replace(fp32_cfg, compile=False))
    policy = resolve_precision(fp8_cfg.precision, run.device, fp8_cfg.fp8)
    layers = eligible(run, fp8_cfg, policy.fp8)
    if not layers:  # FP8's own build refused the model first; said for any other way here
        plan["skipped"]["all"] = "no Linear layer of the model can run in FP8"
        return
    names = [c.name for c in layers]
    recipe = policy.fp8
    plan["autocast"] = dtype_name(policy.autocast_dtype)
    plan["recipe"] = (
        f"{recipe.granularity} {recipe.scaling} scaling, {dtype_name(recipe.forward_dtype)} "
        f"forward, {dtype_name(recipe.backward_dtype)} gradients, the built-in FP8 layers"
    )
    one = OneBatch(run, policy, FP8Switch(run.model, names, recipe))
    one.effect(names)  # a warm-up: delayed scaling takes its scales from earlier amaxes
    plan["none"] = one.effect(())
    plan["all"], local = all_in_fp8(one, names)
    plan["layers"] = []
    for i, c in enumerate(layers):
        if time.perf_counter() > deadline:
            plan["skipped"]["sensitivity"] = f"the budget ran out after {i} of {len(layers)} layers"
            return
        plan["layers"].append(
            {
                "name": c.name,
                "shape": [c.in_features, c.out_features],
                **local[c.name],
                "alone": one.effect({c.name}),
                "all_but": one.effect(set(names) - {c.name}),
            }
        )
    none_db, all_db = plan["none"]["grad_sqnr_db"], plan["all"]["grad_sqnr_db"]
    ranking = planning.rank(plan["layers"], none_db, all_db)
    for row in plan["layers"]:
        row["rank"] = ranking.index(row["name"]) + 1
        row["share"] = planning.share(row, none_db, all_db)
    plan["ranking"] = ranking
    # k = 1 is the top layer's all-but pass, already measured; k = n is the no-FP8 pass.
    top = next(row for row in plan["layers"] if row["name"] == ranking[0])
    middle = [one.effect(set(names) - set(ranking[:k])) for k in range(2, len(names))]
    plan["prefixes"] = [
        plan["all"],
        *([top["all_but"]] if len(names) > 1 else []),
        *middle,
        plan["none"],
    ]


# ------------------------------------------------------------------------------ within the budget
def new_plan() -> dict[str, Any]:
    """What :func:`run_plan` fills: nothing measured yet (``skipped``: part -> why;
    ``runs``: the verifying runs in order)."""
    return {"skipped": {}, "runs": []}


def _not_plannable(fp32: Candidate, fp8: Candidate | None, settings: AdviseConfig) -> str | None:
    """Why no per-layer plan can be measured, or None."""
    if not settings.plan:
        return "advise.plan=false"
    if fp8 is None:
        return "FP8 is not a candidate here"
    if fp8.pilot is None:
        return f"FP8 not measured: {fp8.skipped.get('all', 'no pilot')}"
    if fp32.fidelity is None:
        return "no FP32 reference run to compare with"
    return None


def _left_s(cands: list[Candidate], settings: AdviseConfig, budget: Budget) -> float:
    """What the budget leaves once the admitted precisions' speed measurements and the seeds'
    reserve are set aside."""
    admitted = [c for c in cands if c.timed and c.fidelity is not None and not c.skipped]
    speed = speed_budget(cands, settings, budget)
    return speed.left_s() - speed_need(admitted, settings, settings.speed_steps)


def run_plan(
    cands: list[Candidate],
    settings: AdviseConfig,
    budget: Budget,
    timings: dict[str, Any],
    plan: dict[str, Any],
) -> None:
    """The module doc's steps into ``plan`` (:func:`new_plan`), each only when its estimate
    (from FP8's and FP32's measured runs) fits what is left, else skipped with it."""
    fp32, fp8 = cands[0], next((c for c in cands if c.name == planning.PLANNED), None)
    why = _not_plannable(fp32, fp8, settings)
    if why is not None:
        plan["skipped"]["all"] = why
        return
    count = sum(layer["converted"] for layer in fp8.pilot.fp8["layers"])
    passes = 3 * count + 4  # reference, warm-up, none, all; alone, all but, prefixes per layer
    need = latest_cost(fp32).overhead_s + passes * latest_cost(fp8).step_s
    if need > _left_s(cands, settings, budget):
        plan["skipped"]["all"] = (
            f"estimated {need:.0f} s ({passes} passes of one batch), "
            f"{max(_left_s(cands, settings, budget), 0):.0f} s of advise.budget_s left"
        )
        return
    with timed_part(timings, SENSITIVITY):
        measure_sensitivity(fp32.cfg, fp8.cfg, plan, budget.deadline())
    if "ranking" in plan:
        plan["exclude_base"] = list(fp8.cfg.fp8.exclude)
        verify(plan, fp32, fp8, lambda: _left_s(cands, settings, budget), budget, timings)


def with_kept(cfg: RunConfig, kept: list[str]) -> RunConfig:
    """``cfg`` with ``kept`` appended to its fp8.exclude patterns."""
    return dataclasses.replace(
        cfg, fp8=dataclasses.replace(cfg.fp8, exclude=[*cfg.fp8.exclude, *kept])
    )


def _all_layers(plan: dict[str, Any], fp32: Candidate, fp8: Candidate) -> float | None:
    """Record FP8's all-layers fidelity run in ``plan`` and return its loss gap (inf when it
    stopped); None, with why, when it was not measured."""
    fidelity = fp8.fidelity_against(fp32.fidelity)
    if fidelity is None:
        why = fp8.skipped.get("fidelity and speed", "no run")
        plan["skipped"]["kept set"] = f"FP8's all-layers run was not measured ({why})"
        return None
    f = dataclasses.asdict(fidelity)
    plan["all_layers"] = {**f, "within": planning.within(f, plan["allowed"])}
    return f["max_rel_diff"] if f["diverged"] is None else math.inf


def verify(
    plan: dict[str, Any],
    fp32: Candidate,
    fp8: Candidate,
    left_s: Callable[[], float],
    budget: Budget,
    timings: dict[str, Any],
) -> None:
    """Step 3 of the module doc: ``kept`` (the layers to keep; [] when the all-layers run is
    within) and ``runs``, or ``skipped`` with why no set was verified. ``left_s()``: seconds
    the plan may still spend."""
    settings = fp8.cfg.advise
    ctx = advice.Context(tolerance=settings.tolerance, fp32_spread=fp32.nudge_spread)
    plan["allowed"] = advice.allowed_difference(ctx)
    gap_all = _all_layers(plan, fp32, fp8)
    if gap_all is None:
        return
    dbs = [p["grad_sqnr_db"] for p in plan["prefixes"]]
    plan["predicted"] = planning.predicted_gaps(dbs, gap_all)
    keep, n = planning.first_keep(gap_all, plan["allowed"], plan["predicted"]), len(plan["ranking"])
    if keep == 0:
        plan["kept"] = []
        return
    verified: dict[int, bool] = {}
    while keep is not None and keep < n:
        run = verifying_run(plan["ranking"][:keep], fp32, fp8, left_s, budget, timings)
        if isinstance(run, str):
            plan["skipped"]["verifying run"] = run
            break
        run["within"] = planning.within(run, plan["allowed"])
        plan["runs"].append(run)
        verified[keep] = run["within"]
        keep = planning.next_keep(verified, n)
    if any(verified.values()):
        plan["kept"] = plan["ranking"][: min(k for k, ok in verified.items() if ok)]
    elif "verifying run" not in plan["skipped"]:
        short_of = "the only eligible layer" if n == 1 else f"all {n} eligible layers"
        plan["skipped"]["kept set"] = (
            f"no set short of {short_of} brings FP8's loss within {plan['allowed']:.1%} of "
            "FP32's: FP8 does not fit this model"
        )


def verifying_run(
    kept: list[str],
    fp32: Candidate,
    fp8: Candidate,
    left_s: Callable[[], float],
    budget: Budget,
    timings: dict[str, Any],
) -> dict[str, Any] | str:
    """FP8's short run with ``kept`` in high precision against FP32's (its fidelity figures and
    losses), or why it did not run or finish."""
    steps = fp8.cfg.advise.fidelity_steps
    need = latest_cost(fp8).of(steps)
    if need > left_s():
        return (
            f"keeping {len(kept)} layer{'s' if len(kept) > 1 else ''}: estimated {need:.0f} s, "
            f"{max(left_s(), 0):.0f} s of advise.budget_s left"
        )
    with timed_part(timings, f"{VERIFY}, {len(kept)} kept"):
        trial = short_run(with_kept(fp8.cfg, kept), steps, PILOT_WARMUP, budget.deadline())
    if trial.cut_short:
        return f"the budget ran out after {trial.steps} of {steps} steps"
    f = advice.fidelity_of(trial.losses, fp32.fidelity.losses, trial.skipped_steps, trial.diverged)
    return {"kept": kept, **dataclasses.asdict(f), "losses": trial.losses}


def note_not_reached(plan: dict[str, Any], why: str) -> None:
    """After an interrupt: the part of ``plan`` not finished is listed as not measured (``why``)."""
    if "kept" in plan or plan["skipped"]:
        return  # finished, or already said why not
    plan["skipped"]["verifying run" if "ranking" in plan else "all"] = why
