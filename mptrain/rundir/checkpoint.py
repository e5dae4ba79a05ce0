"""Checkpoints that survive crashes, and exact resume.

A checkpoint holds everything the next step depends on: model (FP8 scales and amax histories are
buffers, so they come with it), optimizer, LR scheduler, loss scaler (scale and growth tracker),
the loop's counters and history (step, epoch, skipped steps, scale history, evaluations), every RNG
(python, numpy, torch CPU and CUDA) and the resolved config; and, for using the trained model
(:mod:`mptrain.commands.evaluate`), the data facts: input shape, class names and preprocessing. The data position is implied: the
order of epoch ``e`` is a function of (seed, e), and the step count says how far into it we are.

Writes are atomic: ``torch.save`` to a temporary file in the same directory, flush, fsync, rename;
only then does ``latest.json`` move to it (written the same way). A crash or kill at any moment
leaves the previous checkpoint and pointer loadable; stray temporary files are removed on the next
start. Resuming in FP32 on a CPU reproduces an uninterrupted run bit for bit. ``best.pt``, when
the best evaluation falls on a saved step, is a hard link to that step's file: no second write and
no second copy on disk, and pruning the step leaves ``best.pt`` whole.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import pickle
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from mptrain.config.keys import flatten, is_non_training_key
from mptrain.config.schema import ConfigError, RunConfig
from mptrain.platform.distributed import (
    load_model_state,
    load_optimizer_state,
    model_state,
    optimizer_state,
)
from mptrain.platform.seeding import restore_rng_states, rng_states
from mptrain.rundir.fileio import atomic_link, atomic_write
from mptrain.train.cadence import TimeCadence
from mptrain.train.state import LoopState

if TYPE_CHECKING:
    from mptrain.precision.policy import PrecisionPolicy
    from mptrain.train.components import Run

CHECKPOINT_DIR = "checkpoints"
LATEST = "latest.json"
FORMAT_VERSION = 2  # 2: loadable with torch.load(weights_only=True)
_NAME = re.compile(r"step_(\d+)\.pt$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or read; the message names the file."""


class CheckpointRefused(CheckpointError):
    """A file that loads but must not be used: unsafe to unpickle, or another format version.
    Not corrupt, so never quarantined or silently skipped."""


# ------------------------------------------------------------------------------------ writing
def atomic_torch_save(obj: Any, path: Path) -> None:
    """``torch.save`` so that ``path`` is either absent/old or complete, never partial."""
    try:
        atomic_write(path, lambda f: torch.save(obj, f), binary=True)
    except Exception as exc:
        # torch.save wraps a failed write in a RuntimeError: look through the chain for ENOSPC.
        cause: BaseException | None = exc
        while cause is not None:
            if isinstance(cause, OSError) and cause.errno == errno.ENOSPC:
                raise CheckpointError(
                    f"no space left on device while writing checkpoint {path}; the previous "
                    "checkpoint is intact"
                ) from exc
            cause = cause.__cause__ or cause.__context__
        raise


def _atomic_json(obj: Any, path: Path) -> None:
    atomic_write(path, lambda f: json.dump(obj, f))


class Checkpointer:
    """Saves checkpoints on the configured cadence, keeps the last K and the best, atomically."""

    def __init__(self, directory: Path, run: Run, signature: dict[str, Any]) -> None:
        self.run = run
        self.dist = run.dist
        self.directory = directory
        self.signature = signature
        c = run.cfg.checkpoint
        self.every_steps = c.every_steps
        self.every_epoch = c.every_epoch
        self.clock = TimeCadence(c.every_minutes)  # since the loop started or the last save
        self.keep_last = c.keep_last
        self.keep_best = c.keep_best
        self.saved: list[Path] = []
        self.steps: set[int] = set()  # steps saved by this run
        self.best: tuple[float, Path] | None = None
        if self.dist.is_main:
            directory.mkdir(parents=True, exist_ok=True)
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
            "scaler": run.scaler.state_dict() if run.scaler.is_enabled() else None,
            "loop": {**state.state_dict(), **run.monitor.state_dict()},
            "rng": rng_states(),
            "signature": self.signature,
            "world_size": self.dist.world_size,
            "config": dataclasses.asdict(run.cfg),
            "data": data_facts(run),
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
        path = self.directory / f"step_{state.step:08d}.pt"
        payload = self.payload(state)
        if not self.dist.is_main:
            self.steps.add(state.step)
            return path
        atomic_torch_save(payload, path)
        _atomic_json({"checkpoint": path.name, "step": state.step}, self.directory / LATEST)
        self.steps.add(state.step)
        if path not in self.saved:
            self.saved.append(path)
        if self._new_best(state):
            # The same state: a second name for the file just written, not a second write.
            self._record_best(state, lambda best_path: atomic_link(path, best_path))
        self._prune()
        return path

    def _prune(self) -> None:
        while len(self.saved) > self.keep_last:
            old = self.saved.pop(0)
            old.unlink(missing_ok=True)

    def after_step(self, state: LoopState, end_of_epoch: bool) -> None:
        run = self.run
        due = (
            (self.every_steps and state.step % self.every_steps == 0)
            or (self.every_epoch and end_of_epoch)
            or self.clock.due(state.step, run.settings.log_every, self.dist, run.device)
        )
        if due:
            self.save(state)
        elif self._new_best(state):
            with self.run.monitor.paused("checkpoint"):
                payload = self.payload(state)  # every rank: a collective under FSDP
                self._record_best(state, lambda best_path: atomic_torch_save(payload, best_path))

    def _new_best(self, state: LoopState) -> bool:
        if not self.keep_best or not state.evals or state.evals[-1]["step"] != state.step:
            return False  # no evaluation at this step (checked first: this runs every step)
        task = self.run.task
        best = task.best(state.evals)
        if best is None or best["step"] != state.step:
            return False
        return self.best is None or task.better(best[task.primary_metric], self.best[0])

    def _record_best(self, state: LoopState, write: Callable[[Path], None]) -> None:
        """Rank 0: ``write(best.pt)`` and remember the primary metric it holds."""
        if self.dist.is_main:
            best_path = self.directory / "best.pt"
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
        # Token data: the window length and the characters of a character vocabulary (None:
        # bytes), all that mptrain sample needs to encode a prompt and decode the tokens.
        "sequence_length": data.sequence_length,
        "vocabulary": None if data.text is None else data.text.vocabulary.chars,
    }


