"""Choosing the Triton attention kernel when it can run, and PyTorch's SDPA when it cannot.

``minillm.core.model`` imports this lazily for its ``"triton"`` attention backend, so a machine without
Triton never imports it. ``attention_triton`` has the signature of ``minillm.core.model.attention_sdpa``;
when the fused kernel (``kernels.flash_attention``, FlashAttention-2 style, Dao 2023) does not
support the call it falls back to SDPA and warns once per reason, naming it.
"""

from __future__ import annotations

import importlib.util
import os
import warnings

import torch
from torch import Tensor

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
    from .model import attention_sdpa

    reason = unsupported_reason(q, k, mask)
    if reason is not None:
        warn_once(reason)
        return attention_sdpa(q, k, v, mask, causal)
    from kernels.flash_attention import flash_attention

    return flash_attention(q, k, v, causal)
