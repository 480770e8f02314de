"""What tensor parallelism should buy: the bytes it sends, and a roofline model of one decode step.

Bytes. Megatron-style tensor parallelism (Shoeybi et al., 2019) costs two all-reduces per layer,
each of the (tokens, d_model) partial sums of o_proj and down_proj, so one forward over
``tokens`` rows (batch x new tokens) moves

    payload = 2 x n_layers x tokens x d_model x bytes per element

into all-reduces, plus, with a vocabulary-parallel LM head, one all-gather of the logits
(tokens x vocab x bytes, counted as the gathered size). That is what ``Comm`` counts, so the
tests can hold the two equal. A ring all-reduce (Patarasuk & Yuan, 2009) puts 2 (p - 1) / p of
the payload through each rank's link (``comm.wire_bytes``).

Time. Batch-1 decode is bound by memory bandwidth: each step reads every weight once. Split over
p GPUs, each reads 1/p of the layers' weights (plus what stays replicated: the LM head, the
norms, and K/V heads when there are fewer of them than ranks), so the reading shrinks by about p.
What does not shrink is the rest:

    step = max(bytes per GPU / (W x memory_efficiency), FLOPs per GPU / (P x compute_efficiency))
         + n_layers x layer_overhead                   (launches, norms, RoPE: fixed per layer)
         + 2 x n_layers x (base + 2 (p - 1) x hop latency + wire bytes / link bandwidth)

The all-reduce term is NCCL's own cost model for a ring all-reduce on the low-latency (LL)
protocol (``src/graph/tuning.cc``: a base latency of 6.6 us plus 0.47 us per ring step over
NVLink, 1.0 us over PCIe; 2 (p - 1) steps). At batch 1 the payload is 8 KB, so the latency
terms decide and the link's bandwidth hardly matters; at large batches and in prefill the
payload grows with the tokens and the bandwidth term takes over, which is where PCIe loses.

Calibration. gpt-fast (PyTorch team, 2023) published Llama-2-7B at batch 1 on 8 A100-80GB
(power-limited to 330 W) with 1, 2, 4, 8 GPUs: 104.9, 168.84, 254.02, 328.43 tokens/s. Its
README says the card's bandwidth peaks near 1700 GB/s in practice (0.83 of the datasheet's
2039); with that, the 1-GPU figure leaves a fixed overhead of about 55 us per layer per step,
which ``calibrate_layer_overhead`` recovers. The 2-, 4- and 8-GPU speedups are then predicted,
not fitted (``tp_speedup_rows``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ..core.config import ModelConfig, check_positive_int, is_number, preset
from ..measure.links import LINKS, Link
from ..measure.roofline import DATASHEETS, Accelerator
from .comm import wire_bytes
from .tensor import check_tensor_parallel, local_config

# NCCL's cost model of a ring all-reduce, LL protocol (src/graph/tuning.cc; bibtex nccl_tuning)
NCCL_BASE_LATENCY_S = 6.6e-6  # per collective
NCCL_NVLINK_HOP_S = 0.47e-6  # per ring step over NVLink
NCCL_PCIE_HOP_S = 1.0e-6  # per ring step over PCIe

# The links a tensor-parallel group uses, each with NCCL's per-step latency as its ``latency``.
# A100's third-generation NVLink: 12 links, 600 GB/s both directions together (nvidia_a100_datasheet).
TP_LINKS: dict[str, Link] = {
    link.name: link
    for link in [
        Link("NVLink 3 (A100)", 300e9, NCCL_NVLINK_HOP_S, "nvidia_a100_datasheet"),
        dataclasses.replace(LINKS["NVLink 4 (H100)"], latency=NCCL_NVLINK_HOP_S),
        dataclasses.replace(LINKS["PCIe 4.0 x16"], latency=NCCL_PCIE_HOP_S),
        dataclasses.replace(LINKS["PCIe 5.0 x16"], latency=NCCL_PCIE_HOP_S),
    ]
}

# gpt-fast's README (pytorch-labs/gpt-fast; bibtex gptfast2023, gptfast_readme): batch 1, a
# 5-token prompt, 8 x A100-80GB power-limited to 330 W, "hybrid cube mesh" NVLink topology.
PUBLISHED_TP_SPEEDUPS: dict[str, dict] = {
    "Llama-2-7B": {
        "accelerator": "A100-80GB-SXM",
        "link": "NVLink 3 (A100)",
        "source": "gptfast_readme",
        "tokens_per_s": {1: 104.9, 2: 168.84, 4: 254.02, 8: 328.43},
    },
    "Llama-2-70B": {  # does not fit one 80 GB card: speedups are relative to 2 GPUs
        "accelerator": "A100-80GB-SXM",
        "link": "NVLink 3 (A100)",
        "source": "gptfast_readme",
        "tokens_per_s": {2: 21.32, 4: 38.01, 8: 62.50},
    },
}
GPT_FAST_BANDWIDTH = 1700e9  # bytes/s, "empirically ... peak bandwidth is about 1700 GB/s" (gpt-fast README)


def published_speedups(model: str) -> dict[int, float]:
    """{GPUs: tokens/s over tokens/s on the fewest GPUs published} for a model of
    ``PUBLISHED_TP_SPEEDUPS``."""
    tps = PUBLISHED_TP_SPEEDUPS[model]["tokens_per_s"]
    base = tps[min(tps)]
    return {n: t / base for n, t in tps.items()}


# ---------------------------------------------------------------------------------------------
# Bytes


def tp_all_reduces_per_forward(config: ModelConfig) -> int:
    """Two per layer: after o_proj and after down_proj."""
    return 2 * config.n_layers


def tp_decode_bytes(
    config: ModelConfig,
    tokens: int,
    dtype_bytes: int,
    tp: int,
    vocab_parallel: bool = False,
    head_tokens: int | None = None,
) -> int:
    """Payload bytes one rank puts into collectives during one forward over ``tokens`` rows
    (batch x new tokens): 2 x n_layers all-reduces of tokens x dim x dtype_bytes, plus, with a
    vocabulary-parallel head, the all-gather of head_tokens x vocab x dtype_bytes logits
    (``head_tokens`` defaults to ``tokens``; one per sequence when only the last position is
    scored). 0 on one rank."""
    check_positive_int("tokens", tokens)
    check_positive_int("dtype_bytes", dtype_bytes)
    check_tensor_parallel(config, tp, vocab_parallel)
    if head_tokens is not None:
        check_positive_int("head_tokens", head_tokens)
    if tp == 1:
        return 0
    total = tp_all_reduces_per_forward(config) * tokens * config.dim * dtype_bytes
    if vocab_parallel:
        total += (tokens if head_tokens is None else head_tokens) * config.vocab_size * dtype_bytes
    return total


def rank_weight_bytes(config: ModelConfig, tp: int, dtype_bytes: int = 2, vocab_parallel: bool = False) -> int:
    """Weight bytes one rank reads in a decode step: its shard of every layer (query heads,
    key/value heads — replicated when fewer than ranks — and MLP units split, norms whole), the
    final norm, and the LM head (whole, or 1/tp of the vocabulary). The embedding table is only
    indexed, so it is not counted."""
    check_tensor_parallel(config, tp, vocab_parallel)
    c = local_config(config, tp)
    q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    layer = c.dim * (q + 2 * kv) + q * c.dim + 3 * c.dim * c.ffn_dim + 2 * c.dim
    head = config.dim * config.vocab_size // (tp if vocab_parallel else 1)
    return dtype_bytes * (config.n_layers * layer + config.dim + head)


def rank_kv_bytes(config: ModelConfig, tp: int, batch: int, context: int, dtype_bytes: int = 2) -> int:
    """K/V bytes one rank reads to attend ``batch`` sequences of ``context`` tokens."""
    return local_config(config, tp).kv_bytes(batch * context, dtype_bytes)


def rank_decode_flops(config: ModelConfig, tp: int, batch: int, context: int, vocab_parallel: bool = False) -> float:
    """FLOPs of one rank's decode step: 2 per weight per row for the matmuls, 4 x heads x context x
    head_dim per row per layer for attention."""
    weights = rank_weight_bytes(config, tp, 1, vocab_parallel)  # dtype_bytes=1: a parameter count
    c = local_config(config, tp)
    attention = 4.0 * config.n_layers * c.n_heads * context * c.head_dim
    return batch * (2.0 * weights + attention)


# ---------------------------------------------------------------------------------------------
# Time


@dataclass(frozen=True)
class PredictOptions:
    """The model's knobs; the defaults are stated rough figures, ``calibrated_options`` fits the
    one that needs a measurement."""

    memory_efficiency: float = 0.8  # fraction of the datasheet bandwidth the weight reads reach
    compute_efficiency: float = 0.6  # fraction of peak FLOP/s where a step is compute-bound
    layer_overhead_s: float = 0.0  # fixed seconds per layer per step (launches, norms, RoPE, ...)
    allreduce_base_s: float = NCCL_BASE_LATENCY_S  # fixed seconds per all-reduce
    context: int = 256  # tokens of K/V each sequence attends
    vocab_parallel: bool = False

    def __post_init__(self) -> None:
        for name in ("memory_efficiency", "compute_efficiency"):
            value = getattr(self, name)
            if not is_number(value) or not 0 < value <= 1:
                raise ValueError(f"PredictOptions.{name} must be in (0, 1], got {value!r}")
        for name in ("layer_overhead_s", "allreduce_base_s"):
            value = getattr(self, name)
            if not is_number(value) or not 0 <= value < math.inf:
                raise ValueError(f"PredictOptions.{name} must be a non-negative number of seconds, got {value!r}")
        check_positive_int("PredictOptions.context", self.context)
        if not isinstance(self.vocab_parallel, bool):
            raise ValueError(f"PredictOptions.vocab_parallel must be true or false, got {self.vocab_parallel!r}")


@dataclass(frozen=True)
class TPPrediction:
    tp: int
    memory_s: float  # reading weights and K/V at the effective bandwidth
    flops_s: float  # the FLOPs at the effective peak
    compute_s: float  # max(memory_s, flops_s): the roofline
    overhead_s: float  # n_layers x layer_overhead
    comm_s: float  # the all-reduces (and the logits' all-gather)
    total_s: float
    speedup: float  # step time on 1 GPU / step time on tp GPUs
    weight_bytes: int  # per GPU
    comm_payload_bytes: int  # per GPU, per step

    @property
    def tokens_per_s(self) -> float:
        """Per sequence: one token per step."""
        return 1.0 / self.total_s


def allreduce_seconds(payload: float, tp: int, link: Link, base_s: float = NCCL_BASE_LATENCY_S) -> float:
    """One ring all-reduce of ``payload`` bytes over ``tp`` ranks: a fixed base latency, one
    link latency per each of the 2 (tp - 1) ring steps, and the wire bytes over the bandwidth."""
    if tp == 1:
        return 0.0
    return base_s + 2 * (tp - 1) * link.latency + wire_bytes("all_reduce", payload, tp) / link.bandwidth


def _step(config, accelerator, link, tp, batch, dtype_bytes, options) -> tuple:
    o = options
    weights = rank_weight_bytes(config, tp, dtype_bytes, o.vocab_parallel)
    memory_s = (weights + rank_kv_bytes(config, tp, batch, o.context, dtype_bytes)) / (
        accelerator.bandwidth_tb_s * 1e12 * o.memory_efficiency
    )
    flops_s = rank_decode_flops(config, tp, batch, o.context, o.vocab_parallel) / (
        accelerator.tflops_16bit * 1e12 * o.compute_efficiency
    )
    per_allreduce = allreduce_seconds(batch * config.dim * dtype_bytes, tp, link, o.allreduce_base_s)
    comm_s = tp_all_reduces_per_forward(config) * per_allreduce if tp > 1 else 0.0
    if o.vocab_parallel and tp > 1:
        gathered = batch * config.vocab_size * dtype_bytes
        comm_s += o.allreduce_base_s + (tp - 1) * link.latency + wire_bytes("all_gather", gathered, tp) / link.bandwidth
    overhead_s = config.n_layers * o.layer_overhead_s
    total = max(memory_s, flops_s) + overhead_s + comm_s
    payload = tp_decode_bytes(config, batch, dtype_bytes, tp, o.vocab_parallel)
    return memory_s, flops_s, overhead_s, comm_s, total, weights, payload


def predict_tp_decode(
    config: ModelConfig,
    accelerator: Accelerator,
    link: Link,
    tp: int,
    batch: int = 1,
    dtype_bytes: int = 2,
    options: PredictOptions = PredictOptions(),
) -> TPPrediction:
    """The predicted time of one decode step (one new token for each of ``batch`` sequences) on
    ``tp`` GPUs joined by ``link``, split into memory, FLOPs, overhead and communication, and
    its speedup over the same model on one GPU (memory permitting or not)."""
    check_positive_int("batch", batch)
    check_positive_int("dtype_bytes", dtype_bytes)
    check_tensor_parallel(config, tp, options.vocab_parallel)
    memory_s, flops_s, overhead_s, comm_s, total, weights, payload = _step(
        config, accelerator, link, tp, batch, dtype_bytes, options
    )
    one_gpu = _step(config, accelerator, link, 1, batch, dtype_bytes, options)[4]
    return TPPrediction(
        tp=tp,
        memory_s=memory_s,
        flops_s=flops_s,
        compute_s=max(memory_s, flops_s),
        overhead_s=overhead_s,
        comm_s=comm_s,
        total_s=total,
        speedup=one_gpu / total,
        weight_bytes=weights,
        comm_payload_bytes=payload,
    )


def calibrate_layer_overhead(
    config: ModelConfig,
    accelerator: Accelerator,
    tokens_per_s: float,
    options: PredictOptions,
    batch: int = 1,
    dtype_bytes: int = 2,
) -> float:
    """The fixed per-layer seconds that make the 1-GPU prediction equal a measured ``tokens_per_s``
    (ValueError when the measurement is faster than the bandwidth allows)."""
    if not is_number(tokens_per_s) or not 0 < tokens_per_s < math.inf:
        raise ValueError(f"tokens_per_s must be a positive number, got {tokens_per_s!r}")
    bare = dataclasses.replace(options, layer_overhead_s=0.0)
    compute = predict_tp_decode(config, accelerator, TP_LINKS["NVLink 3 (A100)"], 1, batch, dtype_bytes, bare)
    spare = 1.0 / tokens_per_s - compute.total_s
    if spare < 0:
        raise ValueError(
            f"{tokens_per_s} tokens/s is faster than {accelerator.name} at memory_efficiency "
            f"{options.memory_efficiency} allows ({1 / compute.total_s:.1f} tokens/s)"
        )
    return spare / config.n_layers


def accelerator(name: str) -> Accelerator:
    by_name = {a.name: a for a in DATASHEETS}
    if name not in by_name:
        raise ValueError(f"unknown accelerator {name!r}; known: {', '.join(by_name)}")
    return by_name[name]


def calibrated_options(context: int = 256) -> PredictOptions:
    """gpt-fast's A100: bandwidth efficiency 1700 / 2039 GB/s (its README), and the per-layer
    overhead that its published 1-GPU Llama-2-7B rate (104.9 tokens/s) leaves."""
    a100 = accelerator("A100-80GB-SXM")
    base = PredictOptions(memory_efficiency=GPT_FAST_BANDWIDTH / (a100.bandwidth_tb_s * 1e12), context=context)
    tps = PUBLISHED_TP_SPEEDUPS["Llama-2-7B"]["tokens_per_s"][1]
    overhead = calibrate_layer_overhead(preset("Llama-2-7B"), a100, tps, base)
    return dataclasses.replace(base, layer_overhead_s=overhead)


# The setups tp_speedup_rows compares: (model, accelerator, link, GPU counts)
TP_SETUPS = (
    ("Llama-2-7B", "A100-80GB-SXM", "NVLink 3 (A100)", (1, 2, 4, 8)),
    ("Llama-2-7B", "A100-80GB-SXM", "PCIe 4.0 x16", (1, 2, 4, 8)),
    ("Llama-2-70B", "A100-80GB-SXM", "NVLink 3 (A100)", (2, 4, 8)),
    ("Llama-3-70B", "H100-SXM", "NVLink 4 (H100)", (2, 4, 8)),  # 140 GB in bf16: not one 80 GB GPU
)


def tp_speedup_rows(batch: int = 1, options: PredictOptions | None = None, setups=TP_SETUPS) -> list[dict]:
    """One row per (model, link, GPUs): predicted step time, its parts, tokens/s per sequence,
    the speedup over the fewest GPUs of the setup, whether the weights fit one GPU's memory, and
    gpt-fast's published speedup where there is one (batch 1 only, A100 + NVLink)."""
    options = calibrated_options() if options is None else options
    rows = []
    for model, accel_name, link_name, gpus in setups:
        config, accel, link = preset(model), accelerator(accel_name), TP_LINKS[link_name]
        predictions = {tp: predict_tp_decode(config, accel, link, tp, batch, options=options) for tp in gpus}
        base = predictions[min(gpus)]
        published = PUBLISHED_TP_SPEEDUPS.get(model, {})
        same_setup = published.get("link") == link_name and published.get("accelerator") == accel_name
        measured = published_speedups(model) if same_setup and batch == 1 else {}
        for tp, p in predictions.items():
            rows.append(
                {
                    "model": model,
                    "accelerator": accel_name,
                    "link": link_name,
                    "gpus": tp,
                    "batch": batch,
                    "fits": p.weight_bytes <= accel.memory_gb * 1e9,
                    "compute_ms": p.compute_s * 1e3,
                    "overhead_ms": p.overhead_s * 1e3,
                    "comm_ms": p.comm_s * 1e3,
                    "total_ms": p.total_s * 1e3,
                    "tokens_per_s": batch / p.total_s,
                    "predicted_speedup": base.total_s / p.total_s,
                    "published_speedup": measured.get(tp),
                    "relative_to_gpus": min(gpus),
                }
            )
    return rows
