"""Using a trained model: ``mptrain eval``, ``mptrain.load_model``, the data facts every checkpoint
records, the commands and snippet of docs/python-api.md as written, and file permissions under the
umask.

One digits MLP is trained once through the real CLI (the page's command, made short); the
evaluations run in-process through ``eval_main`` (the CLI's own entry) except where the exit code
and the one-line error are the point.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import re
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.processes import describe, run_command, run_mptrain
from support.runs import NoFigure, tiny_run, train
from torch import nn

import mptrain
from mptrain.checkpoint.file import load_checkpoint
from mptrain.commands import evaluate as evaluation
from mptrain.config.base import ConfigError
from mptrain.precision.quant.fp8_linear import Float8Linear
from mptrain.train import job as run_module

# The page that shows how to use a trained model (the README's tour repeats its two commands).
PAGE = Path(__file__).resolve().parents[2] / "docs" / "python-api.md"
# Epoch-end checkpoints too: the tests need an older checkpoint (step 22) beside the final one.
SHORT = (
    "device=cpu",
    "progress=false",
    "epochs=null",
    "max_steps=30",
    "checkpoint.every_epoch=true",
)


def page_commands() -> list[list[str]]:
    """The page's first ``bash`` block (train, then evaluate), each line's arguments."""
    block = re.search(r"```bash\n(.*?)```", PAGE.read_text(), re.S)[1]
    return [shlex.split(line.split("#")[0])[1:] for line in block.splitlines() if line.strip()]


def page_snippet() -> str:
    return re.search(r"```python\n(.*?)```", PAGE.read_text(), re.S)[1]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """The page's training command (kept short), run by the CLI: the directory it ran in."""
    cwd = tmp_path_factory.mktemp("trained")
    train_args = page_commands()[0]
    result = run_mptrain(cwd, *train_args, *SHORT, "precision=fp32")
    assert result.returncode == 0, describe(result)
    return cwd


def run_dir(cwd: Path) -> Path:
    return cwd / "outputs" / "digits-run"


def evaluate_in_process(cwd: Path, out: Path, *overrides: str) -> dict:
    """``mptrain eval`` in-process in ``cwd``, writing to ``out``: eval.json's content."""
    before = Path.cwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            where = [] if any(o.startswith("hydra.run.dir=") for o in overrides) else [out]
            evaluation.eval_main(["device=cpu", *(f"hydra.run.dir={w}" for w in where), *overrides])
    finally:
        os.chdir(before)
    return json.loads((out / "eval.json").read_text())


# ----------------------------------------------------------------------------- docs/python-api.md
@pytest.mark.slow
def test_docs_eval_command_and_snippet_work_as_written(trained, monkeypatch, capsys):
    eval_args = page_commands()[1]
    result = run_mptrain(trained, *eval_args)
    assert result.returncode == 0, describe(result)
    (written,) = list((trained / "outputs" / "eval").glob("*/*_bf16_mlp_digits/eval.json"))
    report = json.loads(written.read_text())
    assert report["precision"] == "bf16" and report["trained_precision"] == "fp32"
    assert report["step"] == 30 and report["samples"] == 360
    assert report["checkpoint"].endswith("step_00000030.pt")
    assert abs(report["accuracy_difference"]) < 0.05  # BF16 inference of an FP32 model
    assert (
        "val accuracy" in result.stdout
        and str(written.parent.relative_to(trained)) in result.stdout
    )
    assert (written.parent / "eval.md").is_file()

    monkeypatch.chdir(trained)
    exec(page_snippet(), {})  # the three lines, as written
    printed = capsys.readouterr().out
    assert re.fullmatch(r"\['\d'(, '\d'){7}\]\n", printed), printed


def eval_result(**changes) -> dict:
    """An eval result as run_eval returns it (a classifier's), with ``changes``."""
    result = {
        "task": "classify", "model": "mlp", "dataset": "digits", "precision": "bf16",
        "checkpoint": "run/checkpoints/step_00000030.pt", "step": 30, "epoch": 1,
        "precision_detail": "bf16: autocast bfloat16, parameters float32", "device": "cpu",
        "compile": False, "channels_last": False, "data": "digits", "samples": 360,
        "eval_batch_size": 512, "val_loss": 0.0912, "val_accuracy": 0.97222,
        "trained_val_accuracy": 0.96944, "accuracy_difference": 0.00278,
        "trained_precision": "fp32", "same_data_as_training": True, "notes": [],
    }  # fmt: skip
    return result | changes


