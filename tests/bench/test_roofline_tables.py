"""Chapter 3's tables: three significant digits, headers in words, a dash for a missing figure."""

import math

from minillm.bench.roofline import format_chooser, format_datasheets, format_phases, sig3
from minillm.measure.report import format_table
from minillm.measure.roofline import accelerator_chooser


def test_sig3_shows_three_digits_and_whole_numbers_from_100():
    shown = [format(sig3(x), ",.2f") for x in (0.32, 4.8, 16.06, 203.1, 1117.1, 0.0164, 0.0, -0.0)]
    assert shown == ["0.320", "4.80", "16.1", "203", "1,117", "0.0164", "0", "0"]
    assert f"{sig3(1265.9):>7}" == "  1,266"
    assert sig3(2.5) * 2 == 5.0  # still a number
    assert math.isnan(sig3(None))


def test_a_missing_figure_is_a_dash_aligned_with_its_column():
    lines = format_table([{"x": sig3(12.345)}, {"x": sig3(None)}]).splitlines()
    assert lines[-2:] == ["12.3", "   -"]


def test_datasheet_and_chooser_tables_have_headers_in_words():
    sheets = format_datasheets(title="t")
    assert "None" not in sheets and "_" not in sheets and "ridge (FLOP/byte)" in sheets
    assert " 203" in sheets and "203.1" not in sheets
    rows = accelerator_chooser(8.03e9, 2, {"T4": 0.35, "H100-SXM": 3.0})
    chooser = format_chooser(rows, title="t")
    assert "None" not in chooser and "_" not in chooser and "nan" not in chooser
    assert "$/1M tokens" in chooser and "16.1" in chooser and "16.06" not in chooser
    t4 = next(line for line in chooser.splitlines() if line.startswith("T4"))
    assert t4.split()[1:3] == ["16.1", "no"] and "-" in t4
    assert all(len(line) <= 88 for line in sheets.splitlines() + chooser.splitlines())


def test_format_phases_keeps_its_columns():
    row = {
        "phase": "decode",
        "batch": 4,
        "seconds": 0.00285,
        "tokens_per_s": 1403.5,
        "intensity": 1.77,
        "flops_per_s": 1.71e10,
        "bytes_per_s": 9.66e9,
        "mfu": 0.0871,
        "mbu": 0.68,
    }
    lines = format_phases([row], title="t").splitlines()
    assert lines[1].split() == [
        "phase",
        "batch",
        "ms",
        "tokens/s",
        "FLOP/byte",
        "GFLOP/s",
        "GB/s",
        "MFU",
        "%",
        "MBU",
        "%",
    ]
    assert lines[-1].split() == ["decode", "4", "2.85", "1,404", "1.77", "17.1", "9.66", "8.71", "68.0"]
