"""``book.source.show``: the library's own code on the page, re-formatted to the page's width
without changing a token of it."""

import ast
import importlib.util
import inspect
import json
import textwrap
from pathlib import Path

import pytest

from minillm.book import nbfiles, source
from minillm.book.source import show
from minillm.core.compiled import CompiledForward, StaticSlots
from minillm.measure.report import PAGE_WIDTH


def test_an_excerpt_names_its_file_and_line_and_fits_the_page():
    excerpt = show(CompiledForward.__call__)
    lines, first = inspect.getsourcelines(CompiledForward.__call__)
    assert excerpt.path == "minillm/core/compiled.py" and excerpt.line == first
    assert excerpt.name == "CompiledForward.__call__"
    assert max(len(line) for line in lines) > PAGE_WIDTH  # written wider than the page ...
    long = [line for line in excerpt.code.splitlines() if len(line) > PAGE_WIDTH]
    assert long == [line for line in long if '"' in line]  # ... shown within it, but for a string ruff cannot split


def test_re_formatting_changes_no_code():
    """The excerpt parses to the same syntax tree as the source it came from."""
    for obj in (CompiledForward.__call__, StaticSlots, source.wrap_comments):
        original = textwrap.dedent(inspect.getsource(obj))
        assert ast.dump(ast.parse(show(obj).code)) == ast.dump(ast.parse(original)), obj


def test_a_slice_runs_from_its_start_to_its_stop_line():
    excerpt = show(StaticSlots, start="def reserve", stop="return self.cache.k[layer]")
    code = excerpt.code.splitlines()
    assert code[0].startswith("def reserve(") and code[-1].strip().startswith("return self.cache.k[layer]")
    assert "def update(" in excerpt.code and "def place_new" not in excerpt.code
    lines, first = inspect.getsourcelines(StaticSlots)
    assert "def reserve" in lines[excerpt.line - first]  # the header points at the slice's own line
    with pytest.raises(ValueError, match="'def nowhere' is not in the source of StaticSlots"):
        show(StaticSlots, start="def nowhere")


def test_only_minillm_code_is_shown():
    with pytest.raises(ValueError, match="renders minillm's own code"):
        show(json.dumps)
    with pytest.raises(ValueError, match="no source to show"):
        show(3)


def test_a_source_file_of_the_package_is_shown_as_written(tmp_path):
    from minillm.kernels import native

    excerpt = show(native.SOURCE, start="static int32_t dot_i8(", stop="#elif defined(__AVX2__)")
    lines = native.SOURCE.read_text().splitlines()
    assert lines[excerpt.line - 1].startswith("static int32_t dot_i8(")
    assert excerpt.code == "\n".join(lines[excerpt.line - 1 : excerpt.line - 1 + len(excerpt.code.splitlines())])
    assert excerpt._repr_markdown_().startswith(f"`{excerpt.header}`\n\n```c\nstatic int32_t dot_i8(")
    assert str(excerpt).startswith("// minillm/kernels/quant_matvec.c, line ")
    with pytest.raises(ValueError, match="not a file of the package"):
        show(tmp_path / "elsewhere.c", start="int")
    with pytest.raises(ValueError, match="needs start="):
        show(native.SOURCE)


def test_a_source_files_lines_wider_than_the_page_are_refused(monkeypatch):
    from minillm.kernels import native

    wide = "    return " + "1 + " * 30 + "1;"
    text = "int f(void) {\n" + wide + "\n}\n"
    monkeypatch.setattr(type(native.SOURCE), "read_text", lambda self: text)
    with pytest.raises(ValueError, match=r"1 line\(s\) wider than the page \(88\)"):
        show(native.SOURCE, start="int f(void)", stop="}")


def test_without_ruff_the_code_is_shown_as_written(monkeypatch):
    monkeypatch.setattr(source, "ruff_format", lambda code, width=PAGE_WIDTH: None)
    original = textwrap.dedent(inspect.getsource(source.wrap_comments)).rstrip("\n")
    assert show(source.wrap_comments).code == source.wrap_comments(original)


def test_long_comments_are_wrapped_and_trailing_ones_moved_above_their_code():
    code = "x = 1  # " + "word " * 30 + "\n"
    moved = source.comments_above(code, 40).splitlines()
    assert moved[0].startswith("# word") and moved[1] == "x = 1"
    wrapped = source.wrap_comments(moved[0], 40).splitlines()
    assert len(wrapped) > 1 and all(len(line) <= 40 and line.startswith("# ") for line in wrapped)


def test_the_page_shows_highlighted_python_under_its_header():
    excerpt = show(StaticSlots, start="def reserve", stop="return self.cache.positions")
    md = excerpt._repr_markdown_()
    assert md.startswith(f"`{excerpt.header}`\n\n```python\ndef reserve(") and md.endswith("```\n")
    assert str(excerpt).splitlines()[0] == f"# {excerpt.header}"


ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted(p for d in ("chapters", "solutions") for p in (ROOT / d).glob("*.ipynb"))


def shown_excerpts(nb: dict) -> list[tuple[str, str]]:
    """(the cell's source, its committed markdown output) of every cell that shows library code."""
    found = []
    for cell in nb["cells"]:
        for out in cell.get("outputs", []):
            md = "".join(out.get("data", {}).get("text/markdown", ""))
            if md.startswith("`minillm/") and "\n```" in md:
                found.append((nbfiles.cell_source(cell), md))
    return found


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_the_code_a_page_shows_is_the_code_the_library_has_now(path):
    """A committed excerpt equals what ``show`` renders from today's source: change a shown
    function and this fails until the chapter is re-executed (or its excerpts refreshed with
    ``python -m minillm.book.source``)."""
    nb = nbfiles.read_notebook(path)
    committed = dict(shown_excerpts(nb))
    for cell, excerpt in source.render_excerpts(nb):
        cell_source = nbfiles.cell_source(cell)
        assert committed.get(cell_source) == excerpt._repr_markdown_(), cell_source


def test_refreshing_writes_the_output_jupyter_would(tmp_path):
    chapter = ROOT / "chapters" / "11_compilers.ipynb"
    copy = tmp_path / chapter.name
    copy.write_text(chapter.read_text())
    excerpts = source.excerpt_cells(nbfiles.read_notebook(chapter))
    assert len(excerpts) >= 2 and source.refresh_excerpts(copy) == len(excerpts)
    fresh, committed = nbfiles.read_notebook(copy), nbfiles.read_notebook(chapter)
    shown = [c for c in fresh["cells"] if c in source.excerpt_cells(fresh)]
    assert [c["outputs"] for c in shown] == [c["outputs"] for c in source.excerpt_cells(committed)]


def test_a_triton_kernel_is_shown_from_its_python_function():
    pytest.importorskip("triton")
    from minillm.kernels.rmsnorm import _rmsnorm_kernel

    excerpt = show(_rmsnorm_kernel)
    assert excerpt.name == "_rmsnorm_kernel" and excerpt.code.startswith("@triton.jit")
    assert show(_rmsnorm_kernel.fn) == excerpt


def test_excerpts_under_needs_triton_are_rendered_and_checked():
    chapter = nbfiles.read_notebook(ROOT / "chapters" / "10_flash_attention.ipynb")
    needing = [c for c in source.excerpt_cells(chapter) if nbfiles.cell_source(c).startswith("%%needs triton")]
    assert len(needing) >= 4
    rendered = [cell for cell, _ in source.render_excerpts(chapter)]
    assert all(any(c is r for r in rendered) for c in needing) == (importlib.util.find_spec("triton") is not None)
