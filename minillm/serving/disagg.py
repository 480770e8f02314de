"""Prefill/decode disaggregation with real worker processes (chapter 14; DistServe, Zhong et al.,
2024; Splitwise, Patel et al., 2024; Mooncake, Qin et al., 2025).

    with DisaggregatedEngine("minillm-target", prefill_workers=1, decode_workers=1) as engine:
        outputs = engine.run(requests)     # one DisaggOutput per request, in the given order

Each worker is an OS process (``torch.multiprocessing``, spawned) with its own copy of the model
and its own paged KV pool. The router (this process) releases each request at its arrival time
to the prefill worker with the fewest outstanding tokens and names, at once, the decode worker
with the fewest (``serving.routing``: the one load rule, which the simulated cluster uses too).
The prefill worker (a ``PrefillEngine``: chapter 13's engine, continuous batching) runs the
prompt, samples the first token and posts the request's K/V, all layers, as one tensor with
``torch.distributed.isend`` (gloo on the CPU; nccl between GPUs) straight to that decode worker,
with a small message saying it is there. The decode worker (a ``DecodeEngine``) takes it in when
its pool has room for the whole request (backpressure: it waits, nothing is dropped or
preempted), receives the tensor into new blocks and decodes it with its running batch. Outputs
come back to the router. ``ReplicatedEngine`` runs the same machinery with N colocated workers
(each an ``Engine`` doing both phases): the baseline on the same cores.

Clock. Every process reads ``time.perf_counter`` (one monotonic clock per machine) from a common
origin sent at the start of each run, so TTFT (queueing and prefill on the prefill worker) and
the gaps between tokens (the first of which includes the transfer and any wait for room on the
decode side) are measured across processes.

Processes. The workers are children of the one launcher (``parallel.launch.Children``): spawned,
joined in one process group when there are decode workers, heard from and stopped by it; each
runs the loop of ``serving.disagg_worker``.

Failure. Every wait has a timeout (``DisaggConfig.timeout``). A worker that raises reports its
traceback and exits; the router then stops every worker and raises ``WorkerError`` naming it (a
``RankError``, as ``launch`` raises: one kind to catch). Workers exit when told, when the
router's process is gone, and are terminated if they do not stop in time: no orphaned process.
A request that could never fit a worker's pool (or the context) ends at once with
``finish_reason == "error"`` naming the limit; the others are served.
"""

from __future__ import annotations

import time
import weakref
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from ..core.checkpoints import read_config, resolve
from ..core.config import ModelConfig
from ..measure.metrics import RequestMetrics
from ..parallel.launch import Children, RankError, check_world_size, default_backend
from .disagg_worker import WorkerSpec, worker_main
from .engine import Engine, EngineConfig, RequestOutput, SimulatedModel
from .handoff import DecodeEngine, PrefillEngine
from .routing import ROLES, Router
from .step_cost import StepCost, StepRecord
from .workload import Request, copy_requests, number_requests


class WorkerError(RankError):
    """A worker process failed (raised, died or stopped answering); the message names it."""


@dataclass(frozen=True)
class DisaggConfig:
    """How the workers are made: each prefill/colocated worker's engine (``prefill``) and each
    decode worker's (``decode``), the model's dtype, threads per worker, and the timeout in
    seconds of every wait (a start, a message, a transfer, a shutdown)."""

    prefill: EngineConfig = field(default_factory=lambda: EngineConfig(num_blocks=256))
    decode: EngineConfig = field(default_factory=lambda: EngineConfig(num_blocks=256))
    dtype: str = "float32"
    threads: int = 1  # torch threads in each worker
    timeout: float = 120.0  # seconds
    backend: str | None = None  # torch.distributed backend; None: gloo (nccl with a GPU per worker)
    device: str = "cpu"
    return_kv: bool = False  # tests and teaching: each output carries the K/V its decode worker received
    fault: tuple[str, int] | None = None  # tests: (role, n): that worker raises at its n-th step

    def __post_init__(self) -> None:
        for name in ("prefill", "decode"):
            c = getattr(self, name)
            if not isinstance(c, EngineConfig):
                raise ValueError(f"{name} must be an EngineConfig, got {type(c).__name__}")
            if c.step_cost is not None:
                raise ValueError(f"{name}: worker processes run on the wall clock; give no step_cost")
            if c.scheduler.policy != "continuous":
                raise ValueError(f"{name}: workers batch continuously, got policy {c.scheduler.policy!r}")
        if not hasattr(torch, self.dtype) or not isinstance(getattr(torch, self.dtype), torch.dtype):
            raise ValueError(f"dtype must name a torch dtype (e.g. 'float32', 'bfloat16'), got {self.dtype!r}")
        if isinstance(self.threads, bool) or not isinstance(self.threads, int) or self.threads < 1:
            raise ValueError(f"threads must be a positive integer, got {self.threads!r}")
        if not self.timeout > 0:
            raise ValueError(f"timeout must be positive seconds, got {self.timeout!r}")
        if self.fault is not None and (self.fault[0] not in ROLES or self.fault[1] < 1):
            raise ValueError(f"fault must be (one of {ROLES}, a step >= 1), got {self.fault!r}")


