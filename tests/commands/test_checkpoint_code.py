"""A crafted checkpoint must not run code (issue 39, item 14).

A checkpoint of dicts and strings passes ``torch.load(weights_only=True)``; ``mptrain eval``,
``mptrain sample`` and ``mptrain.load_model`` rebuild the model (and data) from the config inside
it. Its ``_target_`` is code: imported or called only when the user gives it on the command line
or opts in with ``trust_checkpoint_code``, and then never recursively. Each attack below names a
callable that writes a marker file when called; the marker must never appear.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from support.runs import run_cli, tiny_run, train

import mptrain
from mptrain.config.base import ConfigError
from mptrain.config.targets import checkpoint_targets, refuse_checkpoint_code

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A real checkpoint of a tiny MLP run on digits."""
    out = tmp_path_factory.mktemp("run")
    train(tiny_run("max_steps=2"), out)
    return out


def code_that_touches(marker: Path) -> str:
    return f"__import__('pathlib').Path({str(marker)!r}).touch()"


def crafted(trained: Path, directory: Path, **sections: dict) -> Path:
    """A copy of ``trained``'s newest checkpoint with ``sections`` of its config replaced."""
    (source,) = sorted((trained / "checkpoints").glob("step_*.pt"))[-1:]
    payload = torch.load(source, weights_only=True)
    payload["config"].update(sections)
    path = directory / "crafted.pt"
    torch.save(payload, path)
    return path


def sympify_model(marker: Path) -> dict:
    """The issue's attack: sympy (installed with torch) evaluates the string it is given."""
    return {
        "name": "custom",
        "_target_": "sympy.sympify",
        "kwargs": {"a": code_that_touches(marker)},
    }


def nested_in_linear(marker: Path) -> dict:
    """A real nn.Module whose keys hold a node Hydra would instantiate recursively."""
    payload = {"_target_": "sympy.sympify", "a": code_that_touches(marker)}
    kwargs = {"in_features": 64, "out_features": 10, "device": payload}
    return {"name": "custom", "_target_": "torch.nn.Linear", "kwargs": kwargs}


def test_eval_refuses_a_checkpoints_target_and_runs_nothing(trained, tmp_path, monkeypatch):
    marker = tmp_path / "PWNED"
    evil = crafted(trained, tmp_path, model=sympify_model(marker))
    outcome = run_cli(["eval", f"resume={evil}"], tmp_path, monkeypatch, jobs=True)
    assert outcome.code == 2, outcome
    assert outcome.stderr.strip() == (
        f"mptrain: error: model._target_='sympy.sympify' comes from the checkpoint {evil}: "
        "mptrain does not import or call code a checkpoint names (anyone can write one); if you "
        "trust it, give model._target_=sympy.sympify on the command line, or "
        "trust_checkpoint_code=true"
    )
    assert not marker.exists()
    assert not (tmp_path / "outputs").exists()  # nothing written for a refused evaluation


def test_eval_refuses_a_dataset_target_too(trained, tmp_path, monkeypatch):
    marker = tmp_path / "PWNED"
    dataset = {"name": "custom", "_target_": "sympy.sympify", "num_classes": 10}
    evil = crafted(
        trained, tmp_path, dataset={**dataset, "kwargs": {"a": code_that_touches(marker)}}
    )
    outcome = run_cli(["eval", f"resume={evil}"], tmp_path, monkeypatch, jobs=True)
    assert outcome.code == 2 and "dataset._target_='sympy.sympify' comes from the" in outcome.stderr
    assert not marker.exists()


def test_a_nested_target_is_refused_even_when_the_top_one_is_given(trained, tmp_path, monkeypatch):
    """Giving ``model._target_`` vouches for that target only: the checkpoint's keys still come
    from the checkpoint, and a ``_target_`` among them is named."""
    marker = tmp_path / "PWNED"
    evil = crafted(trained, tmp_path, model=nested_in_linear(marker))
    args = ["eval", f"resume={evil}", "model._target_=torch.nn.Linear"]
    outcome = run_cli(args, tmp_path, monkeypatch, jobs=True)
    assert outcome.code == 2, outcome
    assert (
        "model.kwargs.device._target_='sympy.sympify' comes from the checkpoint" in outcome.stderr
    )
    assert not marker.exists()


