"""A serving trace replayed: measured request timelines placed on one clock.

Chapter 2 needs request timelines with real timestamps. The recipe is the simplest server there
is, one request at a time, first come first served:

1. ``bench.trace.measure_services`` runs each request through the model alone and records its
   *service* timeline: when each output token came out, relative to the moment the request started.
2. ``replay_fcfs`` places those timelines on a clock given arrival times (``poisson_arrivals``):
   a request that arrives while the model is busy waits in the queue, and that wait counts in
   its TTFT, exactly as a user would see it.

Splitting the two means one measurement can be replayed at many request rates (the
goodput-vs-load figure, ``load_sweep``) without running the model again; the idle gaps between
arrivals are simulated rather than slept through. (This is not the engine's scheduler of
chapter 13, ``serving.scheduler``: here one request runs at a time.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..core.model import Transformer
from .arrivals import poisson_arrivals
from .metrics import SLO, RequestMetrics, goodput, percentiles, throughput


@dataclass(frozen=True)
class Service:
    """One request served alone: its prompt length and each token's time since it started (s)."""

    input_tokens: int
    token_offsets: tuple[float, ...]  # non-decreasing; token_offsets[0] is prefill + first sample

    @property
    def duration(self) -> float:
        return self.token_offsets[-1]


def replay_fcfs(services: Sequence[Service], arrivals: Sequence[float]) -> list[RequestMetrics]:
    """One server, first come first served: request i starts at max(its arrival, previous finish)."""
    if len(services) != len(arrivals):
        raise ValueError(f"{len(services)} services but {len(arrivals)} arrival times")
    order = sorted(range(len(arrivals)), key=lambda i: arrivals[i])
    out: list[RequestMetrics | None] = [None] * len(arrivals)
    free_at = -float("inf")
    for i in order:
        start = max(arrivals[i], free_at)
        s = services[i]
        out[i] = RequestMetrics(arrivals[i], [start + t for t in s.token_offsets], s.input_tokens)
        free_at = start + s.duration
    return out  # type: ignore[return-value]


def queue_wait(r: RequestMetrics, service: Service) -> float:
    """Seconds the request waited before the model started on it."""
    return r.token_times[0] - service.token_offsets[0] - r.arrival


def summary(requests: Sequence[RequestMetrics]) -> list[dict]:
    """A row per metric (TTFT, TPOT, ITL, e2e): mean, p50, p90, p95 and p99 in ms."""
    values = {
        "TTFT": [r.ttft for r in requests],
        "TPOT": [r.tpot for r in requests if r.output_tokens > 1],
        "ITL": [g for r in requests for g in r.itl],
        "e2e": [r.e2e for r in requests],
    }
    rows = []
    for name, v in values.items():
        ms = [1e3 * x for x in v]
        rows.append({"metric": f"{name} (ms)", "mean": float(np.mean(ms)), **percentiles(ms)})
    return rows


def load_sweep(services: Sequence[Service], rates: Sequence[float], slo: SLO, seed: int = 0) -> list[dict]:
    """Replay the same measured services at each request rate: throughput, goodput, p99 TTFT."""
    rows = []
    for rate in rates:
        reqs = replay_fcfs(services, poisson_arrivals(len(services), rate, seed))
        tp = throughput(reqs)
        rows.append(
            {
                "offered_rps": rate,
                "served_rps": tp["requests_per_s"],
                "goodput_rps": goodput(reqs, slo),
                "p99_ttft_ms": 1e3 * percentiles([r.ttft for r in reqs], (99,))["p99"],
            }
        )
    return rows


def decode_weight_bytes(model: Transformer) -> int:
    """Bytes of weights one decode step reads: every parameter, except an untied input embedding
    table (a step looks up one row of it); a tied table is read in full as the output layer."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())  # shared tensors once
    if not model.config.tie_embeddings:
        emb = model.embed_tokens.weight
        total -= emb.numel() * emb.element_size()
    return total


def mean_with_outlier(values: Sequence[float], outlier: float) -> dict[str, float]:
    """Mean and median before and after adding one extra value."""
    both = [*values, outlier]
    return {
        "mean": float(np.mean(values)),
        "median": float(np.median(values)),
        "mean_with_outlier": float(np.mean(both)),
        "median_with_outlier": float(np.median(both)),
    }
