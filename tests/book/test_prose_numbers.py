"""A measured figure in a chapter's prose is one the page supports: printed by an output of the
chapter, cited from a publication, or declared not a measurement (``minillm.book.prose``)."""

import copy
from pathlib import Path

import pytest

from minillm.book import nbfiles
from minillm.book.prose import FIGURE, prose, unsupported_figures

ROOT = Path(__file__).resolve().parents[2]
CHAPTERS = sorted((ROOT / "chapters").glob("*.ipynb"))


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_every_measured_figure_in_the_prose_is_on_the_page(path):
    problems = unsupported_figures(nbfiles.read_notebook(path))
    assert not problems, f"{path.name}:\n" + "\n".join(map(str, problems))


def page(markdown: str, printed: str = "eager 9.87 ms, compiled 7.61 ms: 1.297x") -> dict:
    return {
        "cells": [
            {"cell_type": "code", "source": "run()", "outputs": [{"output_type": "stream", "text": printed}]},
            {"cell_type": "markdown", "source": markdown},
        ]
    }


def figures(markdown: str) -> list[str]:
    return [p.figure for p in unsupported_figures(page(markdown))]


def test_a_planted_figure_is_caught():
    assert figures("Compiling made the step 2.7x faster, 3.1 ms a step.") == ["2.7x", "3.1 ms"]
    chapter = nbfiles.read_notebook(ROOT / "chapters" / "11_compilers.ipynb")
    planted = copy.deepcopy(chapter)
    planted["cells"].append({"cell_type": "markdown", "metadata": {}, "source": "It ran at 987.65 tokens/s."})
    before = {p.figure for p in unsupported_figures(chapter)}
    assert {p.figure for p in unsupported_figures(planted)} - before == {"987.65 tokens/s"}


def test_a_printed_figure_may_be_rounded_and_a_percentage_may_be_printed_as_a_fraction():
    assert figures("Eager took 9.9 ms, compiled 7.6 ms: 1.3x, or 1.30x.") == []
    assert figures("Compiled took 7.7 ms.") == ["7.7 ms"]  # 7.61 rounds to 7.6
    assert unsupported_figures(page("About 26% of proposals were kept.", printed="kept 0.263")) == []


def test_each_end_of_a_range_needs_support():
    assert figures("Between 7.61 and 9.87 ms; 7.6-9.9 ms; 7.6 / 9.9 ms.") == []
    assert figures("It ranged over 7.6-12.5 ms.") == ["7.6-12.5 ms"]


def test_cited_figures_and_declared_non_measurements_are_allowed():
    assert figures("An H100 reads 3.35 TB/s {cite}`nvidia2023h100`.") == []
    assert figures("A bf16 cache is 2x an int8 one.\n\n<!-- not measured: 2x -->") == []
    assert figures("A bf16 cache is 2x an int8 one.\n\n<!-- not measured: 4x -->") == ["2x"]


def test_code_math_and_links_are_not_prose():
    assert figures("Run `bench --rate 3.5x` with $t = 40 ms$ [here](a/3.3s.html).\n```\n9 ms\n```") == []
    assert prose("`1 ms` x") == "       x"


def test_what_counts_as_a_measured_figure():
    found = [m.group().strip() for m in FIGURE.finditer("2x2 grids, x86, 1.5x, 40 %, 3 req/s, 12 GB/s, 7 s, 5 min")]
    assert found == ["1.5x", "40 %", "3 req/s", "12 GB/s", "7 s", "5 min"]
