"""Experiment trackers (logger=[tensorboard,mlflow]), read back with TensorBoard's and MLflow's own
readers: what a run sends, a resumed run's curves, a tracker failing mid-run, and bad input."""

from __future__ import annotations

import http.server
import importlib.util
import json
import socket
import sys
import threading
import time

import pytest
import torch
from support.processes import describe, run_mptrain
from support.runs import FP16_STORY, NoFigure, compose_run, run_cli, tiny_run, train

from mptrain.checkpoint.checkpointer import run_signature
from mptrain.config.base import ConfigError
from mptrain.config.keys import is_non_training_key
from mptrain.precision.plugin import Precision
from mptrain.precision.policy import resolve_precision

pytest.importorskip("tensorboard")
pytest.importorskip("mlflow")

from mlflow.tracking import MlflowClient
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import api_pb2, metadata, plugin_data_pb2

from mptrain.output import trackers as trackers_module
from mptrain.output.trackers import TensorBoardTracker, Trackers, probe_tracking_server

TRAIN_TAGS = (
    "train/loss",
    "train/lr",
    "train/loss_scale",
    "train/grad_norm",
    "train/skipped_steps",
    "train/samples_per_s",
)


@pytest.fixture(autouse=True)
def _file_store(monkeypatch):
    # MLflow 3 opens a file store only when allowed (mptrain allows it for its own runs).
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


def scalars(log_dir) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def hparams_of(log_dir) -> dict[str, object]:
    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    content = acc.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    data = plugin_data_pb2.HParamsPluginData.FromString(content)
    return {
        k: v.WhichOneof("kind") and getattr(v, v.WhichOneof("kind"))
        for k, v in data.session_start_info.hparams.items()
    }


def hparams_session(log_dir) -> tuple[dict[str, object], list[plugin_data_pb2.SessionEndInfo]]:
    """The hparams TensorBoard reads from ``log_dir``: the session's values and its session ends."""
    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    content = acc.PluginTagToContent("hparams")
    ends = [metadata.parse_session_end_info_plugin_data(content[metadata.SESSION_END_INFO_TAG])]
    return hparams_of(log_dir), ends if metadata.SESSION_END_INFO_TAG in content else []


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    """`mptrain logger=[tensorboard,mlflow]` with every tracker default, in a fresh directory."""
    cwd = tmp_path_factory.mktemp("trackers")
    result = run_mptrain(
        cwd,
        *FP16_STORY,
        "logger=[tensorboard,mlflow]",
        "hydra.run.dir=run",
    )
    assert result.returncode == 0, describe(result)
    return cwd


@pytest.mark.slow
def test_tensorboard_gets_every_scalar_at_global_steps_and_the_config(cli_run):
    found = scalars(cli_run / "run" / "tensorboard")
    for tag in TRAIN_TAGS:
        assert [step for step, _ in found[tag]] == [10, 20, 30], tag
    assert [step for step, _ in found["eval/val_accuracy"]] == [15, 30]
    assert [value for _, value in found["train/loss_scale"]] == [65536, 32768, 32768]
    assert [value for _, value in found["train/skipped_steps"]] == [0, 1, 1]
    metrics = [json.loads(line) for line in (cli_run / "run" / "metrics.jsonl").open()]
    final_eval = [row for row in metrics if row["kind"] == "eval"][-1]
    assert found["eval/val_accuracy"][-1][1] == pytest.approx(final_eval["val_accuracy"])
    hp = hparams_of(cli_run / "run" / "tensorboard")
    assert (
        hp["optimizer.name"] == "adamw" and hp["max_steps"] == 30 and hp["precision.name"] == "fp16"
    )


@pytest.mark.slow
def test_mlflow_gets_params_metrics_artifacts_and_status_in_mlruns(cli_run):
    client = MlflowClient((cli_run / "mlruns").as_uri())  # the default store: ./mlruns
    experiment = client.get_experiment_by_name("mptrain")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    assert run.data.tags["mptrain.run_dir"] == str((cli_run / "run").resolve())
    params = run.data.params
    assert params["precision.name"] == "fp16" and params["max_steps"] == "30"
    assert (
        params["precision.resolved"] == "fp16" and params["logger"] == '["tensorboard", "mlflow"]'
    )
    assert "debug.inject_inf_grad_steps" not in params  # a test's injection, not a setting
    for tag in TRAIN_TAGS:
        assert [m.step for m in client.get_metric_history(run.info.run_id, tag)] == [10, 20, 30]
    history = client.get_metric_history(run.info.run_id, "eval/val_accuracy")
    report = json.loads((cli_run / "run" / "report.json").read_text())
    assert [m.step for m in history] == [15, 30]
    assert history[-1].value == pytest.approx(report["evaluation"]["final_val_accuracy"])
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"report.json", "report.md", "curves.png"} <= artifacts
    saved = json.loads((cli_run / "run" / "mlflow_run.json").read_text())
    assert saved["run_id"] == run.info.run_id


