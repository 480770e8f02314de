"""The radix-tree prefix cache: match to the token, insert, split, evict only unused leaves, copy a
shared partial block before writing it; under a random load no reference leaks, no block is
both free and in use, every hit is the longest cached prefix and holds the right tokens; the
engine's greedy outputs with it equal ``generate``'s and the hash chain's."""

import random

import pytest

from minillm.kv.paged import PoolExhaustedError
from minillm.kv.radix import RadixBlockManager, RadixTree, common_prefix
from minillm.serving.engine import EngineConfig
from minillm.serving.workload import Request
from tests.serving.test_engine import alone, make_engine, shared_prefix_workload, tokens

BS = 4


def tree_with(*runs: list[int], block_size: int = BS) -> tuple[RadixTree, list[int]]:
    """A tree holding each run in fresh blocks (numbered in order), all unused."""
    refs = [0] * 64
    tree, next_block = RadixTree(block_size, refs), 0
    for run in runs:
        n = -(-len(run) // block_size)
        tree.insert(run, list(range(next_block, next_block + n)))
        next_block += n
    return tree, refs


def paths(tree: RadixTree) -> list[list[int]]:
    """The tokens from the root to the end of every node."""
    out = []
    for node in tree.nodes():
        run, n = [], node
        while n is not tree.root:
            run, n = n.tokens + run, n.parent
        out.append(run)
    return out


def test_match_is_to_the_token_and_stops_where_the_tokens_differ():
    tree, _ = tree_with(list(range(10)))  # blocks 0, 1 full, block 2 holds tokens 8, 9
    assert tree.match([]) == ([], 0)
    assert tree.match(list(range(10))) == ([0, 1, 2], 10)
    assert tree.match(list(range(6)) + [99]) == ([0, 1], 6)  # diverges inside block 1
    assert tree.match(list(range(12))) == ([0, 1, 2], 10)  # the cached run ends inside block 2
    assert tree.match([0, 1, 2]) == ([0], 3)  # the prompt ends inside block 0
    assert tree.match([5, 1, 2, 3]) == ([], 0)


def test_insert_splits_a_run_at_the_block_where_it_diverges_and_keeps_the_first_blocks():
    a, b = list(range(12)), list(range(4)) + [50, 51, 52, 53, 54]
    tree, _ = tree_with(a, b)  # a in blocks 0-2, b in 3-5
    (top,) = tree.root.children.values()
    assert top.tokens == [0, 1, 2, 3] and top.blocks == [0]  # b's first block equals a's: a's wins
    assert sorted(c.blocks[0] for c in top.children.values()) == [1, 4]
    assert tree.match(b) == ([0, 4, 5], 9)
    assert tree.match(a + [7]) == ([0, 1, 2], 12)
    tree.insert(list(range(8)), [9, 9])  # already cached: nothing changes
    assert sorted(map(tuple, paths(tree))) == sorted([tuple(range(4)), tuple(a), tuple(b)])


def test_a_partial_block_that_a_cached_block_covers_is_not_added():
    tree, _ = tree_with(list(range(8)), [0, 1, 2, 3, 4, 5])
    assert len(tree.node_of) == 2 and tree.match([0, 1, 2, 3, 4, 5]) == ([0, 1], 6)


def test_eviction_takes_the_least_recently_used_unused_leaf_tail_first():
    tree, refs = tree_with(list(range(8)), [0, 1, 2, 3, 20, 21, 22, 23])  # block 0 -> 1 and 3
    tree.match([0, 1, 2, 3, 20])  # the second branch is the more recently used
    assert tree.num_evictable == 3
    assert tree.evict() == 1  # the older leaf's block
    refs[3] = 1  # a table holds the other leaf: it and its parent stay
    tree.changed()
    assert tree.num_evictable == 0
    with pytest.raises(PoolExhaustedError):
        tree.evict()
    refs[3] = 0
    tree.changed()
    assert [tree.evict(), tree.evict()] == [3, 0]  # the leaf, then the parent it leaves a leaf
    assert not tree.root.children and not tree.node_of


def test_a_node_whose_child_is_in_use_is_never_evicted_even_if_it_is_unused():
    tree, refs = tree_with(list(range(12)), list(range(4)) + [30, 31, 32, 33])  # 0 -> (1, 2) and 4
    refs[4] = 1
    tree.changed()
    assert tree.num_evictable == 2  # blocks 2 then 1; block 0 has a child in use
    assert {tree.evict(), tree.evict()} == {1, 2}
    with pytest.raises(PoolExhaustedError):
        tree.evict()


def test_a_shared_partial_block_is_copied_before_it_is_written_and_reference_counts_return():
    bm = RadixBlockManager(8, BS, pool=(pool := ShadowPool(8)))
    first = list(range(6))
    run(bm, pool, 0, first)
    bm.free(0)  # blocks 0 (full, committed) and 1 (tokens 4, 5) now cached
    assert bm.allocator.ref_counts == [0] * 8 and len(bm.tree.node_of) == 2
    second = first + [7, 8]
    assert bm.match_prefix(1, second) == 6 and bm.table(1) == [0, 1]
    assert bm.blocks_to_write(1, 6, 8) == 1  # the partial block is the tree's: copy it
    bm.prepare_write(1, 6, 8)
    assert bm.cow_copies == 1 and bm.table(1)[0] == 0 and bm.table(1)[1] not in (0, 1)
    write(pool, bm.table(1), second, 6, 8)
    assert pool.content[1][:2] == [(4, 4), (5, 5)] and pool.content[1][2:] == [None, None]  # untouched
    bm.commit(1, second, 8)
    bm.free(1)
    assert bm.allocator.ref_counts == [0] * 8
    assert bm.allocator.num_available == 8 and bm.tree.match(second + [1])[1] == 8


def test_without_prefix_caching_nothing_is_cached():
    bm = RadixBlockManager(4, BS, prefix_caching=False)
    run(bm, None, 0, list(range(6)))
    bm.free(0)
    assert bm.match_prefix(1, list(range(6))) == 0 and len(bm.allocator.free) == 4 and not bm.tree.node_of


class ShadowPool:
    """Stands in for ``KVPool``: each slot records the (position, token) whose K/V it holds."""

    def __init__(self, num_blocks: int, block_size: int = BS):
        self.content = [[None] * block_size for _ in range(num_blocks)]

    def copy_block(self, src: int, dst: int) -> None:
        self.content[dst] = list(self.content[src])


def write(pool: ShadowPool | None, table: list[int], toks: list[int], start: int, end: int) -> None:
    if pool is not None:
        for p in range(start, end):
            pool.content[table[p // BS]][p % BS] = (p, toks[p])


def run(bm: RadixBlockManager, pool: ShadowPool | None, seq: int, toks: list[int]) -> int:
    """Admit a prompt as the scheduler does and write its uncached tokens; returns the hit."""
    hit = bm.match_prefix(seq, toks)
    start = min(hit, len(toks) - 1)
    bm.prepare_write(seq, start, len(toks))
    write(pool, bm.table(seq), toks, start, len(toks))
    bm.commit(seq, toks, len(toks))
    return hit


def check_invariants(bm: RadixBlockManager, pool: ShadowPool) -> None:
    alloc, tree = bm.allocator, bm.tree
    held = [b for t in bm.tables.values() for b in t]
    assert alloc.ref_counts == [held.count(b) for b in range(alloc.num_blocks)]
    free = list(alloc.free)
    assert len(set(free)) == len(free) and not set(free) & (set(held) | set(tree.node_of))  # free = unused
    assert set(free) | set(held) | set(tree.node_of) == set(range(alloc.num_blocks))  # nothing lost
    for node, path in zip(tree.nodes(), paths(tree)):  # every tree block holds the K/V the tree says
        start = len(path) - len(node.tokens)
        for i, block in enumerate(node.blocks):
            span = range(start + i * BS, min(len(path), start + (i + 1) * BS))
            assert pool.content[block][: len(span)] == [(p, path[p]) for p in span]


@pytest.mark.parametrize("seed", range(4))
def test_a_random_load_leaks_nothing_and_every_hit_is_the_longest_cached_prefix(seed):
    rng = random.Random(seed)
    bm = RadixBlockManager(20, BS, pool=(pool := ShadowPool(20)))
    stems = [[rng.randrange(3) for _ in range(rng.randrange(1, 14))] for _ in range(4)]
    live: dict[int, list[int]] = {}
    partial_hits = rejected = 0
    for step in range(400):
        action = rng.random()
        if action < 0.35 or not live:  # a new request: part of a stem, then its own tokens
            stem = rng.choice(stems)
            toks = stem[: rng.randrange(len(stem) + 1)] + [rng.randrange(3) for _ in range(rng.randrange(1, 6))]
            expected = max((common_prefix(p, toks) for p in paths(bm.tree)), default=0)
            hit = bm.match_prefix(step, toks)
            assert hit == expected
            partial_hits += hit % BS > 0
            start = min(hit, len(toks) - 1)
            if not bm.can_write(step, start, len(toks)):
                bm.free(step)  # no room: it waits (the scheduler's unstart)
                rejected += 1
                continue
            bm.prepare_write(step, start, len(toks))
            write(pool, bm.table(step), toks, start, len(toks))
            bm.commit(step, toks, len(toks))
            live[step] = toks
        elif action < 0.75:  # a decode step of a running sequence
            seq = rng.choice(list(live))
            toks = live[seq]
            toks.append(rng.randrange(3))
            if not bm.can_write(seq, len(toks) - 1, len(toks)):
                bm.free(seq)  # preempted
                del live[seq]
                continue
            bm.prepare_write(seq, len(toks) - 1, len(toks))
            write(pool, bm.table(seq), toks, len(toks) - 1, len(toks))
            bm.commit(seq, toks, len(toks))
        elif action < 0.8 and len(live) < 6:  # parallel sampling: a child shares the parent's blocks
            parent = rng.choice(list(live))
            bm.fork(parent, 10_000 + step)
            live[10_000 + step] = list(live[parent])
        else:
            seq = rng.choice(list(live))
            bm.free(seq)
            del live[seq]
        check_invariants(bm, pool)
    for seq in list(live):
        bm.free(seq)
    check_invariants(bm, pool)
    alloc = bm.allocator
    assert alloc.ref_counts == [0] * 20 and alloc.num_available == 20 and not bm.tables and not bm.written
    assert len(alloc.free) + len(bm.tree.node_of) == 20  # every block free or cached
    assert alloc.evictions > 0 and bm.cow_copies > 0 and partial_hits > 0 and rejected > 0


def test_prefix_cache_must_be_hash_or_radix():
    with pytest.raises(ValueError, match="prefix_cache must be one of"):
        EngineConfig(prefix_cache="trie")


def assert_no_leak(engine) -> None:
    alloc = engine.blocks.allocator
    assert alloc.ref_counts == [0] * alloc.num_blocks and alloc.num_available == alloc.num_blocks
    assert not engine.blocks.tables and not engine.scheduler.running and not engine.scheduler.waiting


@pytest.mark.parametrize("token_budget", [None, 8])
def test_engine_greedy_outputs_with_the_radix_cache_equal_generate_and_the_hash_chain(token_budget):
    requests = shared_prefix_workload()
    runs = {}
    for kind in ("hash", "radix"):
        engine = make_engine(token_budget=token_budget, prefix_cache=kind)
        runs[kind] = [
            o.tokens for o in engine.run([Request(list(r.prompt), r.max_tokens, r.arrival) for r in requests])
        ]
        stats = engine.stats()
        assert stats["preemptions"] > 0 and stats["evictions"] > 0 and stats["prefix_hit_tokens"] > 0, stats
        assert_no_leak(engine)
    assert runs["radix"] == runs["hash"] == [alone(r) for r in requests]


def test_engine_multi_turn_chat_reuses_each_answer_to_the_token():
    engine = make_engine(num_blocks=40, max_batch=2, prefix_cache="radix")
    prompt, hits = tokens(7, 1), []
    for turn in range(4):
        before = engine.scheduler.prefix_hit_tokens
        (out,) = engine.run([Request(list(prompt), 5, arrival=engine.now)])
        assert out.tokens == alone(out.request)
        hits.append(engine.scheduler.prefix_hit_tokens - before)
        prompt = prompt + out.tokens + tokens(3, 10 + turn)
    assert hits[1:] == [7 + 4, 7 + 5 + 3 + 4, 7 + 2 * (5 + 3) + 4]  # all but the last answer token
    assert_no_leak(engine)
