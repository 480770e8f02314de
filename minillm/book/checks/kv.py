"""Checkers for chapters 4 and 5: the KV formula, a cache write, users per accelerator, GQA head
expansion, ring-buffer slots, int8 quantization with per-token scales."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...core.config import preset
from ...kv.compressed import dequantize_int8, quantize_int8
from ...kv.memory import kv_cache_bytes, users_that_fit, weight_bytes
from .base import close, passed, require


def check_kv_cache_bytes(fn: Callable) -> None:
    """fn(n_layers, n_kv_heads, head_dim, seq_len, batch, bytes_per_element) -> bytes."""
    name = "KV cache bytes"
    for shape, seq_len, batch, bpe in [
        ("Llama-2-13B", 2048, 32, 2),
        ("Llama-2-70B", 4096, 1, 2),
        ("Llama-3-8B", 8192, 4, 1),
        ("SmolLM2-135M", 100, 3, 4),
    ]:
        c = preset(shape)
        want = kv_cache_bytes(c, seq_len, batch, {1: "int8", 2: "fp16", 4: "fp32"}[bpe])
        got = fn(c.n_layers, c.n_kv_heads, c.head_dim, seq_len, batch, bpe)
        where = (
            f"{shape} ({c.n_layers} layers, {c.n_kv_heads} KV heads of {c.head_dim}), {seq_len} tokens, batch {batch}"
        )
        hint = f"{where}: expected {want:.6g} bytes, got {got!r}"
        if isinstance(got, (int, float)) and got and abs(got * 2 - want) < 1e-6 * want:
            hint += ": exactly half; did you count K and V?"
        elif isinstance(got, (int, float)) and got and abs(got - want * c.n_heads / c.n_kv_heads) < 1e-6 * got:
            hint += ": too large by n_heads / n_kv_heads; only the K/V heads are cached"
        require(isinstance(got, (int, float)) and abs(got - want) <= 1e-9 * want, name, hint)
    passed(name, "2 x layers x KV heads x head_dim x bytes x tokens x batch, on four real shapes")


def check_kv_update(fn: Callable) -> None:
    """fn(k_cache, v_cache, k_new, v_new, pos) writes one step in place and returns the filled (k, v)."""
    name = "KV cache update"
    g = torch.Generator().manual_seed(0)
    B, H, S, hd = 2, 3, 10, 4
    k_cache, v_cache = torch.zeros(B, H, S, hd), torch.zeros(B, H, S, hd)
    k_hist, v_hist = torch.randn(B, H, S, hd, generator=g), torch.randn(B, H, S, hd, generator=g)
    for pos in range(6):
        out = fn(k_cache, v_cache, k_hist[:, :, pos : pos + 1], v_hist[:, :, pos : pos + 1], pos)
        require(isinstance(out, tuple) and len(out) == 2, name, f"return (k, v), got {type(out).__name__}")
        k, v = out
        stored = close(k_cache[:, :, : pos + 1], k_hist[:, :, : pos + 1])
        stored &= close(v_cache[:, :, : pos + 1], v_hist[:, :, : pos + 1])
        hint = f"after writing position {pos}, the cache's slots 0..{pos} must hold the keys and values written"
        require(stored, name, hint + " so far: write in place into slot pos (k_cache[:, :, pos] = ...)")
        got = tuple(k.shape) if hasattr(k, "shape") else repr(k)
        filled = close(k, k_hist[:, :, : pos + 1]) and close(v, v_hist[:, :, : pos + 1])
        require(filled, name, f"at position {pos} return the filled part, shape {(B, H, pos + 1, hd)}: got {got}")
    require(not k_cache[:, :, 6:].any(), name, "slots after the last position must stay untouched")
    passed(name, "each step writes one slot in place and attention reads slots 0..pos")


def check_users_that_fit(fn: Callable) -> None:
    """fn(config, context, memory_bytes, bytes_per_element) -> how many users fit beside the weights."""
    name = "users per accelerator"
    for shape, context, memory in [
        ("Llama-3-8B", 8192, 80e9),
        ("Llama-3-8B", 131072, 80e9),
        ("Llama-2-13B", 4096, 80e9),
        ("Llama-2-70B", 8192, 141e9),
        ("Llama-2-70B", 4096, 80e9),
    ]:
        c = preset(shape)
        want, got = users_that_fit(c, context, memory, "fp16"), fn(c, context, memory, 2)
        hint = f"{shape}, {context} tokens each, {memory / 1e9:.0f} GB, fp16: expected {want}, got {got!r}"
        if weight_bytes(c, "fp16") > memory:
            hint += " (the weights alone do not fit: no user does)"
        require(got == want, name, hint + ": whole users only, in what the weights leave free")
    passed(name, "the memory left after the weights, divided by one user's KV cache, rounded down")


def check_repeat_kv(fn: Callable) -> None:
    """fn(k (B, Hkv, S, hd), n_rep) -> (B, Hkv * n_rep, S, hd), query head h reading K/V head h // n_rep."""
    name = "GQA: expand K/V heads"
    k = torch.randn(2, 3, 5, 4, generator=torch.Generator().manual_seed(1))
    for n_rep in (1, 2, 4):
        got = fn(k, n_rep)
        want = k.repeat_interleave(n_rep, dim=1)
        shape = tuple(got.shape) if hasattr(got, "shape") else got
        same_shape = hasattr(got, "shape") and tuple(got.shape) == tuple(want.shape)
        require(same_shape, name, f"n_rep={n_rep}: expected shape {tuple(want.shape)}, got {shape}")
        hint = f"n_rep={n_rep}: query head h must read K/V head h // n_rep"
        if n_rep > 1 and close(got, k.repeat(1, n_rep, 1, 1)):
            hint += "; you tiled the heads (0,1,2,0,1,2) instead of repeating each (0,0,1,1,2,2)"
        require(close(got, want), name, hint)
    passed(name, "each K/V head repeated n_rep times in place, as repeat_interleave does")


