"""What every rank of ``bench_parallel`` runs, in its own process (``launch(parallel_rank, N,
work)``): the tensor-parallel model (``parallel.tensor``) prefills the prompt and decodes greedily,
then the GPipe pipeline (``parallel.pipeline``) does the same. Each step starts after a barrier
and is timed with ``time.perf_counter``; every byte goes through a counted ``Comm``. The rank
returns the raw records; ``bench.parallel`` turns them into figures.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from ..core.cache import KVCache
from ..parallel.comm import Comm
from ..parallel.pipeline import PipelineSpec, pipeline_generate
from ..parallel.tensor import load_tensor_parallel


@dataclass(frozen=True)
class RankWork:
    """What every rank runs: the checkpoint, the prompt, and the rounds of ``ParallelBench``."""

    model_dir: str
    prompt: tuple[int, ...]
    decode_tokens: int
    repeats: int
    warmup: int


def _timed_step(fn, *args, **kwargs):
    """fn(*args, **kwargs) after a barrier (every rank starts the step together), and its seconds
    on this rank."""
    dist.barrier()
    start = time.perf_counter()
    value = fn(*args, **kwargs)
    return value, time.perf_counter() - start


@torch.inference_mode()
def _tensor_parallel_rank(work: RankWork) -> dict:
    comm = Comm()
    model = load_tensor_parallel(work.model_dir, comm)
    prompt = torch.tensor([work.prompt])  # (1, T)
    prefill_s, decode_s = [], []
    for round_ in range(work.warmup + work.repeats):
        cache = KVCache.for_model(model, 1, len(work.prompt) + work.decode_tokens + 1)
        comm.reset()
        logits, seconds = _timed_step(model, prompt, cache=cache, last_only=True)  # (1, 1, V)
        prefill_counts = comm.counts()
        token = logits[:, -1].argmax(-1, keepdim=True)  # (1, 1)
        tokens, steps = [int(token)], []
        comm.reset()
        for _ in range(work.decode_tokens):
            logits, step_s = _timed_step(model, token, cache=cache)  # token: (1, 1) -> (1, 1, V)
            token = logits[:, -1].argmax(-1, keepdim=True)
            tokens.append(int(token))
            steps.append(step_s)
        if round_ >= work.warmup:
            prefill_s.append(seconds)
            decode_s.append(steps)
    return {
        "prefill_s": prefill_s,  # per round
        "decode_s": decode_s,  # per round, per step
        "prefill_counts": prefill_counts,
        "decode_counts": comm.counts(),  # the last round's decode steps
        "tokens": tokens,
        "local_params": sum(p.numel() for p in model.parameters()),
    }


def _pipeline_rank(rank: int, world: int, work: RankWork) -> dict:
    spec = PipelineSpec(work.model_dir, (work.prompt,), work.decode_tokens + 1)
    runs = [pipeline_generate(rank, world, spec) for _ in range(work.warmup + work.repeats)][work.warmup :]
    prefill_only = pipeline_generate(rank, world, replace(spec, max_new_tokens=1))  # the prefill's bytes alone
    return {"runs": runs, "prefill_only": prefill_only}


def parallel_rank(rank: int, world: int, work: RankWork) -> dict:
    """The rank function (``launch(parallel_rank, N, work)``): tensor parallel, then the pipeline."""
    return {"tp": _tensor_parallel_rank(work), "pp": _pipeline_rank(rank, world, work)}
