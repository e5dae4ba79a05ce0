"""Building a run: everything the training loop needs, from a typed config.

:func:`prepare_run` is the one setup path — ``mptrain bench``, the tests and the benchmarks call
it; ``mptrain`` runs call its two halves, :func:`resolve_run` (seed, device, precision policy,
TF32 flags) and :func:`build_run` (the rest, in the order its body reads), so that a report
written after a failed build still names the device, precision and TF32 flags. It returns a
:class:`Run`; :func:`mptrain.train.loop.train_loop` trains it. Combinations that cannot
run are refused by :func:`check_run` before anything is built; what only the built objects reveal
(no FP8-eligible layer, no module matching ``numerics.fp32_modules``, a batch larger than the
dataset, missing files) raises :class:`~mptrain.config.base.ConfigError` during the build.
"""

from __future__ import annotations

import functools
import operator
import os
from dataclasses import replace
from typing import Any

import torch

from mptrain.config.base import ConfigError
from mptrain.config.models import lm_block_size
from mptrain.config.recipes import check_recipe_source
from mptrain.config.run import MAX_STEPS, RunConfig
from mptrain.data.batches import BatchLayout, DataBundle
from mptrain.data.build import build_data
from mptrain.models.build import build_model, count_parameters
from mptrain.models.task import Task, cross_entropy
from mptrain.platform import hardware
from mptrain.platform.distributed import DistContext, wrap_model
from mptrain.platform.dtypes import dtype_name
from mptrain.platform.seeding import seed_everything
from mptrain.precision.formats import layer_format
from mptrain.precision.gemm_plans import check_gemms, own_format
from mptrain.precision.plugin import Precision
from mptrain.precision.policy import (
    PrecisionPolicy,
    apply_tf32,
    resolve_precision,
)
from mptrain.precision.quant.dist import gathers_fp32
from mptrain.report.rows import plural
from mptrain.train import recompute
from mptrain.train.components import Run
from mptrain.train.faults import InfGradInjector
from mptrain.train.health import culprit_finder
from mptrain.train.monitor import Monitor, MonitorSettings
from mptrain.train.optim import build_optimizer, build_scheduler
from mptrain.train.recipe import check_recipe_data
from mptrain.train.state import LoopSettings
from mptrain.train.switch import plan_switch
from mptrain.train.threads import ThreadChoice, resolve_threads


def prepare_run(cfg: RunConfig, dist: DistContext | None = None) -> Run:
    """Seed, resolve the device and precision, set TF32, and build the run (see module doc)."""
    dist = dist or DistContext()
    device, policy, tf32 = resolve_run(cfg, dist)
    return build_run(cfg, device, policy, tf32, dist)


def resolve_run(
    cfg: RunConfig, dist: DistContext
) -> tuple[torch.device, PrecisionPolicy, dict[str, Any]]:
    """Seed (the same initial weights on every rank); decide device and precision; set TF32."""
    seed_everything(cfg.seed)
    device = hardware.resolve_device(cfg.device)
    if dist.enabled and device.type == "cuda":
        device = torch.device("cuda", dist.local_rank)  # one GPU per process
    policy = resolve_precision(cfg.precision, device, cfg.fp8, cfg.mx, cfg.nvfp4)
    return device, policy, apply_tf32(policy.allow_tf32)


def check_run(cfg: RunConfig, policy: PrecisionPolicy, dist: DistContext) -> None:
    """Refuse combinations that cannot run, before anything is built."""
    if cfg.debug.inject_inf_grad_steps and not policy.loss_scaling:
        raise ConfigError(
            "debug.inject_inf_grad_steps: needs a precision with loss scaling (fp16); "
            f"{policy.name} has no scaler to skip the step"
        )
    if cfg.numerics.fp32_modules and not policy.master_weights:
        raise ConfigError(
            f"numerics.fp32_modules: precision={policy.name} keeps its weights in "
            f"{dtype_name(policy.param_dtype)}, so no layer can run in FP32; "
            "use a mixed precision (fp16, bf16) instead"
        )
    if dist.enabled and (cfg.audit or cfg.probe):
        raise ConfigError("audit/probe: run them in a single process, not under torchrun")
    # phase 2's policy is resolved later (plan_switch); its layer format, by name, is known now
    to = cfg.precision.switch.to
    later = to is not None and layer_format(to, cfg.fp8.granularity) is not None
    check_gemms(cfg, converting=own_format(policy) is not None or later)
    if cfg.precision.update != "nearest" and dist.enabled and dist.strategy == "fsdp":
        raise ConfigError(
            f"precision.update={cfg.precision.update}: not under distributed.strategy=fsdp "
            "(its random bits and Kahan buffers are per whole parameter); use ddp"
        )


