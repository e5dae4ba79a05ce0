"""advise's predicted speed on a named GPU (``advise.target``), beside what it measured.

Each candidate's step (and TF32's, which a GPU would add) is predicted on the GPU
``advise.target`` names (any name of :mod:`mptrain.perf.gpus`; ``auto``: the GPU advise runs on,
none on a CPU) from the model's GEMM shapes and memory traffic (:mod:`mptrain.perf.roofline`: a
lower bound of the step's time); a format the GPU has no kernel for gets no prediction: it would
be emulated there. It is labelled *predicted* wherever it is shown. When advise runs on the
target GPU, each measured row gets the prediction's error and its MFU (:func:`compare`). With
``advise.plan``, the per-layer plan's configs (:func:`.layers.plan_configs`) are predicted too,
into the plan's ``predicted_speed``, which its evidence says (:func:`kept_line`,
:func:`per_gemm_line`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from mptrain.config.base import ConfigError
from mptrain.perf import gpus

if TYPE_CHECKING:
    import torch

    from mptrain.commands.advise.measure import Candidate
    from mptrain.config.run import RunConfig
    from mptrain.perf.roofline import Prediction

BASIS = (
    "roofline at best: each GEMM pass max(FLOPs / the format's dense peak, bytes / bandwidth), "
    "plus casts, the other operations and the optimizer step at the bandwidth; no efficiency "
    "factor, so a measured step is slower"
)


def device_name(device: torch.device) -> str | None:
    """The CUDA device's name (``NVIDIA H100 80GB HBM3``); None on a CPU."""
    import torch

    return torch.cuda.get_device_name(device) if device.type == "cuda" else None


def target_gpu(cfg: RunConfig, device: torch.device) -> tuple[gpus.GPU | None, str]:
    """(the GPU advise predicts for, or None; the line that says which and why). The name was
    checked with the config (:data:`mptrain.config.commands.TARGETS`)."""
    return gpus.resolve_target(cfg.advise.target, device_name(device))


def on_gpu(gpu: gpus.GPU | None, device: torch.device) -> bool:
    """Whether this process runs on the GPU the peak-table row ``gpu`` stands for."""
    here = device_name(device)
    return gpu is not None and here is not None and gpus.row_for_device_name(here) == gpu


PLAN = "plan: "  # the plan's configs among the candidates' in one prediction


def predict(
    cfg: RunConfig,
    device: torch.device,
    candidates: list[Candidate],
    plan: dict[str, Any] | None = None,
    planned: Mapping[str, RunConfig] | None = None,
) -> dict[str, Any]:
    """advise.json's ``prediction``: the target, the GPU's row and its source, and per candidate
    (and TF32, which a GPU would add) the predicted step or why there is none. A model the
    predictor cannot account is said, not hidden (``error``). The per-layer ``plan``'s configs
    (``planned``: :func:`.layers.plan_configs`), predicted, go into
    ``plan["predicted_speed"]`` (:func:`plan_speed`)."""
    gpu, note = target_gpu(cfg, device)
    out: dict[str, Any] = {"target": cfg.advise.target, "note": note, "gpu": None, "rows": {}}
    if gpu is None:
        return out
    out["gpu"] = {"key": gpu.key, "name": gpu.name, "source": gpu.source}
    out["same_device"] = on_gpu(gpu, device)
    out["basis"] = BASIS
    from mptrain.commands.advise import choices
    from mptrain.perf.speed import data_shape, predict_configs

    # a candidate skipped here (BF16 on a CPU without native BF16) keeps the user's config: its
    # choice applied, it is predicted for the GPU all the same
    configs = {c.name: choices.apply(c.cfg, c.choice) if c.choice else c.cfg for c in candidates}
    configs.setdefault("tf32", choices.apply(cfg, choices.choice("tf32")))
    planned = planned if plan is not None and planned else {}
    try:
        found = predict_configs(
            {**configs, **{PLAN + k: v for k, v in planned.items()}}, data_shape(cfg), gpu
        )
    except (ConfigError, RuntimeError, TypeError, ValueError, NotImplementedError) as exc:
        out["error"] = f"the model could not be accounted on the meta device: {exc}"
        return out
    out["rows"] = {name: _row(p) for name, p in found.items() if name in configs}
    _add_ratios(out["rows"])
    if planned:
        rows = {k: _row(found[PLAN + k]) for k in planned}
        plan["predicted_speed"] = plan_speed(gpu, out["rows"], plan["precision"], rows)
    return out


