"""Chapter 13's benchmark: the same requests through each batching policy."""

from minillm import SamplingParams
from minillm.bench.batching import bench_throughput
from minillm.serving.engine import Engine
from minillm.serving.workload import Request
from tests.conftest import tiny_model

MODEL = tiny_model()


def test_bench_throughput_serves_the_requests_with_their_sampling_params_and_stop_ids(monkeypatch):
    """Each timed run gets fresh copies of the requests, and a copy keeps everything a request says:
    its sampling parameters and stop ids too, not only the prompt, length and arrival."""
    params = SamplingParams(temperature=0.7, top_k=5, seed=3)
    requests = [Request([1 + i, 2, 3], 4, arrival=0.001 * i, params=params, stop_ids=(5, 6), id=i) for i in range(3)]
    served: list[list[Request]] = []
    run = Engine.run

    def spy(engine, reqs=(), progress=False):
        reqs = list(reqs)
        served.append(reqs)
        return run(engine, reqs, progress)

    monkeypatch.setattr(Engine, "run", spy)
    bench_throughput(MODEL, requests, max_batch=2, block_size=4, repeats=1)
    timed = [reqs for reqs in served if len(reqs) == len(requests)]  # not the short warm-up runs
    assert len(timed) == 2  # static and continuous
    for reqs in timed:
        assert all(c is not r for c, r in zip(reqs, requests))  # copies: an engine consumes its requests
        assert [(c.prompt, c.max_tokens, c.arrival, c.id) for c in reqs] == [
            (r.prompt, r.max_tokens, r.arrival, r.id) for r in requests
        ]
        assert [c.params for c in reqs] == [params] * 3
        assert [c.stop_ids for c in reqs] == [(5, 6)] * 3
