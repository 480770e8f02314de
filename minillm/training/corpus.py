"""The bundled training corpus: text that ships with Python itself, under the PSF license.

Two kinds of document: the English reference documentation that ``pydoc`` serves
(``pydoc_data.topics``: the language reference, statement by statement) and the source of the
standard library's top-level modules (Python code with its docstrings and comments). It was
made once with ``python -m minillm corpus`` and is committed, gzipped, under
``minillm/data/pystdlib``, so nothing is downloaded, and it does not change with the Python
version of whoever trains.

Documents are joined with the end-of-text token; every 20th document is held out for validation.
Prompts of real text for benchmarks and chapters come from here too: ``corpus_prompt`` (the
first tokens of a split) and ``corpus_prompts`` (several, spread over a split or at random places).
"""

from __future__ import annotations

import gzip
import json
import platform
import sysconfig
from functools import cache
from pathlib import Path
from pydoc_data.topics import topics

import torch

from ..core.tokenizer import Tokenizer

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


# ---------------------------------------------------------------------------------------------
# Prompts of real text


def tokens_at(tokenizer: Tokenizer, text: str, start: int, length: int, skip: int = 0, chars: int = 8) -> list[int]:
    """Up to ``length`` tokens of ``text`` from character ``start`` on, the first ``skip`` dropped:
    ``chars`` characters per token wanted are encoded, doubled until there are enough or no more text."""
    n_chars = chars * length
    ids = tokenizer.encode(text[start : start + n_chars])
    while len(ids) < skip + length and start + n_chars < len(text):
        n_chars *= 2
        ids = tokenizer.encode(text[start : start + n_chars])
    return ids[skip : skip + length]


def corpus_prompt(tokenizer: Tokenizer, length: int, split: str = "valid") -> list[int]:
    """The first ``length`` tokens of the corpus' ``split`` (validation by default): real text, not random ids."""
    if length < 1:
        raise ValueError(f"prompt length must be positive, got {length}")
    ids = tokens_at(tokenizer, load_text(split), 0, length)
    if len(ids) < length:
        raise ValueError(f"the {split} text is only {len(ids)} tokens long; asked for a {length}-token prompt")
    return ids


def corpus_prompts(
    tokenizer: Tokenizer, n: int, length: int, split: str = "valid", placement: str = "spread", seed: int = 0
) -> list[list[int]]:
    """``n`` prompts of real text from the corpus' ``split``:

    - ``placement="spread"``: starting at evenly spaced places of the split (the first at its start),
      each of at most ``length`` tokens, cut back so that none ends in a newline (the tokenizer would
      then split a continuation differently);
    - ``placement="random"``: windows of exactly ``length`` tokens at random places (``seed``), the
      first token of each dropped (a random place usually cuts a word).
    """
    if n < 1 or length < 1:
        raise ValueError(f"n and length must be positive, got {n} and {length}")
    text = load_text(split)
    if placement == "spread":
        prompts = [tokens_at(tokenizer, text, i * len(text) // n, length) for i in range(n)]
        for ids in prompts:
            while len(ids) > 1 and tokenizer.decode(ids[-1:]).endswith("\n"):
                ids.pop()
        return prompts
    if placement == "random":
        gen = torch.Generator().manual_seed(seed)
        starts = torch.randint(0, len(text) - 16 * length, (n,), generator=gen).tolist()
        return [tokens_at(tokenizer, text, s, length, skip=1, chars=16) for s in starts]
    raise ValueError(f"placement must be 'spread' or 'random', got {placement!r}")