def test_trusted_the_target_is_called_but_never_recursively(trained, tmp_path, monkeypatch):
    """With the opt-in, nn.Linear is built; the node in its keys is passed as the dict it is
    (nn.Linear then refuses it as a device), never called."""
    marker = tmp_path / "PWNED"
    evil = crafted(trained, tmp_path, model=nested_in_linear(marker))
    args = ["eval", f"resume={evil}", "trust_checkpoint_code=true"]
    outcome = run_cli(args, tmp_path, monkeypatch, jobs=True)
    assert outcome.code == 2, outcome
    assert "model._target_='torch.nn.Linear': raised TypeError" in outcome.stderr
    assert "must be torch.device, not dict" in outcome.stderr
    assert not marker.exists()


def test_load_model_and_sample_refuse_it(trained, tmp_path, monkeypatch):
    marker = tmp_path / "PWNED"
    evil = crafted(trained, tmp_path, model=sympify_model(marker))
    with pytest.raises(ConfigError, match=r"pass trust_checkpoint_code=True \(load_model\)$"):
        mptrain.load_model(evil)
    with pytest.raises(ConfigError, match=r"model\._target_='sympy\.sympify' comes from"):
        mptrain.load_model(str(evil), checkpoint="latest")
    outcome = run_cli(["sample", f"resume={evil}"], tmp_path, monkeypatch, jobs=True)
    assert outcome.code == 2 and "add trust_checkpoint_code=true (mptrain sample)" in outcome.stderr
    assert not marker.exists()


@pytest.fixture
def custom_run(tmp_path, monkeypatch) -> Path:
    """A real model=custom run (examples/tiny_net.py, imported from the launch directory)."""
    for source in EXAMPLES.glob("*.py"):
        shutil.copy(source, tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "custom"
    train(tiny_run("model=custom", "model._target_=tiny_net.TinyNet", "max_steps=2"), out)
    return out


def test_a_users_own_custom_model_evaluates_when_given_or_trusted(custom_run, monkeypatch):
    cwd = custom_run.parent
    refused = run_cli(["eval", f"resume={custom_run}"], cwd, monkeypatch, jobs=True)
    assert refused.code == 2 and "model._target_='tiny_net.TinyNet' comes from" in refused.stderr
    for opt_in in ("model._target_=tiny_net.TinyNet", "trust_checkpoint_code=true"):
        out = cwd / opt_in.split("=")[0]
        args = ["eval", f"resume={custom_run}", opt_in, f"hydra.run.dir={out}"]
        outcome = run_cli(args, cwd, monkeypatch, jobs=True)
        assert outcome.code == 0, (opt_in, outcome)
        assert (out / "eval.json").is_file()
    model = mptrain.load_model(custom_run, trust_checkpoint_code=True)
    assert type(model).__name__ == "TinyNet"


def test_every_target_of_the_rebuilt_sections_is_found():
    saved = {
        "model": {"_target_": "a.B", "kwargs": {"x": [{"_target_": "c.D"}], "y": {"z": 1}}},
        "dataset": {"_target_": "e.f"},
        "optimizer": {"_target_": "not.rebuilt"},  # eval and load_model build no optimizer
    }
    assert checkpoint_targets(saved) == {
        "model._target_": "a.B",
        "model.kwargs.x.0._target_": "c.D",
        "dataset._target_": "e.f",
    }
    refuse_checkpoint_code(saved, "x.pt", {"model", "dataset"})  # both replaced: nothing to run
    refuse_checkpoint_code(saved, "x.pt", trusted=True)
    with pytest.raises(ConfigError, match=r"^dataset\._target_='e\.f' comes from the checkpoint"):
        refuse_checkpoint_code(saved, "x.pt", {"model"})
