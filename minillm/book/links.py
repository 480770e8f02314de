"""Where the book points: one repository URL, named in _config.yml, behind every notebook's Colab
badge and install cell, and the "Code for this chapter" box that links each chapter to the
modules it imports."""

from __future__ import annotations

import ast
import copy
import importlib
import importlib.util
import re
from pathlib import Path

from .nbfiles import cell_source, dump_notebook, python_source, read_notebook

BADGE = re.compile(
    r"\[!\[Open in Colab\]\(https://colab\.research\.google\.com/assets/colab-badge\.svg\)\]"
    r"\(https://colab\.research\.google\.com/github/[^)\s]*\)"
)
INSTALL = re.compile(r"minillm(?:\[[\w,]*\])? @ git\+https://github\.com/[^\"'\s]*")
INSTALL_SPEC = "minillm[book]"  # the chapters' extra: what notebooks import besides minillm


def repository(config: Path = Path("_config.yml")) -> tuple[str, str]:
    """("owner/name", branch) from the book's _config.yml."""
    import yaml

    repo = yaml.safe_load(Path(config).read_text())["repository"]
    return repo["url"].removeprefix("https://github.com/").rstrip("/"), repo.get("branch", "main")


def colab_badge(repo: str, branch: str, path: str) -> str:
    return (
        f"[![Open in Colab](https://colab.research.google.com/assets/colab-badge.svg)]"
        f"(https://colab.research.google.com/github/{repo}/blob/{branch}/{path})"
    )


def sync_links(nb: dict, badge_path: str, repo: str, branch: str) -> dict:
    """Point a notebook's Colab badge at ``badge_path`` and its install cell at ``repo``."""
    nb = copy.deepcopy(nb)
    for cell in nb["cells"]:
        src = cell_source(cell)
        src = BADGE.sub(lambda _: colab_badge(repo, branch, badge_path), src)
        cell["source"] = INSTALL.sub(f"{INSTALL_SPEC} @ git+https://github.com/{repo}@{branch}", src)
    return nb


# ---------------------------------------------------------------------------------------------
# "Code for this chapter": the modules a chapter imports, linked to their source

BOX_START = ":::{admonition} Code for this chapter"
BOX = re.compile(r"\n*^:::\{admonition\} Code for this chapter\n.*?^:::[ \t]*$", re.M | re.S)


def _source_module(module: str, name: str) -> str:
    """Where ``from module import name`` really comes from: the module itself, or, for a name
    the package re-exports (``from minillm import generate``), the module that defines it.
    Kernel modules are never imported here (Triton may be missing): they are named as they are."""
    if module.split(".")[0] != "minillm":
        return module
    try:
        importlib.import_module(f"{module}.{name}")
        return f"{module}.{name}"  # a submodule
    except ImportError:
        pass
    obj = getattr(importlib.import_module(module), name, None)
    defined = getattr(obj, "__module__", None)
    return defined if isinstance(defined, str) and defined.split(".")[0] == module.split(".")[0] else module


def _attribute_module(node: ast.Attribute, parents: dict[ast.AST, ast.AST]) -> str:
    """The module behind the longest ``minillm.a.b.c`` chain that ``node`` (``minillm.a``) starts."""
    chain = ["minillm", node.attr]
    while isinstance(parents.get(node), ast.Attribute):
        node = parents[node]
        chain.append(node.attr)
    for n in range(len(chain) - 1, 1, -1):
        module = ".".join(chain[:n])
        try:
            spec = importlib.util.find_spec(module)
        except ModuleNotFoundError:  # a name below a plain module, not a package
            spec = None
        if spec is not None:
            return _source_module(module, chain[n]) if n < len(chain) else module
    return _source_module("minillm", chain[1])


def chapter_modules(nb: dict) -> list[str]:
    """The project modules (``minillm.*``) a notebook's code cells import, sorted."""
    found: set[str] = set()
    for cell in nb["cells"]:
        if cell["cell_type"] != "code":
            continue
        tree = ast.parse(python_source(cell))
        parents = {child: parent for parent in ast.walk(tree) for child in ast.iter_child_nodes(parent)}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "minillm":
                found.update(_source_module(node.module, alias.name) for alias in node.names)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name.split(".")[0] == "minillm")
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "minillm":
                found.add(_attribute_module(node, parents))  # minillm.generate(...) after `import minillm`
    # setup, loading and the table printer appear in every chapter: the box names the topic's code
    everywhere = (
        "minillm",
        "minillm.book",
        "minillm.measure.report",
        "minillm.core.checkpoints",
        "minillm.runtime.load",
        "minillm.viz.style",
    )
    return sorted((m for m in found if m not in everywhere and not m.startswith("minillm.book.")), key=_layer_order)


LAYER_ORDER = ("core", "kv", "decoding", "serving", "compression", "parallel", "measure", "training", "viz", "bench")


def _layer_order(module: str) -> tuple[int, str]:
    """Techniques first, then measures, pictures and benchmarks; kernels last."""
    parts = module.split(".")
    layer = parts[1] if len(parts) > 1 else ""
    if layer == "kernels":
        return len(LAYER_ORDER) + 1, module
    return (LAYER_ORDER.index(layer) if layer in LAYER_ORDER else len(LAYER_ORDER)), module