def test_eval_prints_accuracies_as_training_does():
    """Training prints ``val_accuracy=97.22%``; eval the same figure the same way."""
    text = evaluation.render(eval_result())
    assert "- val accuracy: 97.22%\n" in text
    assert "- val accuracy at training time: 96.94% (in fp32); difference +0.28 pt\n" in text
    assert "0.9722" not in text
    lm = eval_result(
        task="lm", val_perplexity=1.0955, trained_val_loss=0.09, loss_difference=0.0012
    )
    text = evaluation.render(lm)
    assert "- next-token accuracy: 97.22%\n" in text
    assert "- val loss at training time: 0.0900 (in fp32); difference +0.0012\n" in text


def test_docs_snippet_is_load_preprocess_predict():
    code = [
        line
        for line in page_snippet().splitlines()
        if line and not line.startswith(("import", "from"))
    ]
    assert len(code) == 3


# --------------------------------------------------------------------------------------- eval
@pytest.mark.slow
def test_same_precision_reproduces_the_training_accuracy_and_others_are_reported(trained, tmp_path):
    fp32 = evaluate_in_process(trained, tmp_path / "fp32", "resume=outputs/digits-run")
    assert fp32["precision"] == "fp32"  # the checkpoint's precision by default
    assert fp32["accuracy_difference"] == 0.0 and fp32["same_data_as_training"]

    fp16 = evaluate_in_process(
        trained, tmp_path / "fp16", "resume=outputs/digits-run", "precision=fp16"
    )
    assert fp16["precision"] == "fp16" and "loss scaling" not in fp16["precision_detail"]
    assert abs(fp16["val_accuracy"] - fp32["val_accuracy"]) < 0.05

    fp8 = evaluate_in_process(
        trained,
        tmp_path / "fp8",
        "resume=outputs/digits-run",
        "precision=fp8",
        "eval_batch_size=100",
    )
    assert fp8["precision"] == "fp8 (emulated)" and fp8["fp8_layers"] == ["3"]  # the middle Linear
    assert fp8["eval_batch_size"] == 100 and fp8["samples"] == 360


@pytest.mark.slow
def test_best_and_explicit_file_and_skipped_unreadable(trained, tmp_path):
    best = evaluate_in_process(
        trained, tmp_path / "best", "resume=outputs/digits-run", "eval.checkpoint=best"
    )
    assert best["checkpoint"].endswith("best.pt")

    # A copy of the run whose newest checkpoint is cut short: the older one is evaluated, and said.
    copy = tmp_path / "run"
    (copy / "checkpoints").mkdir(parents=True)
    for source in (run_dir(trained) / "checkpoints").iterdir():
        (copy / "checkpoints" / source.name).write_bytes(source.read_bytes())
    newest = copy / "checkpoints" / "step_00000030.pt"
    newest.write_bytes(newest.read_bytes()[:1000])
    older = evaluate_in_process(trained, tmp_path / "older", f"resume={copy}")
    assert older["checkpoint"].endswith("step_00000022.pt") and older["step"] == 22
    assert "skipped" in older["notes"][0] and "step_00000030.pt" in older["notes"][0]
    assert newest.is_file()  # evaluation quarantines nothing: the run directory is unchanged


