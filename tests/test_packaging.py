"""A non-editable install ships what the chapters read: every file under minillm/data and
minillm/bundled and every saved result under minillm/results matches a package-data pattern of
pyproject.toml (so `pip install .` or a wheel carries the corpus, the tokenizer, the bundled
models, the Medusa heads and the saved runs the chapters plot)."""

import fnmatch
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = Path(__file__).resolve().parents[1]


def package_data_patterns() -> list[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return config["tool"]["setuptools"]["package-data"]["minillm"]


def test_every_data_file_is_package_data():
    patterns = package_data_patterns()
    folders = ("data", "bundled", "results")
    files = [p for folder in folders for p in (ROOT / "minillm" / folder).rglob("*") if p.is_file()]
    assert files, "no data files found"
    for path in files:
        relative = path.relative_to(ROOT / "minillm").as_posix()
        # setuptools globs do not cross folders: one * is one path component
        matched = [p for p in patterns if fnmatch.fnmatch(relative, p) and relative.count("/") == p.count("/")]
        assert matched, f"{relative} would be missing from a non-editable install; add it to package-data"


def test_the_book_extra_brings_what_notebooks_import():
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["book"]
    names = {e.split(">")[0].split(";")[0].split("=")[0].strip() for e in extra}
    assert {"matplotlib", "ipywidgets", "pyyaml", "triton", "minillm[serve]", "openai", "httpx"} <= names


def test_the_results_store_is_in_the_package_and_can_be_moved(tmp_path, monkeypatch):
    from minillm.measure.report import load_results, results_root, save_result

    assert results_root() == ROOT / "minillm" / "results"
    assert load_results("bench_generate"), "the saved CPU run the chapters plot"
    monkeypatch.setenv("MINILLM_RESULTS", str(tmp_path))
    assert load_results("bench_generate") == {}
    path = save_result("bench_x", {"device": "cpu", "x": 1}, hardware="box")
    assert path == tmp_path / "box" / "bench_x.json"
    assert load_results("bench_x") == {"box": {"device": "cpu", "x": 1}}
