"""The composed engine's section of the GPU check (``minillm.bench.gpu`` runs it): chapter 13's
engine on a random-weight Llama-3-8B-shaped model in bf16, eager against ``EngineConfig(compile=
True)``: decode steps padded to a batch bucket, captured as a CUDA graph per bucket, the
attention reading the paged KV through the Triton paged-decode kernel (``serving.compiled_step``).

The same eight requests (64 random prompt tokens, 32 greedy tokens each) go through both engines
twice; the second run is timed (the first compiles the one bucket they use: eight requests of
one length decode together to the end). The figures: each engine's median decode step (steps of
decode rows only, from its step log), tokens per second over the run, the compiled step's
speedup, and whether the greedy tokens agree (bf16: a near tie may flip a token, so the share of
tokens that agree is reported, not asserted).
"""

from __future__ import annotations

import statistics
import time

import torch

from ..core.device import synchronize
from ..core.model import random_model
from ..serving.engine import Engine, EngineConfig
from ..serving.scheduler import SchedulerConfig
from ..serving.workload import Request

MODEL = "Llama-3-8B"


def decode_step_ms(engine: Engine) -> float:
    """The median duration of the engine's steps that fed decode rows only."""
    steps = [r.duration for r in engine.step_log if r.prefill_tokens == 0 and r.decode_rows > 0]
    return 1e3 * statistics.median(steps)


@torch.inference_mode()
def composed_engine(
    deadline: float,
    out: dict,
    device: str = "cuda",
    model_config=MODEL,
    dtype: torch.dtype = torch.bfloat16,
    batch: int = 8,
    prompt_len: int = 64,
    new_tokens: int = 32,
) -> None:
    """Fill ``out`` (see the module's docstring); ``device`` and ``model_config`` let a test run it
    small on a CPU."""
    model = random_model(model_config, torch.device(device), dtype)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, model.config.vocab_size, (prompt_len,), generator=g).tolist() for _ in range(batch)]
    out.update(
        model=f"{model.config.name} (random weights)",
        dtype=str(dtype).removeprefix("torch."),
        batch=batch,
        prompt_len=prompt_len,
        new_tokens=new_tokens,
    )
    blocks = batch * (prompt_len + new_tokens) // 16 + batch
    tokens = {}
    for name, compile in (("eager", False), ("compiled", True)):
        if time.monotonic() > deadline:
            out[name] = {"skipped": "time budget"}
            continue
        config = EngineConfig(blocks, 16, scheduler=SchedulerConfig(max_batch=batch), compile=compile)
        engine = Engine(model, config)
        t0 = time.perf_counter()
        engine.run([Request(p, new_tokens) for p in prompts])  # compiles the bucket it uses
        first = time.perf_counter() - t0
        engine.step_log.clear()
        synchronize(model.device)
        t0 = time.perf_counter()
        outs = engine.run([Request(p, new_tokens) for p in prompts])
        seconds = time.perf_counter() - t0
        tokens[name] = [o.tokens for o in outs]
        out[name] = {
            "decode_step_ms": decode_step_ms(engine),
            "tokens_per_s": batch * new_tokens / seconds,
            "first_run_s": first,
        }
        if engine.decode_step is not None:
            out[name]["attention"] = engine.decode_step.attention
            out[name]["graphs_compiled"] = len(engine.decode_step.settled)
    if {"eager", "compiled"} <= tokens.keys():
        pairs = [(a, b) for x, y in zip(tokens["eager"], tokens["compiled"]) for a, b in zip(x, y)]
        out["tokens_agree_pct"] = 100.0 * sum(a == b for a, b in pairs) / len(pairs)
        out["compiled_step_speedup"] = out["eager"]["decode_step_ms"] / out["compiled"]["decode_step_ms"]
