"""Chapter 12's pruning plot: one line per method, each mark where its sparsity is, and marks at
the same sparsity side by side so that none hides another."""

import matplotlib
import pytest

from minillm.viz.compression import MARK_SPREAD, plot_pruning

matplotlib.use("Agg")


def test_marks_at_one_sparsity_stand_apart_and_keep_their_values():
    curves = {"magnitude": [(0.3, 48.6), (0.5, 51.8)], "Wanda": [(0.3, 49.0), (0.5, 52.0)]}
    marks = {"magnitude 2:4": (0.5, 56.04), "Wanda 2:4": (0.5, 56.27), "SparseGPT 2:4": (0.5, 54.35)}
    ax = plot_pruning(curves, 48.4, title="t", marks=marks).axes[0]
    drawn = {line.get_label(): line for line in ax.get_lines()}
    xs = [float(drawn[name].get_xdata()[0]) for name in marks]
    assert xs == pytest.approx([0.5 - MARK_SPREAD, 0.5, 0.5 + MARK_SPREAD])
    assert [float(drawn[name].get_ydata()[0]) for name in marks] == [56.04, 56.27, 54.35]
    assert list(drawn["magnitude"].get_xdata()) == [0.3, 0.5]  # the curves are not moved
    alone = plot_pruning(curves, 48.4, marks={"2:4": (0.5, 56.0)}).axes[0]
    assert [float(v) for v in next(x for x in alone.get_lines() if x.get_label() == "2:4").get_xdata()] == [0.5]
