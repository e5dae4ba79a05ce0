"""Bad and hostile data (issue 27): a CIFAR batch whose pickle would run code is refused without
running it (a genuine one in any pickle protocol reads back exactly); a language model's text
that is missing, too short for a window or not UTF-8 is refused in one line naming the cause.
"""

from __future__ import annotations

import codecs
import os
import pickle
import re
import sys
import textwrap

import numpy as np
import pytest
from support.datafiles import (
    CPU,
    build,
    collect,
    random_bytes,
    tv_config,
    unnormalise,
    write_cifar10,
    write_cifar100,
)
from support.runs import run_cli

from mptrain.config.base import ConfigError
from mptrain.config.data import CustomDatasetConfig, TextDatasetConfig
from mptrain.data.batches import BatchLayout
from mptrain.data.build import build_data


# -------------------------------------------------------------------- CIFAR batches (item 10)
class ShellCommand:
    """What a crafted batch file holds: unpickling it would call ``os.system(command)``."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def test_a_cifar_batch_whose_pickle_would_run_code_is_refused_without_running_it(tmp_path):
    write_cifar10(tmp_path)
    marker = tmp_path / "ran"
    batch = tmp_path / "cifar-10-batches-py" / "data_batch_1"
    crafted = {b"data": ShellCommand(f"touch {marker}"), b"labels": [0]}
    batch.write_bytes(pickle.dumps(crafted, protocol=2))
    with pytest.raises(ConfigError) as refused:
        build(tv_config("cifar10", tmp_path))
    assert not marker.exists()
    message = str(refused.value)
    assert len(message.splitlines()) == 1
    assert re.search(
        rf"dataset.root='{tmp_path}': \S*data_batch_1 is not a cifar10 batch: its pickle would "
        rf"call {os.system.__module__}.system; refused",
        message,
    ), message


def test_a_cifar100_meta_file_whose_pickle_would_run_code_is_refused(tmp_path):
    write_cifar100(tmp_path)
    marker = tmp_path / "ran"
    meta = tmp_path / "cifar-100-python" / "meta"
    meta.write_bytes(pickle.dumps({b"fine_label_names": ShellCommand(f"touch {marker}")}))
    with pytest.raises(ConfigError, match=r"meta is not a cifar100 batch: its pickle would call"):
        build(tv_config("cifar100", tmp_path))
    assert not marker.exists()


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_a_genuine_cifar_batch_reads_back_in_every_pickle_protocol(tmp_path, protocol):
    """torchvision's format: b'data' uint8 N x 3072 (R, G, B planes), b'labels' a list of ints."""
    written = write_cifar10(tmp_path)
    images = random_bytes((3, 3072), seed=7)
    entry = {b"batch_label": b"testing batch 1 of 1", b"data": images, b"labels": [4, 0, 9]}
    entry[b"filenames"] = [b"a.png", b"b.png", b"c.png"]
    test_batch = tmp_path / "cifar-10-batches-py" / "test_batch"
    test_batch.write_bytes(pickle.dumps(entry, protocol=protocol))
    bundle = build(tv_config("cifar10", tmp_path), eval_batch_size=2)
    val_images, val_labels = collect(bundle.val)
    assert val_labels.tolist() == [4, 0, 9]
    assert np.array_equal(unnormalise(val_images, "cifar10").reshape(3, 3072).numpy(), images)
    assert len(collect(bundle.train, epoch=0)[1]) == len(written["train_labels"])


def test_a_batch_written_by_python_2_and_numpy_1_names_numpys_old_module(tmp_path):
    """The authors' files name ``numpy.core.multiarray._reconstruct`` (numpy 2 writes
    ``numpy._core``): both are the one reconstruction function, and read."""
    entry = {b"data": random_bytes((2, 3072), seed=1), b"fine_labels": [3, 99]}
    data = pickle.dumps(entry, protocol=2).replace(b"numpy._core.", b"numpy.core.")
    assert b"cnumpy.core.multiarray\n_reconstruct" in data
    from mptrain.data.cifarfile import read_cifar_pickle

    path = tmp_path / "train"
    path.write_bytes(data)
    read = read_cifar_pickle(path)
    assert read[b"fine_labels"] == [3, 99] and np.array_equal(read[b"data"], entry[b"data"])


