"""The book's decision guide: from a measured symptom to the technique to try and the way to check it.

Every chapter ended with a technique and a benchmark that measured it. Read backwards, those
benchmarks are a diagnosis: each symptom (decode is bandwidth-bound, the KV cache fills the
memory, the p99 gap between tokens spikes when long prompts arrive...) shows in one measurement,
points to a few techniques, and has a check that the technique worked *and* stayed correct.

``decision_guide`` builds that table, one ``GuideEntry`` per symptom. The signal, techniques and
checks are the book's prose; the ``evidence`` is not typed in: it is one sentence computed from
the book's own saved runs (``minillm/results/<hardware>/<name>.json``, read with
``report.load_results``) by the symptom's readers (``book.evidence``), with the file it came from
in ``source``. Where several machines saved the file, the newest run wins (``prefer`` names
hardware to try first); where none did, the evidence says which command to run. ``format_guide``
prints it to fit the page, ``guide_markdown`` renders it for a notebook, and ``minillm.viz.guide``
draws it.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..measure.report import PAGE_WIDTH, load_results, wrap_line
from .evidence import (
    Reader,
    batch_from_capstone,
    cache_from_generate,
    context_from_parallel,
    decode_from_compression,
    decode_from_gpu_compression,
    experts_from_parallel,
    kv_from_kv,
    lookup_from_decoding,
    overhead_from_generate,
    overhead_from_gpu_decode,
    prefill_from_gpu_steps,
    prefill_from_step_cost,
    prefix_from_batching,
    replicas_from_parallel,
    split_from_parallel,
    tail_from_disagg,
    throughput_from_batching,
    waste_from_batching,
)

NO_RUN = "no saved run: run `{benchmark}`"


@dataclass(frozen=True)
class GuideEntry:
    """One row of the guide: a symptom, how it shows, what to try, and the measured figure behind it."""

    symptom: str  # what is wrong, e.g. "decode is bandwidth-bound"
    stage: str  # which of the guide's four stages it belongs to (STAGES)
    signal: str  # how it shows in a measurement
    techniques: str  # what to try, most effective first
    chapters: tuple[int, ...]  # where the book teaches them
    benchmark: str  # the command that measures it
    verify: str  # how to check the technique worked and stayed correct
    evidence: str  # one measured sentence from a saved run (or which command to run)
    source: str  # "<hardware>/<name>.json" the evidence came from; "" when there is none


# ---------------------------------------------------------------------------------------------
# The guide


@dataclass(frozen=True)
class Symptom:
    """A guide entry before its evidence: the prose, and where the evidence can be read."""

    symptom: str
    stage: str
    signal: str
    techniques: str
    chapters: tuple[int, ...]
    verify: str
    readers: tuple[Reader, ...]  # the first one's command is what to run when nothing is saved

    def __post_init__(self) -> None:
        if not self.readers:
            raise ValueError(f"symptom {self.symptom!r} needs at least one Reader of its evidence")
        if self.stage not in STAGES:
            raise ValueError(f"symptom {self.symptom!r}: stage must be one of {STAGES}, got {self.stage!r}")

    def entry(self, evidence: str, source: str, benchmark: str | None = None) -> GuideEntry:
        return GuideEntry(
            self.symptom,
            self.stage,
            self.signal,
            self.techniques,
            self.chapters,
            benchmark or self.readers[0].command,
            self.verify,
            evidence,
            source,
        )


GPU_CHECK = "make gpu-check"
GENERATE = "python -m minillm bench generate"
BATCHING = "python -m minillm bench batching"
DISAGG = "python -m minillm bench disagg"

PARALLEL = "python -m minillm bench parallel"
CAPSTONE = "python -m minillm bench capstone"

# Step 0, before any of them: an existing engine (vLLM, SGLang, TensorRT-LLM on GPUs, llama.cpp
# on CPUs and laptops) already pages the KV cache, batches continuously and caches prefixes. The
# guide is for what remains once one runs, and for reading what it does. Its order: first make
# the model and its cache fit, then stop repeating work, then protect latency under load, and
# only then make the step itself cheaper.
STAGES = ("1. fit", "2. stop repeating work", "3. protect latency under load", "4. shave the step")

SYMPTOMS: tuple[Symptom, ...] = (
    Symptom(
        "the model is too large for one device",
        STAGES[0],
        "weights + KV cache exceed the device's memory; out-of-memory at load",
        "int8/int4 weights; tensor or pipeline parallel; offload layers to the host",
        (12, 15),
        "the same greedy tokens as one device; communicated bytes = the formula; tok/s per device",
        (Reader("bench_parallel", PARALLEL, split_from_parallel),),
    ),
    Symptom(
        "an MoE model too large for one device",
        STAGES[0],
        "the experts' weights dominate and exceed one device; each token uses only top-k of them",
        "expert parallelism: experts split over devices, tokens routed by all-to-all",
        (15,),
        "outputs equal one process's; all-to-all bytes = tokens x top-k x d_model x bytes x (p-1)/p; expert load",
        (Reader("bench_parallel", PARALLEL, experts_from_parallel),),
    ),
    Symptom(
        "the KV cache fills the memory",
        STAGES[0],
        "KV bytes per token x context x batch reach the weights' bytes; the batch is capped by memory",
        "int8/fp8 KV cache; tensor parallel; preemption; GQA/MQA only by uptraining",
        (5, 13, 15),
        "KV bytes and decode tok/s per technique; perplexity after quantizing, uptraining or evicting",
        (Reader("bench_kv", "python -m minillm bench kv", kv_from_kv),),
    ),
    Symptom(
        "KV memory reserved but unused",
        STAGES[0],
        "fewer sequences fit than the memory holds: each reserves a slot for its longest length",
        "paged KV cache (block tables); continuous batching",
        (6, 13),
        "wasted share of the KV memory, paged vs contiguous; the same tokens as the contiguous cache",
        (Reader("bench_batching", BATCHING, waste_from_batching),),
    ),
    Symptom(
        "each step recomputes the whole prefix",
        STAGES[1],
        "time per new token grows with its position; total time grows with the square of the length",
        "KV cache: keep each token's keys and values, feed only the new token",
        (4,),
        "tok/s with and without the cache; the same greedy tokens",
        (Reader("bench_generate", GENERATE, cache_from_generate),),
    ),
    Symptom(
        "long prompts shared by many requests",
        STAGES[1],
        "TTFT dominated by a system prompt or document that every request repeats",
        "prefix caching (shared KV blocks, reference-counted)",
        (6,),
        "TTFT with and without the prefix cache; the same tokens either way",
        (Reader("bench_batching", BATCHING, prefix_from_batching),),
    ),
    Symptom(
        "the output copies the input",
        STAGES[1],
        "summaries, code edits, RAG answers: long n-grams of the output already stand in the prompt",
        "prompt lookup decoding (drafts matched in the prompt); lookahead decoding",
        (8, 9),
        "tok/s and tokens per target forward vs greedy; exactly the greedy tokens",
        (Reader("bench_decoding", "python -m minillm bench decoding", lookup_from_decoding),),
    ),
    Symptom(
        "throughput low with many users",
        STAGES[2],
        "static batches wait for their longest member; padding rows in every step",
        "continuous batching (iteration-level scheduling)",
        (13,),
        "output tok/s and TTFT p50/p99 on the same workload, static vs continuous",
        (Reader("bench_batching", BATCHING, throughput_from_batching),),
    ),
    Symptom(
        "one server saturated by its users",
        STAGES[2],
        "goodput stops rising with the arrival rate; TTFT grows with the queue, not the prompt",
        "replicas: more copies of the whole model behind a load balancer",
        (15,),
        "output tok/s and TTFT p50 per replica count on the same requests; the same tokens",
        (Reader("bench_parallel", PARALLEL, replicas_from_parallel),),
    ),
    Symptom(
        "tail latency spikes under load",
        STAGES[2],
        "p99 gap between tokens jumps whenever a long prompt arrives; TPOT misses its SLO",
        "chunked prefill (tune its budget); prefill/decode disaggregation",
        (13, 14),
        "p99 inter-token gap and goodput within the SLO per mode; KV handoff bytes = the formula",
        (Reader("bench_disagg", DISAGG, tail_from_disagg),),
    ),
    Symptom(
        "one long prompt's TTFT breaks the SLO",
        STAGES[2],
        "TTFT over the SLO with an empty queue: a single prefill of a very long context is too slow",
        "context parallelism: the prompt's tokens split over devices, K/V passed around a ring",
        (15,),
        "ring attention equal to one device's; K/V bytes per rank; the causal work balanced (zigzag)",
        (Reader("bench_parallel", PARALLEL, context_from_parallel),),
    ),
    Symptom(
        "cost matters more than latency",
        STAGES[2],
        "the answers can wait for hours; an online SLO keeps the machine below its capacity",
        "a batch API: take the requests at once and keep the batch full",
        (2, 16),
        "output tok/s of a batch against the best in-SLO tok/s online at the same max batch",
        (Reader("bench_capstone", CAPSTONE, batch_from_capstone),),
    ),
    Symptom(
        "decode is bandwidth-bound",
        STAGES[3],
        "tok/s at batch 1 ~ bandwidth / weight bytes; batch 16 costs about what batch 1 does",
        "int4/int8 weight-only quantization; speculative decoding; batching",
        (3, 7, 12),
        "decode tok/s vs bf16 side by side; perplexity change and greedy agreement",
        (
            Reader("bench_compression", "python -m minillm bench compression", decode_from_compression),
            Reader("gpu_check", GPU_CHECK, decode_from_gpu_compression),
        ),
    ),
    Symptom(
        "per-step overhead at small batch",
        STAGES[3],
        "batch-1 tok/s far under bandwidth / weight bytes; a profile shows gaps between kernels",
        "torch.compile; CUDA graphs (mode reduce-overhead) over a static KV cache",
        (11,),
        "decode tok/s eager vs compiled, compile time apart; the same greedy tokens",
        (
            Reader("bench_generate", f"{GENERATE} --compile", overhead_from_generate),
            Reader("gpu_check", GPU_CHECK, overhead_from_gpu_decode),
        ),
    ),
    Symptom(
        "prefill is compute-bound",
        STAGES[3],
        "TTFT grows in proportion to prompt tokens; a prompt token costs a small share of a decode step",
        "fused attention (FlashAttention); 16-bit or fp8 matmuls; skip it: prefix caching",
        (3, 10),
        "prefill time per prompt token against the roofline's FLOP/s; outputs equal the reference kernel's",
        (
            Reader("bench_disagg", DISAGG, prefill_from_step_cost),
            Reader("gpu_check", GPU_CHECK, prefill_from_gpu_steps),
        ),
    ),
)


# ---------------------------------------------------------------------------------------------
# Choosing the run


def result_date(record: Mapping) -> datetime.datetime | None:
    """When a saved result was measured: its provenance ``date`` (or gpu-check's ``started``),
    else that of its first section that has one; None when undated."""
    candidates = [record.get("date"), record.get("started")]
    candidates += [v.get("date") for v in record.values() if isinstance(v, Mapping)]
    for text in filter(None, candidates):
        for fmt in ("%Y-%m-%d %H:%M UTC", "%Y-%m-%dT%H:%M:%SZ"):
            try:
                return datetime.datetime.strptime(str(text), fmt)
            except ValueError:
                continue
    return None


def _preferred(prefer: str | Sequence[str] | None) -> list[str]:
    if prefer is None:
        return []
    names = [prefer] if isinstance(prefer, str) else list(prefer)
    if not all(isinstance(n, str) and n for n in names):
        raise ValueError(f"prefer names hardware folders such as 'cpu-epyc-2core', got {prefer!r}")
    return names


def _read(reader: Reader, record: Mapping) -> str | None:
    """The reader's sentence, or None where the record lacks (or mangles) the figures it needs."""
    try:
        return reader.sentence(record)
    except (KeyError, TypeError, ValueError, IndexError, StopIteration, ZeroDivisionError, AttributeError):
        return None


def best_evidence(
    readers: Sequence[Reader], results: Mapping[str, Mapping[str, Mapping]], prefer: Sequence[str] = ()
) -> tuple[str, str, Reader] | None:
    """The best saved run the readers can read: preferred hardware first, then the newest run
    (undated runs last), then the readers' order. Its sentence, its file and its reader; None
    when no saved run has the figures."""
    found = []
    for order, reader in enumerate(readers):
        for hardware, record in results.get(reader.name, {}).items():
            sentence = _read(reader, record)
            if sentence:
                rank = prefer.index(hardware) if hardware in prefer else len(prefer)
                date = result_date(record)
                stamp = -date.timestamp() if date else float("inf")
                found.append(((rank, stamp, order, hardware), sentence, f"{hardware}/{reader.name}.json", reader))
    if not found:
        return None
    _, sentence, source, reader = min(found, key=lambda f: f[0])
    return sentence, source, reader


def evidence_for(
    symptom: Symptom, results: Mapping[str, Mapping[str, Mapping]], prefer: Sequence[str] = ()
) -> GuideEntry:
    """The symptom's entry with its evidence from the best saved run (``best_evidence``)."""
    best = best_evidence(symptom.readers, results, prefer)
    if best is None:
        benchmark = symptom.readers[0].command
        return symptom.entry(NO_RUN.format(benchmark=benchmark), "")
    sentence, source, reader = best
    return symptom.entry(sentence, source, reader.command)


def decision_guide(
    results_dir: str | Path | None = None, prefer: str | Sequence[str] | None = None
) -> list[GuideEntry]:
    """One entry per symptom, each with its evidence from the saved results under ``results_dir``
    (default: the package's store). ``prefer``: hardware folder(s) to take evidence from first."""
    preferred = _preferred(prefer)
    names = {reader.name for s in SYMPTOMS for reader in s.readers}
    results = {name: load_results(name, results_dir) for name in sorted(names)}
    return [evidence_for(s, results, preferred) for s in SYMPTOMS]


def evidence_hardware(entries: Sequence[GuideEntry]) -> list[str]:
    """The hardware folders the entries' evidence came from, in order of first use."""
    return list(dict.fromkeys(e.source.split("/")[0] for e in entries if e.source))


# ---------------------------------------------------------------------------------------------
# Showing it


def chapters_label(chapters: Sequence[int]) -> str:
    """(3, 12) -> 'ch. 3, ch. 12'."""
    return ", ".join(f"ch. {n}" for n in chapters)


def format_guide(entries: Sequence[GuideEntry], width: int = PAGE_WIDTH) -> str:
    """The guide as text, a block per entry, every line within ``width`` characters."""
    if width < 40:
        raise ValueError(f"width must be at least 40 characters, got {width}")
    indent = " " * 13
    blocks, stage = [], None
    for i, e in enumerate(entries, 1):
        if e.stage != stage:
            stage = e.stage
            blocks.append(f"== {stage} ==")
        head = f"{i}. {e.symptom}"
        label = chapters_label(e.chapters)
        lines = [f"{head}{label.rjust(width - len(head))}" if len(head) + len(label) < width else head]
        measured = f"{e.evidence} [{e.source}]" if e.source else e.evidence
        for name, text in [
            ("signal", e.signal),
            ("try", e.techniques),
            ("measure", e.benchmark),
            ("verify", e.verify),
            ("measured", measured),
        ]:
            lines += wrap_line(f"   {name + ':':<10}{text}", width, indent)
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def guide_markdown(entries: Sequence[GuideEntry]) -> str:
    """The guide as a Markdown table (for ``IPython.display.Markdown`` in a notebook)."""
    lines = [
        "| stage | symptom | how it shows | what to try | where | measure | verify | measured |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for e in entries:
        measured = f"{e.evidence} ({e.source})" if e.source else e.evidence
        cells = [
            e.stage,
            f"**{e.symptom}**",
            e.signal,
            e.techniques,
            chapters_label(e.chapters),
            f"`{e.benchmark}`",
            e.verify,
            measured,
        ]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(lines)
