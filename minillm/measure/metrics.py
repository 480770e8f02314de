"""Inference metrics: latency per request, percentiles, throughput, goodput, cost, MFU and MBU.

Vocabulary (as in chapter 9 of *AI Engineering* and the serving literature):

- TTFT, time to first token: arrival -> first output token (queueing + prefill).
- TPOT, time per output token: the mean gap between output tokens after the first.
- ITL, inter-token latency: each individual gap (TPOT is their mean).
- End-to-end latency = TTFT + TPOT x (n_output - 1).
- Throughput: output tokens/s (and input tokens/s, counted separately), requests/s.
- Goodput: requests/s that meet a service-level objective (SLO) on TTFT and TPOT.
- MFU: achieved FLOP/s over the hardware's peak; MBU: achieved bytes/s over peak bandwidth.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass
class RequestMetrics:
    """The timeline of one request, in seconds on one clock."""

    arrival: float
    token_times: list[float] = field(default_factory=list)  # when each output token was produced
    input_tokens: int = 0

    def __post_init__(self) -> None:
        if any(b < a for a, b in zip(self.token_times, self.token_times[1:])):
            raise ValueError("token_times must be non-decreasing")
        if self.token_times and self.token_times[0] < self.arrival:
            raise ValueError("the first token cannot come before the request arrived")

    @property
    def output_tokens(self) -> int:
        return len(self.token_times)

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.arrival

    @property
    def itl(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]

    @property
    def tpot(self) -> float:
        """Mean time per output token after the first; nan for a one-token answer."""
        n = self.output_tokens
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n > 1 else float("nan")

    @property
    def e2e(self) -> float:
        return self.token_times[-1] - self.arrival

    @property
    def finish(self) -> float:
        return self.token_times[-1]


def percentiles(values: Iterable[float], ps: Sequence[float] = (50, 90, 95, 99)) -> dict[str, float]:
    """{"p50": ..., "p99": ...} with linear interpolation between the nearest ranks."""
    arr = np.asarray(list(values), dtype=float)
    if arr.size == 0:
        raise ValueError("percentiles of an empty list are undefined")
    return {f"p{p:g}": float(np.percentile(arr, p)) for p in ps}


def latency_percentiles(
    requests: Sequence[RequestMetrics], ps: Sequence[float] = (50, 90, 99)
) -> dict[str, dict[str, float] | None]:
    """Percentiles (s) of TTFT, TPOT (answers of two tokens or more), every inter-token gap (ITL)
    and end-to-end latency over ``requests``: {"ttft": {"p50": ...}, "tpot": ..., "itl": ...,
    "e2e": ...}, None for a measure no request has (no answer of two tokens: no TPOT, no ITL)."""
    measures = {
        "ttft": [r.ttft for r in requests],
        "tpot": [r.tpot for r in requests if r.output_tokens > 1],
        "itl": [gap for r in requests for gap in r.itl],
        "e2e": [r.e2e for r in requests],
    }
    return {name: percentiles(values, ps) if values else None for name, values in measures.items()}


@dataclass(frozen=True)
class SLO:
    """A service-level objective: a request is good when every bound holds.

    ``max_itl`` (optional) bounds the longest gap between two tokens of a request: TPOT
    is an average, so a stall of seconds spread over hundreds of tokens can pass it
    unseen (a disaggregated decode worker that keeps a prefilled request waiting for
    room does just that).
    """

    ttft: float = 0.2  # seconds
    tpot: float = 0.1  # seconds
    max_itl: float | None = None  # seconds; None: no bound on a single gap

    def met_by(self, r: RequestMetrics) -> bool:
        if r.ttft > self.ttft or (r.output_tokens >= 2 and r.tpot > self.tpot):
            return False
        return self.max_itl is None or not r.itl or max(r.itl) <= self.max_itl


def span(requests: Sequence[RequestMetrics]) -> float:
    """Seconds from the first arrival to the last finished token."""
    if not requests:
        raise ValueError("no requests")
    return max(r.finish for r in requests) - min(r.arrival for r in requests)


def throughput(requests: Sequence[RequestMetrics], duration: float | None = None) -> dict[str, float]:
    """Output and input tokens/s and requests/s (and per minute) over ``duration`` (default: the span)."""
    duration = span(requests) if duration is None else duration
    if duration <= 0:
        raise ValueError(f"duration must be positive, got {duration}")
    out = sum(r.output_tokens for r in requests)
    inp = sum(r.input_tokens for r in requests)
    return {
        "output_tokens_per_s": out / duration,
        "input_tokens_per_s": inp / duration,
        "requests_per_s": len(requests) / duration,
        "requests_per_min": 60 * len(requests) / duration,
    }


def goodput(requests: Sequence[RequestMetrics], slo: SLO, duration: float | None = None) -> float:
    """Requests per second that meet the SLO."""
    duration = span(requests) if duration is None else duration
    if duration <= 0:
        raise ValueError(f"duration must be positive, got {duration}")
    return sum(slo.met_by(r) for r in requests) / duration


def slo_met_pct(requests: Sequence[RequestMetrics], slo: SLO) -> float:
    """Percent of the requests that meet the SLO: a count over the requests, not a ratio of two
    rates (which can print 99.99...% for all of them)."""
    if not requests:
        raise ValueError("no requests")
    return 100 * sum(slo.met_by(r) for r in requests) / len(requests)


def cost_per_million_tokens(dollars_per_hour: float, tokens_per_s: float) -> float:
    """$ per 1M tokens for a machine rented at ``dollars_per_hour`` producing ``tokens_per_s``."""
    if tokens_per_s <= 0:
        raise ValueError(f"tokens_per_s must be positive, got {tokens_per_s}")
    return dollars_per_hour / (tokens_per_s * 3600) * 1e6


def mfu(flops_per_token: float, tokens_per_s: float, peak_flops: float) -> float:
    """Model FLOP/s utilization: the fraction of peak compute the model's own FLOPs use."""
    return flops_per_token * tokens_per_s / peak_flops


def mbu(bytes_per_token: float, tokens_per_s: float, peak_bandwidth: float) -> float:
    """Model bandwidth utilization: the fraction of peak memory bandwidth the bytes read use."""
    return bytes_per_token * tokens_per_s / peak_bandwidth
