"""The Chinese terms of the glossary render everywhere: the book serves a web font holding just
the CJK characters its pages use, cut from Noto Sans CJK SC (SIL Open Font License 1.1), so a
reader without a CJK font sees the characters, not empty boxes.

Regenerate after adding Chinese text to a page (needs ``fonttools`` and ``brotli``, and the full
font, e.g. Debian's ``fonts-noto-cjk``):

    python -m minillm.book.cjk /usr/share/fonts/opentype/noto/NotoSansCJK-Regular.ttc
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FONT = ROOT / "book" / "_static" / "cjk" / "noto-sans-sc-subset.woff2"
CJK = re.compile(r"[\u2e80-\u9fff\uf900-\ufaff\uff00-\uffef\u3000-\u303f]")


def pages(root: Path = ROOT) -> list[Path]:
    """Every source of a page: the book's Markdown and the notebooks."""
    found = sorted((root / "book").glob("*.md"))
    for folder in ("chapters", "exercises", "solutions"):
        found += sorted((root / folder).glob("*.ipynb"))
    return found


def characters(root: Path = ROOT) -> set[str]:
    """The CJK characters the pages use."""
    return {c for p in pages(root) for c in CJK.findall(p.read_text(encoding="utf-8"))}


def covered(font: Path = FONT) -> set[str]:
    """The characters ``font`` has glyphs for."""
    from fontTools.ttLib import TTFont

    return {chr(code) for code in TTFont(str(font)).getBestCmap()}


def write_subset(source: Path, out: Path = FONT, root: Path = ROOT) -> int:
    """Cut ``source`` (a .ttf/.otf or the first Simplified Chinese face of a .ttc) down to the
    characters the pages use; the number of characters written."""
    from fontTools import subset
    from fontTools.ttLib import TTCollection, TTFont

    if source.suffix.lower() == ".ttc":
        faces = TTCollection(str(source)).fonts
        font = next((f for f in faces if "SC" in f["name"].getDebugName(1)), faces[0])
    else:
        font = TTFont(str(source))
    chars = characters(root)
    options = subset.Options()
    options.flavor = "woff2"
    options.layout_features = ["*"]
    subsetter = subset.Subsetter(options)
    subsetter.populate(unicodes=[ord(c) for c in chars])
    subsetter.subset(font)
    out.parent.mkdir(parents=True, exist_ok=True)
    font.flavor = "woff2"
    font.save(str(out))
    return len(chars)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m minillm.book.cjk PATH/TO/NotoSansCJK-Regular.ttc")
    print(f"{FONT}: {write_subset(Path(sys.argv[1]))} characters")
