"""A cluster of engines on one simulated clock (chapter 14): colocated replicas, or prefill and
decode workers apart, for goodput-vs-rate and P:D-ratio sweeps at sizes no CPU could run.

    cost = roofline_step_cost(preset("Llama-3-8B"), peak_flops=989e12, bandwidth=3.35e12)
    engine = EngineConfig(num_blocks=4096, scheduler=SchedulerConfig(max_batch=64), step_cost=cost)
    cluster = ClusterConfig(prefill=engine, decode=engine, prefill_workers=1, decode_workers=2,
                            transfer_seconds_per_byte=1 / 50e9)
    run = simulate_cluster(preset("Llama-3-8B"), requests, cluster)
    run.outputs  # one RequestOutput per request, in order; metrics on the simulated clock

Every worker is the chapter 13 ``Engine`` over a ``SimulatedModel`` (its real scheduler and block
manager, a ``StepCost`` for a clock): with ``decode_workers == 0`` each of the ``prefill_workers``
is a plain ``Engine`` that prefills and decodes (colocated; with a ``token_budget``, chunked
prefill: Sarathi, Agrawal et al., 2023); otherwise ``PrefillEngine``s hand each prompt's K/V to
``DecodeEngine``s (``serving.handoff``), as in DistServe (Zhong et al., 2024) and Splitwise
(Patel et al., 2024). Each engine keeps its own clock, ``engine.now``.

The event loop is a conservative discrete-event simulation: it always handles the earliest event
of (a) the next request's arrival, which the real workers' router (``serving.routing``: least
outstanding tokens) sends to a prefill worker or replica, naming its decode worker at once when
disaggregated, and (b) each worker's next step, at its clock if it has work, else when its next
request or handoff is due. Ties go to arrivals, then prefill workers, then decode workers.
Nothing is ever handled before an earlier event that could change it: a handoff is made by a
step that began earlier than it can be ready. (The router hears of a step's handoffs and outputs
when the step is handled, at its start; a real router hears at its end.)

A handoff leaves the prefill worker with its first token and is ready on the decode side after
``transfer_latency + nbytes x transfer_seconds_per_byte`` seconds, once the link is free: each
prefill worker has one link, and its transfers go over it one after another, each to the decode
worker the router named; there it waits, in order of readiness, until ``DecodeEngine.can_admit``
finds room (backpressure; the first in line is never overtaken). A request that ends at its first
token (max_tokens 1, a stop id) ends at the prefill.

``roofline_step_cost`` gives the engines a clock for a real model on a real accelerator, from its
shape and the accelerator's datasheet: an estimate, not a measurement.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import count

from ..core.config import ModelConfig
from .engine import Engine, EngineConfig, RequestOutput, RequestTooLargeError, SimulatedModel
from .handoff import DecodeEngine, Handoff, PrefillEngine, kv_handoff_bytes
from .routing import Router
from .step_cost import StepCost
from .workload import Request, copy_requests, number_requests


@dataclass(frozen=True, kw_only=True)
class ClusterConfig:
    """The workers of a simulated cluster and the link between them (keyword arguments only)."""

    prefill: EngineConfig  # each prefill worker's engine (colocated: each replica's); needs a step_cost
    decode: EngineConfig | None = None  # each decode worker's engine; None: the same as prefill's; unused colocated
    prefill_workers: int = 1  # prefill workers, or colocated replicas
    decode_workers: int = 1  # decode workers; 0: colocated (each replica prefills and decodes)
    transfer_seconds_per_byte: float = 0.0  # 1 / the link's bandwidth (B/s)
    transfer_latency: float = 0.0  # seconds per handoff, whatever its size
    kv_bytes_per_token: int | None = None  # the modeled model's K/V per token; None: kv_handoff_bytes(model, 1, 2)

    def __post_init__(self) -> None:
        for name in ("prefill_workers", "decode_workers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        if self.prefill_workers < 1:
            raise ValueError(f"prefill_workers must be at least 1, got {self.prefill_workers}")
        if self.decode_workers < 0:
            raise ValueError(f"decode_workers must be >= 0 (0: colocated), got {self.decode_workers}")
        for name in ("prefill", "decode"):
            value = getattr(self, name)
            if value is None and name == "decode":
                continue
            if not isinstance(value, EngineConfig):
                raise ValueError(f"{name} must be an EngineConfig, got {type(value).__name__}")
            if value.step_cost is None:
                raise ValueError(f"{name}.step_cost is None: a simulated engine needs a StepCost for its clock")
            if value.scheduler.policy != "continuous":
                raise ValueError(f"{name}.scheduler.policy must be 'continuous', got {value.scheduler.policy!r}")
        for name in ("transfer_seconds_per_byte", "transfer_latency"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        kvb = self.kv_bytes_per_token
        if kvb is not None and (isinstance(kvb, bool) or not isinstance(kvb, int) or kvb < 1):
            raise ValueError(f"kv_bytes_per_token must be a positive integer or None, got {kvb!r}")

    @property
    def colocated(self) -> bool:
        return self.decode_workers == 0

    @property
    def decode_config(self) -> EngineConfig:
        return self.prefill if self.decode is None else self.decode


@dataclass
class Transfer:
    """One handoff's trip from a prefill worker to a decode worker, on the simulated clock."""

    request_id: int
    nbytes: int  # the K/V of the prompt, in the modeled model
    seconds: float  # transfer_latency + nbytes x transfer_seconds_per_byte
    sent: float  # the first token's time: the K/V leave
    prefill_worker: int
    decode_worker: int
    admitted: float | None = None  # when the decode worker took it in
    link_wait: float = 0.0  # seconds it waited for the prefill worker's link (earlier transfers on it)

    @property
    def ready(self) -> float:
        return self.sent + self.link_wait + self.seconds

    @property
    def waited(self) -> float:
        """Seconds it was ready but the decode worker had no room (backpressure)."""
        if self.admitted is None:
            raise ValueError(f"request {self.request_id}'s handoff was never admitted")
        return self.admitted - self.ready


