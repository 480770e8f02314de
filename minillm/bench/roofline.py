"""Measuring this machine's roofline (chapter 3): a large matmul's FLOP/s and a large copy's
bytes/s, and the achieved FLOP/s, bytes/s, MFU and MBU of a model's prefill and decode set
against the counted costs of ``minillm.measure.roofline``."""

from __future__ import annotations

import statistics

import torch

from ..core.generate import generate
from ..measure.report import format_table
from ..measure.roofline import DATASHEETS, Roofline, datasheet_rows, forward_cost
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


class Sig3(float):
    """A number that a table (``format_table``) shows to three significant digits, and whole
    from 100 up: 0.320, 4.80, 16.1, 203, 1,117. Still a float for every other use."""

    def __format__(self, spec: str) -> str:
        value = float(self)
        if value != value:
            text = "-"
        elif value == 0:
            text = "0"
        else:
            text = f"{value:,.0f}" if abs(value) >= 100 else f"{value:#.3g}"
        try:  # a width and an alignment (f"{x:>7}") apply to the text
            return format(text, spec)
        except ValueError:  # a number's own spec (a table's ",.2f"): the three digits win
            return text

    def __str__(self) -> str:
        return format(self, "")


def sig3(value: float | None) -> Sig3:
    """``value`` as a ``Sig3``; None (no such figure) becomes NaN, which a table prints as a
    dash and still aligns with the numbers of its column."""
    return Sig3("nan" if value is None else value)


def format_phases(rows: list[dict], title: str) -> str:
    """``measure_phases`` rows as a table in readable units, three significant digits."""
    table = [
        {
            "phase": r["phase"],
            "batch": r["batch"],
            "ms": sig3(1e3 * r["seconds"]),
            "tokens/s": sig3(r["tokens_per_s"]),
            "FLOP/byte": sig3(r["intensity"]),
            "GFLOP/s": sig3(r["flops_per_s"] / 1e9),
            "GB/s": sig3(r["bytes_per_s"] / 1e9),
            "MFU %": sig3(100 * r["mfu"]),
            "MBU %": sig3(100 * r["mbu"]),
        }
        for r in rows
    ]
    return format_table(table, title=title)


def format_datasheets(title: str, accelerators=DATASHEETS) -> str:
    """The datasheet figures of chapter 3 (``datasheet_rows``) under headers in words, three
    significant digits for the ridge and bandwidth (memory and FLOP/s as the datasheets give
    them)."""
    table = [
        {
            "accelerator": r["accelerator"],
            "memory (GB)": r["memory_gb"],
            "bandwidth (TB/s)": sig3(r["bandwidth_tb_s"]),
            "TFLOP/s (16-bit)": r["tflops_16bit"],
            "ridge (FLOP/byte)": sig3(r["ridge"]),
        }
        for r in datasheet_rows(accelerators)
    ]
    return format_table(table, title=title)


def format_chooser(rows: list[dict], title: str) -> str:
    """``accelerator_chooser`` rows under short headers in words, three significant digits; a
    figure that does not exist (the weights do not fit, no price) is a dash."""
    table = [
        {
            "accelerator": r["accelerator"],
            "weights (GB)": sig3(r["weights_gb"]),
            "fits": r["fits"],
            "tokens/s (ceiling)": sig3(r["tokens_per_s"]),
            "$/hour (assumed)": r["dollars_per_hour"],
            "$/1M tokens": sig3(r["dollars_per_1m_tokens"]),
        }
        for r in rows
    ]
    return format_table(table, title=title)
