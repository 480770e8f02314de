"""Paged KV: the allocator's bookkeeping, prefix caching, copy-on-write, and paged attention
against the contiguous path (the model without a cache, and ``attention_reference``)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm.core.attention import attention_mask, attention_reference
from minillm.core.cache import CacheFullError
from minillm.kv.paged import (
    BlockAllocator,
    BlockManager,
    KVPool,
    PagedKVBatch,
    PoolExhaustedError,
    block_hash,
    kv_waste,
    paged_attention_decode,
    slot_mapping,
    table_tensor,
    token_slot,
)
from tests.conftest import tiny_model

VOCAB = 97


def random_tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# ---------------------------------------------------------------------------------------------
# The allocator


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(st.tuples(st.sampled_from(["alloc", "share", "release", "cache"]), st.integers(0, 10**6)), max_size=80)
)
def test_allocator_never_hands_out_a_referenced_block_and_counts_return_to_zero(ops):
    alloc = BlockAllocator(num_blocks=6, block_size=4)
    held: list[int] = []  # one entry per reference we hold
    for op, x in ops:
        if op == "alloc":
            try:
                block = alloc.allocate()
            except PoolExhaustedError:
                assert alloc.num_available == 0
                continue
            assert block not in held, "a referenced block was handed out again"
            held.append(block)
        elif op == "share" and held:
            alloc.incref(held[x % len(held)])
            held.append(held[x % len(held)])
        elif op == "release" and held:
            alloc.decref(held.pop(x % len(held)))
        elif op == "cache" and held:
            alloc.register(held[x % len(held)], x)
        for b in range(alloc.num_blocks):
            assert alloc.ref_counts[b] == held.count(b)
        assert alloc.num_used == len(set(held))
    for block in held:
        alloc.decref(block)
    assert alloc.ref_counts == [0] * 6 and alloc.num_available == 6


def test_allocator_errors():
    alloc = BlockAllocator(2, 4)
    a = alloc.allocate()
    alloc.allocate()
    with pytest.raises(PoolExhaustedError, match="all 2 blocks"):
        alloc.allocate()
    assert issubclass(PoolExhaustedError, CacheFullError)
    alloc.decref(a)
    with pytest.raises(ValueError, match="released more often"):
        alloc.decref(a)
    with pytest.raises(ValueError, match="free"):
        alloc.incref(a)
    with pytest.raises(ValueError, match="positive"):
        BlockAllocator(0, 16)


def test_unreferenced_cached_blocks_are_evicted_least_recently_used_first():
    alloc = BlockAllocator(3, 4)
    blocks = [alloc.allocate() for _ in range(3)]
    for h, b in enumerate(blocks):
        alloc.register(b, h)
    alloc.decref(blocks[1])
    alloc.decref(blocks[0])
    alloc.decref(blocks[2])  # LRU order now: 1, 0, 2
    assert alloc.lookup(1) == blocks[1]  # revived (hash 1 is block 1): no longer evictable
    assert alloc.allocate() == blocks[0]  # the oldest unreferenced one
    assert alloc.lookup(0) is None and alloc.evictions == 1  # its hash is gone with it
    assert alloc.lookup(2) == blocks[2]


# ---------------------------------------------------------------------------------------------
# Block tables, prefix caching, copy-on-write


def test_prefix_cache_reuses_every_matching_full_block_and_only_those():
    bm = BlockManager(16, 4)
    tokens = random_tokens(10, 0)
    assert bm.match_prefix(0, tokens) == 0
    bm.prepare_write(0, 0, 10)
    bm.commit(0, tokens, 10)  # blocks 0 and 1 are full; block 2 holds 2 tokens
    other = tokens[:8] + random_tokens(5, 1)
    assert bm.match_prefix(1, other) == 8
    assert bm.table(1) == bm.table(0)[:2]
    assert [bm.allocator.ref_counts[b] for b in bm.table(0)] == [2, 2, 1]
    changed = tokens[:4] + [(tokens[4] + 1) % VOCAB] + tokens[5:]  # differs in the second block
    assert bm.match_prefix(2, changed) == 4
    assert bm.match_prefix(3, random_tokens(12, 2)) == 0


def test_hash_chain_depends_on_every_earlier_token():
    a = block_hash(block_hash(None, [1, 2]), [3, 4])
    assert a != block_hash(block_hash(None, [1, 5]), [3, 4])  # same block, different parent
    assert a == block_hash(block_hash(None, [1, 2]), [3, 4])


def test_prefix_caching_off_never_matches():
    bm = BlockManager(8, 4, prefix_caching=False)
    tokens = random_tokens(8, 0)
    bm.prepare_write(0, 0, 8)
    bm.commit(0, tokens, 8)
    assert bm.match_prefix(1, tokens) == 0


def test_freed_sequences_leave_no_references():
    bm = BlockManager(8, 4)
    tokens = random_tokens(9, 0)
    bm.prepare_write(0, 0, 9)
    bm.commit(0, tokens, 9)
    bm.match_prefix(1, tokens)
    bm.prepare_write(1, 8, 10)
    bm.fork(1, 2)
    for s in (0, 1, 2):
        bm.free(s)
    assert bm.allocator.ref_counts == [0] * 8 and bm.allocator.num_available == 8


def run_paged(model, pool, tables, prompts_and_starts):
    """One forward of several rows through a PagedKVBatch: [(new tokens, start position)] -> last logits (B, V)."""
    T = max(len(t) for t, _ in prompts_and_starts)
    ids = torch.zeros(len(tables), T, dtype=torch.long)
    pos = torch.full((len(tables), T), -1)
    for i, (toks, start) in enumerate(prompts_and_starts):
        ids[i, T - len(toks) :] = torch.tensor(toks)
        pos[i, T - len(toks) :] = torch.arange(start, start + len(toks))
    with torch.no_grad():
        return model(ids, pos, PagedKVBatch(pool, tables), last_only=True)[:, -1]


def full_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor([tokens]))[0, -1]


def test_fork_then_append_copies_the_shared_block_on_write():
    """Parent and child share a partly filled block; each appends a different token. Without
    copy-on-write the child's write would overwrite the parent's slot."""
    model = tiny_model()
    bm = BlockManager(8, 4, pool=(pool := KVPool.for_model(model, 8, 4)))
    prompt = random_tokens(6, 0)  # 1.5 blocks: the second is shared and partly filled
    bm.prepare_write(0, 0, 6)
    run_paged(model, pool, [bm.table(0)], [(prompt, 0)])
    bm.fork(0, 1)
    a, b = 5, 11
    for seq in (0, 1):
        bm.prepare_write(seq, 6, 7)
    assert bm.cow_copies == 1 and bm.table(0)[0] == bm.table(1)[0] and bm.table(0)[1] != bm.table(1)[1]
    logits = run_paged(model, pool, [bm.table(0), bm.table(1)], [([a], 6), ([b], 6)])
    torch.testing.assert_close(logits[0], full_logits(model, prompt + [a]), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits[1], full_logits(model, prompt + [b]), rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------------------
# Paged attention equals the contiguous cache


@settings(max_examples=15, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 20), min_size=1, max_size=4),
    chunk=st.integers(1, 9),
    block_size=st.sampled_from([1, 3, 4, 8]),
    seed=st.integers(0, 100),
)
def test_paged_forward_in_ragged_chunks_equals_the_model_without_a_cache(lengths, chunk, block_size, seed):
    """Rows of different lengths, fed ``chunk`` tokens per forward into scattered blocks, give
    every row the logits of its whole sequence run alone."""
    model = tiny_model()
    n_blocks = 96  # four rows of 20 tokens at block size 1 need 80
    pool = KVPool.for_model(model, n_blocks, block_size)
    bm = BlockManager(n_blocks, block_size, pool=pool)
    free_order = torch.randperm(n_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    bm.allocator.free.clear()
    bm.allocator.free.extend(free_order)  # scatter the blocks over the pool
    seqs = [random_tokens(n, seed + i) for i, n in enumerate(lengths)]
    done = [0] * len(seqs)
    while any(d < len(s) for d, s in zip(done, seqs)):
        rows = [i for i, s in enumerate(seqs) if done[i] < len(s)]
        feeds = [(seqs[i][done[i] : done[i] + chunk], done[i]) for i in rows]
        for i, (toks, start) in zip(rows, feeds):
            bm.prepare_write(i, start, start + len(toks))
        logits = run_paged(model, pool, [bm.table(i) for i in rows], feeds)
        for j, i in enumerate(rows):
            done[i] += len(feeds[j][0])
            expected = full_logits(model, seqs[i][: done[i]])
            torch.testing.assert_close(logits[j], expected, rtol=1e-4, atol=1e-4)


def test_paged_attention_decode_equals_contiguous_attention():
    torch.manual_seed(0)
    B, H, Hkv, hd, bs, nb = 3, 4, 2, 8, 4, 12
    lens = torch.tensor([5, 1, 9])
    k_pool, v_pool = torch.randn(nb, bs, Hkv, hd), torch.randn(nb, bs, Hkv, hd)
    tables = [[7, 2], [11], [0, 5, 3]]
    q = torch.randn(B, H, hd)
    out = paged_attention_decode(q, k_pool, v_pool, table_tensor(tables, "cpu"), lens)
    for i in range(B):
        k = torch.cat([k_pool[b] for b in tables[i]])[: lens[i]].transpose(0, 1)[None]  # (1, Hkv, S, hd)
        v = torch.cat([v_pool[b] for b in tables[i]])[: lens[i]].transpose(0, 1)[None]
        pos = torch.arange(int(lens[i]))[None]
        ref = attention_reference(q[i : i + 1, :, None], k, v, attention_mask(pos[:, -1:], pos))[:, :, 0]
        torch.testing.assert_close(out[i : i + 1], ref)


def test_paged_batch_rejects_positions_past_its_block_table():
    model = tiny_model()
    pool = KVPool.for_model(model, 4, 4)
    with pytest.raises(CacheFullError, match="block table"):
        run_paged(model, pool, [[0]], [(random_tokens(5, 0), 0)])


# ---------------------------------------------------------------------------------------------
# Memory waste


def test_kv_waste_contiguous_vs_paged():
    assert kv_waste([16, 32], 16) == 0.0
    assert kv_waste([1], 16) == pytest.approx(15 / 16)
    assert kv_waste([10, 30], None, max_len=40) == pytest.approx(0.5)
    assert kv_waste([17], 16) == pytest.approx(15 / 32)
    with pytest.raises(ValueError, match="max_len"):
        kv_waste([50], None, max_len=40)
    with pytest.raises(ValueError, match="positive"):
        kv_waste([], 16)


# ---------------------------------------------------------------------------------------------
# The slot of one token, and the block-table picture


def test_token_slot_agrees_with_slot_mapping():
    table = [7, 2, 9]
    slots = slot_mapping(torch.tensor([table]), torch.arange(12)[None], 4)[0].tolist()
    assert [token_slot(table, i, 4) for i in range(12)] == slots
    assert token_slot(table, 5, 4) == 2 * 4 + 1
    with pytest.raises(IndexError, match="outside"):
        token_slot(table, 12, 4)


def test_plot_block_tables_draws_shared_blocks(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    from minillm.viz.paging import plot_block_tables

    bm = BlockManager(12, 4)
    system = random_tokens(8, 0)
    for sid, toks in ((0, system + [1, 2]), (1, system + [3])):
        cached = bm.match_prefix(sid, toks)
        bm.prepare_write(sid, cached, len(toks))
        bm.commit(sid, toks, len(toks))
    assert bm.table(0)[:2] == bm.table(1)[:2]
    fig = plot_block_tables(bm, {0: 10, 1: 9}, title="t")
    texts = [t.get_text() for ax in fig.axes for t in ax.texts]
    assert sum("ref 2" in t for t in texts) == 2  # the two shared system-prompt blocks are labelled
    fig.savefig(tmp_path / "tables.png")