def _row(p: Prediction | str) -> dict[str, Any]:
    """A prediction as advise.json holds it, or why there is none."""
    if isinstance(p, str):
        return {"none": p}
    return {**dataclasses.asdict(p), "launch_bound": p.launch_bound}


def plan_speed(
    gpu: gpus.GPU, rows: dict[str, dict[str, Any]], precision: str, plans: dict[str, Any]
) -> dict[str, Any]:
    """The plan's ``predicted_speed``: on ``gpu``, the choice's all-layers row (``precision``'s of
    the candidates' ``rows``) and the plan's configs' (``plans``), each step's time, speed-up on
    BF16's predicted step and step time relative to the all-layers one (or why none)."""
    every = rows.get(precision, {"none": "not predicted"})
    bf16 = rows.get("bf16", {}).get("step_time_s")
    out: dict[str, Any] = {}
    for key, row in {"all_layers": every, **plans}.items():
        if "step_time_s" not in row:
            out[key] = {"none": row["none"]}
            continue
        step = row["step_time_s"]
        out[key] = {
            "step_time_s": step,
            "samples_per_s": row["samples_per_s"],
            "tokens_per_s": row["tokens_per_s"],
            "vs_bf16": bf16 / step if bf16 else None,
            "vs_all_layers": step / every["step_time_s"] if "step_time_s" in every else None,
            "launch_bound": row["launch_bound"],
            "flops_by_format": row["flops_by_format"],
        }
    return {"gpu": gpu.key, "basis": "roofline, at best", "rows": out}


def predict_samples_per_s(cfg: RunConfig) -> float:
    """The roofline's samples/s for ``cfg`` as configured (its precision and FP8 scaling) on the
    GPU this process runs on: ``benchmarks/gpu_speed.py``'s predictor hook. ValueError with the
    reason when there is none (a CPU, a GPU the table lacks, a format it lacks)."""
    import torch

    from mptrain.perf.speed import data_shape, predict_configs

    here = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    gpu, why = gpus.resolve_target(gpus.AUTO, here)
    if gpu is None:
        raise ValueError(why)
    found = predict_configs({"cfg": cfg}, data_shape(cfg), gpu)["cfg"]
    if isinstance(found, str):
        raise ValueError(found)
    return found.samples_per_s


def _add_ratios(rows: dict[str, dict[str, Any]]) -> None:
    """Each predicted row's speed-up over the predicted FP32 and BF16 steps."""
    for reference in ("fp32", "bf16"):
        base = rows.get(reference, {}).get("step_time_s")
        for row in rows.values():
            if base and "step_time_s" in row:
                row[f"vs_{reference}"] = base / row["step_time_s"]


def compare(prediction: dict[str, Any] | None, rows: list[dict[str, Any]]) -> None:
    """On the target GPU itself, give each predicted row the measured speed beside it: the
    prediction's error and the measured MFU against the FLOP-weighted peak (in place)."""
    if not prediction or not prediction.get("same_device"):
        return
    for row in rows:
        predicted = prediction["rows"].get(row["precision"], {})
        speed = row["speed"]
        if "samples_per_s" not in predicted or not speed or row["emulated"]:
            continue
        measured = speed["samples_per_s"]
        per_sample = predicted["model_flops"] / predicted["batch"]
        predicted["measured_samples_per_s"] = measured
        predicted["error"] = (predicted["samples_per_s"] - measured) / measured
        predicted["measured_mfu"] = measured * per_sample / (predicted["mixed_peak_tflops"] * 1e12)


# ------------------------------------------------------------------------------ the table
def headers(prediction: dict[str, Any] | None) -> list[str]:
    """The evidence table's extra columns: the prediction, and (on that GPU) its error."""
    if not prediction or not prediction.get("rows"):
        return []
    columns = [f"predicted on {prediction['gpu']['key']} (roofline, at best)"]
    if prediction.get("same_device"):
        columns.append("measured vs predicted")
    return columns


