"""Beyond one machine, for real on the CPU with Gloo: a job of two tasks through submitit's local
executor (Hydra's ``submitit_local`` launcher, as a SLURM job step starts them) trains as DDP
and as FSDP; torchrun's ``--max-restarts`` continues the run after a worker is killed, bit for
bit; without restarts the lost rank is named and the other stops within the timeout; a stop
signal to one rank is reported with that rank.

Workers are killed by ``debug.kill_at_step`` (a real SIGKILL the rank sends itself after that
step, on the job's first attempt only), so where the run is when it dies is not a race."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mptrain.checkpoint.file import load_checkpoint
from mptrain.rundir.layout import CHECKPOINT_DIR, METRICS_JSONL, REPORT_JSON, RESTARTS_JSONL
from mptrain.train.ranks import LOST

pytestmark = pytest.mark.slow

RUN = (
    "model=mlp", "precision=fp32", "device=cpu", "threads=1", "progress=false",
    "epochs=null", "log_every=1", "max_steps=12", "checkpoint.every_steps=3",
)  # fmt: skip
# torchrun shares its rendezvous store with the process group unless told not to, and a
# restarted group then hangs (pytorch/pytorch#135712; mptrain refuses that setup).
SEPARATE_STORE = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def environment(extra: dict[str, str] | None = None) -> dict[str, str]:
    drop = ("HYDRA_FULL_ERROR", "COLUMNS", "LINES")
    return {k: v for k, v in os.environ.items() if k not in drop} | (extra or {})


def torchrun(run_dir: Path, *args: str, restarts: int = 0, env=None, timeout: float = 300):
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        f"--max-restarts={restarts}", "-m", "mptrain", *RUN, *args, f"hydra.run.dir={run_dir}",
    ]  # fmt: skip
    return subprocess.run(
        command,
        cwd=run_dir.parent,
        env=environment(env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def describe(result: subprocess.CompletedProcess) -> str:
    return f"exit {result.returncode}\nstdout:\n{result.stdout[-4000:]}\nstderr:\n{result.stderr[-4000:]}"


def report(run_dir: Path) -> dict:
    return json.loads((run_dir / REPORT_JSON).read_text())


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    newest = sorted((run_dir / CHECKPOINT_DIR).glob("step_*.pt"))[-1]
    return load_checkpoint(newest)["model"]


def assert_same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


# ------------------------------------------------------------------------------ submitit
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_two_task_submitit_job_trains_as_one_distributed_run(tmp_path, strategy):
    """Hydra's submitit_local launcher starts two tasks of one job; mptrain joins them from
    submitit's variables (no torchrun) with the same rank-0 rules: one report, world size 2.
    Under DDP the weights are torchrun's to the bit: the same ranks, seeds and shards."""
    sweep = tmp_path / "sweep"
    command = [
        sys.executable, "-m", "mptrain", "-m", "hydra/launcher=submitit_local",
        "hydra.launcher.tasks_per_node=2", "hydra.launcher.timeout_min=5", *RUN,
        f"distributed.strategy={strategy}", f"hydra.sweep.dir={sweep}",
    ]  # fmt: skip
    result = subprocess.run(
        command, cwd=tmp_path, env=environment(), capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, describe(result)
    (run_dir,) = [p for p in sweep.iterdir() if (p / REPORT_JSON).is_file()]
    on_disk = report(run_dir)
    d = on_disk["distributed"]

    assert on_disk["status"] == "completed" and on_disk["training"]["steps"] == 12
    assert (d["launcher"], d["world_size"], d["tasks"], d["nodes"]) == ("submitit_local", 2, 2, 1)
    assert (d["backend"], d["strategy"]) == ("gloo", strategy)
    assert len(list(sweep.glob("*/report.json"))) == 1  # rank 0 alone writes
    if strategy == "ddp":
        by_torchrun = tmp_path / "torchrun"
        by_torchrun.mkdir()
        result = torchrun(by_torchrun / "run")
        assert result.returncode == 0, describe(result)
        assert report(by_torchrun / "run")["distributed"]["launcher"] == "torchrun"
        assert_same_bits(final_weights(run_dir), final_weights(by_torchrun / "run"))


# ------------------------------------------------------------------------------ restarts
def test_a_restarted_group_continues_the_run_bit_for_bit_and_counts_the_restart(tmp_path):
    straight, restarted = tmp_path / "straight", tmp_path / "restarted"
    result = torchrun(straight)
    assert result.returncode == 0, describe(result)

    result = torchrun(
        restarted, "debug.kill_at_step=8", "debug.kill_rank=1", restarts=1, env=SEPARATE_STORE
    )
    assert result.returncode == 0, describe(result)
    on_disk = report(restarted)

    assert on_disk["status"] == "completed" and on_disk["training"]["steps"] == 12
    assert on_disk["distributed"]["restart"] == 1
    assert on_disk["resumed"]["requested"] == "auto"  # nobody typed it
    assert on_disk["resumed"]["step"] == 6  # the newest checkpoint before the kill at step 8
    assert on_disk["resumed"]["restarts"] == [
        {"restart": 1, "resumed_from_step": 6, "last_logged_step": 8, "steps_lost_at_least": 2}
    ]
    assert len((restarted / RESTARTS_JSONL).read_text().splitlines()) == 1
    rows = [json.loads(r) for r in (restarted / METRICS_JSONL).read_text().splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "train"] == list(range(1, 13))  # each once
    assert_same_bits(final_weights(restarted), final_weights(straight))


def test_restarts_with_torchruns_shared_store_are_refused_in_one_line(tmp_path):
    run_dir = tmp_path / "run"
    result = torchrun(run_dir, restarts=1)

    assert result.returncode != 0
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in result.stderr
    assert "pytorch/pytorch#135712" in result.stderr
    assert not (run_dir / CHECKPOINT_DIR).exists()


# ------------------------------------------------------------------------------ a lost rank
def test_a_lost_rank_is_named_and_the_other_stops_within_the_timeout(tmp_path):
    run_dir = tmp_path / "run"
    started = time.monotonic()
    result = torchrun(
        run_dir, "debug.kill_at_step=5", "debug.kill_rank=1", "distributed.timeout_s=60"
    )
    took = time.monotonic() - started
    on_disk = report(run_dir)

    assert result.returncode != 0
    assert took < 60, f"took {took:.0f} s"
    assert on_disk["status"] == "failed"
    assert on_disk["reason"].startswith(f"rank 1 lost: {LOST}; "), on_disk["reason"]
    assert on_disk["distributed"]["lost_ranks"] == {"1": LOST}
    assert on_disk["distributed"]["timeout_s"] == 60
    assert on_disk["training"]["steps"] == 5


def _rank_pid(launcher_pid: int, rank: int) -> int | None:
    """The pid of torchrun's worker with ``RANK=rank`` (read from /proc)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
            stat = (entry / "stat").read_text().split()
        except OSError:
            continue
        if f"RANK={rank}".encode() in env and b"TORCHELASTIC_RUN_ID" in b" ".join(env):
            parents = {int(stat[3])}
            if launcher_pid in parents or _child_of(int(stat[3]), launcher_pid):
                return int(entry.name)
    return None


def _child_of(pid: int, ancestor: int) -> bool:
    while pid > 1:
        if pid == ancestor:
            return True
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().split()[3])
        except OSError:
            return False
    return False


def test_a_stop_signal_to_one_rank_is_reported_with_that_rank(tmp_path):
    run_dir = tmp_path / "run"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        "-m", "mptrain", *RUN, "max_steps=100000", "model.hidden_sizes=[512,512]",
        f"hydra.run.dir={run_dir}",
    ]  # fmt: skip
    launcher = subprocess.Popen(
        command, cwd=tmp_path, env=environment(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while (
            not (run_dir / METRICS_JSONL).is_file() or not (run_dir / METRICS_JSONL).stat().st_size
        ):
            assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()
            time.sleep(0.05)
        rank1 = _rank_pid(launcher.pid, 1)
        assert rank1 is not None
        os.kill(rank1, signal.SIGTERM)
        _, err = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    on_disk = report(run_dir)
    stopped = on_disk["training"]["steps"]

    assert on_disk["status"] == "interrupted", err[-3000:]
    assert on_disk["reason"] == (
        f"SIGTERM on rank 1 at step {stopped}; checkpoint written, resume with resume=auto"
    )
