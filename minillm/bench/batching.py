"""Chapter 13's measurements: batching policies on one workload, measured and simulated.

1. ``bench_batching`` (``python -m minillm bench batching``): the same chat-like workload through
   static and continuous batching with the same maximum batch and the same KV memory (enough
   blocks for ``max_batch`` sequences of the longest length, what a contiguous cache would
   preallocate), on the real model and clock; with it chapter 6's KV memory waste and prefix-cache
   TTFT (``bench.paging``) on the same workload.
2. ``rate_sweep``: the same workload through each policy at several request rates, on the
   simulated clock (the engine's own scheduler, a ``SimulatedModel`` and a ``StepCost``), and
   ``capacity``, the rate a server can sustain by the cost model.
3. ``interference_workload`` and ``itl_figures``: decoding requests while long prompts arrive,
   the case chunked prefill (Sarathi; Agrawal et al., 2023) is for.

    figures = bench_batching(model, BatchingBench(n_requests=64))
    print(format_batching(figures))
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from ..core.config import ModelConfig, check_field_types
from ..core.model import Transformer
from ..kv.paged import blocks_for
from ..measure.metrics import SLO, percentiles
from ..measure.report import finish_provenance, format_table, provenance
from ..measure.timing import interleaved
from ..serving.engine import EngineConfig, RequestOutput, StepCost
from ..serving.scheduler import POLICIES, SchedulerConfig
from ..serving.workload import Request, chat_trace, random_prompt, requests_from_trace
from .paging import bench_prefix_cache, memory_waste
from .serving import run_measured, serving_figures, simulate

WASTE_SAMPLE = 20_000  # sequence lengths drawn for the memory-waste figures
SIGMA = 0.8  # log-space spread of the workload's prompt and output lengths


@dataclass(frozen=True)
class BatchingBench:
    """The options of ``bench_batching``: one chat-like workload and the three benchmarks on it."""

    n_requests: int = 128  # requests in the workload
    rate: float = 1000.0  # Poisson arrivals per second
    max_batch: int = 16  # sequences per step at most
    prompt_median: float = 64  # tokens (lognormal lengths)
    output_median: float = 64  # tokens
    max_len: int | None = None  # prompt + output at most; None: a quarter of the model's context
    prefix_requests: int = 8  # requests sharing a system prompt (the prefix-cache benchmark)
    system_len: int = 512  # system prompt tokens (at most half the context is used)
    seed: int = 0
    repeats: int = 3  # runs of each batching policy, taking turns
    progress: bool = False  # a progress bar during the measured runs

    def __post_init__(self) -> None:
        check_field_types(
            self,
            ints=("n_requests", "max_batch", "prefix_requests", "system_len", "repeats"),
            optional_ints=("max_len",),
            numbers=("rate", "prompt_median", "output_median"),
        )
        if self.max_len is not None and self.max_len < 2:
            raise ValueError(f"max_len must be at least 2 (a prompt and an output token), got {self.max_len}")


def bench_throughput(
    model: Transformer,
    requests: Sequence[Request],
    max_batch: int,
    block_size: int = 16,
    repeats: int = 3,
    progress: bool = False,
) -> dict:
    """Static vs continuous batching on the same requests, batch and KV memory (wall clock).

    The two take turns (the timing harness), ``repeats`` runs each, alternating who goes first, so
    that drift (another job on the machine) hits both alike; each reports its median run (by
    tokens/s), and the ratio is the median of the rounds' ratios.
    """
    longest = max(len(r.prompt) + r.max_tokens for r in requests)
    num_blocks = max_batch * blocks_for(longest, block_size)

    def run(policy: str) -> dict:
        config = EngineConfig(
            num_blocks, block_size, prefix_caching=False, scheduler=SchedulerConfig(policy, max_batch)
        )
        return serving_figures(*run_measured(model, requests, config, progress))

    policies = ("static", "continuous")
    timings = interleaved({p: partial(run, p) for p in policies}, repeats, model.device, warmup=0)
    result = {"max_batch": max_batch, "num_blocks": num_blocks, "block_size": block_size, "repeats": repeats}
    for policy in policies:
        runs = timings[policy].values
        median = sorted(runs, key=lambda f: f["tokens_per_s"])[(len(runs) - 1) // 2]
        result[policy] = {**saved_keys(median), "output_tokens_per_s_runs": [f["tokens_per_s"] for f in runs]}
    pairs = zip(result["continuous"]["output_tokens_per_s_runs"], result["static"]["output_tokens_per_s_runs"])
    result["ratio_runs"] = [c / s for c, s in pairs]  # each round's two runs saw the same conditions
    result["ratio"] = float(np.median(result["ratio_runs"]))
    result["steps_ratio"] = result["static"]["steps"] / result["continuous"]["steps"]  # the gain at a flat step cost
    return result


def saved_keys(figures: dict) -> dict:
    """A policy's ``serving_figures`` under the keys results/*/bench_batching.json has always had."""
    return {
        "output_tokens_per_s": figures["tokens_per_s"],
        "requests_per_s": figures["requests_per_s"],
        "seconds": figures["seconds"],
        "steps": figures["steps"],
        "preemptions": figures["preemptions"],
        "padding_rows": figures["padding_rows"],
        "ttft_ms": {"p50": figures["ttft_p50_ms"], "p99": figures["ttft_p99_ms"]},
        "tpot_ms_p50": figures["tpot_p50_ms"],
        "measured_kv_waste_pct": figures["measured_kv_waste_pct"],
    }


