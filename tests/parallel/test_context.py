import itertools

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from minillm.core.cache import KVCache
from minillm.core.checkpoints import load
from minillm.parallel.comm import Comm
from minillm.parallel.context import (
    PrefillSpec,
    RingSpec,
    attention_with_lse,
    causal_work,
    contiguous_layout,
    imbalance,
    make_layout,
    merge_partials,
    pad_tokens,
    padded_length,
    padding_tokens,
    ring_attention_with_stats,
    ring_bytes,
    ring_check,
    run_checks,
    skipped_blocks,
    zigzag_layout,
)
from minillm.parallel.launch import launch

pytestmark = pytest.mark.slow  # several processes, a compile or a server: make test-fast leaves it out

RING_SPECS = tuple(
    RingSpec(seed=i, batch=2, n_heads=4, n_kv_heads=kv, head_dim=8, seq_len=T, layout=layout)
    for i, (T, layout, kv) in enumerate(itertools.product((13, 37), ("contiguous", "zigzag"), (4, 2)))
)
PREFILL_SPECS = (PrefillSpec(seq_len=37, layout="zigzag"), PrefillSpec(seq_len=21, layout="contiguous"))


def full_causal(spec: RingSpec) -> torch.Tensor:
    q, k, v = spec.tensors()
    n_rep = spec.n_heads // spec.n_kv_heads
    k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, hd)


def positions(T: int, batch: int = 2) -> torch.Tensor:
    return torch.arange(T).expand(batch, T)


# --- in one process ------------------------------------------------------------------------------


def test_attention_with_lse_over_the_whole_sequence_is_causal_attention():
    spec = RingSpec(n_kv_heads=2, seq_len=11)
    q, k, v = spec.tensors()
    out, lse = attention_with_lse(q, k, v, positions(11), positions(11))
    assert_close(out, full_causal(spec), atol=1e-5, rtol=1e-5)
    scores = q @ k.repeat_interleave(2, dim=1).transpose(-2, -1) / spec.head_dim**0.5
    expected = scores.masked_fill(~torch.ones(11, 11, dtype=torch.bool).tril(), float("-inf")).logsumexp(-1)
    assert_close(lse, expected, atol=1e-5, rtol=1e-5)


def test_merge_of_two_halves_is_full_attention_in_either_order():
    spec = RingSpec(n_kv_heads=2, seq_len=12)
    q, k, v = spec.tensors()
    pos = positions(12)
    a = attention_with_lse(q, k[:, :, :5], v[:, :, :5], pos, pos[:, :5])
    b = attention_with_lse(q, k[:, :, 5:], v[:, :, 5:], pos, pos[:, 5:])
    full_out, full_lse = attention_with_lse(q, k, v, pos, pos)
    for first, second in ((a, b), (b, a)):
        out, lse = merge_partials(*first, *second)
        assert_close(out, full_causal(spec), atol=1e-5, rtol=1e-5)
        assert_close(lse, full_lse, atol=1e-5, rtol=1e-5)


def test_a_query_that_sees_nothing_gets_zero_and_minus_infinity_without_nan():
    spec = RingSpec(seq_len=4)
    q, k, v = spec.tensors()
    future = torch.tensor([[10, 11, 12, 13]] * 2)
    out, lse = attention_with_lse(q, k, v, positions(4), future)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
    padding = torch.full((2, 4), -1)
    out, lse = attention_with_lse(q, k, v, positions(4), padding)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
    # merging with nothing changes nothing; nothing with nothing stays nothing
    real = attention_with_lse(q, k, v, positions(4), positions(4))
    for merged, expected in ((merge_partials(out, lse, *real), real), (merge_partials(*real, out, lse), real)):
        assert_close(merged[0], expected[0])
        assert_close(merged[1], expected[1])
    empty_out, empty_lse = merge_partials(out, lse, out, lse)
    assert not empty_out.isnan().any() and torch.isneginf(empty_lse).all()


