"""Every cache kind against the computation it stands for.

- the ring buffer equals full attention under a window mask;
- cross-layer sharing equals an explicit model whose grouped layers read the same K/V;
- int8 stays within a stated tolerance of full precision on the bundled model;
- selective KV with a budget of at least the sequence equals the full cache;
- caches with a capacity reject writes past it; those that evict keep a fixed size.
"""

import math

import pytest
import torch

import minillm
from minillm import generate
from minillm.core.attention import attention_reference
from minillm.core.cache import CacheFullError, KVCache
from minillm.core.model import rope_cos_sin
from minillm.kv.compressed import (
    CrossLayerKVCache,
    QuantizedKVCache,
    SelectiveKVCache,
    SlidingWindowCache,
    dequantize_int8,
    quantize_int8,
)
from tests.conftest import tiny_model


def ids(n, seed=0, vocab=97, batch=1):
    return torch.randint(0, vocab, (batch, n), generator=torch.Generator().manual_seed(seed))


def logits_through(model, x, cache, chunk):
    """Feed x (B, N) through a cache ``chunk`` tokens at a time; all the logits (B, N, V)."""
    return torch.cat([model(x[:, s : s + chunk], cache=cache) for s in range(0, x.shape[1], chunk)], dim=1)


# --- sliding window ----------------------------------------------------------------------------


@pytest.mark.parametrize("window, chunk, slack", [(8, 1, 0), (8, 5, 0), (8, 30, 0), (12, 7, 3), (5, 64, 2)])
def test_ring_buffer_equals_full_attention_under_a_window_mask(window, chunk, slack):
    model = tiny_model(seed=1)
    windowed = tiny_model(seed=1, sliding_window=window)  # same weights, the window in the config
    x = ids(64, seed=2, batch=2)
    expected = windowed(x)  # one forward, the window applied by the mask
    ring = SlidingWindowCache.for_model(model, 2, window, slack=slack)
    got = logits_through(model, x, ring, chunk)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)
    assert ring.nbytes == 2 * 2 * 2 * (window + slack) * model.config.n_kv_heads * model.config.head_dim * 4
    kept = sorted(p for p in ring.positions[0].tolist() if p >= 0)
    assert kept == list(range(64 - window - slack, 64))  # exactly the last tokens, memory fixed


def test_ring_buffer_generates_what_a_windowed_model_generates():
    model, windowed = tiny_model(seed=3), tiny_model(seed=3, sliding_window=10)
    prompts = [ids(23, seed=4)[0].tolist(), ids(9, seed=5)[0].tolist()]
    ring = SlidingWindowCache.for_model(model, 2, 10)
    got = generate(model, prompts, 40, eos_token_id=None, cache=ring).tokens
    assert got.tolist() == generate(windowed, prompts, 40, eos_token_id=None).tokens.tolist()
    assert got.tolist() != generate(model, prompts, 40, eos_token_id=None).tokens.tolist()  # the window matters


def test_ring_buffer_rolls_back_within_its_slack_and_refuses_more():
    model, windowed = tiny_model(seed=6), tiny_model(seed=6, sliding_window=6)
    x = ids(30, seed=7)
    ring = SlidingWindowCache.for_model(model, 1, 6, slack=4)
    logits_through(model, x[:, :26], ring, 3)
    ring.truncate(22)  # roll back 4 tokens, then write different ones
    y = torch.cat([x[:, :22], ids(8, seed=8)], dim=1)
    torch.testing.assert_close(logits_through(model, y[:, 22:], ring, 2), windowed(y)[:, 22:], atol=2e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="slack=4"):
        ring.truncate(ring.length - 5)


# --- cross-layer sharing -----------------------------------------------------------------------


