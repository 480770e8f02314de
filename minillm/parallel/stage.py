"""One pipeline stage (chapter 15): a run of consecutive layers of the model, read from the
checkpoint alone, and the KV cache of those layers only; ``parallel.pipeline`` relays hidden
states through the stages.

    stage = Stage.from_checkpoint("minillm-target", stage=1, stages=2)   # layers split_layers(n, 2)[1]
    cache = stage.new_cache(batch_size=4, max_len=256)

Rank s of p holds layers ``split_layers(n_layers, p)[s]`` (consecutive, balanced); the first stage
also holds the embedding, the last the final norm and the LM head (with tied embeddings the last
stage reads ``embed_tokens.weight`` as its head).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..core.attention import attention_mask
from ..core.cache import KVCache
from ..core.checkpoints import CheckpointError, fused_parts, read_config, resolve
from ..core.config import ModelConfig
from ..core.model import Block, RMSNorm, rope_cos_sin, rope_inv_freq
from .shards import CheckpointSlices

# ---------------------------------------------------------------------------------------------
# The split


def balanced_ranges(n: int, parts: int) -> list[range]:
    """n items in ``parts`` consecutive ranges whose sizes differ by at most one (the larger first)."""
    size, extra = divmod(n, parts)
    out, start = [], 0
    for i in range(parts):
        stop = start + size + (i < extra)
        out.append(range(start, stop))
        start = stop
    return out


def check_pipeline(config: ModelConfig, stages: int) -> None:
    """ValueError, before any process starts, for a split that cannot work."""
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
        raise ValueError(f"number of pipeline stages must be a positive integer, got {stages!r}")
    if stages > config.n_layers:
        raise ValueError(
            f"{config.name}: {config.n_layers} layers cannot be split over {stages} pipeline stages "
            f"(every stage needs at least one layer: stages <= {config.n_layers})"
        )


def split_layers(n_layers: int, stages: int) -> list[range]:
    """The layers of each stage: consecutive, balanced (sizes differ by at most one)."""
    if isinstance(n_layers, bool) or not isinstance(n_layers, int) or n_layers < 1:
        raise ValueError(f"n_layers must be a positive integer, got {n_layers!r}")
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
        raise ValueError(f"number of pipeline stages must be a positive integer, got {stages!r}")
    if stages > n_layers:
        raise ValueError(f"{n_layers} layers cannot be split over {stages} stages (at most {n_layers})")
    return balanced_ranges(n_layers, stages)


# ---------------------------------------------------------------------------------------------
# One stage: its layers, loaded from the checkpoint alone


class StageKVCache(KVCache):
    """A contiguous KV cache for one stage: buffers of len(layers) layers, not the model's all.

    The model's attention modules keep their global layer index; ``update`` subtracts the
    stage's first layer. ``nbytes`` is the KV formula with the stage's layer count."""

    def __init__(self, config: ModelConfig, layers: range, batch_size: int, max_len: int, dtype, device):
        self.layers = layers
        super().__init__(config, batch_size, max_len, dtype=dtype, device=device)

    def _stored_layers(self, config: ModelConfig) -> int:
        return len(self.layers)

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        if layer not in self.layers:
            raise ValueError(f"this stage's cache holds layers {self.layers}, not layer {layer}")
        return super().update(layer - self.layers.start, k, v)


class Stage(nn.Module):
    """Rank ``stage`` of ``stages``: its layers, plus the embedding (first) and norm + head (last)."""

    def __init__(self, config: ModelConfig, stage: int, stages: int):
        super().__init__()
        check_pipeline(config, stages)
        if not 0 <= stage < stages:
            raise ValueError(f"stage must be in [0, {stages}), got {stage}")
        self.config, self.stage, self.stages = config, stage, stages
        self.layer_ids = split_layers(config.n_layers, stages)[stage]
        self.is_first, self.is_last = stage == 0, stage == stages - 1
        # Only the stage's own modules are ever built (the model's blocks, with their global
        # layer index). Not on the meta device: its first random init imports PyTorch's
        # decompositions, seconds per rank; the weights are overwritten by the checkpoint anyway.
        self.embed_tokens = nn.Embedding(config.vocab_size, config.dim) if self.is_first else None
        self.layers = nn.ModuleList(Block(config, i) for i in self.layer_ids)
        self.norm = RMSNorm(config.dim, config.norm_eps) if self.is_last else None
        tied = config.tie_embeddings
        self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False) if self.is_last and not tied else None
        self.head_weight: Tensor | None = None  # the tied head, read from embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.layers[0].input_layernorm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.layers[0].input_layernorm.weight.device

    def checkpoint_names(self) -> dict[str, list[str]]:
        """Each of this stage's parameters -> the checkpoint tensors it is made of (stacked by rows)."""
        parts = fused_parts(self.config)
        names: dict[str, list[str]] = {}
        for local, block in zip(range(len(self.layers)), self.layers):
            layer = self.layer_ids[local]
            for pname, _ in block.named_parameters():
                module, param = pname.rsplit(".", 1)
                hf = [f"{m}.{param}" for m, _ in parts[module]] if module in parts else [pname]
                names[f"layers.{local}.{pname}"] = [f"layers.{layer}.{n}" for n in hf]
        if self.is_first:
            names["embed_tokens.weight"] = ["embed_tokens.weight"]
        if self.is_last:
            names["norm.weight"] = ["norm.weight"]
            if self.lm_head is not None:
                names["lm_head.weight"] = ["lm_head.weight"]
        return names

    @classmethod
    def from_checkpoint(cls, directory, stage: int, stages: int, dtype=torch.float32, device="cpu") -> Stage:
        """Build the stage and read ONLY its own tensors from the checkpoint (safetensors slices)."""
        directory = resolve(directory)
        config, _ = read_config(directory)
        with torch.device(device):
            self = cls(config, stage, stages).to(dtype)
        self.inv_freq = rope_inv_freq(config).to(device)  # rotary frequencies stay fp32
        params = dict(self.named_parameters())
        with CheckpointSlices(directory) as ckpt, torch.no_grad():
            for pname, sources in self.checkpoint_names().items():
                parts = [ckpt.get(n, dtype=dtype, device=device) for n in sources]
                value = torch.cat(parts, dim=0) if len(parts) > 1 else parts[0]
                if value.shape != params[pname].shape:
                    raise CheckpointError(
                        f"{sources} have shape {tuple(value.shape)}, {pname} needs {tuple(params[pname].shape)}"
                    )
                params[pname].copy_(value)
            if self.is_last and self.lm_head is None:  # tied: the head is the embedding matrix
                head = self.embed_tokens.weight if self.is_first else ckpt.get("embed_tokens.weight", dtype=dtype)
                self.head_weight = head.to(device)
        return self.eval()

    def new_cache(self, batch_size: int, max_len: int) -> StageKVCache:
        return StageKVCache(self.config, self.layer_ids, batch_size, max_len, self.dtype, self.device)

    def forward(self, x: Tensor, positions: Tensor | None, cache: StageKVCache) -> Tensor:
        """ids (B, T) on the first stage, hidden states (B, T, D) on the others ->
        hidden states (B, T, D), or the last position's logits (B, V) on the last stage.

        The mask follows ``Transformer.forward``: positions None means contiguous tokens that
        continue the cache (a causal rule, no mask); explicit positions (left padding) a mask."""
        B, T = x.shape[:2]
        start = cache.length
        implicit = positions is None
        if implicit:
            positions = torch.arange(start, start + T, device=x.device).expand(B, T)
        k_pos = cache.reserve(positions)  # (B, S)
        window = self.config.sliding_window
        mask, causal = None, False
        if implicit and window is None and (T == 1 or start == 0):
            causal = T > 1
        else:
            mask = attention_mask(positions, k_pos, window)  # (B, 1, T, S)
        if self.is_first:
            x = self.embed_tokens(x)  # (B, T, D)
        cos, sin = rope_cos_sin(positions, self.inv_freq, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, mask, causal, cache)
        if not self.is_last:
            return x  # (B, T, D)
        hidden = self.norm(x[:, -1])  # (B, D)
        weight = self.lm_head.weight if self.lm_head is not None else self.head_weight
        return hidden @ weight.T  # (B, V)
