"""Checkers for chapter 2's exercises: one request's latencies, percentiles, goodput, cost."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from .base import passed, require


def _near(a, b, rel: float = 1e-6) -> bool:
    return math.isclose(float(a), float(b), rel_tol=rel, abs_tol=1e-9)


def check_request_latencies(fn: Callable) -> None:
    """fn(arrival, token_times) -> {"ttft", "itl", "tpot", "e2e"} in seconds (at least 2 tokens)."""
    name = "request latencies"
    cases = [(1.0, [1.25, 1.30, 1.36, 1.40, 1.49]), (0.0, [0.5, 0.5, 0.9]), (3.0, [7.0, 7.1])]
    for arrival, times in cases:
        got = fn(arrival, list(times))
        require(
            isinstance(got, dict) and {"ttft", "itl", "tpot", "e2e"} <= set(got),
            name,
            'return a dict with the keys "ttft", "itl", "tpot" and "e2e"',
        )
        itl = [b - a for a, b in zip(times, times[1:])]
        tpot = (times[-1] - times[0]) / (len(times) - 1)
        want = {"ttft": times[0] - arrival, "tpot": tpot, "e2e": times[-1] - arrival}
        require(
            _near(got["ttft"], want["ttft"]),
            name,
            f"TTFT for arrival {arrival}, tokens at {times}: expected "
            f"{want['ttft']:.3f} s, got {float(got['ttft']):.3f}: arrival to *first* token",
        )
        require(
            len(got["itl"]) == len(itl) and all(_near(a, b) for a, b in zip(got["itl"], itl)),
            name,
            f"ITL for tokens at {times}: expected {[round(x, 3) for x in itl]}, got {list(got['itl'])}: one gap "
            "between each pair of consecutive tokens (n tokens give n - 1 gaps; the wait before the first "
            "token is TTFT, not an ITL)",
        )
        require(
            _near(got["tpot"], want["tpot"]),
            name,
            f"TPOT for tokens at {times}: expected {want['tpot']:.4f} s, "
            f"got {float(got['tpot']):.4f}: the mean gap after the first token",
        )
        require(
            _near(got["e2e"], want["e2e"]),
            name,
            f"end-to-end latency: expected {want['e2e']:.3f} s, got "
            f"{float(got['e2e']):.3f}: from the arrival to the last token, = TTFT + TPOT x (n - 1)",
        )
    passed(name, "TTFT, ITL, TPOT and e2e match on 3 timelines, and e2e = TTFT + TPOT x (n - 1)")


def check_percentile(fn: Callable) -> None:
    """fn(values, p) -> the p-th percentile with linear interpolation between ranks (numpy's default)."""
    name = "percentile"
    rng = np.random.default_rng(2)
    cases = [
        ([10.0, 20.0, 30.0, 40.0], 50),
        ([10.0, 20.0, 30.0, 40.0], 90),
        ([5.0], 99),
        ([3.0, 1.0, 2.0], 0),
        ([3.0, 1.0, 2.0], 100),
        (rng.lognormal(0, 1, 101).tolist(), 99),
        (rng.lognormal(0, 1, 40).tolist(), 95),
    ]
    for values, p in cases:
        want = float(np.percentile(values, p))
        got = fn(list(values), p)
        shown = values if len(values) <= 4 else f"{len(values)} values"
        require(
            got is not None and _near(got, want),
            name,
            f"p{p} of {shown}: expected {want:.4f}, got {got}: "
            "sort, take rank k = p/100 x (n - 1), interpolate between ranks floor(k) and ceil(k)",
        )
    passed(name, "matches linear interpolation between ranks (numpy's default) for p0 ... p100")


# The example of AI Engineering, chapter 9: 10 requests in one second, 3 meet both bounds.
GOODPUT_EXAMPLE = {
    "ttft": [0.15, 0.35, 0.18, 0.30, 0.12, 0.25, 0.19, 0.50, 0.20, 0.40],
    "tpot": [0.08, 0.05, 0.15, 0.09, 0.10, 0.07, 0.12, 0.06, 0.09, 0.09],
    "duration": 1.0,
}


def check_goodput(fn: Callable) -> None:
    """fn(ttfts, tpots, duration_s, slo_ttft, slo_tpot) -> requests/s that meet both bounds (<=)."""
    name = "goodput"
    ex = GOODPUT_EXAMPLE
    got = fn(list(ex["ttft"]), list(ex["tpot"]), ex["duration"], 0.2, 0.1)
    require(
        got is not None and _near(got, 3.0),
        name,
        f"the 10-request example should give 3 requests/s, got {got}: "
        "a request counts only if TTFT <= 0.2 s *and* TPOT <= 0.1 s (a bound met exactly counts)",
    )
    ttfts, tpots = [0.1, 0.3, 0.1, 0.1, 0.5, 0.2], [0.05, 0.05, 0.2, 0.01, 0.3, 0.1]
    got = fn(ttfts, tpots, 4.0, 0.2, 0.1)
    require(
        got is not None and _near(got, 0.75),
        name,
        f"6 requests over 4 s of which 3 meet the SLO should give "
        f"0.75 requests/s, got {got}: divide the number of good requests by the duration",
    )
    passed(name, "the 10-requests/s example gives goodput 3, and goodput is good requests per second")


def check_cost_per_million(fn: Callable) -> None:
    """fn(dollars_per_hour, tokens_per_s) -> dollars per 1M tokens."""
    name = "cost per 1M tokens"
    for dph, tps in [(2.0, 100.0), (3.5, 2500.0), (0.5, 20.0)]:
        want = dph / (tps * 3600) * 1e6
        got = fn(dph, tps)
        require(
            got is not None and _near(got, want),
            name,
            f"${dph}/hour at {tps:g} tokens/s should cost "
            f"${want:.4f} per 1M tokens, got {got}: tokens per hour = tokens/s x 3600; cost per token = "
            "$/hour / tokens per hour; times 1,000,000",
        )
    passed(name, "$2/hour at 100 tokens/s costs $5.56 per 1M tokens")
