"""Measuring this machine's roofline (chapter 3): a large matmul's FLOP/s and a large copy's
bytes/s, and the achieved FLOP/s, bytes/s, MFU and MBU of a model's prefill and decode set
against the counted costs of ``minillm.measure.roofline``."""

from __future__ import annotations

import statistics

import torch

from ..core.generate import generate
from ..measure.report import format_table
from ..measure.roofline import Roofline, forward_cost
from ..measure.timing import repeat


def measure_matmul_flops(device="cpu", dtype=torch.float32, n: int = 1024, repeats: int = 5) -> float:
    """Achieved FLOP/s of an n x n x n matmul: this machine's practical compute roof."""
    device = torch.device(device)
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    return 2.0 * n**3 / repeat(lambda: a @ b, repeats, device).median


def measure_bandwidth(device="cpu", megabytes: int = 256, repeats: int = 5) -> float:
    """Achieved bytes/s of copying a large buffer (each byte read once and written once)."""
    device = torch.device(device)
    src = torch.empty(megabytes * 2**20, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    return 2.0 * src.numel() / repeat(lambda: dst.copy_(src), repeats, device).median


def measure_roofline(
    device="cpu", dtype=torch.float32, n: int = 1024, megabytes: int = 256, repeats: int = 5, trials: int = 3
) -> Roofline:
    """This machine's practical roofline: a large matmul's FLOP/s and a large copy's bytes/s,
    each the best of ``trials`` medians (a roof is what the machine *can* do, so a trial slowed
    by another process should not lower it)."""
    flops = max(measure_matmul_flops(device, dtype, n, repeats) for _ in range(trials))
    bandwidth = max(measure_bandwidth(device, megabytes, repeats) for _ in range(trials))
    return Roofline(flops, bandwidth)


def measure_phases(
    model, roof: Roofline, batch: int, prompt_len: int, new_tokens: int = 16, repeats: int = 3
) -> list[dict]:
    """Time prefill (TTFT) and one decode step of ``batch`` prompts of ``prompt_len`` tokens,
    medians over ``repeats`` greedy generations (of every step, for decode), and set them against the counted
    FLOPs and bytes: achieved FLOP/s and bytes/s, MFU and MBU on ``roof``."""
    if batch < 1 or prompt_len < 1 or new_tokens < 2 or repeats < 1:
        raise ValueError("batch, prompt_len and repeats must be >= 1 and new_tokens >= 2")
    prompts = [[1 + (i * 7 + j) % (model.config.vocab_size - 1) for i in range(prompt_len)] for j in range(batch)]
    generate(model, prompts, new_tokens, eos_token_id=None)  # warmup
    runs = [generate(model, prompts, new_tokens, eos_token_id=None) for _ in range(repeats)]
    bpe = model.dtype.itemsize
    step = statistics.median(t for r in runs for t in r.token_times)  # pooled: robust to a stray slow step
    phases = [
        (
            "prefill",
            statistics.median(r.ttft for r in runs),
            prompt_len,
            # generate's prefill keeps only the last token's logits: the head runs once per prompt
            forward_cost(model.config, batch, prompt_len, prompt_len, bpe, head_tokens=1),
        ),
        ("decode", step, 1, forward_cost(model.config, batch, 1, prompt_len + new_tokens // 2, bpe)),
    ]
    rows = []
    for phase, seconds, tokens, cost in phases:
        flops_s, bytes_s = cost.flops / seconds, cost.bytes / seconds
        rows.append(
            {
                "phase": phase,
                "batch": batch,
                "seconds": seconds,
                "tokens_per_s": batch * tokens / seconds,
                "intensity": cost.intensity,
                "flops_per_s": flops_s,
                "bytes_per_s": bytes_s,
                "mfu": flops_s / roof.peak_flops,
                "mbu": bytes_s / roof.peak_bandwidth,
            }
        )
    return rows


def format_phases(rows: list[dict], title: str) -> str:
    """``measure_phases`` rows as a table in readable units."""
    table = [
        {
            "phase": r["phase"],
            "batch": r["batch"],
            "ms": 1e3 * r["seconds"],
            "tokens/s": r["tokens_per_s"],
            "FLOP/byte": r["intensity"],
            "GFLOP/s": r["flops_per_s"] / 1e9,
            "GB/s": r["bytes_per_s"] / 1e9,
            "MFU %": 100 * r["mfu"],
            "MBU %": 100 * r["mbu"],
        }
        for r in rows
    ]
    return format_table(table, title=title)
