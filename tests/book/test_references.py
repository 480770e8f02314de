"""Every citation label on a page names one source: entries that share a first author and a year
carry the year's letter (2026a, 2026b), as author-year styles do."""

import re
from collections import Counter
from pathlib import Path

BIB = Path(__file__).resolve().parents[2] / "book" / "references.bib"
ENTRY = re.compile(r"@\w+\{([^,]+),(.*?)\n\}", re.S)


def label(body: str) -> tuple[str, str]:
    author = re.search(r"author\s*=\s*\{(.+?)\},?\n", body)
    year = re.search(r"year\s*=\s*\{?(\w+)\}?", body)
    first = (author.group(1) if author else "").split(" and ")[0].split(",")[0].strip("{} ")
    return first, year.group(1) if year else ""


def test_no_two_entries_share_an_author_year_label():
    labels = Counter(label(body) for _, body in ENTRY.findall(BIB.read_text()))
    assert len(labels) > 50
    shared = {k: n for k, n in labels.items() if n > 1}
    assert not shared, f"give these years letters (2026a, 2026b, ...): {shared}"
