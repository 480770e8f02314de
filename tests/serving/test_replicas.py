"""Data-parallel serving: N replicas behind a router give every request the single engine's greedy
tokens, count their throughput over the run's wall clock, and reject bad input before any process."""

from __future__ import annotations

import numpy as np
import pytest

import minillm
from minillm.serving.disagg import DisaggConfig
from minillm.serving.engine import Engine, EngineConfig
from minillm.serving.replicas import ReplicaRun, replica_throughput, warmup_requests
from minillm.serving.workload import Request

pytestmark = pytest.mark.slow  # several processes, a compile or a server: make test-fast leaves it out

MODEL = "minillm-draft"  # quick to load in every worker
LENGTHS = [5, 16, 33, 7, 20, 2]
MAX_TOKENS = 6
CONFIG = DisaggConfig(prefill=EngineConfig(num_blocks=32, block_size=16), timeout=60.0)


def workload(vocab: int) -> list[Request]:
    rng = np.random.default_rng(0)
    return [Request(rng.integers(0, vocab, n).tolist(), MAX_TOKENS, id=i) for i, n in enumerate(LENGTHS)]


@pytest.fixture(scope="module")
def model():
    return minillm.load(MODEL, device="cpu")[0]


@pytest.fixture(scope="module")
def runs(model) -> dict[int, ReplicaRun]:
    requests = workload(model.config.vocab_size)
    return {n: replica_throughput(MODEL, n, requests, CONFIG) for n in (1, 2)}


@pytest.mark.parametrize("replicas", [1, 2])
def test_replicas_give_the_single_engines_greedy_tokens(model, runs, replicas):
    requests = workload(model.config.vocab_size)
    reference = Engine(model, EngineConfig(num_blocks=32, block_size=16)).run(requests)
    run = runs[replicas]
    assert [o.tokens for o in run.outputs] == [o.tokens for o in reference]
    assert [o.request.id for o in run.outputs] == [r.id for r in requests]  # in the order given


@pytest.mark.parametrize("replicas", [1, 2])
def test_throughput_is_counted_over_the_wall_clock(runs, replicas):
    run = runs[replicas]
    f = run.figures()
    assert f["replicas"] == replicas and f["requests"] == len(LENGTHS) and f["errors"] == 0
    assert f["output_tokens"] == len(LENGTHS) * MAX_TOKENS
    assert 0 < f["wall_s"] < 30
    assert f["requests_per_s"] == pytest.approx(len(LENGTHS) / f["wall_s"])
    assert f["output_tokens_per_s"] == pytest.approx(len(LENGTHS) * MAX_TOKENS / f["wall_s"])
    assert f["tpot_p50_ms"] > 0 and f["e2e_p50_ms"] >= f["ttft_p50_ms"] > 0
    assert sum(f["requests_per_replica"]) == len(LENGTHS)
    assert all(n > 0 for n in f["requests_per_replica"])  # the router used every replica


def test_warmup_gives_each_replica_one_request():
    warm = warmup_requests(3)
    assert [r.id for r in warm] == [0, 1, 2] and len({tuple(r.prompt) for r in warm}) == 3


@pytest.mark.parametrize(
    "replicas, requests, match",
    [(0, [Request([1], 1)], "replicas"), (1, [], "at least one request"), (1, [[1, 2]], "Request")],
)
def test_bad_input_fails_before_any_process(replicas, requests, match):
    with pytest.raises(ValueError, match=match):
        replica_throughput(MODEL, replicas, requests, CONFIG)
