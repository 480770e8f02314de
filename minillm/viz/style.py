"""One look for every figure in the book."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch


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


# Drawing helpers the schematic figures share


def box(ax, x: float, y: float, w: float, h: float, text: str, color: str, fontsize: float = 9, **kw):
    """A rounded box with its lower left corner at (x, y), ``text`` centred in it."""
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.08", fc=color, ec="0.3", **kw))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=fontsize)


def arrow(ax, start: tuple[float, float], end: tuple[float, float], color: str = "0.25", **kw):
    """An arrow from ``start`` to ``end`` (data coordinates)."""
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=12, color=color, lw=1.2, **kw))


def require_keys(rows: Sequence[Mapping], keys: Sequence[str], where: str) -> None:
    """ValueError naming the first row that lacks one of ``keys`` (or an empty ``rows``)."""
    if not rows:
        raise ValueError(f"{where}: rows is empty")
    for i, r in enumerate(rows):
        missing = [k for k in keys if k not in r]
        if missing:
            raise ValueError(f"{where}: row {i} lacks {', '.join(missing)}")
