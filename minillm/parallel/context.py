"""Context parallelism: the sequence split over the ranks, attention by ring (chapter 15).

Tensor parallelism splits the weights; context parallelism splits the *tokens*. Everything in a
transformer except attention works token by token (embedding, norms, q/k/v and output
projections, MLP), so a rank holding a slice of a long prompt computes those for its slice alone.
Attention is the one place where a token needs the others: each query must see every earlier key.

Ring attention (Liu, Zaharia & Abbeel, 2023, "Ring Attention with Blockwise Transformers for
Near-Infinite Context") moves the keys instead of the queries. Each of the p ranks keeps its
queries and starts with its own K/V block; at each of p - 1 steps it passes the block it holds to
the next rank in a ring and receives one from the previous, so after p - 1 steps every query has
met every key. What makes this exact
is the online softmax of FlashAttention (Milakov & Gimelshein, 2018; Dao, 2023): attention over a
block B of keys is summarised by its output and the log-sum-exp of its scores,

    o_B = sum_{j in B} softmax_B(s)_j v_j,        lse_B = log sum_{j in B} exp(s_j),

and two blocks merge exactly, in any order:

    lse = log(exp(lse_A) + exp(lse_B)),           o = exp(lse_A - lse) o_A + exp(lse_B - lse) o_B.

A query that sees no key of a block has lse = -inf and weight 0 (``merge_partials`` never forms
-inf - -inf).

Causal load balance. Cut in order (``contiguous_layout``), rank p - 1 holds the last tokens,
which see the whole sequence, while rank 0's see only its first slice: the busiest rank does
about (2p - 1)/p times the mean work (``causal_work``, ``imbalance``), and the others wait for
it. The zigzag layout cuts the sequence into 2p chunks and gives rank r chunks r and 2p - 1 - r,
one early and one late, so every rank does nearly the same work; Llama 3's context parallelism
(Dubey et al., 2024) splits this way. The price: with zigzag no rank can skip a whole K/V block
(each holds a late chunk), whereas in order rank r skips the p - 1 - r blocks of later ranks.

Ragged slices. When p (or 2p) does not divide T, slices differ by a token (two with zigzag). A ring step sends and
receives tensors of one shape, so every rank pads its K/V slice to the longest slice with zeros
at position -1, which no query ever sees (``pad_tokens``). The padding is sent like the rest:
``ring_bytes`` counts the padded slice, ``padding_tokens`` what of it is padding.

Bytes. A rank sends, in one ring attention, (p - 1) x (K + V + key positions) of the padded
slice of length L: (p - 1) (2 B Hkv L hd e + B L 8) bytes with e bytes per element and int64
positions (``ring_bytes``); the counted ``Comm`` holds the run to it exactly. Here the exchange
and the block's attention run one after the other; real implementations overlap them (the next
block is in flight while this one is computed), which hides the transfer when a block's
attention takes longer than its trip to the neighbour.

PyTorch's own. ``torch.distributed.tensor.experimental.context_parallel`` shards buffers along
the sequence and replaces SDPA by a ring. In torch 2.13 on a 2-rank gloo CPU mesh, calling
``F.scaled_dot_product_attention(q, k, v, is_causal=True)`` inside it raises
``NotImplementedError: Operator aten._scaled_dot_product_flash_attention_for_cpu.default does
not have a sharding strategy registered.``; forcing the math backend (``sdpa_kernel(MATH)``)
raises ``RuntimeError: aten.add.Tensor got mixed torch.Tensor and DTensor, need to convert all
torch.Tensor to DTensor before calling distributed operators!``. Its ring replaces only the
flash, memory-efficient and cuDNN SDPA kernels (the CUDA ones), not the CPU flash kernel; hence
the hand-written ring here, which runs on both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from minillm.core.checkpoints import load
from minillm.core.model import Transformer, apply_rope, rope_cos_sin
from minillm.parallel.comm import Comm

POSITION_BYTES = 8  # key positions travel as int64
LAYOUTS = ("contiguous", "zigzag")


# --- one block of attention and the merge of two -------------------------------------------------


def attention_with_lse(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, k_pos: Tensor) -> tuple[Tensor, Tensor]:
    """Causal attention of queries over one block of keys, with the log-sum-exp of the scores.

    q (B, H, Tq, hd); k, v (B, Hkv, Tk, hd), H a multiple of Hkv (GQA: K/V heads repeated);
    q_pos (B, Tq), k_pos (B, Tk) integer positions: query i sees key j when 0 <= k_pos_j <= q_pos_i
    (-1 marks padding). Returns out (B, H, Tq, hd) and lse (B, H, Tq), both fp32; a query that sees
    no key of the block gets out 0 and lse -inf.
    """
    n_rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(n_rep, dim=1).float()  # (B, H, Tk, hd)
    v = v.repeat_interleave(n_rep, dim=1).float()  # (B, H, Tk, hd)
    scores = (q.float() @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])  # (B, H, Tq, Tk)
    visible = (k_pos[:, None, :] >= 0) & (k_pos[:, None, :] <= q_pos[:, :, None])  # (B, Tq, Tk)
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    lse = scores.logsumexp(dim=-1)  # (B, H, Tq); -inf where nothing is visible
    probs = (scores - finite_or_zero(lse)[..., None]).exp()  # exp(-inf) = 0 on masked keys
    return probs @ v, lse


def finite_or_zero(lse: Tensor) -> Tensor:
    """lse with -inf replaced by 0, so that subtracting it never forms -inf - (-inf)."""
    return torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))


def merge_partials(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """Exact attention over two disjoint key blocks from each block's (out, lse).

    out (B, H, T, hd), lse (B, H, T). lse = log(e^lse_a + e^lse_b);
    out = e^(lse_a - lse) out_a + e^(lse_b - lse) out_b (Dao, 2023; Liu et al., 2023).
    -inf on either side (or both) is safe."""
    lse = torch.logaddexp(lse_a, lse_b)  # (B, H, T)
    ref = finite_or_zero(lse)
    weight_a = (lse_a - ref).exp()[..., None]  # (B, H, T, 1); 0 where lse_a = -inf
    weight_b = (lse_b - ref).exp()[..., None]
    return weight_a * out_a + weight_b * out_b, lse


# --- which tokens each rank holds ----------------------------------------------------------------


def check_split(seq_len: int, world: int) -> None:
    for name, value in (("seq_len", seq_len), ("world", world)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if seq_len < world:
        raise ValueError(f"seq_len={seq_len} is shorter than world={world}: some rank would hold no token")


def chunks(seq_len: int, n: int) -> list[range]:
    """[0, seq_len) cut into n consecutive ranges whose sizes differ by at most one (longer first)."""
    size, extra = divmod(seq_len, n)
    starts = [i * size + min(i, extra) for i in range(n + 1)]
    return [range(starts[i], starts[i + 1]) for i in range(n)]


def contiguous_layout(seq_len: int, world: int) -> list[list[int]]:
    """Rank r holds the r-th of ``world`` consecutive slices."""
    check_split(seq_len, world)
    return [list(c) for c in chunks(seq_len, world)]


def zigzag_layout(seq_len: int, world: int) -> list[list[int]]:
    """2 * world chunks; rank r holds chunks r and 2 * world - 1 - r (one early, one late)."""
    check_split(seq_len, world)
    parts = chunks(seq_len, 2 * world)
    return [list(parts[r]) + list(parts[2 * world - 1 - r]) for r in range(world)]


def make_layout(name: str, seq_len: int, world: int) -> list[list[int]]:
    if name == "contiguous":
        return contiguous_layout(seq_len, world)
    if name == "zigzag":
        return zigzag_layout(seq_len, world)
    raise ValueError(f"layout must be one of {LAYOUTS}, got {name!r}")


def causal_work(layout: list[list[int]]) -> list[int]:
    """Per rank, the (query, key) pairs with key <= query that its queries attend over: sum of (i + 1)."""
    return [sum(i + 1 for i in tokens) for tokens in layout]


def imbalance(work: list[int]) -> float:
    """max / mean: how long the busiest rank takes relative to a perfect split (1.0)."""
    return max(work) / (sum(work) / len(work))


def skipped_blocks(layout: list[list[int]]) -> list[int]:
    """Per rank, the K/V blocks (other ranks' slices) entirely in the future of all its queries."""
    return [sum(min(other) > max(mine) for other in layout if other is not mine) for mine in layout]


def padded_length(layout: list[list[int]]) -> int:
    """The common slice length every ring message is padded to: the longest slice."""
    return max(len(tokens) for tokens in layout)


def padding_tokens(layout: list[list[int]]) -> list[int]:
    """Per rank, how many of its padded slice's tokens are padding."""
    length = padded_length(layout)
    return [length - len(tokens) for tokens in layout]


def ring_bytes(world: int, batch: int, n_kv_heads: int, slice_len: int, head_dim: int, element_size: int = 4) -> int:
    """Bytes one rank sends in one ring attention: (p - 1) x (K + V + int64 key positions) of its
    padded slice of ``slice_len`` tokens. Linear in ``slice_len``: the padding's share of it is
    ``ring_bytes`` with ``slice_len`` = that rank's ``padding_tokens``."""
    block = 2 * batch * n_kv_heads * slice_len * head_dim * element_size + batch * slice_len * POSITION_BYTES
    return (world - 1) * block


def pad_tokens(x: Tensor, length: int, dim: int, value: float = 0) -> Tensor:
    """x padded along ``dim`` with ``value`` up to ``length`` entries."""
    missing = length - x.shape[dim]
    if missing < 0:
        raise ValueError(f"cannot pad {x.shape[dim]} tokens down to {length}")
    shape = list(x.shape)
    shape[dim] = missing
    return torch.cat([x, x.new_full(shape, value)], dim=dim)


# --- the ring ------------------------------------------------------------------------------------


@dataclass
class RingStats:
    """What one ring attention did on one rank: blocks attended and skipped, pairs of (query, key)
    that were visible (summed over the batch)."""

    blocks_computed: int = 0
    blocks_skipped: int = 0
    visible_pairs: int = 0


def ring_attention_with_stats(
    q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, k_pos: Tensor, comm: Comm
) -> tuple[Tensor, RingStats]:
    """``ring_attention`` and what it did (``RingStats``)."""
    if k.shape != v.shape or k.shape[2] != k_pos.shape[1] or q.shape[2] != q_pos.shape[1]:
        raise ValueError(
            f"shapes disagree: q {tuple(q.shape)}, q_pos {tuple(q_pos.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}, k_pos {tuple(k_pos.shape)}"
        )
    B, H, Tq, hd = q.shape
    out = q.new_zeros(B, H, Tq, hd, dtype=torch.float32)
    lse = q.new_full((B, H, Tq), float("-inf"), dtype=torch.float32)
    stats, last_query = RingStats(), q_pos.max()
    p, rank = comm.world_size, comm.rank
    after, before = comm.ranks[(rank + 1) % p], comm.ranks[(rank - 1) % p]  # global ranks of the neighbours
    block = [k, v, k_pos]
    for step in range(p):
        if step > 0:  # pass on what we hold, receive the previous rank's: p - 1 exchanges in all
            block = comm.ring_exchange(block, dst=after, src=before)
        block_k, block_v, block_pos = block
        visible = (block_pos >= 0) & (block_pos <= last_query)
        if not visible.any():  # every key is padding or in the future of every local query
            stats.blocks_skipped += 1
            continue
        block_out, block_lse = attention_with_lse(q, block_k, block_v, q_pos, block_pos)
        out, lse = merge_partials(out, lse, block_out, block_lse)
        stats.blocks_computed += 1
        seen = (block_pos[:, None, :] >= 0) & (block_pos[:, None, :] <= q_pos[:, :, None])
        stats.visible_pairs += int(seen.sum())
    return out.to(q.dtype), stats


def ring_attention(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, k_pos: Tensor, comm: Comm) -> Tensor:
    """Causal attention of this rank's queries over every rank's keys, the K/V passed round a ring.

    q (B, H, Tq, hd) and q_pos (B, Tq): this rank's queries; k, v (B, Hkv, L, hd) and k_pos (B, L):
    its K/V slice, padded (position -1) to the length L every rank uses. Returns (B, H, Tq, hd).
    The compute of a block wholly in the future of all local queries is skipped; its pass-on is not.
    """
    return ring_attention_with_stats(q, k, v, q_pos, k_pos, comm)[0]


# --- a rank's check: the same seeded problem everywhere, its slice through the ring ---------------


@dataclass(frozen=True)
class RingSpec:
    """One ring-attention problem that every rank builds from the same seed."""

    seed: int = 0
    batch: int = 2
    n_heads: int = 4
    n_kv_heads: int = 4
    head_dim: int = 8
    seq_len: int = 13
    layout: str = "zigzag"

    def __post_init__(self):
        for name in ("batch", "n_heads", "n_kv_heads", "head_dim", "seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")

    def tensors(self) -> tuple[Tensor, Tensor, Tensor]:
        """The whole sequence's q (B, H, T, hd), k and v (B, Hkv, T, hd), fp32."""
        gen = torch.Generator().manual_seed(self.seed)
        B, T, hd = self.batch, self.seq_len, self.head_dim
        q = torch.randn(B, self.n_heads, T, hd, generator=gen)
        k = torch.randn(B, self.n_kv_heads, T, hd, generator=gen)
        v = torch.randn(B, self.n_kv_heads, T, hd, generator=gen)
        return q, k, v


@dataclass
class RingResult:
    """A rank's part of a ring check: its tokens, its output rows, what it sent and computed.
    Arrays are NumPy (``portable``)."""

    tokens: list[int]
    out: np.ndarray  # (B, H, len(tokens), hd)
    counts: dict[str, dict[str, int]]
    stats: RingStats
    padding: int  # padding tokens in this rank's ring messages


def ring_check(rank: int, world: int, spec: RingSpec, comm: Comm | None = None) -> RingResult:
    """Run ``spec`` on this rank: take its slice of the seeded q/k/v, pad the K/V, ring-attend.

    ``comm``: the ring's group (default the whole world); ``rank`` and ``world`` are within it."""
    comm = comm or Comm()
    comm.reset()  # the counts returned are this check's alone
    layout = make_layout(spec.layout, spec.seq_len, world)
    tokens, length = layout[rank], padded_length(layout)
    q, k, v = spec.tensors()
    index = torch.tensor(tokens)
    positions = index.expand(spec.batch, -1)  # (B, n): the tokens' own positions
    k_local = pad_tokens(k[:, :, index], length, dim=2)  # (B, Hkv, L, hd)
    v_local = pad_tokens(v[:, :, index], length, dim=2)
    k_pos = pad_tokens(positions, length, dim=1, value=-1)  # (B, L)
    out, stats = ring_attention_with_stats(q[:, :, index], k_local, v_local, positions, k_pos, comm)
    return RingResult(tokens, portable(out), comm.counts(), stats, length - len(tokens))


# --- a whole-model prefill with the tokens split over the ranks ----------------------------------


@torch.no_grad()
def context_parallel_prefill(
    model: Transformer, input_ids: Tensor, layout: list[list[int]], comm: Comm
) -> tuple[Tensor | None, list[tuple[Tensor, Tensor]]]:
    """Prefill one prompt with its tokens split by ``layout``; attention by ring, the rest per token.

    input_ids (1, T): the whole prompt (each rank reads only its own tokens). Returns the last
    token's logits (1, vocab) on the rank that holds that token (None elsewhere) and, per layer,
    this rank's K/V slice (1, Hkv, n_local, hd), the shard of the KV cache it would keep for decoding.
    Reuses the model's modules (norms, qkv_proj, RoPE, o_proj, MLP, LM head); the model is not changed.
    """
    cfg = model.config
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"input_ids must be one prompt (1, T), got shape {tuple(input_ids.shape)}")
    if cfg.sliding_window is not None:
        raise ValueError("context_parallel_prefill does not implement sliding-window attention")
    if len(layout) != comm.world_size:
        raise ValueError(f"layout has {len(layout)} ranks, the group {comm.world_size}")
    tokens, length = layout[comm.rank], padded_length(layout)
    index = torch.tensor(tokens, device=input_ids.device)
    positions = index[None]  # (1, n)
    k_pos = pad_tokens(positions, length, dim=1, value=-1)  # (1, L)
    x = model.embed_tokens(input_ids[:, index])  # (1, n, D)
    cos, sin = rope_cos_sin(positions, model.inv_freq, x.dtype)
    kv_slices = []
    for layer in model.layers:
        h = layer.input_layernorm(x)
        attn_out, kv = _ring_attention_block(layer.self_attn, h, cos, sin, positions, k_pos, comm)
        x = x + attn_out
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        kv_slices.append(kv)
    last = input_ids.shape[1] - 1
    if last not in tokens:
        return None, kv_slices
    hidden = model.norm(x[:, tokens.index(last)])  # (1, D)
    return model.lm_head(hidden), kv_slices


