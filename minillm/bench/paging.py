"""Chapter 6's measurements and counts: the KV memory paging saves, what the block size decides,
and what a shared system prompt costs with and without the prefix cache.

- ``memory_waste``: % of reserved KV slots left empty, contiguous max-length reservations against
  paging at several block sizes, on the final lengths of many requests;
- ``waste_while_growing``: the same waste counted at every length a sequence passes through;
- ``block_size_rows`` and ``gather_times``: per block size, the waste, the tokens of a system
  prompt prefix caching can share, the block table's size, and the time to read K through tables;
- ``bench_prefix_cache``: TTFT of requests sharing a system prompt, with and without the cache
  (measured); ``prefix_sharing_memory``: their peak KV blocks (exact, on the simulated clock);
- ``shared_prompt_savings``: the arithmetic of one system prompt sent with every call.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import numpy as np
import torch

from ..core.config import ModelConfig
from ..core.model import Transformer
from ..kv.memory import kv_bytes_per_token
from ..kv.paged import blocks_for, gather_kv, kv_waste
from ..measure.metrics import percentiles
from ..measure.timing import interleaved
from ..serving.engine import EngineConfig, StepCost
from ..serving.scheduler import SchedulerConfig
from ..serving.workload import Request, random_prompt
from .serving import run_measured, simulate


def memory_waste(lengths: Sequence[int], max_len: int, block_sizes: Sequence[int] = (8, 16, 32)) -> dict:
    """% of reserved KV slots left empty: contiguous ``max_len`` per sequence vs paging, per block size."""
    contiguous = 100 * kv_waste(lengths, None, max_len)
    rows = [
        {"block_size": bs, "paged_waste_pct": 100 * kv_waste(lengths, bs), "contiguous_waste_pct": contiguous}
        for bs in block_sizes
    ]
    return {"max_len": max_len, "sequences": len(lengths), "mean_length": float(np.mean(lengths)), "rows": rows}


def bench_prefix_cache(
    model: Transformer,
    n: int = 8,
    system_len: int = 512,
    suffix_len: int = 32,
    output_len: int = 8,
    block_size: int = 16,
    seed: int = 0,
) -> dict:
    """TTFT of ``n`` requests sharing a ``system_len``-token system prompt, served one at a time,
    with and without the prefix cache; the first request fills the cache, so only the rest count."""
    rng = np.random.default_rng(seed)
    system = random_prompt(system_len, model.config.vocab_size, rng)
    prompts = [system + random_prompt(suffix_len, model.config.vocab_size, rng) for _ in range(n)]
    num_blocks = 2 * blocks_for(system_len + suffix_len + output_len, block_size) * 2
    result = {"requests": n, "system_len": system_len, "suffix_len": suffix_len, "output_len": output_len}
    requests = [Request(p, output_len, arrival=100.0 * i) for i, p in enumerate(prompts)]  # never overlapping
    for caching in (False, True):
        config = EngineConfig(num_blocks, block_size, prefix_caching=caching, scheduler=SchedulerConfig(max_batch=1))
        outputs, _ = run_measured(model, requests, config)
        ttfts = [1e3 * o.metrics.ttft for o in outputs[1:]]
        key = "with_cache" if caching else "without_cache"
        result[key] = {"ttft_ms_mean": float(np.mean(ttfts)), "ttft_ms_p50": float(np.median(ttfts))}
    with_, without = result["with_cache"]["ttft_ms_mean"], result["without_cache"]["ttft_ms_mean"]
    result["ttft_saving_pct"] = 100 * (1 - with_ / without)
    return result


def gather_times(
    config: ModelConfig,
    block_sizes: Sequence[int],
    batch: int = 8,
    context: int = 512,
    repeats: int = 21,
    seed: int = 0,
) -> dict[int, dict[str, float]]:
    """Milliseconds to read one layer's K of ``batch`` sequences of ``context`` tokens through
    their block tables (``gather_kv``), per block size: the median of ``repeats`` and the 25th and
    75th percentiles (``q1_ms``, ``q3_ms``), whose gap measures the noise.
    The blocks lie scattered in the pool. The block sizes take turns in every round (the timing
    harness), so drift hits them alike, after ``repeats`` untimed rounds: the first copies of a
    process also pay for fresh memory from the operating system, which is not the gather."""
    g = torch.Generator().manual_seed(seed)
    contenders = {}
    for bs in block_sizes:
        num_blocks = batch * blocks_for(context, bs)
        pool = torch.randn(num_blocks, bs, config.n_kv_heads, config.head_dim, generator=g)
        tables = torch.randperm(num_blocks, generator=g).view(batch, -1)
        contenders[str(bs)] = partial(_gather, pool, tables)
    timings = interleaved(contenders, repeats, device="cpu", warmup=repeats)
    out = {}
    for bs in block_sizes:
        t = timings[str(bs)]
        q = percentiles(t.seconds, (25, 75))
        out[bs] = {"median_ms": t.median_ms, "q1_ms": 1e3 * q["p25"], "q3_ms": 1e3 * q["p75"]}
    return out


def waste_while_growing(prompt_lens: Sequence[int], final_lens: Sequence[int], block_size: int) -> float:
    """Fraction of the KV slots held in blocks that stay empty, counting each sequence once at
    every length it holds while it decodes (its prompt, then one token more per step, up to one
    short of its final length): the waste a server sees over time, not at the end."""
    lengths = [n for p, f in zip(prompt_lens, final_lens, strict=True) for n in range(p, max(f, p + 1))]
    return kv_waste(lengths, block_size)


def _gather(pool: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    return gather_kv(pool, tables).contiguous()


def block_size_rows(
    lengths: Sequence[int], block_sizes: Sequence[int], system_len: int = 1000, context: int = 4096
) -> list[dict]:
    """What the block size decides, per block size: % of KV slots wasted on these final lengths,
    the tokens of a ``system_len``-token system prompt that prefix caching can share (whole blocks
    only), and the entries of one ``context``-token sequence's block table."""
    return [
        {
            "block_size": bs,
            "waste_pct": 100 * kv_waste(lengths, bs),
            "shared_system_tokens": (system_len // bs) * bs,
            "table_entries": blocks_for(context, bs),
        }
        for bs in block_sizes
    ]


def shared_prompt_savings(
    config: ModelConfig,
    prompt_tokens: int = 1000,
    calls_per_day: float = 1e6,
    concurrent: int = 64,
    dtype: str = "bf16",
    peak_flops: float = 989e12,
    mfu: float = 0.5,
) -> dict:
    """The arithmetic of one system prompt sent with every call, cached or not.

    Prefill FLOPs count 2 x parameters per token (the matmuls; attention over 1000 tokens adds
    little); the accelerator time assumes ``mfu`` of ``peak_flops``. Memory: one copy of the
    prompt's K/V per concurrent request without sharing, one copy in all with it.
    """
    tokens_per_day = prompt_tokens * calls_per_day
    flops_per_day = 2 * config.num_params() * tokens_per_day
    kv_copy = kv_bytes_per_token(config, dtype) * prompt_tokens
    return {
        "prompt_tokens_per_day": tokens_per_day,
        "prefill_flops_per_day": flops_per_day,
        "accelerator_hours_per_day": flops_per_day / (mfu * peak_flops) / 3600,
        "prefill_seconds_per_call": 2 * config.num_params() * prompt_tokens / (mfu * peak_flops),
        "kv_bytes_per_copy": kv_copy,
        "kv_bytes_unshared": kv_copy * concurrent,
        "kv_bytes_shared": kv_copy,
        "concurrent": concurrent,
    }


def prefix_sharing_memory(
    config: ModelConfig,
    n: int = 16,
    system_len: int = 512,
    suffix_len: int = 32,
    output_len: int = 64,
    block_size: int = 16,
) -> dict:
    """Peak KV blocks of ``n`` requests with one system prompt, with and without the prefix cache
    (the engine's own block tables, on a simulated clock: the counts are exact). The first request
    arrives alone and fills the cache; the others arrive together as its prefill step ends, while it
    still has ``output_len - 1`` tokens to go, so all ``n`` are in flight at once."""
    rng = np.random.default_rng(0)
    system = random_prompt(system_len, config.vocab_size, rng)
    prompts = [system + random_prompt(suffix_len, config.vocab_size, rng) for _ in range(n)]
    need = n * blocks_for(system_len + suffix_len + output_len, block_size)
    out = {"requests": n, "system_len": system_len, "suffix_len": suffix_len, "output_len": output_len}
    out["block_size"] = block_size
    cost = StepCost()
    after_first = cost(0, len(prompts[0]))  # the end of the first request's prefill step
    requests = [Request(p, output_len, arrival=after_first if i else 0.0) for i, p in enumerate(prompts)]
    for caching in (False, True):
        engine_config = EngineConfig(need, block_size, caching, SchedulerConfig("continuous", n), cost)
        _, engine = simulate(config, requests, engine_config)
        key = "with_cache" if caching else "without_cache"
        out[key] = {"peak_blocks": engine.peak_blocks, "prefix_hit_tokens": engine.scheduler.prefix_hit_tokens}
    out["saving_pct"] = 100 * (1 - out["with_cache"]["peak_blocks"] / out["without_cache"]["peak_blocks"])
    return out
