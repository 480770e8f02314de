"""Chapter 15's pictures (viz.parallel) draw what they are given: four panels of the kinds of
parallelism, a bar per micro-batch with the measured and formula bubble, the ring's schedule and
causal skips, work per rank with its imbalance, speedup lines and byte bars."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
from matplotlib.patches import FancyArrowPatch  # noqa: E402

from minillm.parallel.pipeline import Interval, bubble_fraction, measured_bubble  # noqa: E402
from minillm.viz.parallel import (  # noqa: E402
    draw_parallelism_kinds,
    imbalance,
    plot_causal_work,
    plot_comm_bytes,
    plot_pipeline_timeline,
    plot_ring_steps,
    plot_tp_speedup,
    ring_schedule,
)


def texts(ax) -> list[str]:
    return [t.get_text() for t in ax.texts]


def overlapping(fig) -> list[tuple[str, str]]:
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    boxes = [(t.get_text(), t.get_window_extent(renderer)) for ax in fig.axes for t in ax.texts]
    return [(a, b) for i, (a, ea) in enumerate(boxes) for b, eb in boxes[i + 1 :] if ea.overlaps(eb)]


def test_five_kinds_drawn():
    fig = draw_parallelism_kinds()
    assert len(fig.axes) == 5 and fig.get_figwidth() <= 10
    titles = [ax.get_title() for ax in fig.axes]
    kinds = ("replicas", "tensor parallel", "pipeline", "context parallel", "expert parallel")
    for word, ax in zip(kinds, fig.axes):
        assert ax.get_title().startswith(word), titles
    replicas, tensor, pipeline, context, expert = fig.axes
    assert sum("whole model" in t for t in texts(replicas)) == 3
    assert any("all-reduce" in t for t in texts(tensor)) and sum(t.startswith("rank") for t in texts(tensor)) == 2
    # the prose's names: column-parallel splits a matrix's outputs, row-parallel its inputs
    assert sum("column-parallel" in t and "outputs" in t for t in texts(tensor)) == 2
    assert sum("row-parallel" in t and "inputs" in t for t in texts(tensor)) == 2
    assert sum(t.startswith("experts") for t in texts(expert)) == 2
    assert any("all-to-all" in t for t in texts(expert))
    assert sum(t.startswith("rank") for t in texts(pipeline)) == 4
    ring_arrows = [a for a in context.patches if isinstance(a, FancyArrowPatch)]
    assert len(ring_arrows) == 4
    assert overlapping(fig) == []
    plt.close(fig)


def gpipe(p: int, m: int, t: float = 0.01) -> list[list[Interval]]:
    return [[Interval("prefill", 0, i, (i + r) * t, (i + r + 1) * t) for i in range(m)] for r in range(p)]


def test_pipeline_timeline_bars_and_bubble():
    assert bubble_fraction(4, 6) == pytest.approx(3 / 9)
    assert measured_bubble(gpipe(4, 6))["mean"] == pytest.approx(3 / 9)  # an ideal schedule meets the formula
    fig = plot_pipeline_timeline(gpipe(4, 6), 4, 6, hardware="4 CPU processes")
    ax = fig.axes[0]
    assert len(ax.patches) == 24
    assert "bubble measured 33%" in ax.get_title() and "(p-1)/(m+p-1) = 33%" in ax.get_title()
    assert "4 CPU processes" in ax.get_title() and "(ms)" in ax.get_xlabel()
    assert [t.get_text() for t in ax.get_yticklabels()] == ["rank 0", "rank 1", "rank 2", "rank 3"]
    plt.close(fig)
    with pytest.raises(ValueError, match="3 ranks' timelines for 4 stages"):
        plot_pipeline_timeline(gpipe(3, 2), 4, 2)
    with pytest.raises(ValueError, match="no interval of decode step 1"):
        plot_pipeline_timeline(gpipe(2, 2), 2, 2, phase="decode", step=1)


def test_ring_steps_grid_and_causal_skips():
    assert ring_schedule(3) == [[0, 2, 1], [1, 0, 2], [2, 1, 0]]
    fig = plot_ring_steps(4)
    ax = fig.axes[0]
    cells = texts(ax)
    assert len(cells) == 16 and cells[:4] == ["K/V 0", "K/V 3", "K/V 2", "K/V 1"]
    assert "6 of 16 block pairs skipped" in ax.get_title()  # 4 x 3 / 2 later blocks
    assert ax.get_xlabel() == "ring step" and "rank" in ax.get_ylabel()
    plt.close(fig)
    with pytest.raises(ValueError, match="world"):
        plot_ring_steps(1)


def test_causal_work_bars_and_imbalance():
    work = {"contiguous": [1, 3, 5, 7], "zigzag": [4, 4, 4, 4]}
    assert imbalance(work["contiguous"]) == 1.75 and imbalance(work["zigzag"]) == 1.0
    fig = plot_causal_work(work)
    ax = fig.axes[0]
    assert [b.get_height() for b in ax.patches] == [1, 3, 5, 7, 4, 4, 4, 4]
    labels = [t.get_text() for t in fig.legends[0].get_texts()]  # under the bars
    assert labels == ["contiguous (max/mean 1.75)", "zigzag (max/mean 1.00)"]
    assert ax.get_title() and "work" in ax.get_ylabel()
    plt.close(fig)
    with pytest.raises(ValueError, match="same, non-zero number of ranks"):
        plot_causal_work({"a": [1, 2], "b": [1]})


def test_tp_speedup_lines():
    rows = [
        {"model": "M", "link": "NVLink", "gpus": g, "predicted_speedup": p, "published_speedup": q}
        for g, p, q in ((1, 1.0, 1.0), (2, 1.5, 1.6), (4, 2.2, 2.4))
    ] + [{"model": "M", "link": "PCIe", "gpus": g, "predicted_speedup": p} for g, p in ((1, 1.0), (2, 1.3))]
    fig = plot_tp_speedup(rows)
    ax = fig.axes[0]
    labels = [ln.get_label() for ln in ax.lines]
    assert labels == [
        "M, NVLink: predicted",
        "M, NVLink: published",
        "M, PCIe: predicted",
        "ideal from 1 GPU (GPUs / 1)",
    ]
    assert list(ax.lines[1].get_ydata()) == [1.0, 1.6, 2.4] and list(ax.lines[2].get_xdata()) == [1, 2]
    assert list(ax.lines[3].get_xdata()) == [1, 4] and list(ax.lines[3].get_ydata()) == [1, 4.0]
    assert "GPUs" in ax.get_xlabel() and "speedup" in ax.get_ylabel() and ax.get_title()
    plt.close(fig)
    # a model that only fits on two GPUs starts there, against its own ideal line
    big = [
        {"model": "B", "link": "NVLink", "gpus": g, "predicted_speedup": p, "relative_to_gpus": 2}
        for g, p in ((2, 1.0), (4, 1.7), (8, 2.6))
    ]
    fig = plot_tp_speedup(rows + big)
    ax = fig.axes[0]
    labels = [ln.get_label() for ln in ax.lines]
    assert labels[3] == "B, NVLink (vs 2 GPUs): predicted"
    assert labels[-2:] == ["ideal from 1 GPU (GPUs / 1)", "ideal from 2 GPUs (GPUs / 2)"]
    assert list(ax.lines[-1].get_xdata()) == [2, 8] and list(ax.lines[-1].get_ydata()) == [1, 4.0]
    plt.close(fig)
    with pytest.raises(ValueError, match="lacks predicted_speedup"):
        plot_tp_speedup([{"model": "M", "link": "l", "gpus": 1}])


def test_comm_bytes_bars():
    rows = [
        {"kind": "TP all-reduce", "measured": 1920, "formula": 1920},
        {"kind": "ring", "measured": 10, "formula": 12},
    ]
    fig = plot_comm_bytes(rows, hardware="2 CPU processes")
    ax = fig.axes[0]
    assert ax.get_yscale() == "log" and "bytes" in ax.get_ylabel()
    assert [b.get_height() for b in ax.patches] == [1920, 10, 1920, 12]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["TP all-reduce", "ring"]
    assert "2 CPU processes" in ax.get_title()
    plt.close(fig)
    long = [{"kind": k, "measured": 10, "formula": 10} for k in ("PP: rank 0 sends", "ring: 37 tokens, 1 layer")] * 3
    fig = plot_comm_bytes(long)
    fig.canvas.draw()
    boxes = [t.get_window_extent() for t in fig.axes[0].get_xticklabels()]
    assert not any(a.overlaps(b) for a, b in zip(boxes, boxes[1:])), "tick labels run into each other"
    plt.close(fig)
    with pytest.raises(ValueError, match="row 0 needs measured"):
        plot_comm_bytes([{"kind": "x", "measured": 0, "formula": 1}])
