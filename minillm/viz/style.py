"""One look for every figure in the book, and the rules that keep it legible on the page.

The page's text column is about 760 px wide at 1280 px, and a figure's PNG (110 dpi) is shown at
its natural size when it fits, shrunk when it does not. So a figure is at most ``MAX_WIDTH_IN``
wide after tight cropping, and no text is smaller than ``MIN_FONT_PT`` (about 10 px).
``check_figure`` lists what breaks these rules; a test runs it on every plotting function.
"""

from __future__ import annotations

import io
import struct
import textwrap
from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.container import BarContainer
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Rectangle
from matplotlib.text import Text
from matplotlib.ticker import LogFormatter

DPI = 110  # the PNG's pixels per inch: the page shows one pixel per pixel
MAX_WIDTH_IN = 6.9  # the text column at 1280 px, 760 px, in inches at DPI
MAX_WIDTH_PX = round(MAX_WIDTH_IN * DPI)  # 759
MAX_HEIGHT_IN = 9.0  # taller than a screen is a figure nobody sees whole
MIN_FONT_PT = 7.0  # 10.7 px at DPI
ZOOM_SHARE = 0.1  # a linear y axis that spans under 10% of its top value without 0 is zoomed
ZOOM_WORD = "zoomed"
WIDTH_IN = 6.6  # a figure's width: the column, less the tight crop's padding


def set_plot_style() -> None:
    """Figure size, grid and fonts for every chapter's figures (``minillm.book.setup`` calls it)."""
    plt.rcParams.update(
        {
            "figure.figsize": (6.4, 3.8),
            "figure.dpi": DPI,
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


def legend_under(fig, ax=None, ncol: int = 2, handles=None, labels=None, **kw):
    """The legend of ``ax`` (or the given handles) under the figure's axes, clear of the data;
    ``finish`` leaves room for it."""
    if handles is None:
        handles, labels = (ax or fig.axes[0]).get_legend_handles_labels()
    kw.setdefault("fontsize", 9)
    return fig.legend(handles, labels, loc="lower center", bbox_to_anchor=(0.5, 0.0), ncol=ncol, **kw)


def legend_right(ax, **kw):
    """The legend of ``ax`` to its right, clear of the data."""
    kw.setdefault("fontsize", 9)
    return ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), **kw)


def plain_log_ticks(axis) -> None:
    """Label a log axis in plain numbers ("200", "0.5"), not powers of ten ("2 x 10^2")."""
    axis.set_major_formatter(LogFormatter())
    axis.set_minor_formatter(LogFormatter(labelOnlyBase=False, minor_thresholds=(1, 0.4)))


def finish(fig, rect=None):
    """Titles and x labels wrapped to fit the figure's width, then ``tight_layout`` above the
    figure's legends (``legend_under``): the figure the book saves is the figure drawn."""
    for _ in range(2):  # the layout moves the axes, and with them the room their titles have
        tidy(fig)
        renderer = fig.canvas.get_renderer()
        bottom = max((leg.get_window_extent(renderer).height / fig.bbox.height for leg in fig.legends), default=0)
        left, low, right, top = rect or (0, 0, 1, 1)
        fig.tight_layout(rect=(left, max(low, bottom + 0.01 if bottom else 0), right, top))
    return fig


def tidy(fig) -> None:
    """What every figure gets, laid out here or by its caller: zoomed y axes say so, and long
    titles and x labels wrap to the figure's width."""
    label_zoomed_axes(fig)
    fit_texts(fig)


def _zoomed(ax) -> bool:
    """A linear y axis that leaves out zero and spans under ZOOM_SHARE of its largest value."""
    if not ax.axison or not ax.lines or ax.get_yscale() != "linear":
        return False
    low, high = sorted(ax.get_ylim())
    return (low > 0 and high - low < ZOOM_SHARE * high) or (high < 0 and high - low < ZOOM_SHARE * -low)


def label_zoomed_axes(fig) -> None:
    """Add '(zoomed)' to the y label of each zoomed line plot that does not say so already."""
    suptitle = fig._suptitle.get_text() if fig._suptitle else ""
    for ax in fig.axes:
        if _zoomed(ax) and ZOOM_WORD not in " ".join((ax.get_ylabel(), ax.get_title(), suptitle)):
            ax.set_ylabel(f"{ax.get_ylabel()} ({ZOOM_WORD})".strip())


