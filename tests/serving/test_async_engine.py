"""The async engine: many callers at once get exactly the tokens each would get alone, streamed
as sampled; an abort frees the request's blocks before the next step; a failing step ends only
the requests in flight; shutdown stops the loop within its bound. Every wait is bounded."""

import asyncio
import threading

import pytest
import torch

from minillm import generate
from minillm.serving.async_engine import RequestStream
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


def test_a_request_added_while_the_engine_shuts_down_is_refused(monkeypatch):
    """Shutdown landing between add_request's check and its send: the loop's last drain has run,
    so the request must be refused, not left waiting for a loop that is gone."""
    engine = make_engine(MODEL).start()
    engine.stream_timeout = 2
    real_check = engine.engine.check

    def check_then_shut_down(request):
        real_check(request)
        assert engine.shutdown(TIMEOUT)

    monkeypatch.setattr(engine.engine, "check", check_then_shut_down)
    with pytest.raises(RuntimeError, match="shut down while this request was added"):
        list(engine.add_request(Request(prompt(4, 9), 3)))


@pytest.mark.parametrize("method", ["_add", "_publish", "_deliver"])
def test_a_failure_outside_the_step_ends_the_requests_in_flight_and_the_loop_goes_on(monkeypatch, method):
    engine = make_engine(MODEL).start()
    engine.stream_timeout = TIMEOUT
    real, calls = getattr(engine, method), []

    def fails_once(*args):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("a bug")
        return real(*args)

    monkeypatch.setattr(engine, method, fails_once)
    try:
        failed = list(engine.add_request(Request(prompt(5, 10), 20)))
        assert failed[-1].finish_reason == "error" and "RuntimeError: a bug" in failed[-1].error
        assert engine.running
        good = engine.add_request(Request(prompt(5, 11), 4))
        assert [t for d in good for t in d.tokens] == alone(prompt(5, 11), 4)
        assert engine.stats["kv_blocks_used"] == 0 and engine.engine._generators == {}
    finally:
        assert engine.shutdown(TIMEOUT)


class Fatal(BaseException):
    """Escapes every ``except Exception``: the engine's loop dies of it."""


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_when_the_loop_dies_every_open_stream_ends_and_no_request_is_taken(monkeypatch):
    engine = make_engine(MODEL).start()
    engine.stream_timeout = TIMEOUT
    real = engine._publish
    all_added = threading.Event()

    def dies_on_the_third_step(finished):
        # the first step waits until all three requests are in, however fast this machine steps,
        # so the loop never dies before the test has added them (a bounded wait)
        assert all_added.wait(TIMEOUT), "the requests were never added"
        if engine.engine.steps == 3:
            raise Fatal
        return real(finished)

    monkeypatch.setattr(engine, "_publish", dies_on_the_third_step)

    async def main():
        streams = [engine.add_request(Request(prompt(4, 12 + i), 50)) for i in range(3)]
        all_added.set()
        return await asyncio.wait_for(asyncio.gather(*(read(s) for s in streams)), TIMEOUT)

    for tokens, deltas in asyncio.run(main()):
        assert deltas[-1].finish_reason == "error" and "loop stopped" in deltas[-1].error and len(tokens) < 50
    engine._thread.join(TIMEOUT)
    assert not engine.running
    with pytest.raises(RuntimeError, match="not running"):
        engine.add_request(Request(prompt(3, 13), 2))


def test_an_async_stream_waits_for_its_next_delta_at_most_its_timeout():
    async def main():
        stream = RequestStream(Request([1, 2], 2), asyncio.get_running_loop(), timeout=0.05)
        return [d async for d in stream]

    with pytest.raises(TimeoutError, match="no token within 0.05 s"):
        asyncio.run(asyncio.wait_for(main(), TIMEOUT))
