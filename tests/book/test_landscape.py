"""The framework landscape: every cell present and sourced, every key in the bibliography, every
chapter real, the text table within the page, and the online-vs-batch cost from chapter 2's formula."""

import re
from pathlib import Path

import pytest

from minillm.book import frameworks
from minillm.book import landscape as ls

ROOT = Path(__file__).resolve().parents[2]
BIB_KEY = re.compile(r"^@\w+\{([^,\s]+),", re.MULTILINE)


def bib_keys() -> set[str]:
    return set(BIB_KEY.findall((ROOT / "book" / "references.bib").read_text()))


def test_every_cited_key_is_in_the_bibliography():
    missing = ls.cited_keys() - bib_keys()
    assert not missing, f"keys cited but not in book/references.bib: {sorted(missing)}"


def test_markdown_citations_are_bibliography_keys():
    text = "\n".join([ls.landscape_markdown(), ls.pick_guide_markdown(), ls.batch_api_markdown()])
    used = {key for group in re.findall(r"\{cite\}`([^`]+)`", text) for key in group.split(",")}
    assert used and used <= bib_keys()
    assert used == ls.cited_keys()


def test_every_feature_framework_pair_has_a_cell():
    pairs = {(f.key, fw.name) for f in frameworks.FEATURES for fw in frameworks.FRAMEWORKS}
    assert set(frameworks.SUPPORT) == pairs
    assert len(frameworks.FRAMEWORKS) == 6 and len({f.key for f in frameworks.FEATURES}) == len(frameworks.FEATURES)


def test_facts_carry_sources_and_gaps_say_so():
    for (feature, name), cell in frameworks.SUPPORT.items():
        assert cell.cites or cell.value == frameworks.NOT_DOCUMENTED, (feature, name, cell)
    with pytest.raises(ValueError, match="cites no source"):
        frameworks.Cell("yes")


def test_chapters_named_exist_as_notebooks():
    for chapter in ls.chapters_named():
        assert 1 <= chapter <= 15
        assert list((ROOT / "chapters").glob(f"{chapter:02d}_*.ipynb")), f"no notebook for chapter {chapter}"


def test_landscape_table_fits_the_page_and_shows_every_cell():
    text = ls.landscape_table()
    assert max(len(line) for line in text.splitlines()) <= 88
    for f in frameworks.FEATURES:
        assert text.count(f"{f.short} (ch.{f.chapter})") == 2  # once in each half
    for fw in frameworks.FRAMEWORKS:
        assert fw.name in text


def test_markdown_table_has_a_row_per_feature_with_its_chapter():
    lines = ls.landscape_markdown().splitlines()
    assert len(lines) == 2 + len(frameworks.FEATURES)
    for f, line in zip(frameworks.FEATURES, lines[2:]):
        assert line.count("|") - line.count("\\|") == len(frameworks.FRAMEWORKS) + 3
        assert f"| ch. {f.chapter} |" in line


def test_status_facts_are_recorded():
    assert "maintenance mode" in frameworks.framework("TGI").summary
    assert "llama.cpp" in frameworks.framework("Ollama").kind
    with pytest.raises(ValueError, match="unknown framework"):
        frameworks.framework("nope")


def test_online_vs_batch_cost_matches_the_formula():
    out = ls.online_vs_batch_cost(3.6, 500.0, 2000.0)
    online = 3.6 / (500.0 * 3600) * 1e6  # $ per hour / tokens per hour, per million
    batch = 3.6 / (2000.0 * 3600) * 1e6
    assert out["online_cost_per_m"] == pytest.approx(online) == pytest.approx(2.0)
    assert out["batch_cost_per_m"] == pytest.approx(batch) == pytest.approx(0.5)
    assert out["batch_to_online"] == pytest.approx(0.25)
    assert out["discount"] == pytest.approx(0.75)


@pytest.mark.parametrize("args", [(0, 1, 1), (1, 0, 1), (1, 1, -2), (-1, 1, 1)])
def test_online_vs_batch_cost_rejects_non_positive_inputs(args):
    with pytest.raises(ValueError, match="must be positive"):
        ls.online_vs_batch_cost(*args)


def test_batch_apis_publish_a_price_ratio_and_turnaround():
    assert {api.provider for api in ls.BATCH_APIS} >= {"OpenAI", "Anthropic", "Google"}
    for api in ls.BATCH_APIS:
        assert 0 < api.price_ratio < 1 and api.turnaround and api.cites


def test_command_line_flags_are_code_in_the_markdown_table():
    """A flag outside a code span would have its -- turned into an en dash on the page."""
    md = ls.landscape_markdown()
    assert "`--tp`" in md and "`--cache-prompt`" in md
    outside_code = re.sub(r"`[^`]*`", "", md)
    assert not re.search(r"--[a-z]", outside_code)
