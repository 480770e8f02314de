"""A non-editable install ships what the chapters read: every file under minillm/data and
minillm/bundled matches a package-data pattern of pyproject.toml (so `pip install .` or a wheel
carries the corpus, the tokenizer, the bundled models and the Medusa heads)."""

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
    files = [p for folder in ("data", "bundled") for p in (ROOT / "minillm" / folder).rglob("*") if p.is_file()]
    assert files, "no data files found"
    for path in files:
        relative = path.relative_to(ROOT / "minillm").as_posix()
        # setuptools globs do not cross folders: one * is one path component
        matched = [p for p in patterns if fnmatch.fnmatch(relative, p) and relative.count("/") == p.count("/")]
        assert matched, f"{relative} would be missing from a non-editable install; add it to package-data"


def test_the_book_extra_brings_what_notebooks_import():
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["book"]
    names = {e.split(">")[0].split(";")[0].split("=")[0].strip() for e in extra}
    assert {"matplotlib", "ipywidgets", "pyyaml", "triton"} <= names