@torch.inference_mode()
def bench_batching(model: Transformer, options: BatchingBench | None = None) -> dict:
    """All three benchmarks on one chat-like workload (Poisson at ``rate`` requests/s, lognormal
    lengths capped at ``max_len``, by default a quarter of the context)."""
    o = options or BatchingBench()
    max_len = o.max_len or model.config.max_seq_len // 4
    record = provenance(model.device, model.config.name, model.dtype, params=model.num_params())
    trace = chat_trace(o.n_requests, o.rate, o.prompt_median, SIGMA, o.output_median, SIGMA, max_len, o.seed)
    many = chat_trace(WASTE_SAMPLE, o.rate, o.prompt_median, SIGMA, o.output_median, SIGMA, max_len, o.seed)
    lengths = [e.prompt_len + e.output_len for e in many]  # a stable estimate of the waste
    requests = requests_from_trace(trace, model.config.vocab_size, o.seed)
    system_len = min(o.system_len, model.config.max_seq_len // 2)
    workload = {"requests": o.n_requests, "rate": o.rate, "prompt_median": o.prompt_median}
    workload.update(output_median=o.output_median, sigma=SIGMA, max_len=max_len, seed=o.seed)
    figures = {
        **record,
        "workload": workload,
        "throughput": bench_throughput(model, requests, o.max_batch, repeats=o.repeats, progress=o.progress),
        "memory_waste": memory_waste(lengths, model.config.max_seq_len),
        "prefix_cache": bench_prefix_cache(model, o.prefix_requests, system_len),
    }
    return finish_provenance(figures)


def format_batching(figures: dict) -> str:
    """The three results side by side, as text tables, with the hardware line."""
    tp, w, pc = figures["throughput"], figures["memory_waste"], figures["prefix_cache"]
    rows = [
        {
            "policy": p,
            "tokens/s": tp[p]["output_tokens_per_s"],
            "requests/s": tp[p]["requests_per_s"],
            "TTFT p50 ms": tp[p]["ttft_ms"]["p50"],
            "TTFT p99 ms": tp[p]["ttft_ms"]["p99"],
            "TPOT p50 ms": tp[p]["tpot_ms_p50"],
            "steps": tp[p]["steps"],
            "preemptions": tp[p]["preemptions"],
            "KV waste % (measured)": tp[p]["measured_kv_waste_pct"],
        }
        for p in ("static", "continuous")
    ]
    prefix_rows = [
        {"prefix cache": name, "TTFT mean ms": pc[key]["ttft_ms_mean"], "TTFT p50 ms": pc[key]["ttft_ms_p50"]}
        for name, key in (("off", "without_cache"), ("on", "with_cache"))
    ]
    parts = [
        f"{figures['model']} ({figures['params'] / 1e6:.2f}M params, {figures['dtype']}) on {figures['hardware']}",
        format_table(
            rows,
            title=f"Batching, max batch {tp['max_batch']}, {figures['workload']['requests']} "
            f"requests: continuous / static = {tp['ratio']:.2f}x tokens/s, in {tp['continuous']['steps']} "
            f"steps against {tp['static']['steps']}",
        ),
        format_table(
            w["rows"],
            title=f"KV memory waste, {WASTE_SAMPLE:,} draws of the workload's lengths (mean {w['mean_length']:.0f} "
            f"tokens; contiguous = {w['max_len']} slots per request)",
        ),
        format_table(
            prefix_rows,
            title=f"Prefix cache: {pc['requests']} requests sharing a {pc['system_len']}-token "
            f"system prompt: TTFT saving {pc['ttft_saving_pct']:.0f}%",
        ),
    ]
    return "\n\n".join(p for p in parts if p)


# ---------------------------------------------------------------------------------------------
# The same workload through each policy at several request rates, simulated


@dataclass(frozen=True)
class RateSweep:
    """The options of ``rate_sweep``: which rates and policies, the workload, the engine and the clock.
    The KV pool holds ``max_batch`` sequences of ``max_len`` tokens unless ``num_blocks`` says."""

    rates: Sequence[float]  # requests/s offered
    step_cost: StepCost  # the simulated clock
    slo: SLO  # for goodput
    policies: Sequence[str] = POLICIES
    n_requests: int = 200
    max_batch: int = 16
    block_size: int = 16
    timeout: float = 0.05  # dynamic batching: seconds the oldest request waits
    prompt_median: float = 64
    output_median: float = 64
    max_len: int = 256  # prompt + output at most
    num_blocks: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "rates", tuple(self.rates))
        object.__setattr__(self, "policies", tuple(self.policies))
        if not self.rates or not self.policies:
            raise ValueError(f"rates and policies must not be empty, got {self.rates} and {self.policies}")
        for rate in self.rates:
            if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not math.isfinite(rate) or rate <= 0:
                raise ValueError(f"rates must be positive request rates, got {rate!r}")
        unknown = [p for p in self.policies if p not in POLICIES]
        if unknown:
            raise ValueError(f"policies must be among {POLICIES}, got {unknown}")
        check_field_types(
            self,
            ints=("n_requests", "max_batch", "block_size", "max_len"),
            optional_ints=("num_blocks",),
            numbers=("prompt_median", "output_median"),
        )
        if self.timeout < 0:
            raise ValueError(f"timeout must be >= 0, got {self.timeout}")


