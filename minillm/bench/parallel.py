"""Chapter 15's measurements: tensor, pipeline and data parallelism of ``minillm-target`` on this
machine's CPU cores, and what the same communication would cost on GPU links.

1. ``bench_parallel`` (``python -m minillm bench parallel``): for 1, 2 and 4 ranks (processes of
   one thread each, gloo), the hand-written tensor-parallel model (``parallel.tensor``, Megatron-LM,
   Shoeybi et al. 2019) and the GPipe pipeline (``parallel.pipeline``, Huang et al. 2019) each
   prefill a 128-token prompt and decode greedily. Inside the ranks (``bench.parallel_ranks``)
   every step is timed with ``time.perf_counter`` after a barrier (the median over steps and
   repeats is reported), and every byte goes through a counted ``Comm``. Reported per scheme and
   rank count: prefill time, decode time per token, whether the tokens equal one process's
   ``generate``, and the bytes communicated per generated token, counted and by the formula:

       tensor parallel, per rank:   2 x n_layers all-reduces of dim x 4 bytes   (fp32)
       pipeline, all boundaries:    (p - 1) x dim x 4 bytes + 8 (the token id sent back)

2. The same counted collectives priced on GPU links (``predict.allreduce_seconds`` over
   ``predict.TP_LINKS``: a ring all-reduce's NCCL base latency, its 2 (p - 1) hops and the wire
   bytes over the bandwidth; a pipeline message one base latency, one hop and its bytes).
3. ``predict.tp_speedup_rows``: the predicted Llama-2-7B and Llama-3-70B tensor-parallel
   speedups, beside gpt-fast's published ones.
4. Data parallelism (``serving.replicas``): 1 and 2 whole replicas behind a router on a small
   burst of requests: requests/s and tokens/s over the wall clock, and TPOT.

On a machine of two cores, two or four ranks share those two cores, so parallel speed is not
the lesson here; correctness and communication volume are. ``python -m minillm.bench.gpu``
measures, on one GPU, the compute part of a tensor-parallel rank (``bench.gpu_parallel``).

    figures = bench_parallel(ParallelBench.quick())
    print(format_parallel(figures))
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

import numpy as np
import torch

from ..core.checkpoints import load, read_config, resolve
from ..core.config import ModelConfig, check_field_types
from ..core.generate import generate
from ..measure.links import Link
from ..measure.report import finish_provenance, format_table, provenance
from ..parallel.comm import wire_bytes
from ..parallel.context import RingSpec, causal_work, imbalance, make_layout, padded_length, ring_check
from ..parallel.expert import MoEFeedForward, ep_layer_run, expert_load, routed_all_to_all_bytes
from ..parallel.launch import launch, launch_several
from ..parallel.pipeline import (
    StageResult,
    bubble_fraction,
    check_pipeline,
    measured_bubble,
    pipeline_bytes,
)
from ..parallel.predict import NCCL_BASE_LATENCY_S, TP_LINKS, allreduce_seconds, tp_decode_bytes, tp_speedup_rows
from ..parallel.tensor import check_tensor_parallel
from ..serving.disagg import DisaggConfig
from ..serving.engine import Engine, EngineConfig
from ..serving.replicas import replica_throughput
from ..serving.scheduler import SchedulerConfig
from ..serving.workload import Request, copy_requests
from .parallel_ranks import RankWork, parallel_rank

FP32 = 4  # bytes per element: every rank here computes and communicates in fp32
GPU_LINKS = ("NVLink 3 (A100)", "NVLink 4 (H100)", "PCIe 4.0 x16")


@dataclass(frozen=True)
class ParallelBench:
    """The options of ``bench_parallel``: the model, the rank counts, the prompt and the decode
    steps timed (after ``warmup`` untimed rounds, ``repeats`` rounds), and the replicas' workload
    (``replica_requests`` requests of about ``replica_prompt_len`` tokens arriving at once, each
    generating ``replica_output`` tokens, at most ``replica_max_batch`` running per replica)."""

    model: str = "minillm-target"
    ranks: tuple[int, ...] = (1, 2, 4)
    prompt_len: int = 128
    decode_tokens: int = 32  # timed decode steps per round
    repeats: int = 5
    warmup: int = 1
    replicas: tuple[int, ...] = (1, 2)
    replica_requests: int = 16
    replica_prompt_len: int = 32
    replica_output: int = 32
    replica_max_batch: int = 4
    seed: int = 0
    timeout: float = 120.0  # seconds, each launch and every wait inside it

    def __post_init__(self) -> None:
        check_field_types(
            self,
            ints=(
                "prompt_len",
                "decode_tokens",
                "repeats",
                "replica_requests",
                "replica_prompt_len",
                "replica_output",
                "replica_max_batch",
            ),
            numbers=("timeout",),
        )
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 0:
            raise ValueError(f"ParallelBench.warmup must be a non-negative integer, got {self.warmup!r}")
        for name in ("ranks", "replicas"):
            values = getattr(self, name)
            if not values or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in values):
                raise ValueError(f"ParallelBench.{name} must be positive integers, got {values!r}")

    @classmethod
    def quick(cls, **changes) -> ParallelBench:
        """A run of seconds for tests: every part, few steps, one round, no warm-up round."""
        small = dict(decode_tokens=4, repeats=1, warmup=0, replica_requests=4, replica_prompt_len=16, replica_output=4)
        return cls(**{**small, **changes})

    def check(self) -> ModelConfig:
        """The model's config, after every check that can be made before a process starts."""
        config = read_config(resolve(self.model))[0]
        for n in self.ranks:
            check_tensor_parallel(config, n)
            check_pipeline(config, n)
        if self.prompt_len + self.decode_tokens + 1 > config.max_seq_len:
            raise ValueError(
                f"ParallelBench: prompt_len + decode_tokens + 1 = {self.prompt_len + self.decode_tokens + 1} "
                f"exceeds {config.name}'s context of {config.max_seq_len}"
            )
        return config

    def prompt(self, vocab_size: int) -> tuple[int, ...]:
        rng = np.random.default_rng(self.seed)
        return tuple(int(t) for t in rng.integers(0, vocab_size, self.prompt_len))

    def replica_workload(self, vocab_size: int) -> list[Request]:
        rng = np.random.default_rng(self.seed + 1)
        low, high = max(1, self.replica_prompt_len // 2), self.replica_prompt_len * 3 // 2 + 1
        lengths = rng.integers(low, high, self.replica_requests)
        return [
            Request(rng.integers(0, vocab_size, n).tolist(), self.replica_output, id=i) for i, n in enumerate(lengths)
        ]

    def replica_config(self) -> DisaggConfig:
        scheduler = SchedulerConfig("continuous", self.replica_max_batch)
        engine = EngineConfig(num_blocks=256, block_size=16, scheduler=scheduler)
        return DisaggConfig(prefill=engine, timeout=self.timeout)


# ---------------------------------------------------------------------------------------------
# From the ranks' records to figures


def _median_ms(values: Sequence[float]) -> float:
    return 1e3 * statistics.median(values)


def tensor_parallel_row(
    config: ModelConfig, ranks: int, per_rank: Sequence[dict], reference: list[int], prompt_len: int
) -> dict:
    """One row: the slowest rank's step times (medians), tokens vs one process, counted bytes vs
    the formula (every rank must have put in the same)."""
    n = len(reference) - 1  # decode steps
    rounds = range(len(per_rank[0]["prefill_s"]))
    prefill = [max(r["prefill_s"][i] for r in per_rank) for i in rounds]
    decode = [max(r["decode_s"][i][s] for r in per_rank) for i in rounds for s in range(n)]
    reduce = [r["decode_counts"].get("all_reduce", {"calls": 0, "bytes": 0}) for r in per_rank]
    prefill_bytes = [r["prefill_counts"].get("all_reduce", {}).get("bytes", 0) for r in per_rank]
    calls, counted = reduce[0]["calls"], reduce[0]["bytes"]
    formula = tp_decode_bytes(config, 1, FP32, ranks) * n
    payload = counted // calls if calls else 0
    return {
        "ranks": ranks,
        "prefill_ms": _median_ms(prefill),
        "decode_ms": _median_ms(decode),
        "tokens_equal": all(r["tokens"] == reference for r in per_rank),
        "local_params": per_rank[0]["local_params"],
        "calls_per_token": calls / n,
        "bytes_per_token": counted / n,  # payload one rank puts into all-reduces
        "formula_bytes_per_token": formula / n,
        "bytes_equal": all(c == reduce[0] for c in reduce) and counted == formula,
        "wire_bytes_per_token": calls * wire_bytes("all_reduce", payload, ranks) / n,
        "prefill_bytes": prefill_bytes[0],
        "prefill_formula_bytes": tp_decode_bytes(config, prompt_len, FP32, ranks),
        "payload_per_call": payload,
    }


def _sent(results: Sequence[StageResult], what: str = "bytes") -> int:
    """Sends of all stages together: their bytes or their number (``what="calls"``)."""
    return sum(r.counts.get("send", {}).get(what, 0) for r in results)


def pipeline_row(
    config: ModelConfig, ranks: int, per_rank: Sequence[dict], reference: list[int], prompt_len: int
) -> dict:
    """One row: prefill span and per-token cycle from the stages' recorded intervals, tokens vs one
    process, bytes sent (all stages) counted vs ``pipeline_bytes``."""
    n = len(reference) - 1
    rounds = [[r["runs"][i] for r in per_rank] for i in range(len(per_rank[0]["runs"]))]
    prefill, cycles = [], []
    for stages in rounds:
        last = stages[-1].timeline
        ends = [max(iv.end for iv in last if iv.step == step) for step in range(n + 1)]
        prefill.append(ends[0])  # from the start barrier to the first token's logits
        cycles += [b - a for a, b in zip(ends, ends[1:])]  # one token: relay through every stage and back
    whole = pipeline_bytes(config, 1, prompt_len, n + 1, 1, ranks)
    prefill_only = pipeline_bytes(config, 1, prompt_len, 1, 1, ranks)
    counted_whole = _sent(rounds[-1])
    prefill_runs = [r["prefill_only"] for r in per_rank]
    counted_prefill = _sent(prefill_runs)
    bubble = measured_bubble([s.timeline for s in rounds[-1]])
    return {
        "ranks": ranks,
        "layers": [len(r.layers) for r in rounds[-1]],
        "prefill_ms": _median_ms(prefill),
        "decode_ms": _median_ms(cycles),
        "tokens_equal": rounds[-1][-1].tokens == [reference],
        "messages_per_token": (_sent(rounds[-1], "calls") - _sent(prefill_runs, "calls")) / n,
        "bytes_per_token": (counted_whole - counted_prefill) / n,  # sent by all stages together
        "formula_bytes_per_token": (whole["total"] - prefill_only["total"]) / n,
        "bytes_equal": counted_whole == whole["total"] and counted_prefill == prefill_only["total"],
        "total_bytes": counted_whole,
        "total_formula_bytes": whole["total"],
        "bubble_measured": bubble["mean"],
        "bubble_formula": bubble_fraction(ranks, 1),
    }


def message_seconds(payload: float, link: Link, base_s: float = NCCL_BASE_LATENCY_S) -> float:
    """One point-to-point message (an assumption, by analogy with NCCL's all-reduce cost): one base
    latency, one hop and the bytes over the bandwidth."""
    return base_s + link.latency + payload / link.bandwidth


def gpu_link_rows(config: ModelConfig, tensor_rows: Sequence[dict], pipeline_rows: Sequence[dict]) -> list[dict]:
    """The counted communication of one generated token priced on GPU links: the tensor-parallel
    all-reduces (one after another, as the layers run) and the pipeline's relay of messages."""
    rows = []
    for name in GPU_LINKS:
        link = TP_LINKS[name]
        for r in tensor_rows:
            if r["ranks"] > 1:
                per_call = allreduce_seconds(r["payload_per_call"], r["ranks"], link)
                rows.append(_link_row("tensor", r, name, r["calls_per_token"] * per_call))
        for r in pipeline_rows:
            if r["ranks"] > 1:
                activation = config.dim * FP32  # one row, one token
                token = r["bytes_per_token"] - (r["ranks"] - 1) * activation
                seconds = (r["ranks"] - 1) * message_seconds(activation, link) + message_seconds(token, link)
                rows.append(_link_row("pipeline", r, name, seconds))
    return rows


def _link_row(scheme: str, r: dict, link: str, seconds: float) -> dict:
    return {
        "scheme": scheme,
        "ranks": r["ranks"],
        "link": link,
        "comm_us_per_token": 1e6 * seconds,
        "cpu_decode_ms": r["decode_ms"],
    }


def replica_rows(b: ParallelBench, model) -> list[dict]:
    """Each replica count's run of the same burst; its tokens checked against one local engine."""
    requests = b.replica_workload(model.config.vocab_size)
    engine = Engine(model, b.replica_config().prefill)  # the replicas' engine, in this process
    reference = [o.tokens for o in engine.run(copy_requests(requests))]
    rows = []
    for n in b.replicas:
        run = replica_throughput(b.model, n, requests, b.replica_config())
        rows.append({**run.figures(), "tokens_equal": [o.tokens for o in run.outputs] == reference})
    base = rows[0]["output_tokens_per_s"]
    for row in rows:
        row["throughput_vs_first"] = row["output_tokens_per_s"] / base
    return rows


# ---------------------------------------------------------------------------------------------
# The benchmark


EP_EXPERTS, EP_TOP_K, CP_SEQ_LEN = 8, 2, 64  # the split MoE layer and the ring's sequence


@torch.inference_mode()
def mlp_inputs(model, prompt: Sequence[int]) -> torch.Tensor:
    """The hidden states (T, dim) entering the middle layer's MLP over ``prompt``: real
    activations for a router to route."""
    captured = []
    layer = model.layers[len(model.layers) // 2].mlp
    hook = layer.register_forward_pre_hook(lambda mlp, args: captured.append(args[0][0]))
    try:
        model(torch.tensor([list(prompt)]))
    finally:
        hook.remove()
    return captured[0]


def expert_and_context_rows(b: ParallelBench, model, prompt: Sequence[int]) -> tuple[dict, dict]:
    """Chapter 15's other two splits, on two ranks started once: a mixture-of-experts layer
    (``EP_EXPERTS`` experts, top ``EP_TOP_K``, a seeded router) over the model's own hidden states,
    half the tokens on each rank, against one process, with the all-to-all bytes ``Comm`` counted
    against those the routing's split sizes give; and ring attention over ``CP_SEQ_LEN`` tokens
    split zigzag, against attention over the whole sequence in one process."""
    torch.manual_seed(b.seed)
    moe = MoEFeedForward(model.config, n_experts=EP_EXPERTS, top_k=EP_TOP_K).eval()
    x = mlp_inputs(model, prompt)
    xs = list(x.split([len(x) // 2, len(x) - len(x) // 2]))
    spec = RingSpec(seed=b.seed, seq_len=CP_SEQ_LEN, layout="zigzag")
    ep, cp = launch_several([(ep_layer_run, (moe, xs, None)), (ring_check, (spec,))], 2, timeout=b.timeout, threads=1)
    with torch.inference_mode():
        one = moe(x)
        routing = [moe.route(part).experts for part in xs]
    exact = routed_all_to_all_bytes(routing, EP_EXPERTS, model.config.dim, 4)
    load = expert_load(torch.cat(routing), EP_EXPERTS, 2)
    expert = {
        "ranks": 2,
        "n_experts": EP_EXPERTS,
        "top_k": EP_TOP_K,
        "tokens": [len(part) for part in xs],
        "max_abs_diff": float((torch.cat([r.output for r in ep]) - one).abs().max()),
        "tolerance": 1e-5,
        "counted_bytes": [r.counts["all_to_all"]["bytes"] for r in ep],
        "routed_bytes": [e.total for e in exact],
        "bytes_equal": [r.counts["all_to_all"]["bytes"] for r in ep] == [e.total for e in exact],
        "rows_per_expert": load.per_expert,
        "max_over_mean": load.expert_imbalance,
        "rank_max_over_mean": load.rank_imbalance,
    }
    q, k, v = spec.tensors()
    positions = torch.arange(spec.seq_len)
    mask = positions[None, :] <= positions[:, None]
    groups = spec.n_heads // spec.n_kv_heads
    full = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), attn_mask=mask
    )
    got = torch.zeros_like(full)
    for r in cp:
        got[:, :, r.tokens] = torch.from_numpy(r.out)
    layout = make_layout(spec.layout, spec.seq_len, 2)
    context = {
        "ranks": 2,
        "seq_len": spec.seq_len,
        "layout": spec.layout,
        "max_abs_diff": float((got - full).abs().max()),
        "tolerance": 1e-5,
        "kv_share": padded_length(layout) / spec.seq_len,
        "imbalance": imbalance(causal_work(layout)),
        "contiguous_imbalance": imbalance(causal_work(make_layout("contiguous", spec.seq_len, 2))),
        "ring_bytes": [sum(c["bytes"] for c in r.counts.values()) for r in cp],
    }
    return expert, context


def bench_parallel(options: ParallelBench | None = None) -> dict:
    """Everything of chapter 15 measured on this machine (see the module's docstring)."""
    b = options or ParallelBench()
    config = b.check()
    cores = os.cpu_count() or 1
    record = provenance(
        "cpu", b.model, "float32", threads_per_rank=1, cpu_cores=cores, options=asdict(b), note=cpu_note(cores)
    )
    model, _ = load(b.model, device="cpu", dtype=torch.float32)
    prompt = b.prompt(config.vocab_size)
    reference = generate(model, torch.tensor([prompt]), b.decode_tokens + 1, eos_token_id=None).tokens[0].tolist()
    work = RankWork(str(resolve(b.model)), prompt, b.decode_tokens, b.repeats, b.warmup)
    tensor, pipeline = [], []
    for n in b.ranks:
        per_rank = launch(parallel_rank, n, work, timeout=b.timeout, threads=1)
        tensor.append(tensor_parallel_row(config, n, [r["tp"] for r in per_rank], reference, b.prompt_len))
        pipeline.append(pipeline_row(config, n, [r["pp"] for r in per_rank], reference, b.prompt_len))
    record["tensor_parallel"] = tensor
    record["pipeline_parallel"] = pipeline
    record["gpu_links"] = gpu_link_rows(config, tensor, pipeline)
    record["tp_speedups"] = tp_speedup_rows()
    record["replicas"] = replica_rows(b, model)
    record["expert_parallel"], record["context_parallel"] = expert_and_context_rows(b, model, prompt)
    return finish_provenance(record)


def cpu_note(cores: int) -> str:
    return (
        f"This CPU has {cores} core{'s' if cores != 1 else ''}: the ranks (one thread each) share "
        f"{'them' if cores != 1 else 'it'}, so parallel speed is not the lesson here; correctness "
        "(the same greedy tokens as one process) and communication volume (counted bytes = the formula) are."
    )


# ---------------------------------------------------------------------------------------------
# Tables


class _Count(int):
    """A count as a table prints it: an integer (right-aligned) with thousands separators."""

    def __str__(self) -> str:
        return f"{int(self):,}"


def _whole(rows: Sequence[Mapping], keys: Sequence[str]) -> list[dict]:
    """Rows with the counts among ``keys`` as integers with separators (a saved run stores them as
    floats; a count that is not whole stays as it is)."""
    return [
        {**r, **{k: _Count(r[k]) for k in keys if isinstance(r.get(k), (int, float)) and float(r[k]).is_integer()}}
        for r in rows
    ]


def format_tensor(figures: Mapping) -> str:
    columns = {
        "ranks": "ranks",
        "prefill_ms": "prefill ms",
        "decode_ms": "decode ms/token",
        "tokens_equal": "same tokens as 1 process",
        "calls_per_token": "all-reduces per token",
        "bytes_per_token": "bytes per token per rank",
        "formula_bytes_per_token": "formula bytes",
        "bytes_equal": "counted equals formula",
    }
    title = f"Tensor parallel: {figures['options']['prompt_len']}-token prompt, fp32, medians (measured)"
    rows = _whole(figures["tensor_parallel"], ("calls_per_token", "bytes_per_token", "formula_bytes_per_token"))
    return format_table(rows, columns, title=title)


def format_pipeline(figures: Mapping) -> str:
    columns = {
        "ranks": "ranks",
        "prefill_ms": "prefill ms",
        "decode_ms": "decode ms/token",
        "tokens_equal": "same tokens as 1 process",
        "bytes_per_token": "bytes per token (all ranks)",
        "formula_bytes_per_token": "formula bytes",
        "bytes_equal": "counted equals formula",
        "bubble": "bubble measured",
        "formula_bubble": "formula (p-1)/p",
    }
    rows = [
        {**r, "bubble": f"{r['bubble_measured']:.0%}", "formula_bubble": f"{r['bubble_formula']:.0%}"}
        for r in _whole(figures["pipeline_parallel"], ("bytes_per_token", "formula_bytes_per_token"))
    ]
    return format_table(rows, columns, title="Pipeline parallel, one micro-batch (measured)")


def format_gpu_links(rows: Sequence[Mapping]) -> str:
    columns = {
        "scheme": "scheme",
        "ranks": "ranks",
        "link": "link",
        "comm_us_per_token": "comm us per token",
        "cpu_decode_ms": "CPU decode ms",
    }
    title = "The same counted bytes per token on GPU links (predicted: NCCL latency + bytes / bandwidth)"
    return format_table(rows, columns, title=title)


def format_speedups(rows: Sequence[Mapping]) -> str:
    columns = {
        "model": "model",
        "link": "link",
        "gpus": "GPUs",
        "total_ms": "step ms",
        "comm_ms": "comm ms",
        "predicted_speedup": "speedup",
        "published_speedup": "gpt-fast published",
    }
    title = "Tensor-parallel decode, batch 1 (predicted; gpt-fast's published speedups on 8 x A100)"
    return format_table(rows, columns, title=title)


def format_replicas(rows: Sequence[Mapping]) -> str:
    columns = {
        "replicas": "replicas",
        "requests_per_s": "requests/s",
        "output_tokens_per_s": "tokens/s",
        "throughput_vs_first": "tokens/s vs 1 replica",
        "tpot_p50_ms": "TPOT p50 ms",
        "ttft_p50_ms": "TTFT p50 ms",
        "tokens_equal": "same tokens as 1 engine",
    }
    title = "Data parallel: whole replicas behind a router, one burst (measured on the wall clock)"
    return format_table(rows, columns, title=title)


def format_experts_and_context(figures: Mapping) -> list[str]:
    """The expert-parallel layer and the ring, one short paragraph each (none in older runs)."""
    from ..measure.report import wrap_line

    ep, cp = figures.get("expert_parallel"), figures.get("context_parallel")
    if not ep or not cp:
        return []
    expert = (
        f"Expert parallel: one MoE layer ({ep['n_experts']} experts, top {ep['top_k']}) over {ep['ranks']} ranks, "
        f"{'+'.join(map(str, ep['tokens']))} tokens: largest difference from one process {ep['max_abs_diff']:.1e}; "
        f"all-to-all bytes counted {', '.join(f'{n:,}' for n in ep['counted_bytes'])} per rank, "
        f"{'equal to' if ep['bytes_equal'] else 'NOT equal to'} the routing's split sizes; the busiest expert "
        f"got {ep['max_over_mean']:.2f}x the mean rows, the busiest rank {ep['rank_max_over_mean']:.2f}x."
    )
    context = (
        f"Context parallel: ring attention over {cp['seq_len']} tokens on {cp['ranks']} ranks ({cp['layout']} split): "
        f"largest difference from one process {cp['max_abs_diff']:.1e}; each rank keeps {cp['kv_share']:.2f}x of "
        f"the K/V; the busiest rank's causal work is {cp['imbalance']:.2f}x the mean "
        f"({cp['contiguous_imbalance']:.2f}x split in order)."
    )
    return ["\n".join(wrap_line(expert)), "\n".join(wrap_line(context))]


def format_parallel(figures: Mapping) -> str:
    from ..measure.report import describe, wrap_line

    head = f"{describe(figures)}; 1 thread per rank, gloo"
    parts = [
        "\n".join(wrap_line(head) + wrap_line(figures["note"])),
        format_tensor(figures),
        format_pipeline(figures),
        format_gpu_links(figures["gpu_links"]),
        format_speedups(figures["tp_speedups"]),
        format_replicas(figures["replicas"]),
        *format_experts_and_context(figures),
        "\n".join(
            wrap_line(
                "Replicas raise throughput (requests are served side by side); no request runs faster "
                "than one replica serving it alone: where TPOT falls with more replicas, it is because "
                "each replica batches fewer requests. Tensor parallelism is what makes one request's "
                "tokens come faster."
            )
        ),
    ]
    return "\n\n".join(parts)
