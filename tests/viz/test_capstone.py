"""Chapter 16's plots draw the saved capstone run: one bar per rung (a second panel for a GPU
run), labels with each rung's speedup, one bar pair per serving row; rows missing a figure fail
with the plot's name."""

import matplotlib
import pytest

from minillm.bench.capstone_tables import gpu_ladder_rows
from minillm.measure.report import load_results
from minillm.viz.capstone import plot_ladder, plot_serving

matplotlib.use("Agg")


@pytest.fixture(scope="module")
def saved():
    runs = load_results("bench_capstone")
    assert runs, "the package ships a saved bench_capstone run"
    return next(iter(runs.values()))


def test_the_ladder_has_a_bar_and_a_label_per_rung(saved):
    fig = plot_ladder(saved["ladder"], title="t")
    ax = fig.axes[0]
    assert len(ax.patches) == len(saved["ladder"])
    labels = [t.get_text() for t in ax.texts]
    assert any(f"{saved['ladder'][-1]['vs_baseline']:.1f}x" in label for label in labels)


def test_a_gpu_run_adds_a_panel(saved):
    check = {"sections": {"capstone": {"recompute (baseline)": {"decode_tokens_per_s": 5.0}}}}
    check["sections"]["decode"] = {"compiled": {"tokens_per_s": 50.0}}
    fig = plot_ladder(saved["ladder"], gpu_rows=gpu_ladder_rows(check))
    assert len(fig.axes) == 2 and len(fig.axes[1].patches) == 2


def test_serving_draws_two_bars_per_row_and_names_missing_figures(saved):
    fig = plot_serving(saved["serving"])
    assert all(len(ax.patches) == 2 * len(saved["serving"]) for ax in fig.axes)
    with pytest.raises(ValueError, match="plot_serving"):
        plot_serving([{"step": "x", "throughput": 1.0}])
