"""Paged-attention decode kernel in Triton (PagedAttention, Kwon et al., 2023).

At decode each sequence brings one new query token, and its keys and values lie scattered over
the ``KVPool`` in blocks of ``block_size`` tokens, listed in order by its block table
(``minillm.kv.paged``). The PyTorch reference, ``minillm.kv.paged.paged_attention_decode``, first
gathers every sequence's blocks into a contiguous copy, then attends to the copy: the cache is
read twice and written once more. This kernel reads each key and value straight from its block,
once, and keeps the softmax online as in FlashAttention-2 (Dao, 2023).

One program serves one (sequence, K/V head) pair and all the ``n_rep`` query heads that share
that K/V head (grouped-query attention), so each K/V byte is read once per group. It walks the
sequence's context in tiles of ``TILE`` tokens; token t of the context lies in pool block
``block_tables[b, t // block_size]`` at slot ``t % block_size``. Context lengths may differ per
sequence (1 <= length <= table width * block_size); any block size works.

With few sequences there are too few (sequence, head) programs to keep a large GPU's memory
system busy, so the context may also be split into ``splits`` chunks, each its own program
(split-K, as in Flash-Decoding, Dao et al., 2023). Each chunk leaves its running max, sum and
unnormalized output; ``combine_splits`` merges them with the same rescaling rule as the online
softmax.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from .flash_attention import (
    DTYPES,
    HEAD_DIMS,
    LOG2E,
    check_interpreter,
    interpreting,
    shared_memory_bytes,
)


@triton.jit
def _paged_decode_kernel(
    Q,
    K,
    V,
    Out,
    TABLES,
    LENS,
    sqb,
    sqh,
    sqd,
    skn,
    skt,
    skh,
    skd,
    svn,
    svt,
    svh,
    svd,
    sob,
    soh,
    sod,
    stb,
    stm,
    M_PART,
    L_PART,
    ACC_PART,
    n_heads,
    n_rep,
    block_size,
    scale_log2,
    chunk,
    HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr,
    TILE: tl.constexpr,
    PRECISION: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """One program: sequence b, K/V head kv_h, its n_rep query heads (padded to GROUP rows), and
    the context tokens [split * chunk, (split + 1) * chunk) of that sequence."""
    b, kv_h, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    ctx_len = tl.load(LENS + b)
    lo = split * chunk
    hi = tl.minimum(ctx_len, lo + chunk)
    offs_g = tl.arange(0, GROUP)  # query heads kv_h * n_rep + g
    offs_d = tl.arange(0, HEAD_DIM)
    heads = kv_h * n_rep + offs_g
    q_ptrs = Q + b * sqb + heads[:, None] * sqh + offs_d[None, :] * sqd
    q = tl.load(q_ptrs, mask=offs_g[:, None] < n_rep, other=0.0)  # (GROUP, hd)

    m_i = tl.full((GROUP,), float("-inf"), tl.float32)
    l_i = tl.zeros((GROUP,), tl.float32)
    acc = tl.zeros((GROUP, HEAD_DIM), tl.float32)
    for start in range(lo, hi, TILE):
        tok = start + tl.arange(0, TILE)  # (TILE,) context positions
        valid = tok < hi
        block = tl.load(TABLES + b * stb + (tok // block_size) * stm, mask=valid, other=0)  # pool block of each token
        slot = tok % block_size
        k_ptrs = K + block[:, None] * skn + slot[:, None] * skt + kv_h * skh + offs_d[None, :] * skd
        v_ptrs = V + block[:, None] * svn + slot[:, None] * svt + kv_h * svh + offs_d[None, :] * svd
        k = tl.load(k_ptrs, mask=valid[:, None], other=0.0)  # (TILE, hd)
        v = tl.load(v_ptrs, mask=valid[:, None], other=0.0)  # (TILE, hd)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # (GROUP, TILE)
        s = tl.where(valid[None, :], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every tile in [lo, hi) holds a valid token
        p = tl.math.exp2(s - m_new[:, None])  # (GROUP, TILE)
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    is_head = offs_g < n_rep
    if SPLIT:  # partial results, merged by combine_splits; an empty chunk leaves m = -inf, l = 0
        n_splits = tl.num_programs(2)
        row = (b * n_heads + heads) * n_splits + split  # (GROUP,) into (B, H, splits)
        tl.store(M_PART + row, m_i, mask=is_head)
        tl.store(L_PART + row, l_i, mask=is_head)
        tl.store(ACC_PART + row[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=is_head[:, None])
    else:
        out = acc / l_i[:, None]
        o_ptrs = Out + b * sob + heads[:, None] * soh + offs_d[None, :] * sod
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=is_head[:, None])


def combine_splits(m: Tensor, l: Tensor, acc: Tensor, dtype: torch.dtype) -> Tensor:  # noqa: E741
    """Merge per-chunk softmax states: m, l (B, H, P) in log2 units, acc (B, H, P, hd) -> (B, H, hd)."""
    m_max = m.amax(dim=-1, keepdim=True)  # (B, H, 1), finite: chunk 0 always holds token 0
    w = torch.exp2(m - m_max)  # (B, H, P), 0 for empty chunks
    return ((acc * w[..., None]).sum(dim=2) / (l * w).sum(dim=-1)[..., None]).to(dtype)


def num_splits(batch: int, n_kv: int, max_tokens: int, tile: int, device: torch.device) -> int:
    """Enough chunks for about 4 programs per SM, each chunk at least 4 tiles long."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(triton.cdiv(4 * sms, batch * n_kv), triton.cdiv(max_tokens, 4 * tile)))


