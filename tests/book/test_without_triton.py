"""Chapters 10 and 11 on a machine without Triton (a Mac): every cell runs except the kernel
cells, which print one line saying why they are skipped (the ``%%needs triton`` magic)."""

from pathlib import Path

import pytest

from minillm.book import nbfiles
from minillm.book.notebook import missing_modules

pytestmark = pytest.mark.slow  # several processes, a compile or a server: make test-fast leaves it out

ROOT = Path(__file__).resolve().parents[2]
HIDE_TRITON = "import sys\n\nsys.modules['triton'] = None  # as if it were not installed"


def test_missing_modules_names_what_cannot_be_imported():
    assert missing_modules(["torch", "a_module_nobody_wrote"]) == ["a_module_nobody_wrote"]


@pytest.mark.parametrize("name", ["10_flash_attention", "11_compilers"])
def test_the_chapter_runs_without_triton(name, monkeypatch):
    monkeypatch.setenv("MINILLM_SCALE", "tiny")
    monkeypatch.setenv("MINILLM_THREADS", "1")
    nb = nbfiles.read_notebook(ROOT / "chapters" / f"{name}.ipynb")
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    kernel_cells = [c for c in code if nbfiles.cell_source(c).startswith("%%needs triton")]
    assert kernel_cells, f"{name}: its kernel cells start with %%needs triton"
    for cell in code:  # only those cells reach for triton or the kernels package
        src = nbfiles.cell_source(cell)
        if cell not in kernel_cells:
            assert "from kernels" not in src and "import triton" not in src, src[:200]
    hide = {"cell_type": "code", "metadata": {}, "source": HIDE_TRITON, "outputs": [], "execution_count": None}
    nb["cells"].insert(0, hide)
    ran = nbfiles.execute_notebook(nb, cwd=ROOT / "chapters", timeout=600)
    skipped = [
        c
        for c in ran["cells"]
        if c["cell_type"] == "code"
        and any("Skipped: needs triton" in "".join(o.get("text", "")) for o in c.get("outputs", []))
    ]
    assert len(skipped) == len(kernel_cells)
