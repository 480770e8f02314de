"""The notebook cells whose outputs nbval compares print the same on every CPU: verdicts against a
tolerance, counts, and arithmetic on formulas, never the digits of a rounding error or of a value
that went through a floating-point kernel (those differ between an AVX2 and an AVX-512 machine).
A checked cell is tagged ``nbval-check-output``, never marked by a comment the reader would see."""

import re
from pathlib import Path

import pytest

from minillm.book import nbfiles

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "chapters").glob("*.ipynb")) + sorted((ROOT / "solutions").glob("*.ipynb"))
TAG = "nbval-check-output"

# A small number in e-notation that is not a bound ("< 1e-4", "within 1e-4"), or a decimal below
# 0.01 printed to three or more significant digits (0.00554): the digits of a measured error,
# which the CPU's kernels decide.
MACHINE_DIGITS = [
    re.compile(r"\b\d(?:\.\d+)?e-\d+\b"),
    re.compile(r"\b0\.00+[1-9]\d\d+"),
]
BOUND = re.compile(r"(?:<|≤|<=|within)\s*\d(?:\.\d+)?e-\d+")


def machine_digits(text: str) -> list[str]:
    """The machine-dependent numbers in a checked cell's output (bounds like '< 1e-5' are spared)."""
    text = BOUND.sub("", text)
    return [m.group(0).strip() for pattern in MACHINE_DIGITS for m in pattern.finditer(text)]


def checked_outputs(path: Path) -> list[tuple[int, str]]:
    nb = nbfiles.read_notebook(path)
    found = []
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] == "code" and TAG in cell.get("metadata", {}).get("tags", []):
            text = "".join(o.get("text", "") or o.get("data", {}).get("text/plain", "") for o in cell["outputs"])
            found.append((i, text))
    return found


def test_the_scan_finds_machine_digits_and_spares_bounds_and_formulas():
    assert machine_digits("max |logit diff| 6e-06, equal: True") == ["6e-06"]
    assert machine_digits("sum vs y: max difference 2.7e-15") == ["2.7e-15"]
    assert machine_digits("rest of its group  0.00554") == ["0.00554"]
    assert machine_digits("mean error 0.000312, gradient 0.0061") == ["0.000312"]
    assert machine_digits("equal to the reference (max error < 1e-5): True") == []
    assert machine_digits("logits within 1e-4: yes (error < 0.0001); 1.0e+09 tokens; 53.7 GB; 85.42%") == []


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_checked_cells_print_no_machine_dependent_digits(path):
    for index, text in checked_outputs(path):
        assert machine_digits(text) == [], f"{path.name} cell {index}: print a verdict, not {machine_digits(text)}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_checked_cells_are_tagged_not_commented(path):
    nb = nbfiles.read_notebook(path)
    marked = [i for i, c in enumerate(nb["cells"]) if "NBVAL_CHECK_OUTPUT" in nbfiles.cell_source(c)]
    assert marked == [], f"{path.name}: cells {marked} carry a '# NBVAL_CHECK_OUTPUT' comment; tag them {TAG!r}"
