"""Starting processes that work together, written once: N spawned children that join one
``torch.distributed`` process group, report to their parent on one queue and end within a bound.
``launch`` here runs one function on every rank (chapter 15); the disaggregated workers
(``serving.disagg``, chapter 14) are children of the same launcher.

``launch(fn, world_size, *args)`` spawns the ranks itself, as ``vllm --tensor-parallel-size``
does; each rank calls ``fn(rank, world_size, *args)`` inside an initialized process group and its
return value comes back to the caller (one list, in rank order). The function must be importable
(defined at module level in a module, not in a notebook cell), because a spawned process imports
it by name.

The launcher. ``Children`` spawns each child (``torch.multiprocessing``, the spawn context) into
``child_main``, which sets its threads, joins the group through a rendezvous file
(``join_group``), runs its body and leaves the group; a child that raises reports its traceback
on the queue. ``Children.receive`` hands the parent each report, and raises the launcher's error
(``RankError``, or a subclass such as serving's ``WorkerError``: one kind to catch) when a child
reports a failure or exits without a word; ``Children.close`` tells, waits, terminates and kills.
Failure. After a first failure the other children's reports are read for a moment, since the
child that failed first is often not the first to report (its peers' collectives break at once):
the message puts the cause first, the consequences after. Every wait has a timeout; nothing
outlives its launcher.

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
from collections import deque
from collections.abc import Callable, Container
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

# What a child reports when a peer went away: a consequence, not the cause.
PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Timed out")


class RankError(RuntimeError):
    """A child process (a rank, a worker) raised, died, or ran past a timeout; the message names
    which and why. The one error every launcher user raises (subclasses name their kind)."""


def default_backend(device: str, world_size: int) -> str:
    """nccl when every rank has a GPU of its own, else gloo (which moves CPU tensors)."""
    own_gpu = device.startswith("cuda") and torch.cuda.is_available() and torch.cuda.device_count() >= world_size
    return "nccl" if own_gpu else "gloo"


def rank_device(device: str, rank: int) -> torch.device:
    """'cuda' puts rank i on GPU i (mod the count); anything else as given."""
    if device.startswith("cuda") and torch.cuda.is_available():
        index = rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device(device)


def check_world_size(world_size: object, name: str = "world_size") -> int:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"{name} must be a positive integer, got {world_size!r}")
    return world_size


# ---------------------------------------------------------------------------------------------
# The child side


@dataclass(frozen=True)
class Rendezvous:
    """What a child needs to join its siblings: its rank, the group, and the bounds it keeps."""

    rank: int
    world_size: int
    init_file: str | None  # the file:// rendezvous; None: the children form no process group
    backend: str
    timeout: float  # seconds, the join and every collective
    threads: int  # PyTorch CPU threads


def join_group(rv: Rendezvous) -> None:
    """Join the children's process group through its rendezvous file (every rank on this machine)."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        rv.backend,
        init_method=f"file://{rv.init_file}",
        rank=rv.rank,
        world_size=rv.world_size,
        timeout=timedelta(seconds=rv.timeout),
    )


def child_main(rv: Rendezvous, body: Callable, args: tuple, reports) -> None:
    """A spawned child's whole life: threads, the group, ``body(rank, world_size, *args)``, the group
    left; whatever it raises goes to the parent as ("error", rank, traceback)."""
    joined = False
    try:
        torch.set_num_threads(rv.threads)
        if rv.backend == "nccl":  # each rank's GPU chosen before its communicator is made
            rank_device("cuda", rv.rank)
        if rv.init_file is not None:
            join_group(rv)
            joined = True
        body(rv.rank, rv.world_size, *args)
    except BaseException:  # the parent stops everyone and raises this traceback
        with contextlib.suppress(Exception):
            reports.put(("error", rv.rank, traceback.format_exc()), timeout=rv.timeout)
    finally:
        if joined:
            dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# The parent side


