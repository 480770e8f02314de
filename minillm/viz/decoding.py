"""The pictures of Part III (chapters 7 to 9): speculative decoding against K, temperature and the
cost of a draft; prompt lookup by task; Jacobi iterations and a lookahead run; Medusa's candidate
tree and attention masks; and where a wide forward pays (the break-even plot).
"""

from __future__ import annotations

import re

import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.colors import ListedColormap
from matplotlib.patches import Rectangle
from torch import Tensor

from ..decoding.lookahead import LookaheadTrace
from ..decoding.medusa import MedusaTree
from ..decoding.speculative import expected_speedup, expected_tokens_per_forward
from .style import WIDTH_IN, finish, legend_right, legend_under, require_keys, tidy

# ---------------------------------------------------------------------------------------------
# Chapter 7: speculative decoding


def plot_speculative_sweep(rows: list[dict], predicted: dict[str, list[float]], title: str = ""):
    """Against K: tokens per target forward (measured, and the i.i.d. model at the measured alpha),
    and the speedup over plain decoding (measured, and each prediction in ``predicted``)."""
    ks = [r["k"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(WIDTH_IN, 6.2), sharex=True)
    ax1.plot(ks, [r["tokens_per_target_forward"] for r in rows], "o-", label="measured")
    ax1.plot(
        ks,
        [expected_tokens_per_forward(r["alpha"], r["k"]) for r in rows],
        "s--",
        label="(1 - a^(K+1)) / (1 - a),\nat the measured a",
    )
    ax1.set(ylabel="new tokens\nper target forward")
    ax1.set_ylim(bottom=0)
    ax2.plot(ks, [r["speedup"] for r in rows], "o-", color="black", label="measured")
    for (name, values), style in zip(predicted.items(), ["s--", "^:", "v-."]):
        ax2.plot(ks, values, style, label=name)
    ax2.axhline(1, color="gray", lw=1)
    ax2.set(xlabel="K, proposals per round", ylabel="speedup over\nplain decoding (x)")
    ax2.set_ylim(bottom=0)
    for ax in (ax1, ax2):
        legend_right(ax, fontsize=8)
    fig.suptitle(title)
    return finish(fig)


def plot_acceptance_vs_temperature(curve: dict[float, float], measured: dict[float, float], title: str = ""):
    """Chance of accepting one proposal against temperature: from the two models' distributions
    on real text (a line), and measured while generating (points)."""
    fig, ax = plt.subplots(figsize=(WIDTH_IN, 3.8))
    ax.plot(list(curve), list(curve.values()), "o-", label="sum min(p, q) on corpus text (teacher-forced)")
    ax.plot(list(measured), list(measured.values()), "s", ms=9, label="measured while generating")
    ax.set(
        xlabel="temperature (0 = greedy: argmax agreement)",
        ylabel="per-position acceptance rate",
        ylim=(0, 1),
        title=title,
    )
    legend_under(fig, ax, ncol=1)
    return finish(fig)


def plot_speedup_map(k: int, points: dict[str, tuple[float, float]], title: str = ""):
    """The expected speedup (1 - a^(K+1)) / ((1 - a)(K c + 1)) over acceptance a and cost ratio c,
    the break-even line dashed, and measured (a, c) pairs as points."""
    alphas, cs = np.linspace(0, 0.99, 100), np.linspace(0.0, 1.0, 101)
    grid = np.array([[expected_speedup(float(a), k, float(c)) for a in alphas] for c in cs])
    fig, ax = plt.subplots(figsize=(WIDTH_IN, 4.2))
    filled = ax.contourf(alphas, cs, grid, levels=sorted({0, 0.5, 0.75, 1, 1.5, 2, 3, 4, k + 1}), cmap="RdYlGn")
    ax.contour(alphas, cs, grid, levels=[1], colors="black", linestyles="--")
    fig.colorbar(filled, label="expected speedup (x)")
    for name, (a, c) in points.items():
        # a point on the frame (the target drafting for itself: a = 1, c = 1) stays whole and visible
        ax.plot(a, c, "o", color="black", mec="white", mew=1.5, ms=9, clip_on=False, zorder=5)
        right = a > 0.7
        ax.annotate(
            name,
            (a, c),
            textcoords="offset points",
            xytext=(-9 if right else 7, -16 if c > 0.9 else 6),
            ha="right" if right else "left",
            fontsize=8,
            bbox={"boxstyle": "round,pad=0.2", "fc": "white", "ec": "0.4", "alpha": 0.9},
            zorder=6,
        )
    ax.set(xlabel="acceptance rate a", ylabel="draft / target cost per forward, c", title=title)
    return finish(fig)


# ---------------------------------------------------------------------------------------------
# Chapter 8: prompt lookup


def plot_lookup_by_task(rows: list[dict], title: str = ""):
    """Per prompt: prompt lookup's speedup and tokens per forward against the share of the output
    that could be copied, one colour per task."""
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(WIDTH_IN, 6.0), sharex=True)
    for task in dict.fromkeys(r["task"] for r in rows):
        mine = [r for r in rows if r["task"] == task]
        x = [r["copyable"] for r in mine]
        ax1.plot(x, [r["speedup"] for r in mine], "o", label=task)
        ax2.plot(x, [r["tokens_per_target_forward"] for r in mine], "o", label=task)
    ax1.axhline(1, color="gray", lw=1)
    ax1.set(ylabel="speedup over greedy (x)")
    ax2.set(
        xlabel="copyable share: fraction of output tokens a 3-gram lookup could copy",
        ylabel="new tokens per forward",
    )
    legend_under(fig, ax1, ncol=min(4, len(ax1.get_legend_handles_labels()[1])))
    fig.suptitle(title)
    return finish(fig)


