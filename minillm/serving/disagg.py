"""Prefill/decode disaggregation with real worker processes (chapter 14; DistServe, Zhong et al.,
2024; Splitwise, Patel et al., 2024; Mooncake, Qin et al., 2025).

    with DisaggregatedEngine("minillm-target", prefill_workers=1, decode_workers=1) as engine:
        outputs = engine.run(requests)     # one DisaggOutput per request, in the given order

Each worker is an OS process (``torch.multiprocessing``, spawned) with its own copy of the model
and its own paged KV pool. The router (this process) releases each request at its arrival time
to the prefill worker with the least prompt work outstanding and names the decode worker with
the least decode work outstanding. The prefill worker (a ``PrefillEngine``: chapter 13's engine,
continuous batching) runs the prompt, samples the first token and posts the request's K/V, all
layers, as one tensor with ``torch.distributed.isend`` (gloo on the CPU; nccl between GPUs)
straight to that decode worker, with a small message saying it is there. The decode worker (a
``DecodeEngine``) takes it in when its pool has room for the whole request (backpressure: it
waits, nothing is dropped or preempted), receives the tensor into new blocks and decodes it with
its running batch. Outputs come back to the router. ``ReplicatedEngine`` runs the same machinery
with N colocated workers (each an ``Engine`` doing both phases): the baseline on the same cores.

Clock. Every process reads ``time.perf_counter`` (one monotonic clock per machine) from a common
origin sent at the start of each run, so TTFT (queueing and prefill on the prefill worker) and
the gaps between tokens (the first of which includes the transfer and any wait for room on the
decode side) are measured across processes.

Failure. Every wait has a timeout (``DisaggConfig.timeout``). A worker that raises reports its
traceback and exits; the router then stops every worker and raises ``WorkerError`` naming it.
Workers exit when told, when the router's process is gone, and are terminated if they do not
stop in time: no orphaned process. A request that could never fit a worker's pool (or the
context) ends at once with ``finish_reason == "error"`` naming the limit; the others are served.
"""

from __future__ import annotations

import contextlib
import os
import queue
import tempfile
import time
import traceback
import weakref
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path

import torch

from ..core.checkpoints import read_config, resolve
from ..core.config import ModelConfig
from ..core.processes import reap
from ..measure.metrics import RequestMetrics
from .engine import Engine, EngineConfig, RequestOutput, SimulatedModel
from .handoff import DecodeEngine, Handoff, PrefillEngine
from .step_cost import StepCost, StepRecord
from .workload import Request, copy_requests, number_requests

ROLES = ("prefill", "decode", "colocated")


class WorkerError(RuntimeError):
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
# The worker process


@dataclass(frozen=True)
class _WorkerSpec:
    rank: int
    role: str
    model_dir: str
    config: DisaggConfig
    world_size: int
    init_file: str | None  # torch.distributed file:// rendezvous; None: no process group


def _worker_main(spec: _WorkerSpec, inbox, outbox, inboxes) -> None:
    """A worker's whole life: load, join the process group, serve runs until told to stop."""
    group = False
    try:
        torch.set_num_threads(spec.config.threads)
        from ..core.checkpoints import load

        device = worker_device(spec.config.device, spec.rank)
        model, _ = load(spec.model_dir, device, getattr(torch, spec.config.dtype))
        wire = "cpu"
        if spec.init_file is not None:
            backend = _join_group(spec)
            group = True
            wire = device if backend == "nccl" else "cpu"  # gloo sends CPU tensors
        outbox.put(("ready", spec.rank))
        _Worker(spec, model, inbox, outbox, inboxes, wire).serve()
    except BaseException:  # reported to the router, which stops everyone
        with contextlib.suppress(Exception):
            outbox.put(("error", spec.rank, spec.role, traceback.format_exc()), timeout=spec.config.timeout)
    finally:
        if group:
            torch.distributed.destroy_process_group()


def worker_device(device: str, rank: int) -> str:
    """ "cuda" spreads the workers over the GPUs (rank i on GPU i mod count); anything else as given."""
    if device == "cuda" and torch.cuda.is_available():
        index = rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return f"cuda:{index}"
    return device


