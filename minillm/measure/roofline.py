"""The roofline model (Williams, Waterman & Patterson, 2009): counted FLOPs and bytes of a model's
forward, accelerators' datasheets, and what they bound. Measuring this machine's roof is
``minillm.bench.roofline``; drawing it, ``minillm.viz.roofline``.

An operation that does F FLOPs while moving B bytes has arithmetic intensity I = F / B. On a
device with peak compute P (FLOP/s) and memory bandwidth W (bytes/s) it can run at most at
min(P, W x I): below the ridge point I* = P / W it is bandwidth-bound, above it compute-bound.
Decode multiplies a whole weight matrix by one token's vector (I ~ 1 FLOP/byte in fp16), so it
sits far left of the ridge; prefill and large batches move right.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.config import ModelConfig
from .metrics import cost_per_million_tokens


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


def layer_costs(
    config: ModelConfig, batch: int, new_tokens: int, context: int, bytes_per_element: float = 2
) -> list[OpCost]:
    """FLOPs and bytes of one transformer layer's matmuls for ``new_tokens`` per
    sequence attending to ``context`` keys: prefill is new_tokens = context = prompt
    length; decode is new_tokens = 1."""
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


def forward_cost(
    config: ModelConfig,
    batch: int,
    new_tokens: int,
    context: int,
    bytes_per_element: float = 2,
    head_tokens: int | None = None,
) -> OpCost:
    """Total FLOPs and bytes of one forward pass (all layers and the LM head).

    The head runs on ``head_tokens`` tokens per sequence (default: every new token; a
    prefill that keeps only the last token's logits, as ``generate`` does, passes 1)."""
    head = new_tokens if head_tokens is None else head_tokens
    ops = layer_costs(config, batch, new_tokens, context, bytes_per_element) * config.n_layers
    ops.append(matmul_cost("lm_head", batch * head, config.dim, config.vocab_size, bytes_per_element))
    return OpCost("forward", sum(o.flops for o in ops), sum(o.bytes for o in ops))


# ---------------------------------------------------------------------------------------------
# Choosing an accelerator


def decode_upper_bound_tokens_per_s(n_params: float, bytes_per_param: float, bandwidth: float) -> float:
    """Batch-1 decode reads every weight once per token, so tokens/s <= bandwidth / weight bytes
    (a ceiling: the KV cache and activations add bytes, kernels never reach peak bandwidth)."""
    if n_params <= 0 or bytes_per_param <= 0 or bandwidth <= 0:
        raise ValueError("n_params, bytes_per_param and bandwidth must be positive")
    return bandwidth / (n_params * bytes_per_param)


def datasheet_rows(accelerators=DATASHEETS) -> list[dict]:
    return [
        {
            "accelerator": a.name,
            "memory_gb": a.memory_gb,
            "bandwidth_tb_s": a.bandwidth_tb_s,
            "tflops_16bit": a.tflops_16bit,
            "ridge": a.ridge,
        }
        for a in accelerators
    ]


def accelerator_chooser(
    n_params: float, bytes_per_param: float, dollars_per_hour: dict[str, float], accelerators=DATASHEETS
) -> list[dict]:
    """For a model of ``n_params`` stored in ``bytes_per_param``: does it fit on one device, the
    batch-1 decode ceiling in tokens/s, and what 1M tokens would cost at that ceiling for the
    given (assumed) hourly prices. None where the weights do not fit or no price is given."""
    weights_gb = n_params * bytes_per_param / 1e9
    rows = []
    for a in accelerators:
        fits = weights_gb <= a.memory_gb
        tps = decode_upper_bound_tokens_per_s(n_params, bytes_per_param, a.bandwidth_tb_s * 1e12) if fits else None
        price = dollars_per_hour.get(a.name)
        cost = cost_per_million_tokens(price, tps) if tps and price else None
        rows.append(
            {
                "accelerator": a.name,
                "weights_gb": weights_gb,
                "fits": fits,
                "tokens_per_s": tps,
                "dollars_per_hour": price,
                "dollars_per_1m_tokens": cost,
            }
        )
    return rows
