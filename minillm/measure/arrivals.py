"""When requests arrive: the arrival process of a synthetic workload.

Requests from many independent users are modelled, as in the serving literature, as a Poisson
process: the gaps between arrivals are independent and exponential with mean 1 / rate. Both the
chapter-2 replay (``measure.trace``) and the engine's workloads (``serving.workload``) draw from it.
"""

from __future__ import annotations

import numpy as np


def poisson_arrivals(n: int, rate: float, seed: int = 0) -> list[float]:
    """``n`` arrival times (s, the first at 0) of a Poisson process with ``rate`` requests/s."""
    if n < 1:
        raise ValueError(f"n must be a positive integer, got {n}")
    if rate <= 0:
        raise ValueError(f"rate must be positive, got {rate}")
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=n - 1)
    return [0.0, *np.cumsum(gaps).tolist()]
