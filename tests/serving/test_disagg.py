"""Disaggregated serving with real worker processes: the same greedy tokens as ``generate``, the
K/V a decode worker receives equal to a local prefill's, every request served exactly once
(backpressure, not drops), clear errors, and a failing worker that stops everyone in bounded time.

Each cluster is started once per module (a start costs a few seconds: torch is imported in
every spawned process); every wait inside has a timeout, so a hang fails instead of blocking CI.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

import minillm
from minillm.core.cache import KVCache
from minillm.core.sampling import SamplingParams
from minillm.serving.disagg import DisaggConfig, DisaggregatedEngine, ReplicatedEngine, WorkerError
from minillm.serving.engine import Engine, EngineConfig
from minillm.serving.handoff import DecodeEngine, PrefillEngine, kv_handoff_bytes
from minillm.serving.routing import Router
from minillm.serving.workload import Request

pytestmark = pytest.mark.slow  # several processes, a compile or a server: make test-fast leaves it out

MODEL = "minillm-draft"  # 0.6M parameters: quick to load in every worker
BLOCK = 16
LENGTHS = [1, BLOCK, 2 * BLOCK, 7, 33, 50, 3, 90]  # ragged: 1, multiples of the block size, others
TIMEOUT = 60.0


@pytest.fixture(scope="module")
def model():
    return minillm.load(MODEL, device="cpu")[0]


def workload(vocab: int, lengths=LENGTHS, max_tokens: int = 12, gap: float = 0.005, seed: int = 0) -> list[Request]:
    rng = np.random.default_rng(seed)
    return [
        Request(rng.integers(0, vocab, n).tolist(), max_tokens, arrival=gap * i, id=i) for i, n in enumerate(lengths)
    ]


def greedy(model, prompt: list[int], n: int) -> list[int]:
    return minillm.generate(model, torch.tensor([prompt]), n).tokens[0].tolist()


def config(**changes) -> DisaggConfig:
    options = {
        "prefill": EngineConfig(num_blocks=64, block_size=BLOCK),
        "decode": EngineConfig(num_blocks=48, block_size=BLOCK),  # 768 tokens
        "timeout": TIMEOUT,
    }
    return DisaggConfig(**{**options, **changes})


@pytest.fixture(scope="module")
def one_to_one():
    with DisaggregatedEngine(MODEL, 1, 1, config()) as engine:
        yield engine
    assert engine.alive == 0


@pytest.fixture(scope="module")
def one_to_two():
    """Two decode workers whose pools hold 4 blocks of 16 tokens each: one request at a time."""
    with DisaggregatedEngine(MODEL, 1, 2, config(decode=EngineConfig(num_blocks=4, block_size=BLOCK))) as engine:
        yield engine
    assert engine.alive == 0


SMALL = [1, BLOCK, 2 * BLOCK, 7, 33, 3, 20, 2]  # prompt + 12 tokens fit 3 blocks


@pytest.mark.parametrize("decoders", [1, 2])
def test_disaggregated_tokens_equal_generate(model, one_to_one, one_to_two, decoders):
    engine = one_to_one if decoders == 1 else one_to_two
    requests = workload(model.config.vocab_size, LENGTHS if decoders == 1 else SMALL)
    outputs = engine.run(requests)
    assert [o.request.id for o in outputs] == [r.id for r in requests]  # none lost, none duplicated, in order
    assert {o.decode_worker for o in outputs} == set(range(1, decoders + 1))  # every decode worker was used
    for r, o in zip(requests, outputs):
        assert o.finish_reason == "length", o.error
        assert o.tokens == greedy(model, r.prompt, r.max_tokens), f"request {r.id}"
        assert len(o.metrics.token_times) == r.max_tokens


def test_received_kv_equals_a_local_prefill(model, one_to_one):
    requests = workload(model.config.vocab_size)
    outputs = one_to_one.run(requests, config(return_kv=True))  # for this run only
    assert all(o.received_kv is None for o in one_to_one.run(requests[:2]))
    c = model.config
    for r, o in zip(requests, outputs):
        T = len(r.prompt)
        assert o.kv_bytes == 2 * c.n_layers * c.n_kv_heads * c.head_dim * T * 4  # fp32, exactly
        assert o.kv_bytes == kv_handoff_bytes(c, T, 4) == o.received_kv.nbytes
        cache = KVCache.for_model(model, 1, T)
        with torch.inference_mode():
            model(torch.tensor([r.prompt]), cache=cache)
        local = torch.stack([cache.k[:, 0, :, :T], cache.v[:, 0, :, :T]]).transpose(2, 3)  # (2, L, T, H, D)
        torch.testing.assert_close(o.received_kv, local, atol=1e-5, rtol=1e-5)
        assert o.transfer_s >= 0 and o.handoff_wait_s >= o.transfer_s


def test_metrics_span_both_workers(model, one_to_one):
    requests = workload(model.config.vocab_size, [40, 40], max_tokens=6, gap=0.0)
    for o in one_to_one.run(requests):
        assert (o.prefill_worker, o.decode_worker) == (0, 1)
        times = o.metrics.token_times
        assert times[0] >= o.request.arrival and times == sorted(times)
        assert o.metrics.ttft > 0 and o.metrics.tpot > 0
    logs = one_to_one.step_logs
    assert all(r.prefill_tokens > 0 and r.decode_rows == 0 for r in logs[0])  # the prefill worker only prefills
    assert all(r.prefill_tokens == 0 for r in logs[1])  # the decode worker only decodes


def test_too_large_and_bad_requests_fail_alone(model, one_to_one):
    vocab = model.config.vocab_size
    requests = workload(vocab, [5, 20, 9], max_tokens=4)
    requests.insert(1, Request([1] * 700, 100, id=50))  # 800 tokens: beyond the 48-block decode pool
    requests.insert(2, Request([vocab + 5], 3, id=51))  # a token id outside the vocabulary
    outputs = one_to_one.run(requests)
    by_id = {o.request.id: o for o in outputs}
    assert by_id[50].finish_reason == "error" and "blocks" in by_id[50].error and "decode" in by_id[50].error
    assert by_id[51].finish_reason == "error" and "vocabulary" in by_id[51].error
    for r in requests:
        if r.id not in (50, 51):
            assert by_id[r.id].tokens == greedy(model, r.prompt, r.max_tokens)


def test_a_full_decode_pool_makes_requests_wait(model, one_to_two):
    # Each request needs 3 blocks of 16 (prompt 30 + 12 tokens); each decode pool holds 4: one at a time.
    requests = workload(model.config.vocab_size, [30] * 6, gap=0.0)
    outputs = one_to_two.run(requests)
    assert sorted(o.request.id for o in outputs) == [r.id for r in requests]
    for r, o in zip(requests, outputs):
        assert o.tokens == greedy(model, r.prompt, r.max_tokens)
    for rank in (1, 2):
        assert max(len(step.work) for step in one_to_two.step_logs[rank]) == 1  # never two at once
        mine = sorted((o.metrics.token_times[-1], o.metrics.token_times[1]) for o in outputs if o.decode_worker == rank)
        assert len(mine) >= 2
        for (end, _), (_, next_second) in zip(mine, mine[1:]):
            assert next_second >= end  # each decode began after the previous one on its worker finished
    assert max(o.handoff_wait_s for o in outputs) > 0


def test_seeded_sampling_matches_one_engine(model, one_to_one):
    rng = np.random.default_rng(1)
    params = [SamplingParams(temperature=0.9, top_k=50, seed=s) for s in range(4)]
    requests = [Request(rng.integers(0, 500, 10 + i).tolist(), 10, params=p, id=i) for i, p in enumerate(params)]
    reference = Engine(model, EngineConfig(num_blocks=64, block_size=BLOCK)).run(
        [Request(list(r.prompt), r.max_tokens, params=r.params, id=r.id) for r in requests]
    )
    outputs = one_to_one.run(requests)
    assert [o.tokens for o in outputs] == [o.tokens for o in reference]  # the sampler's state went along


def placed_by_the_rule(roles: list[str], requests: list[Request]) -> list[tuple[int, int | None]]:
    router = Router(roles)
    return [(p.prefill_worker, p.decode_worker) for p in map(router.route, requests)]


def at_once(vocab: int, lengths, max_tokens) -> list[Request]:
    """Requests that all arrive at 0: every one is placed before any output can come back."""
    rng = np.random.default_rng(1)
    return [Request(rng.integers(0, vocab, n).tolist(), m, id=i) for i, (n, m) in enumerate(zip(lengths, max_tokens))]


def test_the_real_router_places_requests_by_the_one_rule(model, one_to_two):
    """The same rule as the simulated cluster (tests/serving/test_routing.py): outstanding tokens."""
    requests = at_once(model.config.vocab_size, [3, 20, 9, 2, 12, 5], [12, 2, 3, 9, 4, 6])
    outputs = one_to_two.run(requests)
    placed = [(o.prefill_worker, o.decode_worker) for o in outputs]
    assert placed == placed_by_the_rule(["prefill", "decode", "decode"], requests)
    assert placed == [(0, 1), (0, 2), (0, 2), (0, 2), (0, 1), (0, 2)]  # counting requests would alternate


def test_replicas_equal_generate(model):
    requests = workload(model.config.vocab_size)
    with ReplicatedEngine(MODEL, 2, config()) as engine:
        outputs = engine.run(requests)
        lengths, max_tokens = [40, 3, 3, 3, 30, 2], [4, 4, 4, 4, 4, 4]
        burst = at_once(model.config.vocab_size, lengths, max_tokens)
        placed = [(o.prefill_worker, o.decode_worker) for o in engine.run(burst)]
    assert engine.alive == 0
    assert {o.prefill_worker for o in outputs} == {0, 1} and {o.decode_worker for o in outputs} == {None}
    assert placed == placed_by_the_rule(["colocated"] * 2, burst)
    assert [first for first, _ in placed] == [0, 1, 1, 1, 1, 0]  # by tokens, not by requests in flight
    for r, o in zip(requests, outputs):
        assert o.tokens == greedy(model, r.prompt, r.max_tokens) and o.kv_bytes == 0


@pytest.mark.parametrize("role, step", [("decode", 3), ("prefill", 1)])  # a prefill may batch every prompt in 2
def test_a_failing_worker_stops_every_process(model, role, step):
    engine = DisaggregatedEngine(MODEL, 1, 1, config(fault=(role, step)))
    start = time.monotonic()
    with pytest.raises(WorkerError, match=f"(?s){role} worker .*injected fault"):
        engine.run(workload(model.config.vocab_size))
    assert time.monotonic() - start < 30
    assert engine.alive == 0  # every process was stopped and reaped
    with pytest.raises(RuntimeError, match="closed"):
        engine.run([])


def test_bad_arguments_fail_before_any_process_starts():
    with pytest.raises(ValueError, match="decode_workers"):
        DisaggregatedEngine(MODEL, 1, 0)
    with pytest.raises(ValueError, match="no-such-model|not a bundled|unknown|found"):
        DisaggregatedEngine("no-such-model", 1, 1)
    with pytest.raises(ValueError, match="policy"):
        from minillm.serving.scheduler import SchedulerConfig

        DisaggConfig(decode=EngineConfig(scheduler=SchedulerConfig("static")))
    with pytest.raises(ValueError, match="dtype"):
        DisaggConfig(dtype="float99")


def test_handoff_in_one_process_equals_engine(model):
    """The two halves without processes: PrefillEngine -> Handoff -> DecodeEngine."""
    cfg = EngineConfig(num_blocks=64, block_size=BLOCK)
    requests = workload(model.config.vocab_size, max_tokens=8)
    prefill, decode = PrefillEngine(model, cfg), DecodeEngine(model, cfg)
    for r in requests:
        prefill.add_request(Request(list(r.prompt), r.max_tokens, id=r.id))
    while prefill.unfinished:
        prefill.step()
    handoffs = prefill.take_handoffs()
    assert prefill.blocks.allocator.num_used == 0 or prefill.config.prefix_caching  # blocks freed (or cached)
    assert [h.nbytes for h in handoffs] == [kv_handoff_bytes(model.config, h.tokens, 4) for h in handoffs]
    for h in handoffs:
        decode.admit(h)
    while decode.unfinished:
        decode.step()
    for r in requests:
        assert decode.outputs[r.id].tokens == greedy(model, r.prompt, r.max_tokens)
    full = DecodeEngine(model, EngineConfig(num_blocks=1, block_size=BLOCK))
    with pytest.raises(ValueError, match="blocks"):
        full.admit(handoffs[-1])


def test_an_interrupt_in_the_router_stops_the_workers(model, monkeypatch):
    engine = ReplicatedEngine(MODEL, 1, config())

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(engine, "_dispatch", interrupted)
    with pytest.raises(KeyboardInterrupt):
        engine.run(workload(model.config.vocab_size, [4, 4]))
    assert engine.alive == 0  # stopped and reaped, not left serving a half-finished run


def test_a_handoff_that_overtakes_its_runs_start_waits_for_it(model):
    """The router's "start" and a prefill worker's "handoff" reach a decode worker's inbox from two
    processes, in either order: a handoff of the next run that comes first is kept for that run,
    not dropped when its "start" resets the worker (under load this hung a run for its timeout)."""
    from minillm.serving.disagg_worker import Worker, WorkerSpec
    from minillm.serving.handoff import Handoff

    worker = Worker(1, WorkerSpec("decode", MODEL), model, inbox=None, outbox=None, inboxes=[])
    c = config()
    early = Handoff(Request([1, 2, 3], 4, id=7), 5, 0.0, None, 0)
    worker.handle(("handoff", early, 0, 123.0))  # the next run's handoff, before that run's start
    assert not worker.runnable() and worker.early
    worker.handle(("start", 123.0, c.prefill, c.decode, False))
    assert list(worker.waiting) == [(early, 0)] and worker.early == []
    assert worker.engine.config.num_blocks == c.decode.num_blocks  # the run's decode engine, as sent
    worker.handle(("handoff", early, 0, 123.0))  # one of the current run: taken at once
    assert len(worker.waiting) == 2
    worker.handle(("start", 456.0, c.prefill, c.decode, False))  # a later run never takes in an older run's handoff
    assert not worker.waiting
