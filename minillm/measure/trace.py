"""A measured serving trace: real requests through a model, timed on one clock.

Chapter 2 needs request timelines with real timestamps. The recipe here is the simplest server
there is, one request at a time, first come first served:

1. ``measure_services`` runs each request through the model alone and records its *service*
   timeline: when each output token came out, relative to the moment the request started.
2. ``schedule`` places those timelines on a clock given arrival times (``poisson_arrivals``):
   a request that arrives while the model is busy waits in the queue, and that wait counts in
   its TTFT, exactly as a user would see it.

Splitting the two means one measurement can be replayed at many request rates (the
goodput-vs-load figure) without running the model again; the idle gaps between arrivals are
simulated rather than slept through.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..core.generate import generate
from ..core.model import Transformer
from .metrics import SLO, RequestMetrics, goodput, percentiles, throughput


@dataclass(frozen=True)
class Service:
    """One request served alone: its prompt length and each token's time since it started (s)."""

    input_tokens: int
    token_offsets: tuple[float, ...]  # non-decreasing; token_offsets[0] is prefill + first sample

    @property
    def duration(self) -> float:
        return self.token_offsets[-1]


def poisson_arrivals(n: int, rate: float, seed: int = 0) -> list[float]:
    """``n`` arrival times (s, the first at 0) of a Poisson process with ``rate`` requests/s."""
    if n < 1:
        raise ValueError(f"n must be a positive integer, got {n}")
    if rate <= 0:
        raise ValueError(f"rate must be positive, got {rate}")
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=n - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


def measure_services(model: Transformer, prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int],
                     warmup: bool = True) -> list[Service]:  # fmt: skip
    """Run each prompt alone (greedy, no early stop) and record when each of its tokens came out."""
    if not prompts:
        raise ValueError("no prompts")
    new_tokens = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    if len(new_tokens) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(new_tokens)} values of max_new_tokens")
    if warmup:  # the first call pays one-off costs (allocator, kernel selection) no later request pays
        generate(model, list(prompts[0]), 2, eos_token_id=None)
    services = []
    for prompt, n in zip(prompts, new_tokens):
        r = generate(model, list(prompt), n, eos_token_id=None)
        offsets = np.cumsum([r.ttft, *r.token_times]).tolist()
        services.append(Service(len(prompt), tuple(offsets)))
    return services


def schedule(services: Sequence[Service], arrivals: Sequence[float]) -> list[RequestMetrics]:
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


def run_requests(model: Transformer, prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int],
                 rate: float | None = None, seed: int = 0) -> list[RequestMetrics]:  # fmt: skip
    """Measure the requests, then schedule them: Poisson arrivals at ``rate`` requests/s, or all
    back to back with no queueing when ``rate`` is None."""
    services = measure_services(model, prompts, max_new_tokens)
    if rate is None:
        arrivals = np.cumsum([0.0] + [s.duration for s in services[:-1]]).tolist()
    else:
        arrivals = poisson_arrivals(len(services), rate, seed)
    return schedule(services, arrivals)


def summary(requests: Sequence[RequestMetrics]) -> list[dict]:
    """One row per metric (TTFT, TPOT, ITL, e2e) with mean and p50/p90/p95/p99, in milliseconds."""
    values = {"TTFT": [r.ttft for r in requests], "TPOT": [r.tpot for r in requests if r.output_tokens > 1],
              "ITL": [g for r in requests for g in r.itl], "e2e": [r.e2e for r in requests]}  # fmt: skip
    rows = []
    for name, v in values.items():
        ms = [1e3 * x for x in v]
        rows.append({"metric": f"{name} (ms)", "mean": float(np.mean(ms)), **percentiles(ms)})
    return rows