class Children:
    """The parent's handle on ``world_size`` children: spawned with ``start``, heard with
    ``receive``, ended with ``close``. ``name(rank)`` says who a child is in error messages
    ("rank 1 of 2", "decode worker 1"); ``error`` is what they raise."""

    def __init__(
        self,
        world_size: int,
        *,
        backend: str,
        timeout: float,
        threads: int = 1,
        group: bool = True,
        name: Callable[[int], str] = lambda rank: f"rank {rank}",
        error: type[RankError] = RankError,
        farewell: tuple | None = None,
    ):
        self.world_size, self.backend, self.timeout, self.threads = world_size, backend, timeout, threads
        self.name, self.error, self.farewell = name, error, farewell  # farewell: what close() puts on each inbox
        self._ctx = torch.multiprocessing.get_context("spawn")
        self._tmp = tempfile.TemporaryDirectory(prefix="minillm-ranks-")
        self.init_file = str(Path(self._tmp.name) / "rendezvous") if group else None
        self.reports = self._ctx.Queue()  # every child's reports to the parent
        self.inboxes: list = []  # the parent's messages to each child, where it has an inbox
        self.procs: list = []
        self._backlog: deque = deque()  # reports read while looking for a failure's cause
        self.closed = False

    def queue(self):
        """A new queue to a child (its inbox), closed with the others."""
        inbox = self._ctx.Queue()
        self.inboxes.append(inbox)
        return inbox

    def start(self, body: Callable, *args) -> None:
        """Spawn the next rank into ``child_main(..., body, args, self.reports)``."""
        rv = Rendezvous(len(self.procs), self.world_size, self.init_file, self.backend, self.timeout, self.threads)
        proc = self._ctx.Process(target=child_main, args=(rv, body, args, self.reports), daemon=True)
        proc.start()
        self.procs.append(proc)

    @property
    def alive(self) -> int:
        return sum(p.is_alive() for p in self.procs)

    def receive(self, seconds: float, doing: str | None = None, may_exit: Container[int] = ()) -> tuple | None:
        """The next report within ``seconds`` (a tuple whose first two items are its kind and the
        child's rank), else None. Raises ``error`` when a child reports a failure, or when one not
        in ``may_exit`` has exited and left no report."""
        deadline = time.monotonic() + seconds
        while True:
            message = self._next(min(0.2, max(0.0, deadline - time.monotonic())))
            if message is not None:
                if message[0] == "error":
                    self._fail({message[1]: message[2]}, doing)
                return message
            exited = [r for r, p in enumerate(self.procs) if not p.is_alive() and r not in may_exit]
            if exited:
                self._drain()  # what an exited child sent is in the pipe: read it before judging
                if self._backlog:
                    continue
                codes = ", ".join(f"{self.name(r)} (exit code {self.procs[r].exitcode})" for r in exited)
                self.close()
                raise self.error(f"{codes} exited without a report" + (f" while {doing}" if doing else ""))
            if time.monotonic() >= deadline:
                return None

    def _next(self, seconds: float):
        if self._backlog:
            return self._backlog.popleft()
        try:
            return self.reports.get(timeout=seconds)
        except queue.Empty:
            return None

    def _drain(self) -> None:
        with contextlib.suppress(queue.Empty):
            while True:
                self._backlog.append(self.reports.get(timeout=0.1))

    def _fail(self, errors: dict[int, str], doing: str | None, wait: float = 2.0):
        """Read the other children's failures for up to ``wait`` seconds (until each has reported
        one or exited), stop everyone, raise ``error`` with the cause first."""
        end = time.monotonic() + wait
        while time.monotonic() < end:
            message = self._next(0.1)
            if message is not None and message[0] == "error":
                errors[message[1]] = message[2]
            elif message is None and all(r in errors or not p.is_alive() for r, p in enumerate(self.procs)):
                break
        self.close()
        raise self.error(failure_message(errors, self.name, doing))

    def close(self, wait_s: float = 5.0) -> None:
        """Put the farewell on every live child's inbox (if there is one), wait up to ``wait_s``
        seconds in all, then terminate and kill what is still alive (``reap``); remove the rendezvous."""
        if self.closed:
            return
        self.closed = True
        if self.farewell is not None:
            for proc, inbox in zip(self.procs, self.inboxes):
                if proc.is_alive():
                    with contextlib.suppress(Exception):
                        inbox.put(self.farewell)
        reap(self.procs, wait_s)
        for q in (self.reports, *self.inboxes):
            q.cancel_join_thread()
        self._tmp.cleanup()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def failure_message(errors: dict[int, str], name: Callable[[int], str], doing: str | None = None) -> str:
    """The cause first (a child whose error is not a broken connection), the consequences after."""
    causes = [r for r in sorted(errors) if not any(m in errors[r] for m in PEER_GONE)]
    first = causes[0] if causes else min(errors)
    message = f"{name(first)} failed" + (f" while {doing}" if doing else "") + f":\n{errors[first]}"
    others = [r for r in sorted(errors) if r != first]
    if others:
        last = {r: errors[r].strip().splitlines()[-1] for r in others}
        message += "\nthen: " + "; ".join(f"{name(r)}: {line}" for r, line in last.items())
    return message


def reap(procs, wait_s: float) -> None:
    """Join ``procs`` for up to ``wait_s`` seconds in all, then terminate, then kill, whatever is
    still alive; two seconds at most for each of those."""
    deadline = time.monotonic() + wait_s
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
            proc.join(2.0)
        if proc.is_alive():
            proc.kill()
            proc.join(2.0)


# ---------------------------------------------------------------------------------------------
# One function on every rank


def _run_rank(rank: int, world_size: int, fn: Callable, args: tuple, reports) -> None:
    out = fn(rank, world_size, *args)
    # Pickled here to bytes: a tensor put on a torch queue as such travels as a shared-memory
    # handle, which dies with this process if it exits before the launcher reads it.
    reports.put(("ok", rank, pickle.dumps(out)))


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
    backend = backend or default_backend(device, world_size)
    out: dict[int, object] = {}
    with Children(
        world_size, backend=backend, timeout=timeout, threads=threads, name=lambda r: f"rank {r} of {world_size}"
    ) as ranks:
        for _ in range(world_size):
            ranks.start(_run_rank, fn, args, ranks.reports)
        deadline = time.monotonic() + timeout
        while len(out) < world_size:
            message = ranks.receive(deadline - time.monotonic(), may_exit=out)
            if message is None:
                waiting = [r for r in range(world_size) if r not in out]
                raise RankError(f"rank(s) {waiting} of {world_size} still running after {timeout} s")
            out[message[1]] = pickle.loads(message[2])
    return [out[r] for r in range(world_size)]


def under_torchrun() -> bool:
    """True inside a process that torchrun (or another launcher) started with RANK and WORLD_SIZE."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def init_from_env(device: str = "cpu", timeout: float = 120.0) -> tuple[int, int]:
    """Join the process group torchrun describes in the environment; returns (rank, world_size)."""
    if not dist.is_initialized():
        # the ranks of this node: device_count() is per node, WORLD_SIZE counts every node's ranks
        local = os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1"))
        backend = default_backend(device, int(local))
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
