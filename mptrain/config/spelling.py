"""The nearest valid spelling of a key or an option the config does not know, for the one-line
errors of the command line (``lr=0.01`` -> ``optimizer.lr``, ``max_epochs`` -> ``epochs``,
``precision=FP16`` -> ``fp16``).

Suggestions come from, in order: the names other tools give the same setting (:data:`PEER_KEYS`:
PyTorch Lightning's Trainer, nanoGPT's ``train.py``, Hugging Face's ``TrainingArguments``), a
different case, a nested key whose last part is the one typed, and :mod:`difflib`'s closest
match. A suggestion only ever goes into an error message: nothing here changes what runs.
No torch, no OmegaConf: the keys are the schemas' dataclass fields.
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Iterable

from mptrain.config.keys import schema_fields
from mptrain.config.options import PRECISION_ALIASES, PRECISION_NAMES

# Another tool's name for a setting -> mptrain's key (or key=value, where a flag of theirs is an
# option of ours). Every target's key is a key of RunConfig or one of Hydra's
# (tests/config/test_spelling.py), and no peer name is itself an mptrain key.
PEER_KEYS = {
    # PyTorch Lightning (Trainer arguments; also typed as trainer.<name>)
    "max_epochs": "epochs",
    "accumulate_grad_batches": "grad_accum_steps",
    "gradient_clip_val": "clip_grad_norm",
    "val_check_interval": "eval_every",
    "log_every_n_steps": "log_every",
    "enable_progress_bar": "progress",
    "seed_everything": "seed",
    "accelerator": "device",
    "default_root_dir": "hydra.run.dir",
    # nanoGPT (train.py's globals)
    "max_iters": "max_steps",
    "learning_rate": "optimizer.lr",
    "grad_clip": "clip_grad_norm",
    "eval_interval": "eval_every",
    "log_interval": "log_every",
    "dtype": "precision",
    "out_dir": "hydra.run.dir",
    "init_from": "resume",
    "n_layer": "model.layers",
    "n_head": "model.heads",
    "n_embd": "model.width",
    # Hugging Face (TrainingArguments) and nanoGPT alike
    "gradient_accumulation_steps": "grad_accum_steps",
    "num_train_epochs": "epochs",
    "per_device_train_batch_size": "batch_size",
    "per_device_eval_batch_size": "eval_batch_size",
    "max_grad_norm": "clip_grad_norm",
    "output_dir": "hydra.run.dir",
    "logging_steps": "log_every",
    "eval_steps": "eval_every",
    "label_smoothing_factor": "label_smoothing",
    "resume_from_checkpoint": "resume",
    "torch_compile": "compile",
    "dataloader_num_workers": "num_workers",
    "warmup_steps": "scheduler.warmup_steps",
    # Hugging Face's precision flags (fp16=true, bf16=true) and Lightning's checkpoint argument
    "fp16": "precision=fp16",
    "bf16": "precision=bf16",
    "ckpt_path": "resume",
}
# Where peers nest their settings (Lightning's trainer.max_epochs, HF's args.num_train_epochs).
PEER_PREFIXES = ("trainer.", "training.", "train.", "args.")


@functools.cache
def config_keys() -> frozenset[str]:
    """Every dotted key of :class:`~mptrain.config.run.RunConfig`, nodes included (``precision``, ``precision.scaler``,
    ``precision.scaler.init_scale``); a config group's keys are those of any of its options."""
    return frozenset(key for key, _ in schema_fields())


def suggest_key(key: str, accepted: Iterable[str] | None = None) -> str | None:
    """The key the user probably meant by ``key`` (dotted, ``+``/``~`` prefixes ignored), or None.

    ``accepted``: the dotted keys valid where ``key`` was given (a node's fields), which the
    closest-spelling match searches; every key of the config when None."""
    bare = key.lstrip("+~").lower()
    for prefix in PEER_PREFIXES:
        if bare.startswith(prefix) and bare.removeprefix(prefix):
            bare = bare.removeprefix(prefix)
            break
    known = config_keys()
    if bare in PEER_KEYS:
        return PEER_KEYS[bare]
    if bare in known and bare != key:
        return bare
    by_leaf = [k for k in known if "." in k and k.rsplit(".", 1)[1] == bare]
    if len(by_leaf) == 1:
        return by_leaf[0]
    pool = sorted(accepted if accepted is not None else known)
    close = difflib.get_close_matches(bare, pool, n=1, cutoff=0.75)
    return close[0] if close else None


def suggest_option(option: str, options: Iterable[str]) -> str | None:
    """The option the user probably meant by ``option`` among ``options`` (the same name in
    another case, or the closest spelling), or None."""
    options = list(options)
    by_case = {o.lower(): o for o in options}
    if option.lower() in by_case:
        return by_case[option.lower()]
    # Ties go to the greater name (difflib's order), whatever order the options come in.
    close = difflib.get_close_matches(option.lower(), options, n=1, cutoff=0.6)
    return close[0] if close else None


def suggest_setting(key: str, value: str | None) -> str | None:
    """The override the user probably meant by a flag ``--key[=value]`` (``--epochs=1`` ->
    ``epochs=1``, ``--max_iters 100`` -> ``max_steps=100``, ``--bf16`` -> ``precision=bf16``),
    or None."""
    name = key.lstrip("-").replace("-", "_")
    if value is None and name.lower() in PRECISION_NAMES:
        return f"precision={name.lower()}"
    if value is None and key.lstrip("-") in PRECISION_ALIASES:  # --16-mixed
        return f"precision={key.lstrip('-')}"
    meant = name if name in config_keys() else suggest_key(name)
    if meant is None:
        return None
    return f"{meant}={value}" if value is not None else f"{meant}=VALUE"


def did_you_mean(suggestion: str | None) -> str:
    """' (did you mean X?)' for an error line (after what was wrong, before what is accepted),
    or '' without a suggestion."""
    return f" (did you mean {suggestion}?)" if suggestion else ""
