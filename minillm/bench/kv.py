"""Shrinking the KV cache, measured: the bytes and the decode speed of each technique of chapter 5.

- ``techniques`` lists each way to shrink the cache as a model variant (K/V heads) plus a cache
  kind: GQA and MQA (``minillm.kv.gqa``), and the compressed kinds of ``minillm.kv.compressed``.
- ``decode_tokens_per_s`` times decoding against a cache that already holds ``context`` tokens
  (``fill_with_random`` puts them there without running the model).
- ``kv_benchmark`` does it for every technique side by side, through the timing harness
  (``minillm.measure.timing``), with the options of a ``KVBench``; ``bench_kv`` is the figures of
  ``python -m minillm bench kv``, with their provenance; ``summary_rows`` puts them beside the
  perplexity each technique costs (``minillm.measure.quality``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..core.cache import Cache, KVCache, SlotBuffers
from ..core.config import ModelConfig, preset
from ..core.device import best_device
from ..core.model import Transformer, random_model
from ..kv.compressed import CrossLayerKVCache, QuantizedKVCache, SelectiveKVCache, SlidingWindowCache
from ..kv.gqa import gqa_heads
from ..kv.memory import format_bytes
from ..measure.report import finish_provenance, format_table, provenance
from ..measure.timing import interleaved


@dataclass
class KVBench:
    """How to run the KV benchmark; ``device`` and ``dtype`` default to the best device and to
    bfloat16 on CUDA, float32 elsewhere."""

    contexts: Sequence[int] = (256, 1024, 4096)  # tokens already in the cache when decoding is timed
    batch: int = 1  # sequences decoded together
    new_tokens: int = 16  # decode steps per timed run
    repeats: int = 3  # timed runs of each technique, taking turns; the median is reported
    device: str | torch.device | None = None
    dtype: torch.dtype | None = None
    progress: bool = False  # a progress bar per context (on stderr)

    def __post_init__(self):
        self.contexts = tuple(self.contexts)
        if not self.contexts or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in self.contexts):
            raise ValueError(f"contexts must be positive integers, got {list(self.contexts)}")
        for name in ("batch", "new_tokens", "repeats"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.device = torch.device(self.device) if self.device is not None else best_device()
        if self.dtype is None:
            self.dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating-point torch dtype, got {self.dtype!r}")


def dtype_name(dtype: torch.dtype | str) -> str:
    return str(dtype).removeprefix("torch.")


SHORT_DTYPE = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}  # the glossary's names


def fill_with_random(cache: SlotBuffers, config: ModelConfig, context: int, chunk: int = 1024) -> None:
    """Put ``context`` tokens of random K/V into a cache through its own interface (no model run):
    decode speed does not depend on the values, and the prefill is not what is timed."""
    dtype, device = cache.k.dtype if cache.k.is_floating_point() else torch.float32, cache.k.device
    B = cache.batch_size
    for s in range(0, context, chunk):
        e = min(s + chunk, context)
        cache.reserve(torch.arange(s, e, device=device).expand(B, -1))
        for layer in range(config.n_layers):
            shape = (B, config.n_kv_heads, e - s, config.head_dim)
            k, v = torch.randn(shape, dtype=dtype, device=device), torch.randn(shape, dtype=dtype, device=device)
            k_all, _ = cache.update(layer, k, v)
            if cache.wants_attention:
                cache.record_attention(layer, torch.rand(B, 1, e - s, k_all.shape[2], device=device))


@torch.inference_mode()
def decode_steps(model: Transformer, cache: Cache, new_tokens: int) -> None:
    """``new_tokens`` greedy-shaped decode steps of one token per row (the values do not matter)."""
    token = torch.zeros(cache.batch_size, 1, dtype=torch.long, device=model.device)
    for _ in range(new_tokens):
        model(token, cache=cache)


def roll_back(cache: Cache, new_tokens: int) -> None:
    """Put a contiguous cache back at its context, so that every run decodes from the same place;
    the other kinds have a fixed size anyway (and those that evict cannot roll back)."""
    if isinstance(cache, KVCache):
        cache.truncate(cache.length - new_tokens)


def decode_tokens_per_s(
    model: Transformer, cache: Cache, context: int, new_tokens: int = 16, repeats: int = 3
) -> float:
    """Median decode tokens/s (batch x steps / s) against a cache already holding ``context`` tokens."""
    fill_with_random(cache, model.config, context)
    timing = interleaved(
        {"decode": lambda: decode_steps(model, cache, new_tokens)},
        repeats,
        model.device,
        after=lambda _: roll_back(cache, new_tokens),
    )["decode"]
    return cache.batch_size * new_tokens / timing.median


@dataclass
class Technique:
    name: str
    kv_heads: Callable[[ModelConfig], int]  # the model variant: K/V heads
    make_cache: Callable[[Transformer, int, int], Cache]  # (model, batch, max_len) -> an empty cache
    retrain: str  # what it takes to use it on a trained model


def techniques(window: int = 256, budget: int = 256, group: int = 2, n_heads: int | None = None) -> list[Technique]:
    """Each way to shrink the cache, as a model variant plus a cache kind. With ``n_heads`` (the
    query heads of the model measured) GQA and MQA are named by their K/V-head counts."""

    def same(c: ModelConfig) -> int:
        return c.n_kv_heads

    def contiguous(m: Transformer, b: int, n: int) -> Cache:
        return KVCache.for_model(m, b, n)

    def selective(policy: str) -> Callable[[Transformer, int, int], Cache]:
        return lambda m, b, n: SelectiveKVCache.for_model(m, b, min(budget, n), policy=policy)

    gqa = f"GQA ({gqa_heads(n_heads)} of {n_heads} K/V heads)" if n_heads else "GQA (about 1/4 of the K/V heads)"
    mqa = f"MQA (1 of {n_heads} K/V heads)" if n_heads else "MQA (1 K/V head)"
    return [
        Technique("MHA (baseline)", same, contiguous, "-"),
        Technique(gqa, lambda c: gqa_heads(c.n_heads), contiguous, "convert + uptrain"),
        Technique(mqa, lambda c: 1, contiguous, "convert + uptrain"),
        Technique(
            f"cross-layer, groups of {group}",
            same,
            lambda m, b, n: CrossLayerKVCache.for_model(m, b, n, group=group),
            "yes (train with sharing)",
        ),
        Technique("int8 KV", same, lambda m, b, n: QuantizedKVCache.for_model(m, b, n), "no"),
        Technique(
            f"sliding window {window}",
            same,
            lambda m, b, n: SlidingWindowCache.for_model(m, b, window=min(window, n)),
            "best trained with it",
        ),
        Technique(f"sinks + recent, {budget} tokens", same, selective("recent"), "no"),
        Technique(f"heavy hitters, {budget} tokens", same, selective("heavy"), "no"),
    ]


def kv_benchmark(config: ModelConfig, options: KVBench, chosen: Sequence[Technique] | None = None) -> list[dict]:
    """KV bytes and decode tokens/s of every technique at every context, on random-weight models.

    At each context the techniques take turns (``interleaved``), one timed run each per round, so
    that a slow spell of a shared machine hits them all alike; the median over rounds is reported.
    """
    chosen = chosen or techniques()
    o = options
    # Caches that cannot roll back keep counting positions: the warm-up and every timed run.
    need = max(o.contexts) + o.new_tokens * (o.repeats + 1) + 1
    config = config.replace(max_seq_len=max(config.max_seq_len, need))
    models: dict[int, Transformer] = {}
    for heads in {tech.kv_heads(config) for tech in chosen}:
        models[heads] = random_model(config.replace(n_kv_heads=heads), o.device, o.dtype)
    by_tech = {tech.name: (tech, models[tech.kv_heads(config)]) for tech in chosen}
    return [row for ctx in o.contexts for row in _rows_at(ctx, by_tech, o)]


def _rows_at(context: int, chosen: dict[str, tuple[Technique, Transformer]], o: KVBench) -> list[dict]:
    """Every technique at one context, taking turns (the caches are freed on return)."""
    caches: dict[str, Cache] = {}
    for name, (tech, model) in chosen.items():
        caches[name] = tech.make_cache(model, o.batch, context + o.new_tokens + 1)
        fill_with_random(caches[name], model.config, context)
    timings = interleaved(
        {name: lambda m=model, c=caches[name]: decode_steps(m, c, o.new_tokens) for name, (_, model) in chosen.items()},
        o.repeats,
        o.device,
        after=lambda name: roll_back(caches[name], o.new_tokens),
        progress=f"context {context}" if o.progress else None,
    )
    rows = []
    for name, (tech, model) in chosen.items():
        held = tech.make_cache(model, o.batch, context)  # sized for exactly this context
        tokens_per_s = o.batch * o.new_tokens / timings[name].median
        row = {"technique": name, "kv_heads": model.config.n_kv_heads, "context": context, "dtype": dtype_name(o.dtype)}
        rows.append({**row, "kv_bytes": held.nbytes, "tokens_per_s": tokens_per_s, "retrain": tech.retrain})
    return rows


def mha_shape(name: str) -> ModelConfig:
    """A preset shape made multi-head (the techniques start from MHA)."""
    try:
        base = preset(name)
    except KeyError as e:
        raise ValueError(e.args[0]) from e
    return base.replace(n_kv_heads=base.n_heads, name=f"{base.name} as MHA")


def bench_kv(config: ModelConfig, options: KVBench) -> dict:
    """The benchmark command's figures: every technique on a random-weight model of ``config``'s
    shape (``mha_shape``), with where they were measured (``provenance``)."""
    o = options
    result = provenance(
        o.device,
        model=config.name,
        dtype=o.dtype,
        parameters=config.num_params(),
        batch=o.batch,
        new_tokens=o.new_tokens,
        repeats=o.repeats,
        contexts=list(o.contexts),
    )
    rows = kv_benchmark(config, o, techniques(n_heads=config.n_heads))
    baseline = {r["context"]: r for r in rows if r["technique"] == "MHA (baseline)"}
    for r in rows:
        r["memory_vs_mha"] = r["kv_bytes"] / baseline[r["context"]]["kv_bytes"]
        r["speed_vs_mha"] = r["tokens_per_s"] / baseline[r["context"]]["tokens_per_s"]
    result["rows"] = rows
    return finish_provenance(result)


def format_kv_bench(result: dict) -> str:
    rows = [
        {
            **r,
            "kv": format_bytes(r["kv_bytes"]),
            "memory": f"{r['memory_vs_mha']:.3f}x",
            "speed": f"{r['speed_vs_mha']:.2f}x",
        }
        for r in result["rows"]
    ]
    title = (
        f"{result['model']}, {result['dtype']}, batch {result['batch']}, random weights, on {result['hardware']}"
        f" (median of {result['repeats']} x {result['new_tokens']} decode steps)"
    )
    columns = {
        "technique": "technique",
        "context": "context",
        "kv": "KV bytes",
        "memory": "vs MHA",
        "tokens_per_s": "decode tok/s",
        "speed": "vs MHA",
        "retrain": "retraining",
    }
    return format_table(rows, columns, title=title)


def summary_rows(
    bench_rows: Sequence[dict],
    perplexity: dict[str, float],
    baseline_ppl: float,
    dtype: torch.dtype | str | None = None,
) -> list[dict]:
    """One row per technique: KV memory saved and decode speed, both against MHA in the dtype the
    benchmark ran in (from ``kv_benchmark`` at its longest context; the headers name that baseline),
    perplexity change (from ``perplexity``, keyed by technique name), retraining."""
    longest = max(r["context"] for r in bench_rows)
    rows = [r for r in bench_rows if r["context"] == longest]
    base = next(r for r in rows if r["technique"].startswith("MHA"))
    dtype = dtype_name(dtype) if dtype is not None else base.get("dtype")
    baseline = f"{SHORT_DTYPE.get(dtype, dtype)} MHA" if dtype else "MHA"

    def ppl_change(name: str) -> str:
        if name not in perplexity:
            return "not measured"
        change = round(perplexity[name] - baseline_ppl, 1) or 0.0  # never "-0.0"
        return f"{change:+.1f}"

    return [
        {
            "technique": r["technique"],
            f"KV memory saved vs {baseline}": f"{1 - r['kv_bytes'] / base['kv_bytes']:.0%}",
            f"decode speed vs {baseline}": f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x",
            "perplexity change": ppl_change(r["technique"]),
            "retraining": r["retrain"],
        }
        for r in rows
    ]
