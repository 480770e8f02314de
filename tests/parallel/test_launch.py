"""The one process launcher (``parallel.launch``): results in rank order, a child that dies without
a word or raises ends every child within the bound with one kind of error, the cause first; the
disaggregated workers' error is of the same kind."""

from __future__ import annotations

import multiprocessing
import os
import time

import pytest
import torch
import torch.distributed as dist

from minillm.parallel.launch import RankError, default_backend, failure_message, launch, rank_device
from minillm.serving.disagg import WorkerError


def rank_and_sum(rank: int, world: int) -> tuple[int, float]:
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)  # the ranks are in one process group
    return rank, total.item()


def die_on_rank_one(rank: int, world: int) -> None:
    if rank == 1:
        os._exit(3)  # no traceback, no report: the launcher must notice the exit


def test_devices_and_backends():
    assert rank_device("cpu", 3) == torch.device("cpu")
    assert default_backend("cpu", 2) == "gloo"
    if torch.cuda.is_available():
        assert rank_device("cuda", 1) == torch.device("cuda", 1 % torch.cuda.device_count())
        assert default_backend("cuda", torch.cuda.device_count() + 1) == "gloo"  # two ranks would share a GPU


def test_the_cause_comes_first_and_the_consequences_after():
    errors = {0: "Traceback\nRuntimeError: Connection closed by peer", 1: "Traceback\nValueError: bad shard"}
    message = failure_message(errors, lambda r: f"rank {r} of 2")
    assert message.startswith("rank 1 of 2 failed:\nTraceback\nValueError: bad shard")
    assert message.endswith("then: rank 0 of 2: RuntimeError: Connection closed by peer")
    assert failure_message({2: "x"}, lambda r: f"decode worker {r}", "serving").startswith(
        "decode worker 2 failed while serving:"
    )


def test_one_kind_of_error_for_ranks_and_workers():
    assert issubclass(WorkerError, RankError)


@pytest.mark.slow
def test_launch_returns_every_ranks_result_in_rank_order():
    assert launch(rank_and_sum, 2, timeout=60.0) == [(0, 3.0), (1, 3.0)]


@pytest.mark.slow
def test_a_rank_that_dies_without_a_word_ends_the_launch_within_the_bound():
    start = time.monotonic()
    with pytest.raises(RankError, match=r"rank 1 of 2 \(exit code 3\) exited without a report"):
        launch(die_on_rank_one, 2, timeout=60.0)
    assert time.monotonic() - start < 30.0
    assert not multiprocessing.active_children()  # the other rank was reaped too
