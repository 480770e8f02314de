"""Checkers for chapter 16: the decision guide as a rule (which technique for a measured profile),
the prediction of two stacked techniques from a decode step's time split, and the cost per 1M
tokens of a served row, all output tokens against those of requests within the SLO."""

from __future__ import annotations

from collections.abc import Callable

from .base import passed, require

MENU = (
    "tensor parallelism",
    "quantize the KV cache",
    "prefix caching",
    "chunked prefill",
    "compile",
    "quantize weights",
)

GB = 1e9
FINE = dict(  # a profile with no problem but the bandwidth-bound decode every model has
    weights_bytes=2 * GB,
    device_memory_bytes=16 * GB,
    kv_bytes_needed=4 * GB,
    memory_free_bytes=12 * GB,
    shared_prefix_tokens=100,
    prompt_tokens=1000,
    tpot_p99_s=0.03,
    slo_tpot_s=0.05,
    decode_bytes_per_s=0.8 * 300 * GB,
    copy_bytes_per_s=300 * GB,
)
PROFILES = [  # (changes to FINE, the answer, why)
    ({}, "quantize weights", "decode streams the weights at 80% of the copy bandwidth: fewer bytes"),
    ({"decode_bytes_per_s": 0.2 * 300 * GB}, "compile", "decode reaches 20% of the bandwidth: overhead"),
    ({"tpot_p99_s": 0.12}, "chunked prefill", "TPOT p99 120 ms against an SLO of 50 ms"),
    ({"shared_prefix_tokens": 800}, "prefix caching", "80% of every prompt is a shared prefix"),
    ({"kv_bytes_needed": 20 * GB}, "quantize the KV cache", "the KV cache needs 20 GB, 12 GB are free"),
    ({"weights_bytes": 40 * GB, "memory_free_bytes": 0.0}, "tensor parallelism", "40 GB of weights, 16 GB device"),
    ({"kv_bytes_needed": 20 * GB, "tpot_p99_s": 0.2}, "quantize the KV cache", "memory first: nothing runs without it"),
    ({"shared_prefix_tokens": 900, "tpot_p99_s": 0.2}, "prefix caching", "a shared prefix also shortens the prefills"),
    ({"tpot_p99_s": 0.2, "decode_bytes_per_s": 0.1 * 300 * GB}, "chunked prefill", "the SLO is broken: latency"),
    ({"shared_prefix_tokens": 800, "kv_bytes_needed": 20 * GB}, "quantize the KV cache", "fit the cache first"),
    ({"shared_prefix_tokens": 800, "weights_bytes": 40 * GB}, "tensor parallelism", "fit the model first"),
    ({"shared_prefix_tokens": 500}, "prefix caching", "exactly half of every prompt is shared: at least half"),
    ({"decode_bytes_per_s": 0.5 * 300 * GB}, "quantize weights", "exactly half the bandwidth is not under half"),
]


def check_pick_technique(fn: Callable) -> None:
    """fn(profile: dict) -> one of MENU, by the guide's order: fit the model, fit the KV cache,
    reuse shared prefixes, protect the TPOT, then remove overhead, then move fewer bytes."""
    name = "pick a technique"
    for changes, want, why in PROFILES:
        profile = {**FINE, **changes}
        got = fn(dict(profile))
        hint = f"profile {changes or 'with nothing wrong'}: expected {want!r} ({why}), got {got!r}"
        if got not in MENU:
            hint += f"; answer with one of {MENU}"
        require(got == want, name, hint)
    passed(name, f"{len(PROFILES)} profiles: model fit, KV fit, shared prefix, TPOT, overhead, then bytes")


STACKS = [  # step s, weight-streaming s, bytes ratio, overhead kept
    (0.010, 0.006, 0.5, 1.0),
    (0.010, 0.006, 1.0, 0.5),
    (0.010, 0.006, 0.25, 0.4),
    (0.040, 0.036, 0.5, 0.8),
    (0.005, 0.001, 0.5, 0.3),
]


def check_predict_stacked(fn: Callable) -> None:
    """fn(step_s, weight_s, bytes_ratio, overhead_kept) -> predicted speedup of a decode step whose
    weight streaming shrinks by ``bytes_ratio`` and whose other time shrinks to ``overhead_kept``."""
    name = "stacked speedup"
    for step, weights, ratio, kept in STACKS:
        want = step / (weights * ratio + (step - weights) * kept)
        got = fn(step, weights, ratio, kept)
        hint = f"step {step} s, weights {weights} s, bytes x{ratio}, overhead x{kept}: expected {want:.4f}, got {got!r}"
        naive = (step / (weights * ratio + step - weights)) * (step / (weights + (step - weights) * kept))
        if isinstance(got, (int, float)) and abs(got - naive) < 1e-9 and abs(naive - want) > 1e-6:
            hint += ": that multiplies the two speedups, as if each sped up the whole step"
        elif isinstance(got, (int, float)) and abs(got - 1 / ratio) < 1e-9 and kept == 1.0:
            hint += ": only the weight-streaming part of the step gets faster (Amdahl)"
        require(isinstance(got, (int, float)) and abs(got - want) <= 1e-9 * want, name, hint)
    passed(name, "step / (weights x bytes ratio + rest x overhead kept): Amdahl's law for two techniques")


ROWS = [  # output tokens/s, within-SLO tokens/s, $/hour
    ({"throughput": 120.0, "good_tokens_per_s": 120.0}, 2.0),
    ({"throughput": 300.0, "good_tokens_per_s": 75.0}, 2.0),
    ({"throughput": 2500.0, "good_tokens_per_s": 2000.0}, 4.5),
]


def check_row_costs(fn: Callable) -> None:
    """fn(row, dollars_per_hour) -> ($ per 1M output tokens, $ per 1M output tokens within the SLO)."""
    name = "cost per 1M tokens"
    for row, price in ROWS:
        want = tuple(price / (row[k] * 3600) * 1e6 for k in ("throughput", "good_tokens_per_s"))
        got = fn(dict(row), price)
        hint = f"{row} at ${price}/h: expected ({want[0]:.4f}, {want[1]:.4f}), got {got!r}"
        ok = isinstance(got, (tuple, list)) and len(got) == 2 and all(isinstance(g, (int, float)) for g in got)
        if ok and abs(got[0] - want[0] / 1e6) < 1e-12:
            hint += ": that is per token; the price is per million tokens"
        elif ok and abs(got[0] - want[0] * 3600) < 1e-6 * want[0] * 3600:
            hint += ": an hour has 3600 seconds; tokens/s x 3600 is tokens per hour"
        require(ok and all(abs(g - w) <= 1e-9 * w for g, w in zip(got, want)), name, hint)
    passed(name, "$/hour / (tokens/s x 3600) x 1e6, for all tokens and for the SLO's")
