"""The decode step every section of the GPU check times, written once: what it reads, its CUDA
graph and its timer.

A step is ``step(token (B, 1), position (B, 1)) -> next token (B, 1)``, greedy, over a
``core.compiled.StaticCache`` (a fixed-size cache, which a CUDA graph needs). ``decode_step``
builds one for a model; ``cuda_graphed`` captures it as one CUDA graph; ``median_step_seconds``
times it: each step alone with the device synchronized around it (``timing.timed``), the median
over ``steps`` after a warm-up. The median keeps one slow step (a clock change, another tenant)
out. The synchronization costs a graphed step little (an 8B step takes milliseconds), but it
also keeps an eager step's CPU launches from overlapping the GPU's work of the step before, as
they would in a run of steps: eager figures are, if anything, pessimistic. Every section records
``TIMER`` beside its figures, since GPU results saved before used runs of steps.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch
from torch import Tensor

from ..compression import model_bytes
from ..core.compiled import StaticCache
from ..core.model import Transformer
from ..measure.timing import timed

Step = Callable[[Tensor, Tensor], Tensor]
WARMUP = 3
TIMER = f"median of single steps, each synchronized, after {WARMUP} warm-up steps"


def decode_step(model: Transformer, batch: int, max_len: int) -> tuple[Step, StaticCache]:
    """A greedy step of ``model`` over a fresh static cache of ``max_len`` slots, and the cache."""
    cache = StaticCache(model.config, batch, max_len, model.dtype, model.device)

    @torch.no_grad()
    def step(token: Tensor, position: Tensor) -> Tensor:
        return model(token, position, cache.view)[:, -1].argmax(-1, keepdim=True)

    return step, cache


def decode_bytes(model: Transformer, cache: StaticCache) -> int:
    """Bytes one decode step reads: every stored weight once (of the embedding only the looked-up
    rows, unless the LM head shares it) and the whole fixed-size cache."""
    embed = model.embed_tokens.weight
    head = getattr(model.lm_head, "weight", None)
    shared = head is not None and head.data_ptr() == embed.data_ptr()
    unread = 0 if shared else embed.nbytes - cache.batch_size * embed[0].nbytes
    return model_bytes(model) - unread + cache.nbytes


def median_step_seconds(step: Step, batch: int, steps: int, device, warmup: int = WARMUP) -> float:
    """The median seconds of one greedy step from token 0 at position 0, each step timed alone;
    the cache needs ``warmup + steps`` slots."""
    token = torch.zeros(batch, 1, dtype=torch.long, device=device)
    seconds = []
    for position in range(warmup + steps):
        pos = torch.full((batch, 1), position, device=device)
        elapsed, token = timed(lambda t=token, p=pos: step(t, p).clone(), device)
        if position >= warmup:
            seconds.append(elapsed)
    return statistics.median(seconds)


def cuda_graphed(step: Step, batch: int) -> Step:
    """The step captured once as a CUDA graph: a replay launches all its kernels in one call.
    The inputs are copied into the captured buffers; the returned tensor is overwritten by the
    next replay (the caller clones it)."""
    token = torch.zeros(batch, 1, dtype=torch.long, device="cuda")
    position = torch.zeros(batch, 1, dtype=torch.long, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up on a side stream, as capture wants
        for _ in range(2):
            step(token, position)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(token, position)

    def replay(t: Tensor, p: Tensor) -> Tensor:
        token.copy_(t)
        position.copy_(p)
        graph.replay()
        return out

    return replay
