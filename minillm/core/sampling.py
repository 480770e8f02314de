"""Choosing the next token from logits: greedy, temperature, top-k, top-p (nucleus).

The filters are applied in the usual order: divide by the temperature, keep the k most likely
tokens, keep the smallest set whose probability reaches p, then draw from what is left.
Temperature 0 means greedy (argmax). Draws use an explicit ``torch.Generator``, so a seed
reproduces a run exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy; 1 = the model's own distribution
    top_k: int | None = None  # keep only the k most likely tokens
    top_p: float | None = None  # keep the smallest set of tokens whose probability reaches p
    seed: int | None = None

    def __post_init__(self) -> None:
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or t != t or t < 0 or t == float("inf"):
            raise ValueError(f"temperature must be a finite number >= 0, got {t!r}")
        if self.top_k is not None and (
            not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 1
        ):
            raise ValueError(f"top_k must be a positive integer or None, got {self.top_k!r}")
        if self.top_p is not None and (
            isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1
        ):
            raise ValueError(f"top_p must be in (0, 1] or None, got {self.top_p!r}")
        seed = self.seed
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63):
            raise ValueError(f"seed must be an integer in [0, 2**63) or None, got {seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generator(self, device: torch.device | str = "cpu") -> torch.Generator | None:
        if self.seed is None:
            return None
        return torch.Generator(device=device).manual_seed(self.seed)


def apply_top_k(logits: Tensor, k: int) -> Tensor:
    """Logits below the k-th largest of their row set to -inf; (..., V) -> (..., V)."""
    if k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: Tensor, p: float) -> Tensor:
    """Keep the most likely tokens until their probability reaches p; the rest -> -inf.

    The most likely token always survives, so the result is never empty.
    """
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # probability of the tokens ranked above each one
    drop_sorted = mass_before >= p
    drop = drop_sorted.scatter(-1, order, drop_sorted)  # back to vocabulary order
    return logits.masked_fill(drop, float("-inf"))


def filter_logits(logits: Tensor, params: SamplingParams) -> Tensor:
    """Temperature-scaled, top-k and top-p filtered fp32 logits (..., V)."""
    logits = logits.float() / params.temperature
    if params.top_k is not None:
        logits = apply_top_k(logits, params.top_k)
    if params.top_p is not None:
        logits = apply_top_p(logits, params.top_p)
    return logits


def probabilities(logits: Tensor, params: SamplingParams) -> Tensor:
    """The distribution the sampler draws from (..., V); one-hot on the argmax when greedy."""
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    return filter_logits(logits, params).softmax(dim=-1)


def sample(logits: Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> Tensor:
    """Next token ids (B,) from logits (B, V)."""
    if params.greedy:
        return logits.argmax(dim=-1)
    probs = filter_logits(logits, params).softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
