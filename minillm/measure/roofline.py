"""The roofline model (Williams, Waterman & Patterson, 2009), measured on this machine.

An operation that does F FLOPs while moving B bytes has arithmetic intensity I = F / B. On a
device with peak compute P (FLOP/s) and memory bandwidth W (bytes/s) it can run at most at
min(P, W x I): below the ridge point I* = P / W it is bandwidth-bound, above it compute-bound.
Decode multiplies a whole weight matrix by one token's vector (I ~ 1 FLOP/byte in fp16), so it
sits far left of the ridge; prefill and large batches move right.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from ..core.config import ModelConfig
from ..core.device import synchronize


@dataclass(frozen=True)
class Accelerator:
    """Datasheet figures (dense, no sparsity); see book/references.bib for the sources."""

    name: str
    memory_gb: float
    bandwidth_tb_s: float  # memory bandwidth, TB/s
    tflops_16bit: float  # dense bf16 (fp16 on the T4, which has no bf16) tensor-core TFLOP/s

    @property
    def ridge(self) -> float:
        """FLOPs per byte above which a kernel is compute-bound."""
        return self.tflops_16bit * 1e12 / (self.bandwidth_tb_s * 1e12)


DATASHEETS = [
    Accelerator("T4", 16, 0.320, 65),
    Accelerator("L4", 24, 0.300, 121),
    Accelerator("A100-80GB-SXM", 80, 2.039, 312),
    Accelerator("H100-SXM", 80, 3.35, 989),
    Accelerator("H200-SXM", 141, 4.8, 989),
]


@dataclass(frozen=True)
class Roofline:
    peak_flops: float  # FLOP/s
    peak_bandwidth: float  # bytes/s

    @property
    def ridge(self) -> float:
        return self.peak_flops / self.peak_bandwidth

    def attainable(self, intensity: float) -> float:
        """The roof: the most FLOP/s an operation of this intensity can reach."""
        return min(self.peak_flops, self.peak_bandwidth * intensity)

    def bound(self, intensity: float) -> str:
        return "compute" if intensity >= self.ridge else "memory"


@dataclass(frozen=True)
class OpCost:
    name: str
    flops: float
    bytes: float

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes


def matmul_cost(name: str, m: int, k: int, n: int, bytes_per_element: float) -> OpCost:
    """(m x k) @ (k x n): 2mkn FLOPs; read both inputs and write the output once."""
    return OpCost(name, 2.0 * m * k * n, bytes_per_element * (m * k + k * n + m * n))


def layer_costs(config: ModelConfig, batch: int, new_tokens: int, context: int,
                bytes_per_element: float = 2) -> list[OpCost]:  # fmt: skip
    """FLOPs and bytes of one transformer layer's matmuls for ``new_tokens`` per sequence attending
    to ``context`` keys: prefill is new_tokens = context = prompt length; decode is new_tokens = 1."""
    c, m = config, batch * new_tokens
    d, hd, kv = c.dim, c.head_dim, c.n_kv_heads * c.head_dim
    attn_flops = 2.0 * 2 * batch * c.n_heads * new_tokens * context * hd  # QK^T and PV
    attn_bytes = bytes_per_element * batch * (2 * c.n_heads * new_tokens * hd + 2 * context * kv)
    return [
        matmul_cost("qkv_proj", m, d, c.n_heads * hd + 2 * kv, bytes_per_element),
        OpCost("attention", attn_flops, attn_bytes),
        matmul_cost("o_proj", m, c.n_heads * hd, d, bytes_per_element),
        matmul_cost("mlp_up_gate", m, d, 2 * c.ffn_dim, bytes_per_element),
        matmul_cost("mlp_down", m, c.ffn_dim, d, bytes_per_element),
    ]


def forward_cost(config: ModelConfig, batch: int, new_tokens: int, context: int,
                 bytes_per_element: float = 2) -> OpCost:  # fmt: skip
    """Total FLOPs and bytes of one forward pass (all layers and the LM head)."""
    ops = layer_costs(config, batch, new_tokens, context, bytes_per_element) * config.n_layers
    ops.append(matmul_cost("lm_head", batch * new_tokens, config.dim, config.vocab_size, bytes_per_element))
    return OpCost("forward", sum(o.flops for o in ops), sum(o.bytes for o in ops))


def _median_seconds(fn, device: torch.device, repeats: int) -> float:
    fn()  # warmup
    times = []
    for _ in range(repeats):
        synchronize(device)
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_matmul_flops(device="cpu", dtype=torch.float32, n: int = 1024, repeats: int = 5) -> float:
    """Achieved FLOP/s of an n x n x n matmul: this machine's practical compute roof."""
    device = torch.device(device)
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    return 2.0 * n**3 / _median_seconds(lambda: a @ b, device, repeats)


