"""The one load rule: the least-loaded worker (ties to the lowest index), the load kept from the
router's own bookkeeping, and the simulated cluster routing a request sequence exactly as the
router of the real worker processes does (``tests/serving/test_disagg.py`` holds the real one to
the same choices)."""

from __future__ import annotations

import pytest

from minillm.core.config import preset
from minillm.serving.cluster import ClusterConfig, roofline_step_cost, simulate_cluster
from minillm.serving.engine import EngineConfig
from minillm.serving.routing import Router, least_loaded
from minillm.serving.scheduler import SchedulerConfig
from minillm.serving.workload import Request

# Prompt and output lengths chosen so that the loads cross: a router that counted requests, or
# prompt tokens only, would pick differently from one that counts outstanding tokens.
SEQUENCE = [(300, 10), (20, 200), (50, 50), (10, 10), (400, 5), (5, 400), (60, 60), (30, 3)]


def requests(arrival: float = 0.0) -> list[Request]:
    return [Request([1] * p, m, arrival=arrival, id=i) for i, (p, m) in enumerate(SEQUENCE)]


def router_choices(roles: list[str]) -> list[tuple[int, int | None]]:
    """The workers the rule picks for SEQUENCE when every request arrives before any finishes."""
    router = Router(roles)
    return [(p.prefill_worker, p.decode_worker) for p in map(router.route, requests())]


def test_least_loaded_picks_the_smallest_load_and_the_lowest_index_on_ties():
    assert least_loaded([5, 3, 9], range(3)) == 1
    assert least_loaded([4, 2, 2, 7], range(4)) == 1  # a tie: the lower index
    assert least_loaded([0, 8, 1, 0], [1, 2, 3]) == 3  # only among the workers given
    assert least_loaded([7, 7, 7], [2, 0, 1]) == 0  # whatever order they come in


def test_the_load_is_outstanding_tokens_kept_from_the_routers_own_bookkeeping():
    router = Router(["prefill", "prefill", "decode", "decode"])
    a = router.route(Request([1] * 100, 30, id=0))
    assert (a.prefill_worker, a.decode_worker) == (0, 2) and router.load == [100, 0, 30, 0]
    b = router.route(Request([1] * 10, 5, id=1))
    assert (b.prefill_worker, b.decode_worker) == (1, 3) and router.load == [100, 10, 30, 5]
    c = router.route(Request([1] * 7, 8, id=2))  # worker 1 has 10 prompt tokens to feed, worker 0 has 100
    assert (c.prefill_worker, c.decode_worker) == (1, 3) and router.load == [100, 17, 30, 13]
    router.prefilled(0)  # its prompt is done: worker 0 is free, the decode worker still has 30 to make
    assert router.load == [0, 17, 30, 13]
    router.finished(0)
    router.finished(1)  # ended at its first token (no handoff): its prompt and its tokens leave together
    assert router.load == [0, 7, 0, 8] and set(router.placed) == {2}
    with pytest.raises(ValueError, match="already placed"):
        router.route(Request([1], 1, id=2))

    colocated = Router(["colocated"] * 2)
    assert colocated.route(Request([1] * 4, 6, id=0)).decode_worker is None
    assert colocated.load == [10, 0]
    with pytest.raises(ValueError, match="no handoff"):
        colocated.prefilled(0)
    colocated.finished(0)
    assert colocated.load == [0, 0]
    with pytest.raises(ValueError, match="colocated, or prefill and decode"):
        Router(["prefill", "colocated"])


def engine_config() -> EngineConfig:
    cost = roofline_step_cost(preset("Llama-3-8B"), peak_flops=989e12, bandwidth=3.35e12)
    return EngineConfig(num_blocks=512, scheduler=SchedulerConfig(max_batch=8), step_cost=cost)


def test_the_simulated_cluster_places_requests_as_the_rule_does():
    model = preset("Llama-3-8B")
    disagg = ClusterConfig(prefill=engine_config(), prefill_workers=2, decode_workers=2)
    run = simulate_cluster(model, requests(), disagg)
    placed = [(t.prefill_worker, 2 + t.decode_worker) for t in run.transfers]  # the router's numbering
    assert placed == router_choices(["prefill", "prefill", "decode", "decode"])
    assert placed == [(0, 2), (1, 3), (1, 2), (1, 2), (1, 2), (0, 2), (0, 3), (0, 3)]

    colocated = ClusterConfig(prefill=engine_config(), prefill_workers=3, decode_workers=0)
    run = simulate_cluster(model, requests(), colocated)
    served_by = [next(i for i, e in enumerate(run.prefill_engines) if r.id in e.outputs) for r in requests()]
    assert [(i, None) for i in served_by] == router_choices(["colocated"] * 3)


def test_a_handoff_frees_its_prefill_worker_for_the_next_arrival():
    """A long request prefilled at t=0 and still decoding when the next one arrives: with its
    prompt handed off, both prefill workers have no load and the tie goes to worker 0; a router
    that forgot the handoff would send the newcomer to worker 1."""
    model = preset("Llama-3-8B")
    cluster = ClusterConfig(prefill=engine_config(), prefill_workers=2, decode_workers=1)
    long, later = Request([1] * 400, 400, arrival=0.0, id=0), Request([1] * 50, 5, arrival=1.0, id=1)
    run = simulate_cluster(model, [long, later], cluster)
    first_token, last_token = run.outputs[0].metrics.token_times[0], run.outputs[0].metrics.token_times[-1]
    assert first_token < later.arrival < last_token  # prefilled, and still decoding when the second came
    assert [t.prefill_worker for t in run.transfers] == [0, 0]