@dataclass
class DisaggOutput(RequestOutput):
    """A request's output with where it ran and what its KV handoff cost."""

    prefill_worker: int | None = None  # rank of the prefill (or colocated) worker
    decode_worker: int | None = None  # rank of the decode worker; None if it ended at its first token
    kv_bytes: int = 0  # bytes of K/V sent from the prefill to the decode worker
    transfer_s: float = 0.0  # seconds the decode worker spent receiving them
    handoff_wait_s: float = 0.0  # seconds from the first token until the decode worker took it in
    received_kv: torch.Tensor | None = None  # with DisaggConfig.return_kv: (2, layers, prompt, kv heads, head dim)


# ---------------------------------------------------------------------------------------------
# The router


class _ProcessCluster:
    """Spawn workers of the given roles, route requests to them, collect outputs, stop them."""

    def __init__(self, model_name_or_path, roles: Sequence[str], config: DisaggConfig | None):
        self.config = config or DisaggConfig()
        self.roles = list(roles)
        self.model_dir = str(resolve(model_name_or_path))  # a bad name fails here, before any process
        self.model_config = read_config(Path(self.model_dir))[0]
        self._closed = False
        self.step_logs: dict[int, list[StepRecord]] = {}
        self._start()

    # -- processes -----------------------------------------------------------------------------

    def _start(self) -> None:
        c, roles = self.config, self.roles
        self.workers = Children(
            len(roles),
            backend=c.backend or default_backend(c.device, len(roles)),
            timeout=c.timeout,
            threads=c.threads,
            group="decode" in roles,  # the K/V go over torch.distributed
            name=lambda rank: f"{roles[rank]} worker {rank}",
            error=WorkerError,
            farewell=("stop",),
        )
        self._finalizer = weakref.finalize(self, self.workers.close)
        self.outbox = self.workers.reports
        self.inboxes = [self.workers.queue() for _ in roles]
        for rank, role in enumerate(roles):
            spec = WorkerSpec(role, self.model_dir, c.dtype, c.device, c.timeout, c.fault)
            self.workers.start(worker_main, spec, self.inboxes[rank], self.outbox, self.inboxes)
        ready: set[int] = set()
        while len(ready) < len(roles):
            message = self._receive("starting")
            if message[0] != "ready":
                self._unexpected(message)
            ready.add(message[1])

    def _receive(self, doing: str):
        """The next message from a worker, or WorkerError when one failed or none came in time."""
        message = self.workers.receive(self.config.timeout, doing)
        if message is None:
            self.close()
            raise WorkerError(f"no word from the workers for {self.config.timeout} s while {doing}")
        return message

    def _unexpected(self, message) -> None:
        self.close()
        raise WorkerError(f"unexpected message {message[0]!r} from worker {message[1]}")

    def close(self) -> None:
        """Stop every worker (told, then terminated if it does not stop in time) and reap it."""
        if not self._closed:
            self._closed = True
            self._finalizer()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def alive(self) -> int:
        return self.workers.alive

    # -- a run ---------------------------------------------------------------------------------

    def run(self, requests: Iterable[Request], config: DisaggConfig | None = None) -> list[DisaggOutput]:
        """Serve ``requests`` (arrivals in seconds from the start of the run); outputs in the order given.
        ``config``: the worker engines' configs (``prefill``, ``decode``) and ``return_kv`` for this run
        only, e.g. another token budget; its other fields (dtype, threads, timeout, ...) are the engine's own."""
        if self._closed:
            raise RuntimeError("this engine was closed")
        run_config = self.config
        if config is not None:
            run_config = replace(run_config, prefill=config.prefill, decode=config.decode, return_kv=config.return_kv)
        self._checkers = {role: _checker(role, self.model_config, run_config) for role in set(self.roles)}
        requests = number_requests(copy_requests(list(requests)))
        outputs: dict[int, DisaggOutput] = {r.id: o for r in requests if (o := self._reject(r)) is not None}
        todo = deque(sorted((r for r in requests if r.id not in outputs), key=lambda r: (r.arrival, r.id)))
        self.router = Router(self.roles)
        try:
            self._serve(todo, outputs, run_config)
            self.step_logs = self._logs()
        except BaseException:  # an error, a timeout, an interrupt: no worker is left behind
            self.close()
            raise
        return [outputs[r.id] for r in requests]

    def _serve(self, todo: deque, outputs: dict, run_config: DisaggConfig) -> None:
        """Release each request at its arrival, collect the workers' messages until all are served."""
        left = {r.id: r for r in todo}
        where: dict[int, dict] = {rid: {} for rid in left}  # what DisaggOutput adds, per request
        t0 = time.perf_counter()
        for inbox in self.inboxes:
            inbox.put(("start", t0, run_config.prefill, run_config.decode, run_config.return_kv))
        heard = time.monotonic()
        while left:
            now = time.perf_counter() - t0
            while todo and todo[0].arrival <= now:
                self._dispatch(todo.popleft(), where)
            wait = todo[0].arrival - now if todo else 0.5
            message = self.workers.receive(min(wait, 0.5), "serving") if wait > 0 else None
            if message is None:
                if not todo and time.monotonic() - heard > self.config.timeout:
                    raise WorkerError(
                        f"no word from the workers for {self.config.timeout} s with {len(left)} request(s) "
                        f"unserved (the first: {next(iter(left))})"
                    )
                continue
            heard = time.monotonic()
            kind = message[0]
            if kind == "prefilled":
                _, _, rid, nbytes = message
                # Two workers' messages share no order: the decode worker's output may come first,
                # and then the router has unloaded the request already (and "admitted" gave its bytes).
                if rid in self.router.placed:
                    self.router.prefilled(rid)
                    where[rid]["kv_bytes"] = nbytes
            elif kind == "admitted":
                where[message[2]].update(message[3])
            elif kind == "output":
                out: RequestOutput = message[2]
                r, place = left.pop(out.request.id), where[out.request.id]
                self.router.finished(r.id)
                if place["decode_worker"] is not None and "transfer_s" not in place:  # ended at its first token
                    place.update(decode_worker=None, kv_bytes=0)
                outputs[r.id] = DisaggOutput(
                    r, out.tokens, out.metrics, out.preemptions, out.finish_reason, out.error, **place
                )
            else:
                self._unexpected(message)

    def _dispatch(self, r: Request, where: dict) -> None:
        """Place an arrival by the one load rule (``Router.route``) and send it to its prefill worker."""
        place = self.router.route(r)
        where[r.id].update(prefill_worker=place.prefill_worker, decode_worker=place.decode_worker)
        self.inboxes[place.prefill_worker].put(("request", r, place.decode_worker))

    def _logs(self) -> dict[int, list[StepRecord]]:
        for inbox in self.inboxes:
            inbox.put(("report",))
        logs: dict[int, list[StepRecord]] = {}
        while len(logs) < len(self.roles):
            message = self._receive("reporting")
            if message[0] != "log":
                self._unexpected(message)
            logs[message[1]] = message[2]
        return logs

    def _reject(self, r: Request) -> DisaggOutput | None:
        """An error output for a request a worker could not serve (checked before the run starts,
        by the same checks as the workers' engines: fields, context, vocabulary, pool size)."""
        try:
            for role, checker in self._checkers.items():
                try:
                    checker.check(r)
                except ValueError as e:
                    raise type(e)(f"{e} ({role} worker)") from None
        except ValueError as e:
            metrics = RequestMetrics(r.arrival, [], len(r.prompt))
            return DisaggOutput(r, [], metrics, 0, "error", f"{type(e).__name__}: {e}")
        return None


