"""One training run from a typed config: build every component, train, write the report.

:func:`train` is what the CLI calls for each Hydra job and what tests call directly. It takes plain
objects (a :class:`~mptrain.config.RunConfig` and an output directory) and never sees OmegaConf.

Whatever happens after the output directory is known — completion, divergence, an interrupt, an
exception — a report is written with the matching status before the exception (if any) propagates.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import os
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Console

from mptrain import hardware
from mptrain.checkpoint import (
    CHECKPOINT_DIR,
    Checkpointer,
    Trainables,
    check_compatible,
    resolve_resume,
    restore,
)
from mptrain.config import ConfigError, RunConfig
from mptrain.data import DataBundle, build_data
from mptrain.distributed import DistContext, init_distributed, shutdown, unwrap, wrap_model
from mptrain.fileio import atomic_write_text
from mptrain.fp8 import apply_fp8, fp8_layer_stats
from mptrain.loop import LoopSettings, LoopState, to_model_input, train_loop
from mptrain.metrics import MetricsLog, read_metrics
from mptrain.models import build_model, count_parameters
from mptrain.numerics import (
    audit_step,
    keep_in_fp32,
    range_probe,
    render_audit,
    render_probe,
)
from mptrain.optim import build_optimizer, build_scheduler, optimizer_implementation
from mptrain.plots import RUN_PNG, plot_run
from mptrain.precision import PrecisionPolicy, apply_tf32, build_grad_scaler, resolve_precision
from mptrain.progress import ProgressDisplay
from mptrain.recipe import recipe_verdict
from mptrain.report import METRICS_JSONL, clean_json, print_summary, write_report
from mptrain.signals import GracefulStop


class RunInterrupted(RuntimeError):
    """Raised by :func:`train` after a SIGINT/SIGTERM stop: checkpoint and report are written."""

    def __init__(self, exit_code: int, report: dict[str, Any]) -> None:
        super().__init__(f"interrupted (exit code {exit_code})")
        self.exit_code = exit_code
        self.report = report


class RunFailed(RuntimeError):
    """Raised by :func:`train` after the report was written with status failed or diverged."""

    def __init__(self, status: str, reason: str, report: dict[str, Any]) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason
        self.report = report


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device


def check_output_dir(output_dir: Path) -> None:
    """Fail before training, not at the first save, when the run directory is not writable."""
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"output directory {output_dir}: cannot create it ({exc.strerror})"
        ) from exc
    if not os.access(output_dir, os.W_OK | os.X_OK):
        raise ConfigError(f"output directory {output_dir}: not writable by this user")


def plan_steps(cfg: RunConfig, data: DataBundle) -> tuple[int, int]:
    """(optimizer steps per epoch, total optimizer steps) for the configured length."""
    steps_per_epoch = data.train.num_batches // cfg.grad_accum_steps
    if steps_per_epoch < 1:
        raise ConfigError(
            f"grad_accum_steps={cfg.grad_accum_steps}: batch_size x grad_accum_steps = "
            f"{cfg.batch_size * cfg.grad_accum_steps} exceeds the {data.num_train} training samples"
        )
    limits = []
    if cfg.epochs is not None:
        limits.append(cfg.epochs * steps_per_epoch)
    if cfg.max_steps is not None:
        limits.append(cfg.max_steps)
    return steps_per_epoch, min(limits)


@dataclasses.dataclass
class _RunFacts:
    """What is known about the run so far; the report is built from whatever got filled in."""

    cfg: RunConfig
    output_dir: Path
    started_at: str
    start_time: float
    device: torch.device | None = None
    policy: PrecisionPolicy | None = None
    tf32: dict[str, Any] | None = None
    data: DataBundle | None = None
    num_parameters: int | None = None
    total_steps: int | None = None
    steps_per_epoch: int | None = None
    memory_kind: str | None = None
    fp8: dict[str, Any] | None = None
    model: torch.nn.Module | None = None
    fp32_modules: list[str] = dataclasses.field(default_factory=list)
    resumed: dict[str, Any] | None = None
    checkpointer: Checkpointer | None = None
    stop: GracefulStop | None = None
    dist: DistContext = dataclasses.field(default_factory=DistContext)
    optimizer_impl: str | None = None
    state: LoopState = dataclasses.field(default_factory=LoopState)


def _precision_section(facts: _RunFacts) -> dict[str, Any]:
    p = facts.policy
    if p is None:
        return {
            "requested": facts.cfg.precision.name,
            "effective": None,
            "autocast_dtype": None,
            "loss_scaling": None,
            "scaler": None,
            "label": None,
            "emulated": None,
            "reason": "not resolved",
            "notes": [],
        }
    return {
        "requested": p.requested,
        "effective": p.name,
        "label": p.label,
        "emulated": p.emulated,
        "autocast_dtype": str(p.autocast_dtype).replace("torch.", "") if p.autocast_dtype else None,
        "loss_scaling": p.scaler_enabled,
        "scaler": dataclasses.asdict(p.scaler),
        "reason": p.reason,
        "notes": list(p.notes),
        "master_weights_dtype": str(p.param_dtype).replace("torch.", ""),
        "master_weights": p.master_weights,
    }


def _checkpoint_section(facts: _RunFacts) -> dict[str, Any] | None:
    c = facts.checkpointer
    if c is None:
        return None
    return {
        "directory": str(c.directory),
        "kept": [str(p) for p in c.saved],
        "latest": str(c.saved[-1]) if c.saved else None,
        "best": str(c.best[1]) if c.best else None,
    }


def _fp8_section(facts: _RunFacts) -> dict[str, Any] | None:
    if facts.fp8 is None:
        return None
    stats = fp8_layer_stats(facts.model) if facts.model is not None else []
    return {**facts.fp8, "final_layer_stats": stats}


def build_report(facts: _RunFacts, status: str, reason: str | None) -> dict[str, Any]:
    report = _base_report(facts, status, reason)
    report["recipe"] = recipe_verdict(facts.cfg, status, report["evaluation"])
    return report


def _base_report(facts: _RunFacts, status: str, reason: str | None) -> dict[str, Any]:
    cfg, state, data = facts.cfg, facts.state, facts.data
    device = facts.device or torch.device("cpu")
    best = state.best_eval
    final = state.evals[-1] if state.evals else None
    scale = dataclasses.asdict(state.scale) if state.scale else None
    return {
        "status": status,
        "reason": reason,
        "output_dir": str(facts.output_dir),
        "started_at": facts.started_at,
        "finished_at": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "wall_time_s": time.perf_counter() - facts.start_time,
        "precision": _precision_section(facts),
        "tf32": facts.tf32,
        "fp8": _fp8_section(facts),
        "hardware": hardware.hardware_info(device),
        "versions": hardware.software_versions(),
        "seed": cfg.seed,
        "optimizer": {
            "name": cfg.optimizer.name,
            "implementation": facts.optimizer_impl,
        },
        "model": {
            "name": cfg.model.name,
            "parameters": facts.num_parameters,
            "channels_last": cfg.channels_last,
            "compile": cfg.compile,
        },
        "data": {
            "description": data.description if data else cfg.dataset.name,
            "feed": data.train.feed if data else None,
            "num_train": data.num_train if data else None,
            "num_val": data.num_val if data else None,
            "batch_size": cfg.batch_size,
            "grad_accum_steps": cfg.grad_accum_steps,
            "effective_batch_size": cfg.batch_size * cfg.grad_accum_steps * facts.dist.world_size,
        },
        "training": {
            "steps": state.step,
            "total_steps": facts.total_steps,
            "steps_per_epoch": facts.steps_per_epoch,
            "epochs_completed": state.epoch,
            "samples_seen": state.samples_seen,
            "skipped_steps": {"count": len(state.skipped_steps), "steps": state.skipped_steps},
            "loss_scale": scale,
            "final_train_loss": state.last_train_loss,
            "clip_grad_norm": cfg.clip_grad_norm,
            # Averages over the probes taken every probe_every steps.
            "zero_grad_fraction": state.zero_grad_fraction,
            "updates_lost_fraction": state.updates_lost_fraction,
        },
        "numerics": {
            **(state.health.summary() if state.health else {}),
            "culprit": state.culprit,
            "fp32_modules": facts.fp32_modules,
        },
        "evaluation": {
            "final_val_accuracy": final["val_accuracy"] if final else None,
            "final_val_loss": final["val_loss"] if final else None,
            "best_val_accuracy": best["val_accuracy"] if best else None,
            "best_step": best["step"] if best else None,
            "history": state.evals,
        },
        "throughput": {
            "samples_per_s": state.samples_per_s,
            "measured_steps": state.measured_steps,
            "measured_time_s": state.measured_time_s,
            "warmup_steps": cfg.throughput_warmup_steps,
            "data_wait_fraction": state.data_wait_fraction,
            "excludes": "warm-up steps and evaluation",
            # Emulated FP8 runs FP32 matmuls: its speed says nothing about FP8 hardware.
            "comparable": not (facts.policy is not None and facts.policy.emulated),
        },
        "memory": {
            "peak_bytes": hardware.peak_memory_bytes(device) if facts.memory_kind else None,
            "kind": facts.memory_kind,
        },
        "distributed": facts.dist.describe(),
        "resumed": facts.resumed,
        "checkpoints": _checkpoint_section(facts),
        "recipe": None,  # filled in below, from the evaluation figures
        "config": dataclasses.asdict(cfg),
    }


@dataclasses.dataclass
class Components:
    """Everything the loop needs, built from the config by :func:`build_components`."""

    model: torch.nn.Module  # what the loop calls (torch.compile'd when compile=true)
    data: DataBundle
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    settings: LoopSettings
    num_parameters: int
    fp8: dict[str, Any] | None = None  # the report's fp8 section (converted layers, FLOPs share)
    fp32_modules: list[str] = dataclasses.field(default_factory=list)


def build_components(
    cfg: RunConfig,
    device: torch.device,
    policy: PrecisionPolicy,
    dist: DistContext | None = None,
) -> Components:
    """Data, model (FP32 parameters on ``device``), optimizer, schedule, scaler, loop settings.

    Distributed (``dist``): this rank's data shard, and the model wrapped in DDP or FSDP2 before
    the optimizer is built on its (possibly sharded) parameters.
    """
    dist = dist or DistContext()
    if cfg.debug.inject_inf_grad_steps and not policy.scaler_enabled:
        raise ConfigError(
            "debug.inject_inf_grad_steps: needs a precision with loss scaling (fp16); "
            f"{policy.name} has no scaler to skip the step"
        )
    data = build_data(
        cfg.dataset,
        cfg.batch_size,
        cfg.eval_batch_size,
        device,
        seed=cfg.seed,
        num_workers=cfg.num_workers,
        rank=dist.rank,
        world=dist.world_size,
    )
    model = build_model(cfg.model, data.in_channels, data.image_size, data.num_classes).to(device)
    fp8_section = None
    if policy.fp8 is not None:
        sample, _ = next(iter(data.val.batches(0)))
        fp8_section = apply_fp8(
            model,
            policy.fp8,
            sample[:2],
            include=list(cfg.fp8.include),
            exclude=list(cfg.fp8.exclude),
            keep_first_last=cfg.fp8.keep_first_last,
            backend=cfg.fp8.backend,
        )
        if not any(layer["converted"] for layer in fp8_section["layers"]):
            raise ConfigError(
                f"precision=fp8: no Linear layer of model={cfg.model.name} can run in FP8 "
                "(first/last kept, or dimensions not multiples of 16); see fp8.include/exclude"
            )
    if cfg.numerics.fp32_modules and not policy.master_weights:
        raise ConfigError(
            f"numerics.fp32_modules: precision={policy.name} keeps its weights in "
            f"{str(policy.param_dtype).replace('torch.', '')}, so no layer can run in FP32; "
            "use a mixed precision (fp16, bf16) instead"
        )
    fp32_modules = keep_in_fp32(model, list(cfg.numerics.fp32_modules), device.type)
    if cfg.numerics.fp32_modules and not fp32_modules:
        raise ConfigError(
            f"numerics.fp32_modules={list(cfg.numerics.fp32_modules)}: no module name matches; "
            f"names look like {', '.join(n for n, _ in list(model.named_modules())[1:6])}"
        )
    if not policy.master_weights:  # "pure" low precision: no FP32 copy of the weights
        model = model.to(policy.param_dtype)
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    num_parameters = count_parameters(model)
    # FSDP computes in the recipe's dtype through its own policy (autocast stays on for the rest).
    model = wrap_model(model, dist, device, policy.autocast_dtype)
    steps_per_epoch, total_steps = plan_steps(cfg, data)
    optimizer = build_optimizer(cfg.optimizer, model, device, fused=dist.strategy != "fsdp")
    settings = LoopSettings(
        total_steps=total_steps,
        steps_per_epoch=steps_per_epoch,
        grad_accum_steps=cfg.grad_accum_steps,
        clip_grad_norm=cfg.clip_grad_norm,
        label_smoothing=cfg.label_smoothing,
        eval_every=cfg.eval_every,
        log_every=cfg.log_every,
        probe_every=cfg.probe_every,
        throughput_warmup_steps=cfg.throughput_warmup_steps,
        channels_last=cfg.channels_last,
        inject_inf_grad_steps=frozenset(cfg.debug.inject_inf_grad_steps),
        health=cfg.numerics,
        # The re-run of a batch would call collectives on some ranks only: single process only.
        find_culprit=cfg.numerics.find_culprit and not dist.enabled,
        inject_inf_grad_rank=cfg.debug.inject_inf_grad_rank,
        dist=dist,
    )
    return Components(
        model=torch.compile(model) if cfg.compile else model,
        data=data,
        optimizer=optimizer,
        scheduler=build_scheduler(cfg.scheduler, optimizer, steps_per_epoch, total_steps),
        scaler=build_grad_scaler(policy, dist),
        settings=settings,
        num_parameters=num_parameters,
        fp8=fp8_section,
        fp32_modules=fp32_modules,
    )


def train_components(
    parts: Components,
    policy: PrecisionPolicy,
    device: torch.device,
    state: LoopState,
    settings: LoopSettings | None = None,
    **loop_options: Any,
) -> LoopState:
    """:func:`~mptrain.loop.train_loop` over what :func:`build_components` made."""
    return train_loop(
        parts.model,
        parts.data,
        parts.optimizer,
        parts.scheduler,
        parts.scaler,
        policy,
        settings or parts.settings,
        device,
        state,
        **loop_options,
    )


def _diagnose_before_training(
    cfg: RunConfig, parts: Components, policy: PrecisionPolicy, output_dir: Path, console: Console
) -> None:
    """audit=true / probe=true: trace one step, or probe FP16 ranges; the model is left untouched."""
    if not (cfg.audit or cfg.probe):
        return
    batches = parts.data.train.batches(0)
    first = [next(batches) for _ in range(cfg.probe_batches if cfg.probe else 1)]
    first = [(to_model_input(x, policy, cfg.channels_last), y) for x, y in first]
    if cfg.audit:
        audit = audit_step(
            parts.model, *first[0], policy.autocast, parts.optimizer, mixed=policy.master_weights
        )
        atomic_write_text(output_dir / "audit.json", json.dumps(audit, indent=2) + "\n")
        atomic_write_text(output_dir / "audit.md", render_audit(audit))
        flags = len(audit["flagged_ops"]) + len(audit["state_flags"])
        console.print(f"audit: {len(audit['ops'])} op kinds traced, {flags} flagged -> audit.md")
    if cfg.probe:
        probe = range_probe(parts.model, first, policy.scaler.init_scale)
        atomic_write_text(output_dir / "probe.json", json.dumps(clean_json(probe), indent=2) + "\n")
        atomic_write_text(output_dir / "probe.md", render_probe(probe))
        console.print(f"FP16 range probe: {probe['verdict']} -> probe.md")


def _setup_and_train(facts: _RunFacts, console: Console) -> None:
    cfg = facts.cfg
    dist = facts.dist
    seed_everything(cfg.seed)  # the same initial weights on every rank
    facts.device = device = _device_for(cfg.device, dist)
    facts.policy = policy = resolve_precision(cfg.precision, device, cfg.fp8)
    facts.tf32 = apply_tf32(policy.allow_tf32)
    if dist.enabled and (cfg.audit or cfg.probe):
        raise ConfigError("audit/probe: run them in a single process, not under torchrun")
    parts = build_components(cfg, device, policy, dist)
    if dist.enabled:
        seed_everything(cfg.seed + dist.rank)  # per-rank dropout and other randomness
    facts.data = parts.data
    facts.num_parameters = parts.num_parameters
    facts.fp8 = parts.fp8
    facts.model = parts.model
    facts.steps_per_epoch = parts.settings.steps_per_epoch
    facts.total_steps = parts.settings.total_steps
    console.print(
        f"[bold]mptrain[/bold] {cfg.model.name} on {parts.data.description} | {policy.describe()}"
        f"{'' if policy.requested == policy.name else f' (auto: {policy.reason})'} | {device}"
    )
    for note in policy.notes:
        console.print(f"[yellow]note:[/yellow] {note}")
    facts.fp32_modules = parts.fp32_modules
    facts.optimizer_impl = optimizer_implementation(parts.optimizer)
    _diagnose_before_training(cfg, parts, policy, facts.output_dir, console)
    trainables = Trainables(
        parts.model if dist.strategy == "fsdp" else unwrap(parts.model),
        parts.optimizer,
        parts.scheduler,
        parts.scaler,
    )
    signature = run_signature(cfg, policy)
    if cfg.resume:
        facts.resumed = _resume(cfg, facts, trainables, signature, parts.settings, console)
    checkpointer = None
    if cfg.checkpoint.enabled:
        checkpointer = Checkpointer(
            facts.output_dir / CHECKPOINT_DIR,
            trainables,
            cfg,
            signature,
            every_steps=cfg.checkpoint.every_steps,
            every_epoch=cfg.checkpoint.every_epoch,
            keep_last=cfg.checkpoint.keep_last,
            keep_best=cfg.checkpoint.keep_best,
            dist=dist,
        )
        facts.checkpointer = checkpointer
    facts.memory_kind = hardware.reset_peak_memory(device)
    # Only rank 0 writes metrics and shows progress.
    metrics = MetricsLog(facts.output_dir / METRICS_JSONL) if dist.is_main else None
    try:
        with (
            ProgressDisplay(
                parts.settings.total_steps,
                f"{policy.name} {cfg.model.name}",
                console,
                cfg.progress and dist.is_main,
            ) as display,
            GracefulStop() as stop,
        ):
            facts.stop = stop
            train_components(
                parts,
                policy,
                device,
                facts.state,
                observers=(metrics, display) if metrics else (display,),
                checkpoint=checkpointer.after_step if checkpointer else None,
                stop_requested=stop.requested,
            )
            ended = facts.state.stopped or facts.state.step == parts.settings.total_steps
            if ended and checkpointer and facts.state.step not in checkpointer.steps:
                # The final state (or the interrupted one) is always saved; still inside the
                # signal handlers, so a second signal waits for the write.
                checkpointer.save(facts.state)
    finally:
        if metrics:
            metrics.close()


def _device_for(request: str, dist: DistContext) -> torch.device:
    device = hardware.resolve_device(request)
    if dist.enabled and device.type == "cuda":
        return torch.device("cuda", dist.local_rank)  # one GPU per process
    return device


def run_signature(cfg: RunConfig, policy: PrecisionPolicy) -> dict[str, Any]:
    """What a checkpoint must agree on to be resumed: precision, model, data and batch layout."""
    dataset = {
        k: v for k, v in dataclasses.asdict(cfg.dataset).items() if k not in ("root", "download")
    }
    return {
        "precision": policy.name,
        "model": dataclasses.asdict(cfg.model),
        "dataset": dataset,
        "batch_size": cfg.batch_size,
        "grad_accum_steps": cfg.grad_accum_steps,
        "seed": cfg.seed,
        "fp8": dataclasses.asdict(cfg.fp8) if policy.fp8 is not None else None,
    }


def _resume(
    cfg: RunConfig,
    facts: _RunFacts,
    trainables: Trainables,
    signature: dict[str, Any],
    settings: LoopSettings,
    console: Console,
) -> dict[str, Any]:
    found = resolve_resume(cfg.resume, facts.output_dir)
    if found is None:
        console.print("resume=auto: no checkpoint in this run directory; starting fresh")
        return {"requested": cfg.resume, "from": None, "note": "no checkpoint found; started fresh"}
    path, payload, notes = found
    allowed = check_compatible(payload, signature, path, cfg.resume_allow_changes)
    saved_world = payload.get("world_size", 1)
    if saved_world != facts.dist.world_size:
        notes.append(
            f"saved at world size {saved_world}, resumed at {facts.dist.world_size}: weights, "
            "optimizer and scaler state load as saved; the data position is placed by step count"
        )
    restore(payload, trainables, facts.state, settings.health, path, facts.dist)
    if facts.dist.enabled:  # rank 0's RNG was saved: give each rank its own stream again
        seed_everything(cfg.seed + facts.dist.rank + facts.state.step)
    for note in notes:
        console.print(f"[yellow]resume:[/yellow] {note}")
    console.print(f"resumed from {path} at step {facts.state.step}")
    return {
        "requested": cfg.resume,
        "from": str(path),
        "step": facts.state.step,
        "allowed_differences": allowed,
        "notes": notes,
    }


def train(cfg: RunConfig, output_dir: Path, console: Console | None = None) -> dict[str, Any]:
    """Run one job and write its report into ``output_dir``; return the report.

    Raises ConfigError (bad input found before training: no report is written), RunFailed (the
    run diverged or crashed; the report says why), RunInterrupted (SIGINT/SIGTERM during training:
    the step finished, a checkpoint and the report written), or KeyboardInterrupt (an interrupt
    outside training; report: interrupted).
    """
    console = console or Console()
    dist = init_distributed(cfg.device, cfg.distributed.strategy, cfg.distributed.reduce_dtype)
    try:
        return _train(cfg, output_dir, console, dist)
    finally:
        shutdown(dist)


def _train(cfg: RunConfig, output_dir: Path, console: Console, dist: DistContext) -> dict[str, Any]:
    if dist.is_main:
        check_output_dir(output_dir)
    else:
        console = Console(quiet=True)  # rank 0 speaks for the job
    facts = _RunFacts(
        cfg=cfg,
        output_dir=output_dir,
        started_at=dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        start_time=time.perf_counter(),
        dist=dist,
    )
    status, reason = "completed", None
    try:
        _setup_and_train(facts, console)
    except ConfigError:
        raise
    except KeyboardInterrupt:
        status, reason = "interrupted", f"interrupted at step {facts.state.step}"
        _finish(facts, status, reason, console)
        raise
    except Exception as exc:
        status, reason = "failed", f"{type(exc).__name__}: {exc}"
        report = _finish(facts, status, reason, console)
        raise RunFailed(status, reason, report) from exc
    if facts.state.diverged_reason:
        status, reason = "diverged", facts.state.diverged_reason
    if facts.state.stopped and facts.stop is not None:
        import signal

        name = signal.Signals(facts.stop.signum).name
        saved = facts.checkpointer is not None and facts.state.step in facts.checkpointer.steps
        reason = f"{name} at step {facts.state.step}; " + (
            "checkpoint written, resume with resume=auto"
            if saved
            else "no checkpoint (checkpoint.enabled=false): progress is lost"
        )
        report = _finish(facts, "interrupted", reason, console)
        raise RunInterrupted(facts.stop.exit_code, report)
    report = _finish(facts, status, reason, console)
    if status != "completed":
        raise RunFailed(status, reason or status, report)
    return report


def _finish(facts: _RunFacts, status: str, reason: str | None, console: Console) -> dict[str, Any]:
    report = build_report(facts, status, reason)
    if not facts.dist.is_main:
        return report  # only rank 0 writes
    json_path, _ = write_report(facts.output_dir, report)  # first: the report must exist
    metrics_path = facts.output_dir / METRICS_JSONL
    if metrics_path.is_file():
        title = f"{report['precision']['label'] or facts.cfg.precision.name} {facts.cfg.model.name}"
        try:
            plot_run(read_metrics(metrics_path), title, facts.output_dir / RUN_PNG)
            report["figure"] = RUN_PNG
            write_report(facts.output_dir, report)
        except Exception as exc:  # a figure is not worth losing the run over; say so
            console.print(f"[yellow]warning:[/yellow] curves.png not written: {exc}")
    print_summary(console, report, json_path)
    return report
