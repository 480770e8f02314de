"""The library's own code on the page: ``show(obj)`` renders a function, class or method of
minillm from its source, highlighted, under the file and line it comes from, so the code a
chapter teaches is the code that runs and can never drift from it.

The package is written 120 columns wide and the page holds 88 (``PAGE_WIDTH``): an excerpt is
re-formatted to the page's width with ruff (comments re-wrapped too), the code itself unchanged.
Without ruff (a bare Python) it is shown as written.

    from minillm.book.source import show
    show(StaticSlots, start="def reserve", stop="return self.cache.k[layer]")
"""

from __future__ import annotations

import inspect
import io
import shutil
import subprocess
import sys
import textwrap
import tokenize
from dataclasses import dataclass
from pathlib import Path

from ..measure.report import PAGE_WIDTH

PACKAGE = Path(__file__).resolve().parents[1]  # .../minillm


@dataclass(frozen=True)
class Excerpt:
    """Source lines of one object: where they come from and the code as the page shows it."""

    path: str  # relative to the repository, e.g. minillm/core/compiled.py
    line: int  # the first line of the object in that file
    name: str  # its qualified name (a source file's excerpt: the text it starts at)
    code: str
    language: str = "python"

    @property
    def header(self) -> str:
        return f"{self.path}, line {self.line}: {self.name}"

    def _repr_markdown_(self) -> str:
        return f"`{self.header}`\n\n```{self.language}\n{self.code}\n```\n"

    def __str__(self) -> str:
        comment = "//" if self.language == "c" else "#"
        return f"{comment} {self.header}\n{self.code}"

    __repr__ = __str__


