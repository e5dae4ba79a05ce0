"""Experiment trackers: TensorBoard and MLflow, chosen with ``logger=[tensorboard,mlflow]``
(docs/trackers.md says what each records and how a resumed run continues it).

Both receive the same figures, when metrics.jsonl does (every ``log_every`` steps and at each
evaluation, global optimizer steps), under the tags of :data:`TRAIN_METRICS` and
:data:`EVAL_METRICS`, and the run's settings (:func:`run_params`).

A tracker that cannot start is bad input (:class:`~mptrain.config.base.ConfigError`, before
training); an http(s) MLflow server that does not answer is found so in seconds by
:func:`check_tracking_server`, which the preflight calls before the run directory is touched.
One that fails later is warned about once and dropped; training, checkpoints and the report carry
on without it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from mptrain.config.base import ConfigError, launch_dir
from mptrain.config.keys import flatten
from mptrain.config.run import RunConfig
from mptrain.config.sections import MLflowConfig
from mptrain.rundir.fileio import atomic_write_text
from mptrain.rundir.layout import MLFLOW_RUN_JSON, TENSORBOARD_DIR

# metrics row key -> tracker tag
TRAIN_METRICS = {
    "loss": "train/loss",
    "lr": "train/lr",
    "loss_scale": "train/loss_scale",
    "grad_norm": "train/grad_norm",
    "skipped_total": "train/skipped_steps",
    "samples_per_s": "train/samples_per_s",
    "tokens_per_s": "train/tokens_per_s",
}
EVAL_METRICS = {
    "val_loss": "eval/val_loss",
    "val_accuracy": "eval/val_accuracy",
    "val_perplexity": "eval/val_perplexity",  # language models
}
# report status -> MLflow run status
MLFLOW_STATUS = {"completed": "FINISHED", "interrupted": "KILLED"}
# How long an http(s) MLflow server may take to answer the probe before a run is refused; MLflow's
# own client retries an unreachable server for about 4 1/2 minutes.
PROBE_TIMEOUT_S = 5.0


class Tracker(Protocol):
    """One experiment tracker: metrics at a global step, then the outcome."""

    name: str

    def log_metrics(self, values: dict[str, float], step: int) -> None: ...

    def finish(self, status: str, artifacts: list[Path]) -> None: ...


def row_metrics(row: dict[str, Any]) -> dict[str, float]:
    """A metrics.jsonl row's figures under the trackers' tags (absent and None values left out)."""
    names = EVAL_METRICS if row["kind"] == "eval" else TRAIN_METRICS
    return {tag: float(row[key]) for key, tag in names.items() if row.get(key) is not None}


# ----------------------------------------------------------------------------- TensorBoard
class TensorBoardTracker:
    """Scalars and hparams into one TensorBoard run directory (docs/trackers.md)."""

    name = "tensorboard"

    def __init__(
        self, log_dir: Path, hparams: dict[str, Any], start_step: int, own_dir: bool
    ) -> None:
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams as hparams_summaries

        # purge_step: TensorBoard's readers discard this directory's earlier events at or past it:
        # an interrupted run's steps after its checkpoint, or, in the run's own directory, a run
        # started over (overwrite=true). A fresh run in a directory the user shares between runs
        # purges nothing (step 1 would wipe the other runs' curves).
        purge = start_step + 1 if start_step > 0 or own_dir else None
        self.writer = SummaryWriter(str(log_dir), purge_step=purge, flush_secs=30)
        metrics = {tag: 0.0 for tag in (*EVAL_METRICS.values(), TRAIN_METRICS["loss"])}
        experiment, session_start, _ = hparams_summaries(hparams, metrics)
        self.writer.file_writer.add_summary(experiment)
        self.writer.file_writer.add_summary(session_start)

    def log_metrics(self, values: dict[str, float], step: int) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, step)

    def finish(self, status: str, artifacts: list[Path]) -> None:
        """Write the hparams session end with ``status``, then close the writer; it is closed
        (its events flushed) even when the session end cannot be written, and that error raised."""
        try:
            self.writer.file_writer.add_summary(session_end_summary(status))
        finally:
            self.writer.close()


def session_end_summary(status: str) -> Any:
    """The hparams plugin's session-end ``Summary`` for a report status (completed: success,
    interrupted: unknown, anything else: failure), stamped now.

    Built from TensorBoard's protobufs directly: ``tensorboard.plugins.hparams.summary``
    (``session_end_pb``) imports TensorFlow, which ``pip install "mptrain[tensorboard]"`` does not
    install; torch's ``hparams()`` builds a session end too, but always with success.
    """
    from tensorboard.compat.proto.summary_pb2 import Summary
    from tensorboard.plugins.hparams import api_pb2, metadata, plugin_data_pb2

    # The hparams Status has no "aborted" (unknown, success, failure, running): an interrupted run
    # neither succeeded nor failed, and may be resumed.
    state = {"completed": api_pb2.STATUS_SUCCESS, "interrupted": api_pb2.STATUS_UNKNOWN}
    info = plugin_data_pb2.SessionEndInfo(
        status=state.get(status, api_pb2.STATUS_FAILURE), end_time_secs=time.time()
    )
    content = plugin_data_pb2.HParamsPluginData(session_end_info=info)
    value = Summary.Value(
        tag=metadata.SESSION_END_INFO_TAG,
        metadata=metadata.create_summary_metadata(content),
        tensor=metadata.NULL_TENSOR,  # as TensorBoard's own session_end_pb writes it
    )
    return Summary(value=[value])


# Config sections that are not this run's settings: other commands' (bench, advise, eval, sample)
# and the debug injections. Every one is a non-training key (mptrain.config.keys), as a test checks.
NOT_PARAMS = ("bench", "advise", "eval", "sample", "debug")
# The types a tracker's params take as they are (the others, None and lists, go as JSON text).
TENSORBOARD_TYPES, MLFLOW_TYPES = (bool, int, float, str), (str,)


def run_params(cfg: RunConfig, resolved_precision: str, kept: tuple[type, ...]) -> dict[str, Any]:
    """What the trackers record as the run's settings: the flattened config without
    :data:`NOT_PARAMS`, and ``precision.resolved``, the precision that ran (``precision.name``
    is what was asked for: ``auto`` says nothing of it); a value of none of the ``kept`` types
    (the types the tracker takes) as JSON text."""
    params = {
        key: value
        for key, value in flatten(dataclasses.asdict(cfg)).items()
        if key.split(".", 1)[0] not in NOT_PARAMS
    }
    params["precision.resolved"] = resolved_precision
    return {
        key: value if isinstance(value, kept) else json.dumps(value)
        for key, value in params.items()
    }


# ---------------------------------------------------------------------------------- MLflow
def mlflow_tracking_uri(setting: str | None) -> str:
    """``mlflow.tracking_uri``, else ``$MLFLOW_TRACKING_URI``, else the file store ``./mlruns``;
    a plain path (relative ones from the launch directory) becomes an absolute ``file:`` URI (the
    run's id file stays valid from anywhere)."""
    uri = setting or os.environ.get("MLFLOW_TRACKING_URI") or "mlruns"
    if ":" in uri or uri == "databricks":  # a URI (file:, sqlite:, http:, databricks://...)
        return uri
    return (launch_dir() / Path(uri).expanduser()).resolve().as_uri()


def probe_tracking_server(uri: str, timeout_s: float) -> None:
    """Raise OSError (the cause) when the MLflow server of an http(s) ``uri`` does not answer a
    ``GET <uri>/health`` within about ``timeout_s`` (per connect and per read; name resolution is the
    system's), or answers with a server error (5xx: what MLflow's client retries for minutes, e.g.
    a proxy's 502 when the server behind it is down). Any other status counts as an answer (a
    proxy's 401, a 404 where the server sits under a path). Other URIs (files, databases,
    databricks) are not probed: they have no server.
    """
    parts = urllib.parse.urlsplit(uri)
    if parts.scheme not in ("http", "https"):
        return
    # Here, not at the top: every command's preflight imports this module (~20 ms for these).
    import http.client
    import ssl
    from urllib.error import HTTPError, URLError
    from urllib.request import urlopen

    try:
        # Under the URI's path, where a server started with --static-prefix has its /health.
        # Rebuilt from host and port: user:password@ in the URI is not sent to /health.
        host = f"[{parts.hostname}]" if ":" in (parts.hostname or "") else parts.hostname
        port = f":{parts.port}" if parts.port else ""
        url = f"{parts.scheme}://{host}{port}{parts.path.rstrip('/')}/health"
        # Reachability only: no credentials go out, so a certificate MLflow is told to trust
        # (MLFLOW_TRACKING_INSECURE_TLS, a private CA) must not make the probe refuse the run.
        context = ssl.create_default_context() if parts.scheme == "https" else None
        if context is not None:
            context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
        with urlopen(url, timeout=timeout_s, context=context):
            pass
    except HTTPError as exc:
        if exc.code >= 500:
            raise OSError(f"the server answered {exc.code} {exc.reason}") from exc
    except URLError as exc:  # no answer: the reason is the cause
        reason = exc.reason
        raise reason if isinstance(reason, OSError) else OSError(str(reason)) from exc
    except (ValueError, http.client.HTTPException) as exc:  # a malformed URI or answer
        raise OSError(f"{type(exc).__name__}: {exc}") from exc


def check_tracking_server(cfg: RunConfig, timeout_s: float | None = None) -> None:
    """Raise ConfigError (one line naming ``mlflow.tracking_uri`` and the cause) when ``cfg.logger``
    names mlflow and its http(s) server does not answer within ``timeout_s`` (default
    :data:`PROBE_TIMEOUT_S`): refused in seconds, before the run takes its directory, rather than
    after MLflow's minutes of retries with the run lock held. Other URIs pass unchecked."""
    if "mlflow" not in cfg.logger:
        return
    timeout_s = PROBE_TIMEOUT_S if timeout_s is None else timeout_s
    uri = mlflow_tracking_uri(cfg.mlflow.tracking_uri)
    try:
        probe_tracking_server(uri, timeout_s)
    except OSError as exc:
        source = "" if cfg.mlflow.tracking_uri else " (from $MLFLOW_TRACKING_URI)"
        cause = (str(exc).splitlines() or [""])[0]
        raise ConfigError(
            f"mlflow.tracking_uri={uri}{source}: the MLflow server is unreachable "
            f"({type(exc).__name__}: {cause}; probed for {timeout_s:g} s); start it, or name a "
            "server that runs, a directory or sqlite:///mlflow.db"
        ) from exc


class MLflowTracker:
    """Params, metrics, artifacts and status of one MLflow run (docs/trackers.md)."""

    name = "mlflow"

    def __init__(
        self, settings: MLflowConfig, output_dir: Path, params: dict[str, str], resumed: bool
    ) -> None:
        uri = mlflow_tracking_uri(settings.tracking_uri)
        if uri.startswith("file:"):
            # MLflow 3 refuses its file store unless told to (it prefers a database); a local
            # directory is what this tracker is asked to write to, offline and without SQLAlchemy.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.tracking import MlflowClient

        self.client = client = MlflowClient(uri)
        id_file = output_dir / MLFLOW_RUN_JSON
        self.run_id = self._reopen(id_file, uri) if resumed else None
        if self.run_id is None:
            experiment = client.get_experiment_by_name(settings.experiment_name)
            experiment_id = (
                experiment.experiment_id
                if experiment is not None
                else client.create_experiment(settings.experiment_name)
            )
            tags = {"mptrain.run_dir": str(output_dir.resolve())}
            run_name = settings.run_name or output_dir.resolve().name
            self.run_id = client.create_run(experiment_id, run_name=run_name, tags=tags).info.run_id
            atomic_write_text(id_file, json.dumps({"tracking_uri": uri, "run_id": self.run_id}))
        self._log_params(params)

    def _reopen(self, id_file: Path, uri: str) -> str | None:
        """The run id this run directory logged to before, when it is in this tracking store."""
        if not id_file.is_file():
            return None
        saved = json.loads(id_file.read_text(encoding="utf-8"))
        if saved.get("tracking_uri") != uri:
            return None
        try:
            self.client.get_run(saved["run_id"])
        except Exception:  # deleted, or another store: start a new MLflow run
            return None
        self.client.update_run(saved["run_id"], status="RUNNING")
        return saved["run_id"]

    def _log_params(self, params: dict[str, str]) -> None:
        """The params the run does not have yet (MLflow params cannot change), 100 per call."""
        from mlflow.entities import Param

        logged = self.client.get_run(self.run_id).data.params
        new = [Param(k, v) for k, v in params.items() if k not in logged]
        for start in range(0, len(new), 100):  # MLflow's limit per log_batch
            self.client.log_batch(self.run_id, params=new[start : start + 100])

    def log_metrics(self, values: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        stamp = int(time.time() * 1000)
        metrics = [Metric(tag, value, stamp, step) for tag, value in values.items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def finish(self, status: str, artifacts: list[Path]) -> None:
        for path in artifacts:
            if path.is_file():
                self.client.log_artifact(self.run_id, str(path))
        self.client.set_terminated(self.run_id, MLFLOW_STATUS.get(status, "FAILED"))


# --------------------------------------------------------------------------------- together
class Trackers:
    """The run's trackers as one loop observer (metrics rows and evaluations; nothing per step).

    A tracker that raises is dropped after one warning (``warn``); the run goes on.
    """

    def __init__(self, trackers: list[Tracker], warn: Callable[[str], None]) -> None:
        self.active = list(trackers)
        self.warn = warn

    def on_step(self, state: object) -> None:
        pass

    def on_log(self, row: dict[str, Any]) -> None:
        values = row_metrics(row)
        self._each(lambda t: t.log_metrics(values, row["step"]))

    def on_eval(self, row: dict[str, Any]) -> None:
        self.on_log(row)

    def on_warning(self, message: str) -> None:
        pass  # warnings are in the log file, metrics.jsonl and the report

    def finish(self, status: str, artifacts: list[Path]) -> None:
        """Send the outcome (and ``artifacts`` that exist) and close every tracker."""
        self._each(lambda t: t.finish(status, artifacts))
        self.active = []

    def _each(self, call: Callable[[Tracker], None]) -> None:
        for tracker in list(self.active):
            try:
                call(tracker)
            except Exception as exc:  # a tracker is not worth losing the run over
                self.active.remove(tracker)
                first_line = (str(exc).splitlines() or [""])[0]
                self.warn(
                    f"{tracker.name} failed ({type(exc).__name__}: {first_line}); "
                    f"no more {tracker.name} logging in this run, training goes on"
                )


def start_trackers(
    cfg: RunConfig,
    resolved_precision: str,
    output_dir: Path,
    start_step: int,
    warn: Callable[[str], None],
) -> Trackers | None:
    """The trackers ``cfg.logger`` names, started, with the run's params (:func:`run_params`;
    ``resolved_precision``: what ``precision.name`` became); None without any. Raises ConfigError
    (one line, naming the setting) when one cannot start, before anything trains."""
    check_tracking_server(cfg)  # the preflight probed too; jobs an Optuna sweep picks were not
    trackers: list[Tracker] = []
    for name in dict.fromkeys(cfg.logger):  # named twice: started once
        try:
            trackers.append(_start(name, cfg, resolved_precision, output_dir, start_step))
        except Exception as exc:
            for started in trackers:
                _close_quietly(started)
            key = _setting_key(name, cfg, output_dir)
            detail = (str(exc).splitlines() or [""])[0]
            raise ConfigError(
                f"{key}: cannot start {name} there ({type(exc).__name__}: {detail})"
            ) from exc
    return Trackers(trackers, warn) if trackers else None


def _start(name: str, cfg: RunConfig, precision: str, output_dir: Path, start_step: int) -> Tracker:
    if name == "tensorboard":
        own_dir = cfg.tensorboard.log_dir is None
        log_dir = output_dir / TENSORBOARD_DIR if own_dir else Path(cfg.tensorboard.log_dir)
        hparams = run_params(cfg, precision, TENSORBOARD_TYPES)
        return TensorBoardTracker(log_dir, hparams, start_step, own_dir)
    params = run_params(cfg, precision, MLFLOW_TYPES)
    return MLflowTracker(cfg.mlflow, output_dir, params, resumed=start_step > 0)


def _setting_key(name: str, cfg: RunConfig, output_dir: Path) -> str:
    if name == "tensorboard":
        return f"tensorboard.log_dir={cfg.tensorboard.log_dir or output_dir / TENSORBOARD_DIR}"
    return f"mlflow.tracking_uri={mlflow_tracking_uri(cfg.mlflow.tracking_uri)}"


def _close_quietly(tracker: Tracker) -> None:
    writer = getattr(tracker, "writer", None)
    if writer is not None:
        writer.close()
