"""A disaggregated-serving worker process (chapter 14): the loop each prefill, decode or colocated
worker of ``serving.disagg`` runs, a child of the launcher in ``parallel.launch``.

    Children(...).start(worker_main, WorkerSpec("decode", model_dir), inbox, outbox, inboxes)

``worker_main`` loads the model (the launcher has set its threads and, with decode workers,
joined the process group) and serves runs until told to stop. Messages in, from the router:
("start", t0, prefill EngineConfig, decode EngineConfig, return_kv), ("request", request, decode
rank), ("report",), ("stop",); and, on a decode worker, ("handoff", handoff, source rank, t0)
from a prefill worker, whose K/V follow over ``torch.distributed``. Messages out, on the
launcher's report queue: ("ready", rank), ("prefilled", rank, request id, bytes), ("admitted",
rank, request id, figures), ("output", rank, RequestOutput, None), ("log", rank, step records).
"""

from __future__ import annotations

import queue
import time
from collections import deque
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ..measure.metrics import RequestMetrics
from ..parallel.launch import rank_device
from .engine import Engine, EngineConfig, RequestOutput
from .handoff import DecodeEngine, Handoff, PrefillEngine
from .workload import Request


@dataclass(frozen=True)
class WorkerSpec:
    """How one worker is made: its role, the checkpoint, the dtype and device, the timeout in
    seconds of its waits, and (tests) a fault to inject."""

    role: str  # "prefill", "decode" or "colocated"
    model_dir: str
    dtype: str = "float32"
    device: str = "cpu"  # "cuda": rank i on GPU i mod count
    timeout: float = 120.0
    fault: tuple[str, int] | None = None  # (role, n): a worker of that role raises at its n-th step


def worker_main(rank: int, world_size: int, spec: WorkerSpec, inbox, outbox, inboxes) -> None:
    """A worker's life inside ``child_main``: load the model, say it is ready, serve until told to stop."""
    from ..core.checkpoints import load

    device = rank_device(spec.device, rank)
    model, _ = load(spec.model_dir, device, getattr(torch, spec.dtype))
    nccl = dist.is_initialized() and dist.get_backend() == "nccl"
    outbox.put(("ready", rank))
    Worker(rank, spec, model, inbox, outbox, inboxes, device if nccl else "cpu").serve()  # gloo sends CPU tensors


class Worker:
    """The loop inside a worker process: messages in, engine steps, handoffs and outputs out."""

    IDLE_WAIT = 0.5  # seconds an idle worker blocks on its inbox before checking on the router

    def __init__(self, rank: int, spec: WorkerSpec, model, inbox, outbox, inboxes, wire="cpu"):
        self.rank, self.spec, self.model = rank, spec, model
        self.inbox, self.outbox, self.inboxes = inbox, outbox, inboxes  # its own, the router's, every worker's
        self.wire = wire  # where the K/V travel from: the GPU with nccl, host memory with gloo
        self.engine: Engine | None = None
        self.configs = {"prefill": EngineConfig(), "decode": EngineConfig()}  # this run's engines'
        self.return_kv = False  # this run's outputs carry the K/V received
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
        role, c = self.spec.role, self.configs
        if role == "prefill":
            return PrefillEngine(self.model, c["prefill"])
        if role == "decode":
            return DecodeEngine(self.model, c["decode"])
        return Engine(self.model, c["prefill"])

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
        if kind == "start":  # a new run: the common clock origin, the engines' configs, a fresh engine
            self.finish_sends()
            _, self.t0, prefill, decode, self.return_kv = message
            self.configs, self.steps = {"prefill": prefill, "decode": decode}, 0
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
            self.outbox.put(("log", self.rank, list(self.engine.step_log)))
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
            if self.spec.fault == (self.spec.role, self.steps):
                raise RuntimeError(f"injected fault in {self.spec.role} worker {self.rank} at step {self.steps}")
            e.now = max(e.now, self.clock())
            for out in e.step():
                self.outbox.put(("output", self.rank, out, None))
        if self.spec.role == "prefill":
            self.send_handoffs()
        self.sends = [(w, t) for w, t in self.sends if not w.is_completed()]

    def fail(self, request: Request, error: Exception) -> None:
        metrics = RequestMetrics(request.arrival, [], len(request.prompt))
        out = RequestOutput(request, [], metrics, 0, "error", f"{type(error).__name__}: {error}")
        self.outbox.put(("output", self.rank, out, None))

    # -- prefill side --------------------------------------------------------------------------

    def send_handoffs(self) -> None:
        """Post each new handoff's K/V to its decode worker, then tell that worker."""
        for h in self.engine.take_handoffs():
            rid = h.request.id
            dst = self.decoder_of.pop(rid)
            kv = h.kv.to(self.wire).contiguous()
            self.sends.append((dist.isend(kv, dst, tag=rid), kv))
            self.outbox.put(("prefilled", self.rank, rid, h.nbytes))  # before the decode worker can answer
            self.inboxes[dst].put(("handoff", h.without_kv(), self.rank, self.t0))

    def finish_sends(self) -> None:
        for w, _ in self.sends:
            w.wait(timedelta(seconds=self.spec.timeout))
        self.sends.clear()

    # -- decode side ---------------------------------------------------------------------------

    def take_handoffs(self) -> None:
        """Receive and take in the waiting handoffs that fit, in arrival order
        (a full pool waits)."""
        e = self.engine
        while self.waiting and e.can_admit(self.waiting[0][0]):
            h, src = self.waiting.popleft()
            L, H, D = e.pool.k.shape[0], e.pool.k.shape[3], e.pool.k.shape[4]
            kv = torch.empty(2, L, h.tokens, H, D, dtype=e.pool.k.dtype, device=self.wire)
            start = self.clock()
            dist.irecv(kv, src, tag=h.request.id).wait(timedelta(seconds=self.spec.timeout))
            now = self.clock()
            e.now = max(e.now, now)
            h.ready = now
            try:
                e.admit(h, kv)
            except ValueError as error:
                self.fail(h.request, error)
                continue
            extra = {"kv_bytes": kv.nbytes, "transfer_s": now - start, "handoff_wait_s": now - h.first_time}
            if self.return_kv:
                extra["received_kv"] = kv.cpu()
            self.outbox.put(("admitted", self.rank, h.request.id, extra))
