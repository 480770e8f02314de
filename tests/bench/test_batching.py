"""Chapter 13's benchmarks: the same requests through each batching policy, measured and on the
simulated clock; the command line; the options' validation."""

import json

import pytest

from minillm import SamplingParams
from minillm.bench.batching import (
    BatchingBench,
    InterferenceWorkload,
    RateSweep,
    bench_throughput,
    capacity,
    interference_workload,
    itl_figures,
    rate_sweep,
)
from minillm.bench.serving import copy_requests, serving_figures, simulate
from minillm.cli.main import main
from minillm.measure.metrics import SLO
from minillm.serving.engine import Engine, EngineConfig, StepCost
from minillm.serving.scheduler import SchedulerConfig
from minillm.serving.workload import Request
from tests.conftest import tiny_model

VOCAB = 97
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


def test_bench_throughput_takes_turns_and_keeps_the_saved_keys():
    requests = [Request([1 + i, 2, 3, 4], 3 + i, arrival=0.0, id=i) for i in range(4)]
    result = bench_throughput(MODEL, requests, max_batch=2, block_size=4, repeats=2)
    assert result["repeats"] == 2 and len(result["ratio_runs"]) == 2
    for policy in ("static", "continuous"):
        figures = result[policy]
        assert set(figures) >= {"output_tokens_per_s", "requests_per_s", "ttft_ms", "tpot_ms_p50", "steps"}
        assert set(figures["ttft_ms"]) == {"p50", "p99"} and len(figures["output_tokens_per_s_runs"]) == 2
    assert result["steps_ratio"] == result["static"]["steps"] / result["continuous"]["steps"]


def test_bench_batching_cli(tmp_path, capsys):
    out = tmp_path / "bench.json"
    args = ["bench", "batching", "--requests", "6", "--max-batch", "3", "--prompt-median", "8", "--output-median", "6"]
    args += ["--prefix-requests", "3", "--system-len", "32", "--repeats", "1", "--no-progress", "--json", str(out)]
    args += ["--no-save"]  # the figures go to --json only, not into the package's results store
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "continuous / static" in text and "TTFT saving" in text and "block_size" in text
    figures = json.loads(out.read_text())
    assert figures["throughput"]["continuous"]["output_tokens_per_s"] > 0
    assert set(figures["memory_waste"]["rows"][0]) >= {"block_size", "paged_waste_pct", "contiguous_waste_pct"}
    assert figures["prefix_cache"]["with_cache"]["ttft_ms_mean"] > 0 and "thread" in figures["hardware"]
    assert {"model", "params", "dtype", "device", "threads", "torch", "date", "load_average_after"} <= set(figures)
    assert main(["bench", "batching", "--requests", "0"]) == 2
    assert "n_requests must be a positive integer" in capsys.readouterr().err
    assert main(["bench", "batching", "--rate", "-1"]) == 2
    assert "rate must be a positive number" in capsys.readouterr().err


def test_batching_bench_validates_each_field():
    assert BatchingBench().n_requests == 128
    for field, value in [
        ("n_requests", 0),
        ("max_batch", -1),
        ("prefix_requests", 0),
        ("system_len", 0),
        ("repeats", 0),
        ("rate", 0.0),
        ("rate", float("inf")),
        ("prompt_median", -3.0),
        ("output_median", float("nan")),
        ("max_len", 1),
    ]:
        with pytest.raises(ValueError, match=field):
            BatchingBench(**{field: value})
    with pytest.raises(ValueError, match="n_requests must be a positive integer, got 2.5"):
        BatchingBench(n_requests=2.5)


def test_rate_sweep_validates_each_field():
    cost, slo = StepCost(), SLO()
    assert RateSweep([1.0, 2.0], cost, slo).rates == (1.0, 2.0)
    with pytest.raises(ValueError, match="rates"):
        RateSweep([], cost, slo)
    with pytest.raises(ValueError, match="rates"):
        RateSweep([1.0, 0.0], cost, slo)
    with pytest.raises(ValueError, match="policies"):
        RateSweep([1.0], cost, slo, ("fifo",))
    for field, value in [
        ("n_requests", 0),
        ("max_batch", 0),
        ("block_size", 0),
        ("max_len", 0),
        ("num_blocks", 0),
        ("prompt_median", 0.0),
        ("output_median", -1.0),
        ("timeout", -0.1),
    ]:
        with pytest.raises(ValueError, match=field):
            RateSweep([1.0], cost, slo, **{field: value})


