"""KV caches: the keys and values of past tokens, kept so that each new token costs one step.

``Cache`` is the protocol every cache kind follows, all the model and ``generate`` ask of a cache:

- ``reserve(positions)`` claims slots for the new tokens (B, T) and returns the positions of
  every key the queries may attend to (B, S); -1 marks an empty or padding slot.
- ``update(layer, k, v)`` stores a layer's new keys and values and returns all of that
  layer's keys and values (B, Hkv, S, hd), aligned with those positions.
- ``truncate(length)`` forgets everything after the first ``length`` tokens (rollback, e.g.
  after a rejected speculative draft).
- ``wants_attention`` / ``record_attention(layer, probs)``: a cache that evicts by attention
  (heavy hitters) asks for each layer's attention probabilities; the others ignore them.
- optionally ``attends`` / ``attend(layer, q, k, v)``: a cache with an attention kernel of its
  own (the paged decode step of ``minillm.serving.compiled_step``) stores the new keys and values
  and attends to everything in its own layout; the model then calls ``attend`` instead of
  ``update`` and its own attention.

``KVCache`` is the contiguous kind of chapter 4, preallocated as in gpt-fast, on ``SlotBuffers``
(the K/V buffers and the position of each slot). The compressed kinds of chapter 5 are in
``minillm.kv.compressed``, the paged one in ``minillm.kv.paged``, the fixed-shape one for
compiled decoding and CUDA graphs in ``minillm.core.compiled`` (``StaticCache``: what
``generate(compile=True)`` uses; a hand-written step passes its ``view`` to the model).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from .config import ModelConfig


@runtime_checkable
class Cache(Protocol):
    """What the model and ``generate`` need from a KV cache.

    ``length`` counts the tokens written so far (the next token's position, for an unpadded
    row); ``batch_size`` the rows it was built for. ``in_order`` is True when ``update`` returns
    exactly the keys of positions 0..length-1 in order, so that a plain causal rule needs no
    mask. A cache that limits what may be seen (a sliding window) names it in ``window``, else
    None. ``wants_attention`` asks the model to call ``record_attention`` with each layer's
    attention probabilities (B, H, T, S).
    """

    length: int
    in_order: bool
    window: int | None
    wants_attention: bool

    @property
    def batch_size(self) -> int: ...

    def reserve(self, positions: Tensor) -> Tensor: ...  # (B, T) new positions -> (B, S) all key positions
    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]: ...
    def truncate(self, length: int) -> None: ...
    def record_attention(self, layer: int, probs: Tensor) -> None: ...


class CacheFullError(ValueError):
    """Raised when a write would run past a cache's capacity."""


def check_sizes(**sizes: int) -> None:
    for name, value in sizes.items():
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def kept_slots(slots, start: int, length: int, device) -> Tensor:
    """The slots a ``keep_slots`` keeps, as a tensor, checked: increasing, within [start, length)."""
    slots = torch.as_tensor(slots, dtype=torch.long, device=device)
    if len(slots) and (slots.min() < start or slots.max() >= length or (slots.diff() <= 0).any()):
        raise ValueError(f"slots must increase within [{start}, {length}), got {slots.tolist()}")
    return slots


class SlotBuffers:
    """K and V buffers of (layers, B, n_kv_heads, slots, head_dim) and the position held by each
    slot (B, slots), -1 for empty: the storage the contiguous and compressed kinds are built on.

    It also holds the protocol's defaults: no window, and attention probabilities not wanted
    (``record_attention`` does nothing).
    """

    window: int | None = None
    wants_attention = False

    def __init__(self, config: ModelConfig, batch_size: int, slots: int, dtype, device, n_layers: int | None = None):
        self.config = config
        shape = (n_layers or config.n_layers, batch_size, config.n_kv_heads, slots, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.positions = torch.full((batch_size, slots), -1, dtype=torch.long, device=device)

    @property
    def batch_size(self) -> int:
        return self.positions.shape[0]

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def record_attention(self, layer: int, probs: Tensor) -> None:
        """Only a cache that evicts by attention (``wants_attention``) uses the probabilities."""

    def _check_batch(self, positions: Tensor) -> None:
        if positions.shape[0] != self.batch_size:
            raise ValueError(f"cache was built for batch size {self.batch_size}, got {positions.shape[0]}")


class KVCache(SlotBuffers):
    """A contiguous cache preallocated for ``max_len`` tokens of ``batch_size`` sequences.

    k and v are (n_layers, B, n_kv_heads, max_len, head_dim) buffers, as in gpt-fast: no
    allocation happens while generating, and ``nbytes`` is exactly the KV memory formula
    2 * n_layers * B * n_kv_heads * max_len * head_dim * bytes_per_element.
    """

    in_order = True  # update() returns the keys of positions 0..length-1 in order

    def __init__(
        self,
        config: ModelConfig,
        batch_size: int,
        max_len: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ):
        check_sizes(batch_size=batch_size, max_len=max_len)
        super().__init__(config, batch_size, max_len, dtype, device, self._stored_layers(config))
        self.max_len = max_len
        self.length = 0  # slots filled, the same for every row (rows are left-padded)
        self._start = 0  # first slot of the tokens being written

    def _stored_layers(self, config: ModelConfig) -> int:
        return config.n_layers

    @classmethod
    def for_model(cls, model, batch_size: int, max_len: int | None = None, **options):
        """A cache matching a model's shapes, dtype and device (up to its full context by default)."""
        max_len = max_len or model.config.max_seq_len
        return cls(model.config, batch_size, max_len, dtype=model.dtype, device=model.device, **options)

    def reserve(self, positions: Tensor) -> Tensor:
        self._check_batch(positions)
        T = positions.shape[1]
        if self.length + T > self.max_len:
            used = f"{self.length} of {self.max_len} slots used"
            raise CacheFullError(f"KV cache full: {used}, cannot write {T} more tokens")
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

    def _check_slots(self, start: int, slots) -> Tensor:
        return kept_slots(slots, start, self.length, self.positions.device)

    def keep_slots(self, start: int, slots: Tensor | list[int]) -> None:
        """Keep the tokens of ``slots`` (increasing, all >= start) at start, start+1, ...; drop the rest.

        After verifying several candidate branches in one pass (tree attention), this moves
        the accepted branch's keys and values next to the prefix.
        """
        slots = self._check_slots(start, slots)
        end = start + len(slots)
        for buf in (self.k, self.v):
            buf[:, :, :, start:end] = buf[:, :, :, slots]
        self.positions[:, start:end] = self.positions[:, slots]
        self.truncate(end)