def rate_sweep(config: ModelConfig, sweep: RateSweep) -> list[dict]:
    """One chat-like workload (the same lengths at every rate, Poisson arrivals at each rate)
    through each policy, on the simulated clock: one row of ``serving_figures`` per (policy, rate)."""
    s = sweep
    num_blocks = s.num_blocks or s.max_batch * blocks_for(s.max_len, s.block_size)
    rows = []
    for rate in s.rates:
        trace = chat_trace(s.n_requests, rate, s.prompt_median, SIGMA, s.output_median, SIGMA, s.max_len, s.seed)
        requests = requests_from_trace(trace, config.vocab_size, s.seed)
        for policy in s.policies:
            sched = SchedulerConfig(policy, s.max_batch, timeout=s.timeout)
            engine_config = EngineConfig(num_blocks, s.block_size, False, sched, s.step_cost)
            outputs, engine = simulate(config, requests, engine_config)
            rows.append({"policy": policy, "rate": rate, **serving_figures(outputs, engine, s.slo)})
    return rows


def capacity(cost: StepCost, mean_prompt: float, mean_output: float, max_batch: int) -> float:
    """Requests/s a server can finish at best, by the cost model: each request's share of full
    decode steps, plus its prompt's tokens and one forward's fixed cost for its prefill."""
    seconds = mean_output * cost(max_batch) / max_batch + mean_prompt * cost.prefill_rate + cost.fixed
    return 1.0 / seconds


# ---------------------------------------------------------------------------------------------
# Decodes stalled behind long prompts (chunked prefill)


@dataclass(frozen=True)
class InterferenceWorkload:
    """Requests that are decoding (``n_chat`` short prompts, long answers, all at time 0) while
    long prompts arrive every ``gap`` seconds from ``first``."""

    n_chat: int = 6
    chat_prompt: int = 32  # tokens
    chat_tokens: int = 160  # output tokens of each decoding request
    n_long: int = 5
    long_prompt: int = 640  # tokens
    long_tokens: int = 8
    first: float = 0.15  # seconds: the first long prompt's arrival
    gap: float = 0.3  # seconds between long prompts
    seed: int = 0

    def __post_init__(self) -> None:
        names = ("n_chat", "chat_prompt", "chat_tokens", "n_long", "long_prompt", "long_tokens")
        check_field_types(self, names)
        if not (math.isfinite(self.first) and self.first >= 0 and math.isfinite(self.gap) and self.gap >= 0):
            raise ValueError(f"first and gap must be times >= 0, got {self.first} and {self.gap}")


def interference_workload(
    vocab_size: int, workload: InterferenceWorkload | None = None
) -> tuple[list[Request], list[int]]:
    """The requests of ``workload`` (random prompt ids) and the ids of the decoding ones, whose
    inter-token gaps show the stalls."""
    w = workload or InterferenceWorkload()
    rng = np.random.default_rng(w.seed)
    chat = [Request(random_prompt(w.chat_prompt, vocab_size, rng), w.chat_tokens, 0.0, id=i) for i in range(w.n_chat)]
    long = [
        Request(random_prompt(w.long_prompt, vocab_size, rng), w.long_tokens, w.first + w.gap * j, id=w.n_chat + j)
        for j in range(w.n_long)
    ]
    return chat + long, [r.id for r in chat]


def itl_figures(outputs: Sequence[RequestOutput], ids: Sequence[int]) -> dict:
    """Inter-token gaps (ms) of the requests ``ids``: p50, p99 and the largest, and their TPOT
    (mean over the requests, and p99)."""
    chosen = [o for o in outputs if o.request.id in set(ids)]
    gaps = [1e3 * g for o in chosen for g in o.metrics.itl]
    p = percentiles(gaps, (50, 99))
    return {
        "itl_p50_ms": p["p50"],
        "itl_p99_ms": p["p99"],
        "itl_max_ms": max(gaps),
        "tpot_mean_ms": 1e3 * float(np.mean([o.metrics.tpot for o in chosen])),
        "tpot_p99_ms": 1e3 * percentiles([o.metrics.tpot for o in chosen], (99,))["p99"],
    }
