"""Chapter 6's counts and measurements: KV memory waste, block sizes, a shared system prompt."""

import pytest

from minillm import preset
from minillm.bench.paging import (
    bench_prefix_cache,
    block_size_rows,
    gather_times,
    memory_waste,
    prefix_sharing_memory,
    shared_prompt_savings,
    waste_while_growing,
)
from tests.conftest import tiny_model

MODEL = tiny_model()


def test_prefix_sharing_memory_counts_blocks_exactly():
    m = prefix_sharing_memory(MODEL.config, n=4, system_len=32, suffix_len=8, output_len=8, block_size=4)
    assert m["without_cache"]["peak_blocks"] == 4 * 12 and m["without_cache"]["prefix_hit_tokens"] == 0
    assert m["with_cache"]["peak_blocks"] == 8 + 4 * 4 and m["with_cache"]["prefix_hit_tokens"] == 3 * 32
    assert m["saving_pct"] == pytest.approx(50.0)


def test_shared_prompt_arithmetic_and_block_size_rows():
    c = preset("Llama-3-8B")
    s = shared_prompt_savings(c, 1000, 1e6, concurrent=64, dtype="bf16", peak_flops=1e15, mfu=0.5)
    assert s["prompt_tokens_per_day"] == 1e9 and s["prefill_flops_per_day"] == 2 * c.num_params() * 1e9
    assert s["accelerator_hours_per_day"] == pytest.approx(2 * c.num_params() * 1e9 / 5e14 / 3600)
    assert s["kv_bytes_per_copy"] == 131072 * 1000 and s["kv_bytes_unshared"] == 64 * s["kv_bytes_per_copy"]
    rows = block_size_rows([16, 17, 100], [1, 16, 64], system_len=1000, context=4096)
    assert [r["shared_system_tokens"] for r in rows] == [1000, 992, 960]
    assert [r["table_entries"] for r in rows] == [4096, 256, 64] and rows[0]["waste_pct"] == 0.0
    times = gather_times(MODEL.config, [1, 8], batch=2, context=32, repeats=3)
    assert set(times) == {1, 8} and all(0 < t["q1_ms"] <= t["median_ms"] <= t["q3_ms"] for t in times.values())


def test_memory_waste_contiguous_against_paged():
    w = memory_waste([10, 16, 30], max_len=32, block_sizes=(1, 16))
    assert w["sequences"] == 3 and w["mean_length"] == pytest.approx(56 / 3)
    assert [r["paged_waste_pct"] for r in w["rows"]] == pytest.approx([0.0, 100 * (1 - 56 / 64)])
    assert all(r["contiguous_waste_pct"] == pytest.approx(100 * (1 - 56 / 96)) for r in w["rows"])


def test_waste_while_growing_counts_every_length_held():
    # prompt 3, final 6: lengths 3, 4, 5 in blocks of 4 hold 4 + 4 + 8 slots for 12 tokens
    assert waste_while_growing([3], [6], 4) == pytest.approx(1 - 12 / 16)
    assert waste_while_growing([4, 8], [5, 9], 4) == 0.0


def test_bench_prefix_cache_counts_only_the_requests_after_the_first():
    pc = bench_prefix_cache(MODEL, n=3, system_len=16, suffix_len=4, output_len=2, block_size=4)
    assert pc["requests"] == 3 and pc["system_len"] == 16
    for key in ("without_cache", "with_cache"):
        assert pc[key]["ttft_ms_mean"] > 0 and pc[key]["ttft_ms_p50"] > 0
    assert pc["ttft_saving_pct"] == pytest.approx(
        100 * (1 - pc["with_cache"]["ttft_ms_mean"] / pc["without_cache"]["ttft_ms_mean"])
    )
