"""A Sphinx extension that keeps the placeholder repository off every page.

The committed notebooks and _config.yml name ``YOUR-ORG/minillm`` until the publishing workflow
points them at its own repository (``python -m minillm.book.links --repo``). A local build
resolves the repository itself: ``MINILLM_REPOSITORY`` (owner/name), then the CI's
``GITHUB_REPOSITORY``, then a GitHub ``origin`` remote. Known, every link names it; unknown, the
pages carry no badge, no repository button and no dead link: the install cell shows the one line
that installs from a clone, and source links become plain file names.

It also takes the ``%%needs triton`` guard line off the code cells it shows.

Loaded from _config.yml (``sphinx.extra_extensions``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

from .links import BADGE, PLACEHOLDER, check_repository
from .nbfiles import cell_source, split_needs

GITHUB_REMOTE = re.compile(r"github\.com[:/]([A-Za-z0-9-]+/[A-Za-z0-9._-]+?)(?:\.git)?/?$")
PLACEHOLDER_URL = f"https://github.com/{PLACEHOLDER}"
LINK = re.compile(rf"\[([^\]]+)\]\({re.escape(PLACEHOLDER_URL)}[^)\s]*\)")
INSTALL_LINE = re.compile(rf"^(\s*)%pip install[^\n]*{re.escape(PLACEHOLDER)}[^\n]*$", re.M)
FROM_A_CLONE = 'pass  # no public repository is known to this build: from a clone, pip install -e ".[book]"'
CLONE_LINES = re.compile(rf"^git clone {re.escape(PLACEHOLDER_URL)}\S*\n(?:cd \S+\n)?", re.M)
IN_A_COPY = "# in your copy of the repository (this build knows no public one):\n"


def resolve_repository(root: Path = Path(".")) -> str | None:
    """owner/name of the repository this book comes from, or None when nothing names one."""
    for name in ("MINILLM_REPOSITORY", "GITHUB_REPOSITORY"):
        repo = os.environ.get(name, "").strip()
        if repo and repo != PLACEHOLDER:
            check_repository(repo, "main")
            return repo
    try:
        url = subprocess.run(
            ["git", "-C", str(root), "remote", "get-url", "origin"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = GITHUB_REMOTE.search(url)
    return match.group(1) if match else None


def resolve_text(text: str, repo: str | None) -> str:
    """Markdown or code with the placeholder resolved: renamed to ``repo``, or, with none, the
    badge dropped, links to the placeholder turned into their text, the install line replaced
    by a clone's and the clone commands by a pointer to the reader's copy."""
    if repo is not None:
        return text.replace(PLACEHOLDER, repo)
    text = BADGE.sub("", text).lstrip("\n") if BADGE.search(text) else text
    text = CLONE_LINES.sub(IN_A_COPY, LINK.sub(r"\1", text))
    return INSTALL_LINE.sub(lambda m: m.group(1) + FROM_A_CLONE, text)


def _rewrite_cells(source: str, rewrite, code_only: bool = False) -> str:
    """A notebook's JSON with ``rewrite`` applied to the source of each cell (or code cell)."""
    nb = json.loads(source)
    for cell in nb.get("cells", []):
        if not code_only or cell.get("cell_type") == "code":
            cell["source"] = rewrite(cell_source(cell))
    return json.dumps(nb, ensure_ascii=False, indent=1)


def resolve_notebook(source: str, repo: str | None) -> str:
    """A notebook's JSON with every cell's source resolved."""
    return _rewrite_cells(source, lambda text: resolve_text(text, repo))


def without_needs(source: str) -> str:
    """A notebook's JSON with the ``%%needs triton`` guard line taken off its code cells: the
    page shows the code the cell ran (a run without the module prints a 'Skipped' line instead)."""
    return _rewrite_cells(source, lambda text: split_needs(text)[1] if "%%needs" in text else text, code_only=True)


def _on_source_read(app, docname: str, content: list[str]) -> None:
    notebook = str(app.env.doc2path(docname)).endswith(".ipynb")
    if notebook and "%%needs" in content[0]:
        content[0] = without_needs(content[0])
    if PLACEHOLDER not in content[0]:
        return
    repo = app.config.minillm_repository or None
    content[0] = resolve_notebook(content[0], repo) if notebook else resolve_text(content[0], repo)


def _on_config_inited(app, config) -> None:
    repo = resolve_repository(Path(app.srcdir))
    config.minillm_repository = repo or ""
    options = dict(config.html_theme_options or {})
    if PLACEHOLDER not in str(options.get("repository_url", "")):
        return
    if repo is not None:
        options["repository_url"] = f"https://github.com/{repo}"
    else:  # no button, no launch link to a repository that does not exist
        options.update(repository_url="", use_repository_button=False, use_issues_button=False)
        options.update(use_edit_page_button=False, use_download_button=True, launch_buttons={})
    config.html_theme_options = options
    if "html_context" in config and isinstance(config.html_context, dict):
        config.html_context.pop("github_user", None)


def _on_build_finished(app, exception) -> None:
    """The notebooks and Markdown the page offers for download (``_sources``) resolved alike."""
    if exception is not None:
        return
    repo = app.config.minillm_repository or None
    for path in Path(app.outdir, "_sources").rglob("*"):
        if not path.is_file() or path.suffix not in {".ipynb", ".md", ".txt"}:
            continue
        text = path.read_text(encoding="utf-8")
        if PLACEHOLDER in text:
            resolve = resolve_notebook if path.suffix == ".ipynb" else resolve_text
            path.write_text(resolve(text, repo), encoding="utf-8")


def setup(app):
    app.add_config_value("minillm_repository", "", "env")
    app.connect("config-inited", _on_config_inited)
    app.connect("source-read", _on_source_read)
    app.connect("build-finished", _on_build_finished)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