def load_sweep(services: Sequence[Service], rates: Sequence[float], slo: SLO, seed: int = 0) -> list[dict]:
    """Replay the same measured services at each request rate: throughput, goodput, p99 TTFT."""
    rows = []
    for rate in rates:
        reqs = schedule(services, poisson_arrivals(len(services), rate, seed))
        tp = throughput(reqs)
        rows.append({"offered_rps": rate, "served_rps": tp["requests_per_s"], "goodput_rps": goodput(reqs, slo),
                     "p99_ttft_ms": 1e3 * percentiles([r.ttft for r in reqs], (99,))["p99"]})  # fmt: skip
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
    return {"mean": float(np.mean(values)), "median": float(np.median(values)),
            "mean_with_outlier": float(np.mean(both)), "median_with_outlier": float(np.median(both))}  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Plots (matplotlib is imported only when one is drawn)


def plot_latency_histogram(values_ms: Sequence[float], xlabel: str, title: str, ax=None):
    """A histogram with p50 and p99 marked."""
    import matplotlib.pyplot as plt

    ax = ax or plt.subplots()[1]
    p = percentiles(values_ms, (50, 99))
    ax.hist(values_ms, bins=min(30, max(5, len(values_ms) // 3)), color="0.7", edgecolor="white")
    for key, style in (("p50", "-"), ("p99", "--")):
        ax.axvline(p[key], color="C3", linestyle=style, label=f"{key} = {p[key]:.1f} ms")
    ax.set(xlabel=xlabel, ylabel="requests", title=title)
    ax.legend()
    return ax


def plot_timeline(requests: Sequence[RequestMetrics], services: Sequence[Service], title: str, ax=None):
    """One row per request: waiting in the queue (light), prefill to the first token (dark), decode."""
    import matplotlib.pyplot as plt

    ax = ax or plt.subplots()[1]
    for i, (r, s) in enumerate(zip(requests, services)):
        start = r.token_times[0] - s.token_offsets[0]
        ax.barh(i, 1e3 * (start - r.arrival), left=1e3 * r.arrival, color="0.85", label="queued" if i == 0 else None)
        ax.barh(i, 1e3 * s.token_offsets[0], left=1e3 * start, color="C3",
                label="prefill + first token" if i == 0 else None)  # fmt: skip
        ax.barh(i, 1e3 * (r.finish - r.token_times[0]), left=1e3 * r.token_times[0], color="C0",
                label="decode" if i == 0 else None)  # fmt: skip
    from matplotlib.ticker import MaxNLocator

    ax.invert_yaxis()
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set(xlabel="time since the first arrival (ms)", ylabel="request (in arrival order)", title=title)
    ax.legend(loc="upper right")
    return ax


def plot_load_sweep(rows: Sequence[dict], slo: SLO, title: str, ax=None):
    """Served requests/s and goodput against the offered request rate."""
    import matplotlib.pyplot as plt

    ax = ax or plt.subplots()[1]
    x = [r["offered_rps"] for r in rows]
    ax.plot(x, [r["served_rps"] for r in rows], "o-", label="throughput (requests/s)")
    ax.plot(x, [r["goodput_rps"] for r in rows], "s-",
            label=f"goodput (TTFT <= {1e3 * slo.ttft:.0f} ms, TPOT <= {1e3 * slo.tpot:.0f} ms)")  # fmt: skip
    ax.set(xlabel="offered load (requests/s)", ylabel="requests per second", title=title)
    ax.set_ylim(0, 1.35 * max(r["served_rps"] for r in rows))  # room for the legend above the curves
    ax.legend(loc="upper left")
    return ax


@torch.inference_mode()
def ttft_by_prompt_length(model: Transformer, prompts: Sequence[Sequence[int]], repeats: int = 3) -> list[dict]:
    """Median TTFT (ms) of each prompt served alone, one new token."""
    generate(model, list(prompts[0]), 1, eos_token_id=None)  # warmup
    rows = []
    for p in prompts:
        times = [generate(model, list(p), 1, eos_token_id=None).ttft for _ in range(repeats)]
        rows.append({"prompt_tokens": len(p), "ttft_ms": 1e3 * float(np.median(times))})
    return rows