def check_paged_inputs(q: Tensor, k_pool: Tensor, v_pool: Tensor, block_tables: Tensor, context_lens: Tensor) -> None:
    """Raise ValueError naming the first thing the kernel does not support."""
    if q.dim() != 3 or k_pool.dim() != 4 or v_pool.shape != k_pool.shape:
        raise ValueError(
            f"need q (B, H, hd) and pools (num_blocks, block_size, Hkv, hd); got {tuple(q.shape)}, "
            f"{tuple(k_pool.shape)}, {tuple(v_pool.shape)}"
        )
    B, H, hd = q.shape
    if k_pool.shape[3] != hd or H % k_pool.shape[2]:
        raise ValueError(f"q {tuple(q.shape)} does not fit pools {tuple(k_pool.shape)} (head dim, GQA ratio)")
    if block_tables.dim() != 2 or block_tables.shape[0] != B or context_lens.shape != (B,):
        raise ValueError(
            f"need block_tables (B, M) and context_lens (B,) for B={B}; got "
            f"{tuple(block_tables.shape)}, {tuple(context_lens.shape)}"
        )
    if hd not in HEAD_DIMS:
        raise ValueError(f"head dim {hd} is not supported by the Triton kernel (supported: {HEAD_DIMS})")
    if q.dtype not in DTYPES or k_pool.dtype != q.dtype or v_pool.dtype != q.dtype:
        raise ValueError(f"dtypes {q.dtype}, {k_pool.dtype}, {v_pool.dtype}: need one of {DTYPES} for all three")
    if q.device.type != "cuda" and not interpreting():
        raise ValueError(f"tensors on {q.device}: the kernel needs CUDA (or TRITON_INTERPRET=1 on the CPU)")


def paged_attention_decode_triton(
    q: Tensor, k_pool: Tensor, v_pool: Tensor, block_tables: Tensor, context_lens: Tensor, splits: int | None = None
) -> Tensor:
    """q (B, H, hd); pools (num_blocks, block_size, Hkv, hd); tables (B, M); lens (B,) -> (B, H, hd).

    Same contract as ``minillm.kv.paged.paged_attention_decode``; every length must be >= 1.
    ``splits`` chunks per sequence (split-K); by default enough to fill the GPU.
    """
    check_paged_inputs(q, k_pool, v_pool, block_tables, context_lens)
    check_interpreter()
    B, H, hd = q.shape
    n_kv, block_size = k_pool.shape[2], k_pool.shape[1]
    n_rep = H // n_kv
    group = max(16, triton.next_power_of_2(n_rep))  # tl.dot needs at least 16 rows
    small_smem = not interpreting() and shared_memory_bytes(q.device) < 96 * 1024  # e.g. a T4
    tile = 16 if interpreting() else 32 if small_smem else 64  # tokens per step
    max_tokens = block_tables.shape[1] * block_size
    splits = splits or num_splits(B, n_kv, max_tokens, tile, q.device)
    chunk = triton.cdiv(triton.cdiv(max_tokens, splits), tile) * tile  # tokens per chunk, whole tiles
    out = torch.empty_like(q)
    m_part = torch.empty(B, H, splits, device=q.device, dtype=torch.float32)  # unused when splits == 1
    l_part = torch.empty_like(m_part)
    acc_part = torch.empty(B, H, splits, hd, device=q.device, dtype=torch.float32)
    _paged_decode_kernel[(B, n_kv, splits)](
        q,
        k_pool,
        v_pool,
        out,
        block_tables,
        context_lens,
        *q.stride(),
        *k_pool.stride(),
        *v_pool.stride(),
        *out.stride(),
        *block_tables.stride(),
        m_part,
        l_part,
        acc_part,
        H,
        n_rep,
        block_size,
        LOG2E / math.sqrt(hd),
        chunk,
        HEAD_DIM=hd,
        GROUP=group,
        TILE=tile,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        SPLIT=splits > 1,
        num_warps=4,
        num_stages=1 if interpreting() else 2,
    )
    return combine_splits(m_part, l_part, acc_part, q.dtype) if splits > 1 else out


@torch.library.custom_op("minillm::paged_attention_decode", mutates_args=())
def paged_attention_decode_op(
    q: Tensor, k_pool: Tensor, v_pool: Tensor, block_tables: Tensor, context_lens: Tensor
) -> Tensor:
    """``paged_attention_decode_triton`` as one opaque op that ``torch.compile`` puts in its graph
    as it is (a CUDA graph captures its launch), rather than tracing its Python. The output is
    contiguous, whatever the layout of ``q``."""
    return paged_attention_decode_triton(q.contiguous(), k_pool, v_pool, block_tables, context_lens)


@paged_attention_decode_op.register_fake
def _(q: Tensor, k_pool: Tensor, v_pool: Tensor, block_tables: Tensor, context_lens: Tensor) -> Tensor:
    return q.new_empty(q.shape)
