"""End-to-end runs through mptrain.train.job.train: the report, metrics and statuses."""

from __future__ import annotations

import json

import pytest
import torch
from support.runs import compose_run, tiny_run, train

from mptrain.output.metrics import read_metrics
from mptrain.train import job as run_module
from mptrain.train.job import RunFailed

EXPECTED = {
    "fp32": (None, False),
    "fp16": ("float16", True),
    "bf16": ("bfloat16", False),
}


@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
def test_tiny_run_writes_a_complete_report(tmp_path, precision):
    cfg = tiny_run(f"precision={precision}", "max_steps=12", "log_every=4", "eval_every=6")
    report = train(cfg, tmp_path)

    on_disk = json.loads((tmp_path / "report.json").read_text())
    assert on_disk["status"] == report["status"] == "completed"
    p = on_disk["precision"]
    dtype, scaled = EXPECTED[precision]
    assert (p["requested"], p["effective"], p["autocast_dtype"], p["loss_scaling"]) == (
        precision,
        precision,
        dtype,
        scaled,
    )
    assert p["master_weights_dtype"] == "float32"
    assert on_disk["tf32"]["allow_tf32"] is False
    hw = on_disk["hardware"]
    assert hw["device"] == "cpu" and hw["cpu"]["model"] and hw["cpu"]["logical_cores"] >= 1
    assert isinstance(hw["cpu"]["native_bf16"], bool)
    versions = on_disk["versions"]
    assert versions["torch"] == torch.__version__
    for key in ("python", "torchvision", "hydra-core", "omegaconf", "mptrain"):
        assert versions[key], key
    t = on_disk["training"]
    assert t["steps"] == t["total_steps"] == 12
    assert t["skipped_steps"] == {"count": 0, "steps": []}
    if scaled:
        assert t["loss_scale"]["initial"] == 65536.0 and t["loss_scale"]["backoffs"] == 0
    else:
        assert t["loss_scale"] is None
    e = on_disk["evaluation"]
    assert [h["step"] for h in e["history"]] == [6, 12]
    assert e["final_val_accuracy"] == e["history"][-1]["val_accuracy"] > 0.3
    assert e["best_val_accuracy"] >= e["final_val_accuracy"]
    thr = on_disk["throughput"]
    assert thr["samples_per_s"] > 0 and thr["measured_steps"] == 12 - 2
    assert 0 <= thr["data_wait_fraction"] < 1
    assert on_disk["memory"]["peak_bytes"] > 0
    assert on_disk["wall_time_s"] > 0
    assert on_disk["config"]["precision"]["name"] == precision
    assert on_disk["seed"] == 0

    rows = read_metrics(tmp_path / "metrics.jsonl")
    train_rows = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in train_rows] == [4, 8, 12]
    for r in train_rows:
        assert {"loss", "lr", "loss_scale", "grad_norm", "skipped", "samples_per_s"} <= r.keys()
    assert [r["step"] for r in rows if r["kind"] == "eval"] == [6, 12]
    md = (tmp_path / "report.md").read_text()
    assert "completed" in md and precision in md


def test_auto_records_request_and_resolution(tmp_path):
    report = train(tiny_run("precision=auto", "max_steps=3"), tmp_path)
    p = report["precision"]
    assert p["requested"] == "auto" and p["effective"] in ("fp32", "bf16")
    assert p["reason"] != "requested"


def test_skipped_steps_are_counted_in_the_report(tmp_path):
    cfg = tiny_run("precision=fp16", "max_steps=8", "debug.inject_inf_grad_steps=[2,5]")
    report = train(cfg, tmp_path)
    assert report["training"]["skipped_steps"] == {"count": 2, "steps": [2, 5]}
    scale = report["training"]["loss_scale"]
    assert scale["backoffs"] == 2 and scale["final"] == 65536.0 / 4
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert rows[-2]["skipped_total"] == 2