def ruff_format(code: str, width: int = PAGE_WIDTH) -> str | None:
    """``code`` formatted by ruff at ``width`` columns; None when ruff is not installed or the
    code does not parse on its own."""
    # this Python's own ruff first (the book extra's), so the page does not depend on the PATH
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if ruff is None:
        return None
    try:
        done = subprocess.run(
            [ruff, "format", "--isolated", f"--line-length={width}", "--stdin-filename=excerpt.py", "-"],
            input=code,
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.rstrip("\n") if done.returncode == 0 else None


def _comments(code: str) -> dict[int, int]:
    """Line index -> column where a real comment starts (tokenized: never a ``#`` in a string)."""
    try:
        tokens = tokenize.generate_tokens(io.StringIO(code).readline)
        return {t.start[0] - 1: t.start[1] for t in tokens if t.type == tokenize.COMMENT}
    except (tokenize.TokenError, SyntaxError):
        return {}


def comments_above(code: str, width: int = PAGE_WIDTH) -> str:
    """A trailing comment that would take its line past ``width`` moved onto a line of its own
    above its code (before formatting, so that the formatter does not split the code for it)."""
    comments, out = _comments(code), []
    for i, line in enumerate(code.splitlines()):
        col = comments.get(i)
        if col is not None and len(line) > width and line[:col].strip():
            indent = line[: len(line) - len(line.lstrip())]
            out += [indent + line[col:], line[:col].rstrip()]
        else:
            out.append(line)
    return "\n".join(out) + "\n"


def wrap_comments(code: str, width: int = PAGE_WIDTH) -> str:
    """Comment lines longer than ``width`` re-wrapped at words, at their own indent."""
    comments, out = _comments(code), []
    for i, line in enumerate(code.splitlines()):
        if len(line) <= width or i not in comments or line[: comments[i]].strip():
            out.append(line)
            continue
        indent, text = line[: comments[i]], line[comments[i] :].lstrip("#").strip()
        out += textwrap.wrap(text, width, initial_indent=indent + "# ", subsequent_indent=indent + "# ")
    return "\n".join(out)


def _lines_between(code: str, start: str | None, stop: str | None, name: str) -> str:
    lines = code.splitlines()
    first = 0
    if start is not None:
        hits = [i for i, line in enumerate(lines) if start in line]
        if not hits:
            raise ValueError(f"{start!r} is not in the source of {name}")
        first = hits[0]
    last = len(lines) - 1
    if stop is not None:
        hits = [i for i, line in enumerate(lines) if stop in line and i >= first]
        if not hits:
            raise ValueError(f"{stop!r} is not in the source of {name} after {start!r}")
        last = hits[0]
    return textwrap.dedent("\n".join(lines[first : last + 1]))


LANGUAGES = {".c": "c", ".py": "python"}


def show(obj, start: str | None = None, stop: str | None = None, width: int = PAGE_WIDTH) -> Excerpt:
    """The source of ``obj`` (a function, class or method of minillm), formatted to the page:
    all of it, or from the first line containing ``start`` to the first line after it containing
    ``stop`` (both included). ``obj`` may also be a source file of the package (a ``Path``, e.g.
    the C kernels'), shown as written from ``start`` to ``stop``: its lines must fit the page."""
    if isinstance(obj, Path):
        return _show_file(obj, start, stop, width)
    if not (inspect.isroutine(obj) or inspect.isclass(obj)) and inspect.isfunction(getattr(obj, "fn", None)):
        obj = obj.fn  # a Triton kernel (compiled or interpreted) keeps its Python function as .fn
    if inspect.isfunction(getattr(obj, "_init_fn", None)):
        obj = obj._init_fn  # a torch.library custom op keeps the function it was made from
    target = inspect.unwrap(obj.fget if isinstance(obj, property) else obj)
    name = getattr(target, "__qualname__", getattr(target, "__name__", repr(obj)))
    try:
        file = Path(inspect.getsourcefile(target)).resolve()
        lines, line = inspect.getsourcelines(target)
    except (TypeError, OSError) as exc:
        raise ValueError(f"no source to show for {obj!r}: {exc}") from None
    if PACKAGE not in file.parents:
        raise ValueError(f"show() renders minillm's own code; {name} is defined in {file}")
    whole = comments_above(textwrap.dedent("".join(lines)), width)
    formatted = ruff_format(whole, width) or whole.rstrip("\n")
    code = wrap_comments(_lines_between(formatted, start, stop, name), width)
    if start is not None:  # the file's line of the excerpt's first line
        line += next((i for i, text in enumerate(lines) if start in text), 0)
    return Excerpt(f"minillm/{file.relative_to(PACKAGE).as_posix()}", line, name, code)


def _show_file(path: Path, start: str | None, stop: str | None, width: int) -> Excerpt:
    file = path.resolve()
    if PACKAGE not in file.parents or not file.is_file():
        raise ValueError(f"show() renders minillm's own code; {path} is not a file of the package")
    if start is None:
        raise ValueError(f"show({path.name}) needs start=: the text of the line the excerpt begins at")
    text = file.read_text()
    code = _lines_between(text, start, stop, path.name)
    too_wide = [line for line in code.splitlines() if len(line) > width]
    if too_wide:
        raise ValueError(f"{path.name}: {len(too_wide)} line(s) wider than the page ({width}): {too_wide[0]!r}")
    line = 1 + next(i for i, text_line in enumerate(text.splitlines()) if start in text_line)
    return Excerpt(
        f"minillm/{file.relative_to(PACKAGE).as_posix()}", line, start.strip(), code, LANGUAGES.get(file.suffix, "")
    )


def _library_imports(nb: dict) -> str:
    """The notebook's ``from minillm ...`` and ``import minillm`` statements, in order."""
    import ast

    from .nbfiles import python_source

    found = []
    for cell in nb["cells"]:
        if cell["cell_type"] != "code":
            continue
        try:
            tree = ast.parse(python_source(cell))
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                modules = [node.module or ""]
            elif isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            else:
                continue
            if any(m.split(".")[0] == "minillm" for m in modules):
                found.append(ast.unparse(node))
    return "\n".join(found)


def _needs_and_call(cell: dict) -> tuple[list[str], str]:
    from .nbfiles import cell_source, split_needs

    return split_needs(cell_source(cell))


def excerpt_cells(nb: dict) -> list[dict]:
    """The code cells that only show library code: their source is one ``show(...)`` call,
    perhaps under a ``%%needs triton`` line."""
    return [c for c in nb["cells"] if c["cell_type"] == "code" and _needs_and_call(c)[1].startswith("show(")]


def render_excerpts(nb: dict) -> list[tuple[dict, Excerpt]]:
    """(cell, excerpt) for every excerpt cell whose modules are installed, rendered from today's
    source with the names the notebook imports from minillm."""
    from .notebook import missing_modules

    namespace: dict = {}
    exec(_library_imports(nb), namespace)
    rendered = []
    for cell in excerpt_cells(nb):
        modules, call = _needs_and_call(cell)
        if not missing_modules(modules):
            rendered.append((cell, eval(call, namespace)))
    return rendered


def refresh_excerpts(path: Path) -> int:
    """Write each excerpt cell's output in the notebook at ``path`` afresh, as Jupyter would show
    it (without running the rest of the notebook); the number of cells rendered."""
    from .nbfiles import dump_notebook, read_notebook

    nb = read_notebook(path)
    rendered = render_excerpts(nb)
    for cell, excerpt in rendered:
        data = {"text/markdown": excerpt._repr_markdown_(), "text/plain": str(excerpt)}
        count = cell.get("execution_count")
        cell["outputs"] = [{"data": data, "execution_count": count, "metadata": {}, "output_type": "execute_result"}]
    path.write_text(dump_notebook(nb))
    return len(rendered)


if __name__ == "__main__":  # python -m minillm.book.source chapters/04_kv_cache.ipynb ...
    for name in sys.argv[1:]:
        print(f"{name}: {refresh_excerpts(Path(name))} excerpt(s) rendered")
