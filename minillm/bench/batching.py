"""Serving benchmarks that return their figures (chapters 6 and 13), on the real model and clock:

1. Throughput: the same chat-like workload through static and continuous batching with the
   same maximum batch and the same KV memory (enough blocks for ``max_batch`` sequences of the
   longest length, what a contiguous cache would preallocate).
2. KV memory waste: the fraction of reserved KV slots left empty, contiguous max-length
   preallocation against paging at several block sizes, on the final lengths of many requests
   drawn like the workload's, and as measured step by step in the two engine runs (a growing
   sequence's last block is partly empty at every step; a static batch holds its reservations).
3. Prefix caching: N requests that share a long system prompt, one at a time (no queueing),
   TTFT with and without the prefix cache.

    from .batching import bench_batching, format_batching
    print(format_batching(bench_batching(model)))

Below them, the chapters' helpers: block sizes and a shared system prompt, counted and timed
(chapter 6); the same workload through each batching policy at several request rates on the
simulated clock (``rate_sweep``: the engine's own scheduler, a ``SimulatedModel`` and a
``StepCost``), chunked prefill's workload, and the plots (chapter 13).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import torch

from ..core.config import ModelConfig
from ..core.device import hardware_description
from ..core.model import Transformer
from ..kv.memory import kv_bytes_per_token
from ..kv.paged import blocks_for, gather_kv, kv_waste
from ..measure.metrics import SLO, goodput, percentiles, throughput
from ..serving.engine import Engine, EngineConfig, SimulatedModel, StepCost
from ..serving.scheduler import SchedulerConfig
from ..serving.workload import Request, chat_trace, random_prompt, requests_from_trace

GOAL_THROUGHPUT_RATIO = 2.0  # continuous over static output tokens/s
GOAL_PAGED_WASTE_PCT = 4.0  # at block size 16
GOAL_BLOCK_SIZE = 16
WASTE_SAMPLE = 20_000  # sequence lengths drawn for the memory-waste figures


def _run(model: Transformer, requests: list[Request], config: EngineConfig, progress: bool) -> tuple[list, Engine]:
    engine = Engine(model, config)
    warm = Engine(model, config)  # one-off costs (allocator, kernel selection) outside the timed run
    warm.run([Request(list(r.prompt), 2) for r in requests[:2]])
    return engine.run(requests, progress=progress), engine


def _policy_figures(outputs: list, engine: Engine) -> dict:
    metrics = [o.metrics for o in outputs]
    tp = throughput(metrics)
    return {"output_tokens_per_s": tp["output_tokens_per_s"], "requests_per_s": tp["requests_per_s"],
            "seconds": engine.now, "steps": engine.steps, "preemptions": engine.scheduler.preemptions,
            "padding_rows": engine.padding_rows,
            "ttft_ms": {k: 1e3 * v for k, v in percentiles([m.ttft for m in metrics], (50, 99)).items()},
            "tpot_ms_p50": 1e3 * percentiles([m.tpot for m in metrics if m.output_tokens > 1], (50,))["p50"],
            "measured_kv_waste_pct": 100 * engine.kv_waste}  # fmt: skip


def bench_throughput(model: Transformer, requests: Sequence[Request], max_batch: int, block_size: int = 16,
                     repeats: int = 3, progress: bool = False) -> dict:  # fmt: skip
    """Static vs continuous batching on the same requests, batch and KV memory (wall clock).

    The two take turns, ``repeats`` runs each, alternating who goes first, so that drift (another
    job on the machine) hits both alike; each reports its median run (by tokens/s), and the ratio
    is the median of the rounds' ratios.
    """
    longest = max(len(r.prompt) + r.max_tokens for r in requests)
    num_blocks = max_batch * blocks_for(longest, block_size)
    runs: dict[str, list[dict]] = {"static": [], "continuous": []}
    for i in range(repeats):
        for policy in list(runs) if i % 2 == 0 else list(runs)[::-1]:
            sched = SchedulerConfig(policy, max_batch)
            config = EngineConfig(num_blocks, block_size, prefix_caching=False, scheduler=sched)
            runs[policy].append(_policy_figures(*_run(model, copy_requests(requests), config, progress)))
    result = {"max_batch": max_batch, "num_blocks": num_blocks, "block_size": block_size, "repeats": repeats}
    for policy, figures in runs.items():
        ranked = sorted(figures, key=lambda f: f["output_tokens_per_s"])
        result[policy] = {**ranked[(len(ranked) - 1) // 2],
                          "output_tokens_per_s_runs": [f["output_tokens_per_s"] for f in figures]}  # fmt: skip
    pairs = zip(result["continuous"]["output_tokens_per_s_runs"], result["static"]["output_tokens_per_s_runs"])
    result["ratio_runs"] = [c / s for c, s in pairs]  # each round's two runs saw the same conditions
    result["ratio"] = float(np.median(result["ratio_runs"]))
    result["steps_ratio"] = result["static"]["steps"] / result["continuous"]["steps"]  # the gain at a flat step cost
    return result


def memory_waste(lengths: Sequence[int], max_len: int, block_sizes: Sequence[int] = (8, 16, 32)) -> dict:
    """% of reserved KV slots left empty: contiguous ``max_len`` per sequence vs paging, per block size."""
    contiguous = 100 * kv_waste(lengths, None, max_len)
    rows = [{"block_size": bs, "paged_waste_pct": 100 * kv_waste(lengths, bs), "contiguous_waste_pct": contiguous}
            for bs in block_sizes]  # fmt: skip
    return {"max_len": max_len, "sequences": len(lengths), "mean_length": float(np.mean(lengths)), "rows": rows}


def bench_prefix_cache(model: Transformer, n: int = 8, system_len: int = 512, suffix_len: int = 32,
                       output_len: int = 8, block_size: int = 16, seed: int = 0) -> dict:  # fmt: skip
    """TTFT of ``n`` requests sharing a ``system_len``-token system prompt, served one at a time,
    with and without the prefix cache; the first request fills the cache, so only the rest count."""
    rng = np.random.default_rng(seed)
    system = random_prompt(system_len, model.config.vocab_size, rng)
    prompts = [system + random_prompt(suffix_len, model.config.vocab_size, rng) for _ in range(n)]
    num_blocks = 2 * blocks_for(system_len + suffix_len + output_len, block_size) * 2
    result = {"requests": n, "system_len": system_len, "suffix_len": suffix_len, "output_len": output_len}
    for caching in (False, True):
        config = EngineConfig(num_blocks, block_size, prefix_caching=caching, scheduler=SchedulerConfig(max_batch=1))
        requests = [Request(p, output_len, arrival=100.0 * i) for i, p in enumerate(prompts)]  # never overlapping
        outputs, _ = _run(model, requests, config, progress=False)
        ttfts = [1e3 * o.metrics.ttft for o in outputs[1:]]
        result["with_cache" if caching else "without_cache"] = {"ttft_ms_mean": float(np.mean(ttfts)),
                                                                "ttft_ms_p50": float(np.median(ttfts))}  # fmt: skip
    with_, without = result["with_cache"]["ttft_ms_mean"], result["without_cache"]["ttft_ms_mean"]
    result["ttft_saving_pct"] = 100 * (1 - with_ / without)
    return result


@torch.inference_mode()
def bench_batching(model: Transformer, n_requests: int = 128, rate: float = 1000.0, max_batch: int = 16,
                   prompt_median: float = 64, output_median: float = 64, max_len: int | None = None,
                   prefix_requests: int = 8, system_len: int = 512, seed: int = 0, repeats: int = 3,
                   progress: bool = False) -> dict:  # fmt: skip
    """All three benchmarks on one chat-like workload (Poisson at ``rate`` requests/s, lognormal
    lengths capped at ``max_len``, by default a quarter of the context)."""
    max_len = max_len or model.config.max_seq_len // 4
    trace = chat_trace(n_requests, rate, prompt_median, 0.8, output_median, 0.8, max_len, seed)
    many = chat_trace(WASTE_SAMPLE, rate, prompt_median, 0.8, output_median, 0.8, max_len, seed)  # a stable estimate
    lengths = [e.prompt_len + e.output_len for e in many]
    requests = requests_from_trace(trace, model.config.vocab_size, seed)
    system_len = min(system_len, model.config.max_seq_len // 2)
    return {"hardware": hardware_description(model.device), "model": model.config.name,
            "params": model.num_params(), "dtype": str(model.dtype).removeprefix("torch."),
            "device": str(model.device), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "workload": {"requests": n_requests, "rate": rate, "prompt_median": prompt_median,
                         "output_median": output_median, "sigma": 0.8, "max_len": max_len, "seed": seed},
            "throughput": bench_throughput(model, requests, max_batch, repeats=repeats, progress=progress),
            "memory_waste": memory_waste(lengths, model.config.max_seq_len),
            "prefix_cache": bench_prefix_cache(model, prefix_requests, system_len)}  # fmt: skip


def check_goals(figures: dict) -> list[dict]:
    """The issue's goals against the figures: MET or NOT MET."""
    waste = next(r["paged_waste_pct"] for r in figures["memory_waste"]["rows"] if r["block_size"] == GOAL_BLOCK_SIZE)
    goals = [(f"continuous >= {GOAL_THROUGHPUT_RATIO}x static output tokens/s", figures["throughput"]["ratio"],
              figures["throughput"]["ratio"] >= GOAL_THROUGHPUT_RATIO),
             (f"paged KV waste <= {GOAL_PAGED_WASTE_PCT}% at block size {GOAL_BLOCK_SIZE}", waste,
              waste <= GOAL_PAGED_WASTE_PCT)]  # fmt: skip
    return [{"goal": g, "measured": m, "status": "MET" if ok else "NOT MET"} for g, m, ok in goals]


