"""Using a trained model: ``mptrain eval`` and :func:`load_model` (docs/python-api.md).

``mptrain eval resume=PATH [overrides]`` evaluates a checkpoint on the validation set without
training, at any precision, and writes eval.json and eval.md; it changes nothing in a run
directory. The model and data settings are the checkpoint's with the command line's overrides on
top, and the precision, unless given, the one it trained in (the same precision reproduces the
accuracy recorded at training time). :func:`load_model` returns the plain FP32 architecture with
the trained weights, in eval mode.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import functools
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mptrain.checkpoint.file import find_checkpoint as checkpoint_at
from mptrain.cli.preflight import (
    RUN_DIR_OVERRIDE,
    checked_run_config,
    compose_job,
    describe_compose_error,
    refuse_huge_numbers,
    refuse_hydra_options,
)
from mptrain.config.base import ConfigError
from mptrain.config.commands import check_eval_checkpoint
from mptrain.config.data import TextDatasetConfig
from mptrain.config.keys import flatten
from mptrain.config.models import EXTRA_KEYS_FIELD
from mptrain.config.run import RunConfig
from mptrain.config.targets import refuse_checkpoint_code
from mptrain.data.batches import BatchLayout, DataBundle
from mptrain.data.build import build_data
from mptrain.data.lm import text_bundle, text_in_vocabulary
from mptrain.data.text import Vocabulary
from mptrain.models.build import MODELS, build_model
from mptrain.models.task import Task
from mptrain.platform import hardware
from mptrain.platform.distributed import DistContext
from mptrain.platform.dtypes import dtype_name
from mptrain.report.rows import fmt_num, fmt_pct
from mptrain.rundir.fileio import atomic_write_text, clean_json
from mptrain.rundir.lock import check_creatable
from mptrain.train.build import (
    build_model_for_run,
    check_run,
    choose_threads,
    resolve_run,
    window_length,
)
from mptrain.train.loop import evaluate

_FP8_BUFFERS = (".input_scaler.", ".weight_scaler.", ".grad_scaler.")  # Float8Linear's scalers
_WRAPPER_PREFIXES = ("_orig_mod.", "module.")  # torch.compile, DDP


# ------------------------------------------------------------------------------ the checkpoint
def find_checkpoint(resume: str | None, which: str = "latest") -> tuple[Path, dict, list[str]]:
    """(path, payload, notes) of the trained checkpoint ``resume`` names (see
    :func:`mptrain.checkpoint.file.find_checkpoint`; in a run directory, ``latest`` falls back
    past unreadable checkpoints to the newest that loads). ConfigError, one line, otherwise."""
    if resume in (None, "auto"):
        given = "" if resume is None else f"={resume}"
        raise ConfigError(
            f"resume{given}: mptrain eval needs resume=PATH, a checkpoint file or a run directory"
        )
    return checkpoint_at(resume, which, fall_back=True)


def load_weights(model: nn.Module, state: dict[str, torch.Tensor], where: str) -> list[str]:
    """Load a checkpoint's model state into ``model`` (any dtype: values are cast to the model's).

    FP8 scale buffers the model has no place for are dropped (the FP32 architecture); FP8 scale
    buffers the checkpoint lacks keep the model's fresh ones (a non-FP8 checkpoint evaluated in
    FP8). Returns the FP8 buffer names left fresh. ConfigError for any other mismatch.
    """
    for prefix in _WRAPPER_PREFIXES:  # checkpoints hold the unwrapped module; older ones may not
        if state and all(k.startswith(prefix) for k in state):
            state = {k[len(prefix) :]: v for k, v in state.items()}
    own = model.state_dict()
    is_fp8 = lambda key: any(p in f".{key}" for p in _FP8_BUFFERS)  # noqa: E731
    state = {k: v for k, v in state.items() if k in own or not is_fp8(k)}
    fresh = [k for k in own if k not in state and is_fp8(k)]
    try:
        model.load_state_dict({**{k: own[k] for k in fresh}, **state})
    except RuntimeError as exc:
        detail = " ".join(str(exc).split())
        raise ConfigError(
            f"{where}: the checkpoint's weights do not fit the model built from its config "
            f"({detail[:300]})"
        ) from exc
    return fresh


# ---------------------------------------------------------------------------------- evaluation
def _shape_words(shape: tuple[int, int, int], sequence_length: int | None) -> str:
    """What a model takes, in words: ``3x32x32 inputs and 10 classes``, or for token data
    (no image: channels and size 0) ``windows of 64 tokens from a vocabulary of 65``."""
    channels, size, classes = shape
    if channels == 0 and size == 0:
        window = f"windows of {sequence_length} tokens" if sequence_length else "token windows"
        return f"{window} from a vocabulary of {classes}"
    return f"{channels}x{size}x{size} inputs and {classes} classes"


def check_data_fits(saved: dict[str, Any] | None, data: DataBundle, dataset: str) -> list[str]:
    """ConfigError unless ``data`` has the input shape and class count the model was built for.
    Returns a note when the class names differ (the same count: it may be a renaming)."""
    if saved is None:  # a checkpoint from before data facts were saved: load_weights checks
        return []
    built = (saved["in_channels"], saved["image_size"], saved["num_classes"])
    given = (data.in_channels, data.image_size, data.num_classes)
    if built != given:
        raise ConfigError(
            f"dataset={dataset}: {_shape_words(given, data.sequence_length)}; the checkpoint's "
            f"model takes {_shape_words(built, saved.get('sequence_length'))}"
        )
    if data.text is not None and data.text.vocabulary != Vocabulary.of_checkpoint(saved):
        raise ConfigError(
            f"dataset={dataset}: its {data.text.vocabulary.kind} vocabulary differs from the one "
            "the model was trained with (the same ids would mean other text); evaluate on the "
            "training text's settings"
        )
    if None not in (saved["classes"], data.classes) and saved["classes"] != data.classes:
        return [f"class names differ from training's: {saved['classes']} then, {data.classes} now"]
    return []


def _eval_data(cfg: RunConfig, layout: BatchLayout, saved: dict[str, Any] | None) -> DataBundle:
    """The data to evaluate on; a character model's text is read in the checkpoint's own
    vocabulary (:func:`mptrain.data.lm.text_in_vocabulary`), older checkpoints' unknown id included."""
    saved_vocab = (
        Vocabulary.of_checkpoint(saved) if saved and saved.get("sequence_length") else None
    )
    chars = isinstance(cfg.dataset, TextDatasetConfig) and cfg.dataset.vocabulary == "chars"
    if saved_vocab is None or saved_vocab.kind != "chars" or not chars or cfg.dataset.tokenizer:
        return build_data(cfg.dataset, layout)
    return text_bundle(cfg.dataset, text_in_vocabulary(cfg.dataset, saved_vocab), layout)


