"""Chapter 16's pictures: the ladder (batch-1 tokens/s, one rung at a time, each bar labelled with
its speedup and its quality cost) and the serving rows (what an SLO-bound user gets against what
the machine produces)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
import numpy as np

from ..measure.report import signed_pct
from .style import WIDTH_IN, finish, legend_right, legend_under, require_keys


def _ladder_label(row: Mapping) -> str:
    return f"{row['vs_baseline']:.1f}x, perplexity {signed_pct(row['ppl_change_pct'])}"


def plot_ladder(rows: Sequence[Mapping], title: str = "", gpu_rows: Sequence[Mapping] = ()):
    """Horizontal bars of batch-1 tokens/s, the baseline on top and each rung below it. The label
    at each bar's end is its speedup over the baseline and the perplexity change of its weights;
    blue steps are lossless (the row above's tokens), orange ones change the weights.
    ``gpu_rows`` (``bench.capstone_tables.gpu_ladder_rows``) adds a panel of a saved GPU run below it."""
    require_keys(rows, ("step", "tokens_per_s", "vs_baseline"), "plot_ladder")
    panels = [(rows, "tokens_per_s", "tokens/s at batch 1 (prompt included)", "the saved CPU run")]
    if gpu_rows:
        panels.append((gpu_rows, "decode_tokens_per_s", "decode tokens/s at batch 1", "a GPU (make gpu-check)"))
    heights = [0.42 * len(mine) + 1.0 for mine, *_ in panels]
    fig, axes = plt.subplots(
        len(panels), 1, figsize=(WIDTH_IN, sum(heights) + 0.8), squeeze=False, gridspec_kw={"height_ratios": heights}
    )
    for ax, (mine, key, xlabel, where) in zip(axes[:, 0], panels):
        y = np.arange(len(mine))[::-1]
        values = [r[key] for r in mine]
        colors = [
            "tab:gray" if i == 0 else ("tab:blue" if r.get("lossless", True) else "tab:orange")
            for i, r in enumerate(mine)
        ]
        ax.barh(y, values, color=colors)
        for yi, v, r in zip(y, values, mine):
            label = _ladder_label(r) if "ppl_change_pct" in r else f"{r['vs_baseline']:.1f}x"
            ax.text(v, yi, "  " + label, va="center", fontsize=8)
        ax.set_yticks(y, [r["step"] for r in mine], fontsize=9)
        ax.set_xlim(0, 1.6 * max(values))  # room for the labels at the bars' ends
        ax.set_xlabel(xlabel)
        ax.set_title(where, fontsize=9)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in ("tab:gray", "tab:blue", "tab:orange")]
    labels = ["baseline", "lossless step", "lossy step (weights changed)"]
    legend_under(fig, handles=handles, labels=labels, ncol=3)
    fig.suptitle(title, fontsize=10)
    return finish(fig)


def plot_serving(rows: Sequence[Mapping], title: str = ""):
    """Top: output tokens/s, all of them and those of requests within the SLO. Below: TTFT p50 and
    p99 (log): what one request at a time costs the requests that wait, and what batching and
    prefix caching give back."""
    require_keys(rows, ("step", "throughput", "good_tokens_per_s", "ttft_p50_ms", "ttft_p99_ms"), "plot_serving")
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(WIDTH_IN, 2 * (0.4 * len(rows) + 1.1) + 0.4), sharey=True)
    y = np.arange(len(rows))[::-1]
    h = 0.38
    ax1.barh(y + h / 2, [r["throughput"] for r in rows], h, color="tab:gray", label="all output tokens")
    ax1.barh(y - h / 2, [r["good_tokens_per_s"] for r in rows], h, color="tab:green", label="within the SLO")
    ax1.set_yticks(y, [r["step"] for r in rows], fontsize=9)
    ax2.yaxis.set_tick_params(labelleft=True)  # one above the other: each panel names its rows
    ax1.set_xlabel("output tokens/s")
    legend_right(ax1)
    ax2.barh(y + h / 2, [r["ttft_p50_ms"] for r in rows], h, color="tab:blue", label="TTFT p50")
    ax2.barh(y - h / 2, [r["ttft_p99_ms"] for r in rows], h, color="tab:red", label="TTFT p99")
    ax2.set_xscale("log")
    ax2.set_xlabel("time to first token, ms (log)")
    legend_right(ax2)
    fig.suptitle(title, fontsize=10)
    return finish(fig)
