import pytest

from minillm.measure.arrivals import poisson_arrivals
from minillm.measure.metrics import SLO
from minillm.measure.trace import (
    Service,
    decode_weight_bytes,
    load_sweep,
    mean_with_outlier,
    queue_wait,
    replay_fcfs,
    summary,
)
from tests.conftest import tiny_model


def test_poisson_arrivals_are_seeded_sorted_and_at_the_rate():
    a = poisson_arrivals(2000, rate=50.0, seed=1)
    assert a == poisson_arrivals(2000, rate=50.0, seed=1) and a[0] == 0.0
    assert all(y >= x for x, y in zip(a, a[1:]))
    assert abs(len(a) / a[-1] - 50.0) < 5.0
    with pytest.raises(ValueError, match="rate"):
        poisson_arrivals(3, rate=0)


def test_replay_fcfs_queues_a_request_that_arrives_while_busy():
    s = [Service(4, (0.1, 0.2, 0.3)), Service(8, (0.2, 0.25))]
    first, second = replay_fcfs(s, [0.0, 0.05])
    assert first.ttft == pytest.approx(0.1) and first.finish == pytest.approx(0.3)
    assert second.token_times == pytest.approx([0.5, 0.55])  # waits for the first to finish at 0.3
    assert queue_wait(second, s[1]) == pytest.approx(0.25)
    assert second.ttft == pytest.approx(0.45) and second.input_tokens == 8
    idle = replay_fcfs(s, [0.0, 1.0])[1]  # arrives after the server is free: no wait
    assert idle.ttft == pytest.approx(0.2) and queue_wait(idle, s[1]) == pytest.approx(0.0)


def test_replay_fcfs_serves_in_arrival_order_not_list_order():
    s = [Service(1, (1.0,)), Service(1, (1.0,))]
    late, early = replay_fcfs(s, [0.5, 0.0])
    assert early.ttft == pytest.approx(1.0) and late.ttft == pytest.approx(1.5)
    with pytest.raises(ValueError, match="arrival times"):
        replay_fcfs(s, [0.0])


def test_summary_has_one_row_per_metric_in_ms():
    reqs = replay_fcfs([Service(1, (0.1, 0.2, 0.4)), Service(1, (0.2,))], [0.0, 0.05])
    rows = summary(reqs)
    assert [r["metric"] for r in rows] == ["TTFT (ms)", "TPOT (ms)", "ITL (ms)", "e2e (ms)"]
    assert all(r["p50"] <= r["p99"] for r in rows)
    assert rows[1]["mean"] == pytest.approx(150.0)  # the one-token request has no TPOT


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
