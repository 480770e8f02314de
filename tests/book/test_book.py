"""The book's structure: every chapter has the same frame, links follow the one repository URL in
_config.yml, the table of contents lists exactly what exists, and nothing is saved broken."""

import shutil
from pathlib import Path

import pytest
import yaml

from minillm.book import links, nbfiles

ROOT = Path(__file__).resolve().parents[2]
CHAPTERS = sorted((ROOT / "chapters").glob("*.ipynb"))
NOTEBOOKS = CHAPTERS + sorted((ROOT / "solutions").glob("*.ipynb"))


def toc_files() -> set[str]:
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    files = {toc["root"]}
    for part in toc["parts"]:
        files |= {c["file"] for c in part["chapters"]}
    return files


def test_toc_lists_exactly_the_chapters_and_exercises_that_exist():
    on_disk = {f"{d}/{p.stem}" for d in ("chapters", "exercises") for p in (ROOT / d).glob("*.ipynb")}
    listed = {f for f in toc_files() if f.startswith(("chapters/", "exercises/"))}
    assert listed == on_disk
    for f in toc_files() - listed:
        assert (ROOT / f"{f}.md").is_file(), f"{f} is in _toc.yml but does not exist"


def test_the_book_has_sixteen_chapters_in_six_parts_each_with_exercises():
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    parts = {p["caption"]: [c["file"] for c in p["chapters"]] for p in toc["parts"]}
    numbered = [caption for caption in parts if caption.startswith("Part ")]
    assert [c.split(":")[0] for c in numbered] == [f"Part {n}" for n in ("I", "II", "III", "IV", "V", "VI")]
    chapters = [f for caption in numbered for f in parts[caption]]
    assert [int(Path(f).name[:2]) for f in chapters] == list(range(1, 17))
    assert parts["Exercises"] == [f.replace("chapters/", "exercises/") for f in chapters]
    intro = (ROOT / "book" / "intro.md").read_text()
    for f in chapters:  # the introduction's parts list names every chapter
        assert f"../{f}.ipynb" in intro, f


def test_links_follow_the_repository_in_config():
    repo, branch = links.repository(ROOT / "_config.yml")
    for path in NOTEBOOKS:
        nb = nbfiles.read_notebook(path)
        badge_path = f"{'exercises' if path.parent.name == 'solutions' else 'chapters'}/{path.name}"
        assert nbfiles.dump_notebook(links.sync_links(nb, badge_path, repo, branch)) == nbfiles.dump_notebook(nb), (
            f"{path.name}: run `make exercises` to point its links at {repo}"
        )


@pytest.mark.parametrize("path", CHAPTERS, ids=[p.stem for p in CHAPTERS])
def test_code_for_this_chapter_names_what_the_chapter_imports(path):
    """The box at the end of the first cell lists exactly the modules the chapter's code imports,
    each linked to its source, and every linked file exists (the box cannot go stale)."""
    repo, branch = links.repository(ROOT / "_config.yml")
    nb = nbfiles.read_notebook(path)
    first = nbfiles.cell_source(nb["cells"][0])
    assert links.BOX_START in first, f"{path.name}: no 'Code for this chapter' box; run `make exercises`"
    assert links.sync_code_box(nb, repo, branch) == nb, f"{path.name}: its code box is stale; run `make exercises`"
    for module in links.chapter_modules(nb):
        assert (ROOT / links.module_path(module)).is_file(), module


def test_code_box_derives_modules_from_imports_and_attribute_use():
    code = (
        "import minillm\nfrom minillm.kv.paged import BlockManager\nfrom minillm import KVCache\n"
        "from minillm.kernels.rmsnorm import rms_norm\nfrom minillm.book import setup\n"
        "out = minillm.generate(m, ids, 4)\ntext = minillm.training.corpus.load_text('valid')\n"
    )
    nb = {"cells": [{"cell_type": "markdown", "source": "# x"}, {"cell_type": "code", "source": code}]}
    assert links.chapter_modules(nb) == [  # by layer: techniques first, kernels last
        "minillm.core.cache",
        "minillm.core.generate",
        "minillm.kv.paged",
        "minillm.training.corpus",
        "minillm.kernels.rmsnorm",
    ]
    synced = links.sync_code_box(nb, "someone/minillm", "main")
    box = synced["cells"][0]["source"]
    assert "[`kv/paged.py`](https://github.com/someone/minillm/blob/main/minillm/kv/paged.py)" in box
    assert links.sync_code_box(synced, "someone/minillm", "main") == synced  # idempotent


@pytest.mark.parametrize("path", CHAPTERS, ids=[p.stem for p in CHAPTERS])
def test_every_chapter_has_the_same_frame(path):
    cells = nbfiles.read_notebook(path)["cells"]
    first = cells[0]["source"]
    assert cells[0]["cell_type"] == "markdown" and links.BADGE.search(first), "starts with an Open in Colab badge"
    assert "**What you'll learn**" in first
    assert cells[1]["cell_type"] == "code" and '"google.colab" in sys.modules' in cells[1]["source"]
    assert "setup(" in cells[2]["source"], "the first code cell after the install cell calls minillm.book.setup()"
    last = cells[-1]["source"]
    assert "## Key takeaways" in last and f"../exercises/{path.name}" in last
    number = int(path.name[:2])
    form = f"**Exercises:** [Chapter {number} exercises](../exercises/{path.name}): "
    assert form in last, "one form of exercise link"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[f"{p.parent.name}-{p.stem}" for p in NOTEBOOKS])