def test_protocol_2_bytes_decode_only_as_latin1(tmp_path):
    """Protocol 2 writes bytes as ``_codecs.encode(text, 'latin1')``; any other codec is refused,
    so a file cannot choose what the codec registry looks up."""
    from mptrain.data.cifarfile import RefusedGlobal, read_cifar_pickle

    path = tmp_path / "data_batch_1"

    class Rot13:
        def __reduce__(self):
            return codecs.encode, ("payload", "rot13")

    path.write_bytes(pickle.dumps({b"data": Rot13()}, protocol=2))
    with pytest.raises(RefusedGlobal, match=r"_codecs.encode\(\.\.\., 'rot13'\)"):
        read_cifar_pickle(path)


# ------------------------------------------------------------------------ language-model text
def build_text(path, block_size: int = 32, **keys):
    """build_data of dataset=text on ``path`` with windows of ``block_size`` tokens."""
    layout = BatchLayout(2, 4, CPU, seed=0, num_workers=0, sequence_length=block_size)
    return build_data(TextDatasetConfig(path=str(path), **keys), layout)


def test_a_missing_text_path_is_said_to_be_missing(tmp_path):
    with pytest.raises(ConfigError, match=r"dataset.path='\S*nowhere.txt': \S* does not exist"):
        build_text(tmp_path / "nowhere.txt")


@pytest.mark.parametrize(
    ("content", "keys", "message"),
    [
        (
            b"x" * 20,
            {},
            r"dataset.path='\S+': the text has 20 bytes \(20 tokens\), and its training split "
            r"18 tokens, fewer than one window of model.block_size \+ 1 = 33; use a longer text",
        ),
        (
            b"x" * 100,
            {},
            r"dataset.path='\S+': the text has 100 bytes \(100 tokens\), and its validation "
            r"\(the last dataset.val_fraction=0.1 of it\) split 10 tokens, fewer than one window of "
            r"model.block_size \+ 1 = 33; use a longer text, a larger dataset.val_fraction",
        ),
        (b"", {}, r"dataset.path='\S+': the text is empty, and its training split 0 tokens"),
        (
            b"x" * 10_000,
            {"max_bytes": 30},
            r"dataset.max_bytes=30: the 30 bytes \(30 tokens\) read leave the training split 27 "
            r"tokens, fewer than one window of model.block_size \+ 1 = 33; raise dataset.max_bytes",
        ),
    ],
    ids=["short", "short-validation", "empty", "cut-by-max-bytes"],
)
def test_a_text_too_short_for_a_window_names_the_cause_and_its_key(
    tmp_path, content, keys, message
):
    text = tmp_path / "input.txt"
    text.write_bytes(content)
    with pytest.raises(ConfigError, match=message) as refused:
        build_text(text, **keys)
    assert len(str(refused.value).splitlines()) == 1
    if not keys:
        assert "max_bytes" not in str(refused.value)


def test_a_text_mostly_not_utf8_is_refused_for_characters_and_read_as_bytes(tmp_path):
    text = tmp_path / "latin1.txt"
    text.write_bytes("Größe, Maß und Fuß. ".encode("latin-1") * 100)  # 4 of 20 bytes not UTF-8
    message = (
        r"dataset.path='\S+': 400 of its 2,000 bytes \(20.0%\) are not UTF-8, and "
        r"dataset.vocabulary=chars would read each as U\+FFFD; use dataset.vocabulary=bytes"
    )
    with pytest.raises(ConfigError, match=message):
        build_text(text, vocabulary="chars")
    assert build_text(text, vocabulary="bytes").num_classes == 256