def build_run(
    cfg: RunConfig,
    device: torch.device,
    policy: PrecisionPolicy,
    tf32: dict[str, Any],
    dist: DistContext,
    *,
    jobs: int = 1,
    measure_threads: bool = False,
) -> Run:
    """Data, threads, model (FP32 parameters on ``device``), optimizer, schedule, scaler, loop.

    Threads (:func:`choose_threads`, after the data: its workers count): ``jobs`` share the
    machine; ``measure_threads``: the caller measures ``threads=auto`` on training steps (the
    job; bench and advise time precisions themselves). Distributed: this rank's data shard, the
    model wrapped in DDP or FSDP2 before the optimizer is built on its (possibly sharded)
    parameters; then every rank reseeds with ``seed + rank`` (its own dropout and randomness).
    """
    check_run(cfg, policy, dist)
    data = _checked_data(cfg, device, dist)
    threads = choose_threads(cfg.threads, device, data, dist, jobs, measure_threads)
    fsdp = dist.enabled and dist.strategy == "fsdp"
    model, precision = build_model_for_run(cfg, data, device, policy, fsdp)
    precision.tf32 = tf32
    num_parameters = count_parameters(model)
    # FSDP computes in the recipe's dtype through its own policy (autocast stays on for the rest).
    model = wrap_model(model, dist, device, policy.autocast_dtype, gathers_fp32)
    precision.sync_layers(model, dist, cfg)
    settings = plan_loop(cfg, data, dist)
    optimizer = build_optimizer(cfg.optimizer, model, fused=dist.strategy != "fsdp")
    steps = (settings.steps_per_epoch, settings.total_steps)
    scheduler = build_scheduler(cfg.scheduler, optimizer, *steps)
    model = torch.compile(model) if cfg.compile else model
    precision.setup(optimizer, cfg, dist, device)
    run = Run(
        cfg=cfg,
        device=device,
        precision=precision,
        dist=dist,
        data=data,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        loss_fn=functools.partial(cross_entropy, label_smoothing=cfg.label_smoothing),
        task=Task(cfg.task, tokens_per_sample=data.sequence_length),
        settings=settings,
        monitor=_build_monitor(cfg, data, model, policy, dist, device),
        num_parameters=num_parameters,
        threads=threads,
        schedule=plan_switch(cfg, policy, device, dist, settings.total_steps),
    )
    run.monitor.loss_window = run.schedule.loss_window()  # the losses around a switch
    _install_faults(run)
    if dist.enabled:
        seed_everything(cfg.seed + dist.rank)  # per-rank dropout and other randomness
    return run


# What a policy's build depends on: two policies alike here share one built run (with_policy).
_build_of = operator.attrgetter("param_dtype", "fp8", "blocks", "loss_scaling", "device_type")


def with_policy(run: Run, policy: PrecisionPolicy) -> Run:
    """``run`` with another precision of the same build (``precision=auto`` settled after the
    build: :mod:`mptrain.train.autoprecision`): the same parameter dtype, FP8 layers and loss
    scaling, so only the policy and the monitor that names it are new. Before training only."""
    old = run.precision.policy
    if _build_of(old) != _build_of(policy):
        raise ValueError(f"{old.name} -> {policy.name}: not the same build; build the run again")
    monitor = _build_monitor(run.cfg, run.data, run.model, policy, run.dist, run.device)
    return replace(run, precision=replace(run.precision, policy=policy), monitor=monitor)


def _checked_data(cfg: RunConfig, device: torch.device, dist: DistContext) -> DataBundle:
    """The run's data, checked against a recipe's: a cheap look before reading it (name, size),
    then what was read (the checksum), before a model is built."""
    check_recipe_source(cfg)
    data = build_data(cfg.dataset, _batch_layout(cfg, device, dist))
    check_recipe_data(cfg, data)
    return data


def choose_threads(
    requested: str,
    device: torch.device,
    data: DataBundle,
    dist: DistContext,
    jobs: int = 1,
    measure: bool = False,
) -> ThreadChoice:
    """Decide and set the intra-op thread count (:func:`mptrain.train.threads.resolve_threads`).

    The training feed's DataLoader workers run on the same cores; the processes torchrun started
    on this node share them like concurrent jobs. A distributed run is not measured: its ranks
    wait for each other, so one rank's step time says little about its own thread count.
    """
    workers = getattr(data.train, "num_workers", 0)  # only DataLoader feeds have workers
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if dist.enabled else 1
    choice = resolve_threads(
        requested,
        device.type,
        workers=workers,
        jobs=jobs * local_world,
        measure=measure and not dist.enabled,
    )
    torch.set_num_threads(choice.threads)
    return choice


def _batch_layout(cfg: RunConfig, device: torch.device, dist: DistContext) -> BatchLayout:
    """How this rank's batches are cut: sizes, device, seed, its shard and window length."""
    return BatchLayout(
        batch_size=cfg.batch_size,
        eval_batch_size=cfg.eval_batch_size,
        device=device,
        seed=cfg.seed,
        num_workers=cfg.num_workers,
        rank=dist.rank,
        world=dist.world_size,
        sequence_length=window_length(cfg),
    )


