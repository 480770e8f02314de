"""Self-checking exercises: solutions/ is the single source, exercises/ is generated from it.

In a solution notebook, the code a reader should write sits between ``### BEGIN SOLUTION`` and
``### END SOLUTION``. ``make exercises`` (``python -m minillm.book.exercises``) writes the same
notebooks to exercises/ with each region replaced by ``raise NotImplementedError`` and every
output cleared. After each exercise a check cell calls a checker from ``minillm.book.checks``: it
prints a pass line, or raises ``CheckFailed`` with a hint.
"""

from __future__ import annotations

import contextlib
import copy
import io
import os
import re
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

from ..measure.report import PAGE_WIDTH
from .links import sync_repository_links
from .nbfiles import cell_source, dump_notebook, execute_notebook, python_source, read_notebook

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
REGION = re.compile(rf"^([ \t]*){re.escape(BEGIN)}([^\n]*)\n(.*?)^[ \t]*{re.escape(END)}[^\n]*$", re.M | re.S)
HINT_MORE = re.compile(r"^[ \t]*###(?! END SOLUTION)(.*)$")  # a hint's continuation line
DEF = re.compile(r"^[ \t]*def (\w+)\(", re.M)


# ---------------------------------------------------------------------------------------------
# solutions/ -> exercises/


def count_regions(source: str) -> int:
    return len(REGION.findall(source))


def region_hint(begin_rest: str, body: str, before: str) -> str:
    """What the stub tells the reader to do: the hint written after ``### BEGIN SOLUTION`` (as
    ``### BEGIN SOLUTION: hint``, continued on the ``### ...`` lines right below it), else the
    function the region is the body of."""
    parts = [begin_rest.strip().lstrip(":").strip()]
    for line in body.splitlines():
        more = HINT_MORE.match(line)
        if not parts[0] or not more:
            break
        parts.append(more.group(1).strip())
    hint = " ".join(p for p in parts if p)
    if hint:
        return hint
    functions = DEF.findall(before)
    return f"write the body of {functions[-1]}()" if functions else "write the code this exercise asks for"