@pytest.mark.slow
def test_a_resumed_run_continues_the_same_curves(tmp_path):
    store = (tmp_path / "mlruns").as_uri()
    run_dir = tmp_path / "run"
    common = (
        "max_steps=30",
        "log_every=5",
        "logger=[tensorboard,mlflow]",
        "checkpoint.every_epoch=true",
        "checkpoint.keep_last=5",
    )
    train(tiny_run(*common, f"mlflow.tracking_uri={store}"), run_dir)
    # Back to the end of the first epoch (step 22): steps 25 and 30 are logged again. Tracker
    # settings may change at resume: they are not training settings.
    resume = run_dir / "checkpoints" / "step_00000022.pt"
    again = tiny_run(
        *common, f"mlflow.tracking_uri={store}", "mlflow.run_name=x", f"resume={resume}"
    )
    report = train(again, run_dir)
    assert report["resumed"]["step"] == 22

    found = scalars(run_dir / "tensorboard")
    assert [step for step, _ in found["train/loss"]] == [5, 10, 15, 20, 25, 30]
    assert [step for step, _ in found["eval/val_accuracy"]] == [22, 30]

    client = MlflowClient(store)
    (run,) = client.search_runs([client.get_experiment_by_name("mptrain").experiment_id])
    assert run.info.status == "FINISHED"  # one MLflow run: reopened, finished again
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")]
    assert sorted(steps) == [5, 10, 15, 20, 25, 25, 30, 30]  # MLflow keeps both attempts


def test_a_tracker_failing_mid_run_is_dropped_with_one_warning(tmp_path, monkeypatch, capsys):
    calls = []

    def failing_log_batch(self, run_id, metrics=(), params=(), tags=()):
        if metrics:
            calls.append(run_id)
            if len(calls) >= 2:  # the second metrics call: the store went away
                raise OSError("tracking store unavailable")
        return original(self, run_id, metrics=metrics, params=params, tags=tags)

    original = MlflowClient.log_batch
    monkeypatch.setattr(MlflowClient, "log_batch", failing_log_batch)
    cfg = tiny_run(
        "max_steps=20",
        "log_every=5",
        "logger=[mlflow,tensorboard]",
        f"mlflow.tracking_uri={(tmp_path / 'mlruns').as_uri()}",
    )
    report = train(cfg, tmp_path / "run")
    assert report["status"] == "completed" and report["training"]["steps"] == 20
    out = capsys.readouterr().out
    assert out.count("mlflow failed (OSError: tracking store unavailable)") == 1, out
    assert len(calls) == 2  # no call after the failure
    found = scalars(tmp_path / "run" / "tensorboard")  # the other tracker carries on
    assert [step for step, _ in found["train/loss"]] == [5, 10, 15, 20]


def test_unknown_logger_is_one_line_exit_2(tmp_path):
    result = run_mptrain(tmp_path, "logger=[wandb]")
    assert result.returncode == 2, describe(result)
    (line,) = result.stderr.strip().splitlines()
    assert "logger=['wandb']" in line and "tensorboard, mlflow" in line


def test_a_missing_package_names_the_extra_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)  # as if it were not installed
    with pytest.raises(ConfigError, match=r'logger=.*pip install "mptrain\[mlflow\]"') as info:
        compose_run("logger=[tensorboard,mlflow]")
    assert "\n" not in str(info.value)


OTHER_COMMANDS = ("bench", "advise", "eval", "sample", "debug")


@pytest.mark.parametrize("kept", [trackers_module.MLFLOW_TYPES, trackers_module.TENSORBOARD_TYPES])
def test_params_name_the_precision_that_ran_and_no_other_commands_settings(kept):
    recorded = trackers_module.run_params(tiny_run("precision=auto"), "bf16", kept)
    assert recorded["precision.name"] == "auto" and recorded["precision.resolved"] == "bf16"
    assert "seed" in recorded and "optimizer.lr" in recorded
    assert [k for k in recorded if k.split(".")[0] in OTHER_COMMANDS] == []