def format_batching(figures: dict) -> str:
    """The three results side by side, as text tables, with the hardware line."""
    from .report import format_table

    tp = figures["throughput"]
    rows = [{"policy": p, "tokens/s": tp[p]["output_tokens_per_s"], "requests/s": tp[p]["requests_per_s"],
             "TTFT p50 ms": tp[p]["ttft_ms"]["p50"], "TTFT p99 ms": tp[p]["ttft_ms"]["p99"],
             "TPOT p50 ms": tp[p]["tpot_ms_p50"], "steps": tp[p]["steps"], "preemptions": tp[p]["preemptions"],
             "KV waste % (measured)": tp[p]["measured_kv_waste_pct"]} for p in ("static", "continuous")]  # fmt: skip
    w = figures["memory_waste"]
    pc = figures["prefix_cache"]
    prefix_rows = [{"prefix cache": name, "TTFT mean ms": pc[key]["ttft_ms_mean"],
                    "TTFT p50 ms": pc[key]["ttft_ms_p50"]}
                   for name, key in (("off", "without_cache"), ("on", "with_cache"))]  # fmt: skip
    parts = [
        f"{figures['model']} ({figures['params'] / 1e6:.2f}M params, {figures['dtype']}) on {figures['hardware']}",
        format_table(
            rows,
            title=f"Batching, max batch {tp['max_batch']}, {figures['workload']['requests']} "
            f"requests: continuous / static = {tp['ratio']:.2f}x tokens/s ({tp['steps_ratio']:.2f}x fewer steps)",
        ),  # fmt: skip
        format_table(
            w["rows"],
            title=f"KV memory waste, {WASTE_SAMPLE:,} draws of the workload's lengths (mean {w['mean_length']:.0f} "
            f"tokens; contiguous = {w['max_len']} slots per request)",
        ),  # fmt: skip
        format_table(
            prefix_rows,
            title=f"Prefix cache: {pc['requests']} requests sharing a {pc['system_len']}-token "
            f"system prompt: TTFT saving {pc['ttft_saving_pct']:.0f}%",
        ),  # fmt: skip
        format_table(figures["goals"]) if "goals" in figures else "",
    ]
    return "\n\n".join(p for p in parts if p)


