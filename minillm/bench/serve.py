"""``python -m minillm bench serve``: the HTTP server measured from outside, as a user sees it.

    figures = bench_serve(ServeBench(model="minillm-target", n_requests=32, rates=(2.0, 8.0)))
    print(format_serve(figures))

It starts ``python -m minillm serve`` in a process of its own (or talks to ``url``), sends the
chat-like workload of chapter 13 (Poisson arrivals, lognormal lengths, random prompt ids) as
streaming completions over HTTP (httpx), and records at the client when each token arrives:
TTFT, every inter-token gap (ITL), TPOT and end-to-end latency (chapter 2's definitions). Each
answer's last chunk also carries the engine's own clock for the request (``return_engine_timing``),
so the same requests are measured twice, side by side:

- client: from sending the request to receiving each token's chunk;
- engine: from the request reaching the engine (after HTTP, JSON parsing and validation) to the
  step that sampled each token; its TTFT still counts queueing for a batch slot.

The difference is what the HTTP layer costs: the request's transfer and parsing, the hand-off to
the engine's thread, and for every token the detokenization, the JSON of its chunk, and its trip
back. Requests ask for ``ignore_eos``, so every answer has exactly the workload's length. The
client records its own lateness too (each request sent vs its scheduled arrival): a client that
cannot keep up with the rate would otherwise pass for a fast server.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field

from tqdm.auto import tqdm

from ..core.checkpoints import DEFAULT_MODEL
from ..core.config import check_field_types
from ..core.device import best_device
from ..measure.metrics import (
    SLO,
    RequestMetrics,
    goodput,
    latency_percentiles,
    percentiles,
    slo_met_pct,
    span,
    throughput,
)
from ..measure.report import describe, finish_provenance, format_table, provenance
from ..serving.client import Measured, run_workload, server_process, wait_healthy
from ..serving.workload import Request, chat_trace, requests_from_trace
from .batching import SIGMA

PS = (50, 90, 99)
PROMPT_KINDS = ("random", "edits")


@dataclass(frozen=True)
class ServeBench:
    model: str = DEFAULT_MODEL  # what the benchmark's own server serves (with url: ignored)
    url: str | None = None  # a running minillm server, e.g. http://127.0.0.1:8000; None: start one
    n_requests: int = 32  # per rate
    rates: tuple[float, ...] = (2.0, 8.0)  # Poisson arrivals per second, one run each
    seed: int = 0
    prompt_median: float = 64  # tokens
    output_median: float = 32  # tokens
    max_len: int = 256  # prompt + output at most, tokens
    max_batch: int = 16  # the started server's --max-batch
    threads: int | None = None  # the started server's --threads; None: this process' count
    slo: SLO = field(default_factory=lambda: SLO(ttft=0.5, tpot=0.05))
    startup_timeout: float = 120.0  # seconds for a started server to answer /health
    progress: bool = False
    server_flags: tuple[str, ...] = ()  # more of the started server's flags, e.g. ("--quantize", "int8")
    prompts: str = "random"  # "random" prompt ids, or "edits": code to rewrite (``edit_prompts``)

    def __post_init__(self) -> None:
        check_field_types(
            self,
            ints=("n_requests", "max_len", "max_batch"),
            optional_ints=("threads",),
            numbers=("prompt_median", "output_median", "startup_timeout"),
        )
        if not self.rates or any(not isinstance(r, (int, float)) or not 0 < r < math.inf for r in self.rates):
            raise ValueError(f"rates must be positive request rates (per second), got {self.rates!r}")
        if self.url is not None and not str(self.url).startswith(("http://", "https://")):
            raise ValueError(f"url must start with http:// or https://, got {self.url!r}")
        if min(self.prompt_median, self.output_median) < 1 or self.max_len < 2:
            raise ValueError("prompt_median and output_median must be >= 1 token, max_len >= 2")
        if self.prompts not in PROMPT_KINDS:
            raise ValueError(f"prompts must be one of {PROMPT_KINDS}, got {self.prompts!r}")
        if self.prompts == "edits" and self.url is not None:
            raise ValueError("prompts='edits' needs the model's tokenizer here: give model, not url")


# ---------------------------------------------------------------------------------------------
# Figures


def latency_figures(metrics: Sequence[RequestMetrics], slo: SLO, seconds: float) -> dict:
    """TTFT, TPOT, ITL and end-to-end percentiles (ms); the goodput over ``seconds`` (requests/s
    within the SLO) and the % of the requests within it."""
    latency = {f"{name}_ms": ms(p) for name, p in latency_percentiles(metrics, PS).items()}
    return {**latency, "goodput_rps": goodput(metrics, slo, seconds), "slo_met_pct": slo_met_pct(metrics, slo)}


def ms(seconds: dict[str, float] | None) -> dict[str, float] | None:
    return None if seconds is None else {k: 1e3 * v for k, v in seconds.items()}


def rate_figures(rate: float, measured: Sequence[Measured], slo: SLO) -> dict:
    """One rate's run: throughput at the client over its span (first send to last token), both
    sides' latencies, what HTTP adds, and how late the client itself sent. The engine's clock has
    no span of its own (each request's starts when it arrives): its goodput is over the client's."""
    client = [m.client for m in measured]
    seconds = span(client)
    tp = throughput(client, seconds)
    ttft_gap = [m.client.ttft - m.engine.ttft for m in measured]
    tpot_gap = [m.client.tpot - m.engine.tpot for m in measured if m.client.output_tokens > 1]
    return {
        "rate": rate,
        "requests": len(measured),
        "seconds": seconds,
        "input_tokens_per_s": tp["input_tokens_per_s"],
        "output_tokens_per_s": tp["output_tokens_per_s"],
        "requests_per_s": tp["requests_per_s"],
        "client": latency_figures(client, slo, seconds),
        "engine": latency_figures([m.engine for m in measured], slo, seconds),
        "goodput_over": "the client's span (seconds), on both sides",
        "http_ttft_ms_p50": 1e3 * percentiles(ttft_gap, (50,))["p50"],
        "http_tpot_ms_p50": 1e3 * percentiles(tpot_gap, (50,))["p50"] if tpot_gap else None,
        "send_delay_ms": ms(percentiles([m.send_delay for m in measured], PS)),
    }


def workload(options: ServeBench, vocab_size: int, run: int, rate: float, edits=None) -> list[Request]:
    """The chat-like requests of one rate: the same lengths at every rate, arrivals scaled, and
    fresh prompt ids per run (so no run finds another's prompts in the prefix cache). With
    ``edits`` (``edit_prompts``), each request's prompt is the next of them instead, after one random
    token of its own (which keeps the prefix cache out of the comparison), its output length the
    trace's."""
    o = options
    trace = chat_trace(o.n_requests, rate, o.prompt_median, SIGMA, o.output_median, SIGMA, o.max_len, o.seed)
    requests = requests_from_trace(trace, vocab_size, seed=options.seed + 1000 * (run + 1))
    if edits is None:
        return requests
    for i, r in enumerate(requests):
        prompt = edits[(run * len(requests) + i) % len(edits)][-(o.max_len - r.max_tokens - 1) :]
        r.prompt = [r.prompt[0], *prompt]
    return requests


def edit_prompts(model: str) -> list[list[int]]:
    """Prompts whose answers copy them, as a request to edit code does: a method of the corpus's
    validation split, then its ``def`` line again (chapter 8's "rewrite a function" task)."""
    from ..bench.lookup import method_rewrites
    from ..core.checkpoints import resolve
    from ..core.tokenizer import Tokenizer

    return method_rewrites(Tokenizer.from_dir(resolve(model)))


def bench_serve(options: ServeBench) -> dict:
    """Every rate of ``options`` served over HTTP; the figures with where they were measured."""
    edits = edit_prompts(options.model) if options.prompts == "edits" else None
    if options.url is None:
        o = options
        server = server_process(o.model, o.max_batch, o.threads, o.startup_timeout, o.server_flags)
    else:
        server = nullcontext(options.url.rstrip("/"))
    with server as url:
        card = wait_healthy(url, options.startup_timeout)
        on = card.get("served_on", {})
        figures = provenance(on.get("device", str(best_device())), card["id"], on.get("dtype"))
        figures.update(hardware=on.get("hardware", figures["hardware"]), threads=on.get("threads"), url=options.url)
        figures["workload"] = {
            "requests_per_rate": options.n_requests,
            "prompt_median": options.prompt_median,
            "output_median": options.output_median,
            "max_len": options.max_len,
            "seed": options.seed,
            "max_batch": on.get("max_batch"),
            "prompts": options.prompts,
            "server_flags": list(options.server_flags),
        }
        figures["slo"] = {"ttft_s": options.slo.ttft, "tpot_s": options.slo.tpot}
        total = options.n_requests * len(options.rates)
        runs = []
        with tqdm(total=total, desc="bench serve", unit="req", disable=not options.progress) as bar:
            for i, rate in enumerate(options.rates):
                requests = workload(options, card["vocab_size"], i, rate, edits)
                runs.append(rate_figures(rate, run_workload(url, card["id"], requests, bar), options.slo))
        figures["runs"] = runs
    return finish_provenance(figures)


SERVE_COLUMNS = {
    "rate": "req/s",
    "at": "at",
    "ttft_p50": "TTFT p50",
    "ttft_p90": "p90",
    "ttft_p99": "p99",
    "tpot_p50": "TPOT p50",
    "tpot_p90": "p90",
    "tpot_p99": "p99",
    "itl_p99": "ITL p99",
    "goodput": "goodput",
    "slo_met_pct": "in SLO %",
    "e2e_p50": "end-to-end p50",
    "e2e_p90": "end-to-end p90",
    "e2e_p99": "end-to-end p99",
}


def _added(ms: float, what: str) -> str:
    """What HTTP adds to a latency, signed, never "+0.00" or "-0.00": below 0.005 ms it is nil."""
    if abs(ms) < 0.005:
        return f"under 0.01 ms {what}"
    return f"{ms:+.2f} ms {what}"


def format_serve(figures: dict) -> str:
    """Client and engine latencies per rate in one table (in blocks that fit 88 columns), then per
    rate the throughput, what HTTP adds and how late the client sent, and where it was measured."""
    rows = []
    for run in figures["runs"]:
        for side in ("client", "engine"):
            f = run[side]
            row = {"rate": run["rate"], "at": side, "goodput": f["goodput_rps"], "slo_met_pct": f["slo_met_pct"]}
            for measure, ps in (("ttft", PS), ("tpot", PS), ("itl", (99,)), ("e2e", PS)):
                row.update({f"{measure}_p{p}": (f[f"{measure}_ms"] or {}).get(f"p{p}") for p in ps})
            rows.append(row)
    slo = figures["slo"]
    title = (
        f"{figures['workload']['requests_per_rate']} streamed requests per rate; ms; goodput: req/s "
        f"within TTFT {1e3 * slo['ttft_s']:.0f} ms, TPOT {1e3 * slo['tpot_s']:.0f} ms, over the client's span"
    )
    lines = [format_table(rows, SERVE_COLUMNS, title=title, keys=2)]
    for run in figures["runs"]:
        tpot, late = run["http_tpot_ms_p50"], run.get("send_delay_ms")  # runs saved before it: no send delay
        text = f"{run['rate']:g} req/s: {run['output_tokens_per_s']:.0f} output tokens/s; HTTP adds (p50) "
        text += f"{run['http_ttft_ms_p50']:+.1f} ms TTFT" + (f", {_added(tpot, 'TPOT')}" if tpot is not None else "")
        if late is not None:
            text += f"; the client sent {late['p50']:.1f} ms (p50), {late['p99']:.1f} ms (p99) after schedule"
        lines += textwrap.wrap(text, 88, subsequent_indent="  ")
    lines += textwrap.wrap(describe(figures), 88)
    return "\n".join(lines)


def curve_rows(figures: dict) -> list[dict]:
    """Rows for ``viz.serving.plot_latency_throughput``: one curve measured at the client, one by the engine."""
    rows = []
    for run in figures["runs"]:
        for side, label in (("client", "client (HTTP)"), ("engine", "engine")):
            f = run[side]
            p99, p50 = f["ttft_ms"]["p99"], (f["tpot_ms"] or {}).get("p50")
            rows.append(
                {
                    "policy": label,
                    "rate": run["rate"],
                    "tokens_per_s": run["output_tokens_per_s"],
                    "ttft_p99_ms": p99,
                    "tpot_p50_ms": p50,
                }
            )
    return rows
