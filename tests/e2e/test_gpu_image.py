"""A rehearsal of the lent GPU machine's image on the CPU: gpu_all's pytest step collects every GPU
test there although the image lacks torchao and everything else mptrain's ``test`` extra adds.

benchmarks/gpu_image/sitecustomize.py, put first on PYTHONPATH, makes those packages unimportable
(``import torchao`` raises ModuleNotFoundError, ``find_spec`` says None), as on the image. CI
installs the test extra, so without this rehearsal a module-level ``import torchao`` in a GPU test
file passes here and costs the whole GPU step there ("Interrupted: 1 error during collection").
The scripts gpu_all runs are rehearsed the same way by its smoke run
(tests/e2e/test_benchmarks.py::test_gpu_all_smoke_run_runs_every_step_and_summarises).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
from support.processes import describe

REPO = Path(__file__).resolve().parents[2]
GPU_IMAGE = REPO / "benchmarks" / "gpu_image"
# The GPU tests that can run on an SM90 machine (H100/H200): the pytest step is sized for them.
SM90_RUNNABLE = 29

pytestmark = pytest.mark.slow


def load_gpu_all():
    spec = importlib.util.spec_from_file_location("gpu_all", REPO / "benchmarks" / "gpu_all.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_all"] = module  # dataclasses look their module up
    sys.path.insert(0, str(REPO / "benchmarks"))  # gpu_all imports jsondoc from beside it
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    return module


def collect(argv: list[str], as_image: bool, env: dict) -> subprocess.CompletedProcess:
    """``argv`` with ``--collect-only -qq`` (its ``-v`` undone: node ids) in the repository root, with gpu_all's environment;
    ``as_image``: the GPU image's packages only."""
    env = dict(env)
    if as_image:
        env["PYTHONPATH"] = f"{GPU_IMAGE}:{env['PYTHONPATH']}"
    return subprocess.run(
        [*argv, "--collect-only", "-qq"], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=300, stdin=subprocess.DEVNULL,
    )  # fmt: skip


def node_ids(result: subprocess.CompletedProcess) -> set[str]:
    return {line for line in result.stdout.splitlines() if "::" in line}


def pytest_step_argv(tmp_path: Path) -> list[str]:
    """gpu_all's pytest step, exactly as the GPU run plans it (no pytest-timeout: its limit
    does not change what collects)."""
    gpu_all = load_gpu_all()
    steps = gpu_all.plan(sys.executable, tmp_path, smoke=False, test_timeout_s=None)
    (step,) = [s for s in steps if s.name == "pytest_gpu"]
    return step.argv


def test_the_image_lacks_what_the_rehearsal_blocks():
    code = (
        "import importlib.util\n"
        "for name in ('torchao', 'timm', 'transformers', 'mlflow', 'tensorboard', 'optuna'):\n"
        "    assert importlib.util.find_spec(name) is None, name\n"
        "    try:\n"
        "        __import__(name)\n"
        "    except ModuleNotFoundError:\n"
        "        pass\n"
        "    else:\n"
        "        raise AssertionError(name)\n"
        "import torch, torchvision, hydra, omegaconf, mptrain.cli\n"  # what the image has
        "print('image ok')\n"
    )
    env = load_gpu_all().child_env() | {"PYTHONPATH": f"{GPU_IMAGE}:{REPO}"}
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0 and "image ok" in result.stdout, describe(result)


def test_every_gpu_test_collects_on_the_gpu_image(tmp_path):
    argv = pytest_step_argv(tmp_path)
    assert "--continue-on-collection-errors" in argv
    env = load_gpu_all().child_env()
    here = collect(argv, as_image=False, env=env)
    there = collect(argv, as_image=True, env=env)
    assert here.returncode == 0, describe(here)
    assert there.returncode == 0, describe(there)  # 1 or 2 when a file failed to import
    assert "error" not in there.stdout.splitlines()[-1], describe(there)
    expected = node_ids(here)
    assert len(expected) >= SM90_RUNNABLE and all("test_" in node for node in expected)
    assert node_ids(there) == expected, sorted(expected ^ node_ids(there))


def test_a_module_level_import_of_what_the_image_lacks_is_caught(tmp_path):
    """The rehearsal's own check: a GPU test file that imports torchao at module level fails to
    collect on the image, the other files' tests still collect (the step goes on), and the
    comparison above would see the difference."""
    bad = tmp_path / "test_needs_torchao.py"
    bad.write_text(
        "import pytest\nimport torchao  # noqa: F401\n\n\n"
        "@pytest.mark.gpu\ndef test_uses_torchao():\n    pass\n"
    )
    good = tmp_path / "test_plain.py"
    good.write_text("import pytest\n\n\n@pytest.mark.gpu\ndef test_plain():\n    pass\n")
    # The tmp files are outside tests/: the project's configuration registers the gpu marker.
    step = pytest_step_argv(tmp_path)
    argv = [*step[: step.index("gpu") - 1], "-c", str(REPO / "pyproject.toml"), "-m", "gpu"]
    env = load_gpu_all().child_env()
    here = collect([*argv, str(bad), str(good)], as_image=False, env=env)
    there = collect([*argv, str(bad), str(good)], as_image=True, env=env)
    assert here.returncode == 0 and len(node_ids(here)) == 2, describe(here)
    assert there.returncode != 0, describe(there)
    assert "ModuleNotFoundError" in there.stdout and "torchao" in there.stdout
    assert [node.rsplit("::", 1)[1] for node in node_ids(there)] == ["test_plain"]
