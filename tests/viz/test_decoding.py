"""Part III's pictures (viz.decoding) draw: the plots of chapters 7 and 8, Medusa's tree and masks."""

import matplotlib

matplotlib.use("Agg")

from minillm.decoding.medusa import MedusaTree  # noqa: E402
from minillm.viz.decoding import (  # noqa: E402
    draw_tree,
    plot_acceptance_vs_temperature,
    plot_lookup_by_task,
    plot_mask,
    plot_speculative_sweep,
    plot_speedup_map,
    tree_layout,
)


def test_part3_plots_draw():
    rows = [{"k": k, "alpha": 0.6, "tokens_per_target_forward": 2.0, "speedup": 1.1} for k in (1, 2, 3)]
    assert plot_speculative_sweep(rows, {"model": [1.2, 1.3, 1.4]}, title="t")
    assert plot_acceptance_vs_temperature({0.0: 0.5, 1.0: 0.6}, {0.0: 0.65}, title="t")
    assert plot_speedup_map(3, {"draft": (0.6, 0.2), "self": (0.99, 1.0)}, title="t")
    task_rows = [
        {"task": t, "copyable": c, "speedup": 1 + c, "tokens_per_target_forward": 1 + 2 * c}
        for t, c in [("free", 0.1), ("copy", 0.8)]
    ]
    assert plot_lookup_by_task(task_rows, title="t")


def test_tree_layout_and_drawings():
    tree = MedusaTree.product((3, 2, 1))
    xy = tree_layout(tree)
    assert [x for x, _ in xy] == tree.depths.tolist()
    for i in range(1, len(tree)):  # a parent sits within its children's span
        kids = [y for j, (_, y) in enumerate(xy) if tree.parents[j] == i]
        assert not kids or min(kids) <= xy[i][1] <= max(kids)
    ax = draw_tree(tree, accepted=[0, 1, 4])
    assert len(ax.texts) == len(tree)
    ax = plot_mask(tree.attention_mask())
    assert ax.images[0].get_array().shape == (len(tree), len(tree))


def test_round_split_draws_each_method_and_names_what_is_missing():
    import pytest

    from minillm.viz.decoding import plot_round_split

    rows = [
        {"method": m, "ms_per_round": 9.0, "forward_ms_per_round": 8.0, "other_ms_per_round": 1.0}
        | {"plain_step_ms": 5.0, "speedup": 1.1}
        for m in ("greedy", "speculative", "speculative compiled")
    ]
    fig = plot_round_split(rows, title="t")
    assert sorted(t.get_text() for t in fig.axes[0].get_yticklabels()) == ["speculative", "speculative compiled"]
    with pytest.raises(ValueError, match="other_ms_per_round"):
        plot_round_split([{"method": "x", "ms_per_round": 1, "forward_ms_per_round": 1}])
    with pytest.raises(ValueError, match="not greedy alone"):
        plot_round_split(rows[:1])
