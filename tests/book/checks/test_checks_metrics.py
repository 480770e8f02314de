"""Chapter 2's checkers pass the right answers and reject the stub and plausible wrong ones."""

import numpy as np
import pytest

from minillm.book.checks.base import CheckFailed
from minillm.book.checks.metrics import (
    GOODPUT_EXAMPLE,
    check_cost_per_million,
    check_goodput,
    check_percentile,
    check_request_latencies,
)
from minillm.measure.metrics import SLO, RequestMetrics, cost_per_million_tokens, goodput


def stub(*args):
    raise NotImplementedError


def latencies(arrival, times):
    r = RequestMetrics(arrival, times)
    return {"ttft": r.ttft, "itl": r.itl, "tpot": r.tpot, "e2e": r.e2e}


def test_request_latencies():
    check_request_latencies(latencies)
    with pytest.raises(NotImplementedError):
        check_request_latencies(stub)

    def tpot_over_all_tokens(arrival, times):  # divides the whole latency by n
        return {**latencies(arrival, times), "tpot": (times[-1] - arrival) / len(times)}

    def itl_from_arrival(arrival, times):  # counts the wait for the first token as a gap
        return {**latencies(arrival, times), "itl": [b - a for a, b in zip([arrival, *times], times)]}

    def e2e_from_first_token(arrival, times):
        return {**latencies(arrival, times), "e2e": times[-1] - times[0]}

    wrongs = [(tpot_over_all_tokens, "TPOT"), (itl_from_arrival, "ITL"), (e2e_from_first_token, "end-to-end")]
    for wrong, match in wrongs:
        with pytest.raises(CheckFailed, match=match):
            check_request_latencies(wrong)


def test_percentile():
    check_percentile(lambda v, p: float(np.percentile(v, p)))
    with pytest.raises(NotImplementedError):
        check_percentile(stub)

    def nearest_rank_floor(values, p):
        s = sorted(values)
        return s[min(len(s) - 1, int(p / 100 * len(s)))]

    def unsorted(values, p):
        k = p / 100 * (len(values) - 1)
        lo, hi = int(np.floor(k)), int(np.ceil(k))
        return values[lo] + (values[hi] - values[lo]) * (k - lo)

    for wrong in (nearest_rank_floor, unsorted):
        with pytest.raises(CheckFailed, match="percentile"):
            check_percentile(wrong)


def test_goodput_example_and_checker():
    ex = GOODPUT_EXAMPLE
    reqs = [RequestMetrics(0.0, [t, t + s]) for t, s in zip(ex["ttft"], ex["tpot"])]
    assert goodput(reqs, SLO(0.2, 0.1), duration=1.0) == 3.0  # the library agrees with the example

    def right(ttfts, tpots, duration, slo_ttft, slo_tpot):
        return sum(t <= slo_ttft and s <= slo_tpot for t, s in zip(ttfts, tpots)) / duration

    check_goodput(right)
    with pytest.raises(NotImplementedError):
        check_goodput(stub)
    wrongs = [
        lambda t, s, d, a, b: sum(x < a and y < b for x, y in zip(t, s)) / d,  # strict bounds
        lambda t, s, d, a, b: sum(x <= a or y <= b for x, y in zip(t, s)) / d,  # either bound
        lambda t, s, d, a, b: sum(x <= a and y <= b for x, y in zip(t, s)),  # a count, not a rate
        lambda t, s, d, a, b: len(t) / d,  # throughput, not goodput
    ]
    for wrong in wrongs:
        with pytest.raises(CheckFailed, match="goodput"):
            check_goodput(wrong)


def test_cost_per_million():
    assert round(cost_per_million_tokens(2.0, 100.0), 2) == 5.56
    check_cost_per_million(cost_per_million_tokens)
    with pytest.raises(NotImplementedError):
        check_cost_per_million(stub)
    for wrong in (lambda d, t: d / t * 1e6, lambda d, t: d / (t * 60) * 1e6, lambda d, t: d / (t * 3600) * 1e3):
        with pytest.raises(CheckFailed, match="cost"):
            check_cost_per_million(wrong)
