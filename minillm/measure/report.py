"""What every benchmark reports with its figures, and where it keeps them.

- ``provenance``: the one record of where figures came from (hardware, device, threads, the
  machine's load, torch version, dtype, model, date), put into every result dict;
- the results store: ``minillm/results/<hardware>/<name>.json`` (or under ``$MINILLM_RESULTS``),
  written by ``save_result`` and read by ``load_results`` (chapters plot saved runs next to their
  live ones); the command-line benchmarks save to ``user_results()`` ($MINILLM_RESULTS, else
  ./minillm-results), so that a reader's run never overwrites what the book ships;
- ``format_table``: rows of figures as an aligned text table, for the command line and notebooks.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ..core.device import cpu_name, hardware_description

# The results store ships inside the package (package data), so that a reader who installs the
# wheel sees the saved runs the chapters plot; MINILLM_RESULTS points it elsewhere.
RESULTS_DIR = Path(__file__).resolve().parents[1] / "results"
# Characters a line of code or output may take: what the book's code column holds at 1280 px
# (book/_static/page.css; chapters/ruff.toml formats notebook code to it).
PAGE_WIDTH = 88


# ---------------------------------------------------------------------------------------------
# Provenance


def load_average() -> float | None:
    """The machine's 1-minute load average (None where the OS does not report one)."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def provenance(
    device: str | torch.device = "cpu",
    model: str | None = None,
    dtype: torch.dtype | str | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """Where a measurement comes from. ``extra`` adds the benchmark's own settings (batch, repeats...).

    The load average is read now; call ``finish_provenance`` at the end to add it again, since
    other work on a shared machine skews timings and the figures should say how much there was."""
    device = torch.device(device)
    record: dict[str, Any] = {
        "hardware": hardware_description(device),
        "device": str(device),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "load_average_before": load_average(),
    }
    if model is not None:
        record["model"] = model
    if dtype is not None:
        record["dtype"] = str(dtype).removeprefix("torch.")
    record.update(extra)
    return record


def finish_provenance(record: dict[str, Any]) -> dict[str, Any]:
    """The record with the load average at the end of the run added (returns the same dict)."""
    record["load_average_after"] = load_average()
    return record


def describe(record: Mapping[str, Any]) -> str:
    """One line for a table's title: hardware, dtype, model, threads and load, as far as known."""
    parts = [record.get("hardware", "unknown hardware")]
    if record.get("dtype"):
        parts.append(str(record["dtype"]))
    if record.get("model"):
        parts.append(str(record["model"]))
    load = [(record.get(f"load_average_{when}"), when) for when in ("before", "after")]
    if any(x is not None for x, _ in load):  # the machine's 1-minute load average around the run
        parts.append("load average " + ", ".join(f"{x:.2f} {when}" for x, when in load if x is not None))
    return ", ".join(parts)


# ---------------------------------------------------------------------------------------------
# The results store


def hardware_slug(device: str | torch.device = "cpu") -> str:
    """A results folder name: 'NVIDIA H200' -> 'h200'; an Intel Xeon with 2 cores -> 'cpu-xeon-2core'."""
    device = torch.device(device)
    if device.type == "cuda":
        return gpu_slug(torch.cuda.get_device_name(device))
    name = re.sub(r"\((r|tm)\)|\bcpu\b|\bprocessor\b|@.*$|\bintel\b|\bamd\b|\bcore\b", " ", cpu_name().lower())
    words = re.findall(r"[a-z][a-z0-9]*", name)
    return f"{device.type}-{words[0] if words else platform.machine().lower()}-{os.cpu_count() or 1}core"


def gpu_slug(name: str) -> str:
    """'NVIDIA H200' -> 'h200', 'Tesla T4' -> 't4', 'NVIDIA GeForce RTX 4090' -> 'geforce-rtx-4090'."""
    slug = re.sub(r"^((nvidia|tesla)\s+)+", "", name.strip().lower())
    slug = re.sub(r"[^a-z0-9]+", "-", slug).strip("-")
    return slug or "gpu"


def check_name(name: str) -> None:
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", name or "") or name.startswith("."):
        raise ValueError(f"a result's name is a plain file stem such as 'bench_kv', got {name!r}")


def results_root(results_dir: str | Path | None = None) -> Path:
    """The results store: ``results_dir`` if given, else $MINILLM_RESULTS, else the package's."""
    return Path(results_dir or os.environ.get("MINILLM_RESULTS") or RESULTS_DIR)


def user_results() -> Path:
    """Where a command-line benchmark saves: $MINILLM_RESULTS, else ./minillm-results in the
    current directory; never the installed package or its source tree, whose results the
    chapters read (refresh those on purpose: MINILLM_RESULTS=minillm/results python -m minillm bench ...)."""
    return Path(os.environ.get("MINILLM_RESULTS") or Path.cwd() / "minillm-results")


def result_path(name: str, hardware: str, results_dir: str | Path | None = None) -> Path:
    """<results store>/<hardware>/<name>.json."""
    check_name(name)
    check_name(hardware)
    return results_root(results_dir) / hardware / f"{name}.json"