def explicit_cross_layer_logits(model, x, group):
    """A full forward written out layer by layer: layer i uses the K/V computed by layer i - i % group."""
    cfg = model.config
    B, T = x.shape
    H, Hkv, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    pos = torch.arange(T).expand(B, T)
    cos, sin = rope_cos_sin(pos, model.inv_freq, torch.float32)
    h = model.embed_tokens(x)
    for i, layer in enumerate(model.layers):
        attn = layer.self_attn
        qkv = attn.qkv_proj(layer.input_layernorm(h)).view(B, T, H + 2 * Hkv, hd).transpose(1, 2)
        q = qkv[:, :H] * cos + torch.cat([-qkv[:, :H, :, hd // 2 :], qkv[:, :H, :, : hd // 2]], -1) * sin
        if i % group == 0:  # the owner of the group computes K/V; the others reuse them
            k = (
                qkv[:, H : H + Hkv] * cos
                + torch.cat([-qkv[:, H : H + Hkv, :, hd // 2 :], qkv[:, H : H + Hkv, :, : hd // 2]], -1) * sin
            )
            v = qkv[:, H + Hkv :]
        y = attention_reference(q, k, v, None, causal=True)
        h = h + attn.o_proj(y.transpose(1, 2).reshape(B, T, H * hd))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return model.lm_head(model.norm(h))


@pytest.mark.parametrize("group, n_layers", [(2, 4), (3, 4), (4, 4), (1, 2)])
def test_cross_layer_cache_equals_an_explicit_model_whose_grouped_layers_share_kv(group, n_layers):
    model = tiny_model(seed=9, n_layers=n_layers)
    x = ids(20, seed=10, batch=2)
    cache = CrossLayerKVCache.for_model(model, 2, 32, group=group)
    got = logits_through(model, x, cache, 6)
    torch.testing.assert_close(got, explicit_cross_layer_logits(model, x, group), atol=2e-5, rtol=1e-4)
    assert cache.k.shape[0] == math.ceil(n_layers / group)  # memory / group size
    if group > 1:
        assert not torch.allclose(got, model(x), atol=1e-3)  # sharing changes the model


# --- int8 ----------------------------------------------------------------------------------------


def test_int8_round_trip_error_is_within_half_a_step_per_token_and_head():
    x = torch.randn(2, 3, 17, 16) * torch.rand(2, 3, 17, 1) * 10
    q, scale = quantize_int8(x)
    assert q.dtype == torch.int8 and scale.shape == (2, 3, 17, 1)
    err = (dequantize_int8(q, scale, torch.float32) - x).abs()
    assert (err <= scale / 2 + 1e-6).all()
    assert (q.abs().amax(dim=-1) == 127).all()  # each vector uses the full range


# On the bundled target (fp32, 256 tokens of corpus text; its logits have a std of about 2.8):
INT8_MAX_LOGIT_DIFF = 0.2  # observed ~0.09
INT8_MEAN_KL = 1e-4  # nats per token, observed ~2e-5


@pytest.mark.xdist_group("bundled")
def test_int8_cache_stays_within_tolerance_of_fp32_on_the_bundled_model():
    model, tok = minillm.load("minillm-target")
    from minillm.training.corpus import corpus_prompt

    x = torch.tensor([corpus_prompt(tok, 256)])
    exact = model(x)
    cache = QuantizedKVCache.for_model(model, 1, 256)
    got = logits_through(model, x, cache, 32)
    assert 0 < (got - exact).abs().max().item() < INT8_MAX_LOGIT_DIFF
    log_p, log_q = exact.log_softmax(-1), got.log_softmax(-1)
    assert (log_p.exp() * (log_p - log_q)).sum(-1).mean() < INT8_MEAN_KL
    assert 0 < cache.relative_error < 0.01  # the stored K/V are within 1% (RMS) of the originals
    assert (got.argmax(-1) == exact.argmax(-1)).float().mean() > 0.98
    full = KVCache.for_model(model, 1, 256)
    assert cache.nbytes / full.nbytes == pytest.approx((1 + 4 / model.config.head_dim) / 4)


# --- selective -----------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["recent", "heavy"])
def test_selective_cache_with_room_for_everything_equals_the_full_cache(policy):
    model = tiny_model(seed=11)
    prompts = [ids(15, seed=12)[0].tolist(), ids(7, seed=13)[0].tolist()]
    cache = SelectiveKVCache.for_model(model, 2, 15 + 30, policy=policy)
    got = generate(model, prompts, 30, eos_token_id=None, cache=cache)
    assert got.tokens.tolist() == generate(model, prompts, 30, eos_token_id=None).tokens.tolist()
    assert cache.evicted == 0


def test_sinks_and_recent_keep_exactly_the_first_and_the_last_tokens():
    model = tiny_model(seed=14)
    cache = SelectiveKVCache.for_model(model, 1, 12, policy="recent", n_sink=3)
    logits_through(model, ids(40, seed=15), cache, 5)
    cache.compress()
    assert cache.positions[0].tolist() == [0, 1, 2] + list(range(31, 40))
    assert cache.evicted == 40 - 12 and cache.used == 12


def test_heavy_hitters_keep_the_most_attended_tokens():
    model = tiny_model(seed=16)
    cache = SelectiveKVCache.for_model(model, 1, 8, policy="heavy", n_sink=1, n_recent=2)
    x = ids(8, seed=17)
    model(x, cache=cache)  # exactly full
    cache.scores[:] = torch.tensor([[0.0, 50, 0, 90, 10, 70, 0, 0]])  # attention each token has received
    model(ids(3, seed=18), cache=cache)  # 11 tokens: 3 must go (this forward adds < 24 to any score)
    cache.compress()
    # kept: the sink (0), the 2 most recent (9, 10) and the 5 top scores among the rest: 1, 3, 4, 5 and one more
    kept = cache.positions[0].tolist()
    assert kept[0] == 0 and kept[-2:] == [9, 10] and kept == sorted(kept)
    assert {1, 3, 4, 5} <= set(kept) and len({2, 6, 7, 8} & set(kept)) == 1


def test_selective_cache_evicting_changes_the_output_and_keeps_its_size():
    model = tiny_model(seed=19)
    prompt = ids(60, seed=20)[0].tolist()
    full = generate(model, prompt, 20, eos_token_id=None).tokens
    cache = SelectiveKVCache.for_model(model, 1, 16, policy="heavy")
    nbytes = cache.nbytes
    got = generate(model, prompt, 20, eos_token_id=None, cache=cache).tokens
    assert cache.nbytes == nbytes and cache.used == 16 and cache.evicted > 0
    assert got.tolist() != full.tolist()
    with pytest.raises(ValueError, match="cannot roll back"):
        cache.truncate(10)


# --- capacity and input errors -------------------------------------------------------------------


@pytest.mark.parametrize("kind", [KVCache, CrossLayerKVCache, QuantizedKVCache])
def test_caches_with_a_capacity_reject_writes_past_it(kind):
    model = tiny_model()
    cache = kind.for_model(model, 1, 10)
    model(ids(8), cache=cache)
    with pytest.raises(CacheFullError, match="8 of 10 slots used, cannot write 3"):
        model(ids(3), cache=cache)
    model(ids(2), cache=cache)  # exactly full is fine
    assert cache.length == 10


@pytest.mark.parametrize(
    "make",
    [
        lambda m: KVCache.for_model(m, 2, 16),
        lambda m: SlidingWindowCache.for_model(m, 2, 4),
        lambda m: SelectiveKVCache.for_model(m, 2, 8),
        lambda m: QuantizedKVCache.for_model(m, 2, 16),
    ],
)
def test_a_cache_refuses_a_batch_it_was_not_built_for(make):
    model = tiny_model()
    with pytest.raises(ValueError, match="batch size 2, got 3"):
        model(ids(4, batch=3), cache=make(model))
    with pytest.raises(ValueError, match="must be empty"):
        cache = make(model)
        model(ids(2, batch=2), cache=cache)
        generate(model, ids(2, batch=2), 2, cache=cache)


def test_bad_cache_options_are_named():
    cfg = tiny_model().config
    with pytest.raises(ValueError, match="window"):
        SlidingWindowCache(cfg, 1, 0)
    with pytest.raises(ValueError, match="group"):
        CrossLayerKVCache(cfg, 1, 8, group=0)
    with pytest.raises(ValueError, match="policy"):
        SelectiveKVCache(cfg, 1, 8, policy="oldest")
    with pytest.raises(ValueError, match="n_sink \\+ n_recent <= budget"):
        SelectiveKVCache(cfg, 1, 8, n_sink=4, n_recent=6)


# --- helpers for verifying candidates: tree_mask and keep_slots ----------------------------------


def test_tree_mask_lets_each_new_token_see_only_its_branch():
    model = tiny_model(seed=21)
    prefix, a, b = ids(6, seed=22), ids(3, seed=23), ids(3, seed=24)
    cache = KVCache.for_model(model, 1, 32)
    model(prefix, cache=cache)
    # two branches of 3 after the prefix, side by side: positions 6,7,8 each
    tree = torch.zeros(6, 6, dtype=torch.bool)
    tree[:3, :3] = tree[3:, 3:] = torch.ones(3, 3, dtype=torch.bool).tril()
    pos = torch.tensor([[6, 7, 8, 6, 7, 8]])
    both = model(torch.cat([a, b], dim=1), positions=pos, cache=cache, tree_mask=tree)
    torch.testing.assert_close(both[:, :3], model(torch.cat([prefix, a], 1))[:, 6:], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(both[:, 3:], model(torch.cat([prefix, b], 1))[:, 6:], atol=2e-5, rtol=1e-4)
    cache.keep_slots(6, [9, 10, 11])  # accept branch b: its K/V move next to the prefix
    nxt = ids(2, seed=25)
    torch.testing.assert_close(
        model(nxt, cache=cache), model(torch.cat([prefix, b, nxt], 1))[:, 9:], atol=2e-5, rtol=1e-4
    )


def test_tree_mask_shape_and_cache_kind_are_checked():
    model = tiny_model()
    with pytest.raises(ValueError, match="tree_mask must be \\(3, 3\\)"):
        model(ids(3), tree_mask=torch.ones(2, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="in_order"):
        model(ids(3), cache=SlidingWindowCache.for_model(model, 1, 4), tree_mask=torch.ones(3, 3, dtype=torch.bool))
    cache = KVCache.for_model(model, 1, 8)
    model(ids(4), cache=cache)
    with pytest.raises(ValueError, match="slots must increase"):
        cache.keep_slots(1, [3, 2])


def test_sinks_of_a_left_padded_row_are_its_first_tokens_not_the_padding():
    from minillm.core.generate import left_pad

    model = tiny_model(seed=26)
    x, pos = left_pad([ids(30, seed=27)[0].tolist(), ids(10, seed=28)[0].tolist()], 0, "cpu")
    cache = SelectiveKVCache.for_model(model, 2, 8, policy="recent", n_sink=2)
    model(x, positions=pos, cache=cache)
    cache.compress()
    assert cache.positions.tolist() == [[0, 1] + list(range(24, 30)), [0, 1] + list(range(4, 10))]
