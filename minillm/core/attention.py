"""Attention, four ways, side by side: the diff between them is the lesson of chapter 10.

- ``attention_reference``: the (T, S) score matrix in full, softmax in fp32: the definition;
- ``attention_sdpa``: PyTorch's fused kernels (flash / memory-efficient / math), GQA without copies;
- ``attention_tiled``: FlashAttention's algorithm (Dao et al., 2022; Dao, 2023) in plain PyTorch,
  one key tile at a time with an online softmax (Milakov & Gimelshein, 2018);
- ``attention_triton``: the fused Triton kernel (``kernels.flash_attention``) where it can run, and
  SDPA, with one warning per reason, where it cannot (no Triton, no CUDA, an explicit mask...).

All take q (B, H, T, hd) and k, v (B, Hkv, S, hd) with H a multiple of Hkv (grouped-query
attention) and return (B, H, T, hd). ``attention_mask`` turns query and key positions into the
boolean mask every path shares. Triton is imported only when the triton backend is first used,
so a machine without it never imports it.
"""

from __future__ import annotations

import importlib.util
import math
import os
import warnings

import torch
import torch.nn.functional as F
from torch import Tensor

ATTENTION_BACKENDS = ("sdpa", "reference", "triton")  # triton: the fused kernel, SDPA where unsupported


def attention_mask(q_pos: Tensor, k_pos: Tensor, window: int | None = None) -> Tensor:
    """Which keys each query may see: (B, T) and (B, S) positions -> bool (B, 1, T, S).

    A key is visible when it is not padding (position >= 0), not in the future, and, with a
    sliding window, fewer than ``window`` positions back. A query with no visible key (a
    padding query) is allowed to see everything, so its softmax stays finite; it is never used.
    """
    qp, kp = q_pos[:, :, None], k_pos[:, None, :]
    mask = (kp >= 0) & (kp <= qp)
    if window is not None:
        mask &= qp - kp < window
    mask |= ~mask.any(dim=-1, keepdim=True)
    return mask[:, None]