def run_eval(cfg: RunConfig, path: Path, payload: dict[str, Any]) -> dict[str, Any]:
    """Evaluate ``payload``'s weights on ``cfg``'s validation set at ``cfg``'s precision.
    Returns the figures and facts of the eval report (see :func:`eval_result`)."""
    dist = DistContext()
    device, policy, _ = resolve_run(cfg, dist)
    check_run(cfg, policy, dist)
    layout = BatchLayout(  # batch_size 1: the training feed is built but never read
        batch_size=1,
        eval_batch_size=cfg.eval_batch_size,
        device=device,
        seed=cfg.seed,
        num_workers=cfg.num_workers,
        sequence_length=window_length(cfg),
    )
    data = _eval_data(cfg, layout, payload.get("data"))
    threads = choose_threads(cfg.threads, device, data, dist)  # not measured: no training steps
    notes = check_data_fits(payload.get("data"), data, cfg.dataset.name)
    model, precision = build_model_for_run(cfg, data, device, policy)  # layers, islands, casts
    fp8 = precision.fp8
    fresh = load_weights(model, payload["model"], f"resume={str(path)!r}")
    if fresh and policy.fp8 is not None and policy.fp8.scaling == "delayed":
        raise ConfigError(
            "fp8.scaling=delayed: the checkpoint holds no FP8 scales (not trained in FP8) to "
            "evaluate with; use fp8.scaling=dynamic"
        )
    model = torch.compile(model) if cfg.compile else model
    with torch.no_grad():
        val_loss, val_accuracy = evaluate(model, data.val, policy, cfg.channels_last)
    result = eval_result(cfg, path, payload, (val_loss, val_accuracy, data), (device, policy))
    result["notes"] += notes
    result["threads"] = dataclasses.asdict(threads)
    if fp8 is not None:
        result["fp8_layers"] = [layer["name"] for layer in fp8["layers"] if layer["converted"]]
    return result


