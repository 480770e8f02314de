"""Paged KV cache: fixed-size blocks in a preallocated pool, block tables, prefix caching.

A contiguous cache reserves ``max_len`` slots per sequence up front, and most of them stay
empty. PagedAttention (Kwon et al., 2023) instead splits each sequence's keys and values into
blocks of ``block_size`` tokens, placed anywhere in one shared pool; a per-sequence *block
table* lists its blocks in order, like a page table. Memory is claimed one block at a time, so
a sequence wastes at most one partly filled block.

The pieces, from the bottom up:

- ``BlockAllocator``: a free list and a reference count per block. A block whose count drops
  to zero returns to the free list, or, if it holds a full block of a known prefix, waits in an
  LRU list where a later request may revive it; the least recently used is evicted first.
- ``BlockManager``: the block tables of the sequences. Prefix caching keys every full block by
  a hash chain, hash(parent block's hash, its token ids), so one lookup per block finds the
  longest cached prefix of a new prompt. Copy-on-write gives a sequence its own copy of a
  shared block before it writes into it (e.g. after ``fork``).
- ``KVPool``: the storage, K and V of shape (num_blocks, block_size, n_kv_heads, head_dim) per
  layer, the layout a paged-attention kernel reads.
- ``PagedKVBatch``: the model's ``Cache`` protocol for one forward over several sequences of
  different lengths: it scatters new K/V into their slots and gathers each sequence's K/V back
  through its block table, block by block (``gather_kv``, the PyTorch reference path).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence

import torch
from torch import Tensor

from ..core.attention import attention_mask, attention_reference
from ..core.cache import CacheFullError
from ..core.config import ModelConfig, ceil_div


class PoolExhaustedError(CacheFullError):
    """No free block is left and no cached block can be evicted."""


def blocks_for(n_tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``n_tokens`` tokens."""
    return ceil_div(n_tokens, block_size)


def block_hash(parent: int | None, tokens: Sequence[int]) -> int:
    """The prefix-cache key of a full block: its tokens and, through ``parent``, every
    token before.

    Python's hash of a tuple of ints is deterministic and 64-bit; a collision would
    silently share a wrong block, which at 2^-64 per pair we accept, as vLLM does by
    default.
    """
    return hash((parent, *tokens))


