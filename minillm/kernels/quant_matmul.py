"""Weight-only quantized matmul in Triton: ``y = x @ dequant(W)^T`` with the dequantization inside.

A decode step is a matrix-vector product per linear layer: its time is the time to read the
weights (chapter 3). Stored in 8 or 4 bits the weights are 2 or 4 times fewer bytes than in 16,
but only if they cross the memory bus in that form: dequantizing the whole matrix first and then
calling a dense matmul reads the small matrix, writes a 16-bit one and reads that again. Here a
program loads a tile of codes, turns it into x's dtype in registers, and feeds it to ``tl.dot``;
the 16-bit weight never exists in memory (the approach of e.g. LLM.int8()'s and GPTQ's CUDA
kernels, Dettmers et al., 2022; Frantar et al., 2023).

The formats are those of ``minillm.compression.quant`` (this module does not import it):

- int8: ``qweight`` int8 (N, K), ``scales`` fp32 (N,): ``w = q * s``. The scale of an output
  column is the same for every k, so it is applied once to the fp32 sum, after the K loop.
- int4: ``qweight`` uint8 (N, Kp / 2), two codes per byte, column 2j in the low nibble and
  2j + 1 in the high one; ``scales`` fp16 (N, G) and ``zeros`` uint8 (N, G), ``Kp = G * group``:
  ``w = (q - z) * s`` within each group of ``group_size`` consecutive k. A K tile never
  straddles two groups (BLOCK_K divides the group size), so it needs one scale and one zero per
  column. Rather than interleave the low and high nibbles back into one tile, the kernel splits
  x instead: its even columns meet the low nibbles and its odd columns the high ones, two
  ``tl.dot`` of half the depth. The padding of a last, short group (k >= K) meets zeros of x.
- fp8: ``qweight`` float8 e4m3 (N, K), ``scales`` fp32 (N,), like int8 (needs compute
  capability 8.9 on a GPU).

Products accumulate in fp32; the result is in x's dtype. Tiles: a decode shape (M <= 16 rows)
gets 16-row tiles, narrow in N, deep in K, and *split-K* when there are too few output tiles to
fill the GPU (each of ``split_k`` programs sums a slice of K and adds it atomically into an fp32
output); a prefill shape gets square-ish tiles. ``Tiles`` overrides the choice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from .flash_attention import DTYPES, check_interpreter, interpreting

DECODE_ROWS = 16  # up to this many rows of x (a decode batch), the decode tiles


@dataclass(frozen=True)
class Tiles:
    """Tile sizes of one launch: BLOCK_M x BLOCK_N outputs per program, BLOCK_K deep per step,
    K split over ``split_k`` programs. Powers of two, at least 16 (``tl.dot``'s smallest)."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"Tiles.{name} must be a power of two >= 16, got {v}")
        if self.split_k < 1:
            raise ValueError(f"Tiles.split_k must be >= 1, got {self.split_k}")


@triton.jit
def _quant_matmul_kernel(
    X,
    Q,
    S,
    Z,
    Y,
    M,
    N,
    K,
    sxm,
    sxk,
    sqn,
    sqk,
    ssn,
    ssg,
    szn,
    szg,
    sym,
    syn,
    k_per_split,
    GROUPED: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    ATOMIC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One program: outputs (BLOCK_M, BLOCK_N), summed over K slice ``program_id(2)``.

    GROUPED (int4): Q holds packed bytes (N, Kp / 2), S and Z one value per (n, group).
    Otherwise (int8, fp8): Q holds one code per weight (N, K) and S one scale per n.
    """
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BM,) rows of x
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN,) output columns = rows of W
    row_ok, col_ok = offs_m < M, offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    for k0 in range(k_start, k_end, BLOCK_K):
        if GROUPED:
            offs_j = k0 // 2 + tl.arange(0, BLOCK_K // 2)  # (BK/2,) bytes: weights 2j and 2j + 1
            x_ptrs = X + offs_m[:, None] * sxm + (2 * offs_j[None, :]) * sxk
            x_even = tl.load(x_ptrs, mask=row_ok[:, None] & (2 * offs_j[None, :] < K), other=0.0)  # (BM, BK/2)
            x_odd = tl.load(x_ptrs + sxk, mask=row_ok[:, None] & (2 * offs_j[None, :] + 1 < K), other=0.0)
            packed = tl.load(Q + offs_n[None, :] * sqn + offs_j[:, None] * sqk, mask=col_ok[None, :], other=0)
            group = k0 // GROUP_SIZE  # the tile's one group
            s = tl.load(S + offs_n * ssn + group * ssg, mask=col_ok, other=0.0).to(tl.float32)  # (BN,)
            z = tl.load(Z + offs_n * szn + group * szg, mask=col_ok, other=0).to(tl.float32)
            lo = ((packed & 0xF).to(tl.float32) - z[None, :]) * s[None, :]  # (BK/2, BN): weights 2j
            hi = ((packed >> 4).to(tl.float32) - z[None, :]) * s[None, :]  # weights 2j + 1
            acc += tl.dot(x_even, lo.to(x_even.dtype), input_precision=PRECISION)
            acc += tl.dot(x_odd, hi.to(x_odd.dtype), input_precision=PRECISION)
        else:
            offs_k = k0 + tl.arange(0, BLOCK_K)  # (BK,)
            k_ok = offs_k < K
            x = tl.load(
                X + offs_m[:, None] * sxm + offs_k[None, :] * sxk, mask=row_ok[:, None] & k_ok[None, :], other=0.0
            )
            w_ptrs = Q + offs_n[None, :] * sqn + offs_k[:, None] * sqk
            codes = tl.load(w_ptrs, mask=col_ok[None, :] & k_ok[:, None], other=0.0)  # (BK, BN), W^T's tile
            acc += tl.dot(x, codes.to(x.dtype), input_precision=PRECISION)
    if not GROUPED:  # one scale per output column: once, on the sum
        acc = acc * tl.load(S + offs_n * ssn, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    y_ptrs = Y + offs_m[:, None] * sym + offs_n[None, :] * syn
    out_ok = row_ok[:, None] & col_ok[None, :]
    if ATOMIC:
        tl.atomic_add(y_ptrs, acc, mask=out_ok)  # Y is fp32, zeroed: the K slices add up
    else:
        tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=out_ok)


def _largest_block_k(group_size: int, cap: int) -> int:
    """The largest power of two <= cap that divides the group (so a tile holds one group)."""
    b = cap
    while group_size % b:
        b //= 2
    return b


def default_tiles(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device, group_size: int = 0) -> Tiles:
    """Decode tiles for m <= DECODE_ROWS (split-K when the output tiles are fewer than twice the
    GPU's SMs), prefill tiles otherwise; small tiles in the interpreter."""
    cap_k = 32 if interpreting() else (128 if m <= DECODE_ROWS else 64 if dtype != torch.float32 else 32)
    block_k = _largest_block_k(group_size, cap_k) if group_size else cap_k
    if interpreting():
        return Tiles(16, 32, block_k, num_warps=1, num_stages=1)
    if m <= DECODE_ROWS:
        tiles = triton.cdiv(n, 32)
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        k_blocks = triton.cdiv(k, block_k)
        split = 1 if tiles >= 2 * sms else max(1, min(triton.cdiv(2 * sms, tiles), k_blocks // 8))
        return Tiles(16, 32, block_k, split_k=split, num_warps=4, num_stages=4)
    if dtype == torch.float32:
        return Tiles(32, 64, block_k, num_warps=4, num_stages=2)
    return Tiles(64, 128, block_k, num_warps=4, num_stages=3)


def _check_x(x: Tensor, k: int, n: int) -> None:
    if x.dim() < 1 or x.shape[-1] != k:
        raise ValueError(f"x {tuple(x.shape)} must end in the layer's in_features {k}")
    if x.dtype not in DTYPES:
        raise ValueError(f"x dtype {x.dtype}: need one of {DTYPES}")
    if x.device.type != "cuda" and not interpreting():
        raise ValueError(f"x on {x.device}: the kernel needs CUDA (or TRITON_INTERPRET=1 on the CPU)")
    if n < 1 or k < 1:
        raise ValueError(f"empty weight ({n} x {k})")


def _check_per_channel(qweight: Tensor, scales: Tensor, dtype: torch.dtype, name: str) -> None:
    if qweight.dim() != 2 or qweight.dtype != dtype:
        raise ValueError(f"{name} qweight must be {dtype} (N, K), got {qweight.dtype} {tuple(qweight.shape)}")
    if scales.shape != (qweight.shape[0],) or not scales.is_floating_point():
        raise ValueError(f"{name} scales must be float (N,) = ({qweight.shape[0]},), got {tuple(scales.shape)}")


def _launch(x: Tensor, q: Tensor, s: Tensor, z: Tensor, n: int, k: int, group_size: int, tiles: Tiles | None) -> Tensor:
    check_interpreter()
    x2 = x.reshape(-1, k)  # (M, K), any strides
    m = x2.shape[0]
    t = tiles or default_tiles(m, n, k, x.dtype, x.device, group_size)
    if group_size and (group_size % t.block_k or t.block_k < 32):
        raise ValueError(f"block_k {t.block_k} must divide the int4 group size {group_size} and be >= 32")
    k_per_split = triton.cdiv(triton.cdiv(k, t.split_k), t.block_k) * t.block_k  # whole K tiles per slice
    split = triton.cdiv(k, k_per_split)
    if split > 1:  # the K slices add atomically into an fp32 sum
        y = torch.zeros(m, n, device=x.device, dtype=torch.float32)
    else:
        y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    if m == 0:
        return y.to(x.dtype).view(*x.shape[:-1], n)
    grid = (triton.cdiv(m, t.block_m), triton.cdiv(n, t.block_n), split)
    s2 = s if s.dim() == 2 else s[:, None]  # (N, G) or (N, 1)
    _quant_matmul_kernel[grid](
        x2,
        q,
        s2,
        z,
        y,
        m,
        n,
        k,
        *x2.stride(),
        *q.stride(),
        *s2.stride(),
        *z.stride(),
        *y.stride(),
        k_per_split,
        GROUPED=group_size > 0,
        GROUP_SIZE=max(group_size, 1),
        ATOMIC=split > 1,
        BLOCK_M=t.block_m,
        BLOCK_N=t.block_n,
        BLOCK_K=t.block_k,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=t.num_warps,
        num_stages=t.num_stages,
    )
    return y.to(x.dtype).view(*x.shape[:-1], n)


def int8_matmul(x: Tensor, qweight: Tensor, scales: Tensor, *, tiles: Tiles | None = None) -> Tensor:
    """x (..., K) @ (qweight int8 (N, K) * scales (N,)[:, None])^T -> (..., N) in x's dtype."""
    _check_per_channel(qweight, scales, torch.int8, "int8")
    n, k = qweight.shape
    _check_x(x, k, n)
    return _launch(x, qweight, scales, scales[:, None], n, k, 0, tiles)


def fp8_matmul(x: Tensor, qweight: Tensor, scales: Tensor, *, tiles: Tiles | None = None) -> Tensor:
    """x (..., K) @ (qweight float8_e4m3fn (N, K) * scales (N,)[:, None])^T -> (..., N) in x's dtype."""
    _check_per_channel(qweight, scales, torch.float8_e4m3fn, "fp8")
    n, k = qweight.shape
    _check_x(x, k, n)
    return _launch(x, qweight, scales, scales[:, None], n, k, 0, tiles)


def int4_matmul(
    x: Tensor,
    qweight: Tensor,
    scales: Tensor,
    zeros: Tensor,
    group_size: int,
    in_features: int,
    *,
    tiles: Tiles | None = None,
) -> Tensor:
    """x (..., in_features) @ dequant(W)^T -> (..., N): qweight uint8 (N, G * group_size / 2)
    packed two codes a byte (even k low nibble), scales (N, G) and zeros uint8 (N, G),
    w = (code - zero) * scale per group. ``group_size`` a multiple of 32 (a tile's half-depth
    feeds ``tl.dot``, which needs 16)."""
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 32 or group_size % 32:
        raise ValueError(f"int4_matmul needs group_size a multiple of 32, got {group_size!r}")
    if qweight.dim() != 2 or qweight.dtype != torch.uint8:
        raise ValueError(f"int4 qweight must be uint8 (N, Kp / 2), got {qweight.dtype} {tuple(qweight.shape)}")
    n, groups = qweight.shape[0], qweight.shape[1] * 2 // group_size
    if (
        qweight.shape[1] * 2 != groups * group_size
        or not (groups - 1) * group_size < in_features <= groups * group_size
    ):
        raise ValueError(
            f"qweight {tuple(qweight.shape)} holds {qweight.shape[1] * 2} codes a row: not the whole groups of "
            f"{group_size} that {in_features} in_features need"
        )
    if scales.shape != (n, groups) or zeros.shape != (n, groups) or zeros.dtype != torch.uint8:
        raise ValueError(
            f"int4 scales and zeros (uint8) must be ({n}, {groups}), got {tuple(scales.shape)}, "
            f"{tuple(zeros.shape)} {zeros.dtype}"
        )
    _check_x(x, in_features, n)
    return _launch(x, qweight, scales, zeros, n, in_features, group_size, tiles)