# ---------------------------------------------------------------------------------------------
# Chapter 9: lookahead, Medusa, and what a wide forward costs


def plot_jacobi(guesses: list[list[int]], target: list[int], labels: list[str] | None = None, title: str = ""):
    """Jacobi iterations as a grid, one row per iteration: green where the guess already has greedy's
    token, a dark edge on the confirmed prefix (every token before it right too). A token's text longer
    than its cell holds at 7 pt is cut and ends in '…', and the x label says so."""
    right = torch.tensor([[g == t for g, t in zip(guess, target)] for guess in guesses])  # (iters, n)
    fig, ax = plt.subplots(figsize=(min(WIDTH_IN, 0.62 * len(target) + 1.5), 0.3 * len(guesses) + 1.4))
    cell_pt = 72 * (fig.get_figwidth() - 1.3) / len(target)
    chars = max(2, min(6, int(cell_pt / 4.5)))  # what of each token's text fits its cell at 7 pt

    def fit(text: str) -> str:  # cut visibly, never silently
        return text if len(text) <= chars else text[: chars - 1] + "…"

    ax.imshow(right.numpy(), cmap=ListedColormap(["#f2f2f2", "#8fd18b"]), vmin=0, vmax=1, aspect="auto")
    for it, guess in enumerate(guesses):
        prefix = next((i for i, ok in enumerate(right[it].tolist()) if not ok), len(target))
        if prefix:
            ax.add_patch(Rectangle((-0.5, it - 0.5), prefix, 1, fill=False, ec="black", lw=1.5))
        if labels is not None:
            for i, token in enumerate(guess):
                ax.text(i, it, fit(labels[token]), ha="center", va="center", fontsize=7)
    cut = labels is not None and any(len(labels[t]) > chars for guess in guesses for t in guess)
    note = f"\n(tokens over {chars} characters cut: … marks the cut)" if cut else ""
    ax.set(
        xlabel="position in the block of new tokens" + note,
        ylabel="Jacobi iteration\n(0 = initial guess)",
        title=title,
    )
    ax.grid(False)
    return finish(fig)


