"""Chapter 16's picture: the decision guide as one diagram, a symptom on the left, an arrow to
what to try on the right, with the chapters that teach it and, in small print beneath, the
measured figure behind it.

It draws what ``minillm.book.guide.decision_guide`` returns (any objects with the fields of a
``GuideEntry``: symptom, techniques, chapters, evidence, source); it imports nothing from bench.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence

import matplotlib.pyplot as plt

from .style import arrow, box, tidy

SYMPTOM_COLOR = "#fde2c8"  # light orange: what is wrong
MISSING_COLOR = "0.55"  # evidence not measured yet
EVIDENCE_COLOR = "0.25"
LEFT_WIDTH, GAP, WIDTH = 1.85, 0.4, 6.6  # in data units = inches: the column's width
SYMPTOM_CHARS, TECHNIQUE_CHARS, EVIDENCE_CHARS = 19, 50, 66  # wrap widths at 8.5 / 8 / 7 pt, inside 4.2 in


def _short_chapters(chapters: Sequence[int]) -> str:
    """(3, 12) -> 'ch. 3, 12', with no-break spaces: a line never ends inside it."""
    return "ch.\u00a0" + ",\u00a0".join(str(n) for n in chapters)


def _wrap(text: str, width: int) -> str:
    return textwrap.fill(text, width, break_on_hyphens=False)


def _hardware(entries) -> list[str]:
    return list(dict.fromkeys(e.source.split("/")[0] for e in entries if e.source))


def _title(entries) -> str:
    hardware = _hardware(entries)
    where = f"saved runs: {', '.join(hardware)}" if hardware else "no saved runs yet"
    return f"What to try, and the measured figure behind it ({where})"


def _draw_entry(ax, entry, y: float) -> None:
    """One row centred at height ``y``: the symptom's box, an arrow, the techniques and the evidence."""
    symptom = _wrap(entry.symptom, SYMPTOM_CHARS)
    box(ax, 0.05, y - 0.34, LEFT_WIDTH, 0.68, symptom, SYMPTOM_COLOR, fontsize=8.5)
    x = LEFT_WIDTH + GAP + 0.15
    arrow(ax, (LEFT_WIDTH + 0.1, y), (x - 0.05, y))
    techniques = _wrap(f"{entry.techniques}  ({_short_chapters(entry.chapters)})", TECHNIQUE_CHARS)
    ax.text(x, y + 0.03, techniques, ha="left", va="bottom", fontsize=8, fontweight="bold")
    measured = _wrap(entry.evidence, EVIDENCE_CHARS) + (f"\nsaved in {entry.source}" if entry.source else "")
    color, style = (EVIDENCE_COLOR, "normal") if entry.source else (MISSING_COLOR, "italic")
    ax.text(
        x,
        y - 0.03,
        measured,
        ha="left",
        va="top",
        fontsize=7,
        color=color,
        style=style,
    )


def plot_decision_guide(entries: Sequence, ax=None):
    """The guide as a diagram, one row per entry, symptoms on the left; returns the figure."""
    if not entries:
        raise ValueError("plot_decision_guide: entries is empty")
    n = len(entries)
    if ax is None:
        _, ax = plt.subplots(figsize=(WIDTH, 0.9 * n + 1))
    for i, entry in enumerate(entries):
        _draw_entry(ax, entry, n - i - 0.5)
    ax.text(0.05 + LEFT_WIDTH / 2, n + 0.2, "symptom (measured)", ha="center", va="bottom", fontsize=9, color="0.3")
    ax.text(
        LEFT_WIDTH + GAP + 0.15,
        n + 0.2,
        "what to try (chapters); the saved figure behind it",
        ha="left",
        va="bottom",
        fontsize=9,
        color="0.3",
    )
    ax.set(xlim=(0, WIDTH), ylim=(-0.05, n + 0.55))
    ax.set_title(_title(entries), fontsize=10)
    ax.axis("off")
    tidy(ax.figure)
    return ax.figure
