"""Chapter 2's measurements: requests served one at a time by the real model, and TTFT by prompt
length. The times are ``generate``'s own (TTFT and each token's time); ``measure.trace`` replays
the measured timelines on a clock (``replay_fcfs``) and ``viz.serving`` draws them.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import numpy as np
import torch

from ..core.generate import generate
from ..core.model import Transformer
from ..measure.arrivals import poisson_arrivals
from ..measure.metrics import RequestMetrics
from ..measure.timing import interleaved
from ..measure.trace import Service, replay_fcfs


def measure_services(
    model: Transformer,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int | Sequence[int],
    warmup: bool = True,
) -> list[Service]:
    """Run each prompt alone (greedy, no early stop) and record when each of its tokens came out."""
    if not prompts:
        raise ValueError("no prompts")
    new_tokens = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    if len(new_tokens) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(new_tokens)} values of max_new_tokens")
    if warmup:  # the first call pays one-off costs (allocator, kernel selection) no later request pays
        generate(model, list(prompts[0]), 2, eos_token_id=None)
    services = []
    for prompt, n in zip(prompts, new_tokens):
        r = generate(model, list(prompt), n, eos_token_id=None)
        offsets = np.cumsum([r.ttft, *r.token_times]).tolist()
        services.append(Service(len(prompt), tuple(offsets)))
    return services


def run_requests(
    model: Transformer,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int | Sequence[int],
    rate: float | None = None,
    seed: int = 0,
) -> list[RequestMetrics]:
    """Measure the requests, then replay them: Poisson arrivals at ``rate`` requests/s, or all
    back to back with no queueing when ``rate`` is None."""
    services = measure_services(model, prompts, max_new_tokens)
    if rate is None:
        arrivals = np.cumsum([0.0] + [s.duration for s in services[:-1]]).tolist()
    else:
        arrivals = poisson_arrivals(len(services), rate, seed)
    return replay_fcfs(services, arrivals)


def first_token_time(model: Transformer, prompt: Sequence[int]) -> float:
    """``generate``'s TTFT (s) for ``prompt`` served alone, one new token."""
    return generate(model, list(prompt), 1, eos_token_id=None).ttft


@torch.inference_mode()
def ttft_by_prompt_length(model: Transformer, prompts: Sequence[Sequence[int]], repeats: int = 3) -> list[dict]:
    """Median TTFT (ms) of each prompt served alone, one new token. The prompts take turns (the
    timing harness, after a warm-up round), so drift on the machine hits every length alike."""
    contenders = {str(i): partial(first_token_time, model, p) for i, p in enumerate(prompts)}
    timings = interleaved(contenders, repeats, model.device, warmup=1)
    return [
        {"prompt_tokens": len(p), "ttft_ms": 1e3 * float(np.median(timings[str(i)].values))}
        for i, p in enumerate(prompts)
    ]