def plot_lookahead_trace(trace: LookaheadTrace, title: str = ""):
    """Two panels over the steps of one run: tokens accepted from the pool, and the pool's size."""
    steps = range(len(trace.steps))
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(WIDTH_IN, 5.6), sharex=True)
    ax1.bar(steps, trace.accepted_lengths, color="tab:green", width=1.0)
    ax1.set(ylabel="pool tokens\naccepted", title="accepted per step (+1 of its own)")
    ax2.plot(steps, [s["pool_size"] for s in trace.steps], color="tab:blue")
    ax2.plot(
        steps,
        [len(s["candidates"]) for s in trace.steps],
        ".",
        color="tab:orange",
        ms=3,
        label="n-grams verified that step",
    )
    ax2.lines[0].set_label("n-grams in the pool")
    ax2.set(xlabel="step (one forward)", ylabel="n-grams", title="n-grams in the pool")
    legend_under(fig, ax2, ncol=2)
    fig.suptitle(title)
    return finish(fig)


def tree_layout(tree: MedusaTree) -> list[tuple[float, float]]:
    """(x, y) of each node for a drawing: x its depth, leaves one unit apart, a parent centred on its children."""
    children = [[] for _ in range(len(tree))]
    for i, p in enumerate(tree.parents[1:], start=1):
        children[p].append(i)
    y, next_leaf = [0.0] * len(tree), [0.0]

    def place(i: int) -> float:
        if children[i]:
            y[i] = sum(place(c) for c in children[i]) / len(children[i])
        else:
            y[i], next_leaf[0] = next_leaf[0], next_leaf[0] + 1
        return y[i]

    place(0)
    return [(float(tree.depths[i]), -y[i]) for i in range(len(tree))]


def draw_tree(
    tree: MedusaTree, labels: list[str] | None = None, accepted: list[int] | None = None, title: str = "", ax=None
):
    """The candidate tree, root at the left, one column per head; ``labels`` per node (default: its
    path), the ``accepted`` path (node ids) in green."""
    own = ax is None
    if own:
        _, ax = plt.subplots(figsize=(min(WIDTH_IN, 2.2 * (tree.depth + 1)), 0.32 * len(tree) + 1))
    xy, on_path = tree_layout(tree), set(accepted or [])
    labels = labels or ["root", *("".join(map(str, p)) for p in tree.paths[1:])]
    for i, p in enumerate(tree.parents[1:], start=1):
        good = i in on_path and p in on_path
        ax.plot(
            [xy[p][0], xy[i][0]],
            [xy[p][1], xy[i][1]],
            color="tab:green" if good else "0.7",
            lw=2.5 if good else 1,
            zorder=1,
        )
    for i, (x, y) in enumerate(xy):
        color = "#c7e9c0" if i in on_path else "white"
        ax.text(
            x,
            y,
            f"{i}: {labels[i]}",
            ha="center",
            va="center",
            fontsize=8,
            zorder=2,
            bbox={"boxstyle": "round", "fc": color, "ec": "tab:green" if i in on_path else "0.5"},
        )
    ax.set_xticks(
        range(tree.depth + 1), ["root\n(last token)"] + [f"head {d}\ntop-{k}" for d, k in enumerate(tree.top_k, 1)]
    )
    ax.set_yticks([])
    ax.set_xlim(-0.6, tree.depth + 0.6)
    ax.grid(False)
    for side in ("left", "bottom"):
        ax.spines[side].set_visible(False)
    ax.set_title(title)
    if own:
        finish(ax.figure)
    return ax


def plot_mask(mask: Tensor, labels: list[str] | None = None, title: str = "", ax=None):
    """A boolean attention mask as a picture: row i is what token i may see (dark = attends)."""
    n = mask.shape[0]
    own = ax is None
    if own:
        width = min(WIDTH_IN, 0.22 * n + 1.5)
        _, ax = plt.subplots(figsize=(width, width - 0.3))
    ax.imshow(mask.cpu().numpy(), cmap="Greys", vmin=0, vmax=1.3)
    ticks = labels or [str(i) for i in range(n)]
    cell_pt = 72 * ax.get_position().height * ax.figure.get_figheight() / n
    every = max(1, int(np.ceil(9 / cell_pt)))  # label every token that has 9 pt of room, at 7 pt
    shown = range(0, n, every)
    ax.set_xticks(shown, [ticks[i] for i in shown], rotation=90, fontsize=7)
    ax.set_yticks(shown, [ticks[i] for i in shown], fontsize=7)
    ax.set(xlabel="key (token attended to)", ylabel="query (token attending)", title=title)
    ax.grid(False)
    if own:
        finish(ax.figure)
    else:
        tidy(ax.figure)
    return ax


