"""Chapter 15's pictures: the five ways to spread one model's inference over several GPUs drawn
side by side (replicas; tensor parallel, Shoeybi et al., 2019; pipeline, Huang et al., 2019;
context parallel, ring attention, Liu et al., 2023; expert parallel, Lepikhin et al., 2020),
a pipeline's timeline with its bubble (p - 1) / (m + p - 1), which K/V block each rank holds at
each step of ring attention, the causal work per rank of a contiguous and a zigzag split of the
sequence, predicted against published tensor-parallel speedups, and counted bytes against their
formulas.
"""

from __future__ import annotations

import textwrap
from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.colors import ListedColormap
from matplotlib.patches import Patch

from ..parallel.context import imbalance
from ..parallel.pipeline import Interval, bubble_fraction, measured_bubble
from .style import WIDTH_IN, arrow, box, finish, legend_under, require_keys

RANK_COLORS = ["#c6dbef", "#fdd0a2", "#c7e9c0", "#dadaeb", "#fcbba1", "#d9d9d9", "#fee391", "#ccebc5"]
COMM_COLOR = "tab:purple"
IDEAL_COLOR = "0.5"


# ---------------------------------------------------------------------------------------------
# The five kinds


def _panel(ax, title: str) -> None:
    ax.set(xlim=(0, 10), ylim=(0, 6))
    ax.axis("off")
    ax.set_title(title, fontsize=10, weight="bold")


def _draw_replicas(ax) -> None:
    _panel(ax, "replicas: N whole copies, requests split")
    box(ax, 0.2, 2.3, 1.6, 1.4, "requests", "white")
    for i, y in enumerate((4.3, 2.3, 0.3)):
        box(ax, 4.2, y, 5.4, 1.4, f"GPU {i}: the whole model\n(all layers, own KV cache)", RANK_COLORS[i], fontsize=8)
        arrow(ax, (1.85, 3.0), (4.15, y + 0.7))
    ax.text(1.0, 1.0, "nothing exchanged\nbetween GPUs", ha="center", va="center", fontsize=8, color="0.3")


def _draw_tensor(ax) -> None:
    _panel(ax, "tensor parallel: every layer's matrices split")
    box(ax, 0.1, 2.25, 1.3, 1.5, "x\n(tokens, d)", "white", fontsize=8)
    for i, y in enumerate((3.5, 0.4)):
        # named by what each rank computes: half the outputs, or half the inputs, of each matrix
        columns = f"rank {i}: q/k/v, gate/up\ncolumn-parallel:\noutputs, half {i + 1}/2"
        rows = f"o, down: row-parallel\ninputs, half {i + 1}/2\n(partial sum)"
        box(ax, 1.9, y, 2.6, 2.1, columns, RANK_COLORS[i], fontsize=8)
        box(ax, 4.9, y, 2.7, 2.1, rows, RANK_COLORS[i], fontsize=8)
        arrow(ax, (1.45, 3.0), (1.85, y + 1.05))
        arrow(ax, (4.55, y + 1.05), (4.85, y + 1.05))
        arrow(ax, (7.65, y + 1.05), (8.05, 3.0), color=COMM_COLOR)
    box(ax, 8.1, 1.95, 1.8, 2.1, "all-reduce\n(sum)\n2 per layer", "#e5d8f0", fontsize=8)


def _draw_pipeline(ax) -> None:
    _panel(ax, "pipeline: consecutive layers on consecutive ranks")
    width, gap = 1.9, 0.6
    for i in range(4):
        x = 0.1 + i * (width + gap)
        box(ax, x, 1.9, width, 2.2, f"rank {i}\nlayers\n{8 * i}-{8 * i + 7}", RANK_COLORS[i], fontsize=8)
        if i < 3:
            arrow(ax, (x + width + 0.03, 3.0), (x + width + gap - 0.03, 3.0), color=COMM_COLOR)
    ax.text(5.0, 0.9, "activations (tokens, d) sent rank to rank", ha="center", fontsize=8, color=COMM_COLOR)
    ax.text(5.0, 4.7, "micro-batches keep every rank busy, but for the bubble", ha="center", fontsize=8, color="0.3")


