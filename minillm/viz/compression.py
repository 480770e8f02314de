"""Chapter 12's pictures: rounding a weight matrix, quality against bits per weight, where
weight-only quantization speeds a matmul up and where it slows it down, decode speed of each
technique and pruning curves."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
import numpy as np
import torch


def plot_rounding(weight: torch.Tensor, rounded: Mapping[str, torch.Tensor], title: str = ""):
    """Left: the distribution of a weight matrix's values (log counts: the rare large ones are
    what a per-channel scale must cover). Right: the rounding error of each quantizer."""
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
    w = weight.detach().float().flatten().numpy()
    ax1.hist(w, bins=200, color="tab:gray")
    ax1.set_yscale("log")
    ax1.set(xlabel="weight value", ylabel="count (log)", title="the weights")
    errors = {
        name: (q.detach().float() - weight.detach().float()).abs().flatten().numpy() for name, q in rounded.items()
    }
    edges = np.linspace(0, 1.05 * max(e.max() for e in errors.values()), 80)
    for i, (name, err) in enumerate(errors.items()):
        ax2.hist(err, bins=edges, histtype="step", lw=1.5, color=f"C{i}", label=f"{name}: mean {err.mean():.4f}")
    ax2.set_yscale("log")
    ax2.set(xlabel="|rounding error|", ylabel="count (log)", title="the rounding error")
    ax2.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def plot_quality_vs_bits(rows: Sequence[Mapping], baseline: float, title: str = ""):
    """Perplexity against stored bits per weight (scales included), one labelled point per format;
    the dashed line is the unquantized model."""
    fig, ax = plt.subplots(figsize=(7, 4))
    for r in rows:
        ax.plot(r["bits"], r["perplexity"], "o", color="tab:blue")
        ax.annotate(r["name"], (r["bits"], r["perplexity"]), textcoords="offset points", xytext=(5, 4), fontsize=8)
    ax.axhline(baseline, color="tab:gray", ls="--", lw=1, label=f"fp32: {baseline:.2f}")
    ax.set(xlabel="bits per weight, scales and zero points included", ylabel="perplexity (lower is better)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    return fig


def plot_matmul_times(rows: Sequence[Mapping], title: str = ""):
    """Time per token of one linear layer in each weight format, by tokens per matmul (log-log).
    With 1 token (decode) the layer reads its weights and the fewest bytes win; with many
    (prefill) it computes, and the cost of dequantizing shows."""
    fig, ax = plt.subplots(figsize=(7, 4))
    formats = list(dict.fromkeys(r["format"] for r in rows))
    for i, name in enumerate(formats):
        mine = sorted((r for r in rows if r["format"] == name), key=lambda r: r["rows"])
        ax.plot([r["rows"] for r in mine], [1e3 * r["ms"] / r["rows"] for r in mine], "o-", color=f"C{i}", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set(xlabel="tokens in the matmul (1 = decode, many = prefill)", ylabel="microseconds per token (log)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, ncol=2)
    return fig


def plot_decode_speed(rows: Sequence[Mapping], title: str = ""):
    """Decode speed of each technique against bf16, one bar group per batch size."""
    batches = sorted({r["batch"] for r in rows})
    names = list(dict.fromkeys(r["technique"] for r in rows))
    fig, ax = plt.subplots(figsize=(8, 3.8))
    width = 0.8 / len(batches)
    for j, b in enumerate(batches):
        by_name = {r["technique"]: r["vs_bf16"] for r in rows if r["batch"] == b}
        x = np.arange(len(names)) + j * width
        ax.bar(x, [by_name.get(n, np.nan) for n in names], width, label=f"batch {b}", color=f"C{j}")
    ax.axhline(1, color="tab:gray", lw=1)
    ax.set_xticks(np.arange(len(names)) + width * (len(batches) - 1) / 2, names, rotation=30, ha="right")
    ax.set(ylabel="decode speed vs bf16")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_pruning(curves: Mapping[str, Sequence[tuple[float, float]]], baseline: float, title: str = "", marks=None):
    """Perplexity against sparsity, one line per method; ``marks`` ({label: (sparsity, ppl)}) adds
    single points such as 2:4. Log perplexity: the curves leave the baseline by orders of magnitude."""
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, (name, points) in enumerate(curves.items()):
        xs, ys = zip(*points)
        ax.plot(xs, ys, "o-", color=f"C{i}", label=name)
    for j, (name, (x, y)) in enumerate((marks or {}).items()):
        ax.plot([x], [y], "s", ms=8, color=f"C{len(curves) + j}", label=name)
    ax.axhline(baseline, color="tab:gray", ls="--", lw=1, label=f"dense: {baseline:.1f}")
    ax.set_yscale("log")
    ax.set(xlabel="fraction of weights removed", ylabel="perplexity (log, lower is better)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    return fig
