"""The simulated cluster: every request served exactly once whatever the P:D ratio, backpressure
at a full decode pool, TTFT and the transfer where the clock says by hand, the prefill-decode
interference of a colocated engine reproduced, one colocated replica identical to an ``Engine``,
and the roofline step cost by hand."""

import pytest

from minillm.bench.batching import InterferenceWorkload, interference_workload, itl_figures
from minillm.bench.serving import simulate
from minillm.core.config import ModelConfig, preset
from minillm.serving.cluster import ClusterConfig, roofline_step_cost, simulate_cluster
from minillm.serving.engine import EngineConfig, RequestTooLargeError, StepCost
from minillm.serving.handoff import DecodeEngine, kv_handoff_bytes
from minillm.serving.scheduler import SchedulerConfig
from minillm.serving.workload import Request, chat_trace, requests_from_trace

VOCAB = 97
CONFIG = ModelConfig(vocab_size=VOCAB, max_seq_len=1024)
COST = StepCost(fixed=5e-3, per_token=1e-4, per_prefill_token=5e-5)


def engine_config(num_blocks=64, max_batch=8, token_budget=None, cost=COST, prefix_caching=False) -> EngineConfig:
    scheduler = SchedulerConfig(max_batch=max_batch, token_budget=token_budget)
    return EngineConfig(num_blocks, 16, prefix_caching, scheduler, cost)


def chat_requests(n=60, rate=50.0, seed=1) -> list[Request]:
    requests = requests_from_trace(chat_trace(n, rate, max_len=256, seed=seed), VOCAB, seed)
    requests[3].max_tokens = requests[17].max_tokens = 1  # these end at the prefill
    return requests


def assert_no_leak(engine) -> None:
    alloc = engine.blocks.allocator
    assert alloc.ref_counts == [0] * alloc.num_blocks
    assert not engine.blocks.tables and not engine.scheduler.running and not engine.scheduler.waiting


@pytest.mark.parametrize("prefill_workers, decode_workers", [(1, 1), (1, 2), (2, 1), (2, 0)])
def test_every_request_gets_exactly_one_output(prefill_workers, decode_workers):
    requests = chat_requests()
    cluster = ClusterConfig(
        prefill=engine_config(),
        decode=engine_config(num_blocks=48),
        prefill_workers=prefill_workers,
        decode_workers=decode_workers,
        transfer_seconds_per_byte=1e-9,
        transfer_latency=1e-3,
        kv_bytes_per_token=4096,
    )
    run = simulate_cluster(CONFIG, requests, cluster)
    assert [o.request.id for o in run.outputs] == [r.id for r in requests]
    for r, o in zip(requests, run.outputs):
        assert o.finish_reason == "length" and len(o.tokens) == r.max_tokens == o.metrics.output_tokens
        assert o.metrics.arrival == r.arrival and o.metrics.ttft > 0
        assert all(b > a for a, b in zip(o.metrics.token_times, o.metrics.token_times[1:]))
    finals = [set(e.outputs) for e in run.engines]  # each id in exactly one engine's final outputs
    assert sum(map(len, finals)) == len(requests) and set().union(*finals) == {r.id for r in requests}
    assert all(e.steps > 0 for e in run.engines)  # the router used every worker
    for e in run.engines:
        assert_no_leak(e)
    assert len(run.prefill_engines) == prefill_workers and len(run.decode_engines) == decode_workers
    for r, t in zip(requests, run.transfers):
        if decode_workers == 0 or r.max_tokens == 1:
            assert t is None
        else:
            assert t.nbytes == 4096 * len(r.prompt) and t.seconds == pytest.approx(1e-3 + 4096e-9 * len(r.prompt))
            assert t.admitted >= t.ready and t.waited >= 0
    if decode_workers:
        assert {r.id for r in requests if r.max_tokens == 1} == set().union(*(e.outputs for e in run.prefill_engines))


def test_a_decode_pool_of_one_makes_handoffs_wait():
    requests = chat_requests(n=24, rate=100.0)
    cluster = ClusterConfig(prefill=engine_config(), decode=engine_config(max_batch=1))
    run = simulate_cluster(CONFIG, requests, cluster)
    decoded = sorted((o for o in run.outputs if len(o.tokens) > 1), key=lambda o: o.metrics.token_times[1])
    assert len(decoded) == 22
    for before, after in zip(decoded, decoded[1:]):  # one at a time: each starts after the previous finished
        assert after.metrics.token_times[1] > before.metrics.finish
    waited = [t.waited for t in run.transfers if t is not None]
    assert sum(w > 0 for w in waited) >= len(waited) // 2


def test_ttft_is_the_prefill_and_the_transfer_shows_between_tokens_1_and_2():
    prefill_cost = StepCost(fixed=4e-3, per_token=2e-4, per_prefill_token=3e-5)
    decode_cost = StepCost(fixed=6e-3, per_token=1e-4, per_prefill_token=1e-5)
    cluster = ClusterConfig(
        prefill=engine_config(cost=prefill_cost, prefix_caching=True),
        decode=engine_config(cost=decode_cost),
        transfer_seconds_per_byte=1e-10,
        transfer_latency=2e-3,
        kv_bytes_per_token=1000,
    )
    request = Request(list(range(90)) + list(range(10)), max_tokens=5, arrival=0.5)
    run = simulate_cluster(CONFIG, [request], cluster)
    (out,), (transfer,) = run.outputs, run.transfers
    times = out.metrics.token_times
    transfer_seconds = 2e-3 + 100 * 1000 * 1e-10
    assert out.metrics.ttft == pytest.approx(prefill_cost.fixed + 100 * prefill_cost.prefill_rate, rel=1e-12)
    assert transfer.seconds == pytest.approx(transfer_seconds, rel=1e-12) and transfer.waited == 0
    assert times[1] - times[0] == pytest.approx(transfer_seconds + decode_cost.fixed + decode_cost.per_token, rel=1e-9)
    for a, b in zip(times[1:], times[2:]):
        assert b - a == pytest.approx(decode_cost(1), rel=1e-9)
    assert request.id is None  # the caller's request was copied, not numbered


