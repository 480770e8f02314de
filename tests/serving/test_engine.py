"""The engine and its scheduler: every request's greedy output equals running it alone with
``generate``, whatever the batching policy, with chunked prefill, preemption, eviction, prefix
caching and copy-on-write all happening (the counters prove they did); no block leaks; no
request lost or duplicated; the latency figures follow the clock."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm import SamplingParams, generate
from minillm.bench.serving import copy_requests
from minillm.serving.engine import (
    Engine,
    EngineConfig,
    RequestTooLargeError,
    SimulatedModel,
    StepCost,
    fit_step_cost,
    progress_bar,
)
from minillm.serving.scheduler import SchedulerConfig
from minillm.serving.workload import Request
from tests.conftest import tiny_model

VOCAB = 97
MODEL = tiny_model()


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def alone(request: Request) -> list[int]:
    return generate(MODEL, request.prompt, request.max_tokens, eos_token_id=None).tokens[0].tolist()


def make_engine(policy="continuous", max_batch=4, num_blocks=14, block_size=4, token_budget=None, **kw) -> Engine:
    sched = SchedulerConfig(policy, max_batch, token_budget=token_budget, timeout=kw.pop("timeout", 0.05))
    return Engine(MODEL, EngineConfig(num_blocks, block_size, scheduler=sched, step_cost=StepCost(), **kw))


def assert_no_leak(engine: Engine) -> None:
    alloc = engine.blocks.allocator
    assert alloc.ref_counts == [0] * alloc.num_blocks
    assert alloc.num_available == alloc.num_blocks
    assert not engine.blocks.tables and not engine.scheduler.running and not engine.scheduler.waiting


def shared_prefix_workload(n: int = 12, seed: int = 0) -> list[Request]:
    """A system prompt of two blocks, then each request's own text; some prompts repeat exactly.
    The last two are one prompt of whole blocks, arriving back to back once the rush is over: the
    second finds all of the first one's blocks cached and shares its last block (copy-on-write)."""
    system = tokens(8, 1000)
    reqs = []
    for i in range(n):
        own = tokens(4, seed) if i % 5 < 2 else tokens(3 + (i * 5) % 14, seed + 100 + i)
        reqs.append(Request(system + own, max_tokens=4 + (i * 7) % 11, arrival=0.004 * i))
    last = system + tokens(4, seed + 1)
    return reqs + [Request(last, 6, arrival=1.0), Request(list(last), 5, arrival=1.001)]


def test_greedy_outputs_equal_generate_alone_with_every_mechanism_at_once():
    requests = shared_prefix_workload()
    engine = make_engine(token_budget=8)
    outputs = engine.run(requests)
    for out, req in zip(outputs, requests):
        assert out.request is req and out.tokens == alone(req), f"request {req.id}"
    stats = engine.stats()
    assert stats["preemptions"] > 0 and stats["evictions"] > 0, stats
    assert stats["cow_copies"] > 0 and stats["prefix_hit_tokens"] > 0, stats
    assert stats["steps"] * 8 >= stats["tokens_fed"]  # no step over the budget...
    assert max(len(r.prompt) for r in requests) > 8  # ...so the longer prompts went in chunks
    assert_no_leak(engine)


@pytest.mark.parametrize("policy", ["static", "dynamic"])
def test_static_and_dynamic_batching_give_the_same_tokens(policy):
    requests = shared_prefix_workload(8)
    engine = make_engine(policy, num_blocks=24)
    outputs = engine.run(requests)
    assert [o.tokens for o in outputs] == [alone(r) for r in requests]
    assert engine.stats()["preemptions"] == 0  # whole batches reserve their blocks up front
    assert_no_leak(engine)