def remove_stray_temporaries(directory: Path) -> list[Path]:
    """Delete temporaries a killed save left behind (they are never a valid checkpoint)."""
    stray = list(directory.glob(".*.tmp"))
    for path in stray:
        path.unlink(missing_ok=True)
    return stray


# ------------------------------------------------------------------------------------ reading
def _unreadable(path: Path, exc: Exception) -> CheckpointError:
    return CheckpointError(
        f"checkpoint {path}: unreadable ({type(exc).__name__}: {str(exc).splitlines()[0]}); "
        "it may be truncated or corrupt"
    )


def load_checkpoint(path: Path) -> dict[str, Any]:
    """Load a checkpoint safely: ``torch.load(weights_only=True)``, which unpickles tensors and
    plain Python types only, so a checkpoint from an untrusted source cannot run code. A
    truncated or corrupt file, or one that needs more than that, raises CheckpointError naming it.
    """
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError as exc:
        raise CheckpointError(f"checkpoint {path}: no such file") from exc
    except pickle.UnpicklingError as exc:
        if "Unsupported global" not in str(exc):  # torch's words for a refused object
            raise _unreadable(path, exc) from exc
        raise CheckpointRefused(
            f"checkpoint {path}: refused: it holds objects other than tensors and plain Python "
            "types, which could run code when loaded (mptrain checkpoints never do: written by "
            "something else, or by an mptrain older than checkpoint format 2)"
        ) from exc
    except Exception as exc:
        raise _unreadable(path, exc) from exc
    if not isinstance(payload, dict) or payload.get("format_version") != FORMAT_VERSION:
        raise CheckpointRefused(f"checkpoint {path}: not an mptrain checkpoint of this version")
    return payload


def quarantine(path: Path) -> str:
    """Rename a checkpoint that does not load to ``<name>.corrupt``: kept for inspection, never
    counted as a checkpoint again (keep_last counts loadable ones, pruning cannot keep it in
    place of a good one). Returns what was done, for the run's notes."""
    target = path.with_name(path.name + ".corrupt")
    try:
        path.replace(target)
    except OSError as exc:
        return f"could not quarantine it ({exc.strerror})"
    return f"quarantined as {target.name}"


def candidates(directory: Path) -> list[Path]:
    """Checkpoints in a run's checkpoint directory, newest first (latest.json's target first)."""
    files = sorted(
        (p for p in directory.glob("step_*.pt") if _NAME.search(p.name)),
        key=lambda p: int(_NAME.search(p.name).group(1)),
        reverse=True,
    )
    latest = directory / LATEST
    if latest.is_file():
        try:
            target = directory / json.loads(latest.read_text())["checkpoint"]
            if target in files:
                files.remove(target)
                files.insert(0, target)
        except (ValueError, KeyError, OSError):
            pass
    return files


def newest_loadable(
    directory: Path, key: str, *, quarantine_unreadable: bool
) -> tuple[tuple[Path, dict[str, Any]] | None, list[str]]:
    """((path, payload) of the newest checkpoint in ``directory`` that loads, or None; a note per
    unreadable one skipped, each set aside as ``*.corrupt`` when ``quarantine_unreadable``).
    A checkpoint that is intact but refused (another format) is a ConfigError naming ``key``:
    falling back past it would start over, or evaluate an older state, without saying so."""
    notes: list[str] = []
    for path in candidates(directory):
        try:
            return (path, load_checkpoint(path)), notes
        except CheckpointRefused as exc:
            raise ConfigError(f"{key}: {exc}") from exc
        except CheckpointError as exc:
            notes.append(
                f"skipped {exc}; {quarantine(path)}" if quarantine_unreadable else f"skipped {exc}"
            )
    return None, notes


