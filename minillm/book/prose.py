"""Numbers in a chapter's prose that claim a measurement, and whether the page supports them.

A chapter's prose may state a measured figure (a time, a speed, a ratio such as ``1.3x``, a
percentage) only when the reader can see where it came from:

- an output of the same chapter prints it (the prose may round it: ``1.314`` supports ``1.31x``
  and ``1.3x``; a fraction ``0.263`` supports ``26%``), which covers saved results the page
  prints and labels;
- or it is a published figure: its paragraph cites a source with a ``{cite}`` role;
- or it is not a measurement at all (a definition, a configuration, arithmetic) and the markdown
  cell says so at its end: ``<!-- not measured: 2x, 200 ms -->``.

Numbers in inline code, code blocks and math are not prose and are not read.

    python -m minillm.book.prose chapters/*.ipynb    # lists what no output supports
"""

from __future__ import annotations

import html
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from .nbfiles import cell_source, read_notebook

NUM = r"[-+−]?\d[\d,]*(?:\.\d+)?"
UNIT = (
    r"(?:[x×](?![\w/])"  # a ratio: 1.3x (not 2x2, not x86)
    r"|\s?%|\s?percent\b"
    r"|\s?(?:ms|µs|μs|us|ns|s|sec|seconds?|milliseconds?|microseconds?|min|minutes?)(?![\w/])"
    r"|\s?(?:tok|tokens?|req|requests?|it|steps?)\s?(?:/\s?s\b|per\s+second\b)"
    r"|\s?(?:[KMGT]i?B|[KMGTP]?FLOPs?)/s\b|\s?[KMGTP]?FLOPS\b)"
)
# one figure, or a range or series sharing the unit: 1.26-1.53x, 34.2 / 22.7 / 17.4 ms
FIGURE = re.compile(rf"(?<![\w.])({NUM}(?:\s*(?:-|–|—|/|to)\s*{NUM})*)({UNIT})")
NUMBER = re.compile(NUM)
NOT_MEASURED = re.compile(r"<!--\s*not measured:(.*?)-->", re.S | re.I)
HIDDEN = [
    re.compile(r"```.*?```", re.S),  # code blocks
    re.compile(r"~~~.*?~~~", re.S),
    re.compile(r"<!--.*?-->", re.S),  # comments
    re.compile(r"\$\$.*?\$\$", re.S),  # math
    re.compile(r"(?<!\\)\$[^$\n]+\$"),
    re.compile(r"\\\(.*?\\\)", re.S),
    re.compile(r"``[^`]+``|`[^`\n]+`"),  # inline code and MyST roles' targets
    re.compile(r"\]\([^)\s]*\)"),  # link targets
]
TAG = re.compile(r"<[^>]+>")


@dataclass(frozen=True)
class Unsupported:
    cell: int  # index of the markdown cell in the notebook
    figure: str  # as the prose writes it
    context: str  # the words around it

    def __str__(self) -> str:
        return f"cell {self.cell}: {self.figure!r} in ... {self.context} ..."


def _value(text: str) -> float:
    return float(text.replace(",", "").replace("−", "-"))


def _decimals(text: str) -> int:
    return len(text.split(".")[1]) if "." in text else 0


def output_text(cell: dict) -> str:
    """Everything a code cell's outputs show as text (stream, plain, markdown, HTML)."""
    parts = []
    for out in cell.get("outputs", []):
        if "text" in out:
            parts.append("".join(out["text"]))
        data = out.get("data", {})
        for kind in ("text/plain", "text/markdown", "text/html"):
            if kind in data:
                text = "".join(data[kind])
                parts.append(html.unescape(TAG.sub(" ", text)) if kind == "text/html" else text)
    return "\n".join(parts)


def printed_numbers(nb: dict) -> list[float]:
    """Every number any output of the notebook prints, sign dropped."""
    text = "\n".join(output_text(c) for c in nb["cells"] if c["cell_type"] == "code")
    return sorted({abs(_value(m)) for m in NUMBER.findall(text)})


def supported(number: str, percent: bool, printed: list[float]) -> bool:
    """Whether an output prints ``number`` to the precision the prose gives it (a percentage
    also as a fraction)."""
    value, tol = abs(_value(number)), 0.5 * 10 ** -_decimals(number) + 1e-9
    candidates = printed if not percent else printed + [100 * p for p in printed if p <= 1]
    return any(abs(p - value) <= tol for p in candidates)


def prose(text: str) -> str:
    """Markdown with code, math, comments and link targets blanked out (same length)."""
    for pattern in HIDDEN:
        text = pattern.sub(lambda m: " " * len(m.group()), text)
    return text


def unsupported_figures(nb: dict) -> list[Unsupported]:
    """The measured figures in the notebook's markdown that nothing on the page supports."""
    printed = printed_numbers(nb)
    found = []
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "markdown":
            continue
        source = cell_source(cell)
        declared = {f.strip() for m in NOT_MEASURED.findall(source) for f in m.split(",")}
        for paragraph in re.split(r"\n\s*\n", source):
            if "{cite" in paragraph:
                continue
            visible = prose(paragraph)
            for match in FIGURE.finditer(visible):
                figure = match.group().strip()
                if figure in declared or figure.replace(" ", "") in {d.replace(" ", "") for d in declared}:
                    continue
                percent = "%" in match.group(2) or "percent" in match.group(2)
                numbers = NUMBER.findall(match.group(1))
                if all(supported(n, percent, printed) for n in numbers):
                    continue
                start, end = max(0, match.start() - 50), min(len(visible), match.end() + 30)
                context = " ".join(paragraph[start:end].split())
                found.append(Unsupported(i, figure, context))
    return found


def main(paths: list[str]) -> int:
    bad = 0
    for name in paths:
        for problem in unsupported_figures(read_notebook(Path(name))):
            print(f"{name}: {problem}")
            bad += 1
    print(f"{bad} figure(s) in prose that no output, citation or 'not measured' note supports")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
