"""The table under chapter 1's sampling figure: its numbers are the ones the panels draw."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from minillm.viz.sampling import sampling_grid, sampling_rows  # noqa: E402

LOGITS = torch.tensor([3.0, 2.0, 1.5, 1.0, 0.5, 0.0])
LABELS = [f"t{i}" for i in range(6)]
SETTINGS = [
    {"temperature": 0},
    {"temperature": 1.0},
    {"temperature": 0.5},
    {"temperature": 1.0, "top_k": 2},
    {"temperature": 1.0, "top_p": 0.5},
]


def test_rows_match_the_panels():
    rows = sampling_rows(LOGITS, LABELS, SETTINGS)
    fig = sampling_grid(LOGITS, LABELS, SETTINGS, title="t")
    for row, ax in zip(rows, fig.axes):
        _, filled = ax.containers
        assert row["p(t0)"] == pytest.approx(filled[0].get_width(), abs=1e-6)
        assert row["p(t1)"] == pytest.approx(filled[1].get_width(), abs=1e-6)
        assert (
            ax.get_title()
            == f"{row['setting']}: {row['tokens kept']} token" + ("" if row["tokens kept"] == 1 else "s") + " kept"
        )
        assert isinstance(row["tokens kept"], int)
    plt.close(fig)
    assert [r["tokens kept"] for r in rows] == [1, 6, 6, 2, 1]
    assert rows[0]["p(t0)"] == 1.0 and rows[2]["p(t0)"] > rows[1]["p(t0)"]
