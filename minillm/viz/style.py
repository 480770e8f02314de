"""One look for every figure in the book."""

from __future__ import annotations

import matplotlib.pyplot as plt


def set_plot_style() -> None:
    """Figure size, grid and fonts for every chapter's figures (``minillm.book.setup`` calls it)."""
    plt.rcParams.update(
        {
            "figure.figsize": (7.0, 4.0),
            "figure.dpi": 110,
            "axes.grid": True,
            "grid.alpha": 0.3,
            "axes.spines.top": False,
            "axes.spines.right": False,
            "axes.titlesize": 11,
            "font.size": 10,
            "legend.frameon": False,
            "savefig.bbox": "tight",
        }
    )
