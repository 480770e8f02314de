import math

import numpy as np
import pytest

from minillm.measure.metrics import SLO
from minillm.measure.trace import (
    Service,
    decode_weight_bytes,
    load_sweep,
    mean_with_outlier,
    measure_services,
    poisson_arrivals,
    queue_wait,
    run_requests,
    schedule,
    summary,
    ttft_by_prompt_length,
)
from tests.conftest import tiny_model


def test_poisson_arrivals_are_seeded_sorted_and_at_the_rate():
    a = poisson_arrivals(2000, rate=50.0, seed=1)
    assert a == poisson_arrivals(2000, rate=50.0, seed=1) and a[0] == 0.0
    assert all(y >= x for x, y in zip(a, a[1:]))
    assert abs(len(a) / a[-1] - 50.0) < 5.0
    with pytest.raises(ValueError, match="rate"):
        poisson_arrivals(3, rate=0)


def test_schedule_queues_a_request_that_arrives_while_busy():
    s = [Service(4, (0.1, 0.2, 0.3)), Service(8, (0.2, 0.25))]
    first, second = schedule(s, [0.0, 0.05])
    assert first.ttft == pytest.approx(0.1) and first.finish == pytest.approx(0.3)
    assert second.token_times == pytest.approx([0.5, 0.55])  # waits for the first to finish at 0.3
    assert queue_wait(second, s[1]) == pytest.approx(0.25)
    assert second.ttft == pytest.approx(0.45) and second.input_tokens == 8
    idle = schedule(s, [0.0, 1.0])[1]  # arrives after the server is free: no wait
    assert idle.ttft == pytest.approx(0.2) and queue_wait(idle, s[1]) == pytest.approx(0.0)


def test_schedule_serves_in_arrival_order_not_list_order():
    s = [Service(1, (1.0,)), Service(1, (1.0,))]
    late, early = schedule(s, [0.5, 0.0])
    assert early.ttft == pytest.approx(1.0) and late.ttft == pytest.approx(1.5)


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


def test_load_sweep_goodput_falls_when_the_queue_builds():
    services = [Service(1, (0.05, 0.1))] * 50  # 0.1 s each: capacity 10 requests/s
    rows = load_sweep(services, [2.0, 40.0], SLO(ttft=0.2, tpot=0.1))
    low, high = rows
    assert low["goodput_rps"] == pytest.approx(low["served_rps"], rel=0.2)
    assert high["served_rps"] <= 10.0 + 1e-9 and high["goodput_rps"] < 0.2 * high["served_rps"]
    assert high["p99_ttft_ms"] > 1000


def test_decode_weight_bytes_counts_a_tied_table_once_and_skips_an_untied_input_table():
    tied = tiny_model(tie_embeddings=True)
    assert decode_weight_bytes(tied) == 4 * tied.num_params()
    untied = tiny_model(tie_embeddings=False)
    emb = untied.embed_tokens.weight
    assert decode_weight_bytes(untied) == 4 * (sum(p.numel() for p in untied.parameters()) - emb.numel())


def test_one_outlier_moves_the_mean_not_the_median():
    r = mean_with_outlier([1.0, 2.0, 3.0, 4.0], 100.0)
    assert r["mean"] == 2.5 and r["median"] == 2.5
    assert r["mean_with_outlier"] == 22.0 and r["median_with_outlier"] == 3.0


def test_ttft_by_prompt_length_and_plots_draw():
    import matplotlib

    matplotlib.use("Agg")
    from minillm.measure.trace import plot_latency_histogram, plot_load_sweep, plot_timeline

    model = tiny_model()
    rows = ttft_by_prompt_length(model, [[1] * 4, [1] * 32], repeats=1)
    assert [r["prompt_tokens"] for r in rows] == [4, 32] and all(r["ttft_ms"] > 0 for r in rows)
    ax = plot_latency_histogram(list(np.linspace(1, 10, 20)), "e2e (ms)", "t")
    assert "p50" in ax.get_legend().get_texts()[0].get_text()
    services = [Service(1, (0.1, 0.2))] * 3
    plot_timeline(schedule(services, [0.0, 0.05, 0.5]), services, "t")
    plot_load_sweep(load_sweep(services, [1.0, 5.0], SLO()), SLO(), "t")
    assert not math.isnan(rows[0]["ttft_ms"])
