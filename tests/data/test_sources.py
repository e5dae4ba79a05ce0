"""Models and datasets from elsewhere: torchvision and timm by name, the user's own through
``_target_`` (docs/custom-code.md, examples/), and the one-line errors for each."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from support.processes import describe, run_command, run_mptrain
from support.runs import compose_run, tiny_run, train

from mptrain.checkpoint.checkpointer import run_signature
from mptrain.config.base import ConfigError
from mptrain.config.data import CustomDatasetConfig
from mptrain.config.models import CustomModelConfig, TimmModelConfig, TorchvisionModelConfig
from mptrain.data.batches import BatchLayout
from mptrain.data.build import build_data
from mptrain.models.build import build_model, config_has_convolutions, model_facts
from mptrain.precision.plugin import Precision
from mptrain.precision.policy import resolve_precision
from mptrain.report.schema import load_report

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
TINY = (
    "epochs=null",
    "max_steps=3",
    "checkpoint.enabled=false",
    "progress=false",
    "device=cpu",
    "hydra.run.dir=run",
)
CUSTOM_DATA = ("dataset=custom", "dataset._target_=blobs.make_blobs", "+dataset.num_train=128")
CUSTOM_MODEL = ("model=custom", "model._target_=tiny_net.TinyNet")


@pytest.fixture
def launch_dir(tmp_path, monkeypatch):
    """A launch directory holding the examples (and where in-process tests import them from)."""
    for source in EXAMPLES.glob("*.py"):
        shutil.copy(source, tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def docs_command() -> list[str]:
    """The ``mptrain model=custom ...`` line of docs/custom-code.md (its example), as arguments."""
    page = (ROOT / "docs" / "custom-code.md").read_text()
    line = next(s for s in page.splitlines() if s.startswith("mptrain model=custom"))
    return shlex.split(line, comments=True)


def mptrain_console(cwd: Path, *args: str):
    """mptrain as the console script runs it: ``-P`` keeps the launch directory off sys.path."""
    return run_command(cwd, sys.executable, "-P", "-m", "mptrain", *args)


def cli_error(cwd: Path, *args: str) -> str:
    """The one ``mptrain: error:`` line of a command that must exit 2 before training."""
    result = run_mptrain(cwd, *args, *TINY)
    assert result.returncode == 2, describe(result)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, describe(result)
    assert lines[0].startswith("mptrain: error: "), describe(result)
    assert (
        not (cwd / "run" / "metrics.jsonl").exists()
        or not (cwd / "run" / "metrics.jsonl").read_text().strip()
    ), "training started"
    return lines[0].removeprefix("mptrain: error: ")


# ------------------------------------------------------------------------------ the docs/ example
@pytest.mark.slow
def test_docs_example_runs_under_the_console_script_and_reports_what_was_built(launch_dir):
    command = docs_command()
    assert command[0] == "mptrain"
    result = mptrain_console(launch_dir, *command[1:], *TINY)
    assert result.returncode == 0, describe(result)

    report = load_report(launch_dir / "run" / "report.json")
    model = report.model
    assert (model.source, model.arch, model.class_name) == (
        "custom",
        "tiny_net.TinyNet",
        "tiny_net.TinyNet",
    )
    # 1 -> 32 channel 3x3 conv and a 32 -> 4 Linear.
    assert model.parameters == (9 * 32 + 32) + (32 * 4 + 4)
    assert model.adaptations == [
        "num_classes=4 passed from the dataset",
        "in_channels=1 passed from the dataset",
    ]
    assert model.convolutional is True
    assert report.data.feed.startswith("tensor-indexed")
    assert report.data.description.startswith("custom blobs.make_blobs: 1024 train / 128 val")
    assert report.training.steps == 3


def test_old_reports_without_the_new_model_fields_still_load(tmp_path):
    train(tiny_run("epochs=null", "max_steps=1", "checkpoint.enabled=false"), tmp_path)
    path = tmp_path / "report.json"
    data = json.loads(path.read_text())
    assert (data["model"]["source"], data["model"]["convolutional"]) == ("builtin", False)
    for key in ("source", "arch", "class_name", "adaptations", "convolutional"):
        del data["model"][key]
    path.write_text(json.dumps(data))
    assert load_report(path).model.source is None


# ------------------------------------------------------------------------------------ torchvision
def test_torchvision_model_is_adapted_to_the_channels_and_classes():
    model = build_model(TorchvisionModelConfig(arch="mobilenet_v3_small"), 1, 16, 7)
    facts = model_facts(model)
    assert (facts.source, facts.arch) == ("torchvision", "mobilenet_v3_small")
    assert facts.class_name == "torchvision.models.mobilenetv3.MobileNetV3"
    assert facts.adaptations == [
        "classifier built for 7 classes (num_classes=7)",
        "features.0.0 (Conv2d) replaced for 1 input channel",
    ]
    assert model.features[0][0].in_channels == 1
    assert model(torch.zeros(3, 1, 16, 16)).shape == (3, 7)


def test_torchvision_vit_gets_the_dataset_image_size():
    model = build_model(TorchvisionModelConfig(arch="vit_b_32"), 3, 32, 10)
    assert model.image_size == 32
    assert "image_size=32 passed for the dataset's images" in model_facts(model).adaptations


def test_torchvision_vit_refuses_images_its_patches_do_not_tile():
    with pytest.raises(ConfigError, match=r"^model\.arch='vit_b_32': torchvision cannot build it"):
        build_model(TorchvisionModelConfig(arch="vit_b_32"), 1, 8, 10)


@pytest.mark.parametrize(
    ("cfg", "convolutional"),
    [
        (TorchvisionModelConfig(arch="convnext_tiny"), True),
        (TorchvisionModelConfig(arch="vit_b_16"), True),  # its patch embedding is a Conv2d
        (
            CustomModelConfig(
                _target_="torch.nn.Linear", kwargs={"in_features": 4, "out_features": 2}
            ),
            False,
        ),
    ],
    ids=["convnext", "vit", "linear"],
)
def test_bench_knows_convolutions_of_models_from_elsewhere_before_the_data(cfg, convolutional):
    """mptrain bench skips FP16 on CPUs for convolutional models (they crawl there)."""
    assert config_has_convolutions(cfg) is convolutional


@pytest.mark.slow
def test_unknown_torchvision_arch_suggests_close_names(tmp_path):
    message = cli_error(tmp_path, "model=torchvision", "model.arch=resnet35")
    assert message.startswith("model.arch='resnet35': not a torchvision classification model")
    assert "did you mean" in message and "resnet34" in message


# ------------------------------------------------------------------------------------------- timm
def test_timm_model_takes_the_channels_and_classes():
    pytest.importorskip("timm")
    model = build_model(TimmModelConfig(arch="resnet18"), 1, 8, 5)
    facts = model_facts(model)
    assert facts.source == "timm" and facts.class_name == "timm.models.resnet.ResNet"
    assert "stem built for 1 input channels (in_chans=1)" in facts.adaptations


@pytest.mark.slow
def test_unknown_timm_arch_is_one_line(tmp_path):
    pytest.importorskip("timm")
    message = cli_error(tmp_path, "model=timm", "model.arch=resnet1x")
    assert message.startswith("model.arch='resnet1x': not a timm model")


def test_missing_timm_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "timm", None)  # what `import timm` meets when absent
    with pytest.raises(ConfigError, match=r"pip install 'mptrain\[timm\]'"):
        build_model(TimmModelConfig(arch="resnet18"), 1, 8, 5)


# ----------------------------------------------------------------------------------- custom model
def test_extra_keys_reach_the_typed_config_and_the_run_signature(launch_dir):
    def signature(width: int) -> dict:
        cfg = compose_run(*CUSTOM_MODEL, f"+model.width={width}", *CUSTOM_DATA)
        assert cfg.model.kwargs == {"width": width}
        policy = resolve_precision(cfg.precision, torch.device("cpu"), cfg.fp8)
        return run_signature(cfg, Precision(policy))

    narrow, wide = signature(8), signature(64)
    assert narrow["model.kwargs.width"] == 8
    assert {k for k in narrow if narrow[k] != wide[k]} == {"model.kwargs.width"}


def test_extra_keys_are_still_refused_by_every_other_option():
    with pytest.raises(
        ConfigError,
        match=r"^model\.width: unknown key \(did you mean model\.widths\?\); accepted keys: name, widths",
    ):
        compose_run("model=cnn", "+model.width=64")


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("tiny_net.Nope", "tiny_net has no attribute 'Nope'"),
        ("broken.Net", "cannot import it (ValueError: broken on import)"),
        # The module exists; what it imports does not: name that, not the module.
        (
            "needs_missing.Net",
            "cannot import it (ModuleNotFoundError: No module named 'no_such_dependency')",
        ),
    ],
)
def test_a_target_that_does_not_resolve_says_why(launch_dir, target, message):
    (launch_dir / "broken.py").write_text("raise ValueError('broken on import')\n")
    (launch_dir / "needs_missing.py").write_text("import no_such_dependency\n")
    with pytest.raises(ConfigError) as caught:
        build_model(CustomModelConfig(_target_=target), 1, 8, 4)
    assert str(caught.value).startswith(f"model._target_={target!r}: {message}")


def test_a_user_value_wins_over_the_dataset_fact(launch_dir):
    cfg = CustomModelConfig(_target_="tiny_net.TinyNet", kwargs={"width": 4, "num_classes": 3})
    with pytest.raises(ConfigError, match=r"returns \(2, 3\) .* \(2, 4\) logits"):
        build_model(cfg, 1, 8, 4)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "pattern"),
    [
        (
            ("model._target_=no_such_pkg.Net",),
            r"^model\._target_='no_such_pkg\.Net': cannot import",
        ),
        (
            ("model._target_=collections.OrderedDict",),
            r"^model\._target_='collections\.OrderedDict': OrderedDict is not a torch\.nn\.Module",
        ),
        (
            ("model._target_=tiny_net.TinyNet", "+model.depth=3"),
            r"^model\._target_='tiny_net\.TinyNet': does not take the given keys \['depth'\] ",
        ),
        (
            ("model._target_=torch.nn.Linear", "+model.in_features=5", "+model.out_features=4"),
            r"^model\._target_='torch\.nn\.Linear': a forward pass of the dataset's 1x8x8 images "
            r"failed \(RuntimeError",
        ),
    ],
    ids=["unimportable", "not-a-module", "rejected-key", "wrong-input"],
)
def test_bad_custom_model_is_one_line_before_training(launch_dir, args, pattern):
    message = cli_error(launch_dir, "model=custom", *args, *CUSTOM_DATA)
    assert re.search(pattern, message), message


# --------------------------------------------------------------------------------- custom dataset
FOLDER_DATA = textwrap.dedent(
    """
    import torch

    class Squares(torch.utils.data.Dataset):
        classes = ["dark", "bright"]

        def __init__(self, n, side):
            self.n, self.side = n, side

        def __len__(self):
            return self.n

        def __getitem__(self, i):
            label = i % 2
            return torch.full((3, self.side, self.side), float(label)), label

    def make(n=40, side=8):
        return Squares(n, side), Squares(n // 2, side)

    def flat(n=40):
        return Squares(n, 8), [(torch.zeros(64), 0)]
    """
)


def test_a_file_style_dataset_goes_through_the_dataloader(launch_dir):
    (launch_dir / "squares.py").write_text(FOLDER_DATA)
    layout = BatchLayout(8, 16, torch.device("cpu"), seed=0, num_workers=0)
    bundle = build_data(CustomDatasetConfig(_target_="squares.make", kwargs={"n": 32}), layout)
    assert bundle.train.feed == "DataLoader (0 workers)"
    assert (bundle.num_classes, bundle.in_channels, bundle.image_size) == (2, 3, 8)
    images, labels = next(iter(bundle.train.batches(0)))
    assert images.shape == (8, 3, 8, 8) and labels.dtype == torch.int64

    in_memory = CustomDatasetConfig(_target_="squares.make", in_memory=True)
    assert build_data(in_memory, layout).train.feed.startswith("tensor-indexed")


def test_numpy_integer_labels_are_labels(launch_dir):
    (launch_dir / "np_labels.py").write_text(
        "import numpy as np, torch\n"
        "class Data(torch.utils.data.Dataset):\n"
        "    classes = ['a', 'b']\n"
        "    def __len__(self):\n        return 16\n"
        "    def __getitem__(self, i):\n"
        "        return torch.zeros(1, 4, 4), np.int64(i % 2)\n"
        "def make():\n    return Data(), Data()\n"
    )
    layout = BatchLayout(8, 16, torch.device("cpu"), seed=0, num_workers=0)
    bundle = build_data(CustomDatasetConfig(_target_="np_labels.make"), layout)
    labels = torch.cat([labels for _, labels in bundle.train.batches(0)])
    assert labels.dtype == torch.int64 and sorted(labels.tolist()) == [0] * 8 + [1] * 8


@pytest.mark.slow
def test_a_dataset_of_wrong_shapes_is_one_line_before_training(launch_dir):
    (launch_dir / "squares.py").write_text(FOLDER_DATA)
    message = cli_error(
        launch_dir, *CUSTOM_MODEL, "dataset=custom", "dataset._target_=squares.flat"
    )
    assert message.startswith("dataset._target_='squares.flat': validation sample 0: the image is")


@pytest.mark.slow
def test_a_custom_model_is_evaluated_and_loaded_back_with_its_constructor_arguments(launch_dir):
    import mptrain

    model_args = ("model=custom", "model._target_=tiny_net.TinyNet", "+model.width=16")
    trained = mptrain_console(
        launch_dir, *model_args, *CUSTOM_DATA, *TINY, "checkpoint.enabled=true"
    )
    assert trained.returncode == 0, describe(trained)
    # The checkpoint names tiny_net.TinyNet: its code runs only when the user says so.
    refused = mptrain_console(launch_dir, "eval", "resume=run", "hydra.run.dir=eval")
    assert refused.returncode == 2 and "trust_checkpoint_code=true" in refused.stderr
    evaluated = mptrain_console(
        launch_dir, "eval", "resume=run", "precision=bf16", "hydra.run.dir=eval",
        "trust_checkpoint_code=true",
    )  # fmt: skip
    assert evaluated.returncode == 0, describe(evaluated)
    result = json.loads((launch_dir / "eval" / "eval.json").read_text())
    assert result["samples"] == 128
    # Trained in precision=auto (bf16 on a CPU with BF16 units, fp32 elsewhere): evaluating in
    # the precision it trained in reproduces the accuracy recorded at training time exactly.
    if result["trained_precision"] == "bf16":
        assert result["accuracy_difference"] == 0
    model = mptrain.load_model(launch_dir / "run", trust_checkpoint_code=True)
    assert type(model).__name__ == "TinyNet"
    assert model.mptrain_classes == ["top-left", "top-right", "bottom-left", "bottom-right"]
    assert sum(p.numel() for p in model.parameters()) == (9 * 16 + 16) + (16 * 4 + 4)
    # Setting a constructor argument again (its saved value) is the same model, not a conflict.
    again = mptrain_console(
        launch_dir, "eval", "resume=run", "+model.width=16", "model._target_=tiny_net.TinyNet",
        "dataset._target_=blobs.make_blobs",  # both given: the user's own code, no opt-in
    )  # fmt: skip
    assert again.returncode == 0, describe(again)


@pytest.mark.slow
def test_a_custom_dataset_fed_by_workers_has_no_preprocessing_to_replay(launch_dir):
    import mptrain

    (launch_dir / "squares.py").write_text(FOLDER_DATA)
    data = ("dataset=custom", "dataset._target_=squares.make", "num_workers=0", "batch_size=8")
    trained = run_mptrain(launch_dir, *CUSTOM_MODEL, *data, *TINY, "checkpoint.enabled=true")
    assert trained.returncode == 0, describe(trained)
    model = mptrain.load_model(launch_dir / "run", trust_checkpoint_code=True)
    assert model.mptrain_classes == ["dark", "bright"]
    with pytest.raises(ValueError, match="prepared by its dataset's own code"):
        model.mptrain_preprocess(torch.zeros(3, 8, 8))