@pytest.mark.parametrize("make", [contiguous_layout, zigzag_layout])
@pytest.mark.parametrize("T, world", [(13, 2), (37, 4), (8, 4), (5, 4), (1, 1), (100, 3)])
def test_layouts_cover_every_token_once_and_differ_by_at_most_a_chunk(make, T, world):
    layout = make(T, world)
    assert len(layout) == world and sorted(sum(layout, [])) == list(range(T))
    assert all(tokens == sorted(tokens) for tokens in layout)
    sizes = [len(t) for t in layout]
    assert min(sizes) >= 1 and max(sizes) - min(sizes) <= (1 if make is contiguous_layout else 2)


def test_zigzag_gives_rank_r_chunks_r_and_2p_minus_1_minus_r():
    assert zigzag_layout(8, 2) == [[0, 1, 6, 7], [2, 3, 4, 5]]
    assert zigzag_layout(9, 2) == [[0, 1, 2, 7, 8], [3, 4, 5, 6]]  # chunks of 3, 2, 2, 2
    assert contiguous_layout(9, 2) == [[0, 1, 2, 3, 4], [5, 6, 7, 8]]


def test_causal_work_contiguous_is_imbalanced_and_zigzag_nearly_balanced():
    assert causal_work([[0, 1], [2, 3]]) == [1 + 2, 3 + 4]
    for world in (2, 4, 8):
        T = 64 * world
        contiguous, zigzag = causal_work(contiguous_layout(T, world)), causal_work(zigzag_layout(T, world))
        assert sum(contiguous) == sum(zigzag) == T * (T + 1) // 2
        assert imbalance(contiguous) == pytest.approx((2 * world - 1) / world, rel=0.02)
        assert imbalance(zigzag) < 1.01
        assert skipped_blocks(contiguous_layout(T, world)) == [world - 1 - r for r in range(world)]
        assert skipped_blocks(zigzag_layout(T, world)) == [0] * world


def test_ring_bytes_formula_and_padding():
    # (p - 1) x (K + V: 2 * B * Hkv * L * hd * 4 bytes, + positions: B * L * 8 bytes)
    assert ring_bytes(world=4, batch=2, n_kv_heads=2, slice_len=10, head_dim=8) == 3 * (2 * 2 * 2 * 10 * 8 * 4 + 160)
    assert ring_bytes(world=1, batch=2, n_kv_heads=2, slice_len=10, head_dim=8) == 0
    layout = zigzag_layout(13, 4)  # 8 chunks of 2, 2, 2, 2, 2, 1, 1, 1: ranks hold 3, 3, 3, 4 tokens
    assert [len(t) for t in layout] == [3, 3, 3, 4]
    assert padded_length(layout) == 4 and padding_tokens(layout) == [1, 1, 1, 0]
    full, padding = (ring_bytes(4, 2, 2, n, 8) for n in (4, 1))
    assert full == 4 * padding == 3 * 4 * (2 * 2 * 2 * 8 * 4 + 2 * 8)  # a quarter of rank 0's bytes is padding
    x = torch.ones(2, 3)
    assert torch.equal(pad_tokens(x, 5, dim=1, value=-1)[:, 3:], torch.full((2, 2), -1.0))


