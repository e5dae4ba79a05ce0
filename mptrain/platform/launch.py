"""Who started this process, as one of how many, and how many times: torchrun, a SLURM job step,
submitit's local executor, or nothing (one process).

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK and MASTER_ADDR/PORT itself; for a SLURM job step of
several tasks or submitit's local executor, :func:`export_torch_env` writes them, so mptrain joins
the group exactly as under torchrun (:func:`mptrain.platform.distributed.init_distributed`). A
restarted attempt (:attr:`Launch.restart` > 0: torchrun's ``--max-restarts``, SLURM's requeue)
continues the run from its newest complete checkpoint (:func:`resume_after_restart`). How to
launch: docs/distributed.md.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from typing import Any

from mptrain.config.base import ConfigError

SINGLE = "single"
TORCHRUN = "torchrun"
SLURM = "slurm"
SUBMITIT_LOCAL = "submitit_local"
PORT_RANGE = (20000, 60000)  # submitit's TorchDistributedEnvironment draws the port here


@dataclass(frozen=True)
class Launch:
    """The launcher (:data:`SINGLE`, :data:`TORCHRUN`, :data:`SLURM`, :data:`SUBMITIT_LOCAL`),
    the job's nodes and tasks, and which attempt this is (0: the first)."""

    launcher: str = SINGLE
    nodes: int = 1
    tasks: int = 1
    restart: int = 0


def restart_count() -> int:
    """How many times this job was restarted before this attempt: torchrun's agent
    (``--max-restarts``) or SLURM's requeue; 0 on the first attempt."""
    return _env_number(("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"), 0, least=1)


def _env_number(keys: tuple[str, ...], default: int, least: int = 0) -> int:
    """The number in the first of the variables ``keys`` that holds one of at least ``least``;
    ``default`` when none does."""
    for key in keys:
        value = os.environ.get(key, "")
        if value.isdigit() and int(value) >= least:
            return int(value)
    return default


RESTARTED = "auto"  # what a restarted attempt resumes with: the run directory's newest checkpoint


def resume_after_restart(resume: str | None, restart: int) -> str | None:
    """What attempt ``restart`` (0: the first) of a job resumes from: a restarted attempt
    (torchrun's ``--max-restarts``, SLURM's requeue) continues its run from the run directory's
    newest complete checkpoint, as ``resume=auto`` would, unless the command resumes already."""
    return RESTARTED if restart and resume is None else resume


def global_rank() -> int:
    """This process's rank in its job before the process group exists: torchrun's, SLURM's or
    submitit's local executor's (0 for a single process)."""
    return _env_number(("RANK", "SLURM_PROCID", "SUBMITIT_LOCAL_GLOBALID"), 0)


def launch_tasks() -> int:
    """How many ranks this job has, known before the group exists: torchrun's WORLD_SIZE, a
    SLURM job step's task count (srun sets SLURM_STEP_NUM_TASKS; an allocation's SLURM_NTASKS
    alone does not make one python process several), or submitit's local executor's."""
    return _env_number(("WORLD_SIZE", "SLURM_STEP_NUM_TASKS", "SUBMITIT_LOCAL_NTASKS"), 1)


def _job_environment() -> Any | None:
    """submitit's description of the job this task belongs to, when it has several tasks and
    torchrun did not start it; None otherwise."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun's (or the user's own)
        return None
    if os.environ.get("SUBMITIT_LOCAL_JOB_ID"):
        kind = SUBMITIT_LOCAL
    elif int(os.environ.get("SLURM_STEP_NUM_TASKS", "1")) > 1 and "SLURM_PROCID" in os.environ:
        kind = SLURM  # a job step of several tasks (srun); not one process in an allocation
    else:
        return None
    try:
        from submitit.local.local import LocalJobEnvironment
        from submitit.slurm.slurm import SlurmJobEnvironment
    except ImportError:
        raise ConfigError(
            f"a {kind} job of {launch_tasks()} tasks: joining them "
            'needs submitit (pip install "mptrain[slurm]"), or start the ranks with torchrun'
        ) from None
    return kind, (LocalJobEnvironment() if kind == SUBMITIT_LOCAL else SlurmJobEnvironment())


def check_restartable() -> None:
    """Refuse, before the first attempt, torchrun with ``--max-restarts`` sharing its rendezvous
    store with the process group (its default): a restarted group would read the previous
    attempt's addresses from it and hang (pytorch/pytorch#135712; docs/distributed.md)."""
    restarts = os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")
    shared = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    if restarts.isdigit() and int(restarts) > 0 and shared:
        raise ConfigError(
            f"torchrun --max-restarts={restarts}: torchrun shares its rendezvous store with the "
            "process group, so a restarted group would read the last attempt's addresses and "
            "hang (pytorch/pytorch#135712); start torchrun with "
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"
        )


def export_torch_env() -> Launch:
    """Set torchrun's variables for a SLURM or submitit job of several tasks from submitit's job
    environment: the first host as the master and a port drawn from the job id, so every task
    agrees without talking (variables already set are kept: a MASTER_PORT of the user's wins).
    Returns the launch."""
    found = _job_environment()
    if found is None:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world > 1:
            check_restartable()
            nodes = world // max(int(os.environ.get("LOCAL_WORLD_SIZE", world)), 1)
            return Launch(TORCHRUN, max(nodes, 1), world, restart_count())
        alone = TORCHRUN if "TORCHELASTIC_RUN_ID" in os.environ else SINGLE
        return Launch(alone, restart=restart_count())
    kind, job = found
    port = random.Random(job.job_id).randint(*PORT_RANGE)
    exported = {
        "MASTER_ADDR": job.hostnames[0],
        "MASTER_PORT": str(port),
        "RANK": str(job.global_rank),
        "WORLD_SIZE": str(job.num_tasks),
        "LOCAL_RANK": str(job.local_rank),
        "LOCAL_WORLD_SIZE": str(job.num_tasks // job.num_nodes),
    }
    for key, value in exported.items():
        os.environ.setdefault(key, value)
    return Launch(kind, job.num_nodes, job.num_tasks, restart_count())
