"""gpu_all's ``setup`` step: whether ``--python`` imports mptrain's stack, and the install when not.

It checks that ``--python`` imports torch, torchvision, hydra, omegaconf and mptrain (this
checkout, through PYTHONPATH) and, on the GPU, that CUDA is available. When an import fails (and
no ``--skip-install``): the wheels in ``--wheels`` are installed offline (``pip install
--no-index``), or with ``--pip-install`` ``pip install -e ".[test]"`` runs (a registry is
needed). Without either it fails at once, printing the two commands that carry the wheels. When
setup fails, no other step runs: summary.md says so.

On the H200 lent to these sessions, python3 holds torch (a CUDA build), torchvision, pytest,
pytest-timeout, pillow and rich but not hydra-core, omegaconf or antlr4-python3-runtime, and no
package registry is reachable: FETCH_HERE first, here, then RUN_THERE. Standard library only.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks.gpu_runs import DEVICE_TIMEOUT_S, REPO, SETUP_ESTIMATE_S, SETUP_S, child_env
from benchmarks.gpu_summary import Outcome

# (argv, log, timeout_s) -> (exit code, status, wall seconds): gpu_all.run_command
RunCommand = Callable[[list[str], Path, float], tuple[int | None, str, float]]

SETUP_WHAT = "imports (and CUDA); install when missing"
IMPORTS = "import torch, torchvision, hydra, omegaconf, mptrain.cli"
IMPORT_CHECK_S = 30.0
# What the GPU image lacks of mptrain's runtime dependencies (pyproject.toml), fetched as wheels:
# the versions this project is tested with (omegaconf 2.4 does not satisfy hydra-core 1.3.8).
WHEELS = ["hydra-core==1.3.8", "omegaconf==2.3.1", "antlr4-python3-runtime==4.9.3"]
WHEEL_MODULES = ("hydra", "omegaconf", "antlr4")
FETCH_HERE = "python3 -m benchmarks.gpu_all --fetch-wheels .whl"
RUN_THERE = (
    f'device tool: run(command="python3 -m benchmarks.gpu_all", carry=[".whl"], '
    f"timeout_s={DEVICE_TIMEOUT_S})"
)


def can_import(python: str, smoke: bool, timeout_s: float) -> tuple[bool, str]:
    """Whether ``python`` imports mptrain's stack from this checkout (and, unless ``smoke``,
    sees a CUDA device); what it printed (or why it could not tell)."""
    check = f"{IMPORTS}; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
    if not smoke:
        check += "; assert torch.cuda.is_available(), 'torch sees no CUDA device'"
    try:
        proc = subprocess.run(
            [python, "-c", check], cwd=REPO, env=child_env(), capture_output=True, text=True,
            timeout=timeout_s,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return False, f"the import check timed out after {timeout_s:.0f} s"
    except OSError as exc:
        return False, f"cannot run {python}: {exc}"
    return proc.returncode == 0, (proc.stdout + proc.stderr).strip()


def missing_module(said: str) -> str | None:
    """The top-level module an import check reported missing (ModuleNotFoundError), if any."""
    found = re.search(r"No module named '([\w.]+)'", said)
    return found.group(1).split(".")[0] if found else None


def install_argv(python: str, wheels: Path | None) -> list[str]:
    if wheels is not None:
        found = sorted(str(p) for p in wheels.glob("*.whl"))
        return [python, "-m", "pip", "install", "--no-index", "--find-links", str(wheels), *found]
    return [python, "-m", "pip", "install", "-e", ".[test]"]


def no_install(args: argparse.Namespace, said: str) -> str | None:
    """Why setup fails without installing anything (None: install). Without wheels or
    ``--pip-install`` a registry is not assumed: pip would retry one that cannot be reached."""
    if args.skip_install or "no CUDA device" in said or "timed out" in said:
        return "imports or CUDA; see setup.log"
    if args.wheels is not None or args.pip_install:
        return None
    missing = missing_module(said)
    if missing not in WHEEL_MODULES:
        return f"imports: no module {missing!r}; see setup.log" if missing else "see setup.log"
    print(
        f"[gpu_all] setup: no module {missing!r}, and the wheels were not carried (no .whl/): "
        f"fetch them here, then run with them carried:\n    {FETCH_HERE}\n    {RUN_THERE}",
        flush=True,
    )
    return f"the wheels were not carried: no module {missing!r}; {FETCH_HERE}, then {RUN_THERE}"


def fetch_wheels(target: Path, python: str) -> int:
    """Download (or build) WHEELS into ``target`` where PyPI is reachable, for an offline install."""
    target.mkdir(parents=True, exist_ok=True)
    argv = [python, "-m", "pip", "wheel", "--no-deps", "-w", str(target), *WHEELS]
    code = subprocess.run(argv, check=False).returncode
    print(f"wheels in {target}: {sorted(p.name for p in target.glob('*.whl'))}")
    return code


def has_module(python: str, module: str) -> bool:
    """Whether ``python`` finds ``module`` (importlib.util.find_spec, nothing imported)."""
    code = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"
    try:
        proc = subprocess.run([python, "-c", code], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return proc.returncode == 0


def setup(args: argparse.Namespace, out: Path, left_s: float, run: RunCommand) -> Outcome:
    """The step: the imports work, after an install when they did not (the module docstring);
    ``run``: gpu_all's ``run_command``, the install's process group stopped at its limit."""
    start = time.perf_counter()
    log = out / "setup.log"
    ok, said = can_import(args.python, args.smoke, IMPORT_CHECK_S)
    log.write_text(f"import check: {'ok' if ok else 'failed'}\n{said}\n")
    why = None if ok else no_install(args, said)
    if ok or why:
        status = "ok" if ok else f"failed ({why})"
        return Outcome("setup", SETUP_WHAT, status, 0 if ok else 1, time.perf_counter() - start,
                       SETUP_S, log.name, SETUP_ESTIMATE_S)  # fmt: skip
    argv = install_argv(args.python, args.wheels)
    limit = max(5.0, min(SETUP_S - (time.perf_counter() - start), left_s))
    code, status, _ = run(argv, out / "install.log", limit)
    ok, said = can_import(args.python, args.smoke, IMPORT_CHECK_S)
    with log.open("a") as sink:
        sink.write(f"install ({' '.join(argv)}): {status}, see install.log\n")
        sink.write(f"import check after install: {'ok' if ok else 'failed'}\n{said}\n")
    status = "ok" if ok else f"failed (install {status}; imports still fail: see setup.log)"
    wall_s = time.perf_counter() - start
    return Outcome("setup", SETUP_WHAT, status, code, wall_s, SETUP_S, log.name, SETUP_ESTIMATE_S)
