"""Grouped-query attention from a multi-head model (Ainslie et al., 2023).

- ``to_gqa`` turns a multi-head model into a grouped-query one by mean-pooling the K and V
  heads of each group; n_kv_heads = 1 is multi-query attention (Shazeer, 2019).
- ``uptrain`` gives the converted model a few steps to adapt (the paper's "uptraining"), with
  the options of an ``Uptraining``; ``uptrain_curves`` records the validation perplexity of each
  K/V-head count along the way.
- ``gqa_heads`` picks the K/V-head count of "GQA" for a given number of query heads.

What it saves and costs is measured in ``minillm.bench.kv`` (bytes, decode speed) and
``minillm.measure.quality`` (perplexity).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..core.model import Transformer
from ..training.train import TrainConfig, encode_split, evaluate, fit, load_tokenizer


def to_gqa(model: Transformer, n_kv_heads: int) -> Transformer:
    """A copy of ``model`` with ``n_kv_heads`` K/V heads, each the mean of the heads of its group.

    Query head h reads K/V head h // (n_heads / n_kv_heads), so each group is a run of
    adjacent heads. n_kv_heads = 1 gives MQA; the queries and everything else are unchanged.
    """
    cfg = model.config
    check_kv_heads(n_kv_heads, cfg)
    new = Transformer(cfg.replace(n_kv_heads=n_kv_heads)).to(device=model.device, dtype=model.dtype)
    state = model.state_dict()
    H, Hkv, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    for i in range(cfg.n_layers):
        for kind in ("weight", "bias"):
            key = f"layers.{i}.self_attn.qkv_proj.{kind}"
            if key not in state:
                continue
            q, k, v = state[key].split([H * hd, Hkv * hd, Hkv * hd])
            state[key] = torch.cat([q, mean_pool_heads(k, n_kv_heads, hd), mean_pool_heads(v, n_kv_heads, hd)])
    new.load_state_dict(state)
    return new.eval()


def mean_pool_heads(w: torch.Tensor, n_groups: int, head_dim: int) -> torch.Tensor:
    """The rows of K or V heads, (heads * head_dim, ...), averaged over each group of
    adjacent heads: (n_groups * head_dim, ...)."""
    # (n_groups, heads per group, head_dim, ...) -> the mean over each group's heads
    return w.view(n_groups, -1, head_dim, *w.shape[1:]).mean(dim=1).flatten(0, 1)


def check_kv_heads(n_kv_heads: int, config) -> None:
    """``n_kv_heads`` must divide the model's K/V heads (each new head pools a whole group)."""
    if isinstance(n_kv_heads, bool) or not isinstance(n_kv_heads, int) or n_kv_heads <= 0:
        raise ValueError(f"n_kv_heads must divide the model's {config.n_kv_heads} K/V heads, got {n_kv_heads!r}")
    if config.n_kv_heads % n_kv_heads:
        raise ValueError(f"n_kv_heads must divide the model's {config.n_kv_heads} K/V heads, got {n_kv_heads}")


@dataclass
class Uptraining:
    """A short continued pretraining on the bundled corpus, validated on construction."""

    steps: int = 200  # optimizer steps
    seq_len: int = 128  # tokens per training window
    batch_size: int = 8  # windows per step
    lr: float = 5e-4  # peak learning rate (warm-up over the first tenth, then cosine decay)
    seed: int = 0
    eval_every: int | None = None  # steps between validation losses (default: only at the end)

    def __post_init__(self):
        for name in ("steps", "seq_len", "batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.eval_every is not None and (not isinstance(self.eval_every, int) or self.eval_every < 1):
            raise ValueError(f"eval_every must be a positive integer or None, got {self.eval_every!r}")
        if not self.lr > 0:
            raise ValueError(f"lr must be positive, got {self.lr!r}")

    def train_config(self) -> TrainConfig:
        return TrainConfig(
            steps=self.steps,
            batch_size=self.batch_size,
            seq_len=self.seq_len,
            lr=self.lr,
            warmup=max(1, self.steps // 10),
            eval_every=self.eval_every or self.steps,
            seed=self.seed,
        )


def uptrain(
    model: Transformer, options: Uptraining, valid_ids: torch.Tensor | None = None, progress: bool = False
) -> dict:
    """Continue training ``model`` on the bundled corpus (the GQA paper's "uptraining").
    Returns fit's log; with ``valid_ids``, the validation loss every ``options.eval_every`` steps."""
    ids = encode_split(load_tokenizer(), "train")
    return fit(model, options.train_config(), ids, valid_ids, progress)


def uptrain_curves(
    model: Transformer,
    kv_heads: Sequence[int],
    options: Uptraining,
    valid_ids: torch.Tensor,
    progress: bool = True,
) -> dict[int, list[tuple[int, float]]]:
    """Validation perplexity during uptraining of each K/V-head count (the model's own count is the
    control: the same extra training without the conversion). {n_kv_heads: [(step, ppl), ...]}."""
    for n in kv_heads:  # fail in a second, not after training the first variants
        check_kv_heads(n, model.config)
    curves = {}
    for n in kv_heads:
        variant = to_gqa(model, n)
        start = evaluate(variant, valid_ids, options.seq_len)
        log = uptrain(variant, options, valid_ids, progress)
        curves[n] = [(0, math.exp(start))] + [(s, math.exp(loss)) for s, loss in log["valid_loss"]]
    return curves


def gqa_heads(n_heads: int, ratio: int = 4) -> int:
    """The divisor of n_heads nearest n_heads / ratio (more than 1 K/V head where possible)."""
    divisors = [d for d in range(2, n_heads) if n_heads % d == 0] or [1]
    return min(divisors, key=lambda d: (abs(d - n_heads / ratio), d))
