"""Reading, writing and running notebooks in the committed format (nbformat 4, one trailing newline)."""

from __future__ import annotations

import copy
import re
from pathlib import Path


def cell_source(cell: dict) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def split_needs(code: str) -> tuple[list[str], str]:
    """A code cell's ``%%needs triton`` modules (none without the magic) and the code under it."""
    first, _, rest = code.lstrip().partition("\n")
    if first.startswith("%%needs"):
        return first.split()[1:], rest.lstrip()
    return [], code.lstrip()


def python_source(cell: dict) -> str:
    """A code cell's source as plain Python: IPython magic and shell lines (``%pip``,
    ``%%needs triton``, ``!ls``) become ``pass``, keeping their indentation, so ``ast`` can read it."""
    return "\n".join(re.sub(r"^(\s*)[%!].*", r"\1pass", line) for line in cell_source(cell).splitlines())


def read_notebook(path: Path) -> dict:
    import nbformat

    return nbformat.read(str(path), as_version=4)


def dump_notebook(nb: dict) -> str:
    import nbformat

    return nbformat.writes(nbformat.from_dict(nb)) + "\n"


def execute_notebook(nb: dict, cwd: Path, timeout: int = 600) -> dict:
    """Run every cell of ``nb`` in a fresh kernel (in ``cwd``); raise on the first error."""
    import nbformat
    from nbclient import NotebookClient

    node = nbformat.from_dict(copy.deepcopy(nb))
    NotebookClient(node, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(cwd)}}).execute()
    return node
