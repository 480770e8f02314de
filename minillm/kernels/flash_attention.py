"""Fused attention forward in Triton, in the style of FlashAttention-2 (Dao, 2023).

Plain attention writes the (T, S) score matrix to memory, reads it back for the softmax and again
for the product with V. FlashAttention (Dao et al., 2022) never forms it: a program holds one
tile of queries in fast on-chip memory and walks over the keys and values tile by tile, keeping
for each query row a running maximum ``m``, a running softmax denominator ``l`` and an
unnormalized output ``acc``. When a new tile raises the maximum, the old ``l`` and ``acc`` are
rescaled by ``exp(m_old - m_new)`` (the *online softmax*, Milakov & Gimelshein, 2018). Q, K and
V are each read from memory once and the output written once. FlashAttention-2 puts the loop
over keys inside a program that owns a query tile (parallel over query tiles, batch and heads)
and divides by ``l`` only once at the end; this kernel does the same.

``minillm.core.attention.attention_tiled`` is the same algorithm in plain PyTorch, one key tile at a
time: the math this kernel implements, readable, and importable where Triton is not installed.

Supported: q (B, H, T, hd), k and v (B, Hkv, S, hd) with H a multiple of Hkv (grouped-query
attention: a query head reads K/V head ``h // (H // Hkv)``, nothing is repeated in memory),
T <= S, causal or not. With ``causal`` the queries are the *last* T positions: query i sits at
position ``S - T + i`` and sees keys 0..S-T+i, which serves chunked prefill and speculative
verification as well as plain prefill (T == S). Head dims 16, 32, 64, 128; fp16, bf16, fp32.
"""

from __future__ import annotations

import math
import os
import re

import numpy as np
import torch
import triton
import triton.language as tl
from torch import Tensor

HEAD_DIMS = (16, 32, 64, 128)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
LOG2E = 1.4426950408889634  # exp(x) = exp2(x * log2(e)): exp2 is the GPU's native instruction


