"""Checkers for chapter 15: one linear pair split column- then row-wise (the partial sums an
all-reduce adds), the time of tensor parallelism's all-reduces over a link, the pipeline bubble,
and the merge of two partial attentions by their log-sum-exps (one ring-attention step)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from .base import close, passed, require

SHARD_CASES = [(2, 8, 16, 8, 2), (3, 12, 24, 12, 4), (1, 6, 6, 10, 3), (5, 4, 8, 4, 1)]  # tokens, d, f, out, n


def reference_partials(x, w_in, w_out, n: int) -> list[torch.Tensor]:
    f = w_in.shape[0] // n
    return [(x @ w_in[r * f : (r + 1) * f].T) @ w_out[:, r * f : (r + 1) * f].T for r in range(n)]


def check_shard_pair(fn: Callable) -> None:
    """fn(x, w_in, w_out, n) -> list of n partial outputs: rank r's rows of w_in, then its columns
    of w_out; their sum is x @ w_in.T @ w_out.T."""
    name = "column- then row-parallel"
    gen = torch.Generator().manual_seed(15)
    for tokens, d, f, out, n in SHARD_CASES:
        x = torch.randn(tokens, d, generator=gen, dtype=torch.float64)
        w_in = torch.randn(f, d, generator=gen, dtype=torch.float64)
        w_out = torch.randn(out, f, generator=gen, dtype=torch.float64)
        got = fn(x, w_in, w_out, n)
        require(
            isinstance(got, (list, tuple)) and len(got) == n,
            name,
            f"return a list of {n} partial outputs (one per rank), got {type(got).__name__}"
            + (f" of {len(got)}" if isinstance(got, (list, tuple)) else ""),
        )
        full = x @ w_in.T @ w_out.T
        require(
            close(sum(got), full),
            name,
            f"the {n} partials do not add up to x @ w_in.T @ w_out.T (tokens {tokens}, d {d}, f {f}, out {out})",
        )
        for r, (mine, want) in enumerate(zip(got, reference_partials(x, w_in, w_out, n))):
            require(
                close(mine, want),
                name,
                f"rank {r}'s partial is not its own share: it should use rows [{r}f/n, {r + 1}f/n) of w_in "
                "(its hidden units) and the same columns of w_out",
            )
    passed(name, "each rank's hidden units alone give a partial sum; one all-reduce adds them into the output")


# (layers, dim, dtype bytes, ranks, link GB/s, latency us)
COMM_CASES = [
    (32, 4096, 2, 2, 300.0, 8.0),
    (32, 4096, 2, 8, 300.0, 8.0),
    (80, 8192, 2, 4, 31.5, 10.0),
    (6, 256, 4, 2, 1.0, 50.0),
]


def reference_comm_ms(layers, dim, dtype_bytes, ranks, gb_s, latency_us) -> float:
    payload = dim * dtype_bytes
    per = latency_us * 1e-6 + 2 * (ranks - 1) / ranks * payload / (gb_s * 1e9)
    return 1e3 * 2 * layers * per


def check_tp_comm(fn: Callable) -> None:
    """fn(n_layers, dim, dtype_bytes, ranks, link_gb_s, latency_us) -> ms of all-reduces per token."""
    name = "TP all-reduce time per token"
    for case in COMM_CASES:
        want, got = reference_comm_ms(*case), fn(*case)
        layers, dim, db, p, gb, lat = case
        require(
            isinstance(got, (int, float)) and math.isclose(got, want, rel_tol=1e-6),
            name,
            f"{layers} layers, d_model {dim}, {db} bytes, {p} ranks, {gb} GB/s, {lat} us: got {got!r} ms, "
            f"expected {want:.6g} ms. Two all-reduces per layer, each latency + 2(p-1)/p x payload / bandwidth",
        )
    passed(name, "2 x layers x (latency + 2(p-1)/p x d_model x bytes / bandwidth)")


def check_bubble(bubble: Callable, micro_batches_for: Callable) -> None:
    """bubble(p, m) -> the idle share of GPipe; micro_batches_for(p, target) -> the fewest m with
    bubble <= target."""
    name = "pipeline bubble"
    for p, m in [(1, 1), (2, 1), (4, 1), (4, 4), (8, 32), (3, 7)]:
        want = (p - 1) / (m + p - 1)
        got = bubble(p, m)
        require(
            isinstance(got, (int, float)) and math.isclose(got, want, abs_tol=1e-12),
            name,
            f"{p} stages, {m} micro-batches: got {got!r}, expected {want:.4f} (idle slots over all slots)",
        )
    for p, target in [(4, 0.5), (4, 0.1), (8, 0.2), (2, 0.01), (1, 0.0), (16, 0.25)]:
        want = next(m for m in range(1, 10_000) if (p - 1) / (m + p - 1) <= target + 1e-12)
        got = micro_batches_for(p, target)
        require(
            got == want,
            name,
            f"{p} stages, bubble at most {target}: got {got!r} micro-batches, expected {want} (the fewest)",
        )
    passed(name, "(p - 1) / (m + p - 1), and m >= (p - 1)(1 - b) / b micro-batches keep it under b")


def _attend(q, k, v):
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)


def check_merge(fn: Callable) -> None:
    """fn(out_a, lse_a, out_b, lse_b) -> (out, lse) equal to attention over both blocks of keys."""
    name = "ring-attention merge"
    gen = torch.Generator().manual_seed(15)
    for heads, tq, ta, tb, hd in [(2, 3, 4, 5, 8), (1, 1, 1, 7, 4), (4, 6, 6, 6, 16)]:
        q = torch.randn(heads, tq, hd, generator=gen, dtype=torch.float64)
        k = torch.randn(heads, ta + tb, hd, generator=gen, dtype=torch.float64)
        v = torch.randn(heads, ta + tb, hd, generator=gen, dtype=torch.float64)
        out_a, lse_a = _attend(q, k[:, :ta], v[:, :ta])
        out_b, lse_b = _attend(q, k[:, ta:], v[:, ta:])
        want_out, want_lse = _attend(q, k, v)
        got = fn(out_a, lse_a, out_b, lse_b)
        require(isinstance(got, tuple) and len(got) == 2, name, "return (out, lse)")
        require(close(got[1], want_lse), name, "lse should be log(exp(lse_a) + exp(lse_b)), per query")
        require(
            close(got[0], want_out),
            name,
            "out should weight each block's output by its share of the softmax: exp(lse_a - lse) and exp(lse_b - lse)",
        )
    # a block no query can see (all keys in the future): lse -inf, out 0, must change nothing
    out_b, lse_b = torch.zeros_like(out_a), torch.full_like(lse_a, -math.inf)
    got = fn(out_a, lse_a, out_b, lse_b)
    require(
        close(got[0], out_a) and close(got[1], lse_a) and not torch.isnan(got[0]).any(),
        name,
        "merging with an empty block (lse = -inf, out = 0) must return the other block unchanged, with no NaN "
        "(logaddexp handles -inf; so does subtracting the finite maximum)",
    )
    passed(name, "two blocks' outputs weighted by exp(lse_block - lse) give attention over both, exactly")
