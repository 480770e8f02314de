"""How many bytes: the KV cache and the weights, from a model's shape alone.

Every cached token stores one key and one value vector per layer and per KV head:

    kv_bytes = 2 (K and V) x n_layers x n_kv_heads x head_dim x bytes_per_element x seq_len x batch

The weights are read once per decode step whatever the batch; the cache grows with batch x
context. Where the two meet (``crossover_tokens``) is where the cache, not the model, decides
how many users fit on an accelerator. ``hybrid_kv_bytes`` is the same arithmetic for a model
that combines the ways of shrinking the cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.config import ModelConfig, ceil_div, preset

BYTES_PER_ELEMENT = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1, "int8": 1, "int4": 0.5}
_TORCH_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int8: "int8"}


def bytes_per_element(dtype: str | torch.dtype) -> float:
    """2 for "fp16"/"bf16"/torch.float16, 1 for "int8", 0.5 for "int4", ..."""
    name = _TORCH_NAMES.get(dtype, dtype)
    if name not in BYTES_PER_ELEMENT:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(BYTES_PER_ELEMENT)} or a torch dtype")
    return BYTES_PER_ELEMENT[name]


def kv_bytes_per_token(config: ModelConfig, dtype: str | torch.dtype = "fp16") -> float:
    """K and V of one token across every layer."""
    return config.kv_bytes(1, bytes_per_element(dtype))


def kv_cache_bytes(config: ModelConfig, seq_len: int, batch: int = 1, dtype: str | torch.dtype = "fp16") -> float:
    """The KV cache of ``batch`` sequences of ``seq_len`` tokens (a sliding window
    caps the tokens kept)."""
    if seq_len < 0 or batch < 0:
        raise ValueError(f"seq_len and batch must be non-negative, got {seq_len} and {batch}")
    kept = min(seq_len, config.sliding_window) if config.sliding_window else seq_len
    return kv_bytes_per_token(config, dtype) * kept * batch


def weight_bytes(config: ModelConfig, dtype: str | torch.dtype = "fp16") -> float:
    """Every parameter once (tied embeddings counted once)."""
    return config.num_params() * bytes_per_element(dtype)


def crossover_tokens(config: ModelConfig, dtype: str | torch.dtype = "fp16") -> float:
    """batch x context at which the KV cache weighs as much as the weights."""
    return weight_bytes(config, dtype) / kv_bytes_per_token(config, dtype)


def users_that_fit(config: ModelConfig, context: int, memory_bytes: float, dtype="fp16") -> int:
    """How many users with ``context`` tokens each fit beside the weights in ``memory_bytes``."""
    free = memory_bytes - weight_bytes(config, dtype)
    return max(0, int(free // kv_cache_bytes(config, context, 1, dtype))) if free > 0 else 0


def hybrid_kv_bytes(
    config: ModelConfig,
    seq_len: int,
    batch: int = 1,
    dtype: str | torch.dtype = "bf16",
    n_kv_heads: int | None = None,
    global_every: int = 1,
    window: int | None = None,
    share_group: int = 1,
) -> float:
    """KV bytes of a model mixing the techniques of chapter 5: ``n_kv_heads`` K/V heads, layers
    sharing K/V in groups of ``share_group``, and of the stored K/V, one in ``global_every``
    attending to the whole context while the others keep a local ``window`` (MQA + mostly-local
    attention + cross-layer sharing, as Character.AI described for its serving models, 2024)."""
    n_kv_heads = n_kv_heads or config.n_kv_heads
    stored = ceil_div(config.n_layers, share_group)
    n_global = ceil_div(stored, global_every) if window else stored
    tokens = n_global * seq_len + (stored - n_global) * min(seq_len, window or seq_len)
    return 2 * n_kv_heads * config.head_dim * bytes_per_element(dtype) * tokens * batch


def format_bytes(n: float) -> str:
    """Decimal units, as datasheets use: 53.7 GB, 1.34 GB, 6.09 TB."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


# PaLM-540B's published shape (Chowdhery et al., 2022), imagined with multi-head attention:
# the "500B+ model with MHA" of Pope et al. (2022). PaLM itself used multi-query attention.
PALM_540B_MHA = ModelConfig(
    name="PaLM-540B shape, MHA",
    vocab_size=256000,
    dim=18432,
    n_layers=118,
    n_heads=48,
    head_dim=256,
    ffn_dim=73728,
    max_seq_len=2048,
)


@dataclass
class WorkedExample:
    name: str
    claim: str  # the figure as it is usually quoted
    claimed_bytes: float  # what the usual arithmetic gives
    true_bytes: float  # the formula with the real shape
    note: str

    def row(self) -> dict:
        return {
            "example": self.name,
            "quoted": self.claim,
            "usual arithmetic": format_bytes(self.claimed_bytes),
            "formula": format_bytes(self.true_bytes),
            "note": self.note,
        }


def worked_examples() -> list[WorkedExample]:
    """The classic KV-cache figures, recomputed from the model shapes (nothing typed in)."""
    l13, l70 = preset("Llama-2-13B"), preset("Llama-2-70B")
    l70_mha = l70.replace(n_kv_heads=l70.n_heads)
    one_of_k_or_v = kv_cache_bytes(PALM_540B_MHA, 2048, 512, "fp16") / 2
    return [
        WorkedExample(
            "Llama-2-13B, batch 32, 2048 tokens, fp16",
            "about 54 GB",
            kv_cache_bytes(l13, 2048, 32, "fp16"),
            kv_cache_bytes(l13, 2048, 32, "fp16"),
            f"right: {l13.n_layers} layers x {l13.n_kv_heads * l13.head_dim} (MHA) x 2 (K, V) x 2 bytes = "
            f"{format_bytes(kv_bytes_per_token(l13, 'fp16'))} per token",
        ),
        WorkedExample(
            "Llama-2-70B, one request of 4096 tokens, fp16",
            "about 5.2 GB",
            kv_cache_bytes(l70_mha, 4096, 1, "fp16") / 2,
            kv_cache_bytes(l70, 4096, 1, "fp16"),
            f"the quote drops the 2 for K and V, and Llama-2-70B has {l70.n_kv_heads} KV heads (GQA), not "
            f"{l70.n_heads}: as MHA it would be {format_bytes(kv_cache_bytes(l70_mha, 4096, 1, 'fp16'))}",
        ),
        WorkedExample(
            "500B+ MHA model (PaLM-540B shape), batch 512, 2048 tokens, bf16",
            "about 3 TB",
            one_of_k_or_v,
            2 * one_of_k_or_v,
            "3 TB is K alone (or K and V in 8 bits); K and V in 16 bits are twice that",
        ),
    ]


def kv_vs_weights(config: ModelConfig, batches, contexts, dtype="fp16") -> list[dict]:
    """Rows of (batch, context, KV bytes, weight bytes, KV / weights) for a table or a plot."""
    w = weight_bytes(config, dtype)
    return [
        {
            "batch": b,
            "context": s,
            "kv_bytes": kv_cache_bytes(config, s, b, dtype),
            "weight_bytes": w,
            "kv_over_weights": kv_cache_bytes(config, s, b, dtype) / w,
        }
        for b in batches
        for s in contexts
    ]