def _ring_attention_block(attn, h: Tensor, cos, sin, positions, k_pos, comm) -> tuple[Tensor, tuple[Tensor, Tensor]]:
    """The model's ``Attention.forward`` with ring attention in place of its local attention."""
    B, n, _ = h.shape
    H, Hkv, hd = attn.n_heads, attn.n_kv_heads, attn.head_dim
    qkv = attn.qkv_proj(h).view(B, n, H + 2 * Hkv, hd).transpose(1, 2)  # (B, H+2Hkv, n, hd)
    qk = apply_rope(qkv[:, : H + Hkv], cos, sin)
    q, k, v = qk[:, :H], qk[:, H:], qkv[:, H + Hkv :]  # (B, H, n, hd), (B, Hkv, n, hd) x 2
    length = k_pos.shape[1]
    y = ring_attention(q, pad_tokens(k, length, 2), pad_tokens(v, length, 2), positions, k_pos, comm)
    return attn.o_proj(y.transpose(1, 2).reshape(B, n, H * hd)), (k, v)


@dataclass(frozen=True)
class PrefillSpec:
    """A context-parallel prefill of the bundled model on ``seq_len`` seeded random tokens."""

    model: str = "minillm-target"
    seq_len: int = 37
    layout: str = "zigzag"
    seed: int = 0

    def __post_init__(self):
        if isinstance(self.seq_len, bool) or not isinstance(self.seq_len, int) or self.seq_len < 1:
            raise ValueError(f"seq_len must be a positive integer, got {self.seq_len!r}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")

    def input_ids(self, vocab_size: int) -> Tensor:
        gen = torch.Generator().manual_seed(self.seed)
        return torch.randint(0, vocab_size, (1, self.seq_len), generator=gen)


