"""Runner overhead: mptrain's training step against a bare hand-written PyTorch AMP loop.

    python benchmarks/overhead.py [--steps 60] [--reps 5] [--out benchmarks/results/overhead.json]

For each model (mlp, cnn, vit) x dataset (digits, synthetic 3x16x16) x precision (fp32, bf16), in
one process, median over ``--reps`` repetitions of ``--steps`` optimizer steps (after warm-up,
evaluation excluded). The variants alternate, in reversed order every other repetition, and each
one starts from the same freshly built components (same seed, empty optimizer state):

- ``mptrain``: the real loop (``mptrain.loop.train_loop``) with everything a run builds, its
  metrics rows (loss, gradient norm) written to a metrics.jsonl and its periodic probes;
- ``bare``: the dozen canonical lines (autocast forward, scaled backward, step, update, zero_grad)
  on the same model, optimizer, schedule and tensor-indexed batches;
- ``bare+DataLoader``: the same lines fed by a per-sample ``torch.utils.data.DataLoader``;
- Lightning / Accelerate, when installed (``pip install .[bench]``), on the same model and data
  (one run each, after the repetitions).

Prints a table of median step times and the median of the per-repetition ratios mptrain / bare
(with its interquartile range); --out writes JSON with every repetition, hardware and versions.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime as dt
import importlib.util
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from mptrain.cli import CONFIG_MODULE, CONFIG_NAME, HYDRA_VERSION_BASE
from mptrain.config import to_run_config
from mptrain.hardware import hardware_info, software_versions
from mptrain.loop import LoopState
from mptrain.metrics import MetricsLog
from mptrain.precision import resolve_precision
from mptrain.run import build_components, seed_everything, train_components

CPU = torch.device("cpu")


def compose(*overrides: str):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module

    with initialize_config_module(config_module=CONFIG_MODULE, version_base=HYDRA_VERSION_BASE):
        return to_run_config(hydra_compose(config_name=CONFIG_NAME, overrides=list(overrides)))


def time_mptrain(parts, policy, steps: int, warmup: int) -> float:
    """Seconds per optimizer step of mptrain's loop (its own stopwatch: eval excluded).

    With what every run has: loss/grad-norm rows every ``log_every`` steps written to a
    metrics.jsonl, probes every ``probe_every`` steps, the stop check. Not included: periodic
    checkpoints (disk I/O at epoch ends, off in the peers' runs too) and the terminal display.
    """
    settings = dataclasses.replace(
        parts.settings,
        total_steps=warmup + steps,
        throughput_warmup_steps=warmup,
        eval_every=10**9,
    )
    state = LoopState()
    with tempfile.TemporaryDirectory() as tmp:
        metrics = MetricsLog(Path(tmp) / "metrics.jsonl")
        try:
            train_components(parts, policy, CPU, state, settings, observers=(metrics,))
        finally:
            metrics.close()
    return state.measured_time_s / state.measured_steps


def bare_loop(
    model, optimizer, scheduler, batches: Callable, dtype, steps: int, warmup: int
) -> float:
    """The canonical AMP loop. Returns seconds per step after warm-up."""
    scaler = torch.amp.GradScaler("cpu", enabled=dtype == torch.float16)
    it = batches()
    start = None
    for step in range(warmup + steps):
        if step == warmup:
            start = time.perf_counter()
        try:
            x, y = next(it)
        except StopIteration:
            it = batches()
            x, y = next(it)
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    return (time.perf_counter() - start) / steps


def dataloader_batches(data, batch_size: int) -> Callable:
    images = torch.cat([x for x, _ in data.train.batches(0)])
    labels = torch.cat([y for _, y in data.train.batches(0)])
    dataset = torch.utils.data.TensorDataset(images, labels)
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=batch_size, shuffle=True, drop_last=True
    )
    return lambda: iter(loader)


def lightning_step_time(
    model, lr: float, data, batch_size: int, precision: str, steps: int
) -> float | None:
    if importlib.util.find_spec("lightning") is None:
        return None
    import lightning as L

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = model

        def training_step(self, batch, _):
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=lr, fused=True)

    class StepTimer(L.Callback):
        """Times the steps after warm-up, as the other loops are timed (no Trainer set-up)."""

        def __init__(self) -> None:
            self.start = self.end = None

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            if trainer.global_step == 5 and self.start is None:
                self.start = time.perf_counter()

        def on_train_end(self, trainer, module):
            self.end = time.perf_counter()

    timer = StepTimer()

    images = torch.cat([x for x, _ in data.train.batches(0)])
    labels = torch.cat([y for _, y in data.train.batches(0)])
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(images, labels),
        batch_size=batch_size,
        shuffle=True,
        drop_last=True,
    )
    trainer = L.Trainer(
        accelerator="cpu",
        precision="bf16-mixed" if precision == "bf16" else "32-true",
        max_steps=steps + 5,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[timer],
    )
    trainer.fit(Module(), loader)
    return (timer.end - timer.start) / steps


def accelerate_step_time(
    model, lr: float, data, batch_size: int, precision: str, steps: int
) -> float | None:
    if importlib.util.find_spec("accelerate") is None:
        return None
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)  # a process-wide singleton: one precision per instance
    accelerator = Accelerator(cpu=True, mixed_precision="bf16" if precision == "bf16" else "no")
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, fused=True)
    net, optimizer = accelerator.prepare(model, optimizer)
    batches = list(data.train.batches(0))
    start = None
    for step in range(steps + 5):
        if step == 5:
            start = time.perf_counter()
        x, y = batches[step % len(batches)]
        with accelerator.autocast():
            loss = F.cross_entropy(net(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    return (time.perf_counter() - start) / steps


CASES = [
    (model, dataset, precision)
    for model in ("mlp", "cnn", "vit")
    for dataset in ("digits", "synthetic")
    for precision in ("fp32", "bf16")
]
SYNTHETIC = ("dataset.image_size=16", "dataset.num_train=4096")


def run_case(model: str, dataset: str, precision: str, steps: int, reps: int, warmup: int) -> dict:
    extra = SYNTHETIC if dataset == "synthetic" else ()
    cfg = compose(
        f"model={model}",
        f"dataset={dataset}",
        f"precision={precision}",
        "device=cpu",
        "progress=false",
        "scheduler=constant",
        *extra,
    )
    policy = resolve_precision(cfg.precision, CPU)

    def fresh():
        """Everything a run builds, from the same seed: every variant of every repetition starts
        from the same weights and an empty optimizer state. (Carrying AdamW state across
        repetitions lets first moments of always-zero gradients decay into subnormal floats, which
        slows this CPU's fused AdamW by ~15 % and would bias whichever variant inherits them.)"""
        seed_everything(0)
        return build_components(cfg, CPU, policy)

    def run_bare(feed: str) -> float:
        parts = fresh()  # mptrain's own model, optimizer (fused AdamW, no-decay group), schedule
        batches = (
            (lambda: iter(parts.data.train.batches(0)))
            if feed == "bare"
            else dataloader_batches(parts.data, cfg.batch_size)
        )
        return bare_loop(
            parts.model,
            parts.optimizer,
            parts.scheduler,
            batches,
            policy.autocast_dtype,
            steps,
            warmup,
        )

    variants = {
        "mptrain": lambda: time_mptrain(fresh(), policy, steps, warmup),
        "bare": lambda: run_bare("bare"),
        "bare+DataLoader": lambda: run_bare("bare+DataLoader"),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    for rep in range(reps):
        # Alternate, reversing the order every other repetition, so drift on a shared machine
        # hits every variant alike.
        order = list(variants) if rep % 2 == 0 else list(reversed(variants))
        for name in order:
            times[name].append(variants[name]())
    parts = fresh()
    result = {k: statistics.median(v) for k, v in times.items()}
    for name, fn in (("lightning", lightning_step_time), ("accelerate", accelerate_step_time)):
        t = fn(
            copy.deepcopy(parts.model),
            cfg.optimizer.lr,
            parts.data,
            cfg.batch_size,
            precision,
            steps,
        )
        if t is not None:
            result[name] = t
    return {
        "model": model,
        "dataset": dataset,
        "precision": precision,
        "step_s": result,
        # Per repetition, each variant against the bare loop timed next to it: the pairs cancel
        # the slow drifts of a shared machine, so their median is the figure to read.
        "ratio_to_bare": {
            name: paired_ratio(times[name], times["bare"]) for name in times if name != "bare"
        },
        "reps_step_s": times,
    }


def paired_ratio(variant: list[float], bare: list[float]) -> dict[str, float]:
    """Median and quartiles of the per-repetition ratios variant / bare."""
    ratios = [v / b for v, b in zip(variant, bare, strict=True)]
    q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
    return {"median": statistics.median(ratios), "q1": q1, "q3": q3}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--models", default="mlp,cnn,vit")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    models = set(args.models.split(","))
    rows = [
        run_case(m, d, p, args.steps, args.reps, args.warmup) for m, d, p in CASES if m in models
    ]
    print(
        f"{'case':<24}{'mptrain ms':>11}{'bare ms':>9}{'mptrain/bare (IQR)':>22}"
        f"{'DataLoader ms':>15}{'DL/mptrain':>12}  peers / bare"
    )
    for r in rows:
        t, paired = r["step_s"], r["ratio_to_bare"]["mptrain"]
        peers = "  ".join(
            f"{k} {t[k] / t['bare']:.2f}x" for k in ("lightning", "accelerate") if k in t
        )
        iqr = f"{paired['median']:.3f} ({paired['q1']:.2f}-{paired['q3']:.2f})"
        print(
            f"{r['model'] + ' ' + r['dataset'] + ' ' + r['precision']:<24}"
            f"{1000 * t['mptrain']:>11.2f}{1000 * t['bare']:>9.2f}{iqr:>22}"
            f"{1000 * t['bare+DataLoader']:>15.2f}{t['bare+DataLoader'] / t['mptrain']:>12.2f}  {peers}"
        )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            json.dumps(
                {
                    "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
                    "hardware": hardware_info(CPU),
                    "versions": software_versions(),
                    "steps": args.steps,
                    "reps": args.reps,
                    "rows": rows,
                },
                indent=2,
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