@dataclass
class ClusterRun:
    """A finished simulation: outputs in request order, the engines, and each request's transfer."""

    outputs: list[RequestOutput]
    prefill_engines: list[Engine]  # PrefillEngines, or colocated replicas (plain Engines)
    decode_engines: list[DecodeEngine]  # empty when colocated
    transfers: list[Transfer | None]  # per request, in order; None: no handoff (colocated, or done at the prefill)

    @property
    def engines(self) -> list[Engine]:
        return [*self.prefill_engines, *self.decode_engines]

    @property
    def seconds(self) -> float:
        """The simulated time at which the last worker stopped."""
        return max(e.now for e in self.engines)

    def busy_fraction(self) -> dict[str, list[float]]:
        """Each worker's time spent in steps over the run's length. A prefill worker near 1 is the
        bottleneck; a decode worker steps whenever it holds a sequence, so near 1 says only that it
        was never empty (its step log's batch sizes say how full it was)."""
        span = self.seconds or 1.0

        def busy(e: Engine) -> float:
            return sum(r.duration for r in e.step_log) / span

        return {"prefill": [busy(e) for e in self.prefill_engines], "decode": [busy(e) for e in self.decode_engines]}


def simulate_cluster(model_config: ModelConfig, requests: Sequence[Request], cluster: ClusterConfig) -> ClusterRun:
    """Serve copies of ``requests`` on a simulated cluster (``SimulatedModel`` engines, ``StepCost``
    clocks). Every request is checked first (``RequestTooLargeError`` before anything runs);
    requests without an id are numbered as ``Engine.run`` numbers them."""
    return _SimulatedCluster(model_config, cluster).run(number_requests(copy_requests(requests)))