def test_colocated_prefills_stall_decodes_and_disaggregation_removes_the_stalls():
    requests, chatting = interference_workload(VOCAB, InterferenceWorkload())
    cost = StepCost(fixed=5e-3, per_token=1e-4, per_prefill_token=1e-4)
    engine = engine_config(num_blocks=128, max_batch=16, cost=cost)
    colocated = simulate_cluster(CONFIG, requests, ClusterConfig(prefill=engine, decode_workers=0))
    split = simulate_cluster(CONFIG, requests, ClusterConfig(prefill=engine, decode=engine))
    together, apart = itl_figures(colocated.outputs, chatting), itl_figures(split.outputs, chatting)
    assert together["tpot_p99_ms"] > 1.2 * apart["tpot_p99_ms"]
    assert together["itl_max_ms"] > 640 * 1e3 * cost.prefill_rate  # a whole long prompt in one gap
    assert apart["itl_max_ms"] < 2 * 1e3 * cost(16)  # no prompt ever ran beside them


@pytest.mark.parametrize("token_budget", [None, 32])
def test_one_colocated_replica_is_an_engine(token_budget):
    requests = chat_requests(n=40, rate=80.0, seed=2)
    config = engine_config(num_blocks=24, max_batch=6, token_budget=token_budget, prefix_caching=True)
    expected, engine = simulate(CONFIG, requests, config)
    run = simulate_cluster(CONFIG, requests, ClusterConfig(prefill=config, decode_workers=0))
    assert engine.scheduler.preemptions > 0  # the tight pool made the schedule interesting
    (replica,) = run.prefill_engines
    assert replica.step_log == engine.step_log and replica.now == engine.now
    for a, b in zip(run.outputs, expected, strict=True):
        assert (a.request.id, a.tokens, a.metrics, a.preemptions, a.finish_reason) == (
            b.request.id,
            b.tokens,
            b.metrics,
            b.preemptions,
            b.finish_reason,
        )


def test_bad_requests_fail_before_anything_runs():
    cluster = ClusterConfig(prefill=engine_config(num_blocks=64), decode=engine_config(num_blocks=4))
    with pytest.raises(RequestTooLargeError, match="decode worker.s KV pool"):  # fits the prefill, not the decode
        simulate_cluster(CONFIG, [Request([1] * 40, 2), Request([1] * 40, 40)], cluster)
    with pytest.raises(ValueError, match="id 3 was given twice"):
        simulate_cluster(CONFIG, [Request([1], 2, id=3), Request([2], 2, id=3)], cluster)


def test_a_stuck_cluster_raises_instead_of_looping(monkeypatch):
    monkeypatch.setattr(DecodeEngine, "can_admit", lambda self, handoff: False)
    cluster = ClusterConfig(prefill=engine_config(), decode=engine_config())
    with pytest.raises(RuntimeError, match="decode worker 0 is stuck"):
        simulate_cluster(CONFIG, [Request([1, 2, 3], 4)], cluster)


@pytest.mark.parametrize(
    "change, field",
    [
        (dict(prefill_workers=0), "prefill_workers"),
        (dict(decode_workers=-1), "decode_workers"),
        (dict(decode_workers=1.0), "decode_workers"),
        (dict(prefill=EngineConfig()), "prefill.step_cost"),
        (dict(decode=EngineConfig(scheduler=SchedulerConfig("static"), step_cost=COST)), "decode.scheduler.policy"),
        (dict(transfer_latency=-1.0), "transfer_latency"),
        (dict(transfer_seconds_per_byte=float("inf")), "transfer_seconds_per_byte"),
        (dict(kv_bytes_per_token=0), "kv_bytes_per_token"),
    ],
)
def test_cluster_config_names_the_bad_field(change, field):
    with pytest.raises(ValueError, match=field):
        ClusterConfig(**{"prefill": engine_config(), **change})


def test_roofline_step_cost_by_hand():
    c = ModelConfig(vocab_size=100, dim=8, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=16)
    weights = c.num_params() - 100 * 8  # the untied input embedding is looked up, not read whole
    cost = roofline_step_cost(c, peak_flops=1e6, bandwidth=1e3, dtype_bytes=2, mfu=0.5, mbu=0.5, context=10)
    kv_read = 2 * 2 * 1 * 4 * 10 * 2  # K and V x layers x kv heads x head dim x context x bytes
    assert cost.fixed == pytest.approx(2 * weights / 500)
    assert cost.prefill_rate == pytest.approx(2 * weights / 5e5)
    assert cost.per_token == pytest.approx(2 * weights / 5e5 + kv_read / 500)
    llama = preset("Llama-3-8B")
    h100 = roofline_step_cost(llama, 989e12, 3.35e12)
    assert 6.0e-3 < h100.fixed < 6.8e-3  # ~7.5B weights read at 70% of 3.35 TB/s
    assert kv_handoff_bytes(llama, 1, 2) == 131072  # 128 KiB of K/V per token
    with pytest.raises(ValueError, match="mfu"):
        roofline_step_cost(c, 1e6, 1e3, mfu=1.5)
    with pytest.raises(ValueError, match="bandwidth"):
        roofline_step_cost(c, 1e6, 0)