def fit_texts(fig) -> None:
    """Wrap each title, the figure's title and each x label that would reach past the figure's
    edge (a long title otherwise widens the tightly cropped PNG beyond the column). Each text is
    wrapped from its own lines, so wrapping again after a new layout does not wrap twice."""
    renderer = fig.canvas.get_renderer()
    texts = [fig._suptitle] if fig._suptitle is not None else []
    for ax in fig.axes:
        texts += [ax.title, ax._left_title, ax._right_title, ax.xaxis.label]
    for t in texts:
        if t.get_visible() and t.get_text().strip():
            _wrap_to_figure(t, fig.bbox, renderer)


def _room(t, frame, renderer) -> float:
    """The width (px) ``t`` may take without leaving the figure, at its alignment."""
    ext = t.get_window_extent(renderer)
    if t.get_horizontalalignment() == "center":
        middle = (ext.x0 + ext.x1) / 2
        return 0.96 * 2 * min(middle - frame.x0, frame.x1 - middle)
    return 0.96 * (frame.x1 - ext.x0 if t.get_horizontalalignment() == "left" else ext.x1 - frame.x0)


def _wrap_to_figure(t, frame, renderer) -> None:
    ours = getattr(t, "_wrapped", None) == t.get_text()  # wrapped here before, not set anew since
    lines = (t._unwrapped if ours else t.get_text()).split("\n")
    t.set_text("\n".join(lines))
    chars = max(len(line) for line in lines)
    while t.get_window_extent(renderer).width > _room(t, frame, renderer) and chars > 12:
        chars = int(chars * 0.92)
        wrapped = [textwrap.fill(line, chars, break_long_words=False, break_on_hyphens=False) for line in lines]
        t.set_text("\n".join(wrapped))
        t._unwrapped, t._wrapped = "\n".join(lines), t.get_text()


def require_keys(rows: Sequence[Mapping], keys: Sequence[str], where: str) -> None:
    """ValueError naming the first row that lacks one of ``keys`` (or an empty ``rows``)."""
    if not rows:
        raise ValueError(f"{where}: rows is empty")
    for i, r in enumerate(rows):
        missing = [k for k in keys if k not in r]
        if missing:
            raise ValueError(f"{where}: row {i} lacks {', '.join(missing)}")


# ---------------------------------------------------------------------------------------------
# The rules, checked