def plot_break_even(relative_cost: dict[str, dict], methods: dict[str, tuple[float, float]], title: str = ""):
    """Cost of a forward of T tokens relative to T = 1 (one line per device or model), and each
    method at (its mean width, its tokens per target forward): a method above a line gains there."""
    fig, ax = plt.subplots(figsize=(WIDTH_IN, 4.2))
    for name, by_t in relative_cost.items():
        ts = sorted(int(t) for t in by_t)
        ax.plot(ts, [by_t[t] if t in by_t else by_t[str(t)] for t in ts], ".-", lw=1.5, ms=6, label=name, zorder=2)
    # the methods in black, one marker shape each, drawn over the lines with a white rim: no line's
    # colour is reused, and a method that sits at a measured width stays visible on top of the line
    shapes = ["*", "P", "X", "D", "^", "s"]
    for i, (name, (width, tokens)) in enumerate(methods.items()):
        ax.plot(
            [width],
            [tokens],
            shapes[i % len(shapes)],
            ms=14 if shapes[i % len(shapes)] == "*" else 10,
            color="black",
            mec="white",
            mew=1.2,
            zorder=5,
            label=f"{name}: {tokens:.2f} tokens/forward",
        )
    ax.set_xscale("log", base=2)
    ax.set(
        xlabel="tokens in one forward (T)",
        ylabel="cost relative to a 1-token forward\nor tokens per forward",
        title=title,
    )
    legend_under(fig, ax, ncol=2, fontsize=8)
    return finish(fig)


def plot_round_split(rows: list[dict], title: str = ""):
    """Per method (``bench decoding`` rows, eager and compiled): the milliseconds of a round inside
    the model's forwards and outside them, stacked, with one plain greedy step of the same kind
    marked, and each row's measured speedup at the end of its bar."""
    require_keys(rows, ["method", "ms_per_round", "forward_ms_per_round", "other_ms_per_round"], "plot_round_split")
    methods = [r for r in rows if not r["method"].startswith("greedy")]
    if not methods:
        raise ValueError("plot_round_split needs rows of draft-and-verify methods, not greedy alone")
    fig, ax = plt.subplots(figsize=(WIDTH_IN, 0.42 * len(methods) + 2.4))
    y = np.arange(len(methods))[::-1]
    inside = [r["forward_ms_per_round"] for r in methods]
    outside = [r["other_ms_per_round"] for r in methods]
    ax.barh(y, inside, color="C0", label="inside the forwards")
    ax.barh(y, outside, left=inside, color="C3", label="outside: the loop's own work")
    for yi, r in zip(y, methods):
        end = r["forward_ms_per_round"] + r["other_ms_per_round"]
        ax.text(end, yi, f" {r['speedup']:.2f}x", va="center", fontsize=9)
        ax.plot([r["plain_step_ms"]] * 2, [yi - 0.4, yi + 0.4], color="k", lw=1.5)
    ax.plot([], [], color="k", lw=1.5, label="one plain greedy step (same kind)")
    ax.plot([], [], ls="none", marker="$1.2x$", ms=18, color="k", label="speedup over that greedy")
    # the methods' settings (K, W, N, G, the tree) are in the table beside the figure
    ax.set_yticks(y, [re.sub(r" \(.*?\)", "", r["method"]) for r in methods], fontsize=9)
    ax.set(xlabel="milliseconds per round (one target forward)", title=title)
    ax.set_xlim(0, 1.18 * max(a + b for a, b in zip(inside, outside)))
    legend_under(fig, ax, ncol=2, fontsize=8)
    return finish(fig)
