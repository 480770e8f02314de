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


def _stages(entries) -> list[str]:
    return list(dict.fromkeys(getattr(e, "stage", None) for e in entries if getattr(e, "stage", None)))


def _title(entries) -> str:
    hardware = _hardware(entries)
    where = f"saved runs: {', '.join(hardware)}" if hardware else "no saved runs yet"
    stages = _stages(entries)
    what = f"{stages[0]}: what to try" if len(stages) == 1 else "What to try"
    return f"{what}, and the measured figure behind it ({where})"


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


STAGE_HEIGHT = 0.5  # a stage's heading, between its first entry and the one above


def _layout(entries) -> tuple[list[float], list[tuple[str, float]], float]:
    """Each entry's centre height, each stage heading's height, and the total height: entries one
    unit apart, top down, a heading above the first entry of each stage (``GuideEntry.stage``)."""
    centres, headings, y, stage = [], [], 0.0, None
    several = len(_stages(entries)) > 1  # one stage: its name is the title's, no heading
    for entry in entries:
        here = getattr(entry, "stage", None)
        if several and here and here != stage:
            headings.append((here, y + STAGE_HEIGHT / 2))
            y += STAGE_HEIGHT
        stage = here
        centres.append(y + 0.5)
        y += 1.0
    return centres, headings, y


def plot_decision_guide(entries: Sequence, ax=None):
    """The guide as a diagram, one row per entry, symptoms on the left, under a heading for each
    stage of the guide's order (the entries of one stage: the stage in the title instead, a
    figure short enough to see whole; chapter 16 draws one per stage); returns the figure."""
    if not entries:
        raise ValueError("plot_decision_guide: entries is empty")
    centres, headings, total = _layout(entries)
    n = total  # in entry heights: the y axis runs from 0 (bottom) to n (top)
    if ax is None:
        _, ax = plt.subplots(figsize=(WIDTH, 1.15 * n + 1))
    for entry, centre in zip(entries, centres):
        _draw_entry(ax, entry, n - centre)
    for stage, y in headings:
        ax.text(0.05, n - y + 0.02, stage, ha="left", va="bottom", fontsize=9, fontweight="bold", color="0.2")
        ax.plot([0.05, WIDTH - 0.05], [n - y - 0.02] * 2, color="0.75", lw=0.8)
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