def check_ring_slots(fn: Callable) -> None:
    """fn(n_written, n_new, capacity) -> the slot of each new token, a list of n_new ints."""
    name = "ring-buffer slots"
    for n_written, n_new, capacity in [(0, 3, 8), (7, 1, 8), (8, 1, 8), (13, 4, 8), (100, 5, 5), (6, 1, 4096)]:
        want = [(n_written + i) % capacity for i in range(n_new)]
        got = fn(n_written, n_new, capacity)
        got = got.tolist() if hasattr(got, "tolist") else list(got) if got is not None else None
        where = f"{n_written} tokens written, {n_new} new, {capacity} slots"
        require(got == want, name, f"{where}: expected {want}, got {got}: token number n lives in slot n mod capacity")
    passed(name, "token n in slot n mod capacity: the oldest token is overwritten first")


def check_quantize_int8(quantize: Callable, dequantize: Callable) -> None:
    """quantize(x) -> (q int8, scale (..., 1)); dequantize(q, scale) -> x approximately."""
    name = "int8 KV quantization"
    x = torch.randn(2, 4, 9, 16, generator=torch.Generator().manual_seed(2)) * torch.logspace(-2, 2, 9)[:, None]
    q, scale = quantize(x)
    require(q.dtype == torch.int8, name, f"q must be torch.int8 (1 byte per element), got {q.dtype}")
    hint = f"one scale per token and head: shape (2, 4, 9, 1), got {tuple(scale.shape)}"
    require(tuple(scale.shape) == (2, 4, 9, 1), name, hint)
    back = dequantize(q, scale).float()
    hint = "round-trip error must stay within half a step (scale / 2) everywhere: scale = max |x| / 127 "
    require(
        ((back - x).abs() <= scale / 2 + 1e-6).all(),
        name,
        hint + "over the head_dim of each token, q = round(x / scale)",
    )
    hint = "each token's largest |value| should map to +-127: use the whole int8 range"
    require(bool((q.abs().amax(-1) == 127).all()), name, hint)
    ref_q, ref_scale = quantize_int8(x)
    same = close(dequantize(ref_q, ref_scale), dequantize_int8(ref_q, ref_scale, torch.float32))
    require(same, name, "dequantize should return q x scale")
    passed(name, "int8 with a scale per token and head: within half a step of the original, full range used")
