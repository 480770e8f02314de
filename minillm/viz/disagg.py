"""Chapter 14's pictures: a disaggregated deployment drawn as boxes and arrows (prefill and
decode on separate workers, the prompt's K/V handed from one to the other, as in Splitwise,
Patel et al., 2024, and DistServe, Zhong et al., 2024) beside a colocated one, the token gaps a
long prompt causes when both phases share a batch, each worker's steps on one timeline,
goodput against the request rate, goodput per worker by prefill:decode ratio, and how long the
K/V take to cross each link.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.lines import Line2D
from matplotlib.patches import FancyBboxPatch, Patch

from ..measure.metrics import percentiles
from .style import WIDTH_IN, arrow, box, finish, legend_under, require_keys

PHASE_COLORS = {"prefill": "#fdd0a2", "decode": "#c6dbef", "colocated": "#d9d9d9", "router": "#e5f5e0"}
MODE_COLORS = {"colocated": "tab:red", "chunked": "tab:orange"}  # disaggregated modes: the next colors
BEST_COLOR, OTHER_COLOR = "tab:green", "0.65"
SIMULATED_NOTE = "simulated clock (cost model)"
WIDTH = 6.6  # the drawings' width in inches (= data units): the column
CLIENTS_X, ROUTER_RIGHT = 0.35, 1.97  # the clients' centre, where the router's arrows start
LABEL_BOX = {"fc": "white", "ec": "none", "alpha": 0.8, "pad": 0.5}  # keeps a value readable over a line
STEP_COLORS = {"prefill": "tab:orange", "decode": "tab:blue", "mixed": "tab:purple"}
STEP_LABELS = {
    "prefill": "prefill only",
    "decode": "decode only",
    "mixed": "prefill + decode in one step\n(a whole prompt or a chunk)",
}
STEP_KEYS = ("worker", "start", "end", "prefill_tokens", "decode_rows")


# ---------------------------------------------------------------------------------------------
# The drawings


def _worker(ax, x: float, y: float, w: float, h: float, name: str, color: str) -> None:
    """A worker: its name on top, inside it a model copy and a paged KV pool."""
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.1", fc=color, ec="0.3"))
    ax.text(x + w / 2, y + h - 0.2, name, ha="center", va="center", fontsize=8.5, weight="bold")
    inner_w, inner_h = w - 0.3, (h - 0.55) / 2
    for i, part in enumerate(("model copy", "paged KV pool")):
        box(ax, x + 0.15, y + 0.1 + (1 - i) * (inner_h + 0.1), inner_w, inner_h, part, "white", fontsize=8)


def _column(n: int, top: float, bottom: float, gap: float = 0.3) -> list[tuple[float, float]]:
    """(y, height) of ``n`` boxes stacked from ``top`` to ``bottom``, top one first."""
    h = min(1.45, (top - bottom - gap * (n - 1)) / n)
    total = n * h + gap * (n - 1)
    first = (top + bottom + total) / 2 - h
    return [(first - i * (h + gap), h) for i in range(n)]


def _canvas(width: float, height: float, title: str):
    """An axes of ``width`` x ``height`` data units, one unit an inch (at most the column's width)."""
    fig, ax = plt.subplots(figsize=(width, height))
    fig.subplots_adjust(left=0, right=1, bottom=0, top=0.93)  # the drawing fills the figure: a unit is an inch
    ax.set(xlim=(0, width), ylim=(0, height))
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(title, fontsize=10)
    return fig, ax


def _check_workers(**counts: int) -> None:
    for name, n in counts.items():
        if not 1 <= n <= 4:
            raise ValueError(f"{name} must be between 1 and 4 for a readable drawing, got {n}")


def _clients_and_router(ax, mid: float) -> None:
    """Clients at the left, the router beside them, the requests' arrow between."""
    box(ax, 0.05, mid - 0.6, 0.6, 1.2, "clients", "white", fontsize=9)
    box(ax, 1.15, mid - 0.6, 0.8, 1.2, "router\n(picks the\nworkers)", PHASE_COLORS["router"], fontsize=8)
    arrow(ax, (0.67, mid), (1.13, mid))
    ax.text(0.9, mid + 0.08, "requests", ha="center", va="bottom", fontsize=7)


def _return_path(ax, start_x: float, start_y: float, y: float, end_y: float, label: str) -> None:
    """The tokens' way back: down from ``(start_x, start_y)`` to ``y``, left, up to the clients at ``end_y``."""
    ax.plot([start_x, start_x, CLIENTS_X], [start_y, y, y], color="tab:blue", lw=1.2)
    arrow(ax, (CLIENTS_X, y), (CLIENTS_X, end_y - 0.02), color="tab:blue")
    ax.text((start_x + CLIENTS_X) / 2, y + 0.07, label, ha="center", va="bottom", fontsize=8, color="tab:blue")


def draw_disaggregation(prefill_workers: int = 1, decode_workers: int = 1, title: str = ""):
    """Clients send requests to a router, which gives each prompt to one of the prefill workers
    and names a decode worker; the prefill worker runs the prompt, samples the first token and
    sends the K/V blocks of every layer with the first token to that decode worker
    (``torch.distributed`` send/recv), which decodes the rest and returns all the tokens, the
    first included, through the router: the prefill worker sends nothing to the client. Each
    worker holds its own copy of the model and its own paged KV pool (Zhong et al., 2024)."""
    _check_workers(prefill_workers=prefill_workers, decode_workers=decode_workers)
    fig, ax = _canvas(WIDTH, 4.5, title)
    top, bottom, mid = 4.35, 1.1, 2.725
    _clients_and_router(ax, mid)
    px, dx, w = 2.5, 5.15, 1.4
    prefill = _column(prefill_workers, top, bottom)
    decode = _column(decode_workers, top, bottom)
    for i, (y, h) in enumerate(prefill):
        _worker(ax, px, y, w, h, f"prefill worker {i}", PHASE_COLORS["prefill"])
        arrow(ax, (ROUTER_RIGHT, mid), (px - 0.03, y + h / 2))
    ax.text((ROUTER_RIGHT + px) / 2, mid - 0.08, "prompts", ha="center", va="top", fontsize=7)
    for j, (y, h) in enumerate(decode):
        _worker(ax, dx, y, w, h, f"decode worker {j}", PHASE_COLORS["decode"])
    for y_p, h_p in prefill:
        for y_d, h_d in decode:
            arrow(ax, (px + w + 0.03, y_p + h_p / 2), (dx - 0.03, y_d + h_d / 2), color="tab:purple")
    lowest = min(y + h / 2 for y, h in prefill + decode)
    kv_label = "KV blocks (all layers)\n+ first token\n(torch.distributed\nsend/recv)"
    ax.text((px + w + dx) / 2, lowest - 0.12, kv_label, ha="center", va="top", fontsize=7, color="tab:purple")
    back = "every token, the first included, back from the decode worker (through the router)"
    _return_path(ax, dx + w / 2, decode[-1][0], 0.4, mid - 0.6, back)
    return fig


def draw_colocated(workers: int = 2, title: str = ""):
    """The deployment chapter 13 built, for comparison: every worker runs prefill and decode of
    its requests in the same batches (continuous batching), so a long prompt delays the tokens
    of everyone decoding beside it."""
    _check_workers(workers=workers)
    fig, ax = _canvas(WIDTH, 4.5, title)
    top, bottom, mid = 4.35, 1.1, 2.725
    _clients_and_router(ax, mid)
    x, w = 3.1, 2.9
    column = _column(workers, top, bottom)
    for i, (y, h) in enumerate(column):
        _worker(ax, x, y, w, h, f"worker {i} (prefill + decode)", PHASE_COLORS["colocated"])
        arrow(ax, (ROUTER_RIGHT, mid), (x - 0.03, y + h / 2))
    ax.text((ROUTER_RIGHT + x) / 2, mid - 0.08, "whole requests", ha="center", va="top", fontsize=7)
    _return_path(ax, x + w / 2, column[-1][0], 0.4, mid - 0.6, "all tokens streamed back to the clients")
    return fig


# ---------------------------------------------------------------------------------------------
# The plots


def mode_colors(modes: Sequence[str]) -> dict[str, str]:
    """One color per serving mode: colocated red, chunked orange, disaggregated ones the rest."""
    spare = iter(c for c in ("tab:blue", "tab:green", "tab:purple", "tab:brown", "tab:pink", "tab:cyan"))
    return {m: MODE_COLORS.get(m) or next(spare, "0.3") for m in modes}


def _suptitle(fig, title: str, measured: bool) -> None:
    note = "" if measured else SIMULATED_NOTE
    fig.suptitle(", ".join(part for part in (title, note) if part))


def plot_itl_series(runs: Mapping[str, Sequence[tuple[float, float]]], arrivals: Sequence[float] = (), title: str = ""):
    """Each output token's gap since its request's previous token (ms) against the time it came
    out (s), one panel per run (shared y), the run's p99 gap a horizontal line; dashed verticals
    where long prompts arrive. Colocated, a long prompt's prefill stalls every decode beside it
    (Agrawal et al., 2023); disaggregated, the decode workers do not see it."""
    if not runs:
        raise ValueError("plot_itl_series: runs is empty")
    for name, points in runs.items():
        if len(points) == 0:
            raise ValueError(f"plot_itl_series: run {name!r} has no token gaps")
    n = len(runs)
    fig, axes = plt.subplots(n, 1, figsize=(WIDTH_IN, 1.2 + 2.0 * n), sharex=True, sharey=True, squeeze=False)
    for ax, (name, points) in zip(axes[:, 0], runs.items()):
        t, gap = np.asarray(points, dtype=float).T
        ax.plot(t, gap, ".", ms=3, alpha=0.6, color="tab:blue", label="a token's gap")
        p99 = percentiles(gap, (99,))["p99"]
        ax.axhline(p99, color="tab:red", lw=1.2, label="the run's p99 gap")
        for k, a in enumerate(arrivals):
            ax.axvline(a, color="0.4", ls="--", lw=0.9, label="long prompt arrives" if k == 0 else None)
        ax.set_title(f"{name}: p99 gap {p99:.1f} ms", fontsize=10)
        ax.set_ylabel("gap since the\nprevious token (ms)")
    axes[-1, 0].set_xlabel("time the token came out (s)")
    axes[0, 0].set_ylim(bottom=0)
    legend_under(fig, axes[0, 0], ncol=3)  # under the panels: the gaps fill them
    fig.suptitle(title)
    return finish(fig)


def _step_kind(step: Mapping) -> str:
    if step["prefill_tokens"] and step["decode_rows"]:
        return "mixed"
    return "prefill" if step["prefill_tokens"] else "decode"


def _check_timelines(timelines: Mapping[str, Mapping], window: Sequence[float], tracked: int | None) -> None:
    if not timelines:
        raise ValueError("plot_step_timeline: timelines is empty")
    if not (len(window) == 2 and window[0] < window[1]):
        raise ValueError(f"plot_step_timeline: window must be (start, end) with start < end, got {window!r}")
    for mode, t in timelines.items():
        if not t.get("lanes"):
            raise ValueError(f"plot_step_timeline: mode {mode!r} has no lanes")
        require_keys(t.get("steps", []), STEP_KEYS, f"plot_step_timeline: mode {mode!r}'s steps")
        for step in t["steps"]:
            if not 0 <= step["worker"] < len(t["lanes"]):
                raise ValueError(f"plot_step_timeline: mode {mode!r} has a step on worker {step['worker']}, no lane")
        if tracked is not None and tracked not in t.get("tokens", {}):
            raise ValueError(f"plot_step_timeline: mode {mode!r} has no tokens of request {tracked}")


def _step_lanes(ax, timeline: Mapping, window: Sequence[float]) -> None:
    """One lane per worker, top to bottom; each step a bar (clipped to the window, ms from its
    start) in its kind's color, with its prompt tokens written in it where they fit; a handoff a
    black triangle over its decode worker's lane when its K/V are ready."""
    lanes, span = timeline["lanes"], 1e3 * (window[1] - window[0])
    y = {i: len(lanes) - 1 - i for i in range(len(lanes))}
    inches_per_ms = 5.2 / span  # about the axes' width on the page
    for step in timeline["steps"]:
        x0 = 1e3 * (max(step["start"], window[0]) - window[0])
        x1 = 1e3 * (min(step["end"], window[1]) - window[0])
        kind = _step_kind(step)
        ax.barh(y[step["worker"]], x1 - x0, left=x0, height=0.56, color=STEP_COLORS[kind], ec="white", lw=0.6)
        label = f"{step['prefill_tokens']:,}"
        if step["prefill_tokens"] and (x1 - x0) * inches_per_ms > 0.06 * len(label) + 0.05:
            ax.text((x0 + x1) / 2, y[step["worker"]], label, ha="center", va="center", fontsize=7.5, color="white")
    ready = [(1e3 * (h["ready"] - window[0]), y[h["worker"]] + 0.38) for h in timeline.get("handoffs", [])]
    if ready:
        ax.plot(*zip(*ready), "v", color="black", ms=5.5, ls="none")
    ax.set_yticks(list(y.values()), lanes)
    ax.set_ylim(-0.5, len(lanes) - 0.35)
    ax.grid(axis="y", visible=False)


def plot_step_timeline(
    timelines: Mapping[str, Mapping],
    window: Sequence[float],
    tracked: int | None = None,
    title: str = "",
    measured: bool = False,
):
    """Every step of every worker over a short window of the same arrivals, as DistServe draws
    interference (Zhong et al., 2024): one panel per mode, one lane per worker, each step a bar
    from its start to its end colored by what it carries (prompt tokens only, decode rows only,
    or both: a whole prompt or a chunk beside the decodes), the prompt tokens written in the wide
    ones, and a triangle where a handoff's K/V are ready on the decode side. A decode row waits
    for the whole step it is in, so a long bar is a long gap for every request decoding on that
    worker. ``tracked``: a last panel with that request's tokens in each mode, a tick each.
    A panel's title gives the mode's ``longest_gap_ms``, its longest decode gap (between two
    tokens of a request after its first).

    ``timelines``: per mode, ``lanes`` (a name per worker), ``steps`` (rows of worker, start, end
    in s, prefill_tokens, decode_rows), optionally ``handoffs`` (worker, ready) and
    ``longest_gap_ms`` (in the panel's title) and, for ``tracked``, ``tokens`` (request id: token
    times in s), as ``bench.disagg_simulated.step_timelines`` gives them."""
    _check_timelines(timelines, window, tracked)
    lanes = [len(t["lanes"]) for t in timelines.values()]
    ratios = lanes + ([0.55 * len(timelines)] if tracked is not None else [])
    height = 1.9 + 0.62 * sum(ratios) + 0.35 * len(ratios)
    fig, axes = plt.subplots(
        len(ratios), 1, figsize=(WIDTH_IN, height), sharex=True, gridspec_kw={"height_ratios": ratios}
    )
    axes = np.atleast_1d(axes)
    for ax, (mode, t) in zip(axes, timelines.items()):
        _step_lanes(ax, t, window)
        gap = f": longest decode gap {t['longest_gap_ms']:.1f} ms" if "longest_gap_ms" in t else ""
        ax.set_title(f"{mode}{gap}", fontsize=10, loc="left")
    if tracked is not None:
        _tracked_tokens(axes[-1], timelines, window, tracked)
    span = 1e3 * (window[1] - window[0])
    axes[-1].set_xlim(0, span)
    axes[-1].set_xlabel(f"time after t = {window[0]:g} s (ms)")
    handles = [Patch(color=STEP_COLORS[k], label=STEP_LABELS[k]) for k in STEP_COLORS]
    if any(t.get("handoffs") for t in timelines.values()):
        handles.append(Line2D([], [], marker="v", color="black", ls="none", label="K/V handoff ready to decode"))
    legend_under(fig, handles=handles, labels=[h.get_label() for h in handles], ncol=2)
    _suptitle(fig, title, measured)
    return finish(fig)


def _tracked_tokens(ax, timelines: Mapping[str, Mapping], window: Sequence[float], tracked: int) -> None:
    """One row per mode: a tick at each of the request's tokens, its longest gap in the row's name."""
    names = []
    for k, (mode, t) in enumerate(timelines.items()):
        times = [1e3 * (x - window[0]) for x in t["tokens"][tracked]]
        row = len(timelines) - 1 - k
        ax.plot(times, [row] * len(times), "|", color="0.15", ms=11, mew=1.4)
        longest = max((b - a for a, b in zip(times, times[1:])), default=0.0)
        names.append((row, f"{mode}\nlongest {longest:.0f} ms"))
    ax.set_yticks([r for r, _ in names], [n for _, n in names], fontsize=8)
    ax.set_ylim(-0.6, len(timelines) - 0.4)
    ax.grid(axis="y", visible=False)
    ax.set_title(f"request {tracked}'s tokens, one tick each", fontsize=10, loc="left")


def plot_goodput_vs_rate(rows: Sequence[Mapping], title: str = "", measured: bool = True):
    """Left: goodput (requests/s that met the SLO) against the offered rate, one line per mode;
    on the dashed diagonal every request meets it. Right: the share of requests within the SLO.
    Goodput as the measure of a serving system: Zhong et al., 2024."""
    require_keys(rows, ("mode", "rate", "goodput_rps", "slo_met_pct"), "plot_goodput_vs_rate")
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(WIDTH_IN, 6.6), sharex=True)
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    colors = mode_colors(modes)
    styles = ["o-", "s--", "^:", "d-."]  # distinct marks and dashes: equal curves stay visible
    for k, mode in enumerate(modes):
        mine = sorted((r for r in rows if r["mode"] == mode), key=lambda r: r["rate"])
        x = [r["rate"] for r in mine]
        style = styles[k % len(styles)]
        ax1.plot(x, [r["goodput_rps"] for r in mine], style, color=colors[mode], label=mode, mfc="none")
        ax2.plot(x, [r["slo_met_pct"] for r in mine], style, color=colors[mode], label=mode, mfc="none")
    top = max(r["rate"] for r in rows)
    ax1.plot([0, top], [0, top], color="gray", ls="--", lw=1, label="all requests within SLO")
    ax1.set(ylabel="goodput\n(requests/s within SLO)", xlim=(0, None))
    ax1.set_ylim(0, 1.05 * top)
    ax2.set(xlabel="offered load (requests/s)", ylabel="requests within SLO (%)", ylim=(0, 105), xlim=(0, None))
    legend_under(fig, ax1, ncol=min(4, len(modes) + 1))  # one legend for both panels, under them
    _suptitle(fig, title, measured)
    return finish(fig)