def _join_group(spec: _WorkerSpec) -> str:
    """Join the workers' process group; returns its backend: nccl when every worker has a GPU of
    its own, else gloo (which moves the K/V through host memory)."""
    c = spec.config
    own_gpu = c.device.startswith("cuda") and torch.cuda.device_count() >= spec.world_size
    backend = c.backend or ("nccl" if own_gpu else "gloo")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # every rank is on this machine
    torch.distributed.init_process_group(
        backend,
        init_method=f"file://{spec.init_file}",
        rank=spec.rank,
        world_size=spec.world_size,
        timeout=timedelta(seconds=c.timeout),
    )
    return backend


class _Worker:
    """The loop inside a worker process: messages in, engine steps, handoffs and outputs out."""

    IDLE_WAIT = 0.5  # seconds an idle worker blocks on its inbox before checking on the router

    def __init__(self, spec: _WorkerSpec, model, inbox, outbox, inboxes, wire: str = "cpu"):
        self.spec, self.model, self.inbox, self.outbox, self.inboxes = spec, model, inbox, outbox, inboxes
        self.wire = wire  # where the K/V travel from: the GPU with nccl, host memory with gloo
        self.engine: Engine | None = None
        self.run_config = spec.config
        self.t0 = time.perf_counter()
        self.decoder_of: dict[int, int] = {}  # prefill: request id -> decode rank
        self.sends: list[tuple[object, torch.Tensor]] = []  # prefill: (isend work, tensor) in flight
        self.waiting: deque[tuple[Handoff, int]] = deque()  # decode: (handoff, source rank) not yet taken in
        # decode: handoffs of a run whose "start" has not arrived yet. The router's "start" and a
        # prefill worker's "handoff" reach this inbox from two processes, in either order.
        self.early: list[tuple[float, Handoff, int]] = []  # (run's t0, handoff, source rank)
        self.steps = 0

    def clock(self) -> float:
        return time.perf_counter() - self.t0

    def new_engine(self) -> Engine:
        role, c = self.spec.role, self.run_config
        if role == "prefill":
            return PrefillEngine(self.model, c.prefill)
        if role == "decode":
            return DecodeEngine(self.model, c.decode)
        return Engine(self.model, c.prefill)

    def serve(self) -> None:
        import multiprocessing

        parent = multiprocessing.parent_process()
        while True:
            busy = self.runnable() or bool(self.sends)
            try:
                message = self.inbox.get(timeout=0 if busy else self.IDLE_WAIT)
            except queue.Empty:
                message = None
            if message is not None:
                if message[0] == "stop":
                    self.finish_sends()
                    return
                self.handle(message)
                continue  # take every waiting message before the next step
            if parent is not None and not parent.is_alive():
                return  # the router is gone: nobody to serve
            if self.engine is not None:
                self.work()

    def handle(self, message: tuple) -> None:
        kind = message[0]
        if kind == "start":  # a new run: a fresh engine, the common clock origin
            self.finish_sends()
            self.t0, self.run_config, self.steps = message[1], message[2], 0
            self.engine = self.new_engine()
            self.decoder_of.clear()
            self.waiting = deque((h, src) for run, h, src in self.early if run == self.t0)
            self.early.clear()
        elif kind == "request":  # prefill or colocated: (request, decode rank)
            _, request, decoder = message
            self.decoder_of[request.id] = decoder
            try:
                self.engine.add_request(request)
            except ValueError as e:  # the router checks first; should one slip through, it fails alone
                self.fail(request, e)
        elif kind == "handoff":  # decode: a prefilled request whose K/V wait at the source rank
            _, handoff, source, run = message
            if run == self.t0:
                self.waiting.append((handoff, source))
            else:  # its run's "start" is still on its way: keep it for that run
                self.early.append((run, handoff, source))
        elif kind == "report":  # the run is over: send the step log
            self.outbox.put(("log", self.spec.rank, self.spec.role, list(self.engine.step_log)))
        else:
            raise ValueError(f"unknown message {kind!r}")

    def runnable(self) -> bool:
        e = self.engine
        if e is None:
            return False
        return e.unfinished or bool(self.waiting)

    def work(self) -> None:
        e = self.engine
        if self.spec.role == "decode":
            self.take_handoffs()
        arrival = e.next_arrival
        if e.scheduler.waiting or e.scheduler.running or (arrival is not None and arrival <= self.clock()):
            self.steps += 1
            fault = self.spec.config.fault
            if fault is not None and fault == (self.spec.role, self.steps):
                raise RuntimeError(f"injected fault in {self.spec.role} worker {self.spec.rank} at step {self.steps}")
            e.now = max(e.now, self.clock())
            for out in e.step():
                self.outbox.put(("output", self.spec.rank, out, None))
        if self.spec.role == "prefill":
            self.send_handoffs()
        self.sends = [(w, t) for w, t in self.sends if not w.is_completed()]

    def fail(self, request: Request, error: Exception) -> None:
        metrics = RequestMetrics(request.arrival, [], len(request.prompt))
        out = RequestOutput(request, [], metrics, 0, "error", f"{type(error).__name__}: {error}")
        self.outbox.put(("output", self.spec.rank, out, None))

    # -- prefill side --------------------------------------------------------------------------

    def send_handoffs(self) -> None:
        """Post each new handoff's K/V to its decode worker, then tell that worker it is there."""
        for h in self.engine.take_handoffs():
            rid = h.request.id
            dst = self.decoder_of.pop(rid)
            kv = h.kv.to(self.wire).contiguous()
            self.sends.append((torch.distributed.isend(kv, dst, tag=rid), kv))
            self.inboxes[dst].put(("handoff", h.without_kv(), self.spec.rank, self.t0))
            self.outbox.put(("prefilled", self.spec.rank, rid, h.nbytes))

    def finish_sends(self) -> None:
        for w, _ in self.sends:
            w.wait(timedelta(seconds=self.spec.config.timeout))
        self.sends.clear()

    # -- decode side ---------------------------------------------------------------------------

    def take_handoffs(self) -> None:
        """Receive and take in the waiting handoffs that fit, in arrival order (a full pool waits)."""
        e = self.engine
        while self.waiting and e.can_admit(self.waiting[0][0]):
            h, src = self.waiting.popleft()
            L, H, D = e.pool.k.shape[0], e.pool.k.shape[3], e.pool.k.shape[4]
            kv = torch.empty(2, L, h.tokens, H, D, dtype=e.pool.k.dtype, device=self.wire)
            start = self.clock()
            torch.distributed.irecv(kv, src, tag=h.request.id).wait(timedelta(seconds=self.spec.config.timeout))
            now = self.clock()
            e.now = max(e.now, now)
            h.ready = now
            try:
                e.admit(h, kv)
            except ValueError as error:
                self.fail(h.request, error)
                continue
            extra = {"kv_bytes": kv.nbytes, "transfer_s": now - start, "handoff_wait_s": now - h.first_time}
            if self.run_config.return_kv:
                extra["received_kv"] = kv.cpu()
            self.outbox.put(("admitted", self.spec.rank, h.request.id, extra))


