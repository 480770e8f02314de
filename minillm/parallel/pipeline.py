"""Pipeline parallelism: each of p ranks holds a run of consecutive layers (GPipe, Huang et al. 2019).

Rank s of p (a *stage*) holds layers ``split_layers(n_layers, p)[s]``; the first stage also holds
the embedding, the last the final norm and the LM head (with tied embeddings the last stage
reads ``embed_tokens.weight`` as its head). A forward pass is a relay: stage s receives the
hidden states (rows, tokens, dim) from stage s - 1, runs its layers and sends the result to
stage s + 1. Nothing else crosses a boundary: every stage knows the prompts, so it rebuilds the
positions (and from them the attention mask and the rotary angles) itself.

A relay of one batch keeps one stage busy at a time. GPipe cuts the batch into m micro-batches
that follow each other through the stages, so that stage s works on micro-batch i while stage
s + 1 works on micro-batch i - 1. With equal stages of time t, the pass takes (m + p - 1) t, of
which each stage is busy m t: the *bubble*, the fraction of the span a stage is idle, is

    bubble(p, m) = (p - 1) / (m + p - 1),

small only when m >> p. ``pipeline_generate`` records every stage's compute intervals, so the
bubble is measured (``measured_bubble``) and can be compared with the formula
(``bubble_fraction``).

What crosses the boundaries per forward pass is one activation per boundary per micro-batch,
rows x tokens x dim x bytes (``pipeline_bytes``): for prefill T = the padded prompt length, for
a decode step T = 1. Per decode step, the last stage picks the next token of every row and
sends those B ids (int64) back to the first stage in one message: the first stage embeds them.
Every send and receive goes through a counted ``Comm``, and the tests check the counts against
that formula exactly.

Decoding here is a GPipe flush per step: all m micro-batches of step n go through the pipeline,
then the tokens return and step n + 1 starts, so each step has the same bubble as prefill. (A
schedule in which micro-batch i starts its next step as soon as its own token is back, as
serving engines do, would hide the bubble once m >= p, but with blocking sends on a ring it can
deadlock: the last stage sending tokens while the first is still sending activations.)

Each stage (``parallel.stage``: its layers, loaded from the checkpoint alone) keeps one KV cache
per micro-batch, holding only its own layers: a ``StageKVCache`` of len(layers) layers that maps
the model's global layer index to its own.

Batches of ragged prompts are left-padded once for the whole batch, exactly as
``minillm.generate`` does (padding has position -1 and is never attended to), then cut into
micro-batches of consecutive rows, so each row sees exactly what it sees in ``generate``.
Generation is greedy and always makes ``max_new_tokens`` tokens (no early stop at EOS).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from ..core.checkpoints import read_config, resolve
from ..core.config import ModelConfig
from ..core.device import synchronize
from ..core.generate import check_request, left_pad
from ..core.prompts import token_rows
from .comm import Comm
from .launch import check_world_size, launch, rank_device
from .stage import Stage, balanced_ranges, check_pipeline

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TOKEN_DTYPE = torch.long  # the ids sent back from the last stage to the first


def bubble_fraction(stages: int, micro_batches: int) -> float:
    """GPipe's idle fraction of each stage over a pass: (p - 1) / (m + p - 1)."""
    check_world_size(stages, "stages")
    check_world_size(micro_batches, "micro_batches")
    return (stages - 1) / (micro_batches + stages - 1)


# ---------------------------------------------------------------------------------------------
# Running the pipeline


