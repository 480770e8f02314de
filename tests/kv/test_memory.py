"""The KV memory formula: against live caches, published figures and its own corner cases."""

import pytest
import torch

from minillm import KVCache, preset, random_model
from minillm.kv.compressed import CrossLayerKVCache, SlidingWindowCache
from minillm.kv.memory import (
    PALM_540B_MHA,
    bytes_per_element,
    crossover_tokens,
    format_bytes,
    hybrid_kv_bytes,
    kv_bytes_per_token,
    kv_cache_bytes,
    kv_vs_weights,
    users_that_fit,
    weight_bytes,
    worked_examples,
)
from tests.conftest import tiny_config


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("overrides", [{}, {"n_kv_heads": 1}, {"n_kv_heads": 4, "head_dim": 6}])
def test_a_live_cache_weighs_exactly_what_the_formula_says(dtype, overrides):
    model = random_model(tiny_config(**overrides), dtype=dtype)
    for batch, max_len in [(1, 7), (3, 100)]:
        cache = KVCache.for_model(model, batch, max_len)
        assert cache.nbytes == kv_cache_bytes(model.config, max_len, batch, dtype)


def test_published_figures():
    l13, l70 = preset("Llama-2-13B"), preset("Llama-2-70B")
    assert kv_cache_bytes(l13, 2048, 32, "fp16") == pytest.approx(53.7e9, rel=1e-3)  # "about 54 GB"
    assert kv_cache_bytes(l70, 4096, 1, "fp16") == pytest.approx(1.342e9, rel=1e-3)  # GQA, 8 KV heads
    assert kv_cache_bytes(l70.replace(n_kv_heads=64), 4096, 1, "fp16") == pytest.approx(10.74e9, rel=1e-3)
    assert kv_cache_bytes(PALM_540B_MHA, 2048, 512, "bf16") == pytest.approx(6.08e12, rel=1e-2)
    assert kv_bytes_per_token(preset("Llama-3-8B"), "bf16") == 131072  # 128 KiB per token
    assert weight_bytes(preset("Llama-3-8B"), "bf16") == pytest.approx(16.06e9, rel=1e-3)


def test_worked_examples_are_computed_from_the_shapes():
    rows = {e.name.split(",")[0]: e for e in worked_examples()}
    l70 = rows["Llama-2-70B"]
    assert l70.claimed_bytes / l70.true_bytes == pytest.approx(4.0)  # x8 heads, /2 for K and V
    assert rows["Llama-2-13B"].claimed_bytes == rows["Llama-2-13B"].true_bytes
    assert "GB" in l70.row()["formula"]


def test_sliding_window_caps_and_crossover_balances():
    cfg = tiny_config(sliding_window=16)
    assert kv_cache_bytes(cfg, 1000) == kv_cache_bytes(cfg, 16)
    c = preset("Llama-3-8B")
    n = crossover_tokens(c)
    assert kv_cache_bytes(c, int(n), 1) <= weight_bytes(c) <= kv_cache_bytes(c, int(n) + 1, 1)
    rows = kv_vs_weights(c, [1, 64], [1024, 8192])
    assert len(rows) == 4 and rows[-1]["kv_over_weights"] > 1 > rows[0]["kv_over_weights"]
    assert users_that_fit(c, 8192, 80e9) == int((80e9 - weight_bytes(c)) // kv_cache_bytes(c, 8192))
    assert users_that_fit(c, 8192, 1e9) == 0


def test_hybrid_arithmetic_matches_the_caches_it_describes():
    cfg = tiny_config(n_layers=6)
    model = random_model(cfg)
    assert hybrid_kv_bytes(cfg, 50, 2, "fp32") == kv_cache_bytes(cfg, 50, 2, "fp32")
    shared = CrossLayerKVCache.for_model(model, 2, 50, group=2)
    assert hybrid_kv_bytes(cfg, 50, 2, "fp32", share_group=2) == shared.nbytes
    one_in_three = hybrid_kv_bytes(cfg, 100, 1, "fp32", window=10, global_every=3)  # 2 global, 4 local
    per_token_layer = 2 * cfg.n_kv_heads * cfg.head_dim * 4
    assert one_in_three == per_token_layer * (2 * 100 + 4 * 10)
    assert SlidingWindowCache.for_model(model, 1, 10).nbytes == per_token_layer * 6 * 10


def test_units_and_errors():
    assert format_bytes(53.7e9) == "53.7 GB" and format_bytes(512) == "512 B"
    assert bytes_per_element(torch.bfloat16) == 2 and bytes_per_element("int4") == 0.5
    with pytest.raises(ValueError, match="unknown dtype"):
        bytes_per_element("fp12")
    with pytest.raises(ValueError, match="non-negative"):
        kv_cache_bytes(tiny_config(), -1)