@pytest.mark.slow
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["resume=missing"], "resume='missing': no such file or directory"),
        (["resume=empty"], "no checkpoint (step_*.pt) that loads in empty"),
        ([], "resume: mptrain eval needs resume=PATH"),
        (["resume=outputs/digits-run", "hydra.run.dir=/proc/x"], "hydra.run.dir=/proc/x"),
        (["resume=outputs/digits-run", "dataset=synthetic"], "the checkpoint's model takes 1x8x8"),
        (["resume=outputs/digits-run", "eval.checkpoint=worst"], "eval.checkpoint='worst'"),
        (["resume=outputs/digits-run", "-m"], "takes config overrides"),
    ],
)
def test_bad_inputs_are_one_line_config_errors(trained, tmp_path, overrides, message):
    (trained / "empty").mkdir(exist_ok=True)
    with pytest.raises(ConfigError) as caught:
        evaluate_in_process(trained, tmp_path / "out", *overrides)
    assert message in str(caught.value) and "\n" not in str(caught.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["precision=fp99"], "precision=fp99: unknown option; choose one of"),
        (["resume=corrupt.pt"], "resume='corrupt.pt': checkpoint corrupt.pt: unreadable"),
    ],
)
def test_cli_bad_input_exit_2(trained, args, message):
    source = run_dir(trained) / "checkpoints" / "step_00000022.pt"
    (trained / "corrupt.pt").write_bytes(source.read_bytes()[:2000])
    result = run_mptrain(trained, "eval", "resume=outputs/digits-run", *args)
    assert result.returncode == 2, describe(result)
    assert result.stderr.strip().startswith("mptrain: error: ") and message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, describe(result)


# ------------------------------------------------------------------------------ checkpoints
@pytest.mark.slow
def test_checkpoint_records_data_facts_in_plain_types(trained):
    path = run_dir(trained) / "checkpoints" / "step_00000030.pt"
    payload = torch.load(path, map_location="cpu", weights_only=True)
    data = payload["data"]
    assert (data["in_channels"], data["image_size"], data["num_classes"]) == (1, 8, 10)
    assert data["classes"] == [str(i) for i in range(10)]
    prep = data["preprocessing"]
    assert prep["pixel_scale"] == 16.0 and len(prep["mean"]) == len(prep["std"]) == 1
    # The recorded preprocessing of raw digits gives exactly the inputs the run trained on.
    from sklearn.datasets import load_digits

    raw = load_digits().images
    x = mptrain.preprocess(raw, prep)
    expected = (raw / 16.0 - prep["mean"][0]) / prep["std"][0]
    torch.testing.assert_close(x[:, 0], torch.as_tensor(expected, dtype=torch.float32))


def test_preprocessing_of_fed_as_is_and_uint8_data():
    from mptrain.config.data import SyntheticConfig
    from mptrain.data.arrays import ArrayDataset, array_bundle
    from mptrain.data.batches import BatchLayout

    layout = BatchLayout(
        batch_size=2, eval_batch_size=2, device=torch.device("cpu"), seed=0, num_workers=0
    )
    images = torch.zeros(4, 3, 4, 4, dtype=torch.uint8)
    labels = torch.tensor([0, 1, 0, 1])
    stats = ((0.5, 0.5, 0.5), (0.25, 0.25, 0.25))
    arrays = ArrayDataset(images, labels, images, labels, 2, *stats, classes=["a", "b"])
    bundle = array_bundle(SyntheticConfig(), arrays, layout)
    assert bundle.classes == ["a", "b"] and bundle.preprocessing["pixel_scale"] == 255.0
    assert bundle.preprocessing["mean"] == [0.5] * 3
    raw = torch.full((1, 3, 4, 4), 255)
    torch.testing.assert_close(
        mptrain.preprocess(raw, bundle.preprocessing), torch.full((1, 3, 4, 4), 2.0)
    )
    with pytest.raises(ValueError, match=r"C, H, W = \(3, 4, 4\)"):
        mptrain.preprocess(torch.zeros(4, 4, 3), bundle.preprocessing)  # channels last

    floats = ArrayDataset(images.float(), labels, images.float(), labels, 2)
    plain = array_bundle(SyntheticConfig(), floats, layout).preprocessing
    assert plain["pixel_scale"] == 1.0 and plain["mean"] is None


# ----------------------------------------------------------------------------------- load_model
@pytest.fixture
def no_run_figure(monkeypatch):
    monkeypatch.setattr(run_module, "FigureWorker", NoFigure)