@pytest.mark.slow
def test_a_run_records_what_auto_chose_in_both_trackers(tmp_path, monkeypatch):
    """Read back with MLflow's and TensorBoard's own readers."""
    from mptrain.train import job as run_module

    monkeypatch.setattr(run_module, "FigureWorker", NoFigure)
    mlruns = (tmp_path / "mlruns").as_uri()
    cfg = tiny_run("max_steps=2", "logger=[tensorboard,mlflow]", f"mlflow.tracking_uri={mlruns}",
                   "checkpoint.enabled=false")  # fmt: skip
    ran = train(cfg, tmp_path / "run")["precision"]["effective"]

    client = MlflowClient(mlruns)
    (run,) = client.search_runs([client.get_experiment_by_name("mptrain").experiment_id])
    recorded = {
        "mlflow": run.data.params,
        "tensorboard": hparams_of(tmp_path / "run" / "tensorboard"),
    }
    for tracker, params in recorded.items():
        assert params["precision.name"] == "auto" and params["precision.resolved"] == ran, tracker
        assert [k for k in params if k.split(".")[0] in OTHER_COMMANDS] == [], tracker


def test_what_trackers_leave_out_is_never_a_training_setting():
    assert all(is_non_training_key(section) for section in trackers_module.NOT_PARAMS)


def test_tracker_settings_are_not_training_settings():
    plain = compose_run("precision=fp32")
    tracked = compose_run(
        "precision=fp32",
        "logger=[tensorboard]",
        "tensorboard.log_dir=/tmp/tb",
        "mlflow.experiment_name=other",
        "mlflow.tracking_uri=sqlite:///x.db",
        "mlflow.run_name=r",
        "eval.checkpoint=best",
    )
    policy = resolve_precision(plain.precision, torch.device("cpu"), plain.fp8)
    assert run_signature(plain, Precision(policy)) == run_signature(tracked, Precision(policy))


@pytest.mark.slow
def test_a_fresh_run_keeps_the_other_runs_curves_in_a_shared_log_dir(tmp_path):
    shared = tmp_path / "tb"
    for name in ("first", "second"):
        cfg = tiny_run("epochs=null", "max_steps=4", "log_every=2", "logger=[tensorboard]")
        cfg.tensorboard.log_dir = str(shared)
        train(cfg, tmp_path / name)
    assert [step for step, _ in scalars(shared)["train/loss"]] == [2, 4, 2, 4]


@pytest.mark.slow
def test_a_tracker_that_cannot_start_stops_the_run_before_training(tmp_path):
    blocked = tmp_path / "a_file"
    blocked.write_text("not a directory")
    result = run_mptrain(
        tmp_path,
        "model=mlp",
        "max_steps=2",
        "logger=[mlflow]",
        f"mlflow.tracking_uri={blocked}/mlruns",
    )
    assert result.returncode == 2, describe(result)
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"mptrain: error: mlflow.tracking_uri={(blocked / 'mlruns').as_uri()}: ")
    assert not list(tmp_path.glob("outputs/*/*/report.json"))  # nothing trained


# ------------------------------------------------ TensorBoard without TensorFlow (issue 27, item 14)
def test_tensorboard_ends_the_hparams_session_without_tensorflow(tmp_path, capsys):
    # Exactly what `pip install "mptrain[tensorboard]"` installs: tensorboard, no TensorFlow.
    assert importlib.util.find_spec("tensorflow") is None
    cfg = tiny_run("epochs=null", "max_steps=4", "log_every=2", "logger=[tensorboard]")
    report = train(cfg, tmp_path)
    assert report["status"] == "completed"
    assert "tensorboard failed" not in capsys.readouterr().out
    values, ends = hparams_session(tmp_path / "tensorboard")
    assert values["max_steps"] == 4 and values["precision.name"] == cfg.precision.name
    (end,) = ends
    assert end.status == api_pb2.STATUS_SUCCESS and end.end_time_secs > 0
    assert [step for step, _ in scalars(tmp_path / "tensorboard")["train/loss"]] == [2, 4]


