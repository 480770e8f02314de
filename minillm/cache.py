"""KV caches: the keys and values of past tokens, kept so that each new token costs one step.

Every cache kind offers the same small interface, which the model calls on each forward:

- ``reserve(positions)`` claims slots for the new tokens (B, T) and returns the positions of
  every key the queries may attend to (B, S); -1 marks an empty or padding slot.
- ``update(layer, k, v)`` stores a layer's new keys and values and returns all of that
  layer's keys and values (B, Hkv, S, hd), aligned with those positions.
- ``truncate(length)`` forgets everything after ``length`` slots (rollback, e.g. after a
  rejected speculative draft).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .config import ModelConfig


class CacheFullError(ValueError):
    """Raised when a write would run past a cache's capacity."""


class KVCache:
    """A contiguous cache preallocated for ``max_len`` tokens of ``batch_size`` sequences.

    k and v are (n_layers, B, n_kv_heads, max_len, head_dim) buffers, as in gpt-fast: no
    allocation happens while generating, and ``nbytes`` is exactly the KV memory formula
    2 * n_layers * B * n_kv_heads * max_len * head_dim * bytes_per_element.
    """

    def __init__(
        self,
        config: ModelConfig,
        batch_size: int,
        max_len: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ):
        if batch_size <= 0 or max_len <= 0:
            raise ValueError(f"batch_size and max_len must be positive, got {batch_size} and {max_len}")
        shape = (config.n_layers, batch_size, config.n_kv_heads, max_len, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.positions = torch.full((batch_size, max_len), -1, dtype=torch.long, device=device)
        self.max_len = max_len
        self.length = 0  # slots filled, the same for every row (rows are left-padded)
        self._start = 0  # first slot of the tokens being written

    @classmethod
    def for_model(cls, model, batch_size: int, max_len: int | None = None) -> KVCache:
        """A cache matching a model's shapes, dtype and device (up to its full context by default)."""
        return cls(model.config, batch_size, max_len or model.config.max_seq_len, model.dtype, model.device)

    @property
    def batch_size(self) -> int:
        return self.positions.shape[0]

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def reserve(self, positions: Tensor) -> Tensor:
        B, T = positions.shape
        if self.batch_size != B:
            raise ValueError(f"cache was built for batch size {self.batch_size}, got {B}")
        if self.length + T > self.max_len:
            raise CacheFullError(
                f"KV cache full: {self.length} of {self.max_len} slots used, cannot write {T} more tokens"
            )
        self._start = self.length
        self.length += T
        self.positions[:, self._start : self.length] = positions
        return self.positions[:, : self.length]

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        s, e = self._start, self.length
        self.k[layer, :, :, s:e] = k
        self.v[layer, :, :, s:e] = v
        return self.k[layer, :, :, :e], self.v[layer, :, :, :e]

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {length}")
        self.positions[:, length : self.length] = -1
        self.length = self._start = length
