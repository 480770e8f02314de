"""Chapter 2's measurements: requests served one at a time, then replayed on a clock."""

import math

import pytest

from minillm.bench.trace import measure_services, run_requests, ttft_by_prompt_length
from minillm.measure.trace import summary
from tests.conftest import tiny_model


def test_measure_and_run_requests_on_a_model():
    model = tiny_model()
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    services = measure_services(model, prompts, [4, 6])
    assert [len(s.token_offsets) for s in services] == [4, 6] and [s.input_tokens for s in services] == [3, 5]
    assert all(s.token_offsets[0] > 0 and list(s.token_offsets) == sorted(s.token_offsets) for s in services)
    reqs = run_requests(model, prompts, 4)  # back to back: nobody waits
    assert reqs[1].arrival == pytest.approx(reqs[0].finish)
    reqs = run_requests(model, prompts, 4, rate=1000.0)
    assert all(r.output_tokens == 4 and r.ttft > 0 for r in reqs)
    rows = summary(reqs)
    assert [r["metric"] for r in rows] == ["TTFT (ms)", "TPOT (ms)", "ITL (ms)", "e2e (ms)"]
    assert all(r["p50"] <= r["p99"] for r in rows)
    with pytest.raises(ValueError, match="max_new_tokens"):
        measure_services(model, prompts, [4])
    with pytest.raises(ValueError, match="no prompts"):
        measure_services(model, [], 4)


def test_ttft_by_prompt_length():
    model = tiny_model()
    rows = ttft_by_prompt_length(model, [[1] * 4, [1] * 32, [1] * 4], repeats=1)
    assert [r["prompt_tokens"] for r in rows] == [4, 32, 4] and all(r["ttft_ms"] > 0 for r in rows)
    assert not math.isnan(rows[0]["ttft_ms"])
