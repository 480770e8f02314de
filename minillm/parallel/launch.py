"""Starting ranks: N processes that join one ``torch.distributed`` process group, each running
the same function on its own rank, with every wait bounded.

``launch(fn, world_size, *args)`` spawns the ranks itself (``torch.multiprocessing``, spawn), as
``vllm --tensor-parallel-size`` does; each rank calls ``fn(rank, world_size, *args)`` inside an
initialized process group and its return value comes back to the caller (one list, in rank
order). The function must be importable (defined at module level in a module, not in a notebook
cell), because a spawned process imports it by name.

Failure. A rank that raises reports its traceback; the launcher then terminates the others
(a peer blocked in a collective waits for a partner that will never come) and raises
``RankError`` naming the rank and showing its traceback. A rank that dies without a word, or
ranks still running after ``timeout`` seconds, end the same way. Nothing outlives the call.

Under ``torchrun`` the process group is made from its environment instead (``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``...): ``init_from_env()``.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from ..core.processes import reap


class RankError(RuntimeError):
    """A rank raised, died, or ran past the timeout; the message names which and why."""


def default_backend(device: str) -> str:
    """nccl when every rank has a GPU of its own, else gloo (CPU tensors)."""
    return "nccl" if device.startswith("cuda") else "gloo"


def rank_device(device: str, rank: int) -> torch.device:
    """'cuda' puts rank i on GPU i (mod the count); anything else as given."""
    if device.startswith("cuda") and torch.cuda.is_available():
        index = rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device(device)


def _rank_main(rank, world_size, init_file, backend, timeout, threads, fn, args, results) -> None:
    try:
        torch.set_num_threads(threads)
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # every rank is on this machine
        dist.init_process_group(
            backend,
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout),
        )
        try:
            out = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        # Pickled here to bytes: a tensor put on a torch queue as such travels as a shared-memory
        # handle, which dies with this process if it exits before the launcher reads it.
        results.put(("ok", rank, pickle.dumps(out)))
    except BaseException:  # the launcher stops everyone and raises this traceback
        with contextlib.suppress(Exception):
            results.put(("error", rank, traceback.format_exc()))


def check_world_size(world_size: object, name: str = "world_size") -> int:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"{name} must be a positive integer, got {world_size!r}")
    return world_size


def launch(
    fn: Callable,
    world_size: int,
    *args,
    timeout: float = 120.0,
    threads: int = 1,
    backend: str | None = None,
    device: str = "cpu",
) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned ranks; their results in rank order.

    ``threads``: PyTorch CPU threads per rank (1 keeps N ranks from fighting over the cores).
    ``timeout`` bounds the whole run and every collective inside it."""
    check_world_size(world_size)
    if not timeout > 0:
        raise ValueError(f"timeout must be positive seconds, got {timeout!r}")
    backend = backend or default_backend(device)
    ctx = torch.multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = []
    with tempfile.TemporaryDirectory(prefix="minillm-ranks-") as tmp:
        init_file = str(Path(tmp) / "rendezvous")
        try:
            for rank in range(world_size):
                proc = ctx.Process(
                    target=_rank_main,
                    args=(rank, world_size, init_file, backend, timeout, threads, fn, args, results),
                    daemon=True,
                )
                proc.start()
                procs.append(proc)
            return _collect(procs, results, world_size, timeout)
        finally:
            reap(procs, 5.0)
            results.cancel_join_thread()


def _collect(procs, results, world_size: int, timeout: float) -> list:
    out: dict[int, object] = {}
    deadline = time.monotonic() + timeout
    while len(out) < world_size:
        try:
            kind, rank, payload = results.get(timeout=0.2)
        except queue.Empty:
            dead = [r for r, p in enumerate(procs) if not p.is_alive() and p.exitcode != 0 and r not in out]
            if dead:
                errors = _more_errors(results, procs, {}, out)
                if errors:
                    raise RankError(_failure_message(errors, world_size)) from None
                codes = ", ".join(f"rank {r} exit code {procs[r].exitcode}" for r in dead)
                raise RankError(f"a rank died without reporting ({codes})") from None
            if time.monotonic() > deadline:
                waiting = [r for r in range(world_size) if r not in out]
                raise RankError(f"rank(s) {waiting} of {world_size} still running after {timeout} s") from None
            continue
        if kind == "error":
            errors = _more_errors(results, procs, {rank: payload}, out)
            raise RankError(_failure_message(errors, world_size))
        out[rank] = pickle.loads(payload)
    return [out[r] for r in range(world_size)]


# What a rank reports when a peer went away: a consequence, not the cause.
PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Timed out")


def _more_errors(results, procs, errors: dict, out: dict, wait: float = 2.0) -> dict:
    """After a first failure, the other ranks' reports for up to ``wait`` seconds: the rank that
    failed first is often not the first to report (its peers' collectives break at once)."""
    end = time.monotonic() + wait
    while time.monotonic() < end and len(errors) + len(out) < len(procs):
        try:
            kind, rank, payload = results.get(timeout=0.1)
        except queue.Empty:
            if all(not p.is_alive() for p in procs):
                break
            continue
        if kind == "error":
            errors[rank] = payload
        else:
            out[rank] = pickle.loads(payload)
    return errors


def _failure_message(errors: dict, world_size: int) -> str:
    """The cause first (a rank whose error is not a broken connection), the consequences after."""
    causes = [r for r in sorted(errors) if not any(m in errors[r] for m in PEER_GONE)]
    first = causes[0] if causes else min(errors)
    message = f"rank {first} of {world_size} failed:\n{errors[first]}"
    others = [r for r in sorted(errors) if r != first]
    if others:
        last = {r: errors[r].strip().splitlines()[-1] for r in others}
        message += "\nthen: " + "; ".join(f"rank {r}: {line}" for r, line in last.items())
    return message


def under_torchrun() -> bool:
    """True inside a process that torchrun (or another launcher) started with RANK and WORLD_SIZE."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def init_from_env(device: str = "cpu", timeout: float = 120.0) -> tuple[int, int]:
    """Join the process group torchrun describes in the environment; returns (rank, world_size)."""
    if not dist.is_initialized():
        backend = default_backend(device)
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout))
    return dist.get_rank(), dist.get_world_size()


def several(rank: int, world_size: int, calls: tuple) -> list:
    """A rank function that runs several rank functions in turn: ``calls`` is a tuple of
    ``(fn, args)``; returns their results in order. One launch pays for starting the ranks once."""
    return [fn(rank, world_size, *args) for fn, args in calls]


def launch_several(calls, world_size: int, timeout: float = 120.0, **options) -> list[list]:
    """Run each ``(fn, args)`` of ``calls`` on the same ``world_size`` ranks, started once; for
    each call, its results in rank order."""
    by_rank = launch(several, world_size, tuple(calls), timeout=timeout, **options)
    return [[by_rank[r][i] for r in range(world_size)] for i in range(len(calls))]