def eval_result(
    cfg: RunConfig,
    path: Path,
    payload: dict[str, Any],
    figures: tuple[float, float, DataBundle],
    where: tuple[torch.device, Any],
) -> dict[str, Any]:
    """The eval report: what was evaluated, how, the figures, and the training-time accuracy."""
    val_loss, val_accuracy, data = figures
    device, policy = where
    loop = payload["loop"]
    recorded = next((e for e in loop["evals"] if e["step"] == loop["step"]), None)
    trained = recorded["val_accuracy"] if recorded else None
    trained_loss = recorded["val_loss"] if recorded else None
    return {
        "task": cfg.task,
        "checkpoint": str(path),
        "step": loop["step"],
        "epoch": loop["epoch"],
        "model": cfg.model.name,
        "dataset": cfg.dataset.name,
        "data": data.description,
        "precision": policy.label,
        "precision_detail": describe_inference(policy),
        "trained_precision": payload["signature"].get("precision"),
        "device": str(device),
        "hardware": hardware.hardware_info(device),
        "eval_batch_size": cfg.eval_batch_size,
        "compile": cfg.compile,
        "channels_last": cfg.channels_last,
        "samples": data.num_val,
        **Task(cfg.task).eval_row(val_loss, val_accuracy),  # language models: perplexity too
        "trained_val_accuracy": trained,
        "accuracy_difference": None if trained is None else val_accuracy - trained,
        "trained_val_loss": trained_loss,
        "loss_difference": None if trained_loss is None else val_loss - trained_loss,
        # Another dataset (or split) than training's: the difference then compares other data.
        "same_data_as_training": dataclasses.asdict(cfg.dataset) == payload["config"]["dataset"],
        "notes": list(policy.notes),
    }


def describe_inference(policy: Any) -> str:
    """How the forward pass computes: autocast dtype, parameter dtype, FP8 GEMMs. (No loss
    scaling: it acts on gradients, which evaluation has none of.)"""
    autocast = dtype_name(policy.autocast_dtype) or "none (FP32)"
    detail = f"{policy.label}: autocast {autocast}, parameters {dtype_name(policy.param_dtype)}"
    if policy.fp8 is not None:
        gemm = "torch._scaled_mm" if policy.fp8.real_gemm else "emulated GEMMs"
        detail += f", FP8 Linear layers via {gemm} ({policy.fp8.scaling} scaling)"
    return detail


