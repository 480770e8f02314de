"""Checkers for chapter 10: the online-softmax update, an RMSNorm kernel in Triton, and how many
tiles causal attention computes when it skips the blocks above the diagonal."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...core.config import ceil_div
from ...core.model import rms_norm_reference
from .base import close, passed, require


def check_online_softmax_update(fn: Callable) -> None:
    """fn(m, l, acc, s, v) -> (m, l, acc): fold one tile of scores s (T, n) and values v (n, hd) into
    the running max m (T, 1), denominator l (T, 1) and unnormalized output acc (T, hd)."""
    name = "online softmax update"
    g = torch.Generator().manual_seed(0)
    T, S, hd, block = 5, 24, 4, 8
    scores = torch.randn(T, S, generator=g, dtype=torch.float64) * 3
    scores[:, 9] += 6  # a large score in the second tile: the maximum must move, the old sums rescale
    v = torch.randn(S, hd, generator=g, dtype=torch.float64)
    m = torch.full((T, 1), float("-inf"), dtype=torch.float64)
    l, acc = torch.zeros(T, 1, dtype=torch.float64), torch.zeros(T, hd, dtype=torch.float64)  # noqa: E741
    for start in range(0, S, block):
        out = fn(m, l, acc, scores[:, start : start + block], v[start : start + block])
        require(isinstance(out, tuple) and len(out) == 3, name, f"return (m, l, acc), got {type(out).__name__}")
        m, l, acc = out  # noqa: E741
        seen = scores[:, : start + block]
        require(
            close(m, seen.amax(-1, keepdim=True)),
            name,
            f"after the keys 0..{start + block - 1}, m must be the max of the scores seen so far",
        )
        want_l = torch.exp(seen - seen.amax(-1, keepdim=True)).sum(-1, keepdim=True)
        if not close(l, want_l):
            hint = f"after the keys 0..{start + block - 1}, l must be sum(exp(s - m)) over the scores seen so far"
            if start > 0:
                hint += ": rescale the old l by exp(m_old - m_new) before adding the new tile's sum"
            require(False, name, hint)
    want = torch.softmax(scores, -1) @ v
    got = acc / l
    require(
        close(got, want, atol=1e-8),
        name,
        "acc / l differs from softmax(s) @ v: rescale the old acc by exp(m_old - m_new) too, "
        "then add exp(s - m_new) @ v",
    )
    passed(name, f"{S // block} tiles of {block} keys folded one at a time give softmax(s) @ v exactly")


def check_triton_rms_norm(fn: Callable) -> None:
    """fn(x (rows, D) fp32, weight (D,), eps) -> RMSNorm of each row, through a Triton kernel."""
    name = "Triton RMSNorm"
    g = torch.Generator().manual_seed(0)
    for rows, D in [(4, 64), (3, 100)]:
        x = torch.randn(rows, D, generator=g) * 2 + 0.5
        w = torch.rand(D, generator=g) + 0.5
        got = fn(x, w, 1e-5)
        want = rms_norm_reference(x, w, 1e-5)
        shape = tuple(got.shape) if hasattr(got, "shape") else got
        require(
            hasattr(got, "shape") and shape == tuple(x.shape), name, f"expected shape {tuple(x.shape)}, got {shape}"
        )
        if close(got, want, atol=1e-4):
            continue
        hint = f"rows {rows}, D {D}: the output differs from rms_norm_reference"
        if D & (D - 1):
            hint += " (D is not a power of two: load with mask=cols < D, other=0.0, and divide by D, not BLOCK)"
        elif close(got, x / x.pow(2).mean(-1, keepdim=True).add(1e-5).sqrt(), atol=1e-4):
            hint += ": multiply by the weight"
        elif close(got, x * w / x.pow(2).sum(-1, keepdim=True).add(1e-5).sqrt(), atol=1e-4):
            hint += ": the mean of the squares, not their sum (divide by D)"
        require(False, name, hint)
    passed(name, "one program per row: load, mean of squares, scale, store; masked for D = 100")


def causal_tile_pairs(T: int, block: int) -> int:
    """(query tile, key tile) pairs causal attention computes on T tokens when it skips the tiles
    above the diagonal: the n (n + 1) / 2 of n = ceil(T / block) query tiles' lower triangle."""
    n = ceil_div(T, block)
    return n * (n + 1) // 2


def check_causal_tiles(fn: Callable) -> None:
    """fn(T, block) -> the number of (query tile, key tile) pairs computed with causal block skipping."""
    name = "causal block skipping"
    for T, block in [(64, 16), (4096, 128), (1000, 64), (16, 16), (100, 128)]:
        want, got = causal_tile_pairs(T, block), fn(T, block)
        n = ceil_div(T, block)
        hint = f"T={T}, block={block}: expected {want} tile pairs, got {got!r}"
        if got == n * n:
            hint += ": that is every tile; the tiles whose keys all lie after the tile's last query are skipped"
        elif T % block and got == (T // block) * (T // block + 1) // 2:
            hint += ": round the number of tiles up, the last ragged tile counts"
        elif got == n * (n - 1) // 2:
            hint += ": the diagonal tiles (partly visible, masked) are computed too"
        require(got == want, name, hint)
    passed(name, "n (n + 1) / 2 of the n^2 tiles: about half the work at long sequences")
