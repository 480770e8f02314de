"""What a cache (or any change to a model) costs in quality: the loss and perplexity of text fed
through it, chunk by chunk, so that a cache's evictions, windows or quantization show up as a
change in perplexity (chapter 5; the compression chapter measures its models the same way).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from ..core.cache import Cache
from ..core.model import Transformer


@torch.inference_mode()
def streaming_loss(
    model: Transformer, ids: torch.Tensor, cache: Cache | None = None, chunk: int | None = None
) -> float:
    """Mean next-token loss (nats) of ``ids`` (N,) fed ``chunk`` tokens at a time through ``cache``.

    Without a cache the whole text is one forward (full attention). With one, every chunk
    sees only what the cache kept, so evictions and quantization cost what they cost.
    """
    ids = ids.to(model.device)[None]  # (1, N)
    chunk = chunk or ids.shape[1]
    total, n = 0.0, ids.shape[1] - 1
    for s in range(0, n, chunk):
        logits = model(ids[:, s : min(s + chunk, n)], cache=cache)  # (1, c, V)
        target = ids[:, s + 1 : s + 1 + logits.shape[1]]
        total += F.cross_entropy(logits[0].float(), target[0], reduction="sum").item()
    return total / n


def mean_perplexity(
    model: Transformer,
    segments: Sequence[torch.Tensor],
    make_cache: Callable[[Transformer], Cache] | None = None,
    chunk: int | None = None,
) -> float:
    """exp(mean loss) over text segments, a fresh cache from ``make_cache(model)`` for each."""
    losses = [streaming_loss(model, seg, make_cache(model) if make_cache else None, chunk) for seg in segments]
    return math.exp(sum(losses) / len(losses))
