"""``minillm.book.pages``: a build names the book's real repository, or, when none is known,
leaves out every link to the placeholder instead of printing it."""

import json
import subprocess
from pathlib import Path

from minillm.book import nbfiles, pages
from minillm.book.links import PLACEHOLDER

ROOT = Path(__file__).resolve().parents[2]
CHAPTER = ROOT / "chapters" / "04_kv_cache.ipynb"


def test_a_known_repository_replaces_the_placeholder_everywhere():
    text = CHAPTER.read_text()
    assert PLACEHOLDER in text
    resolved = pages.resolve_notebook(text, "someone/minillm")
    assert PLACEHOLDER not in resolved and "github.com/someone/minillm/blob/main/minillm/" in resolved
    assert "colab.research.google.com/github/someone/minillm/blob/main/chapters/04_kv_cache" in resolved


def test_without_a_repository_no_badge_no_dead_link_and_a_clone_install():
    nb = json.loads(pages.resolve_notebook(CHAPTER.read_text(), None))
    text = "\n".join(nbfiles.cell_source(c) for c in nb["cells"])
    assert PLACEHOLDER not in text and "Open in Colab" not in text
    assert nbfiles.cell_source(nb["cells"][0]).startswith("# 4.")  # the title opens the page
    assert "[`core/cache.py`]" not in text and "`core/cache.py`" in text  # the file's name, unlinked
    install = nbfiles.cell_source(nb["cells"][1])
    assert 'pip install -e ".[book]"' in install and "%pip" not in install
    compile(nbfiles.python_source(nb["cells"][1]), "install", "exec")  # still a cell that runs


def test_how_to_run_names_the_clone_or_the_readers_copy():
    guide = (ROOT / "book" / "how_to_run.md").read_text()
    assert f"git clone https://github.com/{PLACEHOLDER}.git" in guide  # what the publisher rewrites
    known = pages.resolve_text(guide, "someone/minillm")
    assert "git clone https://github.com/someone/minillm.git\ncd minillm\nmake lab" in known
    unknown = pages.resolve_text(guide, None)
    assert PLACEHOLDER not in unknown and "git clone" not in unknown
    assert pages.IN_A_COPY + "make lab" in unknown


def test_the_repository_comes_from_the_environment_then_the_git_remote(monkeypatch, tmp_path):
    monkeypatch.delenv("GITHUB_REPOSITORY", raising=False)
    monkeypatch.setenv("MINILLM_REPOSITORY", "reader/fork")
    assert pages.resolve_repository(tmp_path) == "reader/fork"
    monkeypatch.delenv("MINILLM_REPOSITORY")
    monkeypatch.setenv("GITHUB_REPOSITORY", "ci/minillm")
    assert pages.resolve_repository(tmp_path) == "ci/minillm"
    monkeypatch.delenv("GITHUB_REPOSITORY")
    assert pages.resolve_repository(tmp_path) is None  # not a repository at all
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    assert pages.resolve_repository(tmp_path) is None  # a repository without a remote
    remote = ["git", "-C", str(tmp_path), "remote", "add", "origin", "git@github.com:owner/minillm.git"]
    subprocess.run(remote, check=True)
    assert pages.resolve_repository(tmp_path) == "owner/minillm"


def test_the_book_loads_the_extension():
    config = (ROOT / "_config.yml").read_text()
    assert "extra_extensions: [minillm.book.pages, sphinx-mathjax-offline]" in config


def test_the_page_shows_a_guarded_cell_without_its_needs_line():
    chapter = ROOT / "chapters" / "10_flash_attention.ipynb"
    text = chapter.read_text()
    assert "%%needs triton" in text
    nb = json.loads(pages.without_needs(text))
    guarded = [nbfiles.cell_source(c) for c in nb["cells"] if c["cell_type"] == "code"]
    assert not any("%%needs" in s for s in guarded) and any(s.startswith("show(_flash_fwd_kernel") for s in guarded)
