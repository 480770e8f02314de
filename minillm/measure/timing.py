"""The one timing harness every benchmark and chapter uses.

A measurement here is: warm-up calls first (caches, allocators, kernel selection and compilation
stay out of the figures), then timed repeats with the device synchronized around each call (a GPU
runs asynchronously: without a sync a timer measures only the launch). Contenders compared with
each other take turns within each repeat, the order alternating, so that drift on a shared
machine (a background job, thermal throttling) hits all of them alike. Each contender keeps every
time, so a caller reports the median (the typical run) or the fastest (on a busy machine other
work only ever adds time).

    timings = interleaved({"cache": run_cached, "recompute": run_recomputed}, repeats=5)
    speedup = timings["recompute"].median / timings["cache"].median
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm.auto import tqdm

from ..core.device import synchronize


@dataclass
class Timing:
    """The timed repeats of one contender: seconds of each call and what each call returned."""

    seconds: list[float] = field(default_factory=list)
    values: list[Any] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def fastest(self) -> float:
        return min(self.seconds)

    @property
    def median_ms(self) -> float:
        return 1e3 * self.median

    @property
    def fastest_ms(self) -> float:
        return 1e3 * self.fastest


def check_repeats(repeats: int, warmup: int = 0) -> None:
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be a positive integer, got {repeats!r}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be a non-negative integer, got {warmup!r}")


def as_device(device: str | torch.device | None) -> torch.device:
    return torch.device(device) if device is not None else torch.device("cpu")


@contextmanager
def stopwatch(device: str | torch.device | None = None) -> Iterator[list[float]]:
    """``with stopwatch(device) as elapsed: ...`` then ``elapsed[0]`` is the seconds the block took,
    the device synchronized before and after."""
    dev = as_device(device)
    out: list[float] = []
    synchronize(dev)
    t0 = time.perf_counter()
    try:
        yield out
    finally:
        synchronize(dev)
        out.append(time.perf_counter() - t0)


def timed(fn: Callable[[], Any], device: str | torch.device | None = None) -> tuple[float, Any]:
    """Seconds of one call of ``fn`` (device synchronized around it), and what it returned."""
    with stopwatch(device) as elapsed:
        value = fn()
    return elapsed[0], value


def interleaved(
    contenders: Mapping[str, Callable[[], Any]],
    repeats: int = 5,
    device: str | torch.device | None = None,
    warmup: int = 1,
    after: Callable[[str], None] | None = None,
    progress: str | None = None,
) -> dict[str, Timing]:
    """Time each contender ``repeats`` times, taking turns (order reversed every other repeat),
    after ``warmup`` untimed rounds. ``after(name)`` runs outside the timed region after each call
    (e.g. rolling a cache back to where it was). ``progress`` names a progress bar of the calls
    (tqdm, on stderr); None shows none."""
    check_repeats(repeats, warmup)
    if not contenders:
        raise ValueError("nothing to time: no contenders given")
    names = list(contenders)
    timings = {name: Timing() for name in names}
    total = (warmup + repeats) * len(names)
    with tqdm(total=total, desc=progress, unit="run", disable=progress is None, leave=False) as bar:
        for r in range(warmup + repeats):
            for name in names if r % 2 == 0 else names[::-1]:
                seconds, value = timed(contenders[name], device)
                if after is not None:
                    after(name)
                if r >= warmup:
                    timings[name].seconds.append(seconds)
                    timings[name].values.append(value)
                bar.update()
    return timings


def repeat(
    fn: Callable[[], Any], repeats: int = 5, device: str | torch.device | None = None, warmup: int = 1
) -> Timing:
    """Time one function alone: ``warmup`` untimed calls, then ``repeats`` timed ones."""
    return interleaved({"fn": fn}, repeats, device, warmup)["fn"]