def _draw_context(ax) -> None:
    _panel(ax, "context parallel: the sequence split, K/V passed round a ring")
    centers = [(2.6, 4.6), (7.4, 4.6), (7.4, 1.3), (2.6, 1.3)]
    w, h = 3.0, 1.5
    for i, (cx, cy) in enumerate(centers):
        box(ax, cx - w / 2, cy - h / 2, w, h, f"rank {i}: tokens\nchunk {i} (Q, K, V)", RANK_COLORS[i], fontsize=8)
    for i in range(4):
        (x0, y0), (x1, y1) = centers[i], centers[(i + 1) % 4]
        if y0 == y1:  # horizontal: leave from the side
            sign = 1 if x1 > x0 else -1
            arrow(ax, (x0 + sign * w / 2, y0), (x1 - sign * w / 2, y1), color=COMM_COLOR)
        else:
            sign = 1 if y1 > y0 else -1
            arrow(ax, (x0, y0 + sign * h / 2), (x1, y1 - sign * h / 2), color=COMM_COLOR)
    ax.text(5.0, 2.95, "K/V blocks\nround the ring", ha="center", va="center", fontsize=8, color=COMM_COLOR)


def _draw_expert(ax) -> None:
    _panel(ax, "expert parallel: a MoE layer's experts split, tokens sent to them")
    for i, y in enumerate((3.05, 0.75)):
        box(ax, 0.1, y, 2.6, 2.0, f"rank {i}: its own tokens\nattention, router\n(whole)", RANK_COLORS[i], fontsize=8)
        box(ax, 7.3, y, 2.6, 2.0, f"experts {2 * i}-{2 * i + 1}\n(of 4)", RANK_COLORS[i], fontsize=8)
    for y0, y1 in ((4.05, 4.25), (4.05, 2.0), (1.75, 3.85), (1.75, 1.55)):  # every rank to every rank
        arrow(ax, (2.75, y0), (7.25, y1), color=COMM_COLOR)
    line = "all-to-all: each token to the ranks of its top-k experts,"
    ax.text(5.0, 5.45, line, ha="center", va="center", fontsize=8, color=COMM_COLOR)
    back = "and the experts' outputs back (a second all-to-all)"
    ax.text(5.0, 0.3, back, ha="center", va="center", fontsize=8, color=COMM_COLOR)


def draw_parallelism_kinds(title: str = "Five ways to run one model on several GPUs"):
    """Five schematic panels, one above the other: replicas, tensor parallel, pipeline, context
    parallel, expert parallel; what each rank holds and, in purple, what travels between ranks."""
    panels = (_draw_replicas, _draw_tensor, _draw_pipeline, _draw_context, _draw_expert)
    fig, axes = plt.subplots(len(panels), 1, figsize=(WIDTH_IN, 1.78 * len(panels)))
    for draw, ax in zip(panels, axes.flat):
        draw(ax)
    fig.suptitle(title)
    return finish(fig)


# ---------------------------------------------------------------------------------------------
# Pipeline timeline


def plot_pipeline_timeline(
    timelines: Sequence[Sequence[Interval]],
    stages: int,
    micro_batches: int,
    phase: str = "prefill",
    step: int = 0,
    hardware: str = "",
    title: str = "",
):
    """A Gantt chart of one pass (``phase``, ``step``): one row per rank (rank 0 on top), one bar
    per micro-batch's forward on that rank, labelled by micro-batch. The title gives the measured
    bubble (``parallel.pipeline.measured_bubble``) beside the formula (p - 1) / (m + p - 1).
    Input: per rank the ``Interval`` list ``pipeline_generate`` recorded."""
    if len(timelines) != stages:
        raise ValueError(f"plot_pipeline_timeline: {len(timelines)} ranks' timelines for {stages} stages")
    passes = [[iv for iv in rank if iv.phase == phase and iv.step == step] for rank in timelines]
    for r, bars in enumerate(passes):
        if not bars:
            raise ValueError(f"plot_pipeline_timeline: rank {r} recorded no interval of {phase} step {step}")
        if any(iv.end < iv.start for iv in bars):
            raise ValueError(f"plot_pipeline_timeline: rank {r} has a bar ending before it starts")
    fig, ax = plt.subplots(figsize=(WIDTH_IN, 1.4 + 0.55 * stages))
    t0 = min(iv.start for bars in passes for iv in bars)
    scale, unit = _time_unit(max(iv.end for bars in passes for iv in bars) - t0)
    for r, bars in enumerate(passes):
        for iv in bars:
            left, width = (iv.start - t0) * scale, (iv.end - iv.start) * scale
            color = RANK_COLORS[iv.micro_batch % len(RANK_COLORS)]
            ax.barh(r, width, left=left, height=0.7, color=color, edgecolor="0.3")
            ax.text(left + width / 2, r, str(iv.micro_batch), ha="center", va="center", fontsize=8)
    ax.set_yticks(range(stages), [f"rank {r}" for r in range(stages)])
    ax.invert_yaxis()
    ax.set(xlabel=f"time since the first micro-batch started ({unit})", ylabel="pipeline stage")
    ax.grid(axis="y", visible=False)
    measured = measured_bubble(timelines, phase, step)["mean"]
    formula = bubble_fraction(stages, micro_batches)
    head = title or f"Pipeline of {stages} stages, {micro_batches} micro-batches, {phase} (bars: micro-batch)"
    line = f"bubble measured {measured:.0%}, formula (p-1)/(m+p-1) = {formula:.0%}"
    ax.set_title("\n".join(part for part in (head, line, hardware) if part), fontsize=10)
    return finish(fig)


