"""``python -m minillm bench serve-stack``: the served model with each technique, then all of them,
measured from the client at rising arrival rates; each configuration's highest goodput within the
SLO, against eager fp32's.

    figures = bench_serve_stack(ServeStackBench(rates=(4.0, 8.0, 16.0)))
    print(format_serve_stack(figures))

Every configuration is a ``python -m minillm serve`` of its own (``bench.serve``), started with
its flags, sent the same requests at the same rates (Poisson arrivals, lognormal output lengths),
streamed over HTTP. The prompts are code to rewrite by default (``bench.serve.edit_prompts``): a
request whose answer copies its prompt, what prompt lookup is for; on prompts with nothing to copy
(``prompts="random"``) prompt lookup only adds the cost of verifying its misses. Goodput is
chapter 2's: requests per second that met both the TTFT and the TPOT bound, over the run's span
at the client; the highest over the rates is what the configuration sells within the SLO.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, field, replace

from ..core.checkpoints import DEFAULT_MODEL
from ..core.config import check_field_types
from ..measure.metrics import SLO
from ..measure.report import describe, finish_provenance, format_table, provenance
from .serve import PROMPT_KINDS, ServeBench, bench_serve

# (name, serve's flags): eager fp32 first (every ratio's baseline), each technique alone, then two
# stacks: the fp32 one (on a CPU without native bf16, int8's bf16 compute slows the prompt) and all.
STACK = (
    ("eager fp32", ()),
    ("int8 weights", ("--quantize", "int8")),
    ("compiled decode", ("--compile",)),
    ("prompt lookup K=4", ("--prompt-lookup", "4")),
    ("compiled + lookup", ("--compile", "--prompt-lookup", "4")),
    ("int8 + compiled + lookup", ("--quantize", "int8", "--compile", "--prompt-lookup", "4")),
)


@dataclass(frozen=True)
class ServeStackBench:
    model: str = DEFAULT_MODEL
    stack: tuple[tuple[str, tuple[str, ...]], ...] = STACK
    rates: tuple[float, ...] = (1.0, 2.0, 4.0, 8.0)  # Poisson arrivals per second, one run each
    n_requests: int = 32  # per rate
    prompts: str = "edits"  # "edits" (code to rewrite) or "random" prompt ids
    prompt_median: float = 64  # tokens (random prompts only)
    output_median: float = 48  # tokens
    max_len: int = 320  # prompt + output at most, tokens
    max_batch: int = 8
    threads: int = 1  # each server's CPU threads
    slo: SLO = field(default_factory=lambda: SLO(ttft=0.5, tpot=0.05))
    seed: int = 0
    startup_timeout: float = 900.0  # seconds a server may take to load and compile
    progress: bool = False

    def __post_init__(self) -> None:
        check_field_types(self, ints=("n_requests", "max_len", "max_batch", "threads"))
        if not self.stack or self.stack[0][1]:
            raise ValueError("the stack must start with the baseline, a configuration without flags")
        if self.prompts not in PROMPT_KINDS:
            raise ValueError(f"prompts must be one of {PROMPT_KINDS}, got {self.prompts!r}")
        self.serve_bench(())  # its checks: rates, lengths

    def serve_bench(self, flags: tuple[str, ...]) -> ServeBench:
        return ServeBench(
            model=self.model,
            n_requests=self.n_requests,
            rates=self.rates,
            seed=self.seed,
            prompt_median=self.prompt_median,
            output_median=self.output_median,
            max_len=self.max_len,
            max_batch=self.max_batch,
            threads=self.threads,
            slo=self.slo,
            startup_timeout=self.startup_timeout,
            progress=self.progress,
            server_flags=(*flags, "--max-model-len", str(self.max_len)),  # also bounds what a compiled step reads
            prompts=self.prompts,
        )


def best_run(runs: list[dict]) -> dict:
    """The run of the highest goodput at the client (the lowest rate among equals)."""
    return max(runs, key=lambda r: (r["client"]["goodput_rps"], -r["rate"]))


def bench_serve_stack(options: ServeStackBench) -> dict:
    """Each configuration of ``options.stack`` served and swept; one row each, ratios to the first."""
    configs = []
    for name, flags in options.stack:
        figures = bench_serve(options.serve_bench(flags))
        configs.append({"name": name, "flags": list(flags), "figures": figures})
    first = configs[0]["figures"]
    out = provenance(first["device"], first["model"], first.get("dtype"))
    out.update(hardware=first["hardware"], threads=first.get("threads"))
    out["load_average_before"] = first.get("load_average_before")
    out.update(workload=first["workload"], slo=first["slo"], rates=list(options.rates))
    base = best_run(first["runs"])["client"]["goodput_rps"]
    rows = []
    for c in configs:
        run = best_run(c["figures"]["runs"])
        f = run["client"]
        rows.append(
            {
                "config": c["name"],
                "flags": " ".join(c["flags"]) or "(none)",
                "dtype": c["figures"].get("dtype"),
                "best_goodput_rps": f["goodput_rps"],
                "at_rate": run["rate"],
                "vs_eager": f["goodput_rps"] / base if base else None,
                "slo_met_pct": f["slo_met_pct"],
                "ttft_p50_ms": f["ttft_ms"]["p50"],
                "tpot_p50_ms": (f["tpot_ms"] or {}).get("p50"),
                "output_tokens_per_s": run["output_tokens_per_s"],
                "goodput_by_rate": {f"{r['rate']:g}": r["client"]["goodput_rps"] for r in c["figures"]["runs"]},
            }
        )
    out["rows"] = rows
    out["how"] = (
        "each configuration a server of its own, the same requests at each rate, streamed over HTTP; "
        "goodput: requests per second within both SLO bounds, over the client's span; best over the rates"
    )
    out["configs"] = configs
    return finish_provenance(out)


COLUMNS = {
    "config": "configuration",
    "dtype": "dtype",
    "best_goodput_rps": "goodput req/s",
    "at_rate": "at req/s",
    "vs_eager": "vs eager",
    "slo_met_pct": "in SLO %",
    "ttft_p50_ms": "TTFT p50 ms",
    "tpot_p50_ms": "TPOT p50 ms",
}


def format_serve_stack(figures: dict) -> str:
    slo, w = figures["slo"], figures["workload"]
    title = (
        f"highest goodput within TTFT {1e3 * slo['ttft_s']:.0f} ms and TPOT {1e3 * slo['tpot_s']:.0f} ms "
        f"over {', '.join(f'{r:g}' for r in figures['rates'])} req/s; {w['requests_per_rate']} requests "
        f"per rate, {w['prompts']} prompts, max batch {w['max_batch']}"
    )
    lines = [format_table(figures["rows"], COLUMNS, title=title)]
    lines += [f"  {r['config']}: serve {r['flags']}" for r in figures["rows"]]
    lines += textwrap.wrap(describe(figures), 88)
    return "\n".join(lines)


def stack_only(options: ServeStackBench, names: tuple[str, ...]) -> ServeStackBench:
    """``options`` with only the named configurations (the baseline always kept first)."""
    kept = tuple(c for i, c in enumerate(options.stack) if i == 0 or c[0] in names)
    return replace(options, stack=kept)
