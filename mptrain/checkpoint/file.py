"""The checkpoint file: its format, atomic writes, safe loading and the lookup used by resume.

When to save, what a checkpoint holds (``Checkpointer.payload``: everything the next step depends
on, and the data facts :mod:`mptrain.commands.evaluate` needs) and how a run is restored:
:mod:`mptrain.checkpoint.checkpointer`. The data position is implied: the order of epoch ``e`` is
a function of (seed, e), and the step count says how far into it.

Writes are atomic (:func:`mptrain.rundir.fileio.atomic_write`), and only then does ``latest.json``
move to the new checkpoint: a crash or kill at any moment leaves the previous checkpoint and
pointer loadable; stray temporary files are removed on the next start.
"""

from __future__ import annotations

import errno
import pickle
import re
import zipfile
from pathlib import Path
from typing import Any

import torch

from mptrain.config.base import ConfigError
from mptrain.config.keys import is_non_training_key
from mptrain.rundir.fileio import atomic_write
from mptrain.rundir.layout import BEST, CHECKPOINT_DIR, candidates

FORMAT_VERSION = 2  # 2: loadable with torch.load(weights_only=True)
Found = tuple[Path, dict[str, Any], list[str]]  # a checkpoint found: (path, payload, notes)


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
        # In a torch.save zip archive (every mptrain checkpoint), an UnpicklingError is the
        # weights-only unpickler saying no: a truncated or garbled archive fails before, as a
        # RuntimeError. Recognised by that, whatever torch's wording ("Unsupported global",
        # "... whose module posix is blocked"); torch's advice (weights_only=False) is never
        # repeated. A file that is no zip archive at all is unreadable, not refused.
        if not zipfile.is_zipfile(path):  # the unpickler's own reason, not torch's advice
            raise _unreadable(path, exc.__context__ or exc) from None
        raise CheckpointRefused(
            f"checkpoint {path}: refused: it holds objects other than tensors and plain Python "
            f"types{_what_was_refused(exc)}, which could run code when loaded (mptrain "
            "checkpoints never do: written by something else, or by an mptrain older than "
            "checkpoint format 2)"
        ) from None
    except Exception as exc:
        raise _unreadable(path, exc) from exc
    if not isinstance(payload, dict) or payload.get("format_version") != FORMAT_VERSION:
        raise CheckpointRefused(f"checkpoint {path}: not an mptrain checkpoint of this version")
    return payload


def _what_was_refused(exc: pickle.UnpicklingError) -> str:
    """`` (posix.system)``: the global the weights-only unpickler refused, when it names one."""
    found = re.search(r"GLOBAL ([\w.]+)", str(exc.__context__ or exc))
    return f" ({found[1]})" if found else ""


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


def newest_loadable(
    directory: Path, key: str
) -> tuple[tuple[Path, dict[str, Any]] | None, list[tuple[Path, CheckpointError]]]:
    """((path, payload) of the newest checkpoint in ``directory`` that loads, or None; each
    unreadable one newer than it, with why). Nothing is changed in ``directory``.
    A checkpoint that is intact but refused (another format) is a ConfigError naming ``key``:
    falling back past it would start over, or evaluate an older state, without saying so."""
    skipped: list[tuple[Path, CheckpointError]] = []
    for path in candidates(directory):
        try:
            return (path, load_checkpoint(path)), skipped
        except CheckpointRefused as exc:
            raise ConfigError(f"{key}: {exc}") from exc
        except CheckpointError as exc:
            skipped.append((path, exc))
    return None, skipped


def resolve_resume(resume: str, output_dir: Path, overwrite: bool = False) -> Found | None:
    """(path, payload, notes) for training's ``resume=PATH|auto``; None when auto finds nothing.

    ``auto`` looks in this run's directory and falls back past unreadable checkpoints to the
    newest that loads (setting them aside as ``*.corrupt``), and to ``best.pt`` when no step
    checkpoint loads (said in the notes). When checkpoints are there and none loads, or
    ``checkpoints`` is not a directory, it refuses in one line naming each (starting over on
    another run's work would replace its metrics and report) unless ``overwrite``: then None,
    nothing set aside (the fresh run's overwrite deletes them). PATH goes through
    :func:`find_checkpoint` without falling back: in a run directory its newest checkpoint, and a
    checkpoint the user named that does not load is an error.
    """
    if resume != "auto":
        return find_checkpoint(resume)
    directory = output_dir / CHECKPOINT_DIR
    if not directory.is_dir():
        if overwrite or not directory.exists():
            return None
        raise ConfigError(
            f"resume=auto: {directory} is not a directory, so no checkpoint can be read there; "
            "move it away, or start over with overwrite=true"
        )
    found, skipped = newest_loadable(directory, "resume=auto")
    if found is None and not (directory / BEST).is_file():
        if not skipped or overwrite:
            return None
        unreadable = "; ".join(f"{path.name}: {_why(exc)}" for path, exc in skipped)
        raise ConfigError(
            f"resume=auto: no checkpoint in {directory} loads ({unreadable}); nothing was "
            "changed: resume=PATH another checkpoint, or start over there with overwrite=true "
            "(deletes them)"
        )
    notes = [f"skipped {exc}; {quarantine(path)}" for path, exc in skipped]
    if found is None:
        return _resume_from_best(directory / BEST, notes)
    return (*found, notes)