def _time_unit(span_s: float) -> tuple[float, str]:
    return (1e3, "ms") if span_s < 1 else (1.0, "s")


# ---------------------------------------------------------------------------------------------
# Ring attention


def ring_schedule(world: int) -> list[list[int]]:
    """holds[rank][step]: the K/V block rank ``rank`` attends at ``step`` when each rank passes its
    block to the next rank each step: (rank - step) mod world."""
    return [[(rank - step) % world for step in range(world)] for rank in range(world)]


def plot_ring_steps(world: int, title: str = ""):
    """A grid ranks x steps: in each cell the K/V block that rank holds at that step (the
    sequence split contiguously, rank r holding queries of chunk r). Causally, a rank skips a
    block from later in the sequence (grey), computes a block from earlier in full (blue), and
    its own block under the causal mask (orange)."""
    if not isinstance(world, int) or isinstance(world, bool) or not 2 <= world <= 16:
        raise ValueError(f"world must be an integer between 2 and 16 for a readable grid, got {world!r}")
    holds = np.array(ring_schedule(world))
    ranks = np.arange(world)[:, None]
    kind = np.where(holds < ranks, 0, np.where(holds == ranks, 1, 2))  # 0 full, 1 diagonal, 2 skipped
    colors = ["#9ecae1", "#fdae6b", "#e0e0e0"]
    fig, ax = plt.subplots(figsize=(min(WIDTH_IN, 3.0 + 0.6 * world), 1.6 + 0.45 * world))
    ax.imshow(kind, cmap=ListedColormap(colors), vmin=-0.5, vmax=2.5, aspect="auto")
    for r in range(world):
        for s in range(world):
            ax.text(
                s, r, f"K/V {holds[r, s]}" if world <= 8 else str(holds[r, s]), ha="center", va="center", fontsize=8
            )
    ax.set_xticks(range(world), [str(s) for s in range(world)])
    ax.set_yticks(range(world), [f"rank {r}" for r in range(world)])
    ax.set(xlabel="ring step", ylabel="rank (holds queries of its chunk)")
    ax.grid(visible=False)
    legend = [
        Patch(color=colors[0], label="earlier block: full attention"),
        Patch(color=colors[1], label="own block: causal mask"),
        Patch(color=colors[2], label="later block: skipped (causal)"),
    ]
    legend_under(fig, handles=legend, labels=[p.get_label() for p in legend], ncol=1)
    skipped = int((kind == 2).sum())
    head = title or f"Ring attention over {world} ranks: which K/V block each rank holds"
    ax.set_title(f"{head}\n{skipped} of {world * world} block pairs skipped by the causal mask", fontsize=10)
    return finish(fig)


# ---------------------------------------------------------------------------------------------
# Causal work per rank


def plot_causal_work(work_by_layout: Mapping[str, Sequence[int]], unit: str = "query-key pairs", title: str = ""):
    """Bars of the causal attention work each rank does, side by side per layout (e.g. the
    sequence cut in contiguous chunks, where the last rank does most, against a zigzag that
    gives each rank one early and one late chunk); the legend gives each layout's max/mean."""
    if not work_by_layout:
        raise ValueError("plot_causal_work: work_by_layout is empty")
    lengths = {len(w) for w in work_by_layout.values()}
    if len(lengths) != 1 or 0 in lengths:
        raise ValueError("plot_causal_work: every layout needs the same, non-zero number of ranks")
    ranks = lengths.pop()
    fig, ax = plt.subplots(figsize=(min(WIDTH_IN, 3.5 + 0.6 * ranks), 3.8))
    x = np.arange(ranks)
    width = 0.8 / len(work_by_layout)
    for k, (layout, work) in enumerate(work_by_layout.items()):
        label = f"{layout} (max/mean {imbalance(work):.2f})"
        ax.bar(x + (k - (len(work_by_layout) - 1) / 2) * width, work, width * 0.95, color=f"C{k}", label=label)
    ax.set_xticks(x, [f"rank {r}" for r in range(ranks)])
    ax.set(xlabel="rank", ylabel=f"causal attention work ({unit})")
    ax.grid(axis="x", visible=False)
    legend_under(fig, ax, ncol=min(2, len(work_by_layout)))
    ax.set_title(title or "Causal attention work per rank", fontsize=10)
    return finish(fig)


