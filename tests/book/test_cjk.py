"""The web font the book serves holds every CJK character its pages use (``minillm.book.cjk``)."""

from minillm.book import cjk


def test_the_pages_use_chinese_and_the_font_has_every_character():
    used = cjk.characters()
    assert len(used) > 100  # the glossary's Chinese column
    missing = used - cjk.covered()
    assert not missing, f"regenerate the font (python -m minillm.book.cjk ...): it lacks {''.join(sorted(missing))}"


def test_the_page_style_loads_the_font_for_cjk_code_points_only():
    css = (cjk.ROOT / "book" / "_static" / "page.css").read_text()
    assert f'url("cjk/{cjk.FONT.name}")' in css and "unicode-range: U+2E80-9FFF" in css
    assert (cjk.FONT.parent / "LICENSE.txt").read_text().count("SIL OPEN FONT LICENSE Version 1.1") == 1