@dataclass
class PrefillResult:
    tokens: list[int]
    logits: np.ndarray | None  # (1, vocab) on the rank holding the last token
    kv: list[tuple[np.ndarray, np.ndarray]]  # per layer, this rank's (k, v) (1, Hkv, n, hd)
    counts: dict[str, dict[str, int]]


def prefill_check(rank: int, world: int, spec: PrefillSpec, comm: Comm | None = None) -> PrefillResult:
    """Load the model on this rank and prefill its slice of the seeded prompt (``comm`` as in ``ring_check``)."""
    comm = comm or Comm()
    comm.reset()  # the counts returned are this check's alone
    model, _ = load(spec.model, device="cpu", dtype=torch.float32)
    ids = spec.input_ids(model.config.vocab_size)
    layout = make_layout(spec.layout, spec.seq_len, world)
    logits, kv = context_parallel_prefill(model.eval(), ids, layout, comm)
    kv_arrays = [(portable(k), portable(v)) for k, v in kv]
    return PrefillResult(layout[rank], None if logits is None else portable(logits), kv_arrays, comm.counts())


def portable(t: Tensor) -> np.ndarray:
    """A rank's tensor as a NumPy array for the trip back: a tensor put on a torch.multiprocessing
    queue travels as a shared-memory handle that dies with the rank's process."""
    return t.detach().cpu().numpy()


def group_comms(rank: int, world: int, sizes: set[int]) -> dict[int, Comm]:
    """For each group size, this rank's Comm: the world cut into consecutive groups of that size.

    Every rank creates every group (``new_group`` is collective) and keeps the one it is in."""
    comms = {}
    for size in sorted(sizes):
        if world % size:
            raise ValueError(f"cannot cut a world of {world} ranks into groups of {size}")
        if size == world:
            comms[size] = Comm()
            continue
        for start in range(0, world, size):
            ranks = list(range(start, start + size))
            group = dist.new_group(ranks)
            if rank in ranks:
                comms[size] = Comm(group, ranks)
    return comms


def run_checks(rank: int, world: int, cases: tuple[tuple[int, RingSpec | PrefillSpec], ...]) -> list:
    """Every case ``(group size, spec)`` in one launch, each on this rank's group of that size
    (``RingSpec`` -> ``ring_check``, ``PrefillSpec`` -> ``prefill_check``)."""
    comms = group_comms(rank, world, {size for size, _ in cases})
    results = []
    for size, spec in cases:
        comm = comms[size]
        check = ring_check if isinstance(spec, RingSpec) else prefill_check
        results.append(check(comm.rank, comm.world_size, spec, comm))
    return results
