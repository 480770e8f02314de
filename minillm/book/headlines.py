"""The book in one table: each chapter's technique and its measured headline, read from the saved
runs like the decision guide's evidence (``book.evidence``), for chapter 16's last section.

A chapter whose figures are measured on its own page and saved by no benchmark (the metrics,
the roofline, FlashAttention on a CPU) says so rather than quoting a number typed in.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..measure.report import load_results
from .evidence import (
    Reader,
    cache_from_generate,
    decode_from_compression,
    experts_from_parallel,
    generation_from_generate,
    kv_from_kv,
    ladder_from_capstone,
    lookup_from_decoding,
    overhead_from_generate,
    parallel_from_decoding,
    speculative_from_decoding,
    split_from_parallel,
    tail_from_disagg,
    throughput_from_batching,
    waste_from_batching,
)
from .guide import STAGES, Symptom, evidence_for

ON_THE_PAGE = "measured on the chapter's page (no benchmark saves it)"
GENERATE = "python -m minillm bench generate"
DECODING = "python -m minillm bench decoding"
PARALLEL = "python -m minillm bench parallel"


@dataclass(frozen=True)
class Headline:
    chapter: int
    technique: str
    readers: tuple[Reader, ...] = ()  # none: measured on the page only


HEADLINES: tuple[Headline, ...] = (
    Headline(
        1, "generation: prefill, decode, sampling", (Reader("bench_generate", GENERATE, generation_from_generate),)
    ),
    Headline(2, "metrics: TTFT, TPOT, goodput under an SLO"),
    Headline(3, "the roofline: bandwidth bounds decode, FLOP/s prefill"),
    Headline(4, "the KV cache", (Reader("bench_generate", GENERATE, cache_from_generate),)),
    Headline(5, "a smaller cache: GQA, MQA, int8 K/V", (Reader("bench_kv", "python -m minillm bench kv", kv_from_kv),)),
    Headline(
        6, "paged KV blocks", (Reader("bench_batching", "python -m minillm bench batching", waste_from_batching),)
    ),
    Headline(7, "speculative decoding", (Reader("bench_decoding", DECODING, speculative_from_decoding),)),
    Headline(8, "prompt lookup decoding", (Reader("bench_decoding", DECODING, lookup_from_decoding),)),
    Headline(9, "lookahead and Medusa decoding", (Reader("bench_decoding", DECODING, parallel_from_decoding),)),
    Headline(10, "FlashAttention in Triton"),
    Headline(
        11, "compilers: torch.compile, CUDA graphs", (Reader("bench_generate", GENERATE, overhead_from_generate),)
    ),
    Headline(
        12,
        "quantization, pruning, distillation",
        (Reader("bench_compression", "python -m minillm bench compression", decode_from_compression),),
    ),
    Headline(
        13,
        "continuous batching",
        (Reader("bench_batching", "python -m minillm bench batching", throughput_from_batching),),
    ),
    Headline(
        14,
        "prefill/decode disaggregation",
        (Reader("bench_disagg", "python -m minillm bench disagg", tail_from_disagg),),
    ),
    Headline(
        15,
        "tensor, pipeline, context, expert parallelism",
        (
            Reader("bench_parallel", PARALLEL, split_from_parallel),
            Reader("bench_parallel", PARALLEL, experts_from_parallel),
        ),
    ),
    Headline(
        16,
        "every technique stacked",
        (Reader("bench_capstone", "python -m minillm bench capstone", ladder_from_capstone),),
    ),
)


def headline_rows(results_dir: str | Path | None = None, prefer: Sequence[str] = ()) -> list[dict]:
    """One row per chapter: its technique, the measured headline of its best saved run (or where
    it is measured), and the file it came from."""
    names = {r.name for h in HEADLINES for r in h.readers}
    results = {name: load_results(name, results_dir) for name in sorted(names)}
    rows = []
    for h in HEADLINES:
        if not h.readers:
            rows.append({"chapter": h.chapter, "technique": h.technique, "measured": ON_THE_PAGE, "source": ""})
            continue
        entry = evidence_for(
            Symptom(h.technique, STAGES[0], "", "", (h.chapter,), "", h.readers), results, list(prefer)
        )
        rows.append(
            {"chapter": h.chapter, "technique": h.technique, "measured": entry.evidence, "source": entry.source}
        )
    return rows


def headlines_markdown(rows: Sequence[dict]) -> str:
    """The rows as a Markdown table (for ``IPython.display.Markdown``)."""
    lines = ["| ch. | technique | measured headline | saved in |", "|---|---|---|---|"]
    for r in rows:
        source = f"`{r['source']}`" if r["source"] else "-"
        lines.append(f"| {r['chapter']} | {r['technique']} | {r['measured']} | {source} |")
    return "\n".join(lines)
