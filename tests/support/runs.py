"""In-process runs: the typed config ``mptrain <overrides>`` would run, composed from the shipped
YAML through Hydra's compose API (:func:`compose_run`, :func:`tiny_run`), a run trained to its
report (:func:`train`), the command line through ``mptrain.cli.app.main`` (:func:`run_cli`), tiny
models and the TF32 flags' restorer."""

from __future__ import annotations

import contextlib
import io
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from hydra import compose, initialize_config_module

from mptrain.cli.registry import register_configs, to_run_config
from mptrain.config.run import RunConfig

# Hydra's ConfigStore needs mptrain's schemas and recipes before any test composes: importing
# mptrain registers nothing by itself.
register_configs()


def compose_run(*overrides: str) -> RunConfig:
    """The typed config `mptrain <overrides>` would run, composed from the shipped YAML."""
    with initialize_config_module(config_module="mptrain.conf", version_base="1.3"):
        return to_run_config(compose(config_name="config", overrides=list(overrides)))


def tiny_run(*overrides: str) -> RunConfig:
    """A CPU run of a few steps on digits with a Linear-only model (fast in every precision)."""
    # threads=1: runs compared bit for bit must not measure thread counts (threads=auto changes
    # the count during warm-up, and the count changes the order of floating-point sums), and
    # precision.measure=false: nor time precision=auto's candidates (the faster can differ between
    # two runs of 200 steps or more on a shared machine)
    base = (
        "model=mlp",
        "device=cpu",
        "progress=false",
        "throughput_warmup_steps=2",
        "threads=1",
        "precision.measure=false",
    )
    return compose_run(*base, *overrides)


# A 30-step FP16 run with something to tell at every kind of line: metrics rows every 10 steps,
# evaluations every 15, one step skipped on purpose (an inf gradient at step 12).
FP16_STORY = (
    "model=mlp",
    "device=cpu",
    "precision=fp16",
    "max_steps=30",
    "log_every=10",
    "eval_every=15",
    "debug.inject_inf_grad_steps=[12]",
)


class NoFigure:
    """Stands in for mptrain.output.plots.FigureWorker where a test reads no figure: no child process
    is started and no curves.png drawn (matplotlib is most of a tiny run's time)."""

    def __enter__(self) -> NoFigure:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def plot_run(self, rows: list, title: str, path: Path) -> Path:
        return path


@contextlib.contextmanager
def restored_tf32():
    """Put torch's process-wide TF32 flags (legacy and ``fp32_precision`` APIs) back as they were
    on entry, and check that they read so: a run with ``precision.allow_tf32=true`` sets them for
    the whole process."""
    cuda, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    legacy = (cuda.allow_tf32, cudnn.allow_tf32)
    modern = hasattr(cuda, "fp32_precision")
    saved = (
        (cuda.fp32_precision, cudnn.conv.fp32_precision, cudnn.rnn.fp32_precision) if modern else ()
    )

    def now() -> tuple:
        return ((cuda.allow_tf32, cudnn.allow_tf32), (cuda.fp32_precision, cudnn.conv.fp32_precision,
                cudnn.rnn.fp32_precision) if modern else ())  # fmt: skip

    try:
        yield
    finally:
        # The legacy setters first (after the new API alone the legacy getters raise), as
        # mptrain.precision.policy.apply_tf32 does.
        cuda.allow_tf32, cudnn.allow_tf32 = legacy
        if modern:
            cuda.fp32_precision, cudnn.conv.fp32_precision, cudnn.rnn.fp32_precision = saved
    assert now() == (legacy, saved), f"TF32 flags not restored: {now()} != {(legacy, saved)}"


def train(cfg: RunConfig, output_dir: Path) -> dict:
    """:func:`mptrain.train.job.train`, returning report.json's content (what these tests read)."""
    from mptrain.train.job import train as run_train

    return run_train(cfg, output_dir).to_dict()


# A GPT small enough for a few seconds per run on 2 cores (every Linear stays FP8-aligned).
LM = (
    "task=lm",
    "device=cpu",
    "progress=false",
    "model.layers=1",
    "model.heads=2",
    "model.width=32",
    "model.block_size=32",
    "dataset.max_bytes=60000",
    "dataset.val_windows=16",
    "batch_size=8",
    "eval_batch_size=32",
    "log_every=5",
    "throughput_warmup_steps=2",
    "threads=1",  # as tiny_run: bit-for-bit comparisons
    "precision.measure=false",
)


# ------------------------------------------------------------------- the CLI, in-process
REGISTERED: list[bool] = []  # non-empty once main() ran to its end (its configs registered)


@dataclass
class Outcome:
    code: int | str | None
    stderr: str
    launched: bool


def run_cli(args: list[str], cwd: Path, monkeypatch, jobs: bool = False) -> Outcome:
    """``mptrain <args>`` through ``mptrain.cli.app.main`` in ``cwd``: up to the launch of its jobs,
    or with ``jobs`` the whole command."""
    from hydra.core.global_hydra import GlobalHydra

    from mptrain.cli import app as cli

    assert hasattr(cli, "run_and_report"), (
        "mptrain.cli.app.main no longer starts its jobs with run_and_report(); point this test at "
        "the step that does, so that the checks before it still run in-process"
    )
    launched = []
    if not jobs:
        monkeypatch.setattr(cli, "run_and_report", launched.append)
    if REGISTERED:  # Hydra's ConfigStore is the process's: main() registering again costs ~40 %
        monkeypatch.setattr(cli, "register_configs", lambda: None, raising=False)
    monkeypatch.chdir(cwd)
    monkeypatch.setattr(sys, "path", list(sys.path))  # a run appends its launch directory
    monkeypatch.setattr(sys, "argv", ["mptrain"])  # main() sets it for Hydra's app
    monkeypatch.setattr(sys, "stdout", io.StringIO())  # main() wraps it
    # main() installs its own handlers (mptrain.platform.signals.terminate_like_interrupt)
    handlers = {
        sig: signal.getsignal(sig)
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
    }
    stderr, code = io.StringIO(), 0
    try:
        with contextlib.redirect_stderr(stderr):
            cli.main(list(args))
        REGISTERED.append(True)
    except SystemExit as exc:
        code = exc.code
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        GlobalHydra.instance().clear()
        for name, module in list(sys.modules.items()):  # the examples a run imported from cwd
            if str(getattr(module, "__file__", None) or "").startswith(str(cwd)):
                del sys.modules[name]
    return Outcome(code, stderr.getvalue(), bool(launched))


# ------------------------------------------------------------------- a language model
def tiny_lm(vocab: Any) -> torch.nn.Module:
    """What load_model returns for a language model, untrained: random weights, a context of 8."""
    from mptrain.models.gpt import GPT, GPTShape

    torch.manual_seed(0)
    model = GPT(GPTShape(vocab_size=vocab.size, block_size=8, layers=1, heads=2, width=16))
    model.eval()
    model.mptrain_vocabulary, model.mptrain_sequence_length = vocab, 8
    model.mptrain_checkpoint = "tiny.pt"
    return model


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
