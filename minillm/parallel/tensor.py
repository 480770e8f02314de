"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019), written by hand with ``torch.distributed``.

Each of N ranks holds 1/N of every layer's matrices and computes 1/N of every layer:

- q/k/v and gate/up are split by output rows (column-parallel): rank r computes its own query
  heads, its own key/value heads, its own slice of the MLP's hidden units. Nothing needs to be
  exchanged, because attention heads and SwiGLU hidden units are independent of each other.
- o_proj and down_proj are split by input columns (row-parallel): each rank multiplies its slice
  of the hidden vector by its slice of the matrix, which gives a partial sum of the full output;
  one all-reduce adds the N partial sums. So a layer costs two all-reduces of (tokens, d_model)
  and nothing else.
- With fewer key/value heads than ranks (GQA, MQA), each K/V head is replicated on the
  N / n_kv_heads ranks whose query heads read it (as vLLM does).
- Norms and the embedding are replicated (they are small); the LM head is either replicated or
  vocabulary-parallel (each rank scores 1/N of the vocabulary, one all-gather assembles the logits).

Sharded, the model is an ordinary ``Transformer`` whose config counts local heads and hidden
units (``local_config``), with its two row-parallel projections per layer wrapped so that they
all-reduce. ``generate`` and every cache run on it unchanged: each rank runs the same loop on the
same (all-reduced) logits and samples the same tokens.
"""

from __future__ import annotations

from ..core.config import ModelConfig


def check_tensor_parallel(config: ModelConfig, tp: int, vocab_parallel: bool = False) -> None:
    """ValueError, before any process starts, for a split that cannot work."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tensor-parallel size must be a positive integer, got {tp!r}")
    H, Hkv = config.n_heads, config.n_kv_heads
    if H % tp:
        raise ValueError(f"{config.name}: {H} query heads cannot be split over {tp} ranks ({H} % {tp} != 0)")
    if Hkv >= tp and Hkv % tp:
        raise ValueError(f"{config.name}: {Hkv} key/value heads cannot be split over {tp} ranks ({Hkv} % {tp} != 0)")
    if Hkv < tp and tp % Hkv:
        raise ValueError(
            f"{config.name}: {Hkv} key/value heads cannot be replicated evenly over {tp} ranks ({tp} % {Hkv} != 0)"
        )
    if config.ffn_dim % tp:
        raise ValueError(f"{config.name}: ffn_dim {config.ffn_dim} cannot be split over {tp} ranks")
    if vocab_parallel and config.vocab_size % tp:
        raise ValueError(
            f"{config.name}: vocabulary of {config.vocab_size} cannot be split over {tp} ranks; "
            "use a replicated LM head"
        )


def local_config(config: ModelConfig, tp: int) -> ModelConfig:
    """The shapes one rank of ``tp`` holds: n_heads / tp query heads, max(n_kv_heads / tp, 1)
    key/value heads, ffn_dim / tp hidden units; everything else (dim, head_dim, vocabulary,
    context) unchanged."""
    check_tensor_parallel(config, tp)
    return config.replace(
        n_heads=config.n_heads // tp,
        n_kv_heads=max(config.n_kv_heads // tp, 1),
        head_dim=config.head_dim,
        ffn_dim=config.ffn_dim // tp,
    )


def query_heads(config: ModelConfig, tp: int, rank: int) -> range:
    """The global query heads rank ``rank`` computes."""
    n = config.n_heads // tp
    return range(rank * n, (rank + 1) * n)


def kv_heads(config: ModelConfig, tp: int, rank: int) -> range:
    """The global key/value heads rank ``rank`` holds: its own 1/tp, or (fewer K/V heads than
    ranks) the one head its query heads read, which it shares with tp / n_kv_heads ranks."""
    if config.n_kv_heads >= tp:
        n = config.n_kv_heads // tp
        return range(rank * n, (rank + 1) * n)
    head = query_heads(config, tp, rank).start // config.n_rep
    return range(head, head + 1)
