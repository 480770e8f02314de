"""A compiled batched decode step over the paged KV cache: one new token per sequence, fixed shapes.

The engine's eager step (``Engine._forward``) builds a fresh ``PagedKVBatch`` of a new (B, T)
every step, so nothing in it can be compiled or captured as a CUDA graph. ``PagedDecodeStep``
fixes every shape instead:

- the batch is padded up to a *bucket*, 1, 2, 4, 8, ... up to ``max_batch``. A padding row feeds
  token 0 at position 0 through a table of ``scratch_block`` alone, a pool block the engine never
  hands out: it writes only there, and its logits are dropped;
- the read width (blocks of K/V gathered per row) is bucketed too, in powers of two of blocks,
  because gathering the whole context (``max_seq_len / block_size`` blocks) every step costs a
  CPU more than the weights do at short contexts. Keys past a row's context are masked by their
  position, as ``PagedKVBatch`` does. One graph per (batch bucket, width);
- the inputs are one int64 buffer per batch bucket, allocated once, rows of
  ``[token, position, block 0, block 1, ...]``, filled with one ``copy_`` per step: the compiled
  function reads nothing else, so a CUDA graph can replay it.

Inside the graph, ``PagedDecodeView`` is the model's cache (the protocol of ``PagedKVBatch``): no
host syncs, no boolean-mask indexing; each layer's new K and V go to their slots with
``index_put_`` on the whole pool tensor (no view of it is mutated: writing into a slice of a
graph input makes the compiler copy the whole input). The attention, ``attention=``:

- "gather": the cache gathers each row's blocks (``kv.paged.gather_kv``) and the model attends
  with its own attention (SDPA), as under ``PagedKVBatch``;
- "reference": the model hands its queries to the cache (``cache.attend``, since the cache
  ``attends``), which attends through ``kv.paged.paged_attention_decode``: the same gather, then
  matmuls and a softmax that the compiler fuses into its own loops. Compiled on the CPU this is
  the default: SDPA's CPU kernel serves one query per row poorly (minillm-target, batch 8, one
  thread: 10-20% faster at 64-200 tokens of context, 1.7-2.2x at 600-1000; a tie at batch 1).
  Eagerly, unfused, it is the slower one (2x at batch 8): there "gather" is the default;
- "triton": ``cache.attend`` runs the Triton paged-attention kernel, which reads the pool in
  place: nothing is gathered and the read width is not bucketed (the kernel stops at each row's
  context length), so one graph per batch bucket is enough. The default on CUDA.

The two through ``attend`` attend to each row's whole context: a model with a sliding window
gets "gather", whose mask the model builds with its window.

Compiling follows ``core.compiled.CompiledForward``: ``torch.compile(fullgraph=True,
dynamic=False)``, on CUDA with ``mode="reduce-overhead"`` (CUDA graphs, outputs cloned), on the
CPU with the weights frozen; a code object of its own, and the guards skipped once a graph is
settled. ``warmup`` compiles every graph before a timer starts and returns the seconds it took.
``compile=False`` runs the same fixed-shape code eagerly.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from torch import Tensor

from ..core.cache import CacheFullError
from ..core.compiled import RECOMPILE_LIMIT, compile_options, compiling, own_code
from ..core.device import synchronize
from ..kv.paged import KVPool, blocks_for, context_positions, gather_kv, paged_attention_decode

ATTENTION_KINDS = ("auto", "gather", "reference", "triton")
SMALLEST_READ = 64  # tokens: the narrowest read width; narrower ones save a CPU little (see read_widths)


def powers_of_two(top: int, smallest: int = 1) -> tuple[int, ...]:
    """smallest, 2 * smallest, 4 * smallest, ... below ``top``, then ``top`` itself."""
    out, n = [], smallest
    while n < top:
        out.append(n)
        n *= 2
    return (*out, top)


def read_widths(max_blocks: int, block_size: int, smallest_tokens: int = SMALLEST_READ) -> tuple[int, ...]:
    """The read widths (in blocks) a gathering step compiles: powers of two times the fewest blocks
    that hold ``smallest_tokens``, up to ``max_blocks``. Each doubling of what is gathered costs a
    CPU more (minillm-target compiled, batch 8, "gather", one thread of an AMD EPYC: 7.6 ms at 8
    blocks of 16 tokens, 11.5 at 16, 16 at 32, 50 at 64) but below 64 tokens little (5.9 ms at 1
    block), not worth a graph per batch bucket."""
    return powers_of_two(max_blocks, min(max_blocks, blocks_for(smallest_tokens, block_size)))


def triton_decode_supported(model) -> str | None:
    """Why the Triton paged-decode kernel cannot serve this model, or None when it can."""
    from ..core.attention import triton_available

    if not triton_available():
        return "triton is not installed"
    if model.device.type != "cuda":
        return f"device {model.device.type}"
    if model.config.head_dim not in (16, 32, 64, 128):
        return f"head dim {model.config.head_dim}"
    if model.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"dtype {model.dtype}"
    return None


def triton_decode(q: Tensor, k_pool: Tensor, v_pool: Tensor, tables: Tensor, lens: Tensor) -> Tensor:
    """The Triton kernel as an opaque op of the graph (``kernels.paged_attention``'s custom op)."""
    from ..kernels.paged_attention import paged_attention_decode_op

    return paged_attention_decode_op(q, k_pool, v_pool, tables, lens)


class PagedDecodeView:
    """The ``Cache`` protocol over a ``KVPool`` for one decode token per row, every shape fixed.

    ``tables`` (B, M) are the rows' blocks (padded with any valid block: what lies past a row's
    context is masked), ``positions`` (B, 1) the new tokens' positions; each row's context is
    then ``position + 1`` tokens, which must fit in its M blocks. ``kernel`` (None: gather, then
    the model's own attention) is a paged-attention function ``(q (B, H, hd), k_pool, v_pool,
    tables, lens) -> (B, H, hd)`` that the model calls through ``attend`` instead.
    """

    in_order = False  # keys come back per row, padded: the model builds the mask
    window: int | None = None
    wants_attention = False
    length = 0  # the graph never depends on how full the pool is: positions decide

    def __init__(self, pool: KVPool, tables: Tensor, positions: Tensor, kernel=None):
        bs = pool.block_size
        self.pool, self.tables, self.kernel = pool, tables, kernel
        self.attends = kernel is not None
        pos = positions[:, 0]  # (B,)
        self.lens = pos + 1  # (B,) context lengths, the new token's included
        self.blocks = tables.gather(1, (pos // bs)[:, None])[:, 0]  # (B,) the block each new token goes to
        self.offsets = pos % bs  # (B,) its slot in that block

    @property
    def batch_size(self) -> int:
        return self.tables.shape[0]

    def reserve(self, positions: Tensor) -> Tensor:
        return context_positions(self.lens, self.tables.shape[1] * self.pool.block_size)  # (B, M * bs)

    def _write(self, layer: int, k: Tensor, v: Tensor) -> None:
        """k, v (B, Hkv, 1, hd) into their slots, on the whole pool tensor (no view of it mutated)."""
        index = (torch.full_like(self.blocks, layer), self.blocks, self.offsets)
        self.pool.k.index_put_(index, k[:, :, 0])  # pool (L, N, bs, Hkv, hd)[layer, block, offset] = (Hkv, hd)
        self.pool.v.index_put_(index, v[:, :, 0])

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        self._write(layer, k, v)
        return gather_kv(self.pool.k[layer], self.tables), gather_kv(self.pool.v[layer], self.tables)

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Write k, v, then attend q (B, H, 1, hd) to each row's context through its table -> (B, H, 1, hd)."""
        self._write(layer, k, v)
        return self.kernel(q[:, :, 0], self.pool.k[layer], self.pool.v[layer], self.tables, self.lens)[:, :, None]

    def truncate(self, length: int) -> None:
        """Nothing to forget: positions decide what each row reads (as ``PagedKVBatch``)."""

    def record_attention(self, layer: int, probs: Tensor) -> None:
        """Attention probabilities are not wanted (``wants_attention`` is False)."""


class PagedDecodeStep:
    """One decode token per sequence over a ``KVPool``, batches padded to size buckets.

    ``step(tokens, positions, tables)`` -> logits (B, V) after each row's one new token; the
    token's K/V go into the pool at the slot of its position through its block table, exactly
    as ``PagedKVBatch`` writes them. ``scratch_block`` is a pool block never handed to a
    sequence: padding rows write there. ``attention``: "gather" (gather the table's blocks, the
    model's attention), "reference" (the PyTorch paged decode of ``kv.paged`` through the
    ``attend`` hook), "triton" (the Triton kernel through that hook), or "auto": "triton" on
    CUDA where it runs, else "reference" compiled and "gather" eagerly (see the module's
    docstring). ``block_buckets`` overrides the read widths (in blocks).
    """

    def __init__(
        self,
        model,
        pool: KVPool,
        max_batch: int,
        scratch_block: int,
        compile: bool = True,
        attention: str = "auto",  # "gather", "reference", "triton"; see the module's docstring
        block_buckets: Sequence[int] | None = None,
        max_len: int | None = None,
    ):
        num_blocks, bs = pool.k.shape[1], pool.block_size
        if max_batch < 1:
            raise ValueError(f"max_batch must be positive, got {max_batch}")
        if not 0 <= scratch_block < num_blocks:
            raise ValueError(f"scratch_block {scratch_block} is not a block of this pool (0..{num_blocks - 1})")
        if attention not in ATTENTION_KINDS:
            raise ValueError(f"attention must be one of {ATTENTION_KINDS}, got {attention!r}")
        windowed = model.config.sliding_window is not None  # the hook's kernels see every key of a row
        if attention == "auto":
            triton = triton_decode_supported(model) is None and not windowed
            attention = "triton" if triton else "reference" if compile and not windowed else "gather"
        if attention != "gather" and windowed:
            raise ValueError(f"attention {attention!r} has no sliding window: use 'gather' for this model")
        self.model, self.pool, self.scratch_block = model, pool, scratch_block
        self.max_batch, self.attention, self.compile = max_batch, attention, compile
        self.device = pool.k.device
        self.max_blocks = blocks_for(
            max_len or model.config.max_seq_len, bs
        )  # a row never reads more (max_len: the engine's context)
        self.buckets = powers_of_two(max_batch)
        if block_buckets is None:  # the kernel reads each row to its length: one width, the widest
            block_buckets = (self.max_blocks,) if attention == "triton" else read_widths(self.max_blocks, bs)
        self.block_buckets = tuple(sorted(set(block_buckets)))
        if self.block_buckets[0] < 1 or self.block_buckets[-1] < self.max_blocks:
            raise ValueError(f"block_buckets must be positive and reach {self.max_blocks} blocks")
        self.kernel = {"gather": None, "reference": paged_attention_decode, "triton": triton_decode}[attention]
        # One int64 buffer per batch bucket: rows of [token, position, block 0, ..., block max_blocks-1].
        self.inputs = {
            b: torch.zeros(b, 2 + self.max_blocks, dtype=torch.long, device=self.device) for b in self.buckets
        }
        self.graphed = self.device.type == "cuda"
        if compile:
            # The pool is written in place. The input buffers are static for a CUDA graph to read
            # them where they are; not on the CPU, where freezing folds static tensors that the
            # graph does not write into constants.
            static = (pool.k, pool.v, *self.inputs.values()) if self.graphed else (pool.k, pool.v)
            for t in static:
                torch._dynamo.mark_static_address(t)
            graphs = len(self.buckets) * len(self.block_buckets)
            limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT, 2 * graphs)
            torch._dynamo.config.recompile_limit = limit
            run = own_code(PagedDecodeStep._run).__get__(self)
            self.compiled = torch.compile(run, fullgraph=True, dynamic=False, **compile_options(self.device))
        self.settled: set[tuple[int, int]] = set()  # (bucket, width): compiled, guards skipped from now on
        self.calls: dict[tuple[int, int], int] = {}

    @property
    def graphs(self) -> int:
        """How many graphs ``warmup`` compiles: one per (batch bucket, read width)."""
        return len(self.buckets) * len(self.block_buckets)

    def bucket(self, batch: int) -> int:
        """The smallest batch bucket that holds ``batch`` rows."""
        return next(b for b in self.buckets if b >= batch)

    def width(self, blocks: int) -> int:
        """The smallest read width (in blocks) that holds ``blocks`` blocks."""
        return next(w for w in self.block_buckets if w >= blocks)

    def _run(self, inputs: Tensor, width: int) -> Tensor:
        """The fixed-shape step: inputs (b, 2 + max_blocks) -> logits (b, V)."""
        ids, positions, tables = inputs[:, 0:1], inputs[:, 1:2], inputs[:, 2 : 2 + width]
        view = PagedDecodeView(self.pool, tables, positions, self.kernel)
        return self.model(ids, positions, view, last_only=True)[:, -1]

    @torch.inference_mode()
    def __call__(self, tokens: Sequence[int], positions: Sequence[int], tables: Sequence[Sequence[int]]) -> Tensor:
        B = len(tokens)
        if not 1 <= B <= self.max_batch or len(positions) != B or len(tables) != B:
            raise ValueError(
                f"need 1..{self.max_batch} rows with a position and a table each, got {B} tokens, "
                f"{len(positions)} positions and {len(tables)} tables"
            )
        bs = self.pool.block_size
        if min(positions) < 0 or max(positions) >= self.model.config.max_seq_len:
            raise ValueError(f"positions must lie in 0..{self.model.config.max_seq_len - 1}, got {list(positions)}")
        bucket, width = self.bucket(B), self.width(max(positions) // bs + 1)  # the longest row's blocks
        scratch, rows = self.scratch_block, []
        for token, pos, table in zip(tokens, positions, tables):
            if len(table) <= pos // bs:
                raise CacheFullError(f"position {pos} runs past the end of its block table ({len(table)} blocks)")
            row = [token, pos, *table[:width]]
            rows.append(row + [scratch] * (2 + width - len(row)))
        rows += [[0, 0] + [scratch] * width] * (bucket - B)  # padding rows: position 0 of the scratch block
        self.inputs[bucket][:, : 2 + width].copy_(torch.tensor(rows, dtype=torch.long), non_blocking=True)
        return self._step(bucket, width)[:B]

    def _step(self, bucket: int, width: int) -> Tensor:
        """Run the graph of (bucket, width) over what the buffer of ``bucket`` holds -> logits (bucket, V)."""
        inputs = self.inputs[bucket]
        if not self.compile:
            return self._run(inputs, width)
        if self.graphed:
            torch.compiler.cudagraph_mark_step_begin()
        key = (bucket, width)
        if key in self.settled:  # compiled: the guards only tell its graphs apart
            with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
                logits = self.compiled(inputs, width)
        else:
            with compiling(self.device):
                logits = self.compiled(inputs, width)
            if self.calls.get(key, 0) >= 1:  # a second call may recompile once; then it is settled
                self.settled.add(key)
        self.calls[key] = self.calls.get(key, 0) + 1
        return logits.clone() if self.graphed else logits  # a CUDA graph's outputs are overwritten by its next replay

    @torch.inference_mode()
    def warmup(self) -> float:
        """Compile the graph of every (batch bucket, read width) on padding rows alone (only the
        scratch block is written): twice through each (a second call may recompile once), and on
        CUDA a third time, which records the CUDA graph -> the seconds it took."""
        if not self.compile:
            return 0.0
        synchronize(self.device)
        t0 = time.perf_counter()
        for bucket in self.buckets:
            inputs = self.inputs[bucket]
            inputs[:, :2].zero_()
            inputs[:, 2:].fill_(self.scratch_block)
            for width in self.block_buckets:
                for _ in range(max(0, (3 if self.graphed else 2) - self.calls.get((bucket, width), 0))):
                    self._step(bucket, width)
        synchronize(self.device)
        return time.perf_counter() - t0
