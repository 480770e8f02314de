"""Metrics on hand-computed cases."""

import math

import pytest

from minillm.measure.metrics import (
    SLO,
    RequestMetrics,
    cost_per_million_tokens,
    goodput,
    latency_percentiles,
    mbu,
    mfu,
    percentiles,
    slo_met_pct,
    throughput,
)


def test_one_request_by_hand():
    # arrives at 1.0, tokens at 1.5, 1.6, 1.8, 1.9
    r = RequestMetrics(arrival=1.0, token_times=[1.5, 1.6, 1.8, 1.9], input_tokens=10)
    assert r.ttft == pytest.approx(0.5)
    assert r.itl == pytest.approx([0.1, 0.2, 0.1])
    assert r.tpot == pytest.approx(0.4 / 3)
    assert r.e2e == pytest.approx(0.9)
    assert r.e2e == pytest.approx(r.ttft + r.tpot * (r.output_tokens - 1))
    assert math.isnan(RequestMetrics(0.0, [0.3]).tpot)


def test_bad_timelines_are_rejected():
    with pytest.raises(ValueError, match="non-decreasing"):
        RequestMetrics(0.0, [0.5, 0.4])
    with pytest.raises(ValueError, match="before the request arrived"):
        RequestMetrics(1.0, [0.5])


def test_percentiles_interpolate_and_the_median_ignores_an_outlier():
    values = [1, 2, 3, 4, 100]
    p = percentiles(values, (50, 90))
    assert p == {"p50": 3.0, "p90": pytest.approx(4 + 0.6 * 96)}
    assert sum(values) / len(values) == 22  # the mean moves with the outlier; the median does not
    with pytest.raises(ValueError, match="empty"):
        percentiles([])


def test_latency_percentiles_of_each_measure_by_hand():
    one = RequestMetrics(0.0, [0.5, 0.6, 0.8])  # TTFT 0.5, gaps 0.1 and 0.2, TPOT 0.15, e2e 0.8
    two = RequestMetrics(1.0, [1.3])  # one token: TTFT 0.3, no gap, no TPOT
    p = latency_percentiles([one, two], (50,))
    assert p["ttft"] == {"p50": pytest.approx(0.4)} and p["e2e"] == {"p50": pytest.approx(0.55)}
    assert p["tpot"] == {"p50": pytest.approx(0.15)} and p["itl"] == {"p50": pytest.approx(0.15)}
    alone = latency_percentiles([two])  # no answer of two tokens: no TPOT, no ITL
    assert alone["tpot"] is None and alone["itl"] is None and set(alone["ttft"]) == {"p50", "p90", "p99"}


def test_goodput_example_ten_requests_three_meet_the_slo():
    """10 requests in one second; 3 meet TTFT <= 200 ms and TPOT <= 100 ms: goodput 3 requests/s."""
    good = [RequestMetrics(i * 0.01, [i * 0.01 + 0.15, i * 0.01 + 0.2, i * 0.01 + 0.25]) for i in range(3)]
    slow_first = [RequestMetrics(0.1, [0.4, 0.45, 0.5]) for _ in range(4)]  # TTFT 300 ms
    slow_decode = [RequestMetrics(0.2, [0.3, 0.5, 0.7]) for _ in range(3)]  # TPOT 200 ms
    requests = good + slow_first + slow_decode
    assert goodput(requests, SLO(ttft=0.2, tpot=0.1), duration=1.0) == 3
    assert throughput(requests, duration=1.0)["requests_per_s"] == 10
    assert slo_met_pct(requests, SLO(ttft=0.2, tpot=0.1)) == 30.0
    assert slo_met_pct(good, SLO(ttft=0.2, tpot=0.1)) == 100.0  # every one: exactly 100
    with pytest.raises(ValueError, match="no requests"):
        slo_met_pct([], SLO(ttft=0.2, tpot=0.1))


def test_throughput_counts_input_and_output_separately():
    rs = [RequestMetrics(0.0, [1.0, 2.0], input_tokens=100), RequestMetrics(1.0, [2.0, 3.0, 4.0], input_tokens=50)]
    t = throughput(rs)  # span 0 -> 4 s
    assert t == {
        "output_tokens_per_s": 5 / 4,
        "input_tokens_per_s": 150 / 4,
        "requests_per_s": 0.5,
        "requests_per_min": 30.0,
    }


def test_cost_per_million_tokens_example():
    assert cost_per_million_tokens(2.0, 100) == pytest.approx(5.5556, abs=1e-4)
    with pytest.raises(ValueError, match="tokens_per_s"):
        cost_per_million_tokens(2.0, 0)


def test_mfu_and_mbu():
    # a 7B model in fp16 decoding at 30 tok/s: 14 GB read per token, 14 GFLOP per token
    assert mbu(14e9, 30, 2.0e12) == pytest.approx(0.21)
    assert mfu(14e9, 30, 312e12) == pytest.approx(14e9 * 30 / 312e12)