def module_path(module: str) -> str:
    """``minillm.core.generate`` -> ``minillm/core/generate.py`` (a package -> its __init__.py)."""
    base = module.replace(".", "/")
    root = Path(__file__).resolve().parents[2]
    return f"{base}/__init__.py" if (root / base).is_dir() else f"{base}.py"


def code_box(modules: list[str], repo: str, branch: str) -> str:
    """A one-line admonition naming ``modules`` (no leading ``minillm/``), each linked to its source."""
    links = []
    for module in modules:
        path = module_path(module)
        links.append(f"[`{path.removeprefix('minillm/')}`](https://github.com/{repo}/blob/{branch}/{path})")
    return f"{BOX_START}\n:class: tip\n{' · '.join(links)}\n:::"


def sync_code_box(nb: dict, repo: str, branch: str) -> dict:
    """The notebook with its first markdown cell ending in the code box of what it imports."""
    nb = copy.deepcopy(nb)
    first = next(c for c in nb["cells"] if c["cell_type"] == "markdown")
    text = BOX.sub("", cell_source(first)).rstrip("\n")
    modules = chapter_modules(nb)
    first["source"] = f"{text}\n\n{code_box(modules, repo, branch)}" if modules else text
    return nb


def sync_repository_links(root: Path = Path(".")) -> list[Path]:
    """Rewrite chapters/ and solutions/ so every link uses _config.yml's repository; return the changed."""
    repo, branch = repository(root / "_config.yml")
    changed = []
    for folder, badge_folder in (("chapters", "chapters"), ("solutions", "exercises")):
        for path in sorted((root / folder).glob("*.ipynb")):
            nb = read_notebook(path)
            synced = sync_links(nb, f"{badge_folder}/{path.name}", repo, branch)
            if folder == "chapters":
                synced = sync_code_box(synced, repo, branch)
            if dump_notebook(synced) != dump_notebook(nb):
                path.write_text(dump_notebook(synced), encoding="utf-8")
                changed.append(path)
    return changed


# ---------------------------------------------------------------------------------------------
# Publishing: the book points at the repository it was built from

PLACEHOLDER = "YOUR-ORG/minillm"
CLONE = re.compile(r"^git clone \S+", re.M)
CONFIG_URL = re.compile(r"^(  url: )https://github\.com/\S+", re.M)
CONFIG_BRANCH = re.compile(r"^(  branch: )\S+", re.M)


def check_repository(repo: str, branch: str) -> None:
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9-]{0,38}/[A-Za-z0-9._-]{1,100}", repo or ""):
        raise ValueError(f"a repository is 'owner/name', got {repo!r}")
    if not re.fullmatch(r"[A-Za-z0-9._/-]{1,200}", branch or "") or ".." in branch:
        raise ValueError(f"not a branch name: {branch!r}")


def point_book_at(root: Path, repo: str, branch: str) -> list[Path]:
    """Rewrite the book to point at ``repo`` (owner/name) and ``branch``: _config.yml's repository,
    every chapter's and solution's Colab badge, install cell and code box, and how_to_run's clone
    line. The publishing workflow runs this with its own repository; returns the changed files."""
    check_repository(repo, branch)
    changed = []
    config = root / "_config.yml"
    text = config.read_text()
    new = CONFIG_BRANCH.sub(rf"\g<1>{branch}", CONFIG_URL.sub(rf"\g<1>https://github.com/{repo}", text))
    if new != text:
        config.write_text(new)
        changed.append(config)
    guide = root / "book" / "how_to_run.md"
    if guide.is_file():
        text = guide.read_text()
        new = CLONE.sub(f"git clone https://github.com/{repo}.git", text)
        if new != text:
            guide.write_text(new)
            changed.append(guide)
    return changed + sync_repository_links(root)


def placeholder_warning(root: Path = Path(".")) -> str | None:
    """One line for ``make book`` when the links still name the placeholder repository."""
    repo, _ = repository(root / "_config.yml")
    if repo == PLACEHOLDER:
        return (
            f"note: the notebooks name the placeholder {PLACEHOLDER}; this build takes the repository from "
            "MINILLM_REPOSITORY, GITHUB_REPOSITORY or a GitHub origin remote, and without one leaves the "
            "Colab badges and source links off the pages (minillm/book/pages.py)"
        )
    return None


if __name__ == "__main__":  # python -m minillm.book.links --repo owner/name --branch book | --check
    import argparse

    parser = argparse.ArgumentParser(prog="python -m minillm.book.links", description=point_book_at.__doc__)
    parser.add_argument("--repo", help="owner/name to point the book at")
    parser.add_argument("--branch", default="main", help="the branch the badges open (default: main)")
    parser.add_argument("--check", action="store_true", help="only say whether the links name the placeholder")
    args = parser.parse_args()
    if args.check or not args.repo:
        repo, branch = repository(Path("_config.yml"))
        print(placeholder_warning() or f"the book's links point at {repo} (branch {branch})")
    else:
        for path in point_book_at(Path("."), args.repo, args.branch):
            print(f"pointed {path} at {args.repo}@{args.branch}")