class _SimulatedCluster:
    """The workers, their router and the event loop of one simulation."""

    def __init__(self, model_config: ModelConfig, cluster: ClusterConfig):
        c = self.cluster = cluster
        if c.colocated:
            self.front = [Engine(SimulatedModel(model_config), c.prefill) for _ in range(c.prefill_workers)]
        else:
            kvb = c.kv_bytes_per_token or kv_handoff_bytes(model_config, 1, 2)
            self.front = [
                PrefillEngine(SimulatedModel(model_config), c.prefill, kv_bytes_per_token=kvb)
                for _ in range(c.prefill_workers)
            ]
        self.back = [DecodeEngine(SimulatedModel(model_config), c.decode_config) for _ in range(c.decode_workers)]
        roles = ["colocated"] * len(self.front) if c.colocated else ["prefill"] * len(self.front)
        self.router = Router(roles + ["decode"] * len(self.back))  # decode worker j is the router's len(front) + j
        self.queues: list[list[tuple[float, int, Handoff]]] = [[] for _ in self.back]  # heaps by ready time
        self._order = count()  # ties in a queue: the order handoffs were sent
        self.outputs: dict[int, RequestOutput] = {}
        self.transfers: dict[int, Transfer] = {}
        self.link_free = [0.0] * len(self.front)  # when each prefill worker's link is next free

    def run(self, requests: list[Request]) -> ClusterRun:
        self._check(requests)
        arrivals = sorted(requests, key=lambda r: r.arrival)  # stable: same-time requests in the given order
        k, last = 0, 0.0
        while len(self.outputs) < len(requests):
            events = [(arrivals[k].arrival, 0, 0)] if k < len(arrivals) else []
            events += [(t, 1, i) for i, e in enumerate(self.front) if (t := _front_next(e)) is not None]
            events += [(t, 2, j) for j in range(len(self.back)) if (t := self._back_next(j)) is not None]
            if not events:
                missing = sorted({r.id for r in requests} - set(self.outputs))
                raise RuntimeError(f"the cluster is stuck: no worker can run, requests {missing[:10]} have no output")
            t, kind, i = min(events)
            if t < last:
                raise RuntimeError(f"the simulated clock went back from {last} to {t}")
            last = t
            if kind == 0:
                self._dispatch(arrivals[k])
                k += 1
            elif kind == 1:
                self._step_front(i, t)
            else:
                self._step_back(i, t)
        return ClusterRun(
            [self.outputs[r.id] for r in requests],
            self.front,
            self.back,
            [self.transfers.get(r.id) for r in requests],
        )

    def _check(self, requests: list[Request]) -> None:
        """Every request fits a prefill worker (or replica) and, if it goes on, a decode worker's pool
        (the same model: the rest of ``Engine.check`` holds there too, and validating a long prompt
        again costs more than the simulation of its steps)."""
        for r in requests:
            self.front[0].check(r)
            if self.back and r.max_tokens > 1:
                decode = self.back[0]
                need, have = decode._blocks_needed(r), decode.config.num_blocks
                if need > have:
                    raise RequestTooLargeError(
                        f"request {r.id} needs {need} blocks of {decode.config.block_size} tokens "
                        f"({len(r.prompt) + r.max_tokens} tokens) but a decode worker's KV pool has only {have}"
                    )

    # -- the prefill side ------------------------------------------------------------------------

    def _dispatch(self, request: Request) -> None:
        """Route an arrival as the real router does (``Router.route``)."""
        self.front[self.router.route(request).prefill_worker].add_request(request)

    def _step_front(self, i: int, t: float) -> None:
        engine = self.front[i]
        engine.now = max(engine.now, t)
        steps = engine.steps
        finished = engine.step()
        if engine.steps == steps and not finished:
            raise RuntimeError(f"prefill worker {i} is stuck at t={engine.now}: it has work but ran no step")
        self._finish(finished)
        if not self.cluster.colocated:
            for handoff in engine.take_handoffs():
                place = self.router.prefilled(handoff.request.id)
                self._send(i, handoff, place.decode_worker - len(self.front))

    def _send(self, i: int, handoff: Handoff, j: int) -> None:
        """Put a handoff on its way to decode worker ``j``, the one the router named for it."""
        c, r = self.cluster, handoff.request
        seconds = c.transfer_latency + handoff.nbytes * c.transfer_seconds_per_byte
        start = max(handoff.first_time, self.link_free[i])  # one link per prefill worker: transfers queue on it
        self.link_free[i] = start + seconds
        transfer = Transfer(
            r.id, handoff.nbytes, seconds, handoff.first_time, i, j, link_wait=start - handoff.first_time
        )
        handoff.ready = transfer.ready
        self.transfers[r.id] = transfer
        heapq.heappush(self.queues[j], (handoff.ready, next(self._order), handoff))

    # -- the decode side -------------------------------------------------------------------------

    def _back_next(self, j: int) -> float | None:
        """When decode worker j acts next: now if it has sequences, else when its first handoff is ready."""
        engine, queue = self.back[j], self.queues[j]
        if engine.scheduler.running or engine.scheduler.waiting:
            return engine.now
        return max(engine.now, queue[0][0]) if queue else None

    def _step_back(self, j: int, t: float) -> None:
        """Admit the ready handoffs that fit (in order, none overtaken), then step if there is work."""
        engine, queue = self.back[j], self.queues[j]
        engine.now = max(engine.now, t)
        admitted = 0
        while queue and queue[0][0] <= engine.now and engine.can_admit(queue[0][2]):
            handoff = heapq.heappop(queue)[2]
            engine.admit(handoff)
            self.transfers[handoff.request.id].admitted = engine.now
            admitted += 1
        if not (engine.scheduler.running or engine.scheduler.waiting):
            if not admitted:
                h = queue[0][2]
                raise RuntimeError(
                    f"decode worker {j} is stuck at t={engine.now}: request {h.request.id}'s handoff "
                    f"({engine._blocks_needed(h.request)} blocks) does not fit its empty pool"
                )
            return
        steps = engine.steps
        finished = engine.step()
        if engine.steps == steps and not finished:
            raise RuntimeError(f"decode worker {j} is stuck at t={engine.now}: it has sequences but ran no step")
        self._finish(finished)

    def _finish(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            if out.request.id in self.outputs:
                raise RuntimeError(f"request {out.request.id} finished twice")
            self.outputs[out.request.id] = out
            self.router.finished(out.request.id)


def _front_next(engine: Engine) -> float | None:
    """When a prefill worker or replica steps next: now if it has work, else at its next arrival."""
    if engine.scheduler.running or engine.scheduler.waiting:
        return engine.now
    arrival = engine.next_arrival
    return None if arrival is None else max(engine.now, arrival)


# ---------------------------------------------------------------------------------------------
# A clock for a real model on a real accelerator


def roofline_step_cost(
    config: ModelConfig,
    peak_flops: float,
    bandwidth: float,
    dtype_bytes: float = 2,
    mfu: float = 0.5,
    mbu: float = 0.7,
    context: int = 1024,
    fused: bool = True,
) -> StepCost:
    """A ``StepCost`` for ``config`` on an accelerator of ``peak_flops`` (FLOP/s) and ``bandwidth``
    (bytes/s), from the roofline model (Williams, Waterman & Patterson, 2009). An ESTIMATE from the
    model's shape and a datasheet, not a measurement: the achieved fractions of peak, ``mfu`` and
    ``mbu``, are assumptions (0.5 and 0.7 are typical of good kernels), and so is ``context``.

    - ``fixed``: every forward reads the weights once, P x dtype_bytes / (bandwidth x mbu), where P
      counts the weights a forward multiplies by (all but an untied input embedding table).
    - ``per_prefill_token``: 2P FLOPs per token / (peak_flops x mfu).
    - ``per_token`` (a decode row): the same FLOPs, plus reading that row's K/V at an average
      context of ``context`` tokens, 2 x layers x kv_heads x head_dim x context x dtype_bytes
      / (bandwidth x mbu).

    Left out: attention's own FLOPs (for Llama-3-8B about 3% of a token's at 1k tokens of context),
    activations' bytes, and the overlap of compute with memory traffic (the cost is their sum, not
    their max, so it errs high near the ridge point). ``fused``: a mixed step of decode rows and
    prompt chunks is one forward and pays ``fixed`` once, as in a GPU engine with a variable-length
    attention kernel (``StepCost.fused``); minillm's own engine runs them as two forwards.
    """
    for name, value in (("peak_flops", peak_flops), ("bandwidth", bandwidth), ("dtype_bytes", dtype_bytes)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"{name} must be a positive number, got {value!r}")
    for name, value in (("mfu", mfu), ("mbu", mbu)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
            raise ValueError(f"{name} must be a fraction in (0, 1], got {value!r}")
    if isinstance(context, bool) or not isinstance(context, int) or context < 0:
        raise ValueError(f"context must be an integer >= 0, got {context!r}")
    weights = config.num_params(include_embeddings=False) + config.vocab_size * config.dim  # LM head included
    compute, memory = peak_flops * mfu, bandwidth * mbu  # achieved FLOP/s and bytes/s
    per_prefill_token = 2 * weights / compute
    kv_read = kv_handoff_bytes(config, context, dtype_bytes)  # one decode row's K/V
    return StepCost(
        fixed=weights * dtype_bytes / memory,
        per_token=per_prefill_token + kv_read / memory,
        per_prefill_token=per_prefill_token,
        fused=fused,
    )
