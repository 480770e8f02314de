"""Chapter 3's picture: the roofline of a device, with operations placed by their intensity."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

from ..measure.roofline import Roofline
from .style import WIDTH_IN, finish, legend_under, tidy


def plot_roofline(
    roof: Roofline,
    points: list[tuple[str, float, float | None]],
    title: str,
    ax=None,
    intensity_range: tuple[float, float] = (0.1, 1e4),
):
    """A log-log roofline: the roof, its ridge, and ``points`` as (label, intensity, achieved FLOP/s);
    a point with achieved None is drawn on the roof (its ceiling)."""
    own = ax is None
    if own:
        _, ax = plt.subplots(figsize=(WIDTH_IN, 4.2))
    x = np.logspace(np.log10(intensity_range[0]), np.log10(intensity_range[1]), 200)
    ax.plot(x, np.minimum(roof.peak_flops, roof.peak_bandwidth * x), "k-", lw=2, label="roof: min(P, W x I)")
    ax.axvline(roof.ridge, color="gray", ls=":", label=f"ridge: {roof.ridge:.3g} FLOP/byte")
    for label, intensity, achieved in points:
        y = roof.attainable(intensity) if achieved is None else achieved
        ax.plot(intensity, y, "o", ms=7, label=label)
    ax.set(xscale="log", yscale="log", xlabel="arithmetic intensity (FLOP/byte)", ylabel="FLOP/s", title=title)
    if own:  # under the axes, clear of the roof and the points, at the book's legend size
        legend_under(ax.figure, ax, ncol=3 if len(points) + 2 > 4 else 2)
        finish(ax.figure)
    else:  # the caller's axes: the corner matplotlib finds emptiest
        ax.legend(fontsize=8, loc="best")
        tidy(ax.figure)
    return ax