def resolve_resume(resume: str, output_dir: Path) -> tuple[Path, dict[str, Any], list[str]] | None:
    """(path, payload, notes) for ``resume=PATH|auto``; None when auto finds nothing.

    PATH may be a checkpoint file, a run directory or its checkpoints/ directory. ``auto`` looks
    in this run's directory and falls back past unreadable checkpoints to the newest that loads;
    an explicit file that does not load is an error.
    """
    if resume == "auto":
        directory = output_dir / CHECKPOINT_DIR
        if not directory.is_dir():
            return None
        found, notes = newest_loadable(directory, "resume=auto", quarantine_unreadable=True)
        return (*found, notes) if found is not None else None
    path = Path(resume)
    if path.is_dir():
        directory = path / CHECKPOINT_DIR if (path / CHECKPOINT_DIR).is_dir() else path
        found = candidates(directory)
        if not found:
            raise ConfigError(f"resume={resume!r}: no checkpoint (step_*.pt) in {directory}")
        path = found[0]
    if not path.exists():
        raise ConfigError(f"resume={resume!r}: no such file or directory")
    try:
        return path, load_checkpoint(path), []
    except CheckpointError as exc:  # the user named this file: bad input, before training
        raise ConfigError(f"resume={resume!r}: {exc}") from exc


# Training settings added after checkpoints were first written, with the value that computes what
# a checkpoint without them computed: an older checkpoint resumes when the run keeps that value.
ADDED_SETTINGS: dict[str, Any] = {
    "task": "classify",
    "fp8.pow2_scales": False,
    "fp8.min_features": 0,
    "fp8.granularity": "tensorwise",
}


def check_compatible(
    payload: dict[str, Any], signature: dict[str, Any], path: Path, allow_changes: bool
) -> list[str]:
    """Refuse a resume whose training settings differ from the checkpoint's, listing every
    difference, unless allowed. Returns the differences that were allowed (recorded in the
    report; :func:`restore` applies them)."""
    saved = {**_added_defaults(payload["signature"]), **payload["signature"]}
    differences = [
        f"{key}: checkpoint {saved.get(key)!r}, now {signature.get(key)!r}"
        for key in dict.fromkeys([*signature, *saved])  # both key sets, in order
        if saved.get(key) != signature.get(key)
    ]
    if differences and not allow_changes:
        raise ConfigError(
            f"resume: {path} was saved with different settings ({'; '.join(differences)}); "
            "set resume_allow_changes=true to resume anyway"
        )
    return differences


def _added_defaults(saved: dict[str, Any]) -> dict[str, Any]:
    """The :data:`ADDED_SETTINGS` an older signature lacks (FP8 keys only if it ran FP8)."""
    fp8 = any(key.startswith("fp8.") for key in saved)
    return {
        key: value
        for key, value in ADDED_SETTINGS.items()
        if key not in saved and (fp8 or not key.startswith("fp8."))
    }


def restore(payload: dict[str, Any], run: Run, path: Path) -> list[str]:
    """Load every saved state into the freshly built run: components, loop state, monitor, RNGs.

    This run's optimizer and schedule settings win over the checkpoint's (they equal them unless
    ``resume_allow_changes=true`` allowed a change): the saved optimizer state brings its own
    hyperparameters, which are replaced by the configured ones. Returns notes for the report.
    """
    model, optimizer = run.checkpoint_model, run.optimizer
    load_model_state(model, payload["model"], run.dist)
    notes = []
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
    if run.scaler.is_enabled():
        if payload["scaler"] is None:
            raise ConfigError(
                f"resume: {path} holds no loss-scaler state (saved without loss scaling); an FP16 "
                "run cannot start from an empty scaler. Resume with the checkpoint's precision"
            )
        run.scaler.load_state_dict(payload["scaler"])
    run.state.load_state_dict(payload["loop"])
    run.monitor.load_state_dict(payload["loop"])
    restore_rng_states(payload["rng"])
    return notes


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
        group["lr"] = base * factor(step)
    scheduler._last_lr = [group["lr"] for group in groups]


def run_signature(cfg: RunConfig, policy: PrecisionPolicy) -> dict[str, Any]:
    """What a checkpoint must agree on to be resumed: every training setting, flattened
    (``optimizer.lr``, ``scheduler.name``, ``batch_size``, ...), with the precision that ran.

    Settings that do not change what a run computes (:data:`mptrain.config.keys.NON_TRAINING_KEYS`)
    are left out, and so are the FP8 settings unless the run is FP8, and the distributed ones.
    """
    settings = flatten(dataclasses.asdict(cfg))
    # The seed too: it orders the data and draws dropout (sweeps pair runs across seeds, so
    # the comparison policy leaves it out).
    signature: dict[str, Any] = {"precision": policy.name, "seed": cfg.seed}
    for key, value in settings.items():
        fp8_unused = key.startswith("fp8.") and policy.fp8 is None
        # distributed.*: how the work is spread; a change of world size or strategy is resumed
        # by design (full state dicts) and noted separately.
        where = key.startswith(("precision.name", "distributed."))
        if where or fp8_unused or is_non_training_key(key):
            continue
        signature[key] = value
    return signature
