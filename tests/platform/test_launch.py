"""Who started the ranks (mptrain.platform.launch): torchrun's variables kept, a SLURM job step's
and submitit's turned into torchrun's by submitit's own job environments, the restart count, and
the torchrun setup whose restarts would hang refused in one line."""

from __future__ import annotations

import os
import random

import pytest

from mptrain.config.base import ConfigError
from mptrain.platform import launch

TORCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def clean_env(monkeypatch):
    """No launcher's variables from the test's own environment, and torchrun's variables that
    export_torch_env writes (os.environ itself) put back as they were afterwards: set through
    monkeypatch first, so it knows to remove them."""
    for key in TORCH_VARS:
        monkeypatch.setenv(key, "unset")
        monkeypatch.delenv(key)
    for key in list(os.environ):
        if key.startswith(("SLURM_", "SUBMITIT_", "TORCHELASTIC_")):
            monkeypatch.delenv(key)
    return monkeypatch


def slurm_task(monkeypatch, rank: int, local: int, node: int) -> None:
    """Task ``rank`` of a SLURM job step of 4 tasks on node01 and node02."""
    for key, value in {
        "SLURM_JOB_ID": "4242",
        "SLURM_NTASKS": "4",
        "SLURM_STEP_NUM_TASKS": "4",  # srun's: a job step of 4 tasks
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_JOB_NODELIST": "node[01-02]",
        "SLURM_NODEID": str(node),
        "SLURM_PROCID": str(rank),
        "SLURM_LOCALID": str(local),
    }.items():
        monkeypatch.setenv(key, value)


def test_a_slurm_task_gets_torchruns_variables_from_its_job(clean_env):
    slurm_task(clean_env, rank=3, local=1, node=1)

    found = launch.export_torch_env()

    assert found == launch.Launch("slurm", nodes=2, tasks=4, restart=0)
    port = random.Random("4242").randint(*launch.PORT_RANGE)  # as submitit draws it
    assert {k: os.environ[k] for k in TORCH_VARS} == {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "node01",  # the node list expanded: the first host
        "MASTER_PORT": str(port),
    }


def test_every_task_of_a_job_agrees_on_the_master_and_a_users_port_wins(clean_env):
    seen = set()
    for rank in range(4):
        for key in TORCH_VARS:
            clean_env.delenv(key, raising=False)
        slurm_task(clean_env, rank=rank, local=rank % 2, node=rank // 2)
        launch.export_torch_env()
        seen.add((os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]))
    assert len(seen) == 1
    clean_env.setenv("MASTER_PORT", "29400")
    clean_env.delenv("RANK")
    clean_env.delenv("WORLD_SIZE")
    launch.export_torch_env()
    assert os.environ["MASTER_PORT"] == "29400"


def test_one_python_in_an_allocation_of_four_tasks_is_a_single_process(clean_env):
    """``salloc -n 4`` then ``python -m mptrain`` (no srun): one process, not rank 0 of 4."""
    slurm_task(clean_env, rank=0, local=0, node=0)
    clean_env.delenv("SLURM_STEP_NUM_TASKS")

    assert launch.export_torch_env() == launch.Launch()
    assert "RANK" not in os.environ


def test_torchruns_own_variables_are_kept_and_named(clean_env):
    for key, value in {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}.items():
        clean_env.setenv(key, value)
    clean_env.setenv("TORCHELASTIC_RESTART_COUNT", "2")

    assert launch.export_torch_env() == launch.Launch("torchrun", nodes=2, tasks=4, restart=2)
    assert os.environ["RANK"] == "1"


@pytest.mark.parametrize(
    ("env", "count"),
    [({}, 0), ({"TORCHELASTIC_RESTART_COUNT": "0"}, 0), ({"TORCHELASTIC_RESTART_COUNT": "3"}, 3),
     ({"SLURM_RESTART_COUNT": "1"}, 1)],
)  # fmt: skip
def test_the_restart_count_comes_from_torchrun_or_slurms_requeue(clean_env, env, count):
    for key, value in env.items():
        clean_env.setenv(key, value)
    assert launch.restart_count() == count


def test_a_restarted_attempt_resumes_unless_the_command_already_does():
    assert launch.resume_after_restart(None, 0) is None
    assert launch.resume_after_restart(None, 1) == "auto"
    assert launch.resume_after_restart("runs/a/checkpoints/step_4.pt", 2) == (
        "runs/a/checkpoints/step_4.pt"
    )


def test_the_rank_is_known_before_the_group_from_any_launcher(clean_env):
    assert launch.global_rank() == 0
    clean_env.setenv("SLURM_PROCID", "5")
    assert launch.global_rank() == 5
    clean_env.setenv("RANK", "2")
    assert launch.global_rank() == 2


def test_torchrun_restarts_over_a_shared_store_are_refused_in_one_line(clean_env):
    for key, value in {"RANK": "0", "WORLD_SIZE": "2", "TORCHELASTIC_MAX_RESTARTS": "1"}.items():
        clean_env.setenv(key, value)
    clean_env.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")

    with pytest.raises(ConfigError) as caught:
        launch.export_torch_env()
    assert "\n" not in str(caught.value)
    assert str(caught.value).endswith("start torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1")

    clean_env.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")  # what that variable makes it
    assert launch.export_torch_env().launcher == "torchrun"
