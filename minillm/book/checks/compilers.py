"""Checkers for chapter 11: launch-overhead arithmetic, model bandwidth utilization (MBU), and the
element offset of a cached key inside a paged pool."""

from __future__ import annotations

from collections.abc import Callable

import torch

from .base import passed, require

CASES_LAUNCH = [(256, 200, 5.0), (1, 1, 4.0), (1000, 450, 2.5), (64, 1, 10.0)]  # steps, kernels/step, us/launch


def check_launch_overhead(fn: Callable) -> None:
    """fn(steps, kernels_per_step, launch_us) -> seconds spent launching kernels."""
    name = "launch overhead"
    for steps, kernels, us in CASES_LAUNCH:
        want, got = steps * kernels * us * 1e-6, fn(steps, kernels, us)
        hint = f"{steps} steps x {kernels} kernels x {us} us: expected {want:.6g} s, got {got!r}"
        if isinstance(got, (int, float)) and abs(got - want * 1e6) <= 1e-9 * want * 1e6:
            hint += ": a million times too large; the launch cost is in microseconds, the answer in seconds"
        elif isinstance(got, (int, float)) and steps > 1 and abs(got - kernels * us * 1e-6) <= 1e-12:
            hint += ": that is one step; every step launches its kernels again"
        require(isinstance(got, (int, float)) and abs(got - want) <= 1e-9 * max(want, 1e-12), name, hint)
    passed(name, "steps x kernels per step x microseconds per launch, in seconds")


def check_mbu(fn: Callable) -> None:
    """fn(weight_bytes, kv_bytes, tokens_per_s, peak_bytes_per_s) -> MBU as a fraction."""
    name = "MBU"
    for w, kv, tps, peak in [
        (16e9, 1e9, 150.0, 3.35e12),
        (2.6e8, 0.0, 400.0, 2e11),
        (140e9, 20e9, 12.0, 4.8e12),
        (1e6, 5e5, 1e4, 5e10),
    ]:
        want, got = (w + kv) * tps / peak, fn(w, kv, tps, peak)
        hint = (
            f"weights {w:.3g} B, KV {kv:.3g} B, {tps} tokens/s, peak {peak:.3g} B/s: expected {want:.4g}, got {got!r}"
        )
        if isinstance(got, (int, float)) and abs(got - 100 * want) <= 1e-9 * 100 * want:
            hint += ": that is a percentage; return a fraction"
        elif isinstance(got, (int, float)) and kv and abs(got - w * tps / peak) <= 1e-9 * want:
            hint += ": every decode step reads the KV cache too, not only the weights"
        require(isinstance(got, (int, float)) and abs(got - want) <= 1e-9 * want, name, hint)
    passed(name, "(weight bytes + KV bytes) x tokens/s / peak bandwidth")


def check_pool_offset(fn: Callable) -> None:
    """fn(table, position, head, block_size, n_kv_heads, head_dim) -> flat element offset of
    K[position, head, 0] in a contiguous pool of shape (num_blocks, block_size, n_kv_heads, head_dim)."""
    name = "pool offset"
    nb, bs, hkv, hd = 7, 4, 2, 3
    pool = torch.arange(nb * bs * hkv * hd).reshape(nb, bs, hkv, hd)  # each element holds its own offset
    table = [5, 0, 3]
    for pos, head in [(0, 0), (3, 1), (4, 0), (9, 1), (11, 0)]:
        want = int(pool[table[pos // bs], pos % bs, head, 0])
        got = fn(table, pos, head, bs, hkv, hd)
        hint = f"table {table}, position {pos}, head {head}, pool {(nb, bs, hkv, hd)}: expected {want}, got {got!r}"
        if got == ((pos * hkv) + head) * hd:
            hint += ": that is the logical position; look up the physical block in the table first"
        elif got == table[pos // bs] * bs + pos % bs:
            hint += ": that is the token's slot; multiply by the elements per slot (heads x head_dim) and add the head"
        require(got == want, name, hint)
    passed(name, "((table[p // bs] x bs + p % bs) x heads + head) x head_dim")
