"""A radix-tree prefix cache for paged KV blocks (RadixAttention, SGLang; Zheng et al., 2024).

``paged.BlockManager`` finds a cached prefix by a hash chain, one full block at a time. Here the
cached K/V are indexed by a radix tree over token ids instead: every edge holds a run of tokens,
every node owns the KV blocks of its run, and a new prompt walks down from the root, comparing
tokens, to its longest cached prefix. ``RadixBlockManager`` has the interface of
``BlockManager`` (the engine takes either, ``EngineConfig.prefix_cache``).

The choice made here: a request reuses its cached prefix **to the token**, its last, partly
matching block included. That block is shared by copy-on-write: the request gets its own copy
(``KVPool.copy_block``) before it writes into it. The tree only ever grows by whole blocks at a
block boundary, so its shape is:

- every node starts at a block boundary and owns ``ceil(len(tokens) / block_size)`` blocks,
  block i holding tokens[i * bs : (i + 1) * bs] of its run;
- only a leaf may end in a partial block (the last block of a finished request);
- a node's children are keyed by the tokens of their first block (a full block, or the partial
  block of a leaf), so one dict lookup descends a whole block; a match that ends inside a block
  scans the children for the longest common prefix. Two children may start with the same few
  tokens (in different blocks): pages of ``block_size`` tokens cannot share less than a block.

Invariants (the tests check them):

- a block in the tree is never written again: its tokens' K/V are final. A request writes into a
  tree block only after copying it, and offers blocks to the tree only when they are full
  (``commit``) or when it is done with them (``free``, its last partial block);
- ``ref_counts`` count the block tables that hold a block; the tree holds none. A block is either
  free (count 0, not in the tree), cached (count 0, in the tree) or in use (count > 0);
- eviction takes the last block of the least recently used leaf whose last block is unused, so a
  block leaves the tree only when nothing below it is cached: every cached block's prefix stays
  cached, and a block that a table holds is never evicted.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from itertools import count

from .paged import BlockManager, KVPool, PoolExhaustedError, blocks_for


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """The number of leading tokens ``a`` and ``b`` share."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


@dataclass(eq=False)
class RadixNode:
    """A run of tokens that starts at a block boundary, and the blocks that hold its K/V."""

    tokens: list[int]
    blocks: list[int]
    parent: RadixNode | None = None
    children: dict[tuple[int, ...], RadixNode] = field(default_factory=dict)  # by first block's tokens
    last_used: int = 0  # a tick of the tree's clock: eviction takes the smallest


