"""The run's summary (terminal and report.md): only the rows a run has something to say in, counts
with the right plural, and the distributed setup."""

from __future__ import annotations

import dataclasses

import pytest
from support.runs import NoFigure, tiny_run

from mptrain.platform import hardware
from mptrain.report.render import render_markdown, summary_rows
from mptrain.train import job as run_module
from mptrain.train.job import RunFailed, train


@pytest.fixture(scope="module")
def one_epoch(tmp_path_factory):
    """The report of one epoch of digits (22 steps) in FP16: loss scaling, evaluations."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(run_module, "FigureWorker", NoFigure)
        cfg = tiny_run(
            "precision=fp16", "epochs=1", "model.hidden_sizes=[32]", "checkpoint.enabled=false"
        )
        return train(cfg, tmp_path_factory.mktemp("one_epoch"))


def rows(report) -> dict[str, str]:
    return dict(summary_rows(report))


def test_a_run_failed_before_training_shows_what_it_was_and_no_n_a(tmp_path, monkeypatch):
    def crashing_build(*args, **kwargs):
        raise RuntimeError("out of memory while building")

    monkeypatch.setattr(run_module, "build_run", crashing_build)
    monkeypatch.setattr(run_module, "FigureWorker", NoFigure)
    # No "BF16 emulated" note row on a CPU without native BF16: the rows asked for below.
    monkeypatch.setattr(hardware, "cpu_has_native_bf16", lambda: True)
    with pytest.raises(RunFailed) as failed:
        train(tiny_run("precision=bf16"), tmp_path)

    shown = rows(failed.value.report)
    assert list(shown) == [
        "status", "precision", "precision choice", "device", "model / data", "steps", "wall time",
    ]  # fmt: skip
    assert shown["steps"] == "0 (0 epochs)"
    for key, value in shown.items():
        assert "n/a" not in value and "None" not in value, (key, value)


def test_counts_of_one_are_singular(one_epoch):
    shown = rows(one_epoch)
    assert shown["steps"] == "22 of 22 (1 epoch)"
    once = dataclasses.replace(
        one_epoch,
        throughput=dataclasses.replace(one_epoch.throughput, measured_steps=1),
        training=dataclasses.replace(
            one_epoch.training,
            loss_scale={**one_epoch.training.loss_scale, "backoffs": 1, "growths": 1},
        ),
    )
    shown = rows(once)
    assert "(1 step after 2 warm-up, eval excluded)" in shown["throughput"]
    assert "1 backoff, 1 growth" in shown["loss scale"]


def test_a_completed_run_keeps_every_row(one_epoch):
    shown = rows(one_epoch)
    for key in ("skipped steps", "loss scale", "final val accuracy", "best val accuracy",
                "final train loss", "throughput", "data wait", "peak memory"):  # fmt: skip
        assert key in shown, key


def test_report_md_names_the_distributed_setup(one_epoch):
    assert "- distributed: no (1 process)\n" in render_markdown(one_epoch)
    assert "distributed" not in rows(one_epoch)
    fsdp = {"world_size": 4, "rank": 0, "backend": "nccl", "strategy": "fsdp",
            "reduce_dtype": "float32"}  # fmt: skip
    four = dataclasses.replace(one_epoch, distributed=fsdp)
    words = "4 processes, backend nccl, strategy fsdp, gradients reduced in float32"
    assert f"- distributed: {words}\n" in render_markdown(four)
    assert rows(four)["distributed"] == words


def test_the_unigram_baseline_line_gives_the_final_loss_and_the_gap_apart():
    """'final val loss 2.019 NOT below it' read as a final loss of 2.019; it was the gap (the
    final loss was 5.441)."""
    from types import SimpleNamespace

    from mptrain.report.render import _baseline_text

    above = SimpleNamespace(baseline_val_loss=3.422, final_val_loss=5.441)
    assert _baseline_text(above) == ("3.422 nats/token; final val loss 5.441, 2.019 above it (59%)")
    below = SimpleNamespace(baseline_val_loss=3.422, final_val_loss=2.0)
    assert _baseline_text(below).endswith("final val loss 2.000, 1.422 below it (42%)")