def png_size(png: bytes) -> tuple[int, int]:
    """(width, height) in pixels from a PNG's header (its IHDR chunk)."""
    if png[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError("not a PNG")
    return struct.unpack(">II", png[16:24])


def saved_size(fig) -> tuple[int, int]:
    """The pixels of ``fig`` saved as the book saves it: DPI, tight bounding box."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, bbox_inches="tight")
    return png_size(buf.getvalue())


def _shown_texts(fig) -> list[Text]:
    """Every text the figure draws: its own, each axes' titles, labels, tick labels, texts and
    legends (axes that are switched off contribute their titles and texts only)."""
    found = list(fig.texts) + [t for leg in fig.legends for t in [*leg.get_texts(), leg.get_title()]]
    for ax in fig.axes:
        if not ax.get_visible():
            continue
        found += [ax.title, ax._left_title, ax._right_title, *ax.texts]
        if ax.get_legend() is not None:
            found += [*ax.get_legend().get_texts(), ax.get_legend().get_title()]
        if ax.axison:
            for axis in (ax.xaxis, ax.yaxis):
                if axis.get_visible():
                    found += [axis.label, axis.get_offset_text(), *axis.get_ticklabels(which="both")]
    return [t for t in found if t.get_visible() and t.get_text().strip()]


def small_texts(fig) -> list[str]:
    """The texts set smaller than MIN_FONT_PT, each as 'size pt: text'."""
    return [
        f"{t.get_fontsize():g} pt text {t.get_text()[:40]!r}"
        for t in _shown_texts(fig)
        if t.get_fontsize() < MIN_FONT_PT
    ]


def _data_points(ax) -> np.ndarray:
    """Display coordinates of the data an axes draws: line vertices (densified) and the corners
    and centres of its bars and histogram outlines."""
    points = []
    for line in ax.lines:
        xy = line.get_transform().transform(np.asarray(line.get_xydata(), dtype=float))
        xy = xy[np.isfinite(xy).all(axis=1)]
        if len(xy) > 1 and len(xy) < 500:  # points along each segment: a legend over a line is over data
            t = np.linspace(0, 1, 12)[:, None, None]
            xy = (xy[:-1] * (1 - t) + xy[1:] * t).reshape(-1, 2)
        points.append(xy)
    for patch in ax.patches:
        if isinstance(patch, Rectangle) and patch.get_width() and patch.get_height():
            x0, y0, x1, y1 = patch.get_window_extent().extents
            xs, ys = np.linspace(x0, x1, 5), np.linspace(y0, y1, 5)
            points.append(np.array([(x, y) for x in xs for y in ys]))
        elif type(patch).__name__ == "Polygon":  # a histogram's step outline
            points.append(patch.get_transform().transform(patch.get_path().vertices))
    return np.concatenate(points) if points else np.empty((0, 2))


def legends_over_data(fig) -> list[str]:
    """Legends whose box covers a point of the data (of their axes, or any axes for a figure legend)."""
    found = []
    pairs = [(ax.get_legend(), [ax]) for ax in fig.axes if ax.get_legend() is not None]
    pairs += [(leg, fig.axes) for leg in fig.legends]
    for legend, axes in pairs:
        frame = legend.get_window_extent()
        for ax in axes:
            inside = ax.get_window_extent()
            pts = _data_points(ax)
            pts = pts[
                (pts[:, 0] >= inside.x0)
                & (pts[:, 0] <= inside.x1)
                & (pts[:, 1] >= inside.y0)
                & (pts[:, 1] <= inside.y1)
            ]
            hit = (pts[:, 0] > frame.x0) & (pts[:, 0] < frame.x1) & (pts[:, 1] > frame.y0) & (pts[:, 1] < frame.y1)
            if hit.any():
                labels = ", ".join(t.get_text() for t in legend.get_texts())[:60]
                found.append(f"legend ({labels}) over the data of axes {ax.get_title()[:30]!r}")
    return found


def bars_from_zero(fig) -> list[str]:
    """Bar charts on a linear axis whose value axis does not reach zero."""
    found = []
    for ax in fig.axes:
        for c in ax.containers:
            if not isinstance(c, BarContainer) or not len(c.patches):
                continue
            horizontal = c.orientation == "horizontal"
            scale = ax.get_xscale() if horizontal else ax.get_yscale()
            low, high = ax.get_xlim() if horizontal else ax.get_ylim()
            if scale == "linear" and min(low, high) > 0:
                found.append(f"bars of axes {ax.get_title()[:30]!r} start at {min(low, high):g}, not 0")
    return found


def unmarked_zoom(fig) -> list[str]:
    """Zoomed line plots (``_zoomed``) with no 'zoomed' in the y label, the title or the figure's title."""
    suptitle = fig._suptitle.get_text() if fig._suptitle else ""
    found = []
    for ax in fig.axes:
        if _zoomed(ax) and ZOOM_WORD not in " ".join((ax.get_ylabel(), ax.get_title(), suptitle)):
            low, high = sorted(ax.get_ylim())
            found.append(f"y axis {low:g}-{high:g} of axes {ax.get_title()[:30]!r} is zoomed and does not say so")
    return found


def check_figure(fig) -> list[str]:
    """What in ``fig`` breaks the book's figure rules; empty when it keeps them all."""
    width, height = saved_size(fig)  # draws the figure, so every extent below is the saved one
    problems = []
    if width > MAX_WIDTH_PX:
        problems.append(f"{width} px wide ({width / DPI:.2f} in) saved, over {MAX_WIDTH_PX} px ({MAX_WIDTH_IN} in)")
    if fig.get_figwidth() > MAX_WIDTH_IN:
        problems.append(f"figsize {fig.get_figwidth():.2f} in wide, over {MAX_WIDTH_IN} in")
    if height > MAX_HEIGHT_IN * DPI:
        problems.append(f"{height} px tall ({height / DPI:.2f} in) saved, over {MAX_HEIGHT_IN} in")
    fig.canvas.draw()
    return problems + small_texts(fig) + legends_over_data(fig) + bars_from_zero(fig) + unmarked_zoom(fig)
