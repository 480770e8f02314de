"""Converting MHA to GQA, measuring a cache's effect on loss, and the technique benchmark."""

import pytest
import torch

from minillm import KVCache
from minillm.core.cache import SlidingWindowCache
from minillm.kv.gqa import decode_tokens_per_s, gqa_heads, kv_benchmark, streaming_loss, techniques, to_gqa
from tests.conftest import tiny_model


def test_gqa_conversion_is_exact_when_the_pooled_heads_are_already_equal():
    model = tiny_model(seed=1, n_heads=4, n_kv_heads=4)
    hd, H = model.config.head_dim, 4
    with torch.no_grad():
        for layer in model.layers:
            w = layer.self_attn.qkv_proj.weight  # rows: q (H*hd), k (H*hd), v (H*hd)
            for part in (1, 2):  # make K/V heads 0=1 and 2=3: pooling pairs loses nothing
                heads = w[part * H * hd : (part + 1) * H * hd].view(H, hd, -1)
                heads[1], heads[3] = heads[0], heads[2]
    x = torch.randint(0, 97, (2, 20))
    gqa = to_gqa(model, 2)
    assert gqa.config.n_kv_heads == 2 and gqa.num_params() < model.num_params()
    torch.testing.assert_close(gqa(x), model(x), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(to_gqa(model, 4)(x), model(x))


def test_gqa_conversion_of_distinct_heads_changes_the_model_and_checks_its_input():
    model = tiny_model(seed=2, n_heads=4, n_kv_heads=4)
    x = torch.randint(0, 97, (1, 12))
    assert not torch.allclose(to_gqa(model, 1)(x), model(x), atol=1e-3)
    with pytest.raises(ValueError, match="must divide"):
        to_gqa(model, 3)


def test_streaming_loss_through_a_full_cache_equals_one_forward_and_a_window_raises_it():
    model = tiny_model(seed=3)
    text = torch.randint(0, 97, (80,))
    whole = streaming_loss(model, text)
    assert streaming_loss(model, text, KVCache.for_model(model, 1, 80), chunk=7) == pytest.approx(whole, rel=1e-5)
    assert streaming_loss(model, text, SlidingWindowCache.for_model(model, 1, 4), chunk=7) != pytest.approx(whole)


def test_benchmark_measures_every_technique_and_its_bytes():
    cfg = tiny_model(n_heads=4, n_kv_heads=4).config
    cfg = cfg.replace(max_seq_len=40)  # the benchmark stretches the context for the timed steps
    rows = kv_benchmark(cfg, contexts=(16, 40), new_tokens=2, repeats=3, chosen=techniques(window=8, budget=8))
    by = {(r["technique"], r["context"]): r for r in rows}
    assert len(rows) == 2 * len(techniques())
    assert all(r["tokens_per_s"] > 0 for r in rows)
    base = by[("MHA (baseline)", 40)]["kv_bytes"]
    gqa = by[("GQA (about 1/4 of the K/V heads)", 40)]
    assert gqa["kv_bytes"] * 2 == base and gqa["kv_heads"] == 2  # 4 heads: 2 is the divisor nearest 4 / 4 above 1
    assert by[("MQA (1 K/V head)", 40)]["kv_bytes"] * 4 == base
    assert by[("cross-layer, groups of 2", 40)]["kv_bytes"] * 2 == base
    assert by[("sliding window 8", 40)]["kv_bytes"] == by[("sliding window 8", 16)]["kv_bytes"] == base * 8 // 40


def test_gqa_heads_picks_a_divisor_near_a_quarter():
    assert [gqa_heads(h) for h in (32, 9, 8, 15, 7, 4, 2)] == [8, 3, 2, 3, 1, 2, 1]


def test_decode_speed_leaves_a_contiguous_cache_at_its_context():
    model = tiny_model()
    cache = KVCache.for_model(model, 2, 64)
    assert decode_tokens_per_s(model, cache, 30, new_tokens=4, repeats=2) > 0
    assert cache.length == 30  # the warm-up and every timed repeat were rolled back
