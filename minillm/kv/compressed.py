"""The compressed KV cache kinds of chapter 5: each a way to spend less memory per token.

- ``CrossLayerKVCache``: groups of adjacent layers read one layer's K/V (Cross-Layer
  Attention, Brandon et al., 2024); memory / group size.
- ``QuantizedKVCache``: int8 K/V with one scale per token and head (``quantize_int8``); about
  half of fp16.
- ``SlidingWindowCache``: a ring buffer of the last ``window`` tokens; memory fixed.
- ``SelectiveKVCache``: a fixed budget of tokens: attention sinks plus the most recent
  (StreamingLLM, Xiao et al., 2023), or sinks, recent and heavy hitters, the tokens with the
  largest accumulated attention (H2O, Zhang et al., 2023).

Each follows ``minillm.core.cache.Cache``, the protocol of the contiguous ``KVCache`` they
compress, so the model and ``generate`` take any of them.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..core.cache import KVCache, SlotBuffers, check_sizes
from ..core.config import ModelConfig, ceil_div


class CrossLayerKVCache(KVCache):
    """Adjacent layers in groups of ``group`` share one K/V: the first layer of a group writes it,
    the others read it (and their own K/V projections go unused). Memory / group size."""

    def __init__(self, config, batch_size, max_len, dtype=torch.float32, device="cpu", group: int = 2):
        check_sizes(group=group)
        self.group = group
        super().__init__(config, batch_size, max_len, dtype, device)

    def _stored_layers(self, config: ModelConfig) -> int:
        return ceil_div(config.n_layers, self.group)

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        owner, e = layer // self.group, self.length
        if layer % self.group == 0:
            self.k[owner, :, :, self._start : e] = k
            self.v[owner, :, :, self._start : e] = v
        return self.k[owner, :, :, :e], self.v[owner, :, :, :e]


def quantize_int8(x: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric int8 with one scale per vector along the last dim: x ~ q * scale."""
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-8) / 127.0
    q = (x.float() / scale).round().clamp(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    return (q.float() * scale).to(dtype)


class QuantizedKVCache(KVCache):
    """K and V stored as int8 with one fp32 scale per (token, head): 1 byte per element plus
    4 bytes per head_dim elements. Attention reads them back dequantized (a fused kernel
    would dequantize in registers; here the dequantized copy is made each step).

    ``relative_error`` is the RMS quantization error over everything written, relative to
    the RMS of the values: how much the cache distorts what it stores.
    """

    def __init__(self, config, batch_size, max_len, dtype=torch.float32, device="cpu"):
        super().__init__(config, batch_size, max_len, torch.int8, device)
        self.dtype = dtype
        scale_shape = self.k.shape[:-1] + (1,)
        self.k_scale = torch.zeros(scale_shape, dtype=torch.float32, device=device)
        self.v_scale = torch.zeros(scale_shape, dtype=torch.float32, device=device)
        self._err_sq = self._val_sq = 0.0

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes + self.k_scale.nbytes + self.v_scale.nbytes

    @property
    def relative_error(self) -> float:
        return (self._err_sq / self._val_sq) ** 0.5 if self._val_sq else 0.0

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        s, e = self._start, self.length
        for x, q_buf, scale_buf in ((k, self.k, self.k_scale), (v, self.v, self.v_scale)):
            q, scale = quantize_int8(x)
            q_buf[layer, :, :, s:e], scale_buf[layer, :, :, s:e] = q, scale
            self._err_sq += (dequantize_int8(q, scale, torch.float32) - x.float()).square().sum().item()
            self._val_sq += x.float().square().sum().item()
        k_all = dequantize_int8(self.k[layer, :, :, :e], self.k_scale[layer, :, :, :e], self.dtype)
        v_all = dequantize_int8(self.v[layer, :, :, :e], self.v_scale[layer, :, :, :e], self.dtype)
        return k_all, v_all

    def keep_slots(self, start, slots) -> None:
        slots = self._check_slots(start, slots)
        end = start + len(slots)
        for buf in (self.k_scale, self.v_scale):
            buf[:, :, :, start:end] = buf[:, :, :, slots]
        super().keep_slots(start, slots)


class SlidingWindowCache(SlotBuffers):
    """A ring buffer holding the last ``window`` (+ ``slack``) tokens: memory fixed, however long
    the sequence. Token number n (counting every token written) lives in slot n % capacity.

    Queries see at most ``window`` positions back (the model applies the window mask), which
    is exactly sliding-window attention. When a forward brings fewer new tokens than the
    free room (decode), they are written first and attention reads the ring; a longer chunk
    (a prefill) attends to the ring and the chunk together, then only its last tokens are kept.
    ``slack`` extra slots let ``truncate`` roll back that many tokens (speculative decoding).
    """

    in_order = False

    def __init__(self, config, batch_size, window, dtype=torch.float32, device="cpu", slack: int = 0):
        check_sizes(batch_size=batch_size, window=window)
        if not isinstance(slack, int) or slack < 0:
            raise ValueError(f"slack must be a non-negative integer, got {slack!r}")
        super().__init__(config, batch_size, window + slack, dtype, device)
        self.window, self.slack, self.capacity = window, slack, window + slack
        self.length = 0  # tokens written so far
        self._direct = True
        self._slots = torch.empty(0, dtype=torch.long)
        self._keep = 0

    @classmethod
    def for_model(cls, model, batch_size: int, window: int, slack: int = 0) -> SlidingWindowCache:
        return cls(model.config, batch_size, window, model.dtype, model.device, slack)

    def reserve(self, positions: Tensor) -> Tensor:
        self._check_batch(positions)
        T, C = positions.shape[1], self.capacity
        # Writing first is safe when the tokens it overwrites are out of every new query's window.
        self._direct = T + self.window - 1 <= C
        self._keep = min(T, C)  # the last tokens of the chunk that stay in the ring
        self._slots = (self.length + torch.arange(T - self._keep, T, device=positions.device)) % C
        self.length += T
        if self._direct:
            self.positions[:, self._slots] = positions
            return self.positions
        k_pos = torch.cat([self.positions, positions], dim=1)  # old ring, then the chunk
        self.positions[:, self._slots] = positions[:, T - self._keep :]
        return k_pos

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        if self._direct:
            self.k[layer][:, :, self._slots], self.v[layer][:, :, self._slots] = k, v
            return self.k[layer], self.v[layer]
        k_all, v_all = torch.cat([self.k[layer], k], dim=2), torch.cat([self.v[layer], v], dim=2)
        T = k.shape[2]
        self.k[layer][:, :, self._slots] = k[:, :, T - self._keep :]
        self.v[layer][:, :, self._slots] = v[:, :, T - self._keep :]
        return k_all, v_all

    def truncate(self, length: int) -> None:
        dropped = self.length - length
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {length}")
        if dropped > self.slack:
            raise ValueError(
                f"a sliding-window cache can roll back at most slack={self.slack} tokens, asked for {dropped}; "
                "build it with a larger slack"
            )
        slots = (torch.arange(length, self.length) % self.capacity).to(self.positions.device)
        self.positions[:, slots] = -1
        self.length = length


class SelectiveKVCache(SlotBuffers):
    """At most ``budget`` tokens, chosen by a policy; the others are evicted for good.

    - ``policy="recent"``: the first ``n_sink`` tokens (attention sinks) and the most recent.
    - ``policy="heavy"``: the sinks, the last ``n_recent`` tokens, and the tokens that have
      received the most attention so far (summed over layers, heads and queries).

    One choice is shared by every layer and head (H2O chooses per head; sharing keeps one
    position table and one mask). A forward that brings the cache over budget attends to all
    of it, then the cache is cut back to the budget before the next forward: a long prompt
    is prefilled exactly and compressed afterwards. Tokens keep their original positions.
    """

    in_order = False

    def __init__(
        self,
        config,
        batch_size,
        budget,
        dtype=torch.float32,
        device="cpu",
        policy: str = "recent",
        n_sink: int = 4,
        n_recent: int | None = None,
    ):
        check_sizes(batch_size=batch_size, budget=budget)
        if policy not in ("recent", "heavy"):
            raise ValueError(f"policy must be 'recent' or 'heavy', got {policy!r}")
        n_recent = budget // 2 if n_recent is None else n_recent
        if n_sink < 0 or n_recent < 0 or n_sink + n_recent > budget:
            raise ValueError(f"need 0 <= n_sink + n_recent <= budget, got {n_sink} + {n_recent} > {budget}")
        super().__init__(config, batch_size, budget, dtype, device)
        self.budget, self.policy, self.n_sink, self.n_recent = budget, policy, n_sink, n_recent
        self.wants_attention = policy == "heavy"
        self.scores = torch.zeros(batch_size, budget, dtype=torch.float32, device=device)
        self.length = 0  # tokens seen
        self.used = 0  # slots holding a token
        self.evicted = 0
        self._pending: list[tuple[Tensor, Tensor] | None] = [None] * config.n_layers
        self._pending_pos: Tensor | None = None
        self._pending_scores: Tensor | None = None

    @classmethod
    def for_model(cls, model, batch_size: int, budget: int, **options) -> SelectiveKVCache:
        return cls(model.config, batch_size, budget, model.dtype, model.device, **options)

    def reserve(self, positions: Tensor) -> Tensor:
        self._check_batch(positions)
        B, T = positions.shape
        self.compress()
        self.length += T
        if self.used + T <= self.budget:  # room: write into free slots, as a contiguous cache would
            self._slots = slice(self.used, self.used + T)
            self.positions[:, self._slots] = positions
            self.used += T
            return self.positions[:, : self.used]
        self._slots = None  # over budget: attend to everything, keep the best after this forward
        self._pending_pos = torch.cat([self.positions[:, : self.used], positions], dim=1)
        self._pending_scores = torch.cat([self.scores[:, : self.used], self.scores.new_zeros(B, T)], dim=1)
        return self._pending_pos

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        if self._slots is not None:
            self.k[layer, :, :, self._slots], self.v[layer, :, :, self._slots] = k, v
            return self.k[layer, :, :, : self.used], self.v[layer, :, :, : self.used]
        n = self.used
        k_all = torch.cat([self.k[layer, :, :, :n], k], dim=2)
        v_all = torch.cat([self.v[layer, :, :, :n], v], dim=2)
        self._pending[layer] = (k_all, v_all)
        return k_all, v_all

    def record_attention(self, layer: int, probs: Tensor) -> None:
        """probs (B, H, T, S): add the attention each key received to its score."""
        received = probs.sum(dim=(1, 2))  # (B, S)
        if self._slots is not None:
            self.scores[:, : self.used] += received
        else:
            self._pending_scores += received

    def compress(self) -> None:
        """Cut the cache back to its budget after a forward that went over it."""
        if self._pending_pos is None:
            return
        keep = self._choose(self._pending_pos, self._pending_scores)  # (B, budget), slots in order
        for layer, (k_all, v_all) in enumerate(self._pending):
            idx = keep[:, None, :, None].expand(-1, k_all.shape[1], -1, k_all.shape[-1])
            self.k[layer] = k_all.gather(2, idx)
            self.v[layer] = v_all.gather(2, idx)
        self.evicted += self._pending_pos.shape[1] - self.budget
        self.positions = self._pending_pos.gather(1, keep)
        self.scores = self._pending_scores.gather(1, keep)
        self.used = self.budget
        self._pending = [None] * self.config.n_layers
        self._pending_pos = self._pending_scores = None

    def _choose(self, positions: Tensor, scores: Tensor) -> Tensor:
        """Indices (B, budget) of the tokens to keep, in their original order."""
        # Rank every candidate: sinks and recent tokens first (infinite priority), then by score.
        order = positions.argsort(dim=1)
        rank = torch.empty_like(order)
        rank.scatter_(1, order, torch.arange(positions.shape[1], device=positions.device).expand_as(order))
        n = positions.shape[1]
        pads = (positions < 0).sum(dim=1, keepdim=True)  # padding sorts first; sinks come after it
        protected = ((rank >= pads) & (rank < pads + self.n_sink)) | (rank >= n - self.n_recent)
        priority = rank.float() if self.policy == "recent" else scores  # recent: newest first among the rest
        priority = priority.masked_fill(protected, float("inf")).masked_fill(positions < 0, float("-inf"))
        keep = priority.topk(self.budget, dim=1).indices
        return keep.sort(dim=1).values

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {length}")
        if self.evicted or self._pending_pos is not None:
            raise ValueError("a selective cache that has evicted tokens cannot roll back: they are gone")
        self.positions[:, length : self.used] = -1
        self.scores[:, length : self.used] = 0
        self.length = self.used = length