def write_json(path: str | Path, figures: Mapping[str, Any]) -> Path:
    """Figures as indented JSON at ``path`` (folders made as needed)."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(figures, indent=1) + "\n")
    except PermissionError as e:
        raise PermissionError(
            f"cannot write {path}: set MINILLM_RESULTS to a folder you can write (or pass --json PATH)"
        ) from e
    return path


def save_result(
    name: str, figures: Mapping[str, Any], hardware: str | None = None, results_dir: str | Path | None = None
) -> Path:
    """Write ``figures`` to <results store>/<hardware>/<name>.json (hardware: this machine's slug
    by default)."""
    return write_json(result_path(name, hardware or hardware_slug(figures.get("device", "cpu")), results_dir), figures)


def load_results(name: str, results_dir: str | Path | None = None) -> dict[str, dict]:
    """Every saved ``<name>.json``, by hardware folder; empty when none was saved."""
    check_name(name)
    root = results_root(results_dir)
    return {p.parent.name: json.loads(p.read_text()) for p in sorted(root.glob(f"*/{name}.json"))}


# ---------------------------------------------------------------------------------------------
# Tables


def signed_pct(change: float) -> str:
    """A change in percent with its sign, one decimal: "+1.6%", "-0.3%", and "0.0%" for one that
    rounds to nothing (never "-0.0%")."""
    text = f"{change:+.1f}%"
    return "0.0%" if text in ("+0.0%", "-0.0%") else text


def wrap_line(line: str, width: int = PAGE_WIDTH, indent: str = "") -> list[str]:
    """One line of prose broken at spaces to fit ``width`` (continuations after ``indent``)."""
    return textwrap.wrap(line, width, subsequent_indent=indent, break_on_hyphens=False) or [""]


def join_fitting(parts: Sequence[str], sep: str = " | ", width: int = PAGE_WIDTH) -> str:
    """``parts`` joined by ``sep``, starting a new line wherever the next part would run past
    ``width``."""
    lines: list[str] = []
    for part in parts:
        if lines and len(lines[-1]) + len(sep) + len(part) <= width:
            lines[-1] += sep + part
        else:
            lines.append(part)
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if value != value:  # NaN: no figure to give
            return "-"
        return f"{value:,.2f}" if abs(value) < 100 else f"{value:,.1f}"
    return str(value)


def format_table(
    rows: Sequence[Mapping[str, Any]],
    columns: Mapping[str, str] | Sequence[str] | None = None,
    title: str | None = None,
    width: int = PAGE_WIDTH,
    keys: int = 1,
) -> str:
    """Rows of figures as an aligned text table. ``columns`` maps row keys to headers (default:
    every key of the first row); numbers are right-aligned, text left-aligned.

    Nothing is cut, and nothing runs past ``width`` characters as long as the key columns and any
    one other column fit side by side: a table too wide first breaks its headers over up to three
    lines (more, down to a word a line, where three leave a column too wide), then continues its
    remaining columns in a second table (and a third...) that repeats the first ``keys`` columns,
    which name the row. The title wraps."""
    if columns is None:
        columns = list(rows[0]) if rows else []
    headers = dict(columns) if isinstance(columns, Mapping) else {c: c for c in columns}
    names = list(headers.values())
    cells = [[_cell(row.get(key)) for key in headers] for row in rows]
    numeric = [all(isinstance(row.get(key), (int, float)) for row in rows) for key in headers]
    body = [max([0] + [len(r[i]) for r in cells]) for i in range(len(names))]
    keys = min(keys, len(names))

    def widths_of(heads: list[list[str]]) -> list[int]:
        return [max([b] + [len(x) for x in h]) for h, b in zip(heads, body)]

    def too_wide(widths: list[int]) -> bool:  # the key columns and some other column side by side
        return any(_span([*widths[:keys], widths[i]]) > width for i in range(keys, len(names)))

    heads = [[h] for h in names]
    if _span(widths_of(heads)) > width:
        heads = [_wrap_header(h, b) for h, b in zip(names, body)]
        if too_wide(widths_of(heads)):  # more header lines, as many as it takes
            heads = [_wrap_header(h, b, None) for h, b in zip(names, body)]
    widths = widths_of(heads)
    parts, part = [], []
    for i in range(keys, len(names)):
        if part and _span([widths[j] for j in [*range(keys), *part, i]]) > width:
            parts.append(part)
            part = []
        part.append(i)
    parts.append(part)
    out = [piece for line in (title or "").splitlines() for piece in wrap_line(line, width)]
    for n, part in enumerate(parts):
        shown = [*range(keys), *part]
        if n:
            out.append("")
        out += _table_lines(
            [heads[i] for i in shown],
            [[r[i] for i in shown] for r in cells],
            [widths[i] for i in shown],
            [numeric[i] for i in shown],
        )
    return "\n".join(out)


def _span(widths: Sequence[int]) -> int:
    return sum(widths) + 2 * max(len(widths) - 1, 0)


def _wrap_header(header: str, body_width: int, most: int | None = 3) -> list[str]:
    """A header over as few lines as fit the column's own width, at most ``most`` lines (None:
    as many as it takes, a word a line at the narrowest)."""
    longest_word = max((len(w) for w in header.split()), default=0)
    for w in range(max(body_width, longest_word, 1), len(header) + 1):
        lines = textwrap.wrap(header, w, break_on_hyphens=False) or [""]
        if most is None or len(lines) <= most:
            return lines
    return [header]


def _table_lines(
    heads: Sequence[list[str]], cells: Sequence[Sequence[str]], widths: Sequence[int], numeric: Sequence[bool]
) -> list[str]:
    def line(values: Sequence[str]) -> str:
        parts = [v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)]
        return "  ".join(parts).rstrip()

    depth = max(len(h) for h in heads)
    # a wrapped header sits on the rule, its last line right above it
    head_rows = [[""] * (depth - len(h)) + list(h) for h in heads]
    out = [line([h[k] for h in head_rows]) for k in range(depth)]
    out.append(line(["-" * w for w in widths]))
    out += [line(r) for r in cells]
    return out
