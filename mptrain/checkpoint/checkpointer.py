"""Checkpoints during training: when to save, keeping the last K and the best, and resume.

The :class:`Checkpointer` saves on the configured cadence (steps, epochs, minutes) in the format
:mod:`mptrain.checkpoint.file` defines, keeps the last ``keep_last`` and ``best.pt`` (a hard link
to the step file when the best evaluation falls on a saved step). :func:`restore` loads a
checkpoint's every state into a freshly built :class:`~mptrain.train.components.Run`;
:func:`run_signature` is what a checkpoint must agree on to be resumed.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from mptrain.checkpoint.file import (
    DATA_IDENTITY,
    FORMAT_VERSION,
    atomic_torch_save,
    remove_stray_temporaries,
)
from mptrain.config.base import ConfigError
from mptrain.config.keys import flatten, is_non_training_key
from mptrain.config.run import RunConfig
from mptrain.pace.clocks import TimeCadence
from mptrain.platform.distributed import (
    broadcast_flag,
    load_model_state,
    load_optimizer_state,
    model_state,
    optimizer_state,
)
from mptrain.platform.seeding import restore_rng_states, rng_states
from mptrain.rundir.fileio import atomic_link, atomic_write_text
from mptrain.rundir.layout import BEST, LATEST, candidates, step_checkpoint_name
from mptrain.train.state import LoopState

if TYPE_CHECKING:
    from mptrain.precision.plugin import Precision
    from mptrain.train.components import Run


class Checkpointer:
    """Saves checkpoints on the configured cadence, keeps the last K and the best, atomically."""

    def __init__(self, directory: Path, run: Run, signature: dict[str, Any]) -> None:
        self.run = run
        self.dist = run.dist
        self.directory = directory
        self.signature = signature
        self.config = run.cfg.checkpoint  # the cadence, keep_last and keep_best
        self.clock = TimeCadence(self.config.every_minutes)  # since the loop started or last save
        self.saved: list[Path] = []
        self.steps: set[int] = set()  # steps saved by this run
        self.best: tuple[float, Path] | None = None
        # True once per checkpoint signal (mptrain.platform.signals.CheckpointOnSignal.take).
        self.asked: Callable[[], bool] = lambda: False
        if self.dist.is_main:
            directory.mkdir(parents=True, exist_ok=True)
            pointer = directory / LATEST
            if pointer.exists() and not pointer.is_file():  # found now, not at the first save
                raise ConfigError(
                    f"{pointer}: not a file (a directory?), so no checkpoint could be recorded "
                    "there; move it away or choose another hydra.run.dir"
                )
            remove_stray_temporaries(directory)
            # Files of an earlier (interrupted) run of this directory count towards keep_last.
            self.saved = list(reversed(candidates(directory)))

    def payload(self, state: LoopState) -> dict[str, Any]:
        run = self.run
        model = run.checkpoint_model
        return {
            "format_version": FORMAT_VERSION,
            "model": model_state(model, self.dist),
            "optimizer": optimizer_state(model, run.optimizer, self.dist),
            "scheduler": run.scheduler.state_dict(),
            # the loss scaler, nvfp4's stochastic-rounding generators, precision.update's state
            **run.precision.state_dict(),
            "loop": {**state.state_dict(), **run.monitor.state_dict()},
            "rng": rng_states(),
            "signature": self.signature,
            "world_size": self.dist.world_size,
            # threads=auto: the count in effect now, which a resume keeps (train/threads.py)
            "threads": torch.get_num_threads(),
            "config": dataclasses.asdict(run.cfg),
            "data": data_facts(run),
            # precision.switch: which phase the checkpoint is in (mptrain.train.switch)
            "precision_switch": run.schedule.state_dict(),
        }

    def save(self, state: LoopState) -> Path:
        """Write ``step_<N>.pt`` atomically, then move ``latest.json`` to it; prune old ones.

        Distributed: every rank gathers (a collective under FSDP); only rank 0 writes.
        """
        with self.run.monitor.paused("checkpoint"):  # not training time
            path = self._save(state)
        self.clock.restart()
        return path

    def _save(self, state: LoopState) -> Path:
        path = self.directory / step_checkpoint_name(state.step)
        payload = self.payload(state)
        if self.dist.is_main:
            atomic_torch_save(payload, path)
            pointer = json.dumps({"checkpoint": path.name, "step": state.step})
            atomic_write_text(self.directory / LATEST, pointer)
            if path not in self.saved:
                self.saved.append(path)
            if self._new_best(state):
                # The same state: a second name for the file just written, not a second write.
                self._record_best(state, lambda best_path: atomic_link(path, best_path))
            while len(self.saved) > self.config.keep_last:  # prune the oldest
                self.saved.pop(0).unlink(missing_ok=True)
        self.steps.add(state.step)
        return path

    def after_step(self, state: LoopState, end_of_epoch: bool) -> None:
        run, c = self.run, self.config
        due = (
            (c.every_steps and state.step % c.every_steps == 0)
            or (c.every_epoch and end_of_epoch)
            or self.clock.due(state.step, run.settings.log_every, self.dist, run.device)
            or self._asked(state.step)
        )
        if due:
            self.save(state)
        elif self._new_best(state):
            with self.run.monitor.paused("checkpoint"):
                payload = self.payload(state)  # every rank: a collective under FSDP
                self._record_best(state, lambda best_path: atomic_torch_save(payload, best_path))

    def _asked(self, step: int) -> bool:
        """A checkpoint signal came: the same answer on every rank, agreed at log rows as the
        clock is (mptrain.pace.clocks), after every step in a single process."""
        if not self.dist.enabled:
            return self.asked()
        if step % self.run.settings.log_every:
            return False
        return broadcast_flag(self.asked(), self.dist, self.run.device)

    def _new_best(self, state: LoopState) -> bool:
        if not self.config.keep_best or not state.evals or state.evals[-1]["step"] != state.step:
            return False  # no evaluation at this step (checked first: this runs every step)
        task = self.run.task
        best = task.best(state.evals)
        if best is None or best["step"] != state.step:
            return False
        return self.best is None or task.better(best[task.primary_metric], self.best[0])

    def _record_best(self, state: LoopState, write: Callable[[Path], None]) -> None:
        """Rank 0: ``write(best.pt)`` and remember the primary metric it holds."""
        if self.dist.is_main:
            best_path = self.directory / BEST
            write(best_path)
            task = self.run.task
            self.best = (task.best(state.evals)[task.primary_metric], best_path)


def data_facts(run: Run) -> dict[str, Any]:
    """What rebuilding and feeding the model needs beyond ``config`` (plain types only): the
    shapes the model was built for, the class names in label order, and the preprocessing raw
    inputs get (:func:`mptrain.data.build.preprocessing`); see :mod:`mptrain.commands.evaluate`."""
    data = run.data
    return {
        "num_classes": data.num_classes,
        "in_channels": data.in_channels,
        "image_size": data.image_size,
        "classes": None if data.classes is None else list(data.classes),
        "preprocessing": data.preprocessing,
        "description": data.description,
        # Token data: the window length, the characters of a character vocabulary (None: bytes)
        # and a tokenizer file's content (None: none), all that mptrain sample needs to encode a
        # prompt and decode the tokens (mptrain.data.text.Vocabulary.of_checkpoint).
        "sequence_length": data.sequence_length,
        "vocabulary": None,
        "tokenizer": None,
        **({} if data.text is None else data.text.vocabulary.checkpoint_facts()),
    }


def restore(payload: dict[str, Any], run: Run, path: Path) -> list[str]:
    """Load every saved state into the freshly built run: components, loop state, monitor, RNGs.

    This run's optimizer and schedule settings win over the checkpoint's (they equal them unless
    ``resume_allow_changes=true`` allowed a change): the saved optimizer state brings its own
    hyperparameters, which are replaced by the configured ones. Returns notes for the report.
    """
    # A checkpoint saved after a precision switch holds the second precision's layers and
    # scaler: the run switches first (absent in checkpoints written before schedules existed).
    notes = run.schedule.load_state_dict(run, payload.get("precision_switch"))
    model, optimizer = run.checkpoint_model, run.optimizer
    load_model_state(model, payload["model"], run.dist)
    saved_optimizer = payload["config"]["optimizer"]["name"]
    if saved_optimizer == run.cfg.optimizer.name:
        configured = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        try:
            load_optimizer_state(model, optimizer, payload["optimizer"], run.dist)
        except ValueError as exc:  # e.g. weight decay 0 <-> > 0 changed the parameter groups
            notes.append(f"optimizer state not resumed ({exc}): it starts fresh")
        for group, settings in zip(optimizer.param_groups, configured, strict=True):
            group.update(settings)  # this run's hyperparameters and implementation (fused...)
    else:
        notes.append(
            f"optimizer changed ({saved_optimizer} -> {run.cfg.optimizer.name}): its state "
            "(moments, momentum) starts fresh; weights, schedule position and scaler are resumed"
        )
    _restore_schedule(run.scheduler, payload["scheduler"])
    run.state.load_state_dict(payload["loop"])
    run.monitor.load_state_dict(payload["loop"])
    restore_rng_states(payload["rng"])
    return notes + run.precision.load_state_dict(payload, path)


def _restore_schedule(scheduler: torch.optim.lr_scheduler.LambdaLR, saved: dict[str, Any]) -> None:
    """The schedule's position (applied steps) from the checkpoint; its peak lr and shape from
    this run's config, and the optimizer's lr set to where that schedule is now."""
    base_lrs = list(scheduler.base_lrs)
    scheduler.load_state_dict(saved)
    scheduler.base_lrs = base_lrs
    step = scheduler.last_epoch
    groups = scheduler.optimizer.param_groups
    for group, base, factor in zip(groups, base_lrs, scheduler.lr_lambdas, strict=True):
        group["initial_lr"] = base
        if torch.is_tensor(group["lr"]):  # torchao's optimizers keep it a tensor (no recompiles)
            group["lr"].fill_(base * factor(step))
        else:
            group["lr"] = base * factor(step)
    scheduler._last_lr = [float(group["lr"]) for group in groups]


def run_signature(
    cfg: RunConfig, precision: Precision, data_identity: str | None = None
) -> dict[str, Any]:
    """What a checkpoint must agree on to be resumed: every training setting, flattened
    (``optimizer.lr``, ``scheduler.name``, ``batch_size``, ...), with the precision that ran and
    what the data was (``data.identity``: the DataBundle's digest of its content, when it has one;
    a path alone does not say the text behind it is the same).

    Settings that do not change what a run computes (:data:`mptrain.config.keys.NON_TRAINING_KEYS`)
    are left out, and so are the distributed ones; of the precision's, the run's precision object
    says which it signs (:meth:`~mptrain.precision.plugin.Precision.signs`).
    """
    settings = flatten(dataclasses.asdict(cfg))
    # The seed too: it orders the data and draws dropout (sweeps pair runs across seeds, so
    # the comparison policy leaves it out).
    signature: dict[str, Any] = {"precision": precision.policy.name, "seed": cfg.seed}
    switch_to = cfg.precision.switch.to
    for key, value in settings.items():
        # distributed.*: how the work is spread; a change of world size or strategy is resumed
        # by design (full state dicts) and noted separately.
        skipped = key.startswith("distributed.") or is_non_training_key(key)
        if skipped or not precision.signs(key, switch_to):
            continue
        signature[key] = value
    if data_identity is not None:
        signature[DATA_IDENTITY] = data_identity
    return signature