def test_notebooks_are_saved_with_outputs_and_without_errors(path):
    code = [c for c in nbfiles.read_notebook(path)["cells"] if c["cell_type"] == "code" and c["source"].strip()]
    errors = [o for c in code for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, f"{path.name} was saved with an error output"
    assert sum(bool(c.get("outputs")) for c in code) >= len(code) // 2, f"{path.name} was saved without outputs"


@pytest.mark.parametrize("path", CHAPTERS, ids=[p.stem for p in CHAPTERS])
def test_no_stderr_noise_in_a_chapter(path):
    """Warnings, progress bars and debug lines on stderr do not belong in the rendered book: a cell
    that cannot avoid them carries the remove-stderr tag and its committed stderr is dropped."""
    for i, cell in enumerate(nbfiles.read_notebook(path)["cells"]):
        if cell["cell_type"] == "code":
            streams = [o for o in cell.get("outputs", []) if o.get("name") == "stderr"]
            assert not streams, f"{path.name} cell {i} has stderr output: {''.join(streams[0]['text'])[:120]!r}"


def test_the_book_can_be_pointed_at_any_repository(tmp_path):
    """What the publishing workflow does, for a made-up repository: every Colab badge, install
    cell, code-box link, the clone line and _config.yml name it, and nothing names the placeholder."""
    for folder in ("chapters", "solutions", "book"):
        shutil.copytree(ROOT / folder, tmp_path / folder)
    shutil.copy(ROOT / "_config.yml", tmp_path / "_config.yml")
    repo, branch = "someone-else/inference-book", "book"
    changed = links.point_book_at(tmp_path, repo, branch)
    assert len(changed) >= len(NOTEBOOKS) + 2
    assert links.repository(tmp_path / "_config.yml") == (repo, branch)
    assert f"git clone https://github.com/{repo}.git" in (tmp_path / "book" / "how_to_run.md").read_text()
    for folder, badge_folder in (("chapters", "chapters"), ("solutions", "exercises")):
        for path in sorted((tmp_path / folder).glob("*.ipynb")):
            text = path.read_text()
            assert links.PLACEHOLDER not in text, path.name
            badge = f"https://colab.research.google.com/github/{repo}/blob/{branch}/{badge_folder}/{path.name}"
            assert badge in text, path.name
            assert f"minillm[book] @ git+https://github.com/{repo}@{branch}" in text, path.name
            if folder == "chapters":
                assert f"https://github.com/{repo}/blob/{branch}/minillm/" in text, path.name
    assert links.placeholder_warning(tmp_path) is None and links.placeholder_warning(ROOT)
    with pytest.raises(ValueError, match="owner/name"):
        links.point_book_at(tmp_path, "not a repo", "main")


def test_the_workflows_parse_and_run_the_projects_own_commands():
    book = yaml.safe_load((ROOT / ".github/workflows/book.yml").read_text())
    tests = yaml.safe_load((ROOT / ".github/workflows/tests.yml").read_text())
    on = book.get("on", book.get(True))  # YAML 1.1 reads a bare `on` key as True
    assert on["push"]["branches"] == ["main"]
    steps = [s.get("run", "") for s in book["jobs"]["build"]["steps"]]
    assert any('minillm.book.links --repo "${{ github.repository }}"' in s for s in steps)
    assert any("make exercises" in s for s in steps) and any(s.strip() == "make book" for s in steps)
    assert any('git push --force origin "$BOOK_BRANCH"' in s for s in steps)
    assert "deploy-pages" in book["jobs"]["deploy"]["steps"][0]["uses"]
    assert "pull_request" in tests.get("on", tests.get(True))
    assert [s.get("run") for s in tests["jobs"]["test"]["steps"]][-1] == "make test"


def live_cpu(nb: dict) -> str | None:
    """The CPU a chapter's live cells ran on, from the hardware line its set-up cell prints."""
    import re

    for cell in nb["cells"][:4]:
        for out in cell.get("outputs", []):
            text = "".join(out.get("text") or out.get("data", {}).get("text/plain", ""))
            match = re.match(r"(.+?) \(cpu\), \d+ thread", text)
            if match:
                name = re.sub(r"\((R|TM)\)|\bProcessor\b|\bCPU\b|@.*", "", match.group(1))
                return " ".join(name.split()[:2])  # vendor and family: "Intel Xeon", "AMD EPYC"
    return None


def test_the_landing_page_names_the_machine_of_every_chapters_live_cells():
    intro = (ROOT / "book" / "intro.md").read_text()
    said = intro[intro.index("**What ran where") :].split("\n\n")[0]
    cpus = {live_cpu(nbfiles.read_notebook(p)) for p in CHAPTERS} - {None}
    assert cpus, "no chapter prints a CPU hardware line"
    live = " ".join(said.split()).split("live cells on", 1)[1].split("the saved")[0]
    for cpu in cpus:
        assert cpu in live, (cpu, live)