def _why(exc: CheckpointError) -> str:
    """Why a checkpoint did not load, short: the cause's type and first sentence."""
    cause = exc.__cause__ or exc
    first = (str(cause).strip().splitlines() or [""])[0].split(". ")[0].rstrip(".")
    return f"{type(cause).__name__}: {first}" if first else type(cause).__name__


def _resume_from_best(path: Path, notes: list[str]) -> Found | None:
    """resume=auto when best.pt is all a run left (killed before its first periodic checkpoint):
    it holds a full state, that of the best evaluation, so the run continues from there and the
    steps after it are trained again. Said in the notes; an unreadable best.pt is set aside."""
    try:
        payload = load_checkpoint(path)
    except CheckpointRefused as exc:
        raise ConfigError(f"resume=auto: {exc}") from exc
    except CheckpointError as exc:
        notes.append(f"skipped {exc}; {quarantine(path)}")
        return None
    step = payload["loop"].get("step")
    notes.append(
        f"no step checkpoint: resumed from {BEST} (the best evaluation, step {step}); the steps "
        "after it are trained again"
    )
    return path, payload, notes


def kept_best(resume: str) -> bool:
    """Whether ``resume`` is a run directory (or its checkpoints/) that holds best.pt."""
    path = Path(resume)
    directory = path / CHECKPOINT_DIR if (path / CHECKPOINT_DIR).is_dir() else path
    return path.is_dir() and (directory / BEST).is_file()


def find_checkpoint(resume: str, which: str = "latest", *, fall_back: bool = False) -> Found:
    """(path, payload, notes) of the checkpoint ``resume`` names: the one lookup of a user's path
    (training's resume=PATH, ``mptrain eval``, ``mptrain sample``, ``mptrain.load_model``).

    ``resume`` is a checkpoint file, a run directory or its checkpoints/ directory. In a directory:
    ``which="best"`` is best.pt; ``"latest"`` its newest checkpoint, or with ``fall_back`` the
    newest that loads (the unreadable ones noted and left in place). ConfigError, one line, for
    anything else.
    """
    path = Path(resume)
    if not path.exists():
        raise ConfigError(f"resume={resume!r}: no such file or directory")
    if path.is_dir():
        directory = path / CHECKPOINT_DIR if (path / CHECKPOINT_DIR).is_dir() else path
        if which == "best":
            path = directory / BEST
            if not path.is_file():
                raise ConfigError(
                    f"resume={resume!r}: no {BEST} in {directory} (eval.checkpoint=best); "
                    "use eval.checkpoint=latest"
                )
        elif fall_back:
            found, skipped = newest_loadable(directory, f"resume={resume!r}")
            if found is None:
                count = f" ({len(skipped)} unreadable)" if skipped else ""
                raise ConfigError(
                    f"resume={resume!r}: no checkpoint (step_*.pt) that loads in {directory}{count}"
                )
            return (*found, [f"skipped {exc}" for _, exc in skipped])
        else:
            found = candidates(directory)
            if not found:
                raise ConfigError(f"resume={resume!r}: no checkpoint (step_*.pt) in {directory}")
            path = found[0]
    try:
        return path, load_checkpoint(path), []
    except CheckpointError as exc:  # the user named this file: bad input, before anything runs
        raise ConfigError(f"resume={resume!r}: {exc}") from exc


# Training settings added after checkpoints were first written, with the value that computes what
# a checkpoint without them computed: an older checkpoint resumes when the run keeps that value.
ADDED_SETTINGS: dict[str, Any] = {
    "task": "classify",
    "fp8.pow2_scales": False,
    "fp8.min_features": 0,
    "fp8.granularity": "tensorwise",
    "precision.update": "nearest",
    "precision.gemms.forward": None,
    "precision.gemms.input_grad": None,
    "precision.gemms.weight_grad": None,
    "precision.gemms.layers": ["*"],
}
# Added to dataset=text (only its signatures hold them); dataset.tokenizer's null needs no entry.
ADDED_TEXT_SETTINGS: dict[str, Any] = {"dataset.text_field": "text"}
# Added to model=gpt (issue 29): its GPTs had biases.
ADDED_GPT_SETTINGS: dict[str, Any] = {"model.bias": True}


