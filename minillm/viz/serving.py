"""The plots of serving: chapter 2's request timelines, latency histograms and load sweep, and
chapter 13's batch timelines, step costs, rate sweeps, latency-throughput curves and token gaps.
They take what ``measure.trace``, ``serving.engine`` and ``bench.batching`` return.
"""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from ..measure.metrics import SLO, RequestMetrics, percentiles
from ..measure.trace import Service
from ..serving.engine import StepCost
from .style import WIDTH_IN, finish, legend_right, legend_under, tidy

POLICY_COLORS = {"static": "tab:red", "dynamic": "tab:orange", "continuous": "tab:blue"}


# ---------------------------------------------------------------------------------------------
# Chapter 2: one request at a time


def _axes(ax, height: float = 3.8):
    """``ax``, or the axes of a new figure of the column's width."""
    return ax if ax is not None else plt.subplots(figsize=(WIDTH_IN, height))[1]


def _done(ax, own: bool):
    """Lay out a figure this module made; only fit the titles of one a caller made."""
    if own:
        finish(ax.figure)
    else:
        tidy(ax.figure)
    return ax


def plot_latency_histogram(values_ms: Sequence[float], xlabel: str, title: str, ax=None):
    """A histogram with p50 and p99 marked; the legend to its right, off the bars."""
    own, ax = ax is None, _axes(ax)
    p = percentiles(values_ms, (50, 99))
    ax.hist(values_ms, bins=min(30, max(5, len(values_ms) // 3)), color="0.7", edgecolor="white")
    for key, style in (("p50", "-"), ("p99", "--")):
        ax.axvline(p[key], color="C3", linestyle=style, label=f"{key} = {p[key]:.1f} ms")
    ax.set(xlabel=xlabel, ylabel="requests", title=title)
    legend_right(ax)
    return _done(ax, own)


def plot_timeline(requests: Sequence[RequestMetrics], services: Sequence[Service], title: str, ax=None):
    """One row per request: waiting in the queue (light), prefill to the first token (dark), decode."""
    own, ax = ax is None, _axes(ax)
    for i, (r, s) in enumerate(zip(requests, services)):
        start = r.token_times[0] - s.token_offsets[0]
        ax.barh(i, 1e3 * (start - r.arrival), left=1e3 * r.arrival, color="0.85", label="queued" if i == 0 else None)
        first = "prefill + first token" if i == 0 else None
        ax.barh(i, 1e3 * s.token_offsets[0], left=1e3 * start, color="C3", label=first)
        decode = "decode" if i == 0 else None
        ax.barh(i, 1e3 * (r.finish - r.token_times[0]), left=1e3 * r.token_times[0], color="C0", label=decode)
    ax.invert_yaxis()
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set(xlabel="time since the first arrival (ms)", ylabel="request (in arrival order)", title=title)
    legend_right(ax)
    return _done(ax, own)


def plot_load_sweep(rows: Sequence[dict], slo: SLO, title: str, ax=None):
    """Served requests/s and goodput against the offered request rate."""
    own, ax = ax is None, _axes(ax)
    x = [r["offered_rps"] for r in rows]
    ax.plot(x, [r["served_rps"] for r in rows], "o-", label="throughput (requests/s)")
    good = f"goodput (TTFT <= {1e3 * slo.ttft:.0f} ms, TPOT <= {1e3 * slo.tpot:.0f} ms)"
    ax.plot(x, [r["goodput_rps"] for r in rows], "s-", label=good)
    ax.set(xlabel="offered load (requests/s)", ylabel="requests per second", title=title)
    ax.set_ylim(0, 1.35 * max(r["served_rps"] for r in rows))  # room for the legend above the curves
    ax.legend(loc="upper left", fontsize=9)
    return _done(ax, own)


# ---------------------------------------------------------------------------------------------
# Chapter 13: batching policies


def _request_colors(n: int) -> list:
    """``n`` colors that can be told apart: tab10's, then tab20's pale halves, then a cycle."""
    dark = [plt.get_cmap("tab10")(i) for i in range(10)]
    pale = [plt.get_cmap("tab20")(2 * i + 1) for i in range(10)]
    palette = dark + pale
    return [palette[i % len(palette)] for i in range(n)]


def plot_batch_timeline(step_logs: dict, max_batch: int, title: str = ""):
    """Who rides in each batch row at each step: one panel per policy, one color per request
    (its number written where it boards a row), its prompt dotted, its decode steps plain, and
    padding rows (finished members of a static batch, still computed) hatched gray."""
    height = min(8.8, 1.6 + 0.5 * max_batch * len(step_logs))
    fig, axes = plt.subplots(len(step_logs), 1, figsize=(WIDTH_IN, height), sharex=True)
    axes = np.atleast_1d(axes)
    ids = sorted({rid for log in step_logs.values() for r in log for rid, _ in r.work})
    color = dict(zip(ids, _request_colors(len(ids))))
    for ax, (name, log) in zip(axes, step_logs.items()):
        previous: dict[int, int] = {}  # row -> the request in it at the previous step
        for r in log:
            x, w = 1e3 * r.start, 1e3 * r.duration
            for row, (rid, n) in enumerate(r.work):
                prompt = n > 1  # prompt tokens; a decode row feeds 1
                edge = "white" if prompt else color[rid]  # the hatch's color
                ax.broken_barh(
                    [(x, w)],
                    (row + 0.1, 0.8),
                    facecolor=color[rid],
                    edgecolor=edge,
                    lw=0,
                    hatch="...." if prompt else None,
                )
                if previous.get(row) != rid:  # boards this row: say who it is
                    ax.text(
                        x + 1,
                        row + 0.5,
                        str(rid),
                        ha="left",
                        va="center",
                        fontsize=7,
                        color="black",
                        bbox={"fc": "white", "ec": "none", "alpha": 0.75, "pad": 0.4},
                    )
            for row in range(len(r.work), len(r.work) + r.padding_rows):
                ax.broken_barh([(x, w)], (row + 0.1, 0.8), facecolor="0.93", edgecolor="0.45", hatch="////", lw=0)
            previous = {row: rid for row, (rid, _) in enumerate(r.work)}
        ax.set(ylim=(0, max_batch), ylabel="batch row", yticks=[i + 0.5 for i in range(max_batch)])
        ax.set_yticklabels([str(i) for i in range(max_batch)])
        ax.set_title(f"{name}: {len(log)} steps", fontsize=10, loc="left")
        ax.grid(False)
    axes[-1].set_xlabel("time (ms, simulated)")
    handles = [
        Patch(facecolor="0.6", hatch="....", edgecolor="white", label="prompt (prefill step)"),
        Patch(facecolor="0.6", label="decode step (one color per request, its number where it takes a row)"),
        Patch(facecolor="0.93", edgecolor="0.45", hatch="////", label="padding row (computed, thrown away)"),
    ]
    legend_under(fig, handles=handles, labels=[h.get_label() for h in handles], ncol=1, fontsize=8)
    fig.suptitle(title)
    return finish(fig)


def plot_step_costs(records: Sequence, cost: StepCost, title: str = ""):
    """Measured step durations beside the fitted cost: decode-only steps against their rows,
    prefill-only steps against their prompt tokens."""
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(WIDTH_IN, 6.4))
    decode = [r for r in records if r.prefill_tokens == 0]
    prefill = [r for r in records if r.decode_rows == 0]
    ax1.plot([r.decode_rows for r in decode], [1e3 * r.duration for r in decode], ".", alpha=0.4, label="measured step")
    b = np.arange(1, max([r.decode_rows for r in decode], default=1) + 1)
    fit = f"fit: {1e3 * cost.fixed:.1f} ms + {1e3 * cost.per_token:.2f} ms/row"
    ax1.plot(b, 1e3 * (cost.fixed + cost.per_token * b), "k-", label=fit)
    ax1.set(xlabel="decode rows in the step (batch)", ylabel="step time (ms)", title="decode steps")
    ms = [1e3 * r.duration for r in prefill]
    ax2.plot([r.prefill_tokens for r in prefill], ms, ".", alpha=0.6, label="measured step")
    t = np.linspace(0, max([r.prefill_tokens for r in prefill], default=1), 50)
    fit = f"fit: {1e3 * cost.fixed:.1f} ms + {1e3 * cost.prefill_rate:.3f} ms/token"
    ax2.plot(t, 1e3 * (cost.fixed + cost.prefill_rate * t), "k-", label=fit)
    ax2.set(xlabel="prompt tokens in the step", ylabel="step time (ms)", title="prefill-only steps")
    legend_right(ax1)
    legend_right(ax2)
    fig.suptitle(title)
    return finish(fig)


def plot_rate_sweep(rows: Sequence[dict], slo: SLO, title: str = ""):
    """Four panels against the request rate, one line per policy: throughput, p99 TTFT and p99
    TPOT (with the SLO's bounds) and goodput."""
    fig, axes = plt.subplots(2, 2, figsize=(WIDTH_IN, 6.2), sharex=True)
    panels = [
        ("tokens_per_s", "output tokens/s", None),
        ("ttft_p99_ms", "TTFT p99 (ms)", 1e3 * slo.ttft),
        ("tpot_p99_ms", "TPOT p99 (ms)", 1e3 * slo.tpot),
        ("goodput_rps", "goodput\n(requests/s in SLO)", None),
    ]
    for ax, (key, label, bound) in zip(axes.flat, panels):
        for policy in dict.fromkeys(r["policy"] for r in rows):
            mine = [r for r in rows if r["policy"] == policy]
            x, y = [r["rate"] for r in mine], [r[key] for r in mine]
            ax.plot(x, y, "o-", color=POLICY_COLORS.get(policy), label=policy)
        if bound is not None:
            ax.axhline(bound, color="gray", ls="--", lw=1, label="SLO")
        if key == "ttft_p99_ms":
            ax.set_yscale("log")
        ax.set(ylabel=label)
    for ax in axes[1]:
        ax.set_xlabel("offered load (requests/s)")
    legend_under(fig, axes[0, 1], ncol=4)  # one legend for the four panels, under them
    fig.suptitle(title)
    return finish(fig)


def plot_latency_throughput(rows: Sequence[dict], slo: SLO, title: str = ""):
    """The latency-throughput curve: each point one request rate, p99 TTFT and p99 TPOT against
    the throughput achieved (TPOT p50 where the rows have no p99, labelled so: the SLO's bound
    is on the p99); a policy is better where its curve lies lower and further right."""
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(WIDTH_IN, 6.4))
    p99 = all(r.get("tpot_p99_ms") is not None for r in rows)
    tpot_key, tpot_label = ("tpot_p99_ms", "TPOT p99 (ms)") if p99 else ("tpot_p50_ms", "TPOT p50 (ms)")
    for policy in dict.fromkeys(r["policy"] for r in rows):
        mine = sorted((r for r in rows if r["policy"] == policy), key=lambda r: r["rate"])
        x = [r["tokens_per_s"] for r in mine]
        ax1.plot(x, [r["ttft_p99_ms"] for r in mine], "o-", color=POLICY_COLORS.get(policy), label=policy)
        ax2.plot(x, [r[tpot_key] for r in mine], "o-", color=POLICY_COLORS.get(policy), label=policy)
    ax1.axhline(1e3 * slo.ttft, color="gray", ls="--", lw=1, label="SLO")
    ax2.axhline(1e3 * slo.tpot, color="gray", ls="--", lw=1, label="SLO" if p99 else "SLO\n(bound on\nthe p99)")
    ax1.set(xlabel="throughput (output tokens/s)", ylabel="TTFT p99 (ms)", yscale="log")
    ax2.set(xlabel="throughput (output tokens/s)", ylabel=tpot_label)
    legend_right(ax1)
    legend_right(ax2)
    fig.suptitle(title)
    return finish(fig)


def plot_itl(runs: dict, ids: Sequence[int], title: str = ""):
    """Each output token's gap since the previous one (ms) against time, for the requests ``ids``,
    one panel per run (e.g. with and without chunked prefill), one above the other."""
    fig, axes = plt.subplots(len(runs), 1, figsize=(WIDTH_IN, 1.0 + 2.3 * len(runs)), sharey=True)
    for ax, (name, outputs) in zip(np.atleast_1d(axes), runs.items()):
        for o in outputs:
            if o.request.id in set(ids):
                t = o.metrics.token_times
                ax.plot(t[1:], [1e3 * g for g in o.metrics.itl], ".-", ms=3, lw=0.6)
        ax.set(xlabel="time (s, measured)", ylabel="gap before\neach token (ms)", title=name)
    fig.suptitle(title)
    return finish(fig)