@pytest.mark.parametrize(
    ("status", "expected"),
    [("interrupted", api_pb2.STATUS_UNKNOWN), ("diverged", api_pb2.STATUS_FAILURE)],
)
def test_the_hparams_session_end_carries_the_run_status(tmp_path, status, expected):
    tracker = TensorBoardTracker(tmp_path, {"lr": 0.1}, start_step=0, own_dir=True)
    tracker.finish(status, [])
    values, (end,) = hparams_session(tmp_path)
    assert values == {"lr": 0.1} and end.status == expected


def test_the_writer_is_closed_when_the_session_end_cannot_be_written(tmp_path, monkeypatch):
    def broken(status):
        raise OSError("no session end today")

    monkeypatch.setattr(trackers_module, "session_end_summary", broken)
    warnings: list[str] = []
    together = Trackers([TensorBoardTracker(tmp_path, {"lr": 0.1}, 0, True)], warnings.append)
    together.on_log({"kind": "train", "step": 3, "loss": 1.5})
    together.finish("completed", [])
    (warning,) = warnings
    assert warning.startswith("tensorboard failed (OSError: no session end today)")
    # The scalar is on disk only because the writer was closed (flushed) all the same.
    assert scalars(tmp_path)["train/loss"] == [(3, 1.5)]


# ---------------------------------------------- an unreachable MLflow server (issue 27, "Also")
@pytest.fixture
def closed_port() -> int:
    """A local TCP port nothing listens on (bound once by the OS, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def no_mlflow_retries(monkeypatch):
    # Were the probe missing, MLflow's client would retry the closed port for minutes.
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")


def test_an_unreachable_mlflow_server_stops_the_command_before_the_run(
    tmp_path, monkeypatch, closed_port, no_mlflow_retries
):
    uri = f"http://127.0.0.1:{closed_port}"
    args = ["model=mlp", "logger=[mlflow]", f"mlflow.tracking_uri={uri}", "hydra.run.dir=run"]
    started = time.monotonic()
    outcome = run_cli(args, tmp_path, monkeypatch)
    assert outcome.code == 2 and not outcome.launched, outcome
    (line,) = outcome.stderr.strip().splitlines()
    assert line.startswith(
        f"mptrain: error: mlflow.tracking_uri={uri}: the MLflow server is unreachable"
    )
    assert "ConnectionRefusedError" in line
    assert not (tmp_path / "run").exists()  # nothing taken: no directory, no lock
    assert time.monotonic() - started < 5


def test_a_run_started_from_python_refuses_an_unreachable_mlflow_server(
    tmp_path, closed_port, no_mlflow_retries
):
    cfg = tiny_run("logger=[mlflow]", f"mlflow.tracking_uri=http://127.0.0.1:{closed_port}")
    with pytest.raises(
        ConfigError, match=r"^mlflow.tracking_uri=\S+: the MLflow server is unreachable"
    ):
        train(cfg, tmp_path / "run")


def test_the_probe_gives_up_after_its_timeout():
    # A server that takes the connection and never answers (the kernel accepts it from the backlog).
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            probe_tracking_server(f"http://127.0.0.1:{silent.getsockname()[1]}", timeout_s=0.3)
        assert time.monotonic() - started < 2


class _Answers(http.server.BaseHTTPRequestHandler):
    """/health: 200; /down/health: 502, as a proxy in front of a stopped server; else 404."""

    def do_GET(self):  # http.server calls it by this name
        status = {"/health": 200, "/down/health": 502}.get(self.path, 404)
        self.send_response(status)
        self.end_headers()
        self.wfile.write(b"OK")

    def log_message(self, *args):
        pass


@pytest.fixture
def answering_port():
    """The port of a local HTTP server answering as :class:`_Answers` says."""
    server = http.server.HTTPServer(("127.0.0.1", 0), _Answers)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield server.server_port
    server.shutdown()
    server.server_close()


def test_a_server_that_answers_passes_the_probe(answering_port):
    probe_tracking_server(f"http://user:pw@127.0.0.1:{answering_port}", 2.0)  # 200 at /health
    probe_tracking_server(f"http://127.0.0.1:{answering_port}/under/a/path", 2.0)  # 404 answers
    probe_tracking_server("sqlite:///never/opened.db", 2.0)  # no server: not probed


def test_a_server_error_fails_the_probe(answering_port):
    with pytest.raises(OSError, match="the server answered 502"):
        probe_tracking_server(f"http://127.0.0.1:{answering_port}/down", 2.0)
