"""Install like a reader: build a wheel of this checkout, install it (no editable link, nothing
from the source tree on the path) and execute every chapter from a folder outside the
repository, at the smallest scale. A file the chapters read but the wheel leaves out (the corpus,
the tokenizer, a bundled model) fails here, as it would on Colab."""

import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = sorted((ROOT / "chapters").glob("*.ipynb"))


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A site folder holding minillm and kernels installed from a freshly built wheel."""
    tmp = tmp_path_factory.mktemp("installed")
    build = [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation", "-q", "-w"]
    subprocess.run([*build, str(tmp / "wheel")], check=True, timeout=600, cwd=tmp, capture_output=True)
    (wheel,) = (tmp / "wheel").glob("minillm-*.whl")
    site = tmp / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
        check=True,
        timeout=600,
        capture_output=True,
    )
    return site


@pytest.mark.parametrize("path", CHAPTERS, ids=[p.stem for p in CHAPTERS])
def test_every_chapter_runs_from_an_installed_wheel(installed, path, tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(installed))  # first on the kernel's path: the wheel, not the checkout
    monkeypatch.setenv("MINILLM_SCALE", "tiny")
    monkeypatch.setenv("MINILLM_THREADS", "1")
    nb = nbformat.read(str(path), as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell("import minillm.kernels as k\nprint(minillm.__file__, k.__file__)"))
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    where = nb.cells[-1].outputs[0]["text"].split()
    assert all(Path(p).is_relative_to(installed) for p in where), where
    assert not any(Path(p).is_relative_to(ROOT) for p in where)