def test_interference_workload_validates_each_field():
    for field in ("n_chat", "chat_prompt", "chat_tokens", "n_long", "long_prompt", "long_tokens"):
        with pytest.raises(ValueError, match=field):
            InterferenceWorkload(**{field: 0})
    with pytest.raises(ValueError, match="gap"):
        InterferenceWorkload(gap=-1.0)


def test_rate_sweep_gives_one_row_per_policy_and_rate_and_continuous_wins_under_load():
    cost = StepCost(fixed=5e-3, per_token=5e-4, per_prefill_token=1e-4)
    peak = capacity(cost, 20, 20, max_batch=4)
    assert peak == pytest.approx(1 / (20 * cost(4) / 4 + 20 * 1e-4 + 5e-3))
    rates = [0.2 * peak, 2 * peak]
    shape = dict(n_requests=30, max_batch=4, prompt_median=16, output_median=16, max_len=64)
    rows = rate_sweep(MODEL.config, RateSweep(rates, cost, SLO(1.0, 0.05), **shape))
    assert [(r["policy"], r["rate"]) for r in rows] == [
        (p, r) for r in rates for p in ("static", "dynamic", "continuous")
    ]
    by = {(r["policy"], r["rate"]): r for r in rows}
    assert by["continuous", 2 * peak]["tokens_per_s"] > 1.2 * by["static", 2 * peak]["tokens_per_s"]
    assert by["continuous", 0.2 * peak]["ttft_p99_ms"] < by["static", 0.2 * peak]["ttft_p99_ms"]
    assert all(0 <= r["slo_met_pct"] <= 100 and r["goodput_rps"] <= r["requests_per_s"] + 1e-9 for r in rows)


def test_serving_figures_without_an_slo_have_no_goodput():
    requests = [Request([1, 2, 3], 4, id=0), Request([4, 5], 1, arrival=0.01, id=1)]
    outputs, engine = simulate(MODEL.config, requests, EngineConfig(16, 4, step_cost=StepCost()))
    plain, with_slo = serving_figures(outputs, engine), serving_figures(outputs, engine, SLO(1.0, 1.0))
    assert "goodput_rps" not in plain and with_slo["goodput_rps"] > 0 and with_slo["slo_met_pct"] == 100.0
    assert {k: v for k, v in with_slo.items() if k in plain} == plain
    assert plain["steps"] == engine.steps and plain["seconds"] == engine.now
    assert [r.id for r in requests] == [0, 1] and copy_requests(requests)[0] is not requests[0]


def test_interference_workload_and_itl_figures():
    shape = InterferenceWorkload(
        n_chat=2, chat_prompt=4, chat_tokens=12, n_long=2, long_prompt=40, long_tokens=2, first=0.02, gap=0.05
    )
    requests, chatting = interference_workload(VOCAB, shape)
    assert chatting == [0, 1] and [len(r.prompt) for r in requests] == [4, 4, 40, 40]
    assert [r.arrival for r in requests] == pytest.approx([0, 0, 0.02, 0.07])
    cost = StepCost(fixed=1e-3, per_token=1e-3, per_prefill_token=1e-3)
    whole = Engine(MODEL, EngineConfig(40, 4, scheduler=SchedulerConfig("continuous", 4), step_cost=cost))
    chunked_sched = SchedulerConfig("continuous", 4, token_budget=8)
    chunked = Engine(MODEL, EngineConfig(40, 4, scheduler=chunked_sched, step_cost=cost))
    a, b = itl_figures(whole.run(requests), chatting), itl_figures(chunked.run(copy_requests(requests)), chatting)
    assert a["itl_max_ms"] > 2 * b["itl_max_ms"]  # a whole 40-token prefill stalls the decodes; chunks of 6 do not
    assert a["itl_p50_ms"] <= a["itl_p99_ms"] <= a["itl_max_ms"]
