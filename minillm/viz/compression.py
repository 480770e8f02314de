"""Chapter 12's pictures: rounding a weight matrix, quality against bits per weight, where
weight-only quantization speeds a matmul up and where it slows it down, decode speed of each
technique and pruning curves."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
import numpy as np
import torch

from .style import WIDTH_IN, finish, legend_under, plain_log_ticks

MARKERS = "osD^vP"  # one per line, so the lines part in grayscale too


def plot_rounding(weight: torch.Tensor, rounded: Mapping[str, torch.Tensor], title: str = ""):
    """Left: the distribution of a weight matrix's values (log counts: the rare large ones are
    what a per-channel scale must cover). Right: the rounding error of each quantizer."""
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(WIDTH_IN, 6.2))
    w = weight.detach().float().flatten().numpy()
    ax1.hist(w, bins=200, color="tab:gray")
    ax1.set_yscale("log")
    ax1.set(xlabel="weight value (unitless, as stored)", ylabel="count (log)", title="the weights")
    errors = {
        name: (q.detach().float() - weight.detach().float()).abs().flatten().numpy() for name, q in rounded.items()
    }
    edges = np.linspace(0, 1.05 * max(e.max() for e in errors.values()), 80)
    for i, (name, err) in enumerate(errors.items()):
        ax2.hist(err, bins=edges, histtype="step", lw=1.5, color=f"C{i}", label=f"{name}: mean {err.mean():.4f}")
    ax2.set_yscale("log")
    ax2.set(xlabel="|rounding error| (same units as the weights)", ylabel="count (log)", title="the rounding error")
    legend_under(fig, ax2, ncol=2)  # under the panels: the histograms fill their axes
    fig.suptitle(title)
    return finish(fig)


def plot_quality_vs_bits(rows: Sequence[Mapping], baseline: float, title: str = ""):
    """Perplexity against stored bits per weight (scales included), one labelled point per format;
    the dashed line is the unquantized model. The y axis is zoomed to the points (it says so), and
    the right axis gives each point's change against fp32 in percent, so a 1% step is read as 1%.
    Formats that land close together are labelled on alternate sides, one above and one below
    the points, so their names stay clear of each other and of the markers."""
    fig, ax = plt.subplots(figsize=(WIDTH_IN, 4))
    span = max(r["perplexity"] for r in rows) - min(r["perplexity"] for r in rows) or 1.0

    def near(q, r) -> bool:
        return abs(q["bits"] - r["bits"]) < 0.6 and abs(q["perplexity"] - r["perplexity"]) < 0.08 * span

    for r in rows:
        ax.plot(r["bits"], r["perplexity"], "o", color="tab:blue")
        group = sorted((q for q in rows if near(q, r)), key=lambda q: (q["bits"], q["name"]))
        k = next(j for j, q in enumerate(group) if q is r)  # its place, left to right, among close points
        left = len(group) > 1 and k % 2 == 0  # the leftmost of a close pair is labelled on its left
        alone, above, below = -4, 9 + 10 * (k // 2), -14 - 10 * (k // 2)
        rise = alone if len(group) == 1 else above if left else below
        offset = (-7 if left else 7, rise)
        ax.annotate(
            r["name"],
            (r["bits"], r["perplexity"]),
            textcoords="offset points",
            xytext=offset,
            ha="right" if left else "left",
            fontsize=9,
        )
    ax.axhline(baseline, color="tab:gray", ls="--", lw=1, label=f"fp32: {baseline:.2f}")
    xs = [r["bits"] for r in rows]
    ax.set_xlim(min(xs) - 1.2, max(xs) + 1.2)  # room for the names on either side
    values = [r["perplexity"] for r in rows] + [baseline]
    pad = 0.15 * (max(values) - min(values) or 1)
    ax.set_ylim(min(values) - pad, max(values) + pad)
    ax.set(xlabel="bits per weight, scales and zero points included", ylabel="perplexity (zoomed;\nlower is better)")
    change = ax.secondary_yaxis(
        "right", functions=(lambda p: 100 * (p / baseline - 1), lambda c: baseline * (1 + c / 100))
    )
    change.set_ylabel("vs fp32 (%)")
    ax.set_title(title, fontsize=10)
    legend_under(fig, ax, ncol=1)
    return finish(fig)


def plot_matmul_times(rows: Sequence[Mapping], title: str = ""):
    """Time per token of one linear layer in each weight format, by tokens per matmul (log-log).
    With 1 token (decode) the layer reads its weights and the fewest bytes win; with many
    (prefill) it computes, and the cost of dequantizing shows."""
    fig, ax = plt.subplots(figsize=(WIDTH_IN, 4))
    formats = list(dict.fromkeys(r["format"] for r in rows))
    for i, name in enumerate(formats):
        mine = sorted((r for r in rows if r["format"] == name), key=lambda r: r["rows"])
        xs, ys = [r["rows"] for r in mine], [1e3 * r["ms"] / r["rows"] for r in mine]
        ax.plot(xs, ys, "-", marker=MARKERS[i % len(MARKERS)], color=f"C{i}", label=name)
    ax.set_xscale("log", base=2)
    tokens = sorted({r["rows"] for r in rows})
    ax.set_xticks(tokens, [str(n) for n in tokens])  # the token counts measured, not powers of 2
    ax.xaxis.set_minor_locator(plt.NullLocator())
    ax.set_yscale("log")
    plain_log_ticks(ax.yaxis)
    ax.set(xlabel="tokens in the matmul (1 = decode, many = prefill)", ylabel="microseconds per token (log)")
    ax.set_title(title, fontsize=10)
    legend_under(fig, ax, ncol=min(4, len(formats)))
    return finish(fig)


def plot_decode_speed(rows: Sequence[Mapping], title: str = ""):
    """Decode speed of each technique against bf16, one bar group per batch size."""
    batches = sorted({r["batch"] for r in rows})
    names = list(dict.fromkeys(r["technique"] for r in rows))
    fig, ax = plt.subplots(figsize=(WIDTH_IN, 3.8))
    width = 0.8 / len(batches)
    for j, b in enumerate(batches):
        by_name = {r["technique"]: r["vs_bf16"] for r in rows if r["batch"] == b}
        x = np.arange(len(names)) + j * width
        ax.bar(x, [by_name.get(n, np.nan) for n in names], width, label=f"batch {b}", color=f"C{j}")
    ax.axhline(1, color="tab:gray", lw=1)
    ax.set_xticks(np.arange(len(names)) + width * (len(batches) - 1) / 2, names, rotation=30, ha="right")
    ax.set(ylabel="decode speed vs bf16 (x)")
    ax.set_ylim(bottom=0)
    ax.set_title(title, fontsize=10)
    legend_under(fig, ax, ncol=len(batches))
    return finish(fig)


MARK_SPREAD = 0.012  # sparsity between two marks at the same sparsity (plot_pruning)


def plot_pruning(curves: Mapping[str, Sequence[tuple[float, float]]], baseline: float, title: str = "", marks=None):
    """Perplexity against sparsity, one line per method; ``marks`` ({label: (sparsity, ppl)}) adds
    single points such as 2:4. Marks at the same sparsity stand side by side, a little apart
    (``MARK_SPREAD`` of the axis per mark), so that close values do not hide one another. Log
    perplexity: the curves leave the baseline by orders of magnitude."""
    fig, ax = plt.subplots(figsize=(WIDTH_IN, 4))
    for i, (name, points) in enumerate(curves.items()):
        xs, ys = zip(*points)
        ax.plot(xs, ys, "-", marker=MARKERS[i % len(MARKERS)], color=f"C{i}", label=name)
    marks = dict(marks or {})
    at_x: dict[float, list[str]] = {}
    for name, (x, _) in marks.items():
        at_x.setdefault(x, []).append(name)
    for j, (name, (x, y)) in enumerate(marks.items()):
        shared = at_x[x]
        offset = (shared.index(name) - (len(shared) - 1) / 2) * MARK_SPREAD
        ax.plot([x + offset], [y], "s", ms=8, color=f"C{len(curves) + j}", label=name)
    ax.axhline(baseline, color="tab:gray", ls="--", lw=1, label=f"dense: {baseline:.1f}")
    ax.set_yscale("log")
    plain_log_ticks(ax.yaxis)
    ax.set(xlabel="fraction of weights removed", ylabel="perplexity (log, lower is better)")
    ax.set_title(title, fontsize=10)
    legend_under(fig, ax, ncol=3)
    return finish(fig)
