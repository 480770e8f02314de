"""The book in one table (book.headlines): one row per chapter, each headline read from the saved
run it names (its figures recomputed here), a chapter without a saving benchmark says so, and an
empty store gives 'no saved run' rows rather than an exception."""

import json
from pathlib import Path

from minillm.book.headlines import HEADLINES, ON_THE_PAGE, headline_rows, headlines_markdown
from minillm.measure.report import RESULTS_DIR

ROOT = Path(__file__).resolve().parents[2]


def test_one_row_per_chapter_each_written():
    rows = headline_rows(RESULTS_DIR)
    written = sorted(int(p.name[:2]) for p in (ROOT / "chapters").glob("[0-9][0-9]_*.ipynb"))
    assert [r["chapter"] for r in rows] == written == [h.chapter for h in HEADLINES]
    assert sum(r["source"] != "" for r in rows) >= 12  # the store ships saved runs for most chapters
    md = headlines_markdown(rows).splitlines()
    assert len(md) == len(rows) + 2 and all(line.count("|") == 5 for line in md)


def test_the_capstone_headline_holds_its_saved_ladder():
    row = next(r for r in headline_rows(RESULTS_DIR) if r["chapter"] == 16)
    ladder = json.loads((RESULTS_DIR / row["source"]).read_text())["ladder"]
    base, top = ladder[0]["tokens_per_s"], ladder[-1]["tokens_per_s"]
    cached = next(r for r in ladder if r["step"] == "+ KV cache")["tokens_per_s"]
    assert f"{base:.1f} -> {top:.1f} tok/s" in row["measured"]
    assert f"{top / cached:.2f}x from the KV-cache rung" in row["measured"]


def test_an_empty_store_says_what_to_run(tmp_path):
    for row in headline_rows(tmp_path):
        assert row["source"] == ""
        assert row["measured"] == ON_THE_PAGE or row["measured"].startswith("no saved run: run `python -m minillm")