def render(result: dict[str, Any]) -> str:
    """eval.md: the result in a few lines, its figures written as training's report writes them
    (accuracies as percentages, :func:`~mptrain.report.rows.fmt_pct`)."""
    acc = result["val_accuracy"]
    lm = result.get("task") == "lm"
    lines = [
        f"# mptrain eval: {result['model']} on {result['dataset']} in {result['precision']}",
        "",
        f"- checkpoint: {result['checkpoint']} (step {result['step']}, epoch {result['epoch']})",
        f"- precision: {result['precision_detail']}",
        f"- device: {result['device']}"
        + (", torch.compile" if result["compile"] else "")
        + (", channels_last" if result["channels_last"] else "")
        + (f"; {_threads_words(result['threads'])}" if result.get("threads") else ""),
        f"- data: {result['data']}",
        f"- {'windows' if lm else 'samples'} evaluated: {result['samples']} "
        f"(batches of {result['eval_batch_size']})",
        f"- val loss: {fmt_num(result['val_loss'], '.4f')}",
    ]
    if lm:
        lines += [
            f"- val perplexity: {fmt_num(result['val_perplexity'], '.3f')}",
            f"- next-token accuracy: {fmt_pct(acc)}",
            f"- val loss at training time: {_at_training(result, 'loss')}",
        ]
    else:
        lines += [
            f"- val accuracy: {fmt_pct(acc)}",
            f"- val accuracy at training time: {_at_training(result, 'accuracy')}",
        ]
    if not result["same_data_as_training"]:
        lines.append("- note: the dataset settings differ from training's (other data)")
    lines += [f"- note: {note}" for note in result["notes"]]
    return "\n".join(lines) + "\n"


def _threads_words(threads: dict[str, Any]) -> str:
    """``threads 2 (auto, not measured: affinity 2 CPUs, ...)``."""
    return f"threads {threads['threads']} ({threads['mode']}: {threads['basis']})"


def _at_training(result: dict[str, Any], figure: str) -> str:
    """The figure compared with training time (a language model's loss per token, else
    accuracy) and the difference: accuracies in percent and points, as sweep tables show them."""
    trained, diff = result[f"trained_val_{figure}"], result[f"{figure}_difference"]
    if trained is None:
        return "none recorded for this step"
    if figure == "accuracy":
        value, difference = fmt_pct(trained), f"{100 * diff:+.2f} pt"
    else:
        value, difference = f"{trained:.4f}", f"{diff:+.4f}"
    return f"{value} (in {result['trained_precision']}); difference {difference}"


def write_eval(result: dict[str, Any], output_dir: Path) -> None:
    """eval.json and eval.md in ``output_dir`` (atomic writes)."""
    output_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(output_dir / "eval.json", json.dumps(clean_json(result), indent=2) + "\n")
    atomic_write_text(output_dir / "eval.md", render(result))


# ------------------------------------------------------------------------------ the command line
_GROUPS = ("task", "model", "dataset", "precision")  # from the checkpoint unless overridden
# The checkpoint's settings an evaluation keeps (what the model and its inputs are, and how it
# computes); the rest (optimizer, schedule, epochs...) does not enter an evaluation.
_CARRIED = ("model", "dataset", "precision.allow_tf32", "fp8", "numerics.fp32_modules")
_CARRIED += ("channels_last", "eval_batch_size")


def eval_main(overrides: list[str]) -> None:
    """``mptrain eval resume=PATH [overrides]``: evaluate, write the report, print the result.

    Writes to ``outputs/eval/<date>/<time>_<precision>_<model>_<dataset>`` or ``hydra.run.dir``.
    Bad input raises ConfigError (one line; the CLI exits 2).
    """
    from omegaconf import OmegaConf

    user = _parse_overrides(overrides)
    which = user.get("eval.checkpoint", "latest")
    check_eval_checkpoint(which)  # before the checkpoint it chooses is read
    path, payload, notes = find_checkpoint(user.get("resume"), which)
    user_keys = set(user)
    composed = compose_job(_saved_choices(payload, user_keys) + overrides)
    asked = any(o.startswith(RUN_DIR_OVERRIDE) for o in overrides)
    run_dir = composed.hydra.run.dir if asked else None
    if run_dir == "":
        raise ConfigError("hydra.run.dir=: empty; give the directory eval should write to")
    _apply_saved(composed, payload["config"], user_keys, OmegaConf)
    cfg = checked_run_config(composed)
    refuse_checkpoint_code(payload["config"], str(path), user_keys, cfg.trust_checkpoint_code)
    # Before evaluating (minutes on big data), and without creating anything.
    check_creatable(Path(run_dir or "outputs/eval"), "hydra.run.dir" if run_dir else "outputs/eval")
    result = run_eval(cfg, path, payload)
    result["notes"] = notes + result["notes"]
    stamp = dt.datetime.now().strftime("%Y-%m-%d/%H-%M-%S")
    name = f"{stamp}_{result['precision'].split()[0]}_{cfg.model.name}_{cfg.dataset.name}"
    output_dir = Path(run_dir) if run_dir is not None else Path("outputs") / "eval" / name
    write_eval(result, output_dir)
    print(render(result), end="")
    print(f"eval written to {output_dir / 'eval.md'}")


