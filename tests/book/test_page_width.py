"""Every committed notebook fits the book's page: no code line and no printed line is longer than
the code column holds (PAGE_WIDTH, 88 characters at 1280 px with book/_static/page.css), so no
code block scrolls sideways and no table loses a column off the right edge."""

import re
from pathlib import Path

import pytest

from minillm.book import nbfiles
from minillm.measure.report import PAGE_WIDTH

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted(p for d in ("chapters", "solutions", "exercises") for p in (ROOT / d).glob("*.ipynb"))


def shown_text(output: dict) -> str:
    """The text the book shows for one output: a stream, an error, or a plain-text result that
    has no richer form (a figure, HTML or a widget is shown instead of its text/plain)."""
    if output["output_type"] == "stream":
        return "".join(output["text"])
    if output["output_type"] == "error":
        return "\n".join(output["traceback"])
    data = output.get("data", {})
    if "text/markdown" in data:  # its code blocks (book.source.show); its tables wrap to the column
        return "\n".join(re.findall(r"^```[a-z]*\n(.*?)^```", "".join(data["text/markdown"]), re.M | re.S))
    return "".join(data["text/plain"]) if list(data) == ["text/plain"] else ""


def long_lines(nb: dict) -> list[str]:
    found = []
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "code":
            continue
        texts = [("code", nbfiles.cell_source(cell))] + [("output", shown_text(o)) for o in cell.get("outputs", [])]
        for kind, text in texts:
            found += [
                f"cell {i} {kind}, {len(line)} chars: {line}" for line in text.splitlines() if len(line) > PAGE_WIDTH
            ]
    return found


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_no_line_is_wider_than_the_page(path):
    found = long_lines(nbfiles.read_notebook(path))
    assert not found, f"{path.name}: {len(found)} lines over {PAGE_WIDTH} characters:\n" + "\n".join(found[:10])


def test_the_check_sees_a_long_output_line():
    nb = {
        "cells": [{"cell_type": "code", "source": "print(1)", "outputs": [{"output_type": "stream", "text": "x" * 89}]}]
    }
    assert long_lines(nb) == [f"cell 0 output, 89 chars: {'x' * 89}"]
    nb["cells"][0]["outputs"] = [{"output_type": "display_data", "data": {"text/plain": "y" * 99, "image/png": ""}}]
    assert long_lines(nb) == []