# ---------------------------------------------------------------------------------------------
# Tensor-parallel speedups and counted bytes


def plot_tp_speedup(rows: Sequence[Mapping], title: str = ""):
    """Speedup against the number of GPUs, one line per (model, link) for the prediction, round
    markers for published figures where a row has them, and the ideal from each baseline
    (speedup = GPUs / the setup's fewest). Rows as ``parallel.predict.tp_speedup_rows`` makes them."""
    require_keys(rows, ("model", "link", "gpus", "predicted_speedup"), "plot_tp_speedup")
    setups = list(dict.fromkeys((r["model"], r["link"]) for r in rows))
    fig, ax = plt.subplots(figsize=(WIDTH_IN, 4.5))
    for k, (model, link) in enumerate(setups):
        mine = sorted((r for r in rows if (r["model"], r["link"]) == (model, link)), key=lambda r: r["gpus"])
        gpus = [r["gpus"] for r in mine]
        base = mine[0].get("relative_to_gpus", 1)
        label = f"{model}, {link}" + (f" (vs {base} GPUs)" if base != 1 else "")
        ax.plot(
            gpus, [r["predicted_speedup"] for r in mine], "s--", color=f"C{k}", mfc="none", label=f"{label}: predicted"
        )
        published = [(r["gpus"], r["published_speedup"]) for r in mine if r.get("published_speedup") is not None]
        if published:
            px, py = zip(*published)
            ax.plot(px, py, "o-", color=f"C{k}", label=f"{label}: published")
    top = max(r["gpus"] for r in rows)
    # one ideal per baseline: from b GPUs the ideal speedup is GPUs / b
    for b, style in zip(sorted({r.get("relative_to_gpus", 1) for r in rows}), (":", "-.", "--")):
        unit = "GPU" if b == 1 else "GPUs"
        ax.plot([b, top], [1, top / b], color=IDEAL_COLOR, ls=style, lw=1, label=f"ideal from {b} {unit} (GPUs / {b})")
    ax.set(xlabel="GPUs (tensor-parallel size)", ylabel="decode speedup\n(tokens/s over the fewest GPUs)")
    ax.set_xticks(sorted({r["gpus"] for r in rows}))
    ax.set_ylim(bottom=0)
    legend_under(fig, ax, ncol=1, fontsize=8)
    ax.set_title(title or "Tensor-parallel decode speedup, predicted and published", fontsize=10)
    return finish(fig)


def plot_comm_bytes(rows: Sequence[Mapping], hardware: str = "", title: str = ""):
    """Bytes counted by ``Comm`` beside the formula's, per kind of communication (log scale):
    equal bars say the model sends exactly what the arithmetic says."""
    require_keys(rows, ("kind", "measured", "formula"), "plot_comm_bytes")
    for i, r in enumerate(rows):
        if not (r["measured"] > 0 and r["formula"] > 0):
            raise ValueError(f"plot_comm_bytes: row {i} needs measured and formula > 0 on a log axis")
    fig, ax = plt.subplots(figsize=(min(WIDTH_IN, 3.5 + 1.3 * len(rows)), 4))
    x = np.arange(len(rows))
    ax.bar(x - 0.2, [r["measured"] for r in rows], 0.38, color="tab:blue", label="counted by Comm")
    ax.bar(x + 0.2, [r["formula"] for r in rows], 0.38, color="tab:orange", label="formula")
    ax.set_yscale("log")
    values = [r[k] for r in rows for k in ("measured", "formula")]
    ax.set_ylim(min(values) / 10, max(values) * 3)  # the smallest bar stays visible
    # each label wrapped to its bar pair's width, so neighbours never run into each other
    ax.set_xticks(x, ["\n".join(textwrap.wrap(r["kind"], 14)) for r in rows])
    ax.set(xlabel="communication", ylabel="payload bytes per rank (log)")
    ax.grid(axis="x", visible=False)
    legend_under(fig, ax, ncol=2)
    head = title or "Bytes sent: counted against the formula"
    ax.set_title("\n".join(part for part in (head, hardware) if part), fontsize=10)
    return finish(fig)