def _parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """The keys (or groups) the command line sets and their values (the last wins); Hydra options
    other than hydra.run.dir are refused (eval is one job without Hydra's launcher: they would
    be ignored)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    refuse_hydra_options(overrides, "eval")
    refuse_huge_numbers(overrides)
    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except Exception as exc:
        raise ConfigError(describe_compose_error(exc)) from exc
    return {o.key_or_group: o.value() for o in parsed}


def _saved_choices(payload: dict[str, Any], user_keys: set[str]) -> list[str]:
    """Group choices from the checkpoint (the precision that ran), unless the user chose."""
    saved = payload["config"]
    choice = {
        "task": saved.get("task", "classify"),
        "model": saved["model"]["name"],
        "dataset": saved["dataset"]["name"],
        "precision": payload["signature"].get("precision", saved["precision"]["name"]),
    }
    return [f"{group}={choice[group]}" for group in _GROUPS if group not in user_keys]


def _apply_saved(composed: Any, saved: dict[str, Any], user_keys: set[str], omegaconf: Any) -> None:
    """Set the checkpoint's model/data/numerics values the command line leaves alone."""
    within = lambda key, tops: any(key == t or key.startswith(f"{t}.") for t in tops)  # noqa: E731
    # +model.width=4 sets what the checkpoint holds as model.kwargs.width (a custom option's
    # constructor arguments).
    split = (key.partition(".") for key in user_keys)
    user_keys = user_keys | {f"{g}.{EXTRA_KEYS_FIELD}.{rest}" for g, _, rest in split if rest}
    for key, value in flatten(saved).items():
        if not within(key, _CARRIED) or within(key, user_keys):
            continue
        try:
            # A custom option's constructor arguments, and model=hf's configuration keys, are
            # keys no schema declares.
            extra = f".{EXTRA_KEYS_FIELD}." in f".{key}" or key.startswith("model.config.")
            omegaconf.update(composed, key, value, merge=False, force_add=extra)
        except Exception as exc:
            raise ConfigError(
                f"checkpoint config {key}={value!r}: not accepted by this mptrain ({exc})"
            ) from exc


# --------------------------------------------------------------------------- the Python API
def load_model_info(path: str | Path, checkpoint: str = "latest") -> dict[str, Any]:
    """What :func:`load_model` needs and users want, from a checkpoint file or run directory:
    ``path``, ``step``, ``config`` (the run's), ``data`` (in_channels, image_size, num_classes,
    classes, preprocessing, description), ``precision`` (what it trained in) and ``state``
    (the model's state dict as saved)."""
    found, payload, _ = find_checkpoint(str(path), checkpoint)
    if payload.get("data") is None:
        raise ConfigError(
            f"{found}: saved by an mptrain that did not record the data facts (input shape, "
            "classes, preprocessing); evaluate it with `mptrain eval resume=PATH` instead"
        )
    return {
        "path": str(found),
        "step": payload["loop"]["step"],
        "config": payload["config"],
        "data": payload["data"],
        "precision": payload["signature"].get("precision"),
        "state": payload["model"],
    }


