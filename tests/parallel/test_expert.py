"""Expert parallelism: the MoE layer split over gloo ranks gives the one-process outputs, a MoE model
split so gives its logits and greedy tokens, every byte the all-to-alls move is the count from the
routing's split sizes (the formula's when routing is uniform), and the load figures are right."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from minillm import generate
from minillm.parallel.comm import Comm
from minillm.parallel.expert import (
    AllToAllBytes,
    ExpertParallelMoE,
    MoEFeedForward,
    Routing,
    all_to_all_bytes,
    check_expert_parallel,
    count_exchange_bytes,
    ep_generate_run,
    ep_layer_run,
    expert_load,
    expert_rank,
    local_experts,
    moe_model,
    round_robin_routing,
    routed_all_to_all_bytes,
    split_sizes,
)
from minillm.parallel.launch import launch_several
from tests.conftest import tiny_config, tiny_model

D = 32  # tiny_config's d_model
FP32 = 4


def random_moe(n_experts: int, top_k: int, seed: int = 0) -> MoEFeedForward:
    torch.manual_seed(seed)
    moe = MoEFeedForward(tiny_config(), n_experts, top_k)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.2)
    return moe.eval()


# ---------------------------------------------------------------------------------------------
# One process


def test_routing_is_mixtrals_softmax_renormalised_over_the_top_k():
    moe = random_moe(8, 2)
    x = torch.randn(10, D)
    logits = moe.router(x)
    routing = moe.route(x)
    probs = torch.softmax(logits, -1)
    chosen = probs.gather(-1, routing.experts)
    torch.testing.assert_close(routing.gates, chosen / chosen.sum(-1, keepdim=True))
    assert torch.equal(routing.experts, logits.topk(2, -1).indices)  # highest logit first


def test_moe_layer_is_the_gated_sum_of_each_tokens_experts():
    moe = random_moe(4, 2)
    x = torch.randn(2, 5, D)  # (B, T, D): the layer flattens the tokens
    with torch.no_grad():
        y = moe(x)
        flat = x.reshape(-1, D)
        routing = moe.route(flat)
        for i in range(flat.shape[0]):  # token by token, as the definition reads
            want = sum(g * moe.experts[int(e)](flat[i]) for e, g in zip(routing.experts[i], routing.gates[i]))
            torch.testing.assert_close(y.reshape(-1, D)[i], want, atol=1e-6, rtol=1e-5)


def test_split_over_a_world_of_one_is_the_layer_and_moves_nothing():
    moe, comm = random_moe(4, 2), Comm()
    layer = ExpertParallelMoE(moe, comm)
    x = torch.randn(9, D)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), moe(x), atol=0, rtol=0)
    assert comm.counts() == {}
    assert layer.last_dispatch.expert_rows == expert_load(moe.route(x).experts, 4).per_expert


def test_experts_are_dealt_out_in_runs():
    assert [expert_rank(e, 8, 4) for e in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert list(local_experts(8, 4, 2)) == [4, 5]


def test_the_byte_formula():
    # 16 tokens, top-2, d_model 4096, bf16, 8 ranks: 16 x 2 x 4096 x 2 x 7/8
    assert all_to_all_bytes(16, 2, 4096, 2, 8) == 16 * 2 * 4096 * 2 * 7 / 8 == 229376
    assert all_to_all_bytes(16, 2, 4096, 2, 1) == 0
    assert count_exchange_bytes(8, 4) == 3 * 2 * 8


def test_routed_bytes_on_a_hand_made_routing():
    # 2 ranks, 4 experts (0, 1 on rank 0; 2, 3 on rank 1), top-2
    rank0 = torch.tensor([[0, 2], [1, 3], [0, 1]])  # 2 rows to rank 1
    rank1 = torch.tensor([[2, 3], [0, 3]])  # 1 row to rank 0
    assert split_sizes(rank0, 4, 2) == [4, 2] and split_sizes(rank1, 4, 2) == [1, 3]
    row = D * FP32
    assert routed_all_to_all_bytes([rank0, rank1], 4, D, FP32) == [
        AllToAllBytes(dispatch=2 * row, combine=1 * row),
        AllToAllBytes(dispatch=1 * row, combine=2 * row),
    ]


def test_round_robin_routing_is_uniform_and_meets_the_formula():
    routing = round_robin_routing(8, 8, 2)
    assert expert_load(routing.experts, 8, 4).per_expert == [2] * 8
    torch.testing.assert_close(routing.gates.sum(-1), torch.ones(8))
    by_rank = [round_robin_routing(8, 8, 2).experts for _ in range(4)]
    for counted in routed_all_to_all_bytes(by_rank, 8, D, FP32):
        assert counted.dispatch == counted.combine == all_to_all_bytes(8, 2, D, FP32, 4)


def test_load_imbalance_on_a_hand_made_routing():
    experts = torch.tensor([[0, 1], [0, 2], [0, 1], [3, 0]])  # expert 0 gets 4 of the 8 rows
    load = expert_load(experts, 4, world_size=2)
    assert load.per_expert == [4, 2, 1, 1]
    assert load.per_rank == [6, 2]
    assert load.expert_imbalance == 4 / 2
    assert load.rank_imbalance == 6 / 4
    assert expert_load(torch.zeros(0, 2, dtype=torch.long), 4).expert_imbalance == 1.0


@pytest.mark.parametrize(
    "n_experts, top_k, world, message",
    [
        (6, 2, 4, "6 experts cannot be split evenly over 4 ranks"),
        (4, 5, 1, "top_k 5 exceeds n_experts 4"),
        (4, 0, 1, "top_k must be a positive integer"),
        (0, 1, 1, "n_experts must be a positive integer"),
        (4, 2, True, "world size must be a positive integer"),
    ],
)
def test_impossible_layer_or_split_is_a_clear_error(n_experts, top_k, world, message):
    with pytest.raises(ValueError, match=message):
        check_expert_parallel(n_experts, top_k, world)


def test_bad_layer_split_and_routing_are_refused_by_name():
    with pytest.raises(ValueError, match="top_k 3 exceeds n_experts 2"):
        MoEFeedForward(tiny_config(), 2, 3)
    with pytest.raises(ValueError, match="4 experts cannot be split evenly over 3 ranks"):
        ExpertParallelMoE(random_moe(4, 2), SimpleNamespace(world_size=3, rank=0))
    moe, x = random_moe(4, 2), torch.randn(3, D)
    with pytest.raises(ValueError, match=r"routing must give \(tokens, top_k\) = \(3, 2\)"):
        moe(x, round_robin_routing(4, 4, 2))
    bad = Routing(torch.tensor([[0, 4]] * 3), torch.full((3, 2), 0.5))
    with pytest.raises(ValueError, match=r"expert outside 0..3"):
        moe(x, bad)


# ---------------------------------------------------------------------------------------------
# Several processes: one launch per world size runs every check


PROMPTS = ((3, 14, 15, 9, 26), (5, 35, 8, 96, 2, 7, 1), (4, 4, 20), (61, 2, 33, 8, 12, 40))
NEW_TOKENS = 12
# world -> (experts, top-k of the routed layer, tokens per rank, experts of the forced layer and model)
WORLDS = {2: (4, 2, (5, 12), 8), 4: (8, 2, (7, 3, 9, 6), 8)}
FORCED_TOKENS = 8  # per rank: 8 x 2 rows over 8 experts, two each


def moe_tiny_model(n_experts: int, top_k: int):
    return moe_model(tiny_model(seed=3), n_experts, top_k, seed=1, std=0.2)


@pytest.fixture(scope="module", params=sorted(WORLDS))
def run(request):
    world = request.param
    n_routed, k, tokens, n_forced = WORLDS[world]
    routed, forced = random_moe(n_routed, k, seed=world), random_moe(n_forced, k, seed=10 + world)
    gen = torch.Generator().manual_seed(world)
    xs = [torch.randn(n, D, generator=gen) for n in tokens]
    forced_xs = [torch.randn(FORCED_TOKENS, D, generator=gen) for _ in range(world)]
    routings = [round_robin_routing(FORCED_TOKENS, n_forced, k) for _ in range(world)]
    model = moe_tiny_model(n_forced, k)
    calls = [
        (ep_layer_run, (routed, xs, None)),
        (ep_layer_run, (forced, forced_xs, routings)),
        (ep_generate_run, (model, PROMPTS[:world], NEW_TOKENS)),
    ]
    results = launch_several(calls, world, timeout=60.0)
    return SimpleNamespace(
        world=world,
        k=k,
        routed=routed,
        xs=xs,
        forced=forced,
        forced_xs=forced_xs,
        routings=routings,
        model=model,
        results=results,
    )


@pytest.mark.slow
def test_split_layer_equals_one_process(run):
    for moe, xs, routings, results in (
        (run.routed, run.xs, None, run.results[0]),
        (run.forced, run.forced_xs, run.routings, run.results[1]),
    ):
        together = None  # one process: every rank's tokens in one batch, the router's routing
        if routings is not None:
            together = Routing(torch.cat([r.experts for r in routings]), torch.cat([r.gates for r in routings]))
        with torch.no_grad():
            want = moe(torch.cat(xs), together)
        got = torch.cat([r.output for r in results])
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_counted_bytes_are_the_routings_split_sizes(run):
    moe, results = run.routed, run.results[0]
    with torch.no_grad():
        by_rank = [moe.route(x).experts for x in run.xs]
    exact = routed_all_to_all_bytes(by_rank, moe.n_experts, D, FP32)
    sizes = {"calls": 1, "bytes": count_exchange_bytes(moe.n_experts, run.world)}
    for rank, (result, want) in enumerate(zip(results, exact)):
        assert result.counts["all_to_all"] == {"calls": 2, "bytes": want.total}, f"rank {rank}"
        assert result.counts["all_to_all_counts"] == sizes
        assert result.dispatch.send_splits == split_sizes(by_rank[rank], moe.n_experts, run.world)


@pytest.mark.slow
def test_counted_bytes_equal_the_formula_under_uniform_routing(run):
    for result in run.results[1]:
        formula = all_to_all_bytes(FORCED_TOKENS, run.k, D, FP32, run.world)
        assert result.counts["all_to_all"]["bytes"] == 2 * formula  # dispatch + combine
    total = sum(r.counts["all_to_all"]["bytes"] for r in run.results[1])
    assert total == 2 * all_to_all_bytes(FORCED_TOKENS * run.world, run.k, D, FP32, run.world)


@pytest.mark.slow
def test_each_rank_sees_the_global_load_of_its_experts(run):
    moe, results = run.routed, run.results[0]
    with torch.no_grad():
        experts = moe.route(torch.cat(run.xs)).experts
    load = expert_load(experts, moe.n_experts, run.world)
    assert [n for r in results for n in r.dispatch.expert_rows] == load.per_expert
    assert [sum(r.dispatch.expert_rows) for r in results] == load.per_rank
    assert [sum(r.dispatch.recv_splits) for r in results] == load.per_rank


@pytest.mark.slow
def test_split_moe_model_gives_the_same_logits_and_greedy_tokens(run):
    model, results = run.model, run.results[2]
    n_layers = model.config.n_layers
    for rank, result in enumerate(results):
        prompt = torch.tensor([PROMPTS[rank]])
        with torch.inference_mode():
            logits = model(prompt)[0]
        tokens = generate(model, prompt, NEW_TOKENS, eos_token_id=None).tokens[0].tolist()
        torch.testing.assert_close(result.prefill_logits, logits, atol=1e-5, rtol=1e-5)
        assert result.tokens == tokens, f"rank {rank}"
        assert result.counts["all_to_all"]["calls"] == 2 * n_layers * NEW_TOKENS  # one forward per token
        assert result.local_params < model.num_params()
