"""The async engine: many callers at once get exactly the tokens each would get alone, streamed
as sampled; an abort frees the request's blocks before the next step; a failing step ends only
the requests in flight; shutdown stops the loop within its bound. Every wait is bounded."""

import asyncio

import pytest
import torch

from minillm import generate
from minillm.serving.engine import RequestTooLargeError
from minillm.serving.workload import Request
from tests.conftest import tiny_model
from tests.serving.conftest import make_engine

MODEL = tiny_model(max_seq_len=512)
TIMEOUT = 30  # seconds any one test may wait for the engine


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def alone(ids: list[int], n: int) -> list[int]:
    return generate(MODEL, ids, n, eos_token_id=None).tokens[0].tolist()


async def read(stream) -> tuple[list[int], list]:
    tokens, deltas = [], []
    async for delta in stream:
        tokens += delta.tokens
        deltas.append(delta)
    return tokens, deltas


def test_concurrent_callers_get_their_own_greedy_tokens_streamed():
    prompts = [(prompt(3 + 5 * i, i), 4 + 3 * i) for i in range(8)]
    expected = [alone(p, n) for p, n in prompts]
    engine = make_engine(MODEL, num_blocks=64, block_size=4, max_batch=4).start()

    async def main():
        streams = [engine.add_request(Request(p, n)) for p, n in prompts]
        return await asyncio.wait_for(asyncio.gather(*(read(s) for s in streams)), TIMEOUT)

    try:
        results = asyncio.run(main())
    finally:
        assert engine.shutdown(TIMEOUT)
    for (tokens, deltas), want, (_, n) in zip(results, expected, prompts):
        assert tokens == want
        assert deltas[-1].finish_reason == "length" and all(not d.finished for d in deltas[:-1])
        assert sum(len(d.tokens) for d in deltas) == n and len(deltas) >= 2  # streamed, not one at the end
        times = [t for d in deltas for t in d.times]
        assert times == sorted(times) and len(times) == n
    assert engine.stats["kv_blocks_used"] == 0 and engine.stats["running"] == 0
    assert engine.engine.outputs == {}, "a serving engine keeps no finished outputs"
    assert engine.stats["generated_tokens"] == sum(n for _, n in prompts)


def test_blocking_iteration_outside_an_event_loop():
    engine = make_engine(MODEL).start()
    engine.stream_timeout = TIMEOUT
    try:
        stream = engine.add_request(Request(prompt(5, 1), 6))
        tokens = [t for delta in stream for t in delta.tokens]
    finally:
        engine.shutdown(TIMEOUT)
    assert tokens == alone(prompt(5, 1), 6)


def test_abort_frees_the_blocks_at_once_and_the_engine_serves_the_next():
    engine = make_engine(MODEL, num_blocks=128, block_size=4).start()

    async def main():
        stream = engine.add_request(Request(prompt(20, 2), 400))
        seen = []
        async for delta in stream:
            seen.append(delta)
            if len(seen) == 3:
                assert engine.stats["kv_blocks_used"] > 0
                engine.abort(stream.id)
        return seen

    try:
        deltas = asyncio.run(asyncio.wait_for(main(), TIMEOUT))
        assert deltas[-1].finish_reason == "abort"
        assert sum(len(d.tokens) for d in deltas) < 400
        assert engine.stats["kv_blocks_used"] == 0 and engine.stats["running"] == 0
        assert engine.engine._generators == {} and not engine.engine.unfinished  # nothing of it is kept
        engine.stream_timeout = TIMEOUT
        again = engine.add_request(Request(prompt(5, 3), 4))
        assert [t for d in again for t in d.tokens] == alone(prompt(5, 3), 4)
    finally:
        engine.shutdown(TIMEOUT)


def test_a_failing_step_ends_the_requests_in_flight_and_the_loop_goes_on(monkeypatch):
    engine = make_engine(MODEL).start()
    engine.stream_timeout = TIMEOUT
    real_step, calls = engine.engine.step, []

    def flaky_step():
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("boom")
        return real_step()

    monkeypatch.setattr(engine.engine, "step", flaky_step)
    try:
        failed = list(engine.add_request(Request(prompt(5, 4), 50)))
        assert failed[-1].finish_reason == "error" and "RuntimeError: boom" in failed[-1].error
        assert engine.running and engine.stats["kv_blocks_used"] == 0
        good = engine.add_request(Request(prompt(5, 5), 5))
        assert [t for d in good for t in d.tokens] == alone(prompt(5, 5), 5)
    finally:
        engine.shutdown(TIMEOUT)


def test_requests_that_cannot_be_served_are_refused_when_added():
    engine = make_engine(MODEL, num_blocks=4, block_size=4).start()
    try:
        with pytest.raises(RequestTooLargeError, match="KV pool has only 4"):
            engine.add_request(Request(prompt(10, 6), 20))
        with pytest.raises(RequestTooLargeError, match="context length 512"):
            engine.add_request(Request(prompt(10, 6), 600))
        with pytest.raises(ValueError, match="vocabulary"):
            engine.add_request(Request([5, 500], 2))
    finally:
        engine.shutdown(TIMEOUT)
    with pytest.raises(RuntimeError, match="not running"):
        engine.add_request(Request(prompt(3, 7), 2))


def test_shutdown_aborts_what_is_in_flight_within_its_bound():
    engine = make_engine(MODEL).start()

    async def main():
        stream = engine.add_request(Request(prompt(8, 8), 450))
        first = await anext(aiter(stream))
        assert not first.finished
        await asyncio.to_thread(engine.shutdown, TIMEOUT)
        return [d async for d in stream]

    rest = asyncio.run(asyncio.wait_for(main(), TIMEOUT))
    assert rest[-1].finish_reason == "abort"
    assert not engine.running and not engine._thread.is_alive()


def test_only_continuous_batching_and_an_idle_engine_can_be_wrapped():
    from minillm.serving.async_engine import AsyncEngine
    from minillm.serving.engine import Engine, EngineConfig
    from minillm.serving.scheduler import SchedulerConfig

    with pytest.raises(ValueError, match="continuous policy"):
        AsyncEngine(Engine(MODEL, EngineConfig(16, 4, scheduler=SchedulerConfig("static", 4))))
    busy = Engine(MODEL, EngineConfig(16, 4))
    busy.add_request(Request([1, 2], 2))
    with pytest.raises(ValueError, match="in flight"):
        AsyncEngine(busy)