def best_ratio(rows: Sequence[Mapping]) -> Mapping:
    """The row with the highest rate within the SLO per GPU (the first of equals)."""
    require_keys(rows, ("ratio", "max_rate_per_gpu"), "best_ratio")
    return max(rows, key=lambda r: r["max_rate_per_gpu"])


def plot_pd_ratio(rows: Sequence[Mapping], title: str = ""):
    """DistServe's per-GPU goodput for each prefill:decode split: the highest rate at which 90% of
    requests meet the SLO, over the GPUs (``max_rate_per_gpu``), best one in green and each bar
    labelled with the split's whole rate on its workers: the ratio that keeps both pools busy
    depends on the prompt and answer lengths (Zhong et al., 2024)."""
    require_keys(rows, ("ratio", "max_rate_rps", "max_rate_per_gpu"), "plot_pd_ratio")
    for i, r in enumerate(rows):
        if "workers" not in r and "gpus" not in r:
            raise ValueError(f"plot_pd_ratio: row {i} lacks workers (or gpus)")
    best = best_ratio(rows)
    fig, ax = plt.subplots(figsize=(WIDTH_IN, 4))
    x = np.arange(len(rows))
    heights = [r["max_rate_per_gpu"] for r in rows]
    colors = [BEST_COLOR if r is best else OTHER_COLOR for r in rows]
    bars = ax.bar(x, heights, 0.6, color=colors)
    for bar, r in zip(bars, rows):
        workers = r.get("workers", r.get("gpus"))
        plural = "worker" if workers == 1 else "workers"
        note = f"{r['max_rate_rps']:.3g} req/s\non {workers} {plural}" + ("\nbest" if r is best else "")
        ax.annotate(
            note,
            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
            textcoords="offset points",
            xytext=(0, 3),
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax.set_xticks(x, [r["ratio"] for r in rows])
    ax.set_ylim(0, 1.3 * max(heights) if max(heights) > 0 else 1)  # room for the labels
    ax.set(xlabel="prefill workers : decode workers", ylabel="highest rate in SLO\nper worker (req/s)")
    ax.grid(axis="x", visible=False)
    ax.set_title(title, fontsize=10)
    return finish(fig)


def plot_kv_transfer(rows: Sequence[Mapping], title: str = ""):
    """How long one prompt's K/V take to cross each link (log scale), one group of bars per
    model; the dark vertical line in each group is that model's prefill of the same prompt. A
    transfer well left of its line hides behind the next prefill (Patel et al., 2024)."""
    require_keys(rows, ("model", "link", "transfer_ms", "prefill_ms"), "plot_kv_transfer")
    for i, r in enumerate(rows):
        if not (r["transfer_ms"] > 0 and r["prefill_ms"] > 0):
            raise ValueError(f"plot_kv_transfer: row {i} needs transfer_ms and prefill_ms > 0 on a log axis")
    models = list(dict.fromkeys(r["model"] for r in rows))
    links = list(dict.fromkeys(r["link"] for r in rows))
    colors = {link: f"C{i}" for i, link in enumerate(links)}
    height = 0.8 / len(links)
    fig, ax = plt.subplots(figsize=(WIDTH_IN, 1.8 + 0.25 * len(links) * len(models) + 0.3 * len(models)))
    for g, model in enumerate(models):
        mine = {r["link"]: r for r in rows if r["model"] == model}
        for j, link in enumerate(links):
            if link not in mine:
                continue
            y, ms = g + j * height, mine[link]["transfer_ms"]
            ax.barh(y, ms, height * 0.9, color=colors[link], label=None if link in _labels(ax) else link)
            ax.text(ms * 1.08, y, f"{_ms(ms)} ms", va="center", fontsize=7, bbox=LABEL_BOX, zorder=3)
        prefill = next(r["prefill_ms"] for r in rows if r["model"] == model)
        span = (g - 0.5 * height, g + (len(links) - 0.5) * height)
        ax.vlines(
            prefill, *span, color="black", lw=1.5, ls="--", zorder=2, label="prefill of the prompt" if g == 0 else None
        )
        ax.text(prefill, span[0], f"prefill {_ms(prefill)} ms", va="bottom", ha="center", fontsize=7)
    ax.set_xscale("log")
    ax.set_yticks(np.arange(len(models)) + height * (len(links) - 1) / 2, models)
    ax.invert_yaxis()
    values = [r["transfer_ms"] for r in rows] + [r["prefill_ms"] for r in rows]
    ax.set_xlim(min(values) / 3, max(values) * 2.5)  # room for the value labels
    ax.set(xlabel="time to send one prompt's K/V (ms, log)")
    ax.grid(axis="y", visible=False)
    legend_under(fig, ax, ncol=2)  # under the axes, clear of the bars and their values
    ax.set_title(title, fontsize=10)
    return finish(fig)


def _ms(value: float) -> str:
    """Three significant digits, without an exponent: 1.2, 17.1, 125, 1,178."""
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def _labels(ax) -> set[str]:
    return set(ax.get_legend_handles_labels()[1])
