"""Chapter 14's pictures (viz.disagg) draw what they are given: every worker of the drawing, the
p99 gap where it is, a line per long prompt, the best ratio in green, each model's prefill line."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from matplotlib.colors import to_rgba  # noqa: E402
from matplotlib.patches import FancyArrowPatch  # noqa: E402

from minillm.viz.disagg import (  # noqa: E402
    BEST_COLOR,
    SIMULATED_NOTE,
    STEP_COLORS,
    draw_colocated,
    draw_disaggregation,
    plot_goodput_vs_rate,
    plot_itl_series,
    plot_kv_transfer,
    plot_pd_ratio,
    plot_step_timeline,
)


def texts(fig) -> list[str]:
    return [t.get_text() for ax in fig.axes for t in ax.texts]


def overlapping(fig) -> list[tuple[str, str]]:
    """Pairs of texts whose drawn extents cross (the drawing's labels must not)."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    boxes = [(t.get_text(), t.get_window_extent(renderer)) for ax in fig.axes for t in ax.texts]
    return [(a, b) for i, (a, ea) in enumerate(boxes) for b, eb in boxes[i + 1 :] if ea.overlaps(eb)]


@pytest.mark.parametrize("p,d", [(1, 1), (1, 2), (2, 1), (2, 2)])
def test_drawing_has_every_worker_and_every_transfer(p, d):
    fig = draw_disaggregation(p, d, title="2 CPU processes")
    words = texts(fig)
    assert [w for w in words if w.startswith("prefill worker")] == [f"prefill worker {i}" for i in range(p)]
    assert [w for w in words if w.startswith("decode worker")] == [f"decode worker {j}" for j in range(d)]
    assert words.count("paged KV pool") == p + d and words.count("model copy") == p + d
    assert any("KV blocks (all layers)" in w and "send/recv" in w for w in words)
    arrows = [a for a in fig.axes[0].patches if isinstance(a, FancyArrowPatch)]
    # clients -> router, router -> each prefill worker, each prefill -> each decode, back to the clients
    assert len(arrows) == 1 + p + p * d + 1
    assert fig.axes[0].get_title() == "2 CPU processes"
    assert overlapping(fig) == []
    plt.close(fig)


def test_colocated_drawing_and_bad_counts():
    fig = draw_colocated(2, title="t")
    assert texts(fig).count("paged KV pool") == 2 and overlapping(fig) == []
    plt.close(fig)
    with pytest.raises(ValueError, match="decode_workers"):
        draw_disaggregation(1, 0)
    with pytest.raises(ValueError, match="workers"):
        draw_colocated(9)


def test_itl_series_marks_p99_and_arrivals():
    gaps = [20.0] * 98 + [300.0, 310.0]
    runs = {
        "colocated": [(0.1 * i, g) for i, g in enumerate(gaps)],
        "disagg 1:1": [(0.1 * i, 20.0 + i % 3) for i in range(100)],
    }
    fig = plot_itl_series(runs, arrivals=[2.0, 6.0], title="minillm-target, CPU")
    left, right = fig.axes
    p99 = float(np.percentile(gaps, 99))
    horizontal = [ln for ln in left.lines if len(set(ln.get_ydata())) == 1 and len(set(ln.get_xdata())) > 1]
    assert [ln.get_ydata()[0] for ln in horizontal] == [pytest.approx(p99)]
    assert f"{p99:.1f} ms" in left.get_title() and left.get_title().startswith("colocated")
    for ax in (left, right):
        vertical = [ln for ln in ax.lines if len(set(ln.get_xdata())) == 1 and ln.get_linestyle() == "--"]
        assert sorted(ln.get_xdata()[0] for ln in vertical) == [2.0, 6.0]
        assert "(ms)" in ax.get_ylabel()
    assert "(s)" in right.get_xlabel()  # the panels stand one above the other and share the time axis
    assert left.get_shared_y_axes().joined(left, right) and left.get_shared_x_axes().joined(left, right)
    assert "long prompt arrives" in [t.get_text() for t in fig.legends[0].get_texts()]
    assert fig.get_suptitle() == "minillm-target, CPU"
    plt.close(fig)
    with pytest.raises(ValueError, match="runs is empty"):
        plot_itl_series({})
    with pytest.raises(ValueError, match="'chunked' has no token gaps"):
        plot_itl_series({"chunked": []})


def goodput_rows():
    return [
        {"mode": mode, "rate": rate, "goodput_rps": rate * share, "slo_met_pct": 100 * share}
        for mode, shares in (("colocated", (1.0, 0.5, 0.1)), ("disagg 1:1", (1.0, 0.9, 0.6)))
        for rate, share in zip((1.0, 4.0, 8.0), shares)
    ]


def test_goodput_vs_rate_lines_per_mode_and_the_diagonal():
    fig = plot_goodput_vs_rate(goodput_rows(), title="H200", measured=False)
    good, met = fig.axes
    labels = [ln.get_label() for ln in good.lines]
    assert labels == ["colocated", "disagg 1:1", "all requests within SLO"]
    diagonal = good.lines[-1]
    assert list(diagonal.get_xdata()) == list(diagonal.get_ydata()) == [0, 8.0]
    assert list(met.lines[1].get_ydata()) == [100.0, 90.0, 60.0]
    assert good.lines[0].get_color() != good.lines[1].get_color()
    assert fig.get_suptitle() == f"H200, {SIMULATED_NOTE}"
    assert "requests/s" in met.get_xlabel() and "%" in met.get_ylabel()  # one above the other, x shared
    assert plot_goodput_vs_rate(goodput_rows(), title="H200").get_suptitle() == "H200"
    plt.close("all")
    with pytest.raises(ValueError, match="rows is empty"):
        plot_goodput_vs_rate([])
    with pytest.raises(ValueError, match="row 0 lacks slo_met_pct"):
        plot_goodput_vs_rate([{"mode": "x", "rate": 1.0, "goodput_rps": 1.0}])


def test_pd_ratio_highlights_the_best():
    rows = [
        {"ratio": "1:1", "workers": 2, "max_rate_rps": 6.0, "max_rate_per_gpu": 3.0},
        {"ratio": "1:2", "gpus": 3, "max_rate_rps": 10.5, "max_rate_per_gpu": 3.5},
        {"ratio": "1:3", "workers": 4, "max_rate_rps": 12.0, "max_rate_per_gpu": 3.0},
    ]
    fig = plot_pd_ratio(rows, title="t")
    ax = fig.axes[0]
    colors = [bar.get_facecolor() for bar in ax.patches]
    assert colors[1] == to_rgba(BEST_COLOR) and colors[0] == colors[2] != colors[1]
    assert [bar.get_height() for bar in ax.patches] == [3.0, 3.5, 3.0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["1:1", "1:2", "1:3"]
    assert "best" in texts(fig)[1] and "on 3 workers" in texts(fig)[1] and "best" not in texts(fig)[0]
    plt.close(fig)
    with pytest.raises(ValueError, match="row 0 lacks workers"):
        plot_pd_ratio([{"ratio": "1:1", "max_rate_rps": 1.0, "max_rate_per_gpu": 0.5}])


def test_kv_transfer_bars_and_prefill_lines():
    rows = [
        {"model": m, "link": link, "transfer_ms": t, "prefill_ms": p}
        for m, p, ts in (("minillm-target", 15.0, (0.05, 25.0)), ("Llama-3-8B", 120.0, (0.6, 268.0)))
        for link, t in zip(("NVLink", "gloo TCP"), ts)
    ]
    fig = plot_kv_transfer(rows, title="t")
    ax = fig.axes[0]
    assert ax.get_xscale() == "log" and "(ms" in ax.get_xlabel()
    assert sorted(bar.get_width() for bar in ax.patches) == [0.05, 0.6, 25.0, 268.0]
    xs = sorted(seg[0][0] for c in ax.collections for seg in c.get_segments())
    assert xs == [15.0, 120.0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["minillm-target", "Llama-3-8B"]
    plt.close(fig)
    with pytest.raises(ValueError, match="rows is empty"):
        plot_kv_transfer([])
    with pytest.raises(ValueError, match="row 0 needs transfer_ms"):
        plot_kv_transfer([{"model": "m", "link": "l", "transfer_ms": 0.0, "prefill_ms": 1.0}])


def timelines():
    def step(worker, start, end, prefill, decode):
        return {"worker": worker, "start": start, "end": end, "prefill_tokens": prefill, "decode_rows": decode}

    colocated = [step(0, 1.00, 1.01, 0, 4), step(0, 1.01, 1.06, 900, 4), step(0, 1.06, 1.07, 0, 5)]
    disagg = [step(0, 0.99, 1.05, 900, 0), step(1, 1.00, 1.01, 0, 4), step(1, 1.01, 1.02, 0, 4)]
    return {
        "colocated": {
            "lanes": ["replica 0"],
            "steps": colocated,
            "tokens": {3: [1.01, 1.06, 1.07]},
            "longest_gap_ms": 50.0,
        },
        "disagg 1:1": {
            "lanes": ["prefill worker", "decode worker"],
            "steps": disagg,
            "handoffs": [{"worker": 1, "ready": 1.055}],
            "tokens": {3: [1.01, 1.02]},
            "longest_gap_ms": 10.0,
        },
    }


def test_step_timeline_draws_each_step_in_its_lane_and_color():
    window = (1.0, 1.08)
    fig = plot_step_timeline(timelines(), window, tracked=3, title="Llama-3-8B, H100 roofline")
    colocated, disagg, tokens = fig.axes
    bars = colocated.patches
    assert [b.get_width() for b in bars] == pytest.approx([10.0, 50.0, 10.0])  # ms from the window's start
    assert [b.get_x() for b in bars] == pytest.approx([0.0, 10.0, 60.0])
    kinds = [STEP_COLORS["decode"], STEP_COLORS["mixed"], STEP_COLORS["decode"]]
    assert [b.get_facecolor() for b in bars] == [to_rgba(c) for c in kinds]
    assert "900" in [t.get_text() for t in colocated.texts]  # a wide bar says its prompt tokens
    first = disagg.patches[0]  # starts before the window: clipped to it
    assert first.get_x() == 0 and first.get_width() == pytest.approx(50.0)
    assert first.get_facecolor() == to_rgba(STEP_COLORS["prefill"])
    lanes = dict(zip(disagg.get_yticks(), [t.get_text() for t in disagg.get_yticklabels()]))
    assert lanes == {1.0: "prefill worker", 0.0: "decode worker"}  # worker 0 on top
    decode_lane = [b.get_y() + b.get_height() / 2 for b in disagg.patches[1:]]
    assert decode_lane == [0.0, 0.0] and first.get_y() + first.get_height() / 2 == 1.0
    (marker,) = disagg.lines
    assert marker.get_xdata()[0] == pytest.approx(55.0) and marker.get_marker() == "v"
    assert colocated.get_title(loc="left") == "colocated: longest decode gap 50.0 ms"
    assert [len(line.get_xdata()) for line in tokens.lines] == [3, 2] and "request 3" in tokens.get_title(loc="left")
    assert tokens.get_xlim() == pytest.approx((0.0, 80.0)) and "(ms)" in tokens.get_xlabel()
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend[:2] == ["prefill only", "decode only"] and "K/V handoff ready to decode" in legend
    assert fig.get_suptitle() == f"Llama-3-8B, H100 roofline, {SIMULATED_NOTE}"
    plt.close(fig)
    assert len(plot_step_timeline(timelines(), window).axes) == 2  # no tracked request: no token panel
    plt.close("all")


def test_step_timeline_bad_input_is_named():
    with pytest.raises(ValueError, match="timelines is empty"):
        plot_step_timeline({}, (0, 1))
    with pytest.raises(ValueError, match="window"):
        plot_step_timeline(timelines(), (1.0, 1.0))
    bad = timelines()
    bad["colocated"]["steps"][0]["worker"] = 1
    with pytest.raises(ValueError, match="'colocated' has a step on worker 1"):
        plot_step_timeline(bad, (1.0, 1.08))
    bad = timelines()
    del bad["disagg 1:1"]["steps"][1]["end"]
    with pytest.raises(ValueError, match="row 1 lacks end"):
        plot_step_timeline(bad, (1.0, 1.08))
    with pytest.raises(ValueError, match="no tokens of request 7"):
        plot_step_timeline(timelines(), (1.0, 1.08), tracked=7)