def load_model(
    path: str | Path,
    device: str | torch.device = "cpu",
    checkpoint: str = "latest",
    trust_checkpoint_code: bool = False,
) -> nn.Module:
    """The trained model of a checkpoint file or run directory: the plain FP32 architecture (FP8
    layers as nn.Linear), in eval mode, on ``device``. A model the checkpoint names by
    ``_target_`` (``model=custom``) is its code: built only with ``trust_checkpoint_code=True``,
    else ConfigError naming the target. Attributes: ``mptrain_classes`` (names in
    label order, or None), ``mptrain_preprocessing`` (see :func:`mptrain.data.build.preprocessing`),
    ``mptrain_preprocess(raw)`` (raw inputs -> the model's input), ``mptrain_vocabulary`` (a
    language model's :class:`~mptrain.data.text.Vocabulary`, else None), ``mptrain_sequence_length``
    (a language model's context in tokens, else None) and ``mptrain_checkpoint``."""
    info = load_model_info(path, checkpoint)
    refuse_checkpoint_code(info["config"], info["path"], trusted=trust_checkpoint_code)
    saved_model, data = info["config"]["model"], info["data"]
    option = MODELS.get(saved_model["name"])
    if option is None:
        raise ConfigError(f"model.name={saved_model['name']!r}: one of {', '.join(MODELS)}")
    fields = {f.name for f in dataclasses.fields(option.schema)}
    cfg = option.schema(**{k: v for k, v in saved_model.items() if k in fields})
    length = data.get("sequence_length")  # language models: the window length
    model = build_model(
        cfg, data["in_channels"], data["image_size"], data["num_classes"], "cpu", length
    )
    load_weights(model, info["state"], info["path"])
    model = model.float().eval().to(device)
    model.mptrain_vocabulary = Vocabulary.of_checkpoint(data) if length is not None else None
    model.mptrain_sequence_length = length
    model.mptrain_classes = data["classes"]
    model.mptrain_preprocessing = data["preprocessing"]
    model.mptrain_preprocess = functools.partial(
        preprocess, spec=data["preprocessing"], device=device
    )
    model.mptrain_checkpoint = info["path"]
    return model


def preprocess(
    raw: Any, spec: dict[str, Any] | None, device: str | torch.device = "cpu"
) -> torch.Tensor:
    """Raw inputs as the dataset holds them -> the float32 NCHW batch the model was trained on.

    Arrays/tensors of raw pixel values (0..pixel_scale): (N, C, H, W), (C, H, W), and for one
    channel (N, H, W) or (H, W). With ``resize`` in ``spec`` (image folders): a PIL image or a
    list of them, resized and centre-cropped as at validation. Then ``/ pixel_scale`` and
    ``(x - mean) / std`` per channel. ValueError for an input of another shape.
    """
    if spec is None:  # a custom dataset fed by DataLoader workers: its own code preprocessed
        raise ValueError(
            "this model's inputs were prepared by its dataset's own code (dataset=custom): "
            "apply the same preprocessing, then call the model directly"
        )
    if spec.get("resize"):
        from torchvision import transforms

        steps = [transforms.Resize(spec["resize"]), transforms.CenterCrop(spec["center_crop"])]
        to_input = transforms.Compose([*steps, transforms.ToTensor()])  # ToTensor: / 255
        images = raw if isinstance(raw, list | tuple) else [raw]
        x = torch.stack([to_input(image.convert(spec["color"])) for image in images])
    else:
        x = _as_nchw(torch.as_tensor(raw).float(), spec) / spec["pixel_scale"]
    if spec["mean"] is not None:
        mean = torch.tensor(spec["mean"]).view(1, -1, 1, 1)
        x = (x - mean) / torch.tensor(spec["std"]).view(1, -1, 1, 1)
    return x.to(device)


def _as_nchw(x: torch.Tensor, spec: dict[str, Any]) -> torch.Tensor:
    shape = (spec["channels"], spec["height"], spec["width"])
    if tuple(x.shape[-3:]) == shape and x.dim() in (3, 4):
        return x.reshape(-1, *shape)
    if spec["channels"] == 1 and tuple(x.shape[-2:]) == shape[1:] and x.dim() in (2, 3):
        return x.reshape(-1, *shape)
    accepted = "(N, C, H, W) or (C, H, W)" + (", (N, H, W) or (H, W)" if shape[0] == 1 else "")
    raise ValueError(
        f"input of shape {tuple(x.shape)}: the model takes {accepted} with C, H, W = {shape}"
    )
