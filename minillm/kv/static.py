"""A fixed-shape KV cache for CUDA graphs and ``torch.compile`` (chapter 11).

``minillm.core.cache.KVCache`` returns a growing slice of its buffers: a new shape each step, so
a recompile each step under ``torch.compile`` and no replayable CUDA graph. ``StaticDecodeCache``
writes the new tokens with ``index_copy_`` at their positions and always returns the whole
buffers, masked by position, as gpt-fast's cache does.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..core.config import ModelConfig


class StaticDecodeCache:
    """Every step reads the whole (max_len) buffer: (B, Hkv, max_len, hd), positions -1 where empty.

    Positions are always passed explicitly (the same in every row), so ``length`` stays 0: a
    constant keeps torch.compile from recompiling. The buffers are marked static addresses,
    since the CUDA graph mutates them in place.
    """

    in_order = False  # the model builds the mask from positions
    window: int | None = None
    wants_attention = False
    length = 0

    def __init__(self, config: ModelConfig, batch: int, max_len: int, dtype: torch.dtype, device="cuda"):
        shape = (config.n_layers, batch, config.n_kv_heads, max_len, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.positions = torch.full((batch, max_len), -1, dtype=torch.long, device=device)
        for t in (self.k, self.v, self.positions):
            torch._dynamo.mark_static_address(t)  # mutated in place inside the CUDA graph

    @property
    def batch_size(self) -> int:
        return self.positions.shape[0]

    def reserve(self, positions: Tensor) -> Tensor:
        self.slots = positions[0]  # (T,), the same positions in every row
        self.positions.index_copy_(1, self.slots, positions)
        return self.positions  # (B, max_len)

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        self.k[layer].index_copy_(2, self.slots, k)
        self.v[layer].index_copy_(2, self.slots, v)
        return self.k[layer], self.v[layer]

    def truncate(self, length: int) -> None:
        """Forget the tokens at positions >= ``length`` (their slots are masked from then on)."""
        if length < 0:
            raise ValueError(f"cannot truncate a cache to a negative length, got {length}")
        self.positions.masked_fill_(self.positions >= length, -1)

    def record_attention(self, layer: int, probs: Tensor) -> None:
        """Attention probabilities are not wanted (``wants_attention`` is False)."""