def _quoted(text: str) -> str:
    """A double-quoted Python string literal, as ruff formats them."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def stub_line(hint: str, indent: str = "", width: int = PAGE_WIDTH) -> str:
    """``raise NotImplementedError(hint)``, wrapped over several string literals when one line at
    ``indent`` would run past ``width`` (the book's code column)."""
    one = f"raise NotImplementedError({_quoted(hint)})"
    if len(indent) + len(one) <= width:
        return one
    pieces = textwrap.wrap(hint, width - len(indent) - 7, drop_whitespace=False)
    inner = "".join(f"{indent}    {_quoted(piece)}\n" for piece in pieces)
    return f"raise NotImplementedError(\n{inner}{indent})"


def stub_source(source: str, only: int | None = None) -> str:
    """Replace solution regions by a stub that raises NotImplementedError with a one-line message
    saying what to implement, keeping their indentation.

    ``only`` stubs just the region with that index (counted across the string), for tests that
    show each exercise's check fails without its solution."""
    counter = iter(range(10**9))

    def replace(match: re.Match) -> str:
        i = next(counter)
        if only is not None and i != only:
            return match.group(0)
        indent, rest, body = match.group(1), match.group(2), match.group(3)
        return indent + stub_line(region_hint(rest, body, source[: match.start()]), indent)

    return REGION.sub(replace, source)


def exercise_notebook(solution: dict, only: int | None = None) -> dict:
    """The exercise version of a solution notebook: regions stubbed, outputs cleared.

    With ``only``, just that region (numbered across the notebook) is stubbed and outputs are kept."""
    nb = copy.deepcopy(solution)
    seen = 0
    for cell in nb["cells"]:
        if cell["cell_type"] != "code":
            continue
        src = cell_source(cell)
        n = count_regions(src)
        if only is None:
            cell["source"] = stub_source(src)
            cell["outputs"], cell["execution_count"] = [], None
        elif seen <= only < seen + n:
            cell["source"] = stub_source(src, only - seen)
        seen += n
    return nb


def write_exercises(solutions: Path = Path("solutions"), exercises: Path = Path("exercises")) -> list[Path]:
    """Regenerate every exercise notebook; return the paths written."""
    exercises.mkdir(parents=True, exist_ok=True)
    written = []
    for src in sorted(Path(solutions).glob("*.ipynb")):
        nb = read_notebook(src)
        if not any(count_regions(cell_source(c)) for c in nb["cells"] if c["cell_type"] == "code"):
            raise ValueError(f"{src} has no {BEGIN} region: an exercise notebook needs at least one")
        dst = exercises / src.name
        dst.write_text(dump_notebook(exercise_notebook(nb)), encoding="utf-8")
        written.append(dst)
    return written


# ---------------------------------------------------------------------------------------------
# Running a solution notebook in this process: once solved, and once per region with it stubbed

CHECK_TAG = "nbval-check-output"
NEEDS = re.compile(r"^%%needs\s+(.*)$")


@dataclass
class SolutionRun:
    """One in-process run of a solution notebook: ``stubbed[i]`` is the exception the notebook
    raised from region ``i`` on with that region stubbed (None if it ran to the end: a check that
    cannot fail); ``failures`` maps a code cell (numbered among the code cells) to what went wrong
    in the solved run: the exception it raised, or, for a checked cell, how its printed output
    differs from the committed one. ``code_cells`` counts them."""

    stubbed: list[BaseException | None] = field(default_factory=list)
    failures: dict[int, str] = field(default_factory=dict)
    code_cells: int = 0


def _cell_code(cell: dict) -> str | None:
    """A code cell as Python for ``exec``; None for a ``%%needs`` cell whose modules are missing."""
    source = cell_source(cell)
    first, _, rest = source.partition("\n")
    needs = NEEDS.match(first)
    if needs:
        from .notebook import missing_modules

        if missing_modules(needs.group(1).split()):
            return None
        return python_source({"source": rest})
    return python_source(cell)


def _first_error(sources: list[str], namespace: dict) -> BaseException | None:
    """Run ``sources`` in ``namespace`` in order; the first exception raised, or None."""
    for i, code in enumerate(sources):
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                exec(compile(code, f"<stubbed run, cell {i}>", "exec"), namespace)
        except Exception as error:  # noqa: BLE001 - which exception is the caller's verdict
            return error
    return None


def _committed_text(cell: dict) -> str:
    return "".join(o.get("text", "") for o in cell.get("outputs", []) if o.get("name") == "stdout")


@contextlib.contextmanager
def _working_directory(path: Path):
    before = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(before)


def run_solution(solution: dict, cwd: Path) -> SolutionRun:
    """Run a solution notebook once in this process (no kernel), in a fresh namespace. Before each
    cell that holds solution regions, each region is stubbed in turn and the rest of the notebook
    runs on in a copy of the namespace until it raises, which is what a reader who has not solved
    that exercise would see (the others stay solved). Checked cells (tagged ``nbval-check-output``)
    must print what the committed notebook shows. Magic lines are skipped; ``%%needs`` is honoured."""
    cells = [c for c in solution["cells"] if c["cell_type"] == "code"]
    codes = [_cell_code(c) for c in cells]
    namespace: dict = {"__name__": "__main__"}
    run = SolutionRun()
    with _working_directory(cwd):
        for i, (cell, code) in enumerate(zip(cells, codes)):
            if code is None:
                continue
            rest = [c for c in codes[i + 1 :] if c is not None]
            for region in range(count_regions(code)):
                run.stubbed.append(_first_error([stub_source(code, only=region), *rest], dict(namespace)))
            printed = io.StringIO()
            try:  # as nbval does, a failing cell is reported and the next cells still run
                with contextlib.redirect_stdout(printed):
                    exec(compile(code, f"<solution cell {i}>", "exec"), namespace)
            except Exception as error:  # noqa: BLE001 - reported as this cell's failure
                run.failures[i] = f"raised {type(error).__name__}: {error}"
                continue
            if CHECK_TAG in cell.get("metadata", {}).get("tags", []) and printed.getvalue() != _committed_text(cell):
                run.failures[i] = f"printed {printed.getvalue()!r}, committed {_committed_text(cell)!r}"
    run.code_cells = len(cells)
    return run


def execute_in_place(paths: list[Path]) -> None:
    """``make execute``: re-run notebooks on this machine and save them with their outputs."""
    for path in paths:
        print(f"executing {path} ...", flush=True)
        nb = execute_notebook(read_notebook(path), cwd=path.parent)
        path.write_text(dump_notebook(drop_tagged_stderr(nb)), encoding="utf-8")


def drop_tagged_stderr(nb: dict) -> dict:
    """Cells tagged ``remove-stderr`` (a library's debug lines, e.g. the profiler's) are saved
    without their stderr, as the book would hide it anyway."""
    for cell in nb["cells"]:
        if "remove-stderr" in cell.get("metadata", {}).get("tags", []):
            cell["outputs"] = [o for o in cell.get("outputs", []) if o.get("name") != "stderr"]
    return nb


if __name__ == "__main__":  # python -m minillm.book.exercises [--execute NB ...] | [solutions exercises]
    args = sys.argv[1:]
    if args[:1] == ["--execute"]:
        execute_in_place([Path(a) for a in args[1:]])
    else:
        for path in sync_repository_links():
            print(f"updated links in {path}")
        paths = write_exercises(*(Path(a) for a in args[:2]))
        print("\n".join(f"wrote {p}" for p in paths))
