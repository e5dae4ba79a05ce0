"""Every file name in a run directory, in one place.

A run directory (``outputs/<date>/<time>_<precision>_<model>_<dataset>/`` or ``hydra.run.dir``)::

    .mptrain.lock          held while a job writes here (rundir.lock.RunDirLock)
    report.json, report.md the run's report (report.schema); failure.json when it stopped early
    metrics.jsonl          one row per log/eval/warning (output.metrics), appended as it runs
    curves.png             loss and metric curves (output.plots)
    mptrain.log            what the job said (output.joblog, through Hydra's job logging)
    audit.md/.json, probe.md/.json   diagnostics asked for with audit=true / probe=true
    mlflow_run.json, tensorboard/    trackers (output.trackers)
    checkpoints/step_<N>.pt, latest.json, best.pt   (checkpoint.file, checkpoint.checkpointer)

A sweep directory holds ``sweep.md``, ``sweep.json`` and ``sweep_loss.png`` beside its jobs, and
``.mptrain-sweep.lock`` while a sweep runs there (``cli.preflight.hold_sweep_dir``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

LOCK_NAME = ".mptrain.lock"
SWEEP_LOCK_NAME = ".mptrain-sweep.lock"
REPORT_JSON = "report.json"
REPORT_MD = "report.md"
FAILURE_JSON = "failure.json"
METRICS_JSONL = "metrics.jsonl"
# One row per restarted attempt (torchrun --max-restarts, SLURM's requeue): where it resumed and the
# last step the attempt before it logged (mptrain.checkpoint.resume.record_restart).
RESTARTS_JSONL = "restarts.jsonl"
RUN_PNG = "curves.png"
SWEEP_PNG = "sweep_loss.png"
AUDIT_JSON, AUDIT_MD = "audit.json", "audit.md"
PROBE_JSON, PROBE_MD = "probe.json", "probe.md"
MLFLOW_RUN_JSON = "mlflow_run.json"
TENSORBOARD_DIR = "tensorboard"
CHECKPOINT_DIR = "checkpoints"
LATEST = "latest.json"
BEST = "best.pt"
_STEP_NAME = re.compile(r"step_(\d+)\.pt$")


def step_checkpoint_name(step: int) -> str:
    """``step_00000030.pt``: zero-padded so names sort by step."""
    return f"step_{step:08d}.pt"


def candidates(directory: Path) -> list[Path]:
    """Checkpoints in a run's checkpoint directory, newest first (latest.json's target first)."""
    files = sorted(
        (p for p in directory.glob("step_*.pt") if _STEP_NAME.search(p.name)),
        key=lambda p: int(_STEP_NAME.search(p.name).group(1)),
        reverse=True,
    )
    latest = directory / LATEST
    if latest.is_file():
        try:
            target = directory / json.loads(latest.read_text())["checkpoint"]
            if target in files:
                files.remove(target)
                files.insert(0, target)
        except (ValueError, KeyError, OSError):
            pass
    return files
