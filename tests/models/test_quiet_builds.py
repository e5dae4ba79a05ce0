"""Building a model says nothing the user cannot act on: ``model=hf`` imports torchao through
transformers, and torch logs a deprecation notice for each Enum torchao registers as a pytree
constant (torchao's to fix). Exactly that notice is dropped, during the build only."""

from __future__ import annotations

import enum
import logging
import subprocess
import sys

import pytest
import torch

from mptrain.models.hf import quiet_enum_constant_notice

NOTICE = "register_constant() on Enum subclasses is deprecated"


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def register_enum() -> None:
    """torch's real call as torchao makes it (a ``str`` Enum), with a new class each time."""

    class Choice(str, enum.Enum):
        A = "a"

    torch.utils._pytree.register_constant(Choice)


def test_only_the_enum_constant_notice_is_dropped_and_only_inside():
    logger = logging.getLogger("torch.utils._pytree")
    records = Records()
    logger.addHandler(records)
    try:
        register_enum()
        if not any(NOTICE in m for m in records.messages):
            pytest.skip(f"torch {torch.__version__} does not log the notice")
        records.messages.clear()
        with quiet_enum_constant_notice():
            register_enum()
            logger.warning("another warning of the same logger")
        assert records.messages == ["another warning of the same logger"]
        register_enum()
        assert any(NOTICE in m for m in records.messages[1:])
        assert not logger.filters
    finally:
        logger.removeHandler(records)


BUILD = """
import sys
from mptrain.config.models import HFModelConfig
from mptrain.models.hf import build_hf
assert "torchao" not in sys.modules
cfg = HFModelConfig(config={"n_layer": 1, "n_head": 2, "n_embd": 32}, block_size=8)
build_hf(cfg, 0, 0, 100)
print("torchao imported:", "torchao" in sys.modules)
"""


@pytest.mark.slow
def test_building_an_hf_model_logs_no_pytree_notice():
    pytest.importorskip("transformers")
    done = subprocess.run(
        [sys.executable, "-c", BUILD], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr
    assert NOTICE not in done.stderr and "_pytree" not in done.stderr, done.stderr
    assert "Enum subclass" not in done.stdout + done.stderr


# ----------------------------------------------- compile=true on a CPU: torch's CUDA_HOME notice
CUDA_NOTICE = "No CUDA runtime is found, using CUDA_HOME="


def test_a_cpu_device_drops_only_the_cuda_home_notice(tmp_path, monkeypatch):
    from torch.utils import cpp_extension

    from mptrain.platform.hardware import _drop_no_cuda_runtime, resolve_device

    monkeypatch.setenv("CUDA_HOME", str(tmp_path))  # a toolkit torch finds...
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # ...and no runtime
    logger = logging.getLogger("torch.utils.cpp_extension")
    # as in a fresh process (an earlier test's CPU device installed the filter); restored after
    unfiltered = [f for f in logger.filters if f is not _drop_no_cuda_runtime]
    monkeypatch.setattr(logger, "filters", unfiltered)
    records = Records()
    logger.addHandler(records)
    try:
        cpp_extension._find_cuda_home()  # torch's probe, as importing cpp_extension runs it
        assert any(m.startswith(CUDA_NOTICE) for m in records.messages)
        records.messages.clear()
        assert resolve_device("cpu") == torch.device("cpu")
        resolve_device("auto")  # installs the filter once
        cpp_extension._find_cuda_home()
        logger.warning("another warning of the same logger")
        assert records.messages == ["another warning of the same logger"]
        assert logger.filters.count(_drop_no_cuda_runtime) == 1
    finally:
        logger.removeHandler(records)


IMPORT_CPP_EXTENSION = """
import sys
import torch
if sys.argv[1] == "quiet":
    from mptrain.platform.hardware import resolve_device
    resolve_device("cpu")
import torch.utils.cpp_extension  # what inductor imports compiling C++ kernels for the CPU
"""


def test_importing_cpp_extension_after_a_cpu_device_is_silent():
    if torch.cuda.is_available():
        pytest.skip("torch logs no CUDA_HOME notice where CUDA runs")

    def stderr(mode: str) -> str:
        command = [sys.executable, "-c", IMPORT_CPP_EXTENSION, mode]
        done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=True)
        return done.stderr

    if CUDA_NOTICE not in stderr("plain"):
        pytest.skip("no CUDA toolkit here: torch logs no CUDA_HOME notice")
    assert "CUDA" not in stderr("quiet")
