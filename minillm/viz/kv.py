"""Chapters 4 and 5's pictures: cache vs recompute, KV bytes against weight bytes, and what each
way of shrinking the cache costs in quality and buys in speed."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

from ..kv.memory import BYTES_PER_ELEMENT, crossover_tokens, format_bytes, kv_bytes_per_token, weight_bytes
from .style import WIDTH_IN, finish, legend_right


def plot_cache_vs_recompute(cached, recomputed, prompt_len: int, title: str = ""):
    """Two panels from two GenerationResults: time of each new token against its position, and
    the running total (quadratic without the cache, linear with it)."""

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(WIDTH_IN, 6.2), sharex=True)
    for result, name, color in ((recomputed, "recompute (no cache)", "tab:red"), (cached, "KV cache", "tab:blue")):
        times = np.array([result.ttft] + list(result.token_times)) * 1e3  # ms
        pos = prompt_len + np.arange(len(times))
        ax1.plot(pos[1:], times[1:], ".", ms=2, color=color, label=name)
        ax2.plot(pos, np.cumsum(times) / 1e3, color=color, label=name)
    ax1.set(ylabel="time for that token (ms)", title="per token")
    ax2.set(xlabel="position of the new token", ylabel="total time so far (s)", title="running total")
    ax1.legend(markerscale=5, loc="upper left", fontsize=9)
    ax2.legend(loc="upper left", fontsize=9)
    fig.suptitle(title)
    return finish(fig)


def plot_kv_vs_weights(configs, dtype: str = "bf16", max_tokens: float = 2e6, title: str = ""):
    """KV-cache bytes against tokens held (batch x context), one line per model, beside its weights;
    the crossover, where the cache outweighs the model, is marked."""

    fig, ax = plt.subplots(figsize=(WIDTH_IN, 4.0))
    tokens = np.logspace(3, np.log10(max_tokens), 100)
    for i, cfg in enumerate(configs):
        color = f"C{i}"
        ax.loglog(tokens, tokens * kv_bytes_per_token(cfg, dtype) / 1e9, color=color, label=f"{cfg.name}: KV cache")
        ax.axhline(weight_bytes(cfg, dtype) / 1e9, color=color, ls="--", lw=1, label=f"{cfg.name}: weights")
        n = crossover_tokens(cfg, dtype)
        ax.plot([n], [weight_bytes(cfg, dtype) / 1e9], "o", color=color)
        ax.annotate(
            f"{n / 1e3:,.0f}k tokens",
            (n, weight_bytes(cfg, dtype) / 1e9),
            textcoords="offset points",
            xytext=(6, -12),
            fontsize=8,
            color=color,
        )
    ax.set(xlabel="tokens held in the cache (batch x context)", ylabel=f"GB ({dtype})", title=title)
    ax.legend(fontsize=8)
    return finish(fig)


def interactive_kv_calculator():
    """Sliders for the KV formula (needs ipywidgets and a live kernel; the book shows the table)."""
    import ipywidgets as widgets

    def show(n_layers: int, n_kv_heads: int, head_dim: int, context: int, batch: int, dtype: str):
        per_token = 2 * n_layers * n_kv_heads * head_dim * BYTES_PER_ELEMENT[dtype]
        print(
            f"{format_bytes(per_token)} per token; {format_bytes(per_token * context)} per sequence; "
            f"{format_bytes(per_token * context * batch)} for the batch"
        )

    return widgets.interact(
        show,
        n_layers=widgets.IntSlider(value=32, min=1, max=128),
        n_kv_heads=widgets.IntSlider(value=8, min=1, max=128),
        head_dim=widgets.IntSlider(value=128, min=32, max=256, step=32),
        context=widgets.IntSlider(value=8192, min=512, max=131072, step=512),
        batch=widgets.IntSlider(value=1, min=1, max=256),
        dtype=widgets.Dropdown(options=list(BYTES_PER_ELEMENT), value="bf16"),
    )


def plot_quality(curves: dict, xlabel: str, baseline: float, title: str = ""):
    """Perplexity against a knob (window, budget, ...), one line per method, the full cache dashed."""

    fig, ax = plt.subplots(figsize=(WIDTH_IN, 3.8))
    for name, points in curves.items():
        xs, ys = zip(*points)
        ax.plot(xs, ys, "o-", label=name)
    ax.axhline(baseline, color="gray", ls="--", label="full cache")
    ax.set_xscale("log", base=2)
    ax.set(xlabel=xlabel, ylabel="perplexity (lower is better)", title=title)
    legend_right(ax)
    return finish(fig)


def plot_kv_bench(rows, title: str = ""):
    """Memory and decode speed of each technique relative to MHA, at the longest context measured."""

    longest = max(r["context"] for r in rows)
    last = [r for r in rows if r["context"] == longest]
    base = next(r for r in last if r["technique"].startswith("MHA"))
    names = [_named_by_heads(r, base.get("kv_heads")) for r in last]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(WIDTH_IN, 2 * (0.3 * len(names) + 0.9) + 0.6), sharey=True)
    ax1.barh(names, [r["kv_bytes"] / base["kv_bytes"] for r in last], color="tab:blue")
    ax2.barh(names, [r["tokens_per_s"] / base["tokens_per_s"] for r in last], color="tab:green")
    ax1.set(xlabel="KV bytes vs MHA (x, lower is better)")
    ax2.set(xlabel="decode tokens/s vs MHA (x, higher is better)")
    ax2.axvline(1, color="gray", lw=1)
    ax1.invert_yaxis()
    ax2.yaxis.set_tick_params(labelleft=True)  # one above the other: each panel names its rows
    fig.suptitle(f"{title}\ncontext {longest} tokens")
    return finish(fig)


def _named_by_heads(row: dict, n_heads: int | None) -> str:
    """GQA and MQA rows named by their K/V-head counts ("GQA (3 of 9 K/V heads)"), whatever name a
    saved run gave them; the other techniques keep theirs."""
    kind = row["technique"].split()[0]
    if kind in ("GQA", "MQA") and n_heads and "kv_heads" in row:
        return f"{kind} ({row['kv_heads']} of {n_heads} K/V heads)"
    return row["technique"]


def plot_uptraining(saved: dict, n_heads: int, title: str = ""):
    """Perplexity during uptraining, one line per K/V-head count (from ``python -m minillm train gqa``)."""

    fig, ax = plt.subplots(figsize=(WIDTH_IN, 3.8))
    for n, curve in saved["curves"].items():
        steps, ppl = zip(*curve)
        kind = "MHA, the control" if int(n) == n_heads else ("MQA" if int(n) == 1 else "GQA")
        ax.plot(steps, ppl, "o-", label=f"{n} K/V heads ({kind})")
    ax.set_yscale("log")
    ax.set(
        xlabel=f"uptraining step (batch {saved['batch_size']} x {saved['seq_len']} tokens)",
        ylabel="validation perplexity (log)",
        title=title,
    )
    legend_right(ax)
    return finish(fig)
