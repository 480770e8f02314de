"""Shrinking the KV cache, measured: memory, decode speed and quality of each technique.

- ``to_gqa`` turns a multi-head model into a grouped-query one by mean-pooling the K and V
  heads of each group (Ainslie et al., 2023); ``uptrain`` gives it a few steps to adapt.
- ``streaming_loss`` runs text through any cache kind, so that a cache's evictions, windows
  or quantization show up as a change in perplexity.
- ``decode_tokens_per_s`` times decoding against a cache that already holds ``context``
  tokens; ``kv_benchmark`` does it for every technique side by side.
- ``hybrid_kv_bytes`` is the arithmetic of combining them (MQA + mostly-local attention +
  cross-layer sharing), as Character.AI described for its serving models (2024).
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..core.cache import CrossLayerKVCache, KVCache, QuantizedKVCache, SelectiveKVCache, SlidingWindowCache
from ..core.config import ModelConfig
from ..core.device import synchronize
from ..core.model import Transformer, random_model
from .memory import bytes_per_element


def to_gqa(model: Transformer, n_kv_heads: int) -> Transformer:
    """A copy of ``model`` with ``n_kv_heads`` K/V heads, each the mean of the heads of its group.

    Query head h reads K/V head h // (n_heads / n_kv_heads), so each group is a run of
    adjacent heads. n_kv_heads = 1 gives MQA; the queries and everything else are unchanged.
    """
    cfg = model.config
    if n_kv_heads <= 0 or cfg.n_kv_heads % n_kv_heads:
        raise ValueError(f"n_kv_heads must divide the model's {cfg.n_kv_heads} K/V heads, got {n_kv_heads}")
    new = Transformer(cfg.replace(n_kv_heads=n_kv_heads)).to(device=model.device, dtype=model.dtype)
    state = model.state_dict()
    H, Hkv, hd, g = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.n_kv_heads // n_kv_heads
    for i in range(cfg.n_layers):
        for kind in ("weight", "bias"):
            key = f"layers.{i}.self_attn.qkv_proj.{kind}"
            if key not in state:
                continue
            w = state[key]
            q, k, v = w.split([H * hd, Hkv * hd, Hkv * hd])
            pool = lambda t: t.view(n_kv_heads, g, hd, *t.shape[1:]).mean(dim=1).flatten(0, 1)  # noqa: E731
            state[key] = torch.cat([q, pool(k), pool(v)])
    new.load_state_dict(state)
    return new.eval()


def uptrain(model: Transformer, steps: int, seq_len: int = 128, batch_size: int = 8, lr: float = 5e-4,
            seed: int = 0, valid_ids: torch.Tensor | None = None, eval_every: int | None = None,
            progress: bool = False) -> dict:  # fmt: skip
    """A short continued pretraining on the bundled corpus (the GQA paper's "uptraining").
    Returns fit's log; with ``valid_ids``, the validation loss every ``eval_every`` steps."""
    from ..training.train import TrainConfig, encode_split, fit, load_tokenizer

    ids = encode_split(load_tokenizer(), "train")
    tc = TrainConfig(steps=steps, batch_size=batch_size, seq_len=seq_len, lr=lr, warmup=max(1, steps // 10),
                     eval_every=eval_every or steps, seed=seed)  # fmt: skip
    return fit(model, tc, ids, valid_ids, progress)


def uptrain_curves(model: Transformer, kv_heads: Sequence[int], steps: int, eval_every: int, valid_ids: torch.Tensor,
                   progress: bool = True, **options) -> dict:  # fmt: skip
    """Validation perplexity during uptraining of each K/V-head count (the model's own count is the
    control: the same extra training without the conversion). {n_kv_heads: [(step, ppl), ...]}."""
    from ..training.train import evaluate

    curves = {}
    for n in kv_heads:
        variant = to_gqa(model, n)
        start = evaluate(variant, valid_ids, options.get("seq_len", 128))
        log = uptrain(variant, steps, valid_ids=valid_ids, eval_every=eval_every, progress=progress, **options)
        curves[n] = [(0, math.exp(start))] + [(s, math.exp(loss)) for s, loss in log["valid_loss"]]
    return curves


@torch.inference_mode()
def streaming_loss(model: Transformer, ids: torch.Tensor, cache=None, chunk: int | None = None) -> float:
    """Mean next-token loss (nats) of ``ids`` (N,) fed ``chunk`` tokens at a time through ``cache``.

    Without a cache the whole text is one forward (full attention). With one, every chunk
    sees only what the cache kept, so evictions and quantization cost what they cost.
    """
    ids = ids.to(model.device)[None]  # (1, N)
    chunk = chunk or ids.shape[1]
    total, n = 0.0, ids.shape[1] - 1
    for s in range(0, n, chunk):
        logits = model(ids[:, s : min(s + chunk, n)], cache=cache)  # (1, c, V)
        target = ids[:, s + 1 : s + 1 + logits.shape[1]]
        total += F.cross_entropy(logits[0].float(), target[0], reduction="sum").item()
    return total / n


def mean_perplexity(model: Transformer, segments: Sequence[torch.Tensor], make_cache=None, chunk=None) -> float:
    """exp(mean loss) over text segments, a fresh cache from ``make_cache(model)`` for each."""
    losses = [streaming_loss(model, seg, make_cache(model) if make_cache else None, chunk) for seg in segments]
    return math.exp(sum(losses) / len(losses))


def fill_with_random(cache, config: ModelConfig, context: int, chunk: int = 1024) -> None:
    """Put ``context`` tokens of random K/V into any cache through its own interface (no model run):
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
            if getattr(cache, "wants_attention", False):
                cache.record_attention(layer, torch.rand(B, 1, e - s, k_all.shape[2], device=device))


@torch.inference_mode()
def _timed_decode(model: Transformer, cache, new_tokens: int) -> float:
    """Tokens/s of ``new_tokens`` decode steps; a cache that can roll back is left where it was."""
    B, device = cache.batch_size, model.device
    token = torch.zeros(B, 1, dtype=torch.long, device=device)
    synchronize(device)
    t0 = time.perf_counter()
    for _ in range(new_tokens):
        model(token, cache=cache)
    synchronize(device)
    rate = B * new_tokens / (time.perf_counter() - t0)
    if isinstance(cache, KVCache):  # the same context for every repeat; the others have a fixed size anyway
        cache.truncate(cache.length - new_tokens)
    return rate


def _prepare(model: Transformer, cache, context: int):
    """The cache filled with ``context`` tokens and one warm-up decode step done."""
    fill_with_random(cache, model.config, context)
    _timed_decode(model, cache, 1)
    return cache


@torch.inference_mode()
def decode_tokens_per_s(model: Transformer, cache, context: int, new_tokens: int = 16, repeats: int = 3) -> float:
    """Median decode tokens/s (batch x steps / s) against a cache already holding ``context`` tokens."""
    _prepare(model, cache, context)
    return statistics.median(_timed_decode(model, cache, new_tokens) for _ in range(repeats))


@dataclass
class Technique:
    name: str
    kv_heads: Callable[[ModelConfig], int]  # the model variant: K/V heads
    make_cache: Callable[[Transformer, int, int], object]  # (model, batch, max_len) -> an empty cache
    retrain: str  # what it takes to use it on a trained model


def gqa_heads(n_heads: int, ratio: int = 4) -> int:
    """The divisor of n_heads nearest n_heads / ratio (more than 1 K/V head where possible)."""
    divisors = [d for d in range(2, n_heads) if n_heads % d == 0] or [1]
    return min(divisors, key=lambda d: (abs(d - n_heads / ratio), d))


def techniques(window: int = 256, budget: int = 256, group: int = 2) -> list[Technique]:
    """Each way to shrink the cache, as a model variant plus a cache kind."""
    same = lambda c: c.n_kv_heads  # noqa: E731
    contiguous = lambda m, b, n: KVCache.for_model(m, b, n)  # noqa: E731
    return [
        Technique("MHA (baseline)", same, contiguous, "-"),
        Technique("GQA (about 1/4 of the K/V heads)", lambda c: gqa_heads(c.n_heads), contiguous, "convert + uptrain"),
        Technique("MQA (1 K/V head)", lambda c: 1, contiguous, "convert + uptrain"),
        Technique(f"cross-layer, groups of {group}", same,
                  lambda m, b, n: CrossLayerKVCache.for_model(m, b, n, group=group), "yes (train with sharing)"),
        Technique("int8 KV", same, lambda m, b, n: QuantizedKVCache.for_model(m, b, n), "no"),
        Technique(f"sliding window {window}", same,
                  lambda m, b, n: SlidingWindowCache.for_model(m, b, window=min(window, n)), "best trained with it"),
        Technique(f"sinks + recent, {budget} tokens", same,
                  lambda m, b, n: SelectiveKVCache.for_model(m, b, min(budget, n), policy="recent"), "no"),
        Technique(f"heavy hitters, {budget} tokens", same,
                  lambda m, b, n: SelectiveKVCache.for_model(m, b, min(budget, n), policy="heavy"), "no"),
    ]  # fmt: skip


def kv_benchmark(config: ModelConfig, contexts: Sequence[int] = (256, 1024, 4096), batch: int = 1,
                 new_tokens: int = 16, repeats: int = 3, device=None, dtype=torch.float32,
                 chosen: Sequence[Technique] | None = None) -> list[dict]:  # fmt: skip
    """KV bytes and decode tokens/s of every technique at every context, on random-weight models.

    At each context the techniques take turns, one timed run each per round, so that a slow
    spell of a shared machine hits them all alike; the median over rounds is reported.
    """
    chosen = chosen or techniques()
    need = max(contexts) + new_tokens * repeats + 1  # caches that cannot roll back keep counting positions
    config = config.replace(max_seq_len=max(config.max_seq_len, need))
    models: dict[int, Transformer] = {}
    for tech in chosen:
        heads = tech.kv_heads(config)
        models.setdefault(heads, random_model(config.replace(n_kv_heads=heads), device, dtype))
    rows = []
    for ctx in contexts:
        caches = []
        for tech in chosen:
            model = models[tech.kv_heads(config)]
            cache = tech.make_cache(model, batch, ctx + new_tokens + 1)
            caches.append((model, _prepare(model, cache, ctx)))
        rates = [[_timed_decode(m, c, new_tokens) for m, c in caches] for _ in range(repeats)]
        for i, tech in enumerate(chosen):
            model = caches[i][0]
            held = tech.make_cache(model, batch, ctx)  # sized for exactly this context
            rows.append({"technique": tech.name, "kv_heads": model.config.n_kv_heads, "context": ctx,
                         "kv_bytes": held.nbytes, "tokens_per_s": statistics.median(r[i] for r in rates),
                         "retrain": tech.retrain})  # fmt: skip
        del caches
    return rows


def hybrid_kv_bytes(config: ModelConfig, seq_len: int, batch: int = 1, dtype="bf16", n_kv_heads: int | None = None,
                    global_every: int = 1, window: int | None = None, share_group: int = 1) -> float:  # fmt: skip
    """KV bytes of a model mixing the techniques: ``n_kv_heads`` K/V heads, layers sharing K/V in
    groups of ``share_group``, and of the stored K/V, one in ``global_every`` attending to the whole
    context while the others keep a local ``window``."""
    n_kv_heads = n_kv_heads or config.n_kv_heads
    stored = -(-config.n_layers // share_group)
    n_global = -(-stored // global_every) if window else stored
    tokens = n_global * seq_len + (stored - n_global) * min(seq_len, window or seq_len)
    return 2 * n_kv_heads * config.head_dim * bytes_per_element(dtype) * tokens * batch


def bench_kv(shape: str = "SmolLM2-135M", contexts: Sequence[int] = (256, 1024, 4096), batch: int = 1,
             new_tokens: int = 16, repeats: int = 3, device=None, dtype=None) -> dict:  # fmt: skip
    """The benchmark command's figures: every technique on a random-weight model of a real shape,
    made multi-head first (the techniques start from MHA), with the hardware it ran on."""
    from ..core.config import preset
    from ..core.device import best_device, hardware_description

    device = torch.device(device) if device else best_device()
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    base = preset(shape)
    config = base.replace(n_kv_heads=base.n_heads, name=f"{base.name} as MHA")
    load_before = os.getloadavg()[0]  # other work on the machine skews timings: say how much there was
    rows = kv_benchmark(config, contexts, batch, new_tokens, repeats, device, dtype)
    baseline = {r["context"]: r for r in rows if r["technique"] == "MHA (baseline)"}
    for r in rows:
        r["memory_vs_mha"] = r["kv_bytes"] / baseline[r["context"]]["kv_bytes"]
        r["speed_vs_mha"] = r["tokens_per_s"] / baseline[r["context"]]["tokens_per_s"]
    return {"model": config.name, "parameters": config.num_params(), "dtype": str(dtype).removeprefix("torch."),
            "batch": batch, "new_tokens": new_tokens, "repeats": repeats, "device": str(device),
            "hardware": hardware_description(device), "load_average_before": round(load_before, 2),
            "load_average_after": round(os.getloadavg()[0], 2), "rows": rows}  # fmt: skip


def format_kv_bench(result: dict) -> str:
    from ..bench.report import format_table
    from .memory import format_bytes

    rows = [{**r, "kv": format_bytes(r["kv_bytes"]), "memory": f"{r['memory_vs_mha']:.3f}x",
             "speed": f"{r['speed_vs_mha']:.2f}x"} for r in result["rows"]]  # fmt: skip
    title = (f"{result['model']}, {result['dtype']}, batch {result['batch']}, random weights, on {result['hardware']}"
             f" (median of {result['repeats']} x {result['new_tokens']} decode steps)")  # fmt: skip
    columns = {"technique": "technique", "context": "context", "kv": "KV bytes", "memory": "vs MHA",
               "tokens_per_s": "decode tok/s", "speed": "vs MHA", "retrain": "retraining"}  # fmt: skip
    return title + "\n" + format_table(rows, columns)


def summary_rows(bench_rows: Sequence[dict], perplexity: dict[str, float], baseline_ppl: float) -> list[dict]:
    """One row per technique: memory saved and decode speed change (from ``kv_benchmark`` at its
    longest context), perplexity change (from ``perplexity``, keyed by technique name), retraining."""
    longest = max(r["context"] for r in bench_rows)
    rows = [r for r in bench_rows if r["context"] == longest]
    base = next(r for r in rows if r["technique"].startswith("MHA"))
    return [{"technique": r["technique"], "memory saved": f"{1 - r['kv_bytes'] / base['kv_bytes']:.0%}",
             "decode speed": f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x",
             "perplexity": (f"{perplexity[r['technique']] - baseline_ppl:+.1f}" if r["technique"] in perplexity
                            else "not measured"),
             "retraining": r["retrain"]} for r in rows]  # fmt: skip