# ---------------------------------------------------------------------------------------------
# Chapter 6: block sizes, shared system prompts


def gather_times(config: ModelConfig, block_sizes: Sequence[int], batch: int = 8, context: int = 512,
                 repeats: int = 15, seed: int = 0) -> dict[int, float]:  # fmt: skip
    """Seconds (the fastest of ``repeats``) to read one layer's K of ``batch`` sequences of
    ``context`` tokens through their block tables (``gather_kv``), per block size; the blocks lie
    scattered in the pool. The block sizes take turns in every round, so drift hits them alike,
    and the fastest run is the one least disturbed by other work on the machine."""
    g = torch.Generator().manual_seed(seed)
    cases = {}
    for bs in block_sizes:
        num_blocks = batch * blocks_for(context, bs)
        pool = torch.randn(num_blocks, bs, config.n_kv_heads, config.head_dim, generator=g)
        cases[bs] = (pool, torch.randperm(num_blocks, generator=g).view(batch, -1))
    times: dict[int, list[float]] = {bs: [] for bs in block_sizes}
    for _ in range(repeats):
        for bs, (pool, tables) in cases.items():
            t0 = time.perf_counter()
            gather_kv(pool, tables).contiguous()
            times[bs].append(time.perf_counter() - t0)
    return {bs: min(t) for bs, t in times.items()}