class RadixTree:
    """Cached KV blocks indexed by token prefix (see the module's docstring for the invariants).

    ``ref_counts`` is the allocator's list, read to tell a block in use from a cached one.
    """

    def __init__(self, block_size: int, ref_counts: list[int]):
        self.block_size, self.ref_counts = block_size, ref_counts
        self.root = RadixNode([], [])
        self.node_of: dict[int, RadixNode] = {}  # tree block -> the node that owns it
        self._clock = count(1)
        self._evictable: int | None = 0  # cached count of num_evictable; None: to recount

    def __contains__(self, block: int) -> bool:
        return block in self.node_of

    def _piece(self, tokens: Sequence[int], i: int) -> tuple[int, ...]:
        """The tokens of block i of a run (fewer than block_size for a partial last block)."""
        return tuple(tokens[i * self.block_size : (i + 1) * self.block_size])

    def _touch(self, node: RadixNode) -> None:
        node.last_used = next(self._clock)

    def changed(self) -> None:
        """Something eviction depends on changed (a block's use, or the tree): recount lazily."""
        self._evictable = None

    # -- lookup --------------------------------------------------------------------------------

    def match(self, tokens: Sequence[int]) -> tuple[list[int], int]:
        """The blocks of the longest cached prefix of ``tokens`` and its length in tokens.
        The last block may match only partly (then the length is not a multiple of
        block_size)."""
        node, blocks, n = self.root, [], 0
        while True:
            self._touch(node)
            piece = self._piece(tokens, n // self.block_size)
            child = node.children.get(piece) if len(piece) == self.block_size else None
            if child is None:  # no whole block matches: the best partial one, if any
                best = max(node.children.values(), key=lambda c: common_prefix(c.tokens, piece), default=None)
                m = common_prefix(best.tokens, piece) if best is not None else 0
                if m:
                    self._touch(best)
                    blocks.append(best.blocks[0])
                return blocks, n + m
            for i, block in enumerate(child.blocks):
                m = common_prefix(self._piece(child.tokens, i), tokens[n : n + self.block_size])
                if m:
                    blocks.append(block)
                    n += m
                if m < self.block_size:  # diverged, or the prompt or the run ended, inside this block
                    self._touch(child)
                    return blocks, n
            node = child

    # -- growth --------------------------------------------------------------------------------

    def insert(self, tokens: Sequence[int], blocks: Sequence[int]) -> None:
        """Offer ``blocks`` (block i holding tokens[i * bs : (i + 1) * bs], only the last one
        partial) to the tree. Where the tree already holds a block of the same tokens it keeps
        its own (the first one wins) and the offered one stays its table's alone."""
        if len(blocks) != blocks_for(len(tokens), self.block_size):
            raise ValueError(f"{len(blocks)} blocks for {len(tokens)} tokens of block size {self.block_size}")
        node, i = self.root, 0
        while i < len(blocks):
            self._touch(node)
            piece = self._piece(tokens, i)
            child = node.children.get(piece)
            if child is None:
                if not self._covered(node, piece):
                    self._add_child(node, list(tokens[i * self.block_size :]), list(blocks[i:]))
                return
            same = 1  # the key matched: the child's first block holds these tokens
            while same < len(child.blocks) and i + same < len(blocks):
                if self._piece(child.tokens, same) != self._piece(tokens, i + same):
                    break
                same += 1
            self._touch(child)
            if i + same == len(blocks):
                return  # every offered block's tokens are in the tree already
            if same < len(child.blocks):  # diverged inside the child's run: cut it there
                if self._covers(self._piece(child.tokens, same), self._piece(tokens, i + same)):
                    return
                child = self.split(child, same)
            node, i = child, i + same

    def _covers(self, cached: tuple[int, ...], piece: tuple[int, ...]) -> bool:
        """Whether a cached block's tokens start with a partial block's."""
        return len(piece) < self.block_size and cached[: len(piece)] == piece

    def _covered(self, node: RadixNode, piece: tuple[int, ...]) -> bool:
        """Whether a child of ``node`` already holds the tokens of a partial block."""
        return any(self._covers(key, piece) for key in node.children)

    def _add_child(self, parent: RadixNode, tokens: list[int], blocks: list[int]) -> None:
        child = RadixNode(tokens, blocks, parent, last_used=next(self._clock))
        parent.children[self._piece(tokens, 0)] = child
        for block in blocks:
            self.node_of[block] = child
        self.changed()

    def split(self, node: RadixNode, i: int) -> RadixNode:
        """Cut ``node`` before its block i (0 < i < its blocks): a new parent takes the first i
        blocks; ``node`` keeps the rest, under it. Returns the new parent."""
        if not 0 < i < len(node.blocks):
            raise ValueError(f"a node of {len(node.blocks)} blocks cannot be split before block {i}")
        cut = i * self.block_size
        upper = RadixNode(node.tokens[:cut], node.blocks[:i], node.parent, last_used=node.last_used)
        node.parent.children[self._piece(node.tokens, 0)] = upper
        node.tokens, node.blocks, node.parent = node.tokens[cut:], node.blocks[i:], upper
        upper.children[self._piece(node.tokens, 0)] = node
        for block in upper.blocks:
            self.node_of[block] = upper
        return upper

    # -- eviction ------------------------------------------------------------------------------

    def nodes(self) -> Iterator[RadixNode]:
        """Every node but the root, parents before children."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    @property
    def num_evictable(self) -> int:
        """Blocks that repeated ``evict`` calls could free: cached ones with nothing in use below."""
        if self._evictable is None:
            self._evictable = self._count_evictable(self.root)[0]
        return self._evictable

    def _count_evictable(self, node: RadixNode) -> tuple[int, bool]:
        """(evictable blocks of the subtree, whether all of it can go)."""
        n, whole = 0, True
        for child in node.children.values():
            c, w = self._count_evictable(child)
            n, whole = n + c, whole and w
        if not whole:
            return n, False  # a child stays, so this node's blocks stay too
        unused_tail = 0
        for block in reversed(node.blocks):
            if self.ref_counts[block]:
                break
            unused_tail += 1
        return n + unused_tail, unused_tail == len(node.blocks)

    def evict(self) -> int:
        """Take the last block of the least recently used leaf whose last block is unused; a
        leaf left empty leaves the tree. Returns the block (reference count 0, free to reuse)."""
        leaves = [n for n in self.nodes() if not n.children and not self.ref_counts[n.blocks[-1]]]
        if not leaves:
            raise PoolExhaustedError("KV pool exhausted: no free block, and every cached leaf is in use")
        leaf = min(leaves, key=lambda n: n.last_used)
        key = self._piece(leaf.tokens, 0)
        block = leaf.blocks.pop()
        del self.node_of[block]
        leaf.tokens = leaf.tokens[: len(leaf.blocks) * self.block_size]
        if not leaf.blocks:
            del leaf.parent.children[key]
        self.changed()
        return block


class RadixAllocator:
    """Reference counts and a free list, as ``paged.BlockAllocator``, over a ``RadixTree`` of
    cached blocks: a block whose count drops to 0 stays cached if the tree holds it, else it is
    free; when no block is free, ``allocate`` evicts one from the tree."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks} and {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.ref_counts = [0] * num_blocks
        self.free: deque[int] = deque(range(num_blocks))
        self.tree = RadixTree(block_size, self.ref_counts)
        self.evictions = 0

    @property
    def num_available(self) -> int:
        """Blocks that ``allocate`` can hand out: free ones plus those eviction can reach."""
        return len(self.free) + self.tree.num_evictable

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_available

    def allocate(self) -> int:
        """A block with reference count 1: a free one, else one evicted from the tree."""
        if self.free:
            block = self.free.popleft()
        else:
            block = self.tree.evict()
            self.evictions += 1
        self.ref_counts[block] = 1
        return block

    def incref(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            if block not in self.tree:
                raise ValueError(f"block {block} is free; allocate it instead of sharing it")
            self.tree.changed()  # a cached block in use again: no longer evictable
        self.ref_counts[block] += 1

    def decref(self, block: int) -> None:
        if self.ref_counts[block] <= 0:
            raise ValueError(f"block {block} released more often than it was referenced")
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            if block in self.tree:
                self.tree.changed()  # cached, now evictable
            else:
                self.free.append(block)


class RadixBlockManager(BlockManager):
    """Per-sequence block tables over a ``RadixAllocator``: ``paged.BlockManager`` (its growth and
    copy-on-write inherited), with the prefix cache a radix tree reused to the token.

    A block is *shared*, and copied before a sequence writes into it, when another table holds it
    too (after ``fork``) or when the tree does (tree blocks are never written). ``written`` keeps,
    per sequence, its tokens and how many of them have K/V in its blocks (the last ``commit``):
    ``free`` offers those to the tree. ``pool`` (optional, for bookkeeping tests) receives the
    copies that copy-on-write makes.
    """

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True, pool: KVPool | None = None):
        self.allocator = RadixAllocator(num_blocks, block_size)
        self.tree = self.allocator.tree
        self.block_size, self.prefix_caching, self.pool = block_size, prefix_caching, pool
        self.tables: dict[int, list[int]] = {}
        self.written: dict[int, tuple[Sequence[int], int]] = {}
        self.cow_copies = 0

    def match_prefix(self, seq_id: int, tokens: Sequence[int]) -> int:
        """Start a sequence's table with the blocks of the longest cached prefix of ``tokens``,
        the last one perhaps partly matching; return the tokens covered."""
        table = self.table(seq_id)
        if table:
            raise ValueError(f"sequence {seq_id} already has blocks; match its prefix before it grows")
        if not self.prefix_caching:
            return 0
        blocks, n = self.tree.match(tokens)
        for block in blocks:
            self.allocator.incref(block)
        table.extend(blocks)
        return n

    def _shared(self, block: int) -> bool:
        """Another table holds ``block``, or the tree does (tree blocks are never written)."""
        return self.allocator.ref_counts[block] > 1 or block in self.tree

    def commit(self, seq_id: int, tokens: Sequence[int], num_written: int) -> None:
        """After a forward wrote K/V for tokens[:num_written], offer its newly full blocks to the tree."""
        if not self.prefix_caching:
            return
        full_before = self.written.get(seq_id, (tokens, 0))[1] // self.block_size
        self.written[seq_id] = (tokens, num_written)
        full = num_written // self.block_size
        if full > full_before:
            self.tree.insert(tokens[: full * self.block_size], self.table(seq_id)[:full])

    def fork(self, parent_id: int, child_id: int) -> None:
        """The child shares every block of the parent (parallel sampling); writes then copy on write."""
        if self.tables.get(child_id):
            raise ValueError(f"sequence {child_id} already has blocks")
        self.tables[child_id] = list(self.table(parent_id))
        if parent_id in self.written:
            tokens, n = self.written[parent_id]
            self.written[child_id] = (list(tokens[:n]), n)
        for block in self.tables[child_id]:
            self.allocator.incref(block)

    def free(self, seq_id: int) -> None:
        """Release a sequence's blocks. First what it wrote joins the tree, its last partial block
        too: nothing writes into that block any more."""
        table = self.tables.pop(seq_id, [])
        tokens, n = self.written.pop(seq_id, ((), 0))
        if self.prefix_caching and n:
            self.tree.insert(tokens[:n], table[: blocks_for(n, self.block_size)])
        for block in reversed(table):
            self.allocator.decref(block)