def _checker(role: str, config: ModelConfig, disagg: DisaggConfig) -> Engine:
    """An engine of the role's kind over a stand-in model, whose ``check`` is the worker's own."""
    engine_config = disagg.decode if role == "decode" else disagg.prefill
    kind = {"prefill": PrefillEngine, "decode": DecodeEngine, "colocated": Engine}[role]
    cheap = EngineConfig(engine_config.num_blocks, engine_config.block_size, False, engine_config.scheduler, StepCost())
    return kind(SimulatedModel(config), cheap)


class DisaggregatedEngine(_ProcessCluster):
    """``prefill_workers`` prefill processes and ``decode_workers`` decode processes behind a router;
    ``run(requests) -> outputs`` like ``Engine.run``. Use it as a context manager (or ``close()``)."""

    def __init__(self, model_name_or_path, prefill_workers: int = 1, decode_workers: int = 1, config=None):
        check_world_size(prefill_workers, "prefill_workers")
        check_world_size(decode_workers, "decode_workers")
        self.prefill_workers, self.decode_workers = prefill_workers, decode_workers
        super().__init__(model_name_or_path, ["prefill"] * prefill_workers + ["decode"] * decode_workers, config)


class ReplicatedEngine(_ProcessCluster):
    """``replicas`` colocated worker processes (each an ``Engine`` running prefill and decode
    together, configured by ``config.prefill``) behind the same router: the baseline."""

    def __init__(self, model_name_or_path, replicas: int = 1, config=None):
        check_world_size(replicas, "replicas")
        self.replicas = replicas
        super().__init__(model_name_or_path, ["colocated"] * replicas, config)