# ---------------------------------------------------------------------------------------------
# The router


class _Cluster:
    """Spawn workers of the given roles, route requests to them, collect outputs, stop them."""

    def __init__(self, model_name_or_path, roles: Sequence[str], config: DisaggConfig | None):
        self.config = config or DisaggConfig()
        self.roles = list(roles)
        self.model_dir = str(resolve(model_name_or_path))  # a bad name fails here, before any process
        self.model_config = read_config(Path(self.model_dir))[0]
        self._procs: list = []
        self._closed = False
        self.step_logs: dict[int, list[StepRecord]] = {}
        self._start()

    # -- processes -----------------------------------------------------------------------------

    def _start(self) -> None:
        ctx = torch.multiprocessing.get_context("spawn")
        needs_group = "decode" in self.roles
        self._tmp = tempfile.TemporaryDirectory(prefix="minillm-disagg-")
        init_file = str(Path(self._tmp.name) / "rendezvous") if needs_group else None
        self.outbox = ctx.Queue()
        self.inboxes = [ctx.Queue() for _ in self.roles]
        for rank, role in enumerate(self.roles):
            spec = _WorkerSpec(rank, role, self.model_dir, self.config, len(self.roles), init_file)
            proc = ctx.Process(
                target=_worker_main, args=(spec, self.inboxes[rank], self.outbox, self.inboxes), daemon=True
            )
            proc.start()
            self._procs.append(proc)
        self._finalizer = weakref.finalize(self, _stop_processes, self._procs, self.inboxes, self.config.timeout)
        ready: set[int] = set()
        while len(ready) < len(self.roles):
            message = self._receive("starting")
            if message[0] == "ready":
                ready.add(message[1])
            else:
                self._unexpected(message)

    def _receive(self, doing: str):
        """The next message from a worker, or WorkerError when one failed or none came in time."""
        deadline = time.monotonic() + self.config.timeout
        while (message := self._poll(min(0.5, max(0.0, deadline - time.monotonic())), doing)) is None:
            if time.monotonic() > deadline:
                self.close()
                raise WorkerError(f"no word from the workers for {self.config.timeout} s while {doing}")
        return message

    def _poll(self, seconds: float, doing: str):
        """A worker's message within ``seconds``, else None; WorkerError (every worker stopped) when
        a worker reports a failure or has exited."""
        try:
            message = self.outbox.get(timeout=seconds)
        except queue.Empty:
            message = None
        if message is not None and message[0] == "error":
            _, rank, role, text = message
            self.close()
            raise WorkerError(f"{role} worker {rank} failed while {doing}:\n{text}")
        if message is None:
            dead = [(i, p.exitcode) for i, p in enumerate(self._procs) if not p.is_alive()]
            if dead:
                self.close()
                raise WorkerError(f"worker(s) {dead} (rank, exit code) exited while {doing}")
        return message

    def _unexpected(self, message) -> None:
        self.close()
        raise WorkerError(f"unexpected message {message[0]!r} from worker {message[1]}")

    def close(self) -> None:
        """Stop every worker (told, then terminated if it does not stop in time) and reap it."""
        if not self._closed:
            self._closed = True
            self._finalizer()
            self._tmp.cleanup()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def alive(self) -> int:
        return sum(p.is_alive() for p in self._procs)

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
        left = {r.id: r for r in todo}
        self.load = [0] * len(self.roles)  # outstanding tokens per worker
        where: dict[int, dict] = {rid: {} for rid in left}
        try:
            self._serve(todo, left, where, outputs, run_config)
            self.step_logs = self._logs()
        except BaseException:  # an error, a timeout, an interrupt: no worker is left behind
            self.close()
            raise
        return [outputs[r.id] for r in requests]

    def _serve(self, todo: deque, left: dict, where: dict, outputs: dict, run_config: DisaggConfig) -> None:
        """Release each request at its arrival, collect the workers' messages until all are served."""
        t0 = time.perf_counter()
        for inbox in self.inboxes:
            inbox.put(("start", t0, run_config))
        heard = time.monotonic()
        while left:
            now = time.perf_counter() - t0
            while todo and todo[0].arrival <= now:
                self._dispatch(todo.popleft(), where)
            wait = todo[0].arrival - now if todo else 0.5
            message = self._poll(min(wait, 0.5), "serving") if wait > 0 else None
            if message is None:
                if not todo and time.monotonic() - heard > self.config.timeout:
                    raise WorkerError(
                        f"no word from the workers for {self.config.timeout} s with {len(left)} request(s) "
                        f"unserved (the first: {next(iter(left))})"
                    )
                continue
            heard = time.monotonic()
            kind, rank = message[0], message[1]
            if kind == "prefilled":
                rid, nbytes = message[2], message[3]
                self.load[rank] -= len(left[rid].prompt)
                where[rid]["kv_bytes"] = nbytes
            elif kind == "admitted":
                where[message[2]].update(message[3])
            elif kind == "output":
                out: RequestOutput = message[2]
                rid = out.request.id
                r = left.pop(rid)
                self._unload(r, where[rid])
                outputs[rid] = DisaggOutput(
                    r, out.tokens, out.metrics, out.preemptions, out.finish_reason, out.error, **where[rid]
                )
            else:
                self._unexpected(message)

    def _logs(self) -> dict[int, list[StepRecord]]:
        for inbox in self.inboxes:
            inbox.put(("report",))
        logs: dict[int, list[StepRecord]] = {}
        while len(logs) < len(self.roles):
            message = self._receive("reporting")
            if message[0] != "log":
                self._unexpected(message)
            logs[message[1]] = message[3]
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

    def _dispatch(self, r: Request, where: dict) -> None:
        """Least outstanding work: prompt tokens for a prefill worker, tokens to generate for a decoder."""
        firsts = [i for i, role in enumerate(self.roles) if role in ("prefill", "colocated")]
        first = min(firsts, key=lambda i: self.load[i])
        decoders = [i for i, role in enumerate(self.roles) if role == "decode"]
        decoder = min(decoders, key=lambda i: self.load[i]) if decoders else None
        if self.roles[first] == "colocated":
            self.load[first] += len(r.prompt) + r.max_tokens
        else:
            self.load[first] += len(r.prompt)
            self.load[decoder] += r.max_tokens
        where[r.id].update(prefill_worker=first, decode_worker=decoder)
        self.inboxes[first].put(("request", r, decoder))

    def _unload(self, r: Request, place: dict) -> None:
        first, decoder = place.get("prefill_worker"), place.get("decode_worker")
        if self.roles[first] == "colocated":
            self.load[first] -= len(r.prompt) + r.max_tokens
        else:
            if "kv_bytes" not in place:  # it failed before its prefill was done
                self.load[first] -= len(r.prompt)
            self.load[decoder] -= r.max_tokens
            if "transfer_s" not in place:  # ended at its first token: no handoff was taken in
                place["decode_worker"] = None
                place["kv_bytes"] = 0