def attention_probs(q: Tensor, k: Tensor, mask: Tensor | None, causal: bool = False) -> Tensor:
    """softmax(q k^T / sqrt(hd)) in fp32: (B, H, T, S), K heads repeated for GQA."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)  # (B, H, S, hd)
    scores = (q @ k.transpose(-2, -1)).float() / math.sqrt(q.shape[-1])  # (B, H, T, S)
    if causal:
        T, S = scores.shape[-2:]
        mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(dim=-1)


def attention_reference(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool = False) -> Tensor:
    """Plain scaled dot-product attention, the N x N score matrix in full.

    q (B, H, T, hd); k, v (B, Hkv, S, hd) with H a multiple of Hkv (GQA); mask bool (B, 1, T, S).
    """
    v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)  # (B, H, S, hd)
    return (attention_probs(q, k, mask, causal).to(q.dtype) @ v).to(q.dtype)


def attention_sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool = False) -> Tensor:
    """The same computation through PyTorch's fused kernels (flash / memory-efficient / math).

    With GQA and an explicit (or no) mask, the n_rep query heads that share a K/V head are
    folded into that head's rows: (B, H, T, hd) -> (B, Hkv, n_rep * T, hd). Each K/V head is
    then read once for its whole group and never copied, which is what makes GQA's smaller
    cache faster to decode from, not only smaller.
    """
    batch, n_heads, T, hd = q.shape
    n_kv = k.shape[1]
    if n_kv == n_heads or causal:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=n_kv != n_heads)
    n_rep = n_heads // n_kv
    grouped_mask = mask.repeat(1, 1, n_rep, 1) if mask is not None else None  # (B, 1, n_rep * T, S)
    y = F.scaled_dot_product_attention(q.reshape(batch, n_kv, n_rep * T, hd), k, v, attn_mask=grouped_mask)
    return y.view(batch, n_heads, T, hd)


def attention_function(backend: str):
    """The attention function of a backend name; "triton" imports the kernels only when asked for."""
    if backend == "triton":  # falls back to SDPA, with a warning, where unsupported
        return attention_triton
    return attention_sdpa if backend == "sdpa" else attention_reference


def attention_tiled(q: Tensor, k: Tensor, v: Tensor, causal: bool = False, block: int = 64) -> Tensor:
    """Attention computed one key tile at a time with an online softmax, in plain PyTorch.

    q (B, H, T, hd); k, v (B, Hkv, S, hd) -> (B, H, T, hd). Never holds more than (T, block) scores.
    """
    B, H, T, hd = q.shape
    S, n_rep = k.shape[2], H // k.shape[1]
    qf = q.float() / math.sqrt(hd)  # (B, H, T, hd)
    m = torch.full((B, H, T, 1), float("-inf"), device=q.device)  # running max of each row's scores
    l = torch.zeros(B, H, T, 1, device=q.device)  # running sum of exp(score - m)  # noqa: E741
    acc = torch.zeros(B, H, T, hd, device=q.device)  # running sum of exp(score - m) * v
    q_pos = torch.arange(T, device=q.device)[:, None] + (S - T)  # (T, 1): query i sits at S - T + i
    for start in range(0, S, block):
        kt = k[:, :, start : start + block].float().repeat_interleave(n_rep, dim=1)  # (B, H, n, hd)
        vt = v[:, :, start : start + block].float().repeat_interleave(n_rep, dim=1)  # (B, H, n, hd)
        s = qf @ kt.transpose(-2, -1)  # (B, H, T, n)
        if causal:
            k_pos = torch.arange(start, start + kt.shape[2], device=q.device)[None, :]  # (1, n)
            s = s.masked_fill(k_pos > q_pos, float("-inf"))
        m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))  # (B, H, T, 1)
        m_safe = m_new.masked_fill(m_new == float("-inf"), 0.0)  # a row with nothing visible yet
        p = torch.exp(s - m_safe)  # (B, H, T, n)
        alpha = torch.exp(m - m_safe)  # rescales what was summed under the old maximum
        l = l * alpha + p.sum(dim=-1, keepdim=True)  # noqa: E741
        acc = acc * alpha + p @ vt
        m = m_new
    return (acc / l).to(q.dtype)


# Choosing the Triton kernel when it can run, SDPA when it cannot

_warned: set[str] = set()


def triton_available() -> bool:
    """True when the triton package is installed (importing it is left to the kernels)."""
    return importlib.util.find_spec("triton") is not None


def unsupported_reason(q: Tensor, k: Tensor, mask: Tensor | None) -> str | None:
    """Why the fused kernel cannot serve this call, or None when it can."""
    if not triton_available():
        return "triton is not installed"
    on_cpu_interpreter = q.device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    if q.device.type != "cuda" and not on_cpu_interpreter:
        return f"device {q.device.type} (the kernel needs CUDA, or TRITON_INTERPRET=1 on the CPU)"
    if mask is not None:
        return "an explicit attention mask (the kernel does causal or no mask)"
    if q.shape[-1] not in (16, 32, 64, 128):
        return f"head dim {q.shape[-1]} (the kernel supports 16, 32, 64, 128)"
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"dtype {q.dtype}"
    if q.dtype == torch.bfloat16 and on_cpu_interpreter:
        return "bf16 in the Triton CPU interpreter (its bf16 tl.dot is wrong)"
    if q.dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported(including_emulation=False):
        return "bf16 on a GPU without native bf16"
    if q.shape[2] > k.shape[2]:
        return "more queries than keys"
    return None


def warn_once(reason: str) -> None:
    """One warning per distinct reason, so a generation loop does not print it at every token."""
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"triton attention falls back to sdpa: {reason}", stacklevel=3)


def attention_triton(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool = False) -> Tensor:
    """q (B, H, T, hd), k, v (B, Hkv, S, hd) -> (B, H, T, hd) through the fused kernel, or SDPA."""
    reason = unsupported_reason(q, k, mask)
    if reason is not None:
        warn_once(reason)
        return attention_sdpa(q, k, v, mask, causal)
    from minillm.kernels.flash_attention import flash_attention

    return flash_attention(q, k, v, causal)