def measure_bandwidth(device="cpu", megabytes: int = 256, repeats: int = 5) -> float:
    """Achieved bytes/s of copying a large buffer (each byte read once and written once)."""
    device = torch.device(device)
    src = torch.empty(megabytes * 2**20, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    return 2.0 * src.numel() / _median_seconds(lambda: dst.copy_(src), device, repeats)


def measure_roofline(device="cpu", dtype=torch.float32, n: int = 1024, megabytes: int = 256,
                     repeats: int = 5, trials: int = 3) -> Roofline:  # fmt: skip
    """This machine's practical roofline: a large matmul's FLOP/s and a large copy's bytes/s,
    each the best of ``trials`` medians (a roof is what the machine *can* do, so a trial slowed
    by another process should not lower it)."""
    flops = max(measure_matmul_flops(device, dtype, n, repeats) for _ in range(trials))
    bandwidth = max(measure_bandwidth(device, megabytes, repeats) for _ in range(trials))
    return Roofline(flops, bandwidth)


# ---------------------------------------------------------------------------------------------
# Measured utilization of a model's prefill and decode (MFU, MBU)


def measure_phases(model, roof: Roofline, batch: int, prompt_len: int, new_tokens: int = 16,
                   repeats: int = 3) -> list[dict]:  # fmt: skip
    """Time prefill (TTFT) and one decode step of ``batch`` prompts of ``prompt_len`` tokens,
    medians over ``repeats`` greedy generations (of every step, for decode), and set them against the counted
    FLOPs and bytes: achieved FLOP/s and bytes/s, MFU and MBU on ``roof``."""
    from ..core.generate import generate

    if batch < 1 or prompt_len < 1 or new_tokens < 2 or repeats < 1:
        raise ValueError("batch, prompt_len and repeats must be >= 1 and new_tokens >= 2")
    prompts = [[1 + (i * 7 + j) % (model.config.vocab_size - 1) for i in range(prompt_len)] for j in range(batch)]
    generate(model, prompts, new_tokens, eos_token_id=None)  # warmup
    runs = [generate(model, prompts, new_tokens, eos_token_id=None) for _ in range(repeats)]
    bpe = model.dtype.itemsize
    step = statistics.median(t for r in runs for t in r.token_times)  # pooled: robust to a stray slow step
    phases = [("prefill", statistics.median(r.ttft for r in runs), prompt_len,
               forward_cost(model.config, batch, prompt_len, prompt_len, bpe)),
              ("decode", step, 1,
               forward_cost(model.config, batch, 1, prompt_len + new_tokens // 2, bpe))]  # fmt: skip
    rows = []
    for phase, seconds, tokens, cost in phases:
        flops_s, bytes_s = cost.flops / seconds, cost.bytes / seconds
        rows.append({"phase": phase, "batch": batch, "seconds": seconds, "tokens_per_s": batch * tokens / seconds,
                     "intensity": cost.intensity, "flops_per_s": flops_s, "bytes_per_s": bytes_s,
                     "mfu": flops_s / roof.peak_flops, "mbu": bytes_s / roof.peak_bandwidth})  # fmt: skip
    return rows


# ---------------------------------------------------------------------------------------------
# Choosing an accelerator


def decode_upper_bound_tokens_per_s(n_params: float, bytes_per_param: float, bandwidth: float) -> float:
    """Batch-1 decode reads every weight once per token, so tokens/s <= bandwidth / weight bytes
    (a ceiling: the KV cache and activations add bytes, kernels never reach peak bandwidth)."""
    if n_params <= 0 or bytes_per_param <= 0 or bandwidth <= 0:
        raise ValueError("n_params, bytes_per_param and bandwidth must be positive")
    return bandwidth / (n_params * bytes_per_param)


def datasheet_rows(accelerators=DATASHEETS) -> list[dict]:
    return [{"accelerator": a.name, "memory_gb": a.memory_gb, "bandwidth_tb_s": a.bandwidth_tb_s,
             "tflops_16bit": a.tflops_16bit, "ridge": a.ridge} for a in accelerators]  # fmt: skip


def accelerator_chooser(n_params: float, bytes_per_param: float, dollars_per_hour: dict[str, float],
                        accelerators=DATASHEETS) -> list[dict]:  # fmt: skip
    """For a model of ``n_params`` stored in ``bytes_per_param``: does it fit on one device, the
    batch-1 decode ceiling in tokens/s, and what 1M tokens would cost at that ceiling for the
    given (assumed) hourly prices. None where the weights do not fit or no price is given."""
    from .metrics import cost_per_million_tokens

    weights_gb = n_params * bytes_per_param / 1e9
    rows = []
    for a in accelerators:
        fits = weights_gb <= a.memory_gb
        tps = decode_upper_bound_tokens_per_s(n_params, bytes_per_param, a.bandwidth_tb_s * 1e12) if fits else None
        price = dollars_per_hour.get(a.name)
        cost = cost_per_million_tokens(price, tps) if tps and price else None
        rows.append({"accelerator": a.name, "weights_gb": weights_gb, "fits": fits, "tokens_per_s": tps,
                     "dollars_per_hour": price, "dollars_per_1m_tokens": cost})  # fmt: skip
    return rows


# ---------------------------------------------------------------------------------------------
# Plotting (matplotlib is imported only when a figure is drawn)


def plot_roofline(roof: Roofline, points: list[tuple[str, float, float | None]], title: str, ax=None,
                  intensity_range: tuple[float, float] = (0.1, 1e4)):  # fmt: skip
    """A log-log roofline: the roof, its ridge, and ``points`` as (label, intensity, achieved FLOP/s);
    a point with achieved None is drawn on the roof (its ceiling)."""
    import matplotlib.pyplot as plt
    import numpy as np

    if ax is None:
        _, ax = plt.subplots()
    x = np.logspace(np.log10(intensity_range[0]), np.log10(intensity_range[1]), 200)
    ax.plot(x, np.minimum(roof.peak_flops, roof.peak_bandwidth * x), "k-", lw=2, label="roof: min(P, W x I)")
    ax.axvline(roof.ridge, color="gray", ls=":", label=f"ridge: {roof.ridge:.3g} FLOP/byte")
    for label, intensity, achieved in points:
        y = roof.attainable(intensity) if achieved is None else achieved
        ax.plot(intensity, y, "o", ms=7, label=label)
    ax.set(xscale="log", yscale="log", xlabel="arithmetic intensity (FLOP/byte)", ylabel="FLOP/s", title=title)
    ax.legend(fontsize=8, loc="lower right")
    return ax


def format_phases(rows: list[dict], title: str) -> str:
    """``measure_phases`` rows as a table in readable units."""
    from ..bench.report import format_table

    table = [{"phase": r["phase"], "batch": r["batch"], "ms": 1e3 * r["seconds"], "tokens/s": r["tokens_per_s"],
              "FLOP/byte": r["intensity"], "GFLOP/s": r["flops_per_s"] / 1e9, "GB/s": r["bytes_per_s"] / 1e9,
              "MFU %": 100 * r["mfu"], "MBU %": 100 * r["mbu"]} for r in rows]  # fmt: skip
    return format_table(table, title=title)