def test_a_few_bytes_not_utf8_are_noted_not_hidden(tmp_path):
    text = tmp_path / "cut.txt"
    text.write_bytes(("naïve café " * 200).encode() + b"\xff")  # one stray byte in 2,601
    bundle = build_text(text, vocabulary="chars")
    assert "1 byte not UTF-8, read as U+FFFD" in bundle.description
    assert bundle.text.describe()["not_utf8_bytes"] == 1
    assert build_text(text, vocabulary="bytes").text.describe()["not_utf8_bytes"] is None


# ------------------------------------------------------------------ labels read by workers
# A custom dataset whose sample 37 of the training set has label 17 of 10 classes: the first
# sample (checked before training) is fine, the bad one is met only as the workers read it.
BAD_LABEL_DATA = textwrap.dedent(
    """
    import torch

    class Labelled(torch.utils.data.Dataset):
        def __init__(self, n, bad):
            self.n, self.bad = n, bad

        def __len__(self):
            return self.n

        def __getitem__(self, i):
            return torch.full((1, 4, 4), float(i % 10)), 17 if i == self.bad else i % 10

    def make(bad=37):
        return Labelled(48, bad), Labelled(16, None)
    """
)


@pytest.mark.parametrize("workers", [0, 1])
def test_a_label_out_of_range_read_by_a_worker_names_the_dataset_sample_and_range(
    tmp_path, monkeypatch, workers
):
    (tmp_path / "labelled.py").write_text(BAD_LABEL_DATA)
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = CustomDatasetConfig(_target_="labelled.make", num_classes=10, in_memory=False)
    bundle = build_data(cfg, BatchLayout(8, 8, CPU, seed=0, num_workers=workers))
    message = r"^dataset custom: training sample 37 has label 17, outside 0\.\.9 \(dataset.num_classes=10\)$"
    with pytest.raises(RuntimeError, match=message) as refused:
        collect(bundle.train)
    assert refused.type.__name__ == "BadLabel"
    monkeypatch.delitem(sys.modules, "labelled")


@pytest.mark.slow
def test_a_bad_label_in_a_worker_fed_run_is_one_line_exit_1(tmp_path, monkeypatch):
    (tmp_path / "labelled.py").write_text(BAD_LABEL_DATA)
    args = [
        "model=mlp",
        "device=cpu",
        "progress=false",
        "dataset=custom",
        "dataset._target_=labelled.make",
        "+dataset.num_classes=10",
        "num_workers=1",
        "batch_size=8",
        "max_steps=12",
        "checkpoint.enabled=false",
    ]
    outcome = run_cli(args, tmp_path, monkeypatch, jobs=True)
    assert outcome.code == 1, outcome
    lines = outcome.stderr.splitlines()
    assert len(lines) == 1, outcome
    assert re.search(
        r"^mptrain: error: run failed: BadLabel: dataset custom: training sample 37 has label 17, "
        r"outside 0\.\.9 \(dataset.num_classes=10\) \(report in ",
        lines[0],
    ), lines[0]


@pytest.mark.parametrize("kind", ["fifo", "device", "loop"])
def test_a_text_path_that_is_no_file_nor_directory_is_named(tmp_path, kind):
    """Issue 39, item 25: a FIFO or /dev/zero said "no .txt files" (a FIFO would block the run),
    a symbolic link loop "does not exist"."""
    import os
    from pathlib import Path

    from mptrain.config.data import TextDatasetConfig
    from mptrain.data.lm import load_text

    if kind == "fifo":
        path = tmp_path / "fifo"
        os.mkfifo(path)
    elif kind == "device":
        path = Path("/dev/zero")
    else:
        path = tmp_path / "a"
        path.symlink_to(tmp_path / "b")
        (tmp_path / "b").symlink_to(path)
    expected = "symbolic link that leads nowhere" if kind == "loop" else "not a regular file"
    with pytest.raises(ConfigError, match=expected):
        load_text(TextDatasetConfig(path=str(path)))
