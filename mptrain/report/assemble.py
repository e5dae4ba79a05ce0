"""The run's report assembled from a finished, failed or interrupted job: one builder per section
of :class:`~mptrain.report.schema.RunReport` (model, precision, data, training, numerics,
evaluation, throughput, time, checkpoints), each reading what the job measured, never re-measuring.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch

from mptrain.checkpoint.checkpointer import Checkpointer
from mptrain.config.base import ConfigError
from mptrain.config.run import RunConfig
from mptrain.data.batches import DataBundle
from mptrain.models.build import compile_counts, model_facts
from mptrain.models.task import Task
from mptrain.pace.progress import ProgressDisplay
from mptrain.perf import gpus
from mptrain.perf.speed import DataShape, mfu_of_run
from mptrain.platform import contention, hardware
from mptrain.platform.distributed import DistContext
from mptrain.platform.dtypes import dtype_name
from mptrain.precision.policy import PrecisionPolicy
from mptrain.precision.quant.convert import fp8_layer_stats
from mptrain.report.schema import (
    CheckpointsSection,
    DataSection,
    EvaluationSection,
    MemorySection,
    ModelSection,
    NumericsSection,
    OptimizerSection,
    PrecisionSection,
    RunReport,
    ThroughputSection,
    TimeSection,
    TrainingSection,
)
from mptrain.train.components import Run
from mptrain.train.optim import optimizer_implementation, state_dtypes
from mptrain.train.recipe import recipe_verdict
from mptrain.train.state import LoopState
from mptrain.train.threads import threads_section


# ------------------------------------------------------------------------------ the report
class JobRecord(Protocol):
    """What the report reads of a job (:class:`mptrain.train.job.Job` records it as it runs);
    ``run`` and ``policy`` are None when the job stopped before they were built."""

    cfg: RunConfig
    run: Run | None
    state: LoopState
    policy: PrecisionPolicy | None
    tf32: dict[str, Any] | None
    device: torch.device
    dist: DistContext
    output_dir: Path
    started_at: str
    start_time: float
    resumed: dict[str, Any] | None
    checkpointer: Checkpointer | None
    compile_counts_at_start: dict[str, int] | None
    load_at_start: contention.LoadSample  # the machine's load when the job started
    display: ProgressDisplay | None  # the run's estimate and the notes given while it trained
    memory_accounted: dict[str, Any] | None  # one step's bytes (mptrain.train.memory)
    lost_ranks: dict[int, str] | None  # rank 0: the ranks that ended the run, and how


def now_iso() -> str:
    """The local time with its offset, to the millisecond: sweep comparisons tell jobs that ran
    at the same time by these (:mod:`mptrain.commands.sweep`)."""
    return dt.datetime.now().astimezone().isoformat(timespec="milliseconds")


def _model_section(job: JobRecord) -> ModelSection:
    """The model's name and settings, what was built (source, class, adaptations) and, with
    compile=true, the graphs and graph breaks torch.compile produced during the run."""
    cfg, run = job.cfg, job.run
    facts = model_facts(run.model) if run else None
    built = dataclasses.asdict(facts) if facts else {}
    compiled = {}
    if job.compile_counts_at_start is not None:
        start, now = job.compile_counts_at_start, compile_counts()
        compiled = {
            "compiled_graphs": now["graphs"] - start["graphs"],
            "graph_breaks": now["graph_breaks"] - start["graph_breaks"],
        }
    return ModelSection(
        cfg.model.name,
        run.num_parameters if run else None,
        cfg.channels_last,
        cfg.compile,
        **compiled,
        **built,
    )


def _layer_section(
    section: dict[str, Any] | None, layer_stats: Callable[[], Any]
) -> dict[str, Any] | None:
    """A layer format's section (``fp8``, ``blocks``) with its layers' ``final_layer_stats``:
    ``layer_stats()`` at the end of the run (reads device values), or, for layers a precision
    switch left, as they were at the switch (mptrain.train.switch); None without one."""
    if not section or "final_layer_stats" in section:
        return section or None
    return {**section, "final_layer_stats": layer_stats()}


def assemble_report(job: JobRecord, status: str, reason: str | None) -> RunReport:
    """The report from what the job got to: every section, whatever stage it stopped at."""
    cfg, run, state = job.cfg, job.run, job.state
    evaluation = _evaluation_section(state, run, cfg.task)
    wall_time_s = time.perf_counter() - job.start_time
    return RunReport(
        status=status,
        reason=reason,
        output_dir=str(job.output_dir),
        started_at=job.started_at,
        finished_at=now_iso(),
        wall_time_s=wall_time_s,
        precision=_precision_section(job, job.display.notes if job.display else []),
        tf32=job.tf32,
        fp8=_layer_section(run and run.precision.fp8, lambda: fp8_layer_stats(run.model)),
        hardware={
            **hardware.hardware_info(job.device),
            # whether others' work competed for the cores (the speed figures: a busy machine's)
            "machine_load": contention.judged_since(job.load_at_start, job.device),
        },
        versions=hardware.software_versions(),
        seed=cfg.seed,
        optimizer=OptimizerSection(
            cfg.optimizer.name,
            optimizer_implementation(run.optimizer) if run else None,
            state_dtypes(run.optimizer) if run else None,
        ),
        model=_model_section(job),
        data=_data_section(cfg, run, job.dist),
        training=_training_section(cfg, run, state),
        numerics=_numerics_section(run),
        evaluation=evaluation,
        throughput=_throughput_section(job),
        memory=MemorySection(
            run.monitor.peak_memory_bytes if run else None,
            run.monitor.memory_kind if run else None,
            job.memory_accounted,
        ),
        distributed={**job.dist.describe(), "lost_ranks": job.lost_ranks},
        resumed=job.resumed,
        checkpoints=_checkpoints_section(job.checkpointer),
        recipe=recipe_verdict(cfg, status, evaluation, run.data if run else None),
        blocks=_layer_section(
            run and run.precision.blocks.section, lambda: run.precision.blocks.layer_stats()
        ),
        config=dataclasses.asdict(cfg),
        time=_time_section(run, wall_time_s, job.display),
        threads=threads_section(run.threads, run.monitor.threads) if run else None,
    )


def _precision_section(job: JobRecord, run_notes: list[str]) -> PrecisionSection:
    """What ran and why (with a precision switch: the first precision, and the switch);
    ``run_notes``: notes given while it trained (a slow path's, measured)."""
    cfg, p, run = job.cfg, job.policy, job.run
    if p is None:
        return PrecisionSection(requested=cfg.precision.alias or cfg.precision.name)
    return PrecisionSection(
        requested=p.requested,
        effective=p.name,
        label=p.label,
        emulated=p.emulated,
        autocast_dtype=dtype_name(p.autocast_dtype),
        loss_scaling=p.loss_scaling,
        scaler={"enabled": p.loss_scaling, **dataclasses.asdict(p.scaler)},
        reason=p.reason,
        notes=[*p.notes, *run_notes],
        master_weights_dtype=dtype_name(p.param_dtype),
        master_weights=p.master_weights,
        auto_timing=p.auto_timing,
        switch=run.schedule.describe(run, job.state) if run else None,
        update=None if p.master_weights else cfg.precision.update,
        gemms=_gemms(run),
    )


def _gemms(run: Run | None) -> dict[str, str] | None:
    """The per-GEMM formats of the run's converted layers (precision.gemms), if it set any."""
    if run is None:
        return None
    section = run.precision.fp8 or run.precision.blocks.section or {}
    if "gemms" not in section:
        return None
    return {**section["gemms"], "layers": ", ".join(section["gemm_layers"])}


def _data_section(cfg: RunConfig, run: Run | None, dist: DistContext) -> DataSection:
    data = run.data if run else None
    return DataSection(
        description=data.description if data else cfg.dataset.name,
        feed=data.train.feed if data else None,
        num_train=data.num_train if data else None,
        num_val=data.num_val if data else None,
        batch_size=cfg.batch_size,
        grad_accum_steps=cfg.grad_accum_steps,
        effective_batch_size=cfg.batch_size * cfg.grad_accum_steps * dist.world_size,
        skipped_bad_files=_bad_files(cfg, data),
        pipeline=getattr(data.train, "pipeline", None) if data else None,
        text=data.text.describe() if data and data.text else None,
    )


def _bad_files(cfg: RunConfig, data: DataBundle | None) -> int | None:
    if data is None or not getattr(cfg.dataset, "skip_bad_files", False):
        return None
    return data.train.bad_files + data.val.bad_files


def _training_section(cfg: RunConfig, run: Run | None, state: LoopState) -> TrainingSection:
    monitor = run.monitor if run else None
    scale = monitor.scale_stats if monitor else None
    return TrainingSection(
        steps=state.step,
        total_steps=run.settings.total_steps if run else None,
        steps_per_epoch=run.settings.steps_per_epoch if run else None,
        epochs_completed=state.epoch,
        samples_seen=state.samples_seen,
        skipped_steps={"count": len(state.skipped_steps), "steps": state.skipped_steps},
        loss_scale=dataclasses.asdict(scale) if scale else None,
        final_train_loss=state.last_train_loss,
        clip_grad_norm=cfg.clip_grad_norm,
        zero_grad_fraction=monitor.probes.zero_grad_fraction if monitor else None,
        updates_lost_fraction=monitor.probes.updates_lost_fraction if monitor else None,
        states_lost_fraction=monitor.probes.states_lost_fraction if monitor else None,
        length=run.settings.length or None if run else None,
    )


def _numerics_section(run: Run | None) -> NumericsSection:
    if run is None:
        return NumericsSection()
    return NumericsSection(
        **run.monitor.health.summary(),
        culprit=run.monitor.culprit,
        fp32_modules=run.precision.fp32_modules,
    )


def _evaluation_section(state: LoopState, run: Run | None, task_name: str) -> EvaluationSection:
    task = run.task if run else Task(task_name)  # a run that failed to build: the configured task
    best, final = task.best(state.evals), state.evals[-1] if state.evals else None
    text = run.data.text if run else None
    return EvaluationSection(
        final_val_accuracy=final["val_accuracy"] if final else None,
        final_val_loss=final["val_loss"] if final else None,
        best_val_accuracy=best["val_accuracy"] if best else None,
        best_step=best["step"] if best else None,
        history=state.evals,
        task=task.name,
        primary_metric=task.primary_metric,
        best_val_loss=best["val_loss"] if best else None,
        final_val_perplexity=final.get("val_perplexity") if final else None,
        best_val_perplexity=best.get("val_perplexity") if best else None,
        baseline_val_loss=text.unigram_val_loss if text else None,
    )


def _throughput_section(job: JobRecord) -> ThroughputSection:
    cfg, run, policy = job.cfg, job.run, job.policy
    throughput = run.monitor.throughput if run else None
    windows = throughput.windows if throughput else []
    samples = run.monitor.settings.samples_per_step if run else 0
    return ThroughputSection(
        samples_per_s=throughput.samples_per_s if throughput else None,
        measured_steps=throughput.measured_steps if throughput else 0,
        measured_time_s=throughput.measured_time_s if throughput else 0.0,
        warmup_steps=cfg.throughput_warmup_steps,
        data_wait_fraction=throughput.data_wait_fraction if throughput else None,
        # Emulated FP8 runs FP32 matmuls: its speed says nothing about FP8 hardware.
        comparable=not (policy is not None and policy.emulated)
        and not (run is not None and run.schedule.emulated),
        window_samples_per_s=[n * samples / s for n, s in windows],
        tokens_per_s=run.monitor.tokens_per_s if run else None,
        window_steps=[n for n, _ in windows],
        **_mfu_fields(job),
    )


def _mfu_fields(job: JobRecord) -> dict[str, Any]:
    """The throughput section's MFU: model FLOP/s over the FLOP-weighted peak of the formats the
    run's GEMMs ran in (:func:`mptrain.perf.speed.mfu_of_run`), on a GPU the table knows;
    otherwise None and why (on a CPU: n/a)."""
    cfg, run, policy, device = job.cfg, job.run, job.policy, job.device
    if device.type != "cuda":
        return {"mfu_note": "n/a: on a CPU (no peak throughput table)"}
    samples_per_s = run.monitor.throughput.samples_per_s if run else None
    if run is None or policy is None or not samples_per_s:
        return {"mfu_note": "n/a: no step was measured"}
    if policy.emulated:
        return {
            "mfu_note": f"n/a: {policy.name}'s GEMMs are emulated (no hardware kernel): not a speed"
        }
    gpu = gpus.row_for_device_name(torch.cuda.get_device_name(device))
    if gpu is None:
        return {"mfu_note": f"n/a: no peak table for {torch.cuda.get_device_name(device)}"}
    name = "tf32" if policy.name == "fp32" and cfg.precision.allow_tf32 else policy.name
    fp8 = (
        [r["name"] for r in run.precision.fp8["layers"] if r["converted"]]
        if run.precision.fp8
        else None
    )
    try:
        per_sample, peak = mfu_of_run(cfg, DataShape.of(run.data), name, fp8, gpu)
    except (ConfigError, RuntimeError, TypeError, ValueError, NotImplementedError) as exc:
        return {"mfu_note": f"n/a: the model's FLOPs could not be counted ({exc})"}
    return {
        "mfu": samples_per_s * per_sample / (job.dist.world_size * peak),
        "mixed_peak_tflops": peak / 1e12,
        "mfu_note": f"{gpu.name}, {name}: FLOP-weighted peak of its GEMMs' formats",
    }


def _time_section(
    run: Run | None, wall_time_s: float, display: ProgressDisplay | None
) -> TimeSection | None:
    """Where the time went, and the estimate made while training beside the loop's actual time."""
    if run is None:
        return None
    t = run.monitor.time
    inside = t.training_s + t.evaluation_s + t.checkpoint_s
    estimate = display.estimate if display else None
    steps_run = run.state.step - display.start_step if display else 0
    return TimeSection(
        training_s=t.training_s,
        evaluation_s=t.evaluation_s,
        evaluations=t.evaluations,
        checkpoint_s=t.checkpoint_s,
        checkpoints=t.checkpoints,
        other_s=max(wall_time_s - inside, 0.0),
        estimate=estimate.record(inside, steps_run) if estimate else None,
    )


def _checkpoints_section(c: Checkpointer | None) -> CheckpointsSection | None:
    if c is None:
        return None
    return CheckpointsSection(
        directory=str(c.directory),
        kept=[str(p) for p in c.saved],
        latest=str(c.saved[-1]) if c.saved else None,
        best=str(c.best[1]) if c.best else None,
    )