def interpreting() -> bool:
    """True when Triton runs its CPU interpreter (TRITON_INTERPRET=1), which the tests use."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:2])


def check_interpreter(triton_version: str = triton.__version__, numpy_version: str = np.__version__) -> None:
    """Triton 3.6 and older interpret a loop whose bounds come from ``tl.program_id`` by turning a
    one-element array into an int, which numpy 2.4 and newer refuse (fixed in Triton 3.7). Say so,
    rather than fail deep inside the interpreter. On a GPU nothing is interpreted."""
    if interpreting() and _version(triton_version) < (3, 7) and _version(numpy_version) >= (2, 4):
        raise RuntimeError(
            f"Triton {triton_version}'s CPU interpreter cannot run this kernel with numpy {numpy_version}: "
            "install numpy<2.4 (Colab ships 2.0) or triton>=3.7"
        )


@triton.jit
def _attend_tile(
    q,
    k_base,
    v_base,
    skt,
    skd,
    svt,
    svd,
    start_n,
    q_pos,
    S,
    scale_log2,
    m_i,
    l_i,
    acc,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Fold keys start_n .. start_n + BLOCK_N into the running (m, l, acc) of BLOCK_M query rows.

    MASKED tiles (the last, ragged one; those on the causal diagonal) check bounds and causality;
    the others, most of them, skip that work.
    """
    offs_n = start_n + tl.arange(0, BLOCK_N)  # (BLOCK_N,) key positions
    offs_d = tl.arange(0, HEAD_DIM)
    k_ptrs = k_base + offs_n[:, None] * skt + offs_d[None, :] * skd
    v_ptrs = v_base + offs_n[:, None] * svt + offs_d[None, :] * svd
    if MASKED:
        in_range = offs_n < S
        k = tl.load(k_ptrs, mask=in_range[:, None], other=0.0)  # (BLOCK_N, hd)
        v = tl.load(v_ptrs, mask=in_range[:, None], other=0.0)
    else:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # (BLOCK_M, BLOCK_N) fp32, log2 units
    if MASKED:
        visible = in_range[None, :]
        if CAUSAL:
            visible = visible & (offs_n[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))  # (BLOCK_M,)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet
    p = tl.math.exp2(s - m_safe[:, None])  # (BLOCK_M, BLOCK_N)
    alpha = tl.math.exp2(m_i - m_safe)  # rescale of the old sums: the heart of the online softmax
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _flash_fwd_kernel(
    Q,
    K,
    V,
    Out,
    sqb,
    sqh,
    sqt,
    sqd,
    skb,
    skh,
    skt,
    skd,
    svb,
    svh,
    svt,
    svd,
    sob,
    soh,
    sot,
    sod,
    n_heads,
    n_rep,
    T,
    S,
    scale_log2,
    CAUSAL: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One program: BLOCK_M query rows of one (batch, head), looping over all their key tiles."""
    pid_m, pid_bh = tl.program_id(0), tl.program_id(1)
    b, h = pid_bh // n_heads, pid_bh % n_heads
    kv_h = h // n_rep  # GQA: the K/V head this query head shares with n_rep - 1 others
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,) query rows
    offs_d = tl.arange(0, HEAD_DIM)
    q_ptrs = Q + b * sqb + h * sqh + offs_m[:, None] * sqt + offs_d[None, :] * sqd
    q = tl.load(q_ptrs, mask=offs_m[:, None] < T, other=0.0)  # (BLOCK_M, hd), read once
    k_base = K + b * skb + kv_h * skh
    v_base = V + b * svb + kv_h * svh

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)  # running max (log2 units)
    l_i = tl.zeros((BLOCK_M,), tl.float32)  # running softmax denominator
    acc = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)  # running unnormalized output
    q_pos = offs_m + (S - T)  # query i sits at position S - T + i
    if CAUSAL:
        first_q = pid_m * BLOCK_M + (S - T)  # the tile's first query: every row sees the keys before it
        n_full = (first_q // BLOCK_N) * BLOCK_N
        end = tl.minimum(S, (pid_m + 1) * BLOCK_M + (S - T))  # later keys are in every row's future
    else:
        n_full = (S // BLOCK_N) * BLOCK_N
        end = S
    for start_n in range(0, n_full, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q,
            k_base,
            v_base,
            skt,
            skd,
            svt,
            svd,
            start_n,
            q_pos,
            S,
            scale_log2,
            m_i,
            l_i,
            acc,
            MASKED=False,
            CAUSAL=CAUSAL,
            HEAD_DIM=HEAD_DIM,
            BLOCK_N=BLOCK_N,
            PRECISION=PRECISION,
        )  # tiles every row sees in full: no masks
    for start_n in range(n_full, end, BLOCK_N):  # the causal diagonal, a ragged last tile
        m_i, l_i, acc = _attend_tile(
            q,
            k_base,
            v_base,
            skt,
            skd,
            svt,
            svd,
            start_n,
            q_pos,
            S,
            scale_log2,
            m_i,
            l_i,
            acc,
            MASKED=True,
            CAUSAL=CAUSAL,
            HEAD_DIM=HEAD_DIM,
            BLOCK_N=BLOCK_N,
            PRECISION=PRECISION,
        )
    out = acc / l_i[:, None]  # the one division, at the end (FlashAttention-2)
    o_ptrs = Out + b * sob + h * soh + offs_m[:, None] * sot + offs_d[None, :] * sod
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=offs_m[:, None] < T)


def check_attention_inputs(q: Tensor, k: Tensor, v: Tensor) -> None:
    """Raise ValueError naming the first thing the kernel does not support."""
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape:
        raise ValueError(
            f"need q (B, H, T, hd) and k, v (B, Hkv, S, hd); got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    B, H, T, hd = q.shape
    if k.shape[0] != B or k.shape[3] != hd:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} differ in batch or head dim")
    if H % k.shape[1]:
        raise ValueError(f"{H} query heads are not a multiple of {k.shape[1]} K/V heads")
    if k.shape[2] < T:
        raise ValueError(f"q_len {T} > kv_len {k.shape[2]}: the queries must be the last positions")
    if hd not in HEAD_DIMS:
        raise ValueError(f"head dim {hd} is not supported by the Triton kernel (supported: {HEAD_DIMS})")
    if q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"dtypes {q.dtype}, {k.dtype}, {v.dtype}: need one of {DTYPES} for all three")
    if not (q.device == k.device == v.device) or (q.device.type != "cuda" and not interpreting()):
        raise ValueError(f"tensors on {q.device}: the kernel needs CUDA (or TRITON_INTERPRET=1 on the CPU)")


def shared_memory_bytes(device: torch.device) -> int:
    """On-chip shared memory one program may use: ~227 KB on A100/H100/H200, ~99 KB on L4, 64 KB on T4."""
    return getattr(torch.cuda.get_device_properties(device), "shared_memory_per_block_optin", 49152)


def _tile_sizes(hd: int, dtype: torch.dtype, device: torch.device) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages): small tiles in the interpreter; on a GPU, as large
    as its shared memory holds (a Q tile plus num_stages K and V tiles in flight)."""
    if interpreting():
        return 16, 16, 4, 1
    smem = shared_memory_bytes(device)
    if dtype == torch.float32:
        return (64, 32, 4, 2) if smem >= 160 * 1024 else (32, 32, 4, 1)
    if smem >= 160 * 1024:
        return (128, 64, 8, 3) if hd == 128 else (128, 64, 4, 3)
    return (64, 64, 4, 2) if smem >= 96 * 1024 else (64, 32, 4, 2)


def flash_attention(
    q: Tensor, k: Tensor, v: Tensor, causal: bool = False, block_m: int | None = None, block_n: int | None = None
) -> Tensor:
    """Fused attention: q (B, H, T, hd), k and v (B, Hkv, S, hd) -> (B, H, T, hd) in q's dtype."""
    check_attention_inputs(q, k, v)
    check_interpreter()
    B, H, T, hd = q.shape
    S = k.shape[2]
    bm, bn, warps, stages = _tile_sizes(hd, q.dtype, q.device)
    bm = block_m or min(bm, max(16, triton.next_power_of_2(T)))  # a short q (decode) needs no 128-row tile
    bn = block_n or bn
    out = torch.empty_like(q)
    grid = (triton.cdiv(T, bm), B * H)
    _flash_fwd_kernel[grid](
        q,
        k,
        v,
        out,
        *q.stride(),
        *k.stride(),
        *v.stride(),
        *out.stride(),
        H,
        H // k.shape[1],
        T,
        S,
        LOG2E / math.sqrt(hd),
        CAUSAL=causal,
        HEAD_DIM=hd,
        BLOCK_M=bm,
        BLOCK_N=bn,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=warps,
        num_stages=stages,
    )
    return out
