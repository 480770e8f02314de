"""Workloads: chat-like traces (Poisson arrivals, lognormal lengths) and recorded traces replayed."""

import json

import numpy as np
import pytest

from minillm.serving.workload import (
    Request,
    TraceEntry,
    chat_trace,
    load_trace,
    lognormal_lengths,
    requests_from_trace,
    save_trace,
)


def test_chat_trace_is_reproducible_sorted_and_fits_the_context():
    trace = chat_trace(400, rate=10.0, prompt_median=50, output_median=30, max_len=256, seed=3)
    assert trace == chat_trace(400, rate=10.0, prompt_median=50, output_median=30, max_len=256, seed=3)
    assert trace != chat_trace(400, rate=10.0, prompt_median=50, output_median=30, max_len=256, seed=4)
    arrivals = [e.arrival for e in trace]
    assert arrivals[0] == 0.0 and arrivals == sorted(arrivals)
    assert 400 / arrivals[-1] == pytest.approx(10.0, rel=0.2)  # the Poisson rate
    assert all(1 <= e.prompt_len <= 128 and e.output_len >= 1 and e.prompt_len + e.output_len <= 256 for e in trace)
    assert np.median([e.prompt_len for e in trace]) == pytest.approx(50, rel=0.2)
    assert np.median([e.output_len for e in trace]) == pytest.approx(30, rel=0.2)


def test_lognormal_lengths_have_a_long_tail_and_respect_bounds():
    lengths = lognormal_lengths(2000, 64, 1.0, 1, 10_000, np.random.default_rng(0))
    assert np.mean(lengths) > 1.4 * np.median(lengths)  # mean = median * exp(sigma^2 / 2) ~ 1.65x
    assert min(lognormal_lengths(100, 2, 3.0, 5, 9, np.random.default_rng(0))) >= 5
    assert max(lognormal_lengths(100, 2, 3.0, 5, 9, np.random.default_rng(0))) <= 9


@pytest.mark.parametrize("suffix", [".json", ".csv"])
def test_traces_round_trip_through_json_and_csv(tmp_path, suffix):
    trace = chat_trace(20, rate=5.0, max_len=128, seed=1)
    path = tmp_path / f"trace{suffix}"
    save_trace(trace, path)
    loaded = load_trace(path)
    assert [(e.prompt_len, e.output_len) for e in loaded] == [(e.prompt_len, e.output_len) for e in trace]
    assert [e.arrival for e in loaded] == pytest.approx([e.arrival for e in trace])


def test_a_recorded_trace_is_sorted_by_arrival_and_bad_entries_are_named(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(
        json.dumps([{"arrival": 2, "prompt_len": 3, "output_len": 4}, {"arrival": 1, "prompt_len": 5, "output_len": 6}])
    )
    assert load_trace(path) == [TraceEntry(1.0, 5, 6), TraceEntry(2.0, 3, 4)]
    path.write_text(json.dumps([{"arrival": 0, "prompt_len": 3}]))
    with pytest.raises(ValueError, match=r"entry 0 lacks \['output_len'\]"):
        load_trace(path)
    csv_path = tmp_path / "t.csv"
    csv_path.write_text("arrival,prompt_len,output_len\n0,abc,3\n")
    with pytest.raises(ValueError, match="entry 0 is not numeric"):
        load_trace(csv_path)
    csv_path.write_text("arrival,prompt_len,output_len\n0,0,3\n")
    with pytest.raises(ValueError, match="positive lengths"):
        load_trace(csv_path)


def test_requests_from_a_trace_share_the_system_prompt():
    trace = [TraceEntry(0.0, 3, 2), TraceEntry(0.5, 4, 7)]
    reqs = requests_from_trace(trace, vocab_size=50, seed=0, shared_prefix=[1, 2])
    assert [r.prompt[:2] for r in reqs] == [[1, 2], [1, 2]]
    assert [len(r.prompt) for r in reqs] == [5, 6] and [r.max_tokens for r in reqs] == [2, 7]
    assert [r.arrival for r in reqs] == [0.0, 0.5] and [r.id for r in reqs] == [0, 1]
    assert all(0 <= t < 50 for r in reqs for t in r.prompt)
    assert isinstance(reqs[0], Request)
