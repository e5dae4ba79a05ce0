"""What rank 0 says of the other ranks (mptrain.train.ranks): the ranks a stop signal reached,
and the rank that was lost, read from a real TCPStore the way the job's ranks leave their words."""

from __future__ import annotations

import datetime as dt
import signal

import pytest
import torch.distributed as dist

from mptrain.platform.distributed import DistContext
from mptrain.train import ranks
from mptrain.train.loop import STOP_ASKED


@pytest.mark.parametrize(
    ("asked", "words"),
    [
        ({}, None),
        ({0: signal.SIGTERM, 1: signal.SIGTERM}, "SIGTERM"),  # torchrun passed it on: no ranks
        ({1: signal.SIGTERM}, "SIGTERM on rank 1"),
        ({0: signal.SIGINT, 1: signal.SIGTERM}, "SIGINT on rank 0, SIGTERM on rank 1"),
        ({1: signal.SIGHUP, 2: signal.SIGHUP}, "SIGHUP on ranks 1, 2"),  # of 4
        ({1: STOP_ASKED}, "a stop request on rank 1"),
    ],
)
def test_the_ranks_a_stop_reached_are_named_unless_it_reached_all(asked, words):
    assert ranks.stop_words(asked, world_size=4 if 2 in asked else 2) == words


def test_a_rank_stopped_by_anothers_signal_exits_as_if_it_got_it():
    assert ranks.stop_exit_code({1: signal.SIGTERM}) == 143
    assert ranks.stop_exit_code({1: STOP_ASKED}) == 128


# What Gloo raised on rank 0 when rank 1 was killed (torch 2.14.1, measured).
GLOO_CLOSED = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:561] Connection closed by "
    "peer [127.0.0.1]:19376"
)


@pytest.fixture
def store(monkeypatch):
    """A TCPStore on a free port, as rank 0's process group (or torchrun's agent) hosts one."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=dt.timedelta(seconds=5))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(server.port))
    return server


def words_of(world: int) -> list[ranks.LastWords]:
    return [ranks.LastWords(DistContext(rank=r, world_size=world)) for r in range(world)]


def test_a_rank_that_went_without_a_word_is_lost_and_one_that_failed_says_how(store):
    rank0, killed, knocked_on, failed = words_of(4)
    for w in (rank0, killed, knocked_on, failed):
        w.say(ranks.TRAINING)
    knocked_on.say(ranks.failure_word(RuntimeError(GLOO_CLOSED)))
    failed.say(ranks.failure_word(ValueError("a NaN in the data loader")))

    lost = rank0.lost(wait_s=0.3)

    assert lost == {1: ranks.LOST, 3: "failed: ValueError: a NaN in the data loader"}
    assert ranks.lost_words({1: ranks.LOST}) == f"rank 1 lost: {ranks.LOST}"


def test_nobody_is_lost_when_every_rank_ended_or_failed_in_a_collective(store):
    rank0, other = words_of(2)
    other.say("ended at step 7")
    assert rank0.lost(wait_s=0.3) == {}


def test_a_collective_failure_is_told_from_a_ranks_own():
    def collective(exc: BaseException) -> bool:  # as the job tells them apart
        return ranks.failure_word(exc).startswith(ranks.COLLECTIVE)

    assert collective(RuntimeError(GLOO_CLOSED))
    assert collective(dist.DistBackendError("NCCL watchdog timeout"))
    assert not collective(ValueError("bad batch"))
    # rank 0's own failure that merely mentions a timeout blames nobody
    assert not collective(RuntimeError("DataLoader worker timed out"))


def test_one_process_has_no_store_and_says_nothing():
    alone = ranks.LastWords(DistContext())
    alone.say(ranks.TRAINING)
    assert alone.store is None and alone.lost() == {}
