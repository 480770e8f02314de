"""Where a decoding loop's time goes, function by function (Python's cProfile).

``profile_breakdown(fn)`` runs ``fn`` once under cProfile and returns, for the functions of the
``minillm`` package it spent the most time in (inclusive of what they call), the calls, the
milliseconds in all and per call, and the share of the whole run. The model's forwards show up
as ``CachedForward.__call__`` (or ``CompiledForward.__call__``); everything beside them is the
loop's own bookkeeping. cProfile adds a little time to every Python call, so the shares are a
map of where the time goes, not a timing: time with ``bench.timing`` and no profiler.
"""

from __future__ import annotations

import cProfile
import pstats
from collections.abc import Callable
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1]  # the minillm folder


def profile_breakdown(
    fn: Callable[[], object], top: int = 8, skip_files: tuple[str, ...] = ("model.py", "attention.py")
) -> list[dict]:
    """Run ``fn`` under cProfile; -> the ``top`` minillm functions by inclusive time, each as a dict
    of function ("file.py:line name"), calls, total_ms, per_call_ms and share (of the whole run).
    Functions in ``skip_files`` (by default the model's insides: a forward is one item here) and
    those that take the whole run (the entry points) are left out."""
    profiler = cProfile.Profile()
    profiler.enable()
    try:
        fn()
    finally:
        profiler.disable()
    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (calls, primitive calls, own, inclusive, callers)
    whole = max(inclusive for _, _, _, inclusive, _ in stats.values())
    rows = []
    for (file, line, name), (calls, _, _, inclusive, _) in stats.items():
        path = Path(file)
        if PACKAGE not in path.parents or path.name in skip_files or inclusive > 0.99 * whole:
            continue
        rows.append(
            {
                "function": f"{path.name}:{line} {name}",
                "calls": calls,
                "total_ms": 1e3 * inclusive,
                "per_call_ms": 1e3 * inclusive / calls,
                "share": inclusive / whole,
            }
        )
    rows.sort(key=lambda r: -r["total_ms"])
    return rows[:top]
