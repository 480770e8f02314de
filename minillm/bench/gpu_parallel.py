"""The tensor-parallel section of the GPU check (``minillm.bench.gpu`` runs it): with one GPU,
multi-GPU tensor parallelism cannot run, but its compute part can be measured.

A rank of a tp-way split (Megatron-LM, Shoeybi et al. 2019) holds the shapes of
``parallel.tensor.local_config(config, tp)``: 1/tp of the query and key/value heads and of the
MLP's hidden units, with the whole vocabulary (a replicated LM head) and the same number of
layers. A random model of exactly those shapes, in bf16 on this GPU, decodes as that rank
would, minus the all-reduces. So, for tp = 1, 2, 4, 8 of Llama-2-7B:

    step(tp) = measured shard step (compute)  +  2 n_layers x allreduce(dim x 2 bytes, tp, link)
                                                  (predicted, ``predict.allreduce_seconds``)

and the predicted multi-GPU speedup is step(1) / step(tp), beside gpt-fast's published
speedups (8 x A100, NVLink; ``predict.PUBLISHED_TP_SPEEDUPS``). What the measurement shows that
the bandwidth arithmetic alone does not: the weight bytes fall as 1/tp, but everything per layer
that does not shrink (kernel launches, norms, the replicated head) stays, so the speedup bends
below tp even before any communication. The steps are timed eagerly and as one CUDA graph each
(``gpu_decode.cuda_graphed``, what gpt-fast's compiled decode also removes); the graphed
time is the one the prediction uses when there is one.

Each step is timed alone, the device synchronized around it, and the median over ``steps``
steps is reported (``gpu_decode.median_step_seconds``, the check's one decode timer). The K/V of
``context`` tokens is read by every step (``core.compiled.StaticCache``: a fixed-size cache,
which CUDA graphs need).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Sequence

import torch

from ..core.config import ModelConfig, preset
from ..core.model import random_model
from ..parallel.predict import TP_LINKS, allreduce_seconds, published_speedups, tp_all_reduces_per_forward
from ..parallel.tensor import check_tensor_parallel, local_config
from .gpu_decode import TIMER, WARMUP, cuda_graphed, decode_bytes, decode_step, median_step_seconds

MODEL = "Llama-2-7B"
TPS = (1, 2, 4, 8)
LINKS = ("NVLink 3 (A100)", "NVLink 4 (H100)")


def shard_row(config: ModelConfig, tp: int, device, dtype, context: int, steps: int, graphed: bool) -> dict:
    """One rank's shard of a tp-way split: its parameters, the bytes a step reads, the median
    step time eagerly (and CUDA-graphed) and the bandwidth that reached. The model is freed
    before this returns."""
    model = random_model(local_config(config, tp), device, dtype)
    try:
        return {"tp": tp, **_measure_shard(model, context, steps, graphed)}
    finally:
        del model
        gc.collect()
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()


def _measure_shard(model, context: int, steps: int, graphed: bool) -> dict:
    step, cache = decode_step(model, 1, context)
    row = {
        "params": sum(p.numel() for p in model.parameters()),
        "bytes_per_step": decode_bytes(model, cache),
        "eager_ms": 1e3 * median_step_seconds(step, 1, steps, model.device),
    }
    if graphed:
        row["graphed_ms"] = 1e3 * median_step_seconds(cuda_graphed(step, 1), 1, steps, model.device)
    row["compute_ms"] = row.get("graphed_ms", row["eager_ms"])
    row["GB_s"] = row["bytes_per_step"] / (row["compute_ms"] / 1e3) / 1e9
    return row


def predicted_rows(config: ModelConfig, shards: Sequence[dict], links: Sequence[str] = LINKS, dtype_bytes=2) -> list:
    """Measured compute of each shard plus the predicted all-reduces of its step over each link;
    the speedup over the 1-GPU shard, and gpt-fast's published one where the model has it."""
    measured = {r["tp"]: r["compute_ms"] / 1e3 for r in shards if "compute_ms" in r}
    if 1 not in measured:
        return []
    published = published_speedups(config.name) if config.name == "Llama-2-7B" else {}
    rows = []
    for name in links:
        link = TP_LINKS[name]
        for tp, compute_s in measured.items():
            per_call = allreduce_seconds(config.dim * dtype_bytes, tp, link)  # one token's hidden vector
            comm_s = tp_all_reduces_per_forward(config) * per_call if tp > 1 else 0.0
            rows.append(
                {
                    "link": name,
                    "tp": tp,
                    "compute_ms": 1e3 * compute_s,
                    "comm_ms": 1e3 * comm_s,
                    "step_ms": 1e3 * (compute_s + comm_s),
                    "compute_speedup": measured[1] / compute_s,
                    "predicted_speedup": measured[1] / (compute_s + comm_s),
                    "published_speedup": published.get(tp),
                }
            )
    return rows


def tp_shard_decode(
    deadline: float,
    out: dict,
    device: str = "cuda",
    model_config: ModelConfig | str = MODEL,
    tps: Sequence[int] = TPS,
    dtype: torch.dtype = torch.bfloat16,
    context: int = 256,
    steps: int = 32,
    graphed: bool | None = None,
) -> None:
    """Fill ``out`` with one row per tp (stopping at ``deadline``, time.monotonic) and the
    predicted speedups; ``device``, ``model_config`` and ``dtype`` let a test run it small on a CPU
    (CUDA graphs only on CUDA)."""
    config = preset(model_config) if isinstance(model_config, str) else model_config
    for tp in tps:
        check_tensor_parallel(config, tp)
    if WARMUP + steps > context:  # the warm-up and timed steps each take one slot of the fixed cache
        raise ValueError(f"context ({context}) must hold the {WARMUP} warm-up and {steps} timed steps")
    device = torch.device(device)
    graphed = device.type == "cuda" if graphed is None else graphed
    out.update(
        model=f"{config.name} shards (random weights)",
        dtype=str(dtype).removeprefix("torch."),
        batch=1,
        context=context,
        steps=steps,
        timer=TIMER,
        note="compute of one tensor-parallel rank, measured on one GPU; the all-reduces are predicted",
    )
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info()
        need = config.num_params() * torch.empty((), dtype=dtype).element_size() * 1.2
        if free < need:
            out["skipped"] = f"needs ~{need / 1e9:.0f} GB free for {config.name}, {free / 1e9:.1f} GB free"
            return
    rows = out["shards"] = []
    for tp in tps:
        if time.monotonic() > deadline:
            rows.append({"tp": tp, "skipped": "time budget"})
            continue
        rows.append(shard_row(config, tp, device, dtype, context, steps, graphed))
    out["predicted"] = predicted_rows(config, rows, dtype_bytes=torch.empty((), dtype=dtype).element_size())
