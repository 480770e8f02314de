"""Ending child processes within a bound: what every multi-process part of minillm (the
disaggregated workers, the ranks of a parallel run) does on its way out."""

from __future__ import annotations

import time
from collections.abc import Sequence


def reap(procs: Sequence, wait_s: float) -> None:
    """Join ``procs`` (multiprocessing processes) for up to ``wait_s`` seconds in all, then
    terminate, then kill, whatever is still alive; two seconds at most for each of those."""
    deadline = time.monotonic() + wait_s
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
            proc.join(2.0)
        if proc.is_alive():
            proc.kill()
            proc.join(2.0)
