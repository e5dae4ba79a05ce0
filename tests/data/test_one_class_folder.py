"""An image folder of one class (``dataset=imagefolder``, ``root/<split>/<class>/<image>`` with a
single class folder) is refused in one line: every prediction would be that class, so the run
would report 100 % accuracy and a loss of 0 having learnt nothing."""

from __future__ import annotations

import pytest
from support.datafiles import write_image_folder
from support.runs import run_cli

from mptrain.config.base import ConfigError
from mptrain.config.data import ImageFolderConfig
from mptrain.data.folder import load_image_folders

ONE_CLASS = {"train": {"cat": 4}, "val": {"cat": 2}}


def test_a_one_class_folder_is_refused_naming_the_root(tmp_path):
    write_image_folder(tmp_path, ONE_CLASS, size=12)
    cfg = ImageFolderConfig(root=str(tmp_path), image_size=8, resize_size=10)
    with pytest.raises(ConfigError) as refused:
        load_image_folders(cfg)
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(
        f"dataset.root={str(tmp_path)!r}: train/ holds one class folder (cat/)"
    )
    assert "at least 2 class folders" in message


def test_two_class_folders_still_load(tmp_path):
    write_image_folder(tmp_path, {"train": {"cat": 2, "dog": 2}, "val": {"cat": 1, "dog": 1}})
    folders = load_image_folders(ImageFolderConfig(root=str(tmp_path), image_size=8))
    assert folders.train.classes == ["cat", "dog"]


def test_the_command_exits_2_in_one_line(tmp_path, monkeypatch):
    write_image_folder(tmp_path / "data", ONE_CLASS, size=12)
    args = ["dataset=imagefolder", "dataset.root=data", "dataset.image_size=8"]
    args += ["dataset.resize_size=10", "device=cpu", "max_steps=2", "batch_size=2"]
    outcome = run_cli([*args, "num_workers=0", "progress=false"], tmp_path, monkeypatch, jobs=True)
    assert outcome.code == 2, outcome.stderr
    lines = outcome.stderr.strip().splitlines()
    assert len(lines) == 1 and "dataset.root=" in lines[0], outcome.stderr
    assert "at least 2 class folders" in lines[0]