def block_size_rows(lengths: Sequence[int], block_sizes: Sequence[int], system_len: int = 1000,
                    context: int = 4096) -> list[dict]:  # fmt: skip
    """What the block size decides, per block size: % of KV slots wasted on these final lengths,
    the tokens of a ``system_len``-token system prompt that prefix caching can share (whole blocks
    only), and the entries of one ``context``-token sequence's block table."""
    return [{"block_size": bs, "waste_pct": 100 * kv_waste(lengths, bs),
             "shared_system_tokens": (system_len // bs) * bs, "table_entries": blocks_for(context, bs)}
            for bs in block_sizes]  # fmt: skip


def shared_prompt_savings(config: ModelConfig, prompt_tokens: int = 1000, calls_per_day: float = 1e6,
                          concurrent: int = 64, dtype: str = "bf16", peak_flops: float = 989e12,
                          mfu: float = 0.5) -> dict:  # fmt: skip
    """The arithmetic of one system prompt sent with every call, cached or not.

    Prefill FLOPs count 2 x parameters per token (the matmuls; attention over 1000 tokens adds
    little); the accelerator time assumes ``mfu`` of ``peak_flops``. Memory: one copy of the
    prompt's K/V per concurrent request without sharing, one copy in all with it.
    """
    tokens_per_day = prompt_tokens * calls_per_day
    flops_per_day = 2 * config.num_params() * tokens_per_day
    kv_copy = kv_bytes_per_token(config, dtype) * prompt_tokens
    return {"prompt_tokens_per_day": tokens_per_day, "prefill_flops_per_day": flops_per_day,
            "accelerator_hours_per_day": flops_per_day / (mfu * peak_flops) / 3600,
            "prefill_seconds_per_call": 2 * config.num_params() * prompt_tokens / (mfu * peak_flops),
            "kv_bytes_per_copy": kv_copy, "kv_bytes_unshared": kv_copy * concurrent, "kv_bytes_shared": kv_copy,
            "concurrent": concurrent}  # fmt: skip


def prefix_sharing_memory(config: ModelConfig, n: int = 16, system_len: int = 512, suffix_len: int = 32,
                          output_len: int = 64, block_size: int = 16) -> dict:  # fmt: skip
    """Peak KV blocks of ``n`` requests with one system prompt, with and without the prefix cache
    (the engine's own block tables, on a simulated clock: the counts are exact). The first request
    arrives alone and fills the cache; the others arrive together as its prefill step ends, while it
    still has ``output_len - 1`` tokens to go, so all ``n`` are in flight at once."""
    rng = np.random.default_rng(0)
    system = random_prompt(system_len, config.vocab_size, rng)
    prompts = [system + random_prompt(suffix_len, config.vocab_size, rng) for _ in range(n)]
    need = n * blocks_for(system_len + suffix_len + output_len, block_size)
    out = {"requests": n, "system_len": system_len, "suffix_len": suffix_len, "output_len": output_len,
           "block_size": block_size}  # fmt: skip
    for caching in (False, True):
        cost = StepCost()
        config_ = EngineConfig(need, block_size, caching, SchedulerConfig("continuous", n), cost)
        after_first = cost(0, len(prompts[0]))  # the end of the first request's prefill step
        requests = [Request(p, output_len, arrival=after_first if i else 0.0) for i, p in enumerate(prompts)]
        _, engine = simulate(config, requests, config_)
        key = "with_cache" if caching else "without_cache"
        out[key] = {"peak_blocks": engine.peak_blocks, "prefix_hit_tokens": engine.scheduler.prefix_hit_tokens}
    out["saving_pct"] = 100 * (1 - out["with_cache"]["peak_blocks"] / out["without_cache"]["peak_blocks"])
    return out


# ---------------------------------------------------------------------------------------------
# Chapter 13: the same workload through each policy at several request rates, simulated


def copy_requests(requests: Sequence[Request]) -> list[Request]:
    """Fresh copies (an engine numbers and consumes its requests)."""
    return [Request(list(r.prompt), r.max_tokens, r.arrival, r.params, r.stop_ids, r.id) for r in requests]


def simulate(config: ModelConfig, requests: Sequence[Request], engine_config: EngineConfig) -> tuple[list, Engine]:
    """Serve copies of ``requests`` with the engine's real scheduler and block manager, a
    ``SimulatedModel`` in place of the model, and the clock of ``engine_config.step_cost``."""
    engine = Engine(SimulatedModel(config), engine_config)
    return engine.run(copy_requests(requests)), engine


def serving_figures(outputs: Sequence, engine: Engine, slo: SLO) -> dict:
    """Throughput, TTFT and TPOT p50/p99 (ms), goodput under ``slo`` and the mean rows per step."""
    metrics = [o.metrics for o in outputs]
    tp = throughput(metrics)
    ttft = percentiles([m.ttft for m in metrics], (50, 99))
    tpots = [m.tpot for m in metrics if m.output_tokens > 1]
    tpot = percentiles(tpots, (50, 99)) if tpots else {"p50": float("nan"), "p99": float("nan")}
    good = goodput(metrics, slo)
    return {"tokens_per_s": tp["output_tokens_per_s"], "requests_per_s": tp["requests_per_s"],
            "ttft_p50_ms": 1e3 * ttft["p50"], "ttft_p99_ms": 1e3 * ttft["p99"],
            "tpot_p50_ms": 1e3 * tpot["p50"], "tpot_p99_ms": 1e3 * tpot["p99"],
            "goodput_rps": good, "slo_met_pct": 100 * good / tp["requests_per_s"],
            "mean_batch": float(np.mean([len(r.work) for r in engine.step_log])), "steps": engine.steps,
            "preemptions": engine.scheduler.preemptions}  # fmt: skip


def rate_sweep(config: ModelConfig, rates: Sequence[float], step_cost: StepCost, slo: SLO,
               policies: Sequence[str] = ("static", "dynamic", "continuous"), n_requests: int = 200,
               max_batch: int = 16, block_size: int = 16, timeout: float = 0.05, prompt_median: float = 64,
               output_median: float = 64, max_len: int = 256, num_blocks: int | None = None,
               seed: int = 0) -> list[dict]:  # fmt: skip
    """One chat-like workload (the same lengths at every rate, Poisson arrivals at each rate)
    through each policy, on the simulated clock: one row of ``serving_figures`` per (policy, rate).
    The KV pool holds ``max_batch`` sequences of ``max_len`` tokens unless ``num_blocks`` says."""
    num_blocks = num_blocks or max_batch * blocks_for(max_len, block_size)
    rows = []
    for rate in rates:
        trace = chat_trace(n_requests, rate, prompt_median, 0.8, output_median, 0.8, max_len, seed)
        requests = requests_from_trace(trace, config.vocab_size, seed)
        for policy in policies:
            sched = SchedulerConfig(policy, max_batch, timeout=timeout)
            outputs, engine = simulate(config, requests, EngineConfig(num_blocks, block_size, False, sched, step_cost))
            rows.append({"policy": policy, "rate": rate, **serving_figures(outputs, engine, slo)})
    return rows


def itl_figures(outputs: Sequence, ids: Sequence[int]) -> dict:
    """Inter-token gaps (ms) of the requests ``ids``: p50, p99 and the largest, and their TPOT p99."""
    chosen = [o for o in outputs if o.request.id in set(ids)]
    gaps = [1e3 * g for o in chosen for g in o.metrics.itl]
    p = percentiles(gaps, (50, 99))
    return {"itl_p50_ms": p["p50"], "itl_p99_ms": p["p99"], "itl_max_ms": max(gaps),
            "tpot_p99_ms": 1e3 * percentiles([o.metrics.tpot for o in chosen], (99,))["p99"]}  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Plots (matplotlib is imported inside each function)

POLICY_COLORS = {"static": "tab:red", "dynamic": "tab:orange", "continuous": "tab:blue"}


def plot_batch_timeline(step_logs: dict, max_batch: int, title: str = ""):
    """Who rides in each batch row at each step: one panel per policy, one color per request,
    padding rows (finished members of a static batch, still computed) hatched gray."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(step_logs), 1, figsize=(10, 1.1 + 0.45 * max_batch * len(step_logs)), sharex=True)
    axes = np.atleast_1d(axes)
    cmap = plt.get_cmap("tab20")
    for ax, (name, log) in zip(axes, step_logs.items()):
        for r in log:
            x, w = 1e3 * r.start, 1e3 * r.duration
            for row, (rid, n) in enumerate(r.work):
                ax.broken_barh([(x, w)], (row + 0.1, 0.8), color=cmap(rid % 20), alpha=1.0 if n == 1 else 0.55)
            for row in range(len(r.work), len(r.work) + r.padding_rows):
                ax.broken_barh([(x, w)], (row + 0.1, 0.8), facecolor="none", edgecolor="gray", hatch="////", lw=0)
        ax.set(ylim=(0, max_batch), ylabel="batch row", yticks=range(max_batch))
        ax.set_title(f"{name}: {len(log)} steps", fontsize=10, loc="left")
        ax.grid(False)
    axes[-1].set_xlabel("time (ms, simulated)")
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def plot_step_costs(records: Sequence, cost: StepCost, title: str = ""):
    """Measured step durations beside the fitted cost: decode-only steps against their rows,
    prefill-only steps against their prompt tokens."""
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    decode = [r for r in records if r.prefill_tokens == 0]
    prefill = [r for r in records if r.decode_rows == 0]
    ax1.plot([r.decode_rows for r in decode], [1e3 * r.duration for r in decode], ".", alpha=0.4, label="measured step")
    b = np.arange(1, max([r.decode_rows for r in decode], default=1) + 1)
    ax1.plot(b, 1e3 * (cost.fixed + cost.per_token * b), "k-",
             label=f"fit: {1e3 * cost.fixed:.1f} ms + {1e3 * cost.per_token:.2f} ms/row")  # fmt: skip
    ax1.set(xlabel="decode rows in the step (batch)", ylabel="step time (ms)", title="decode steps")
    ax2.plot([r.prefill_tokens for r in prefill], [1e3 * r.duration for r in prefill], ".", alpha=0.6,
             label="measured step")  # fmt: skip
    t = np.linspace(0, max([r.prefill_tokens for r in prefill], default=1), 50)
    ax2.plot(t, 1e3 * (cost.fixed + cost.prefill_rate * t), "k-",
             label=f"fit: {1e3 * cost.fixed:.1f} ms + {1e3 * cost.prefill_rate:.3f} ms/token")  # fmt: skip
    ax2.set(xlabel="prompt tokens in the step", ylabel="step time (ms)", title="prefill-only steps")
    ax1.legend()
    ax2.legend()
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def plot_rate_sweep(rows: Sequence[dict], slo: SLO, title: str = ""):
    """Four panels against the request rate, one line per policy: throughput, p99 TTFT and p99
    TPOT (with the SLO's bounds) and goodput."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(10, 6.5), sharex=True)
    panels = [
        ("tokens_per_s", "output tokens/s", None),
        ("ttft_p99_ms", "TTFT p99 (ms)", 1e3 * slo.ttft),
        ("tpot_p99_ms", "TPOT p99 (ms)", 1e3 * slo.tpot),
        ("goodput_rps", "goodput (requests/s in SLO)", None),
    ]
    for ax, (key, label, bound) in zip(axes.flat, panels):
        for policy in dict.fromkeys(r["policy"] for r in rows):
            mine = [r for r in rows if r["policy"] == policy]
            ax.plot([r["rate"] for r in mine], [r[key] for r in mine], "o-", color=POLICY_COLORS.get(policy),
                    label=policy)  # fmt: skip
        if bound is not None:
            ax.axhline(bound, color="gray", ls="--", lw=1, label="SLO")
        if key == "ttft_p99_ms":
            ax.set_yscale("log")
        ax.set(ylabel=label)
    for ax in axes[1]:
        ax.set_xlabel("offered load (requests/s)")
    axes[0, 0].legend()
    axes[0, 1].legend()
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def plot_latency_throughput(rows: Sequence[dict], slo: SLO, title: str = ""):
    """The latency-throughput curve: each point one request rate, p99 TTFT and p50 TPOT against
    the throughput achieved; a policy is better where its curve lies lower and further right."""
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    for policy in dict.fromkeys(r["policy"] for r in rows):
        mine = sorted((r for r in rows if r["policy"] == policy), key=lambda r: r["rate"])
        x = [r["tokens_per_s"] for r in mine]
        ax1.plot(x, [r["ttft_p99_ms"] for r in mine], "o-", color=POLICY_COLORS.get(policy), label=policy)
        ax2.plot(x, [r["tpot_p50_ms"] for r in mine], "o-", color=POLICY_COLORS.get(policy), label=policy)
    ax1.axhline(1e3 * slo.ttft, color="gray", ls="--", lw=1, label="SLO")
    ax2.axhline(1e3 * slo.tpot, color="gray", ls="--", lw=1, label="SLO (p99 bound)")
    ax1.set(xlabel="throughput (output tokens/s)", ylabel="TTFT p99 (ms)", yscale="log")
    ax2.set(xlabel="throughput (output tokens/s)", ylabel="TPOT p50 (ms)")
    ax1.legend()
    ax2.legend()
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def plot_itl(runs: dict, ids: Sequence[int], title: str = ""):
    """Each output token's gap since the previous one (ms) against time, for the requests ``ids``,
    one panel per run (e.g. with and without chunked prefill)."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(runs), figsize=(5 * len(runs), 3.6), sharey=True)
    for ax, (name, outputs) in zip(np.atleast_1d(axes), runs.items()):
        for o in outputs:
            if o.request.id in set(ids):
                t = o.metrics.token_times
                ax.plot(t[1:], [1e3 * g for g in o.metrics.itl], ".-", ms=3, lw=0.6)
        ax.set(xlabel="time (s, measured)", title=name)
    np.atleast_1d(axes)[0].set_ylabel("gap before each token (ms)")
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def interference_workload(vocab_size: int, n_chat: int = 6, chat_prompt: int = 32, chat_tokens: int = 160,
                          n_long: int = 5, long_prompt: int = 640, long_tokens: int = 8, first: float = 0.15,
                          gap: float = 0.3, seed: int = 0) -> tuple[list[Request], list[int]]:  # fmt: skip
    """Requests that are decoding (``n_chat`` short prompts, long answers, all at time 0) while long
    prompts arrive every ``gap`` seconds from ``first``: the case chunked prefill is for. Returns
    the requests and the ids of the decoding ones, whose inter-token gaps show the stalls."""
    rng = np.random.default_rng(seed)
    chat = [Request(random_prompt(chat_prompt, vocab_size, rng), chat_tokens, 0.0, id=i) for i in range(n_chat)]
    long = [Request(random_prompt(long_prompt, vocab_size, rng), long_tokens, first + gap * j, id=n_chat + j)
            for j in range(n_long)]  # fmt: skip
    return chat + long, [r.id for r in chat]


def capacity(cost: StepCost, mean_prompt: float, mean_output: float, max_batch: int) -> float:
    """Requests/s a server can finish at best, by the cost model: each request's share of full
    decode steps, plus its prompt's tokens and one forward's fixed cost for its prefill."""
    seconds = mean_output * cost(max_batch) / max_batch + mean_prompt * cost.prefill_rate + cost.fixed
    return 1.0 / seconds