class BlockAllocator:
    """Block ids 0..num_blocks-1 with reference counts, a free list and an LRU of cached blocks."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks} and {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.ref_counts = [0] * num_blocks
        self.free: deque[int] = deque(range(num_blocks))
        self.cached: OrderedDict[int, None] = OrderedDict()  # unreferenced blocks with a hash, LRU first
        self.hash_of: dict[int, int] = {}  # block -> hash of the prefix it holds
        self.block_of: dict[int, int] = {}  # hash -> block
        self.evictions = 0

    @property
    def num_available(self) -> int:
        """Blocks that ``allocate`` can hand out: free ones plus evictable cached ones."""
        return len(self.free) + len(self.cached)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_available

    def allocate(self) -> int:
        """A block with reference count 1: a free one, else the least recently used cached
        one."""
        if self.free:
            block = self.free.popleft()
        elif self.cached:
            block, _ = self.cached.popitem(last=False)
            del self.block_of[self.hash_of.pop(block)]
            self.evictions += 1
        else:
            raise PoolExhaustedError(f"KV pool exhausted: all {self.num_blocks} blocks are referenced")
        self.ref_counts[block] = 1
        return block

    def incref(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            if block not in self.cached:
                raise ValueError(f"block {block} is free; allocate it instead of sharing it")
            del self.cached[block]  # revived: no longer evictable
        self.ref_counts[block] += 1

    def decref(self, block: int) -> None:
        if self.ref_counts[block] <= 0:
            raise ValueError(f"block {block} released more often than it was referenced")
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            if block in self.hash_of:
                self.cached[block] = None  # most recently used end
            else:
                self.free.append(block)

    def lookup(self, h: int) -> int | None:
        """The block cached under hash ``h``, with one more reference; None on a miss."""
        block = self.block_of.get(h)
        if block is not None:
            self.incref(block)
        return block

    def register(self, block: int, h: int) -> None:
        """Offer a full, written block to the prefix cache (the first block of a given prefix wins)."""
        if h not in self.block_of and block not in self.hash_of:
            self.block_of[h], self.hash_of[block] = block, h


class BlockManager:
    """Per-sequence block tables over one allocator, with prefix caching and copy-on-write.

    A sequence's table covers its first ``len(table) * block_size`` token slots; ``hashes``
    holds the hash of each of its full, written blocks. ``pool`` (optional, for bookkeeping
    tests) receives the copies that copy-on-write makes.
    """

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True, pool: KVPool | None = None):
        self.allocator = BlockAllocator(num_blocks, block_size)
        self.block_size, self.prefix_caching, self.pool = block_size, prefix_caching, pool
        self.tables: dict[int, list[int]] = {}
        self.hashes: dict[int, list[int]] = {}
        self.cow_copies = 0

    def table(self, seq_id: int) -> list[int]:
        return self.tables.setdefault(seq_id, [])

    def match_prefix(self, seq_id: int, tokens: Sequence[int]) -> int:
        """Start a sequence's table with every cached full block of ``tokens``; return the
        tokens covered."""
        table, hashes = self.table(seq_id), self.hashes.setdefault(seq_id, [])
        if table:
            raise ValueError(f"sequence {seq_id} already has blocks; match its prefix before it grows")
        if not self.prefix_caching:
            return 0
        parent, bs = None, self.block_size
        for i in range(len(tokens) // bs):
            parent = block_hash(parent, tokens[i * bs : (i + 1) * bs])
            block = self.allocator.lookup(parent)
            if block is None:
                break
            table.append(block)
            hashes.append(parent)
        return len(table) * bs

    def blocks_to_write(self, seq_id: int, start: int, end: int) -> int:
        """New blocks that writing token slots [start, end) needs: to grow, plus copies of shared blocks."""
        table = self.table(seq_id)
        grow = max(0, blocks_for(end, self.block_size) - len(table))
        last = min(blocks_for(end, self.block_size), len(table))
        return grow + sum(self._shared(b) for b in table[start // self.block_size : last])

    def _shared(self, block: int) -> bool:
        """Whether a sequence must copy ``block`` before writing into it: another table holds it."""
        return self.allocator.ref_counts[block] > 1

    def can_write(self, seq_id: int, start: int, end: int) -> bool:
        return self.blocks_to_write(seq_id, start, end) <= self.allocator.num_available

    def prepare_write(self, seq_id: int, start: int, end: int) -> None:
        """Make slots [start, end) writable: copy shared blocks (copy-on-write), then
        grow the table."""
        table, bs = self.table(seq_id), self.block_size
        for i in range(start // bs, min(blocks_for(end, bs), len(table))):
            if self._shared(table[i]):
                self._copy_on_write(table, i)
        while len(table) < blocks_for(end, bs):
            table.append(self.allocator.allocate())

    def _copy_on_write(self, table: list[int], i: int) -> None:
        new = self.allocator.allocate()
        if self.pool is not None:
            self.pool.copy_block(table[i], new)
        self.allocator.decref(table[i])
        table[i] = new
        self.cow_copies += 1

    def commit(self, seq_id: int, tokens: Sequence[int], num_written: int) -> None:
        """After a forward wrote K/V for tokens[:num_written], offer its newly full blocks to the prefix cache."""
        if not self.prefix_caching:
            return
        table, hashes, bs = self.table(seq_id), self.hashes.setdefault(seq_id, []), self.block_size
        while len(hashes) < num_written // bs:
            i = len(hashes)
            hashes.append(block_hash(hashes[-1] if hashes else None, tokens[i * bs : (i + 1) * bs]))
            self.allocator.register(table[i], hashes[-1])

    def fork(self, parent_id: int, child_id: int) -> None:
        """The child shares every block of the parent (parallel sampling); writes then copy on write."""
        if self.tables.get(child_id):
            raise ValueError(f"sequence {child_id} already has blocks")
        self.tables[child_id] = list(self.table(parent_id))
        self.hashes[child_id] = list(self.hashes.get(parent_id, []))
        for block in self.tables[child_id]:
            self.allocator.incref(block)

    def free(self, seq_id: int) -> None:
        """Release a sequence's blocks, last first, so that eviction takes the tails of prefixes first."""
        for block in reversed(self.tables.pop(seq_id, [])):
            self.allocator.decref(block)
        self.hashes.pop(seq_id, None)


