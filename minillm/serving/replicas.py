"""Data parallelism for serving: N whole copies of the model behind a router.

The simplest way to use N devices for inference is not to split the model at all: put a whole
replica on each and send every request to one of them (the router here sends it to the replica
with the least work outstanding, ``minillm.serving.disagg.ReplicatedEngine``). The replicas
never talk to each other, so nothing is communicated and nothing is synchronized.

What it buys is capacity, not speed. With N replicas the system can serve up to N times the
requests per second (as long as there are enough requests to keep every replica busy):

    throughput(N) <= N x throughput(1)

but each request still runs on one replica at one replica's pace, so its time per output token
(TPOT) is that of a single replica at best: TPOT(N) >= TPOT(1) at the same per-replica load.
What does fall under load is the waiting: with N times the capacity, requests queue less, so
TTFT and end-to-end latency drop when one replica was overloaded. Tensor parallelism is the
opposite trade: it splits every matrix over N devices, so one token takes less time (TPOT
falls, Shoeybi et al. 2019), at the price of two all-reduces per layer per token. Serving
systems combine them (vLLM's ``--data-parallel-size`` and ``--tensor-parallel-size``): TP
until a token is fast enough, then replicas until the traffic is served.

    run = replica_throughput("minillm-target", 2, requests, config)
    run.output_tokens_per_s, run.figures()["tpot_p50_ms"]

The clock is the wall clock over one ``run`` of the requests, after the workers have started
and run a warm-up request each: process start and model loading are not part of the figure.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

from .disagg import DisaggConfig, DisaggOutput, ReplicatedEngine
from .workload import Request


@dataclass(frozen=True)
class ReplicaRun:
    """One run of a workload through ``replicas`` replicas: the outputs (in the order the requests
    were given) and the seconds from the start of the run to its last output."""

    replicas: int
    wall_s: float
    outputs: tuple[DisaggOutput, ...]

    @property
    def served(self) -> list[DisaggOutput]:
        return [o for o in self.outputs if o.finish_reason != "error"]

    @property
    def output_tokens(self) -> int:
        return sum(len(o.tokens) for o in self.served)

    @property
    def requests_per_s(self) -> float:
        return len(self.served) / self.wall_s

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s

    def figures(self) -> dict:
        """Throughput over the wall clock, and the per-request latencies (ms, medians): TTFT,
        TPOT (requests of two tokens or more) and end-to-end; requests per replica."""
        served = self.served
        tpots = [o.metrics.tpot for o in served if o.metrics.output_tokens > 1]
        per_replica = [sum(o.prefill_worker == r for o in served) for r in range(self.replicas)]
        return {
            "replicas": self.replicas,
            "requests": len(self.outputs),
            "errors": len(self.outputs) - len(served),
            "output_tokens": self.output_tokens,
            "wall_s": self.wall_s,
            "requests_per_s": self.requests_per_s,
            "output_tokens_per_s": self.output_tokens_per_s,
            "ttft_p50_ms": _median_ms([o.metrics.ttft for o in served]),
            "tpot_p50_ms": _median_ms(tpots),
            "e2e_p50_ms": _median_ms([o.metrics.e2e for o in served]),
            "requests_per_replica": per_replica,
        }


def _median_ms(values: Sequence[float]) -> float | None:
    return 1e3 * statistics.median(values) if values else None


def warmup_requests(replicas: int) -> list[Request]:
    """One short request per replica (the router gives each to a different idle replica)."""
    return [Request([1 + i] * 8, 2, id=i) for i in range(replicas)]


def replica_throughput(
    model, replicas: int, requests: Sequence[Request], config: DisaggConfig | None = None, warmup: bool = True
) -> ReplicaRun:
    """Start ``replicas`` colocated workers of ``model`` (a bundled name or a checkpoint directory),
    warm each up with one short request, then time one run of ``requests`` on the wall clock."""
    requests = list(requests)
    if not requests:
        raise ValueError("replica_throughput needs at least one request")
    if not all(isinstance(r, Request) for r in requests):
        raise ValueError("requests must be minillm.serving.workload.Request objects")
    with ReplicatedEngine(model, replicas, config) as engine:  # checks replicas and the model first
        if warmup:
            engine.run(warmup_requests(replicas))
        start = time.perf_counter()
        outputs = engine.run(requests)
        wall = time.perf_counter() - start
    return ReplicaRun(replicas, wall, tuple(outputs))
