"""Runner overhead: mptrain's training step against a bare hand-written PyTorch AMP loop.

    python -m benchmarks.overhead [--steps 60] [--reps 5] [--out benchmarks/results/overhead.json]

For each model (linear, mlp, cnn, vit) x dataset (digits, synthetic 3x16x16) x precision (fp32,
bf16), in one process, median over ``--reps`` repetitions of ``--steps`` optimizer steps (after
warm-up, evaluation excluded). The variants alternate, in reversed order every other repetition,
and each one starts from the same freshly built components (same seed, empty optimizer state):

- ``mptrain``: the real loop (``mptrain.train.loop.train_loop``) with everything a run builds, its
  metrics rows (loss, gradient norm) written to a metrics.jsonl and its periodic probes;
- ``bare``: the dozen canonical lines (autocast forward, scaled backward, step, update, zero_grad)
  on the same model, optimizer, schedule and tensor-indexed batches;
- ``bare+DataLoader``: the same lines fed by a per-sample ``torch.utils.data.DataLoader``;
- ``lightning`` (``Trainer.fit``, ``precision="bf16-mixed"/"32-true"``) and ``accelerate``
  (``prepare`` + ``accelerator.backward``, ``mixed_precision="bf16"/"no"``), when installed
  (``pip install .[bench]``): the same model, optimizer, schedule and tensor-indexed batches.

Prints a table of median step times, the medians of the per-repetition ratios mptrain / bare and
peer / mptrain (with interquartile ranges) and what each loop adds per step over the bare one, in
microseconds (median of the paired differences: the figure to read for the ``linear`` overhead
floor); --out writes JSON with every repetition, hardware and versions.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import importlib.util
import json
import logging
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.mptrain_api import (
    LoopHooks,
    MetricsLog,
    compose,
    hardware_info,
    prepare_run,
    software_versions,
    train_loop,
)

CPU = torch.device("cpu")


def time_mptrain(run, steps: int, warmup: int) -> float:
    """Seconds per optimizer step of mptrain's loop (its own stopwatch: eval excluded).

    With what every run has: loss/grad-norm rows every ``log_every`` steps written to a
    metrics.jsonl, probes every ``probe_every`` steps, the stop check. Not included: periodic
    checkpoints (disk I/O at epoch ends, off in the peers' runs too) and the terminal display.
    """
    with tempfile.TemporaryDirectory() as tmp:
        metrics = MetricsLog(Path(tmp) / "metrics.jsonl")
        try:
            train_loop(run, LoopHooks(observers=(metrics,)))
        finally:
            metrics.close()
    throughput = run.monitor.throughput
    return throughput.measured_time_s / throughput.measured_steps


def endless(new_epoch: Callable[[], Iterator]) -> Iterator:
    """Batches without end: ``new_epoch()`` again whenever an epoch runs out (epochs not empty)."""
    while True:
        yield from new_epoch()


def bare_loop(
    model, optimizer, scheduler, batches: Callable, dtype, steps: int, warmup: int
) -> float:
    """The canonical AMP loop. Returns seconds per step after warm-up."""
    scaler = torch.amp.GradScaler("cpu", enabled=dtype == torch.float16)
    feed = endless(batches)
    start = None
    for step in range(warmup + steps):
        if step == warmup:
            start = time.perf_counter()
        x, y = next(feed)
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


class Epochs:
    """mptrain's tensor-indexed batches as an iterable, one epoch per ``iter()``: the peers get the
    feed mptrain and the bare loop train on (Lightning's ``fit`` takes any iterable)."""

    def __init__(self, source) -> None:
        self.source = source
        self.epoch = 0

    def __iter__(self):
        batches = self.source.batches(self.epoch)
        self.epoch += 1
        return batches

    def __len__(self) -> int:
        return len(self.source)


def lightning_loop(parts, precision: str, steps: int, warmup: int) -> float:
    """Lightning's ``Trainer.fit`` on the same model, optimizer, schedule and batches."""
    import lightning as L

    # Lightning's banners and its own deprecation warnings, on every fit: not ours to fix.
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", module=r"lightning\.")

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = parts.model

        def training_step(self, batch, _):
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            schedule = {"scheduler": parts.scheduler, "interval": "step"}
            return {"optimizer": parts.optimizer, "lr_scheduler": schedule}

    class StepTimer(L.Callback):
        """Times the optimizer steps after warm-up, as the other loops are timed."""

        def __init__(self) -> None:
            self.start = self.end = None

        def on_train_batch_start(self, trainer, *_):
            if trainer.global_step == warmup and self.start is None:
                self.start = time.perf_counter()

        def on_train_batch_end(self, trainer, *_):
            if trainer.global_step == warmup + steps:
                self.end = time.perf_counter()

    timer = StepTimer()
    trainer = L.Trainer(
        accelerator="cpu",
        precision="bf16-mixed" if precision == "bf16" else "32-true",
        max_steps=warmup + steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[timer],
    )
    trainer.fit(Module(), Epochs(parts.data.train))
    return (timer.end - timer.start) / steps


def accelerate_loop(parts, precision: str, steps: int, warmup: int) -> float:
    """Accelerate's canonical loop (``prepare``, ``accelerator.backward``) on the same parts."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)  # a process-wide singleton: one precision per instance
    accelerator = Accelerator(cpu=True, mixed_precision="bf16" if precision == "bf16" else "no")
    # prepare() wraps the forward in autocast and returns FP32 outputs under mixed precision.
    model, optimizer, scheduler = accelerator.prepare(parts.model, parts.optimizer, parts.scheduler)
    epochs = Epochs(parts.data.train)
    feed = endless(lambda: iter(epochs))
    start = None
    for step in range(warmup + steps):
        if step == warmup:
            start = time.perf_counter()
        x, y = next(feed)
        loss = F.cross_entropy(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    return (time.perf_counter() - start) / steps


PEERS = {
    name: loop
    for name, loop in (("lightning", lightning_loop), ("accelerate", accelerate_loop))
    if importlib.util.find_spec(name) is not None
}


# "linear" (one Linear layer: a step of well under 1 ms on 2 CPU cores) is the overhead floor:
# with almost no compute to hide behind, what a loop adds per step shows above the noise.
MODELS = {
    "linear": ("model=mlp", "model.hidden_sizes=[]"),
    "mlp": ("model=mlp",),
    "cnn": ("model=cnn",),
    "vit": ("model=vit",),
}
CASES = [
    (model, dataset, precision)
    for model in MODELS
    for dataset in ("digits", "synthetic")
    for precision in ("fp32", "bf16")
]
SYNTHETIC = ("dataset.image_size=16", "dataset.num_train=4096")


def run_case(model: str, dataset: str, precision: str, steps: int, reps: int, warmup: int) -> dict:
    extra = SYNTHETIC if dataset == "synthetic" else ()
    cfg = compose(
        *MODELS[model],
        f"dataset={dataset}",
        f"precision={precision}",
        "device=cpu",
        "progress=false",
        "scheduler=constant",
        *extra,
    )
    # The timed length: warm-up + steps, evaluation only at the end (outside the stopwatch).
    cfg = dataclasses.replace(
        cfg,
        max_steps=warmup + steps,
        epochs=None,
        throughput_warmup_steps=warmup,
        eval_every=10**9,
    )

    def fresh():
        """Everything a run builds, from the same seed: every variant of every repetition starts
        from the same weights and an empty optimizer state. (Carrying AdamW state across
        repetitions lets first moments of always-zero gradients decay into subnormal floats, which
        slows this CPU's fused AdamW by ~15 % and would bias whichever variant inherits them.)"""
        return prepare_run(cfg)

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
            parts.precision.policy.autocast_dtype,
            steps,
            warmup,
        )

    variants = {
        "mptrain": lambda: time_mptrain(fresh(), steps, warmup),
        "bare": lambda: run_bare("bare"),
        "bare+DataLoader": lambda: run_bare("bare+DataLoader"),
    }
    for name, loop in PEERS.items():
        variants[name] = lambda loop=loop: loop(fresh(), precision, steps, warmup)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for rep in range(reps):
        # Alternate, reversing the order every other repetition, so drift on a shared machine
        # hits every variant alike.
        order = list(variants) if rep % 2 == 0 else list(reversed(variants))
        for name in order:
            times[name].append(variants[name]())
    return {
        "model": model,
        "dataset": dataset,
        "precision": precision,
        "step_s": {name: statistics.median(t) for name, t in times.items()},
        # Per repetition, each variant against the bare loop timed next to it: the pairs cancel
        # the slow drifts of a shared machine, so their median is the figure to read.
        "ratio_to_bare": {
            name: paired_ratio(times[name], times["bare"]) for name in times if name != "bare"
        },
        "ratio_to_mptrain": {name: paired_ratio(times[name], times["mptrain"]) for name in PEERS},
        # What each loop adds per step, in seconds: readable where the step is tiny.
        "added_s_per_step": {
            name: statistics.median(v - b for v, b in zip(times[name], times["bare"], strict=True))
            for name in times
            if name != "bare"
        },
        "reps_step_s": times,
    }


def paired_ratio(variant: list[float], bare: list[float]) -> dict[str, float]:
    """Median and quartiles of the per-repetition ratios variant / bare."""
    ratios = [v / b for v, b in zip(variant, bare, strict=True)]
    q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
    return {"median": statistics.median(ratios), "q1": q1, "q3": q3}


def fmt_ratio(q: dict[str, float]) -> str:
    return f"{q['median']:.3f} ({q['q1']:.2f}-{q['q3']:.2f})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--models", default=",".join(MODELS), help="of " + ",".join(MODELS))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    models = set(args.models.split(","))
    if models - set(MODELS):
        parser.error(
            f"--models: unknown {sorted(models - set(MODELS))}; choose from {list(MODELS)}"
        )
    rows = [
        run_case(m, d, p, args.steps, args.reps, args.warmup) for m, d, p in CASES if m in models
    ]
    print(
        f"{'case':<22}{'mptrain ms':>11}{'bare ms':>9}{'mptrain/bare (IQR)':>21}{'+us/step':>10}"
        f"{'DataLoader/mptrain':>20}  peers / mptrain (IQR), +us/step over bare"
    )
    for r in rows:
        t, added = r["step_s"], r["added_s_per_step"]
        peers = "  ".join(
            f"{name} {fmt_ratio(q)} {1e6 * added[name]:+.0f}"
            for name, q in r["ratio_to_mptrain"].items()
        )
        print(
            f"{r['model'] + ' ' + r['dataset'] + ' ' + r['precision']:<22}"
            f"{1000 * t['mptrain']:>11.2f}{1000 * t['bare']:>9.2f}"
            f"{fmt_ratio(r['ratio_to_bare']['mptrain']):>21}{1e6 * added['mptrain']:>+10.0f}"
            f"{t['bare+DataLoader'] / t['mptrain']:>20.2f}  {peers}"
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