@pytest.mark.slow
def test_default_job_reaches_99_percent(tmp_path):
    """`mptrain` with no overrides: cnn on digits, precision=auto, 15 epochs; the README promises
    >= 99 % validation accuracy."""
    cfg = compose_run("progress=false")
    assert (cfg.model.name, cfg.dataset.name, cfg.precision.name) == ("cnn", "digits", "auto")
    report = train(cfg, tmp_path)
    assert report["evaluation"]["final_val_accuracy"] >= 0.99


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides",
    [
        ("model=vit", "max_steps=4"),
        ("model=cnn", "channels_last=true", "max_steps=4"),
        (
            "model=resnet18",
            "dataset=synthetic",
            "dataset.image_size=16",
            "batch_size=8",
            "max_steps=2",
        ),
        (
            "model=resnet50",
            "dataset=synthetic",
            "dataset.image_size=8",
            "batch_size=4",
            "max_steps=1",
            "eval_batch_size=64",
            "dataset.num_val=16",
        ),
        ("optimizer=sgd", "scheduler=multistep", "scheduler.milestones=[0.1]", "max_steps=6"),
        ("clip_grad_norm=1.0", "label_smoothing=0.1", "grad_accum_steps=2", "max_steps=4"),
    ],
    ids=["vit", "cnn-channels-last", "resnet18", "resnet50", "sgd-multistep", "clip-smooth-accum"],
)
def test_models_and_options_train_in_bf16(tmp_path, overrides):
    cfg = compose_run("device=cpu", "progress=false", "precision=bf16", *overrides)
    report = train(cfg, tmp_path)
    assert report["status"] == "completed"
    assert report["training"]["steps"] == cfg.max_steps
    assert report["model"]["parameters"] > 0


def test_divergence_stops_the_run_with_status_diverged(tmp_path):
    cfg = tiny_run(
        "precision=fp32", "max_steps=60", "optimizer=sgd", "optimizer.lr=1e6", "log_every=2"
    )
    with pytest.raises(RunFailed) as err:
        train(cfg, tmp_path)
    assert err.value.status == "diverged"
    on_disk = json.loads((tmp_path / "report.json").read_text())
    assert on_disk["status"] == "diverged" and "loss became" in on_disk["reason"]
    assert on_disk["training"]["steps"] < 60


def test_crash_mid_run_writes_a_failed_report(tmp_path, monkeypatch):
    def exploding_loop(run, hooks):
        run.state.step = 3
        raise RuntimeError("boom at step 3")

    monkeypatch.setattr(run_module, "train_loop", exploding_loop)
    with pytest.raises(RunFailed) as err:
        train(tiny_run("max_steps=5"), tmp_path)
    assert err.value.status == "failed"
    on_disk = json.loads((tmp_path / "report.json").read_text())
    assert on_disk["status"] == "failed" and "boom at step 3" in on_disk["reason"]
    assert on_disk["training"]["steps"] == 3
    assert not list(tmp_path.glob(".report*.tmp")), "a temporary report file was left behind"


def test_interrupt_writes_an_interrupted_report(tmp_path, monkeypatch):
    def interrupted_loop(run, hooks):
        run.state.step = 2
        raise KeyboardInterrupt

    monkeypatch.setattr(run_module, "train_loop", interrupted_loop)
    with pytest.raises(KeyboardInterrupt):
        train(tiny_run("max_steps=5"), tmp_path)
    on_disk = json.loads((tmp_path / "report.json").read_text())
    assert on_disk["status"] == "interrupted" and on_disk["training"]["steps"] == 2


def test_unwritable_output_directory_fails_before_training(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    from mptrain.config.base import ConfigError

    with pytest.raises(ConfigError, match="output directory"):
        train(tiny_run("max_steps=2"), blocker / "run")


def test_a_build_that_crashes_still_reports_device_precision_and_tf32(tmp_path, monkeypatch):
    def crashing_build(*args, **kwargs):
        raise RuntimeError("out of memory while building")

    monkeypatch.setattr(run_module, "build_run", crashing_build)
    with pytest.raises(RunFailed):
        train(tiny_run("precision=bf16", "max_steps=2"), tmp_path)
    on_disk = json.loads((tmp_path / "report.json").read_text())
    assert on_disk["status"] == "failed" and "out of memory" in on_disk["reason"]
    assert on_disk["precision"]["effective"] == "bf16"
    assert on_disk["tf32"]["allow_tf32"] is False
    assert on_disk["hardware"]["device"] == "cpu"
    assert on_disk["schema_version"] == 1 and "figure" not in on_disk
