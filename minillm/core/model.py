"""A Llama-family decoder-only transformer, written to be read.

It follows Llama (Touvron et al., 2023): pre-norm blocks with RMSNorm (Zhang & Sennrich, 2019),
rotary position embeddings (Su et al., 2021) with Llama 3's frequency scaling, grouped-query
attention (Ainslie et al., 2023) of which MHA and MQA are the two ends, and a SwiGLU MLP
(Shazeer, 2020). Mistral and Qwen2 differ only in options (sliding window, q/k/v bias).

Module and parameter names follow Hugging Face's ``LlamaForCausalLM`` (without the ``model.``
prefix), except that q/k/v and gate/up projections are stacked into one matrix each
(``qkv_proj``, ``gate_up_proj``), as in vLLM and gpt-fast: fewer, larger matmuls.
``minillm.core.checkpoints`` splits and stacks them when saving and loading.

Positions are explicit: every query and every cached key carries its position, and the
attention mask is derived from them (causal: key position <= query position; a padding slot
has position -1 and is never attended to). That one rule serves plain prefill, decoding with a
cache, left-padded batches and sliding windows alike.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .attention import ATTENTION_BACKENDS, attention_function, attention_mask, attention_probs
from .cache import Cache
from .config import ModelConfig, preset


def rms_norm_reference(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x / sqrt(mean(x^2) + eps) * weight, the statistics in fp32 whatever the input dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # PyTorch's fused op computes exactly rms_norm_reference in one call instead of six.
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def rope_inv_freq(config: ModelConfig) -> Tensor:
    """Rotation frequency of each pair of head dimensions, after any context-extension scaling."""
    hd, s = config.head_dim, config.rope_scaling
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    if s.rope_type == "linear":
        return (inv_freq / s.factor).float()
    if s.rope_type == "llama3":
        # Llama 3.1: long wavelengths (low frequencies) are stretched by `factor`, short ones kept,
        # and the band in between interpolates smoothly between the two.
        wavelen = 2 * math.pi / inv_freq
        ratio = s.original_max_position_embeddings / wavelen  # how many periods fit the old context
        smooth = ((ratio - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)).clamp(0, 1)
        inv_freq = (1 - smooth) * inv_freq / s.factor + smooth * inv_freq
    return inv_freq.float()


def rope_cos_sin(positions: Tensor, inv_freq: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos and sin tables for integer positions (B, T) -> two (B, 1, T, head_dim) tensors."""
    angles = positions.clamp(min=0).float()[..., None] * inv_freq  # (B, T, hd/2)
    angles = torch.cat([angles, angles], dim=-1)  # (B, T, hd): the rotate-half layout
    return angles.cos().to(dtype)[:, None], angles.sin().to(dtype)[:, None]


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate each (i, i + hd/2) pair of x (B, H, T, hd) by its position's angle."""
    return x * cos + rotate_half(x) * sin


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        d, hd = config.dim, config.head_dim
        self.q_size, self.kv_size = self.n_heads * hd, self.n_kv_heads * hd
        # W_q, W_k and W_v stacked into one matrix: one matmul instead of three per layer.
        self.qkv_proj = nn.Linear(d, self.q_size + 2 * self.kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, d, bias=config.o_bias)
        self.backend = "sdpa"

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        mask: Tensor | None,
        causal: bool,
        cache: Cache | None = None,
    ) -> Tensor:
        B, T, _ = x.shape
        H, Hkv = self.n_heads, self.n_kv_heads
        qkv = self.qkv_proj(x).view(B, T, H + 2 * Hkv, self.head_dim).transpose(1, 2)  # (B, H+2Hkv, T, hd)
        qk = apply_rope(qkv[:, : H + Hkv], cos, sin)  # queries and keys rotated in one go
        q, k, v = qk[:, :H], qk[:, H:], qkv[:, H + Hkv :]  # (B, H, T, hd), (B, Hkv, T, hd), (B, Hkv, T, hd)
        if cache is not None and getattr(cache, "attends", False):  # it writes k, v and attends in its own layout
            y = cache.attend(self.layer_idx, q, k, v)  # (B, H, T, hd), e.g. a paged-attention kernel
            return self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))
        if cache is not None:
            k, v = cache.update(self.layer_idx, k, v)  # (B, Hkv, S, hd): every key so far
        if cache is not None and cache.wants_attention:
            probs = attention_probs(q, k, mask, causal)  # (B, H, T, S), for caches that evict by attention
            cache.record_attention(self.layer_idx, probs)
            y = probs.to(v.dtype) @ v.repeat_interleave(H // Hkv, dim=1)
        else:
            attend = attention_function(self.backend)
            y = attend(q, k, v, mask, causal)  # (B, H, T, hd)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))


def _narrowest(*windows: int | None) -> int | None:
    given = [w for w in windows if w is not None]
    return min(given) if given else None


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        d, f, b = config.dim, config.ffn_dim, config.mlp_bias
        self.gate_up_proj = nn.Linear(d, 2 * f, bias=b)  # W_gate and W_up stacked: one matmul
        self.down_proj = nn.Linear(f, d, bias=b)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.dim, config.norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.dim, config.norm_eps)
        self.mlp = MLP(config)

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        mask: Tensor | None,
        causal: bool,
        cache: Cache | None = None,
    ) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, causal, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def set_attention_backend(self, backend: str) -> Transformer:
        if backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention backend must be one of {ATTENTION_BACKENDS}, got {backend!r}")
        for layer in self.layers:
            layer.self_attn.backend = backend
        return self

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor | None = None,
        cache: Cache | None = None,
        last_only: bool = False,
        tree_mask: Tensor | None = None,
        return_hidden: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Logits (B, T, vocab) for input_ids (B, T); (B, 1, vocab) with ``last_only``.

        ``positions`` (B, T) gives each token's position, -1 for left padding; by default the
        tokens continue the cache (or start at 0). With a cache, the new keys and values are
        written into it and the queries attend to everything cached so far.

        ``tree_mask`` bool (T, T) or (B, T, T) further restricts which of the new tokens each
        new token sees (row i: may token i see token j), for verifying several candidate
        continuations in one pass (tree attention). It needs a cache that returns the new
        keys last (``in_order``), a static cache (``core.compiled``) or no cache.
        ``return_hidden`` also returns the final normed hidden states (B, T, D) that the LM head
        reads (extra heads such as Medusa's read them too).
        """
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (batch, seq_len), got shape {tuple(input_ids.shape)}")
        B, T = input_ids.shape
        start = cache.length if cache is not None else 0
        if start + T > self.config.max_seq_len:
            raise ValueError(
                f"sequence of {start + T} tokens exceeds the context length max_seq_len={self.config.max_seq_len}"
            )
        implicit = positions is None
        if implicit:
            positions = torch.arange(start, start + T, device=input_ids.device).expand(B, T)
        k_pos = cache.reserve(positions) if cache is not None else positions
        window = _narrowest(self.config.sliding_window, cache.window if cache is not None else None)
        in_order = cache is None or cache.in_order
        mask, causal = None, False
        if implicit and window is None and in_order and tree_mask is None and (T == 1 or start == 0):
            causal = T > 1  # contiguous tokens from 0, or one token that sees the whole cache
        else:
            mask = attention_mask(positions, k_pos, window)
        if tree_mask is not None:
            if tree_mask.shape[-2:] != (T, T):
                raise ValueError(f"tree_mask must be ({T}, {T}) for {T} new tokens, got {tuple(tree_mask.shape)}")
            if in_order:  # the new keys are the last T
                mask = mask.clone()
                mask[..., -T:] &= tree_mask.to(mask.device).view(-1, 1, T, T)
            elif hasattr(cache, "place_new"):  # a static cache knows which slots the new keys took
                mask = mask & cache.place_new(tree_mask)
            else:
                raise ValueError("tree_mask needs a cache that returns the new keys last (in_order)")

        x = self.embed_tokens(input_ids)  # (B, T, D)
        cos, sin = rope_cos_sin(positions, self.inv_freq, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, mask, causal, cache)
        if last_only:
            x = x[:, -1:]
        hidden = self.norm(x)
        logits = self.lm_head(hidden)
        return (logits, hidden) if return_hidden else logits

    def init_weights(self, seed: int | None = None, std: float = 0.02) -> Transformer:
        """Random initialization as in GPT-2: N(0, std), residual projections scaled by depth."""
        gen = torch.Generator(device=self.device)
        if seed is not None:
            gen.manual_seed(seed)
        residual_std = std / math.sqrt(2 * self.config.n_layers)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                elif name.endswith("bias"):
                    p.zero_()
                else:
                    s = residual_std if name.endswith(("o_proj.weight", "down_proj.weight")) else std
                    p.normal_(0.0, s, generator=gen)
        return self

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


def random_model(
    config: ModelConfig | str,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
    seed: int = 0,
) -> Transformer:
    """A model with random weights, e.g. ``random_model("Llama-3-8B", "cuda", torch.bfloat16)``.

    Speed does not depend on the weights' values, so true-size random models serve speed
    experiments. The parameters are allocated directly on ``device`` in ``dtype``.
    """
    cfg = preset(config) if isinstance(config, str) else config
    device = torch.device(device or "cpu")
    dtype = dtype or torch.float32
    with torch.device("meta"):
        model = Transformer(cfg)
    model = model.to_empty(device=device).to(dtype)
    model.inv_freq = rope_inv_freq(cfg).to(device)
    if cfg.tie_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    if device.type != "meta":  # a meta model has shapes only: handy for counting and planning
        model.init_weights(seed)
    return model.eval()
