"""The prefix-cache benchmark: its structure on a tiny random model, and that the radix tree finds
at least the hash chain's hits on the multi-turn workload (more: each turn's last partial block)."""

import pytest

from minillm.bench.prefix_cache import (
    CACHES,
    WORKLOADS,
    PrefixCacheBench,
    bench_prefix_caches,
    format_prefix_caches,
    make_workloads,
)
from tests.conftest import tiny_model

SMALL = PrefixCacheBench(
    conversations=2,
    turns=3,
    few_shot_prompts=4,
    examples=4,
    shots=2,
    stems=1,
    branches=2,
    message_len=(3, 9),
    answer_len=(2, 6),
    system_len=10,
    block_size=4,
    num_blocks=64,
    repeats=2,
)


def test_the_benchmark_measures_both_caches_on_every_workload():
    result = bench_prefix_caches(tiny_model(max_seq_len=512), SMALL)
    assert set(result["workloads"]) == set(WORKLOADS)
    for w in result["workloads"].values():
        assert w["answers_agree_pct"] == 100  # greedy: both caches give the same answers
        for c in CACHES:
            f = w[c]
            assert f["prefix_hit_tokens"] + f["prefill_tokens"] == w["prompt_tokens"]
            assert 0 < f["ttft_p50_ms"] <= f["ttft_p90_ms"] and f["peak_blocks"] > 0
        assert w["radix"]["prefix_hit_tokens"] >= w["hash"]["prefix_hit_tokens"]
    multi = result["workloads"]["multi_turn"]
    assert multi["radix"]["prefix_hit_tokens"] > multi["hash"]["prefix_hit_tokens"]
    cost = result["prefill_cost"]["ms_by_new_tokens"]
    assert list(cost) == [1, 4, 8, 16, 32, 64] and all(ms > 0 for ms in cost.values())
    table = format_prefix_caches(result)
    assert all(len(line) < 100 for line in table.splitlines()) and "multi_turn" in table


def test_the_workloads_share_prefixes_as_described():
    w = make_workloads(SMALL, 97)
    chats = w["multi_turn"]
    assert len(chats) == 6 and [t.parent for t in chats] == [None, None, 0, 1, 2, 3]
    assert len(w["few_shot"]) == 4 and all(t.parent is None for t in w["few_shot"])
    assert [t.parent for t in w["branching"]] == [None, 0, 0, 1, 1, 2, 2]


def test_bad_options_fail_clearly():
    with pytest.raises(ValueError, match="shots"):
        PrefixCacheBench(examples=2, shots=3)
    with pytest.raises(ValueError, match="message_len"):
        PrefixCacheBench(message_len=(5, 5))