class KVPool:
    """K and V storage for every layer: (n_layers, num_blocks, block_size, n_kv_heads, head_dim) each."""

    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ):
        shape = (config.n_layers, num_blocks, block_size, config.n_kv_heads, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.block_size = block_size

    @classmethod
    def for_model(cls, model, num_blocks: int, block_size: int) -> KVPool:
        return cls(model.config, num_blocks, block_size, model.dtype, model.device)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def copy_block(self, src: int, dst: int) -> None:
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]


def slot_mapping(block_tables: Tensor, positions: Tensor, block_size: int) -> Tensor:
    """Flat pool slot of each token: tables (B, M), positions (B, T) -> slots (B, T); -1 stays -1."""
    pos = positions.clamp(min=0)
    blocks = block_tables.gather(1, pos // block_size)  # (B, T)
    return torch.where(positions >= 0, blocks * block_size + pos % block_size, -1)


def table_tensor(tables: Sequence[Sequence[int]], device) -> Tensor:
    """Ragged block tables -> (B, max blocks), padded with block 0 (never read: its positions are -1)."""
    width = max(1, max(len(t) for t in tables))
    out = torch.zeros(len(tables), width, dtype=torch.long)
    for i, t in enumerate(tables):
        out[i, : len(t)] = torch.as_tensor(list(t), dtype=torch.long)
    return out.to(device)


def context_positions(context_lens: Tensor, width: int) -> Tensor:
    """Key positions 0..len-1 of each row, padded with -1 to ``width``: (B,) -> (B, width)."""
    j = torch.arange(width, device=context_lens.device)
    return torch.where(j < context_lens[:, None], j, -1)


def gather_kv(pool: Tensor, block_tables: Tensor) -> Tensor:
    """Read K or V through the block tables, a whole block at a time (a few large copies
    rather than one per token):
    pool (num_blocks, bs, Hkv, hd), tables (B, M) -> (B, Hkv, M * bs, hd)."""
    return pool[block_tables].flatten(1, 2).transpose(1, 2)


def paged_attention_decode(
    q: Tensor, k_pool: Tensor, v_pool: Tensor, block_tables: Tensor, context_lens: Tensor
) -> Tensor:
    """One query token per sequence attending to its cached keys, read through its block
    table.

    q (B, H, hd); k_pool, v_pool (num_blocks, block_size, Hkv, hd); block_tables (B, M)
    int; context_lens (B,) -> (B, H, hd). The PyTorch reference a fused decode kernel
    must match.
    """
    k, v = gather_kv(k_pool, block_tables), gather_kv(v_pool, block_tables)  # (B, Hkv, M * bs, hd)
    k_pos = context_positions(context_lens, k.shape[2])  # (B, M * bs)
    mask = attention_mask((context_lens - 1)[:, None], k_pos)  # (B, 1, 1, M * bs)
    return attention_reference(q[:, :, None], k, v, mask)[:, :, 0]


class PagedKVBatch:
    """The ``Cache`` protocol for one forward of several sequences over a ``KVPool``.

    Row i's new tokens carry positions (padding -1) that continue its cached prefix, whose
    blocks are ``block_tables[i]`` (already long enough, see ``BlockManager.prepare_write``).
    ``update`` writes the new K/V into their slots and returns each row's whole K/V gathered
    in position order, padded to the longest row's blocks with position -1 so the model masks it.
    """

    in_order = False  # keys come back per row, padded: the model must build the mask
    window: int | None = None
    wants_attention = False

    def __init__(self, pool: KVPool, block_tables: Sequence[Sequence[int]]):
        self.pool = pool
        self.tables = table_tensor(block_tables, pool.k.device)  # (B, M)
        self.length = 0

    @classmethod
    def from_tables(cls, pool: KVPool, tables: Tensor) -> PagedKVBatch:
        """The same over block tables already padded into a tensor (B, M) (a rank of a
        tensor-parallel engine receives them so)."""
        batch = cls(pool, [[]])
        batch.tables = tables.to(pool.k.device)
        return batch

    @property
    def batch_size(self) -> int:
        return self.tables.shape[0]

    def reserve(self, positions: Tensor) -> Tensor:
        if positions.shape[0] != self.tables.shape[0]:
            raise ValueError(f"{self.tables.shape[0]} block tables for a batch of {positions.shape[0]} rows")
        context_lens = positions.max(dim=1).values + 1  # (B,)
        if int(context_lens.max()) > self.tables.shape[1] * self.pool.block_size:
            raise CacheFullError("a row's positions run past the end of its block table")
        self.length = int(context_lens.max()) - positions.shape[1]  # so the model's context check is exact
        self.new_slots = slot_mapping(self.tables, positions, self.pool.block_size)  # (B, T)
        self.read_tables = self.tables[:, : blocks_for(int(context_lens.max()), self.pool.block_size)]  # (B, M)
        return context_positions(context_lens, self.read_tables.shape[1] * self.pool.block_size)  # (B, S)

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        valid = self.new_slots >= 0  # (B, T)
        slots = self.new_slots[valid]  # (N,)
        for pool, new in ((self.pool.k[layer], k), (self.pool.v[layer], v)):
            pool.flatten(0, 1)[slots] = new.transpose(1, 2)[valid]  # (N, Hkv, hd)
        return gather_kv(self.pool.k[layer], self.read_tables), gather_kv(self.pool.v[layer], self.read_tables)

    def truncate(self, length: int) -> None:
        """Nothing to forget here: the pool keeps no lengths, each forward's positions decide how far
        each row reads, so a rollback is the next forward continuing from ``length``. Blocks are
        given back through ``BlockManager.free``."""
        if length < 0:
            raise ValueError(f"cannot truncate to a negative length, got {length}")

    def record_attention(self, layer: int, probs: Tensor) -> None:
        """Attention probabilities are not wanted (``wants_attention`` is False)."""


def kv_waste(lengths: Sequence[int], block_size: int | None, max_len: int | None = None) -> float:
    """Fraction of reserved KV slots left empty when sequences end at ``lengths`` tokens.

    ``block_size=None`` is contiguous preallocation of ``max_len`` slots per sequence; otherwise
    each sequence holds whole blocks, so only its last block is partly empty.
    """
    if not lengths or min(lengths) < 1:
        raise ValueError("lengths must be a non-empty list of positive token counts")
    if block_size is None:
        if max_len is None or max_len < max(lengths):
            raise ValueError(f"contiguous preallocation needs max_len >= the longest sequence ({max(lengths)})")
        reserved = max_len * len(lengths)
    else:
        reserved = sum(blocks_for(n, block_size) * block_size for n in lengths)
    return 1.0 - sum(lengths) / reserved


def token_slot(table: Sequence[int], position: int, block_size: int) -> int:
    """The flat pool slot of the token at ``position``: block
    table[position // block_size], offset position % block_size inside it
    (``slot_mapping`` does the same for a whole batch)."""
    if not 0 <= position < len(table) * block_size:
        raise IndexError(f"position {position} is outside the {len(table)} blocks of this table")
    return table[position // block_size] * block_size + position % block_size