# The signature key of what the data was (mptrain.data.batches.DataBundle.identity). Checkpoints
# of an older mptrain lack it: then it is not compared (nothing says what their data was).
DATA_IDENTITY = "data.identity"


def check_compatible(
    payload: dict[str, Any],
    signature: dict[str, Any],
    path: Path,
    allow_changes: bool,
    data_key: str = "dataset",
) -> list[str]:
    """Refuse a resume whose training settings differ from the checkpoint's, listing every
    difference, unless allowed. Returns the differences that were allowed (recorded in the
    report; :func:`restore` applies them). Data whose content changed under the same settings
    is refused in one line naming ``data_key`` (``dataset.path=...``)."""
    # Keys an older mptrain signed that no longer change what a run computes (advise.*) are not
    # differences: such a checkpoint resumes.
    signed = {
        k: v
        for k, v in payload["signature"].items()
        if k in signature or not is_non_training_key(k)
    }
    saved = {**_added_defaults(signed), **signed}
    if DATA_IDENTITY not in saved:
        signature = {k: v for k, v in signature.items() if k != DATA_IDENTITY}
    # Another precision signs other settings (nvfp4.* for nvfp4, none for bf16): a key only one
    # side has is then part of the precision's difference, not one of its own (8 spurious
    # "nvfp4.x: checkpoint ..., now None" lines for an nvfp4 run resumed in bf16).
    other_precision = saved.get("precision") != signature.get("precision")
    differences = [
        f"{key}: checkpoint {saved.get(key)!r}, now {signature.get(key)!r}"
        for key in dict.fromkeys([*signature, *saved])  # both key sets, in order
        if saved.get(key) != signature.get(key)
        and not (other_precision and (key in saved) != (key in signature))
    ]
    if differences and not allow_changes:
        if differences[0].startswith(DATA_IDENTITY) and len(differences) == 1:
            then, now = (_short_digest(x.get(DATA_IDENTITY)) for x in (saved, signature))
            raise ConfigError(
                f"resume: {data_key} holds other data than {path} was trained on (content {then} "
                f"then, {now} now); resume with the data it was trained on, or set "
                "resume_allow_changes=true to go on with this data"
            )
        raise ConfigError(
            f"resume: {path} was saved with different settings ({'; '.join(differences)}); "
            + _how_to_go_on(saved, signature)
        )
    return differences


# Settings a checkpoint cannot be carried across: its weights belong to another model or task.
_IDENTITY_KEYS = ("model.name", "task")


def _how_to_go_on(saved: dict[str, Any], signature: dict[str, Any]) -> str:
    """The end of a refusal: resume_allow_changes=true only where it could work (never for a
    checkpoint of another model or task: its weights would not be this run's)."""
    other = [k for k in _IDENTITY_KEYS if saved.get(k) != signature.get(k)]
    if other:
        named = " ".join(f"{k.split('.')[0]}={saved.get(k)}" for k in other)  # as typed
        return (
            f"it is a checkpoint of another {' and '.join(k.split('.')[0] for k in other)}: "
            f"resume it with {named}, or start this run in another directory"
        )
    return "set resume_allow_changes=true to resume anyway"


def _short_digest(identity: str | None) -> str:
    """``sha256:1a2b3c4d5e6f`` of a data identity (enough to tell two apart in a message)."""
    return "unknown" if identity is None else identity[: identity.index(":") + 13]


def _added_defaults(saved: dict[str, Any]) -> dict[str, Any]:
    """The :data:`ADDED_SETTINGS` an older signature lacks (a group's keys, ``fp8.`` or
    ``precision.``, only if it signed that group: FP8 keys only if it ran FP8), for dataset=text
    the :data:`ADDED_TEXT_SETTINGS` and for model=gpt the :data:`ADDED_GPT_SETTINGS`."""
    groups = {key.split(".")[0] for key in saved if "." in key}
    text = ADDED_TEXT_SETTINGS if saved.get("dataset.name") == "text" else {}
    gpt = ADDED_GPT_SETTINGS if saved.get("model.name") == "gpt" else {}
    return {
        key: value
        for key, value in {**ADDED_SETTINGS, **text, **gpt}.items()
        if key not in saved and ("." not in key or key.split(".")[0] in groups)
    }
