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

from .config import ModelConfig


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
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
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
