"""Checkers for chapter 14: the bytes and time of a K/V handoff, a P:D ratio from measured
per-phase capacities, and SLO attainment with a bound on the longest stall."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

from ...measure.metrics import SLO, RequestMetrics
from .base import passed, require

# (layers, kv heads, head dim, prompt tokens, dtype bytes, link GB/s): Llama-3-8B, 70B, an MHA
# model, the bundled target in fp32, a one-token prompt
HANDOFF_CASES = [
    (32, 8, 128, 4096, 2, 50.0),
    (80, 8, 128, 4096, 2, 12.5),
    (32, 32, 128, 1000, 2, 31.5),
    (6, 8, 32, 640, 4, 1.0),
    (2, 4, 24, 1, 4, 450.0),
]
LATENCY_US = 5.0


def reference_handoff(layers, kv_heads, head_dim, tokens, dtype_bytes, gb_s) -> tuple[int, float]:
    nbytes = 2 * layers * kv_heads * head_dim * tokens * dtype_bytes
    return nbytes, 1e3 * (LATENCY_US * 1e-6 + nbytes / (gb_s * 1e9))


def check_handoff(fn: Callable) -> None:
    """fn(n_layers, n_kv_heads, head_dim, prompt_tokens, dtype_bytes, link_gb_s) -> (bytes, ms),
    with a latency of 5 microseconds per transfer."""
    name = "K/V handoff"
    for case in HANDOFF_CASES:
        want_bytes, want_ms = reference_handoff(*case)
        got = fn(*case)
        require(isinstance(got, tuple) and len(got) == 2, name, f"return (bytes, milliseconds), got {got!r} for {case}")
        got_bytes, got_ms = got
        layers, heads, dim, tokens, db, _ = case
        require(
            got_bytes == want_bytes,
            name,
            f"{layers} layers, {heads} K/V heads of {dim}, {tokens} tokens at {db} bytes: {got_bytes} bytes, "
            f"expected {want_bytes}. Count K and V, every layer, every K/V head (not the query heads)",
        )
        require(
            math.isclose(got_ms, want_ms, rel_tol=1e-6),
            name,
            f"{want_bytes} bytes over {case[-1]} GB/s: {got_ms} ms, expected {want_ms:.6g} ms "
            "(latency + bytes / bandwidth; GB is 1e9 bytes, the answer in milliseconds)",
        )
    passed(name, "2 x layers x K/V heads x head dim x tokens x bytes, and latency + bytes / bandwidth")


def reference_ratio(prefill_rps: float, decode_rps: float, max_workers: int) -> tuple[int, int]:
    best, best_key = None, None
    for p, d in itertools.product(range(1, max_workers), repeat=2):
        if p + d > max_workers:
            continue
        per_worker = min(p * prefill_rps, d * decode_rps) / (p + d)
        key = (round(per_worker, 12), -(p + d))
        if best_key is None or key > best_key:
            best, best_key = (p, d), key
    return best


RATIO_CASES = [(10.0, 10.0, 4), (30.0, 10.0, 4), (10.0, 30.0, 4), (7.0, 2.0, 8), (1.0, 5.0, 6), (4.0, 6.0, 5)]


def check_choose_ratio(fn: Callable) -> None:
    """fn(prefill_rps, decode_rps, max_workers) -> (P, D): the ratio with the most goodput per worker."""
    name = "P:D ratio"
    for prefill, decode, most in RATIO_CASES:
        want = reference_ratio(prefill, decode, most)
        got = fn(prefill, decode, most)
        got = tuple(got) if isinstance(got, (tuple, list)) else got
        per = min(want[0] * prefill, want[1] * decode) / sum(want)
        require(
            got == want,
            name,
            f"a prefill worker serves {prefill} req/s and a decode worker {decode}, up to {most} workers: "
            f"got {got}, expected {want} ({per:.3g} req/s per worker). The cluster serves the smaller of "
            "P x prefill and D x decode; among equal ratios per worker take the fewest workers",
        )
    passed(name, "the pipeline runs at its slower phase; the best ratio balances the two per worker")


def _metrics(arrival: float, times: list[float], prompt: int = 8) -> RequestMetrics:
    return RequestMetrics(arrival, times, prompt)


ATTAINMENT_CASES = [
    _metrics(0.0, [0.1, 0.12, 0.14, 0.16]),  # meets everything
    _metrics(0.0, [0.6]),  # one token, TTFT too slow
    _metrics(0.0, [0.2]),  # one token within TTFT
    _metrics(0.0, [0.1, 0.15, 0.2, 0.25]),  # TPOT 50 ms: too slow
    _metrics(1.0, [1.1] + [1.5 + 0.01 * i for i in range(60)]),  # a 400 ms stall, TPOT ~16 ms: passes TPOT only
    _metrics(0.0, [0.25, 0.28125]),  # exactly at the TTFT and TPOT bounds (exact in binary): counts
]
ATTAINMENT_SLO = SLO(ttft=0.25, tpot=0.03125, max_itl=0.25)


def check_attainment(fn: Callable) -> None:
    """fn(metrics, slo_ttft, slo_tpot, max_gap) -> % of requests meeting all three bounds."""
    name = "SLO attainment"
    s = ATTAINMENT_SLO
    for k in range(1, len(ATTAINMENT_CASES) + 1):
        chosen = ATTAINMENT_CASES[:k]
        want = 100 * sum(s.met_by(m) for m in chosen) / len(chosen)
        got = fn(chosen, s.ttft, s.tpot, s.max_itl)
        require(
            isinstance(got, (int, float)) and math.isclose(got, want, abs_tol=1e-6),
            name,
            f"the first {k} requests: {got!r} %, expected {want:.4g} %. A request counts when TTFT <= "
            "slo_ttft, TPOT <= slo_tpot (if it has two tokens or more) and every gap between two of its "
            "tokens <= max_gap; a bound met exactly counts",
        )
    stalled = ATTAINMENT_CASES[4]
    require(
        fn([stalled], s.ttft, s.tpot, None) == 100.0 and fn([stalled], s.ttft, s.tpot, s.max_itl) == 0.0,
        name,
        "a request whose tokens stall for 400 ms but average 16 ms meets TPOT: it passes with max_gap None "
        "and fails with max_gap 0.25 s",
    )
    passed(name, "TTFT, TPOT and the longest gap; an average TPOT alone hides a stall")