def cells(prediction: dict[str, Any] | None, precision: str, lm: bool) -> list[str]:
    """The extra columns' cells of ``precision``'s row (see :func:`headers`)."""
    columns = headers(prediction)
    if not columns:
        return []
    row = prediction["rows"].get(precision)
    if row is None:
        return [""] * len(columns)
    if "none" in row:
        return [f"n/a: {row['none']}"] + [""] * (len(columns) - 1)
    rate = row["tokens_per_s"] if lm and row["tokens_per_s"] else row["samples_per_s"]
    unit = "tokens/s" if lm and row["tokens_per_s"] else "samples/s"
    text = f"{rate:,.0f} {unit}, {_duration(row['step_time_s'])}/step"
    if "vs_fp32" in row and precision != "fp32":
        text += f", {row['vs_fp32']:.2f}× fp32"
    if row["launch_bound"]:
        text += f"; launch-bound: ~{row['kernels']} kernels at ≥ 5 µs each take longer"
    out = [f"predicted {text}"]
    if len(columns) > 1:
        out.append(
            f"error {row['error']:+.0%}, MFU {row['measured_mfu']:.1%}" if "error" in row else ""
        )
    return out


def _duration(seconds: float) -> str:
    """``62.7 ms``, ``1.48 µs``, ``2.16 s``: three figures in the unit that suits."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns"


def lines(prediction: dict[str, Any] | None) -> list[str]:
    """The words under the table: which GPU, from where, on what basis; or why none."""
    if not prediction:
        return []
    if prediction.get("gpu") is None:
        return [f"Predicted speed: none ({prediction['note']})."]
    if prediction.get("error"):
        return [f"Predicted speed on {prediction['gpu']['name']}: none ({prediction['error']})."]
    gpu = prediction["gpu"]
    said = [
        f"Predicted on {gpu['name']} ({prediction['note']}): {prediction['basis']}. "
        f"Figures: {gpu['source']}."
    ]
    if prediction.get("same_device"):
        said.append(
            "Measured on that GPU: error = (predicted − measured) / measured; MFU = model "
            "FLOP/s over the FLOP-weighted peak of the formats the GEMMs ran in."
        )
    return said


# ------------------------------------------------------------------------------ the plan's words
def _plan_figure(row: dict[str, Any], against: str | None) -> str:
    """``1.25 ms/step (+1.6% step time on <against>, 1.58× bf16's speed)`` (``against``: the
    all-layers step's words, "" where the line said them; None: not compared with it)."""
    parts = []
    if against is not None and row.get("vs_all_layers") is not None:
        on = f" on {against}" if against else ""
        parts.append(f"{row['vs_all_layers'] - 1:+.1%} step time{on}")
    if row.get("vs_bf16"):
        parts.append(f"{row['vs_bf16']:.2f}× bf16's speed")
    said = f" ({', '.join(parts)})" if parts else ""
    return f"{_duration(row['step_time_s'])}/step{said}"


def _plan_head(speed: dict[str, Any]) -> str:
    return f"- predicted on {speed['gpu']} ({speed['basis']}; not measured)"


def kept_line(plan: dict[str, Any]) -> str | None:
    """The plan's evidence line of its predicted speed on advise.target's GPU: every eligible
    layer in the choice's format, and the kept layers whole in high precision; None when there
    was no prediction."""
    speed = plan.get("predicted_speed")
    if not speed:
        return None
    rows, head = speed["rows"], _plan_head(speed)
    every, kept = rows["all_layers"], rows.get("kept_layers")
    if "none" in every:
        return f"{head}: none ({every['none']})"
    text = f"{head}: every eligible layer in {plan['label']} {_plan_figure(every, None)}"
    if kept is not None:
        figure = f"none ({kept['none']})" if "none" in kept else _plan_figure(kept, "")
        text += f"; with the kept layers {figure}"
    if every["launch_bound"]:
        text += "; launch-bound: on a GPU, kernel launches would set steps this short"
    return text


def per_gemm_line(plan: dict[str, Any]) -> str | None:
    """The per-GEMM plan's predicted speed on advise.target's GPU, beside every eligible layer in
    the choice's format and the kept layers whole; None when it was not predicted."""
    speed = plan.get("predicted_speed")
    row = speed["rows"].get("per_gemm") if speed else None
    if row is None:
        return None
    head = _plan_head(speed)
    if "none" in row:
        return f"{head}: none ({row['none']})"
    every = "every eligible layer in " + plan["label"]
    text = f"{head}: {_plan_figure(row, every)}"
    kept = speed["rows"].get("kept_layers", {})
    if "step_time_s" in kept:
        text += f"; the kept layers whole {_plan_figure(kept, '')}"
    return text