@settings(max_examples=20, deadline=None)
@given(
    policy=st.sampled_from(["static", "dynamic", "continuous"]),
    budget=st.sampled_from([None, 4, 9]),
    block_size=st.sampled_from([1, 2, 4]),
    prefix_caching=st.booleans(),
    seed=st.integers(0, 10**4),
    n=st.integers(1, 7),
)
def test_any_workload_completes_exactly_once_with_no_leak(policy, budget, block_size, prefix_caching, seed, n):
    if policy != "continuous":
        budget = None
    rng = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 12, (n, 2), generator=rng).tolist()
    requests = [Request(tokens(p, seed + i), o, arrival=0.003 * i) for i, (p, o) in enumerate(lens)]
    engine = make_engine(policy, 3, 24 // block_size, block_size, budget, prefix_caching=prefix_caching)
    outputs = engine.run(requests)
    assert [o.request.id for o in outputs] == list(range(n))
    assert [o.tokens for o in outputs] == [alone(r) for r in requests]
    assert_no_leak(engine)


def test_a_request_that_can_never_fit_fails_clearly_and_the_others_are_served_once():
    engine = make_engine(num_blocks=6)
    good = [Request(tokens(5, i), 3, arrival=0.001 * i) for i in range(4)]
    for r in good[:2]:
        engine.add_request(r)
    too_big = Request(tokens(20, 9), 8)
    with pytest.raises(RequestTooLargeError, match="needs 7 blocks of 4 tokens .* only 6"):
        engine.add_request(too_big)
    with pytest.raises(RequestTooLargeError):
        engine.run([good[2], too_big])  # checked before anything runs: good[2] is not added twice
    with pytest.raises(RequestTooLargeError, match="context length"):
        engine.check(Request(tokens(100, 0), 40))
    outputs = engine.run(good[2:])
    assert [o.request.id for o in outputs] == [2, 3]
    assert [o.tokens for o in outputs] == [alone(r) for r in good[2:]]
    assert set(engine.outputs) == {0, 1, 2, 3}
    with pytest.raises(ValueError, match="already added"):
        engine.add_request(good[0])


def test_abort_ends_a_request_wherever_it_is_and_keeps_nothing():
    """Running, waiting or not yet arrived: its blocks come back at once, and no generator, output
    or id of it stays behind (a server aborts and forgets requests for as long as it runs)."""
    engine = make_engine(max_batch=1)
    seeded = SamplingParams(temperature=1.0, seed=3)
    running, waiting = Request(tokens(6, 1), 20, params=seeded), Request(tokens(5, 2), 20, params=seeded)
    later = Request(tokens(5, 3), 4, arrival=5.0)
    for r in (running, waiting, later):
        engine.add_request(r)
    engine.step()
    assert [s.id for s in engine.scheduler.running] == [running.id] and engine.blocks.allocator.num_used > 0
    assert [engine.abort(r.id) for r in (running, waiting, later)] == [True] * 3
    assert not engine.unfinished and engine._generators == {} and engine.outputs == {}
    assert_no_leak(engine)
    assert not engine.abort(running.id), "an abort of a request no longer in flight is a no-op"
    (out,) = engine.run([Request(tokens(5, 4), 3, id=running.id)])  # its id is free again
    assert out.tokens == alone(Request(tokens(5, 4), 3))
    engine.outputs.clear()  # what a server does with each finished output
    engine.add_request(Request(tokens(3, 5), 2, id=running.id))  # no id is kept for ever


def test_request_validation():
    with pytest.raises(ValueError, match="max_tokens"):
        Request([1, 2], 0)
    with pytest.raises(ValueError, match="prompt"):
        Request([], 3)
    with pytest.raises(ValueError, match="arrival"):
        Request([1], 3, arrival=-1.0)
    with pytest.raises(ValueError, match="token ids"):
        make_engine().check(Request([VOCAB], 3))
    with pytest.raises(ValueError, match="policy"):
        SchedulerConfig("fifo")
    with pytest.raises(ValueError, match="continuous"):
        SchedulerConfig("static", token_budget=16)
    with pytest.raises(ValueError, match="max_batch"):
        SchedulerConfig("continuous", 8, token_budget=4)


def test_static_batching_waits_for_a_full_batch_and_dynamic_for_its_timeout():
    arrivals = [0.0, 0.01, 0.5, 1.0]
    requests = lambda: [Request(tokens(4, i), 2, arrival=a) for i, a in enumerate(arrivals)]  # noqa: E731
    static = make_engine("static", max_batch=3, num_blocks=30).run(requests())
    assert min(o.metrics.token_times[0] for o in static) >= 0.5  # nobody starts before the third arrives
    dynamic = make_engine("dynamic", max_batch=3, num_blocks=30, timeout=0.1).run(requests())
    first = dynamic[0].metrics.token_times[0]
    assert 0.1 <= first < 0.5  # the first two left when the oldest had waited 0.1 s
    cont = make_engine("continuous", max_batch=3, num_blocks=30).run(requests())
    assert cont[0].metrics.token_times[0] == pytest.approx(StepCost()(4))


def test_metrics_follow_the_simulated_clock():
    cost = StepCost(fixed=0.01, per_token=0.001)
    engine = Engine(MODEL, EngineConfig(30, 4, scheduler=SchedulerConfig("continuous", 2), step_cost=cost))
    a, b = engine.run([Request(tokens(5, 0), 3), Request(tokens(7, 1), 2, arrival=0.5)])
    assert a.metrics.token_times == pytest.approx([cost(5), cost(5) + cost(1), cost(5) + 2 * cost(1)])
    assert a.metrics.ttft == pytest.approx(cost(5)) and a.metrics.input_tokens == 5
    assert b.metrics.ttft == pytest.approx(cost(7))  # the idle gap was skipped, not counted
    assert b.metrics.itl == pytest.approx([cost(1)])
    assert engine.now == pytest.approx(0.5 + cost(7) + cost(1))


def test_wall_clock_is_the_default_and_times_are_positive():
    engine = Engine(MODEL, EngineConfig(30, 4))
    (out,) = engine.run([Request(tokens(5, 0), 3)])
    assert out.metrics.ttft > 0 and all(g > 0 for g in out.metrics.itl)


def test_sampling_with_a_seed_matches_generate_and_stop_ids_end_early():
    params = SamplingParams(temperature=1.0, top_k=20, seed=7)
    prompt = tokens(6, 3)
    engine = make_engine(num_blocks=30)
    sampled, batched_with = engine.run([Request(prompt, 10, params=params), Request(tokens(9, 4), 10)])
    ref = generate(MODEL, prompt, 10, temperature=1.0, top_k=20, seed=7, eos_token_id=None)
    assert sampled.tokens == ref.tokens[0].tolist()
    greedy = alone(Request(prompt, 10))
    stop = greedy[3]
    (out,) = make_engine().run([Request(prompt, 10, stop_ids=(stop,))])
    assert out.tokens == greedy[: greedy.index(stop) + 1]


def test_progress_bar_when_asked(capsys):
    bar = progress_bar(3, enabled=False)
    bar.update(3)
    bar.close()
    assert capsys.readouterr().err == ""
    make_engine().run([Request(tokens(4, 0), 2)], progress=True)
    assert "1/1" in capsys.readouterr().err


def test_progress_counts_the_requests_added_before_and_prints_nothing_to_stdout(capsys):
    engine = make_engine()
    engine.add_request(Request(tokens(4, 0), 2))
    engine.run([Request(tokens(4, 1), 2)], progress=True)
    out = capsys.readouterr()
    assert "2/2" in out.err and out.out == ""


# ---------------------------------------------------------------------------------------------
# The step log, the cost model and its fit, the simulated model


def test_step_log_records_every_step_and_padding_rows_cost_time():
    cost = StepCost(fixed=0.01, per_token=0.001, per_prefill_token=0.0001)
    engine = Engine(MODEL, EngineConfig(30, 4, scheduler=SchedulerConfig("static", 2), step_cost=cost))
    engine.run([Request(tokens(5, 0), 4), Request(tokens(3, 1), 1)])
    log = engine.step_log
    assert len(log) == engine.steps and log[0].start == 0.0
    assert all(a.end == pytest.approx(b.start) for a, b in zip(log, log[1:]))  # no idle gap: all arrived at 0
    assert log[0].prefill_tokens == 8 and log[0].decode_rows == 0 and log[0].duration == pytest.approx(cost(0, 8))
    later = log[1:]
    assert [r.padding_rows for r in later] == [1, 1, 1]  # the one-token request's row rides along
    assert all(r.decode_rows == 2 and r.duration == pytest.approx(cost(2)) for r in later)
    assert (
        engine.stats()["padding_rows"] == 3 and engine.peak_blocks == 3
    )  # the first's 3 blocks: the other left in step 1


def test_a_mixed_step_runs_two_forwards():
    cost = StepCost(fixed=0.01, per_token=0.001, per_prefill_token=0.0001)
    engine = Engine(MODEL, EngineConfig(30, 4, scheduler=SchedulerConfig("continuous", 4), step_cost=cost))
    engine.run([Request(tokens(5, 0), 4), Request(tokens(6, 1), 2, arrival=0.011)])
    mixed = [r for r in engine.step_log if r.decode_rows and r.prefill_tokens]
    assert mixed and all(r.forwards == 2 and r.duration == pytest.approx(cost(1, 6, 2)) for r in mixed)


def test_fit_step_cost_recovers_a_known_cost():
    true = StepCost(fixed=0.004, per_token=0.0007, per_prefill_token=0.00015)
    engine = Engine(MODEL, EngineConfig(40, 4, scheduler=SchedulerConfig("continuous", 4), step_cost=true))
    engine.run(shared_prefix_workload(10))
    fitted = fit_step_cost(engine.step_log)
    assert fitted.fixed == pytest.approx(true.fixed, rel=1e-6)
    assert fitted.per_token == pytest.approx(true.per_token, rel=1e-6)
    assert fitted.prefill_rate == pytest.approx(true.prefill_rate, rel=1e-6)
    assert true.half_batch() == pytest.approx(0.004 / 0.0007)
    with pytest.raises(ValueError, match="at least 3"):
        fit_step_cost(engine.step_log[:2])
    with pytest.raises(ValueError, match=">= 0"):
        StepCost(fixed=-1.0)


def test_simulated_model_keeps_the_schedule_and_the_clock_of_the_real_one():
    requests = shared_prefix_workload(8)
    config = EngineConfig(24, 4, scheduler=SchedulerConfig("continuous", 4, token_budget=8), step_cost=StepCost())
    real = Engine(MODEL, config)
    real.run(copy_requests(requests))
    sim = Engine(SimulatedModel.like(MODEL), config)
    outputs = sim.run(copy_requests(requests))
    assert [(r.start, r.work) for r in sim.step_log] == [(r.start, r.work) for r in real.step_log]
    assert sim.stats() == real.stats()
    assert all(o.tokens == [0] * o.request.max_tokens for o in outputs)  # zero logits: greedy picks token 0
    assert_no_leak(sim)
    with pytest.raises(ValueError, match="step_cost"):
        Engine(SimulatedModel.like(MODEL), EngineConfig(24, 4))