def test_a_single_rank_ring_is_plain_causal_attention_and_sends_nothing():
    spec = RingSpec(n_kv_heads=2, seq_len=9)
    q, k, v = spec.tensors()
    comm = Comm()  # no process group: a world of one
    out, stats = ring_attention_with_stats(q, k, v, positions(9), positions(9), comm)
    assert_close(out, full_causal(spec), atol=1e-5, rtol=1e-5)
    assert comm.counts() == {} and stats.blocks_computed == 1 and stats.visible_pairs == 2 * 45
    result = ring_check(0, 1, spec)
    assert_close(torch.from_numpy(result.out), full_causal(spec), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: contiguous_layout(3, 4), "shorter than world"),
        (lambda: zigzag_layout(10, 0), "world must be a positive integer"),
        (lambda: zigzag_layout(0, 2), "seq_len must be"),
        (lambda: make_layout("striped", 10, 2), "layout must be one of"),
        (lambda: RingSpec(n_heads=4, n_kv_heads=3), "multiple of n_kv_heads"),
        (lambda: RingSpec(head_dim=0), "head_dim must be"),
        (lambda: RingSpec(layout="random"), "layout must be one of"),
        (lambda: PrefillSpec(seq_len=0), "seq_len must be"),
    ],
)
def test_bad_input_is_a_clear_value_error(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# --- ranks ---------------------------------------------------------------------------------------


CASES = tuple((world, spec) for world in (2, 4) for spec in RING_SPECS) + tuple((2, s) for s in PREFILL_SPECS)


@pytest.fixture(scope="module")
def ranks() -> dict[tuple[int, object], list]:
    """ONE launch of 4 ranks runs every case: world-2 cases on both pairs (0, 1) and (2, 3),
    world-4 cases on all four. {(world, spec): that group's results in group-rank order}."""
    per_rank = launch(run_checks, 4, CASES, timeout=60.0, threads=1)
    out = {}
    for i, (world, spec) in enumerate(CASES):
        groups = [[per_rank[r][i] for r in range(start, start + world)] for start in range(0, 4, world)]
        out[world, spec] = groups[0]
        out["other", world, spec] = groups[-1]
    return out


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case", range(len(RING_SPECS)))
def test_ring_attention_reassembled_is_full_causal_attention(ranks, world, case):
    spec = RING_SPECS[case]
    results = ranks[world, spec]
    layout = make_layout(spec.layout, spec.seq_len, world)
    assembled = torch.empty_like(full_causal(spec))
    for rank, result in enumerate(results):
        assert result.tokens == layout[rank]
        assembled[:, :, result.tokens] = torch.from_numpy(result.out)
    assert_close(assembled, full_causal(spec), atol=1e-5, rtol=1e-5)
    for mine, theirs in zip(results, ranks["other", world, spec]):  # the second pair's ring, same answer
        assert mine.tokens == theirs.tokens and (mine.out == theirs.out).all()


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case", range(len(RING_SPECS)))
def test_ring_counts_bytes_work_and_skips_exactly(ranks, world, case):
    spec = RING_SPECS[case]
    results = ranks[world, spec]
    layout = make_layout(spec.layout, spec.seq_len, world)
    sent = ring_bytes(world, spec.batch, spec.n_kv_heads, padded_length(layout), spec.head_dim)
    for rank, result in enumerate(results):
        assert result.counts == {"ring": {"calls": world - 1, "bytes": sent}}
        assert result.stats.visible_pairs == spec.batch * causal_work(layout)[rank]
        assert result.stats.blocks_skipped == skipped_blocks(layout)[rank]
        assert result.stats.blocks_computed + result.stats.blocks_skipped == world
        assert result.padding == padding_tokens(layout)[rank]


@pytest.fixture(scope="module")
def target():
    model, _ = load("minillm-target", device="cpu", dtype=torch.float32)
    return model.eval()


@pytest.mark.parametrize("case", range(len(PREFILL_SPECS)))
def test_context_parallel_prefill_matches_the_single_process_model(ranks, target, case):
    spec = PREFILL_SPECS[case]
    results = ranks[2, spec]
    ids = spec.input_ids(target.config.vocab_size)
    cache = KVCache.for_model(target, batch_size=1, max_len=spec.seq_len)
    with torch.no_grad():
        expected = target(ids, cache=cache, last_only=True)[:, -1]  # (1, vocab)
    holders = [r for r in results if r.logits is not None]
    assert len(holders) == 1 and spec.seq_len - 1 in holders[0].tokens
    assert_close(torch.from_numpy(holders[0].logits), expected, atol=1e-5, rtol=1e-5)
    cfg = target.config
    for result in results:
        assert len(result.kv) == cfg.n_layers
        for layer, (k, v) in enumerate(result.kv):
            assert_close(torch.from_numpy(k), cache.k[layer, :, :, result.tokens], atol=1e-5, rtol=1e-5)
            assert_close(torch.from_numpy(v), cache.v[layer, :, :, result.tokens], atol=1e-5, rtol=1e-5)
        slice_len = padded_length(make_layout(spec.layout, spec.seq_len, 2))
        per_layer = ring_bytes(2, 1, cfg.n_kv_heads, slice_len, cfg.head_dim)
        assert result.counts == {"ring": {"calls": cfg.n_layers, "bytes": cfg.n_layers * per_layer}}