def build_model_for_run(
    cfg: RunConfig,
    data: DataBundle,
    device: torch.device,
    policy: PrecisionPolicy,
    fsdp: bool = False,
) -> tuple[torch.nn.Module, Precision]:
    """The model with ``policy`` applied (:meth:`Precision.convert_module`: its layer format,
    FP32 islands, a pure precision's cast), in channels_last when asked, and the run's
    precision object holding what the conversion made (the scaler and the rest come with
    :meth:`Precision.setup`, once there is an optimizer).

    ``fsdp``: the model will be sharded with FSDP2 (torchao's FP8 layers then all-gather in FP8).
    """
    model = build_model(
        cfg.model, data.in_channels, data.image_size, data.num_classes, device, data.sequence_length
    )
    precision = Precision(policy)
    model = precision.convert_module(model, cfg, data, device, fsdp)
    scaling = policy.fp8.scaling if policy.fp8 is not None else None
    recompute.apply(model, cfg.memory.activation_checkpointing, cfg.model.name, scaling)
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model, precision


def window_length(cfg: RunConfig) -> int | None:
    """Tokens per sample of a language model (its ``model.block_size``); None for classifiers."""
    return lm_block_size(cfg.model) if cfg.task == "lm" else None


def plan_loop(cfg: RunConfig, data: DataBundle, dist: DistContext) -> LoopSettings:
    """The loop's settings; its optimizer steps per epoch and in all for the configured length:
    epochs, max_steps, or the first reached of both (see :class:`RunConfig`'s ``epochs``)."""
    steps_per_epoch = data.train.num_batches // cfg.grad_accum_steps
    if steps_per_epoch < 1:
        raise ConfigError(
            f"grad_accum_steps={cfg.grad_accum_steps}: batch_size x grad_accum_steps = "
            f"{cfg.batch_size * cfg.grad_accum_steps} exceeds the {data.num_train} training samples"
        )
    by_epochs = None if cfg.epochs is None else cfg.epochs * steps_per_epoch
    total_steps = min(limit for limit in (by_epochs, cfg.max_steps) if limit is not None)
    if total_steps > MAX_STEPS:
        raise ConfigError(
            f"epochs={cfg.epochs}: {total_steps:,} steps of {steps_per_epoch} per epoch; at most "
            f"{MAX_STEPS:,} steps"
        )
    return LoopSettings(
        total_steps=total_steps,
        steps_per_epoch=steps_per_epoch,
        length=ending_limit(cfg.epochs, cfg.max_steps, steps_per_epoch),
        grad_accum_steps=cfg.grad_accum_steps,
        clip_grad_norm=cfg.clip_grad_norm,
        eval_every=cfg.eval_every,
        eval_every_minutes=cfg.eval_every_minutes,
        log_every=cfg.log_every,
        probe_every=cfg.probe_every,
        channels_last=cfg.channels_last,
        dist=dist,
    )


def ending_limit(epochs: int | None, max_steps: int | None, steps_per_epoch: int) -> str:
    """Which limit ends the run, in words: ``max_steps=2000``, ``15 epochs``, ``max_steps=400,
    before 15 epochs``, ``15 epochs, before max_steps=2000``."""
    if epochs is None:
        return f"max_steps={max_steps}"
    passes = plural(epochs, "epoch")
    if max_steps is None:
        return passes
    if max_steps < epochs * steps_per_epoch:
        return f"max_steps={max_steps}, before {passes}"
    return f"{passes}, before max_steps={max_steps}"


def _build_monitor(
    cfg: RunConfig,
    data: DataBundle,
    model: torch.nn.Module,
    policy: PrecisionPolicy,
    dist: DistContext,
    device: torch.device,
) -> Monitor:
    settings = MonitorSettings(
        samples_per_step=data.train.batch_size * cfg.grad_accum_steps * dist.world_size,
        tokens_per_sample=data.sequence_length,
        precision=policy.name,
        throughput_warmup_steps=cfg.throughput_warmup_steps,
        health=cfg.numerics,
        # The re-run of a batch would call collectives on some ranks only: single process only.
        find_culprit=cfg.numerics.find_culprit and not dist.enabled,
    )
    return Monitor(settings, device, culprit_finder(model, policy.autocast))


def _install_faults(run: Run) -> None:
    """``debug.inject_inf_grad_steps``: hook the scaler and first parameter (see faults.py)."""
    debug = run.cfg.debug
    if not debug.inject_inf_grad_steps or debug.inject_inf_grad_rank not in (None, run.dist.rank):
        return
    injector = InfGradInjector(
        frozenset(debug.inject_inf_grad_steps),
        run.settings.grad_accum_steps,
        sharded=run.dist.enabled and run.dist.strategy == "fsdp",
        steps_done=lambda: run.state.step,
    )
    injector.install(run.model, run.precision.scaler)
