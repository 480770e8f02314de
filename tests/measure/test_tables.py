"""Tables fit the page: nothing past the width, nothing cut, the row names repeated."""

from hypothesis import given, settings
from hypothesis import strategies as st

from minillm.measure.report import PAGE_WIDTH, format_table, signed_pct

WIDE = [
    {"policy": p, "rate": r, **{f"c{i}": 1000.5 * i + r for i in range(12)}}
    for p in ("continuous", "static")
    for r in (0.5, 7.25)
]
HEADERS = {"policy": "policy", "rate": "req/s offered", **{f"c{i}": f"TTFT p{i} ms" for i in range(12)}}


def test_a_narrow_table_is_one_block_with_one_header_line():
    text = format_table([{"name": "a", "x": 1.5}], title="T")
    assert text.splitlines() == ["T", "name     x", "----  ----", "a     1.50"]


def test_a_wide_table_fits_the_page_and_keeps_every_cell():
    text = format_table(WIDE, HEADERS, title="a title " * 20, keys=2)
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= PAGE_WIDTH
    blocks = text.split("\n\n")
    assert len(blocks) > 1, "twelve wide columns cannot fit one block"
    for row in WIDE:
        for key, value in row.items():
            shown = value if isinstance(value, str) else f"{value:,.1f}" if abs(value) >= 100 else f"{value:,.2f}"
            assert shown in text, (key, shown)
    for block in blocks:  # every block names its rows: the two key columns repeat
        rows = [line for line in block.splitlines() if line.startswith(("continuous", "static"))]
        assert [r.split()[:2] for r in rows] == [
            ["continuous", "0.50"],
            ["continuous", "7.25"],
            ["static", "0.50"],
            ["static", "7.25"],
        ]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.lists(st.text("abcdefgh", min_size=1, max_size=12), min_size=1, max_size=4).map(" ".join),
        min_size=1,
        max_size=9,
    ),
    st.lists(st.floats(-1e7, 1e7, allow_nan=False), min_size=1, max_size=9),
    st.integers(40, 120),
)
def test_no_line_runs_past_the_width(headers, values, width):
    """Whenever the key column and any one other column fit side by side (here: words of at most
    12 letters, numbers of at most 13 characters, 40 columns or more)."""
    columns = {f"k{i}": h for i, h in enumerate(headers)}
    rows = [{f"k{i}": values[i % len(values)] for i in range(len(headers))}]
    text = format_table(rows, columns, width=width)
    assert all(len(line) <= width for line in text.splitlines()), text


def test_a_missing_float_prints_as_a_dash_not_nan():
    from minillm.measure.report import format_table

    table = format_table([{"method": "greedy", "ms": float("nan")}, {"method": "draft", "ms": 1.5}])
    assert "nan" not in table and table.splitlines()[2].split() == ["greedy", "-"]


def test_a_change_that_rounds_to_nothing_has_no_sign():
    assert [signed_pct(x) for x in (1.64, -0.26, -0.04, 0.04, 0.0)] == ["+1.6%", "-0.3%", "0.0%", "0.0%", "0.0%"]