@dataclass(frozen=True)
class PipelineSpec:
    """One pipelined generation: checkpoint, prompts (lists of ids), tokens to make, micro-batches."""

    model_dir: str
    prompts: tuple[tuple[int, ...], ...]
    max_new_tokens: int
    micro_batches: int = 1
    dtype: str = "float32"
    device: str = "cpu"

    def __post_init__(self) -> None:
        if not isinstance(self.model_dir, (str, Path)):
            raise ValueError(f"model_dir must be a path or a bundled model's name, got {self.model_dir!r}")
        object.__setattr__(self, "model_dir", str(self.model_dir))
        object.__setattr__(self, "prompts", tuple(tuple(r) for r in token_rows(list(map(list, self.prompts)))))
        m = self.micro_batches
        if isinstance(m, bool) or not isinstance(m, int) or not 1 <= m <= len(self.prompts):
            raise ValueError(f"micro_batches must be an integer in [1, {len(self.prompts)}] (the prompts), got {m!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def prompt_len(self) -> int:
        return max(len(p) for p in self.prompts)


@dataclass
class Interval:
    """One stage's compute on one micro-batch (seconds from the start barrier)."""

    phase: str  # "prefill" or "decode"
    step: int  # 0 for prefill, n for the n-th decode step
    micro_batch: int
    start: float
    end: float


@dataclass
class StageResult:
    """What one rank returns. ``tokens`` (B lists of ids) and ``logits`` (B, V) only from the last."""

    rank: int
    layers: range
    timeline: list[Interval]
    counts: dict[str, dict[str, int]]
    tokens: list[list[int]] | None = None
    logits_array: np.ndarray | None = None  # (B, V) fp32
    kv_bytes: int = 0  # this stage's KV caches, all micro-batches

    @property
    def logits(self) -> Tensor | None:
        """The prefill's last-position logits (B, V), a CPU tensor (last stage only).

        Kept as an array inside: ``launch`` returns results through a torch multiprocessing
        queue, which would share a tensor through a file descriptor of the rank's process,
        gone once the rank exits."""
        return None if self.logits_array is None else torch.from_numpy(self.logits_array)


def micro_batch_rows(batch_size: int, micro_batches: int) -> list[range]:
    """The rows of each micro-batch: consecutive, balanced."""
    return balanced_ranges(batch_size, micro_batches)


def relay_micro_batch(
    stage: Stage, comm: Comm, x: Tensor, positions, cache, rows: int, T: int, timeline, phase, step, mb
):
    """One micro-batch through this stage.

    Receive (unless first), compute, send (unless last)."""
    s, D = stage.stage, stage.config.dim
    if not stage.is_first:
        x = comm.recv((rows, T, D), stage.dtype, s - 1, stage.device)  # (rows, T, D)
    start = time.perf_counter()
    out = stage(x, positions, cache)
    synchronize(stage.device)  # on a GPU, the interval ends when the work does
    end = time.perf_counter()
    timeline.append((phase, step, mb, start, end))
    if not stage.is_last:
        comm.send(out, s + 1)
    return out


@torch.inference_mode()
def pipeline_generate(rank: int, world: int, spec: PipelineSpec) -> StageResult:
    """Rank function (run under ``launch``): stage ``rank`` of ``world`` prefills and greedily
    decodes ``spec.max_new_tokens`` tokens of every prompt with GPipe micro-batches."""
    device = rank_device(spec.device, rank)
    stage = Stage.from_checkpoint(spec.model_dir, rank, world, spec.torch_dtype, device)
    comm = Comm()
    B, P, N = len(spec.prompts), spec.prompt_len, spec.max_new_tokens
    ids, positions = left_pad(spec.prompts, 0, device)  # the pad id is never seen (position -1)
    padded = any(len(p) != P for p in spec.prompts)
    mbs = micro_batch_rows(B, spec.micro_batches)
    caches = [stage.new_cache(len(r), P + N) for r in mbs]
    timeline: list[tuple] = []
    out = torch.zeros(B, N, dtype=TOKEN_DTYPE, device=device)
    logits0 = None

    dist.barrier()  # carries no payload; the clocks (CLOCK_MONOTONIC, shared by the ranks) start here
    t0 = time.perf_counter()
    token = None
    for step in range(N):
        if step == 0:
            xs = [ids[r.start : r.stop] for r in mbs]  # (rows, P) each
        else:
            positions = positions[:, -1:] + 1  # (B, 1): each row continues from its own length
            if stage.is_first and not stage.is_last:
                token = comm.recv((B,), TOKEN_DTYPE, world - 1, device)  # (B,) from the last stage
            xs = [token[r.start : r.stop, None] for r in mbs] if stage.is_first else [None] * len(mbs)
        pos = [positions[r.start : r.stop] if padded else None for r in mbs]
        T = P if step == 0 else 1
        phase = "prefill" if step == 0 else "decode"
        results = [
            relay_micro_batch(stage, comm, xs[i], pos[i], caches[i], len(r), T, timeline, phase, step, i)
            for i, r in enumerate(mbs)
        ]
        if stage.is_last:
            logits = torch.cat(results, dim=0)  # (B, V)
            if step == 0:
                logits0 = logits.float().cpu()
            token = logits.argmax(dim=-1)  # (B,)
            out[:, step] = token
            if step + 1 < N and not stage.is_first:
                comm.send(token, 0)
    return StageResult(
        rank=rank,
        layers=stage.layer_ids,
        timeline=[Interval(ph, st, mb, a - t0, b - t0) for ph, st, mb, a, b in timeline],
        counts=comm.counts(),
        tokens=out.cpu().tolist() if stage.is_last else None,
        logits_array=None if logits0 is None else logits0.numpy(),
        kv_bytes=sum(c.nbytes for c in caches),
    )


def pipeline_generate_all(rank: int, world: int, specs: tuple[PipelineSpec, ...]) -> list[StageResult]:
    """Rank function: ``pipeline_generate`` for each spec in turn, in one launch."""
    return [pipeline_generate(rank, world, spec) for spec in specs]


def check_spec(spec: PipelineSpec, stages: int) -> ModelConfig:
    """Every check that can be made before a process starts: the split and the request."""
    config, _ = read_config(resolve(spec.model_dir))
    check_pipeline(config, stages)
    check_request([list(p) for p in spec.prompts], spec.max_new_tokens, config)
    return config


def run_pipeline(
    specs: PipelineSpec | Sequence[PipelineSpec], stages: int, timeout: float = 60.0, device: str = "cpu"
) -> list[list[StageResult]]:
    """Check every spec, then launch ``stages`` ranks once; for each spec, its results in rank order."""
    specs = (specs,) if isinstance(specs, PipelineSpec) else tuple(specs)
    check_world_size(stages, "stages")
    for spec in specs:
        check_spec(spec, stages)
    by_rank = launch(pipeline_generate_all, stages, specs, timeout=timeout, device=device)
    return [[by_rank[r][i] for r in range(stages)] for i in range(len(specs))]


# ---------------------------------------------------------------------------------------------
# Formulas and measurements


def pipeline_bytes(
    config: ModelConfig,
    batch_size: int,
    prompt_len: int,
    max_new_tokens: int,
    micro_batches: int,
    stages: int,
    dtype: torch.dtype = torch.float32,
) -> dict:
    """What ``pipeline_generate`` sends across the stage boundaries.

    Per forward pass (the prefill of T = prompt_len tokens, then max_new_tokens - 1 decode
    steps of T = 1) every boundary carries every micro-batch's activation, rows x T x dim x
    bytes: B x T x dim x bytes per boundary in all, in ``micro_batches`` messages. After every
    step but the last, B token ids (int64) go from the last stage to the first. Every byte
    sent is received once, so ``total`` is both the sum of the ranks' "send" bytes and of
    their "recv" bytes. ``per_rank_send``: stage s < p - 1 sends its boundary's activations,
    the last stage the tokens."""
    p, N = stages, max_new_tokens
    elem = torch.empty((), dtype=dtype).element_size()
    token_elem = torch.empty((), dtype=TOKEN_DTYPE).element_size()
    per_boundary = batch_size * (prompt_len + (N - 1)) * config.dim * elem
    token_bytes = (N - 1) * batch_size * token_elem if p > 1 else 0
    per_rank = [per_boundary] * (p - 1) + [token_bytes]
    return {
        "activation_bytes": (p - 1) * per_boundary,
        "token_bytes": token_bytes,
        "total": (p - 1) * per_boundary + token_bytes,
        "per_rank_send": per_rank,
        "per_rank_send_calls": [micro_batches * N] * (p - 1) + [N - 1 if p > 1 else 0],
    }


def measured_bubble(timelines: Sequence[Sequence[Interval]], phase: str = "prefill", step: int = 0) -> dict:
    """The idle fraction of each stage over one pass (``phase``, ``step``), from the recorded intervals.

    The span runs from the first stage's first compute start to the last stage's last compute
    end (over all ranks); each stage's idle fraction is 1 - (its compute time) / span. GPipe's
    formula assumes equal stages and free communication: the first and last stages here also
    embed and score, and the sends take time, so the measured values scatter around it."""
    passes = [[iv for iv in tl if iv.phase == phase and iv.step == step] for tl in timelines]
    if any(not ivs for ivs in passes):
        raise ValueError(f"some rank recorded no interval of {phase} step {step}")
    begin = min(iv.start for ivs in passes for iv in ivs)
    span = max(iv.end for ivs in passes for iv in ivs) - begin
    idle = [1.0 - sum(iv.end - iv.start for iv in ivs) / span for ivs in passes]
    return {"per_stage": idle, "mean": sum(idle) / len(idle), "span_s": span}