@pytest.mark.parametrize("precision", ["fp8", "bf16_pure"])
def test_load_model_returns_the_plain_fp32_architecture(tmp_path, no_run_figure, precision):
    cfg = tiny_run(
        f"precision={precision}", "epochs=null", "max_steps=3", "model.hidden_sizes=[32,32]"
    )
    train(cfg, tmp_path)
    payload = load_checkpoint(tmp_path / "checkpoints" / "step_00000003.pt")

    model = mptrain.load_model(tmp_path)
    assert not model.training and model.mptrain_checkpoint.endswith("step_00000003.pt")
    assert all(p.dtype == torch.float32 and p.device.type == "cpu" for p in model.parameters())
    assert not any(isinstance(m, Float8Linear) for m in model.modules())
    assert set(model.state_dict()) == {k for k in payload["model"] if "_scaler." not in k}
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, payload["model"][key].float(), rtol=0, atol=0)
    if precision == "fp8":
        assert any("_scaler." in k for k in payload["model"])
    assert model.mptrain_classes[3] == "3"


@pytest.mark.slow
def test_load_model_of_an_fsdp_run_of_two_processes(tmp_path):
    """FSDP2 on 2 Gloo ranks: the checkpoint holds the gathered, unwrapped state."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "-m", "mptrain"]
    args = ["model=mlp", *SHORT[:3], "max_steps=3", "precision=fp32", "distributed.strategy=fsdp"]
    result = run_command(tmp_path, *command, *args, "hydra.run.dir=run")
    assert result.returncode == 0, describe(result)
    payload = load_checkpoint(tmp_path / "run" / "checkpoints" / "step_00000003.pt")
    assert payload["world_size"] == 2
    model = mptrain.load_model(tmp_path / "run")
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, payload["model"][key], rtol=0, atol=0)


def test_load_weights_strips_compile_and_ddp_prefixes_and_refuses_other_models():
    model = nn.Sequential(nn.Linear(4, 2))
    state = {f"_orig_mod.{k}": v + 1 for k, v in model.state_dict().items()}
    fresh = nn.Sequential(nn.Linear(4, 2))
    evaluation.load_weights(fresh, state, "x.pt")
    torch.testing.assert_close(fresh[0].bias, model[0].bias + 1)
    evaluation.load_weights(
        fresh, {f"module.{k}": v for k, v in model.state_dict().items()}, "x.pt"
    )
    torch.testing.assert_close(fresh[0].bias, model[0].bias)
    with pytest.raises(ConfigError, match=r"x\.pt: the checkpoint's weights do not fit"):
        evaluation.load_weights(nn.Sequential(nn.Linear(4, 3)), model.state_dict(), "x.pt")


def test_import_mptrain_stays_cheap_and_exports_load_model():
    code = "import sys, mptrain; assert 'torch' not in sys.modules; mptrain.load_model; print('ok')"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert result.stdout == "ok\n", result.stderr


# ------------------------------------------------------------------------------------- umask
@pytest.mark.slow
@pytest.mark.parametrize(("umask", "mode"), [(0o022, 0o644), (0o077, 0o600)], ids=["022", "077"])
def test_written_files_honour_the_umask(tmp_path, umask, mode):
    env = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "COLUMNS", "LINES")}
    command = [
        sys.executable,
        "-m",
        "mptrain",
        "model=mlp",
        *SHORT[:3],
        "max_steps=3",
        "hydra.run.dir=run",
    ]
    result = subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180, umask=umask
    )
    assert result.returncode == 0, describe(result)
    files = [p for p in (tmp_path / "run").rglob("*") if p.is_file()]
    names = {p.name for p in files}
    assert {"report.json", "report.md", "curves.png", "step_00000003.pt", "latest.json"} <= names
    wrong = {
        str(p): oct(stat.S_IMODE(p.stat().st_mode))
        for p in files
        if stat.S_IMODE(p.stat().st_mode) != mode
    }
    assert wrong == {}


# ------------------------------------------------------------------------ each dataset's facts
def test_image_folder_facts_reproduce_the_validation_inputs_from_the_files(tmp_path):
    from PIL import Image
    from support.datafiles import build, collect, write_image_folder

    from mptrain.config.data import ImageFolderConfig

    write_image_folder(tmp_path, {"train": {"cat": 2, "dog": 2}, "val": {"cat": 2, "dog": 2}})
    bundle = build(ImageFolderConfig(root=str(tmp_path), image_size=32, resize_size=36))
    assert bundle.classes == ["cat", "dog"]
    prep = bundle.preprocessing
    assert (prep["resize"], prep["center_crop"], prep["color"]) == (36, 32, "RGB")
    files = sorted((tmp_path / "val").glob("*/*.png"))  # the order ImageFolder reads them in
    raw = [Image.open(path) for path in files]
    images, _ = collect(bundle.val)
    torch.testing.assert_close(mptrain.preprocess(raw, prep), images)


def test_torchvision_datasets_name_their_classes(tmp_path):
    from support.datafiles import build, tv_config, write_cifar10, write_cifar100, write_mnist

    write_cifar10(tmp_path)
    write_cifar100(tmp_path)
    write_mnist(tmp_path, "FashionMNIST", seed=0)
    write_mnist(tmp_path, "MNIST", seed=1)
    cifar10 = build(tv_config("cifar10", tmp_path))
    assert cifar10.classes[:2] == ["airplane", "automobile"] and len(cifar10.classes) == 10
    assert cifar10.preprocessing["pixel_scale"] == 255.0 and len(cifar10.preprocessing["std"]) == 3
    assert build(tv_config("cifar100", tmp_path)).classes is None  # no meta file written here
    names = [f"class{i}".encode() for i in range(100)]
    with (tmp_path / "cifar-100-python" / "meta").open("wb") as f:
        pickle.dump({b"fine_label_names": names}, f)
    assert build(tv_config("cifar100", tmp_path)).classes[99] == "class99"
    assert build(tv_config("fashion_mnist", tmp_path)).classes[0] == "T-shirt/top"
    assert build(tv_config("mnist", tmp_path)).classes == [str(i) for i in range(10)]


def test_image_folder_run_loads_predicts_from_files_and_notes_renamed_classes(
    tmp_path, no_run_figure
):
    from PIL import Image
    from support.datafiles import write_image_folder

    first, second = tmp_path / "a", tmp_path / "b"
    write_image_folder(first, {"train": {"cat": 4, "dog": 4}, "val": {"cat": 2, "dog": 2}})
    write_image_folder(second, {"train": {"bird": 4, "dog": 4}, "val": {"bird": 2, "dog": 2}})
    shape = ("dataset.image_size=16", "dataset.resize_size=18", "num_workers=0", "batch_size=4")
    cfg = tiny_run(
        "dataset=imagefolder", f"dataset.root={first}", *shape, "epochs=null", "max_steps=2"
    )
    train(cfg, tmp_path / "run")

    other = evaluate_in_process(
        tmp_path, tmp_path / "eval", f"resume={tmp_path / 'run'}", f"dataset.root={second}"
    )
    assert other["samples"] == 4 and not other["same_data_as_training"]
    assert any("class names differ" in note and "bird" in note for note in other["notes"])

    model = mptrain.load_model(tmp_path / "run")
    x = model.mptrain_preprocess(Image.open(first / "val" / "dog" / "0.png"))
    assert x.shape == (1, 3, 16, 16) and model.mptrain_classes == ["cat", "dog"]
    assert model(x).shape == (1, 2)


def test_a_language_model_evaluated_on_other_text_is_told_in_tokens_not_pixels():
    """'Also': an LM evaluated on a text with another vocabulary size was told of '0x0x0 inputs
    and 17 classes'."""
    from types import SimpleNamespace

    from mptrain.commands.evaluate import check_data_fits
    from mptrain.config.base import ConfigError

    saved = {"in_channels": 0, "image_size": 0, "num_classes": 65, "sequence_length": 32}
    data = SimpleNamespace(
        in_channels=0, image_size=0, num_classes=17, sequence_length=32, text=None, classes=None
    )
    with pytest.raises(ConfigError) as refused:
        check_data_fits({**saved, "classes": None}, data, "text")
    assert str(refused.value) == (
        "dataset=text: windows of 32 tokens from a vocabulary of 17; the checkpoint's model "
        "takes windows of 32 tokens from a vocabulary of 65"
    )