def _checker(role: str, config: ModelConfig, disagg: DisaggConfig) -> Engine:
    """An engine of the role's kind over a stand-in model, whose ``check`` is the worker's own."""
    engine_config = disagg.decode if role == "decode" else disagg.prefill
    kind = {"prefill": PrefillEngine, "decode": DecodeEngine, "colocated": Engine}[role]
    cheap = EngineConfig(engine_config.num_blocks, engine_config.block_size, False, engine_config.scheduler, StepCost())
    return kind(SimulatedModel(config), cheap)


def _stop_processes(procs, inboxes, timeout: float) -> None:
    """Ask every worker to stop, wait a bounded time, then terminate and kill what is left."""
    for proc, inbox in zip(procs, inboxes):
        if proc.is_alive():
            with contextlib.suppress(Exception):
                inbox.put(("stop",))
    reap(procs, min(timeout, 10.0))
    for inbox in inboxes:
        inbox.cancel_join_thread()


class DisaggregatedEngine(_Cluster):
    """``prefill_workers`` prefill processes and ``decode_workers`` decode processes behind a router;
    ``run(requests) -> outputs`` like ``Engine.run``. Use it as a context manager (or ``close()``)."""

    def __init__(self, model_name_or_path, prefill_workers: int = 1, decode_workers: int = 1, config=None):
        for name, n in (("prefill_workers", prefill_workers), ("decode_workers", decode_workers)):
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"{name} must be a positive integer, got {n!r}")
        self.prefill_workers, self.decode_workers = prefill_workers, decode_workers
        super().__init__(model_name_or_path, ["prefill"] * prefill_workers + ["decode"] * decode_workers, config)


class ReplicatedEngine(_Cluster):
    """``replicas`` colocated worker processes (each an ``Engine`` running prefill and decode
    together, configured by ``config.prefill``) behind the same router: the baseline."""

    def __init__(self, model_name_or_path, replicas: int = 1, config=None):
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
            raise ValueError(f"replicas must be a positive integer, got {replicas!r}")
        self.replicas = replicas
        super().__init__(model_name_or_path, ["colocated"] * replicas, config)
