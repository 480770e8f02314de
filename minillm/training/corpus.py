"""The bundled training corpus: text that ships with Python itself, under the PSF license.

Two kinds of document: the English reference documentation that ``pydoc`` serves
(``pydoc_data.topics``: the language reference, statement by statement) and the source of the
standard library's top-level modules (Python code with its docstrings and comments). It was
made once with ``python -m minillm corpus`` and is committed, gzipped, under
``minillm/data/pystdlib``, so nothing is downloaded, and it does not change with the Python
version of whoever trains.

Documents are joined with the end-of-text token; every 20th document is held out for validation.
"""

from __future__ import annotations

import gzip
import json
import platform
import sysconfig
from functools import cache
from pathlib import Path
from pydoc_data.topics import topics

DATA_DIR = Path(__file__).resolve().parents[1] / "data" / "pystdlib"
EOT = "<|endoftext|>"
VALID_EVERY = 20
# Modules that are mostly data tables or generated code, not prose or idiomatic code.
EXCLUDE = {
    "locale.py",
    "__hello__.py",
    "this.py",
    "antigravity.py",
    "_pydecimal.py",
    "_sysconfigdata.py",
    "pydoc_data.py",
    "_compat_pickle.py",
    "sre_constants.py",
    "token.py",
    "keyword.py",
}


def stdlib_documents() -> list[tuple[str, str]]:
    """(name, text) for every document of the corpus, read from the running Python."""
    docs = [(f"pydoc:{name}", text.strip() + "\n") for name, text in sorted(topics.items())]
    lib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(lib.glob("*.py")):
        if path.name in EXCLUDE or path.name.startswith("_sysconfigdata"):
            continue
        docs.append((f"Lib/{path.name}", path.read_text(encoding="utf-8")))
    return docs


def build_corpus(out_dir: Path = DATA_DIR) -> dict:
    """Write train.txt.gz, valid.txt.gz and manifest.json; return the manifest."""
    docs = stdlib_documents()
    splits: dict[str, list[tuple[str, str]]] = {"train": [], "valid": []}
    for i, doc in enumerate(docs):
        splits["valid" if i % VALID_EVERY == VALID_EVERY - 1 else "train"].append(doc)
    out_dir.mkdir(parents=True, exist_ok=True)
    manifest = {"python": platform.python_version(), "license": "PSF-2.0", "splits": {}}
    for split, items in splits.items():
        text = EOT.join(t for _, t in items)
        # mtime=0 keeps the gzip bytes reproducible.
        with gzip.GzipFile(out_dir / f"{split}.txt.gz", "wb", mtime=0) as f:
            f.write(text.encode("utf-8"))
        manifest["splits"][split] = {"documents": [n for n, _ in items], "characters": len(text)}
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


@cache
def load_text(split: str = "train") -> str:
    """The committed corpus text of one split ("train" or "valid"), documents joined by EOT."""
    if split not in ("train", "valid"):
        raise ValueError(f"split must be 'train' or 'valid', got {split!r}")
    with gzip.open(DATA_DIR / f"{split}.txt.gz", "rt", encoding="utf-8") as f:
        return f.read()


def documents(split: str = "train") -> list[str]:
    return load_text(split).split(EOT)
