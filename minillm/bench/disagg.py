"""Chapter 14's measurements: colocated, chunked and disaggregated serving side by side, with
real worker processes on this machine, and GPU-sized configurations on the simulated clock.

1. ``bench_disagg`` (``python -m minillm bench disagg``): the same workloads through two
   colocated replicas (each an engine doing prefill and decode; once without and once with
   chunked prefill) and through one prefill + one decode worker: the same number of processes,
   so the same cores. The interference workload (decodes running while long prompts arrive)
   gives each mode's inter-token gaps; a chat-like Poisson workload at several rates gives TTFT
   and TPOT p50/p99 and goodput under an SLO; the disaggregated runs give the K/V bytes moved
   (checked against the formula) and the time each transfer took, and the steps of each worker
   fit chapter 13's step-cost model (prefill and decode apart).
2. ``kv_transfer_table``: what moving one request's K/V would take on real links, next to its
   prefill (``measure.links``).
3. ``bench_simulated``: a GPU-sized model (Llama-3-8B on H100s by default) on the simulated
   clock (``bench.disagg_simulated``: ``simulated_goodput``, ``pd_ratio_sweep``, the scenarios).

    figures = bench_disagg(DisaggBench(rates=(2.0, 4.0)))
    print(format_disagg(figures))
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace

import numpy as np

from ..core.config import check_field_types, preset
from ..measure.links import LINKS, kv_bytes, kv_transfer_rows
from ..measure.metrics import SLO, percentiles
from ..measure.report import finish_provenance, format_table, provenance
from ..serving.disagg import DisaggConfig, DisaggOutput, DisaggregatedEngine, ReplicatedEngine
from ..serving.engine import EngineConfig
from ..serving.scheduler import SchedulerConfig
from ..serving.step_cost import fit_step_cost
from ..serving.workload import Request, chat_trace, requests_from_trace
from .batching import SIGMA, InterferenceWorkload, interference_workload, itl_figures
from .disagg_simulated import (
    SimulatedSweep,
    budget_sweep,
    format_simulated,
    pd_ratio_sweep,
    run_figures,
    scenario_table,
    simulated_goodput,
)
from .serving import served

MODES = ("colocated", "chunked", "disagg 1:1")


@dataclass(frozen=True)
class DisaggBench:
    """The options of ``bench_disagg``: the workers' engines, the two workloads and the SLO."""

    model: str = "minillm-target"
    max_batch: int = 16  # sequences per step in every worker
    num_blocks: int = 512  # KV blocks per worker
    block_size: int = 16
    token_budget: int = 128  # chunked prefill: tokens per step at most
    interference: InterferenceWorkload = field(default_factory=InterferenceWorkload)
    rates: tuple[float, ...] = (1.0, 2.0, 3.0)  # requests/s of the chat-like workload, one run each
    n_requests: int = 32  # requests per rate
    prompt_median: float = 256  # tokens (lognormal)
    output_median: float = 48  # tokens (lognormal)
    max_len: int = 1024  # prompt + output at most
    slo: SLO = field(default_factory=lambda: SLO(ttft=1.0, tpot=0.1))  # what a 2-core CPU can hold at low load
    seed: int = 0
    timeout: float = 120.0  # seconds, every wait inside the engines

    def __post_init__(self) -> None:
        check_field_types(self, ints=("max_batch", "num_blocks", "block_size", "token_budget", "n_requests", "max_len"))
        if not self.rates or any(not (isinstance(r, (int, float)) and math.isfinite(r) and r > 0) for r in self.rates):
            raise ValueError(f"rates must be positive requests/s, got {self.rates!r}")

    def config(self, chunked: bool = False) -> DisaggConfig:
        sched = SchedulerConfig("continuous", self.max_batch, token_budget=self.token_budget if chunked else None)
        engine = EngineConfig(self.num_blocks, self.block_size, scheduler=sched)
        plain = EngineConfig(self.num_blocks, self.block_size, scheduler=replace(sched, token_budget=None))
        return DisaggConfig(prefill=engine, decode=plain, timeout=self.timeout)

    def workload(self, rate: float, vocab_size: int) -> list[Request]:
        trace = chat_trace(
            self.n_requests, rate, self.prompt_median, SIGMA, self.output_median, SIGMA, self.max_len, self.seed
        )
        return requests_from_trace(trace, vocab_size, self.seed)


class Servers:
    """The two sets of processes a benchmark compares: two colocated replicas and one prefill + one
    decode worker, started once and closed together (``with Servers(options) as s: s.run(...)``)."""

    def __init__(self, options: DisaggBench):
        self.options = options
        self.replicas = ReplicatedEngine(options.model, 2, options.config())
        try:
            self.disagg = DisaggregatedEngine(options.model, 1, 1, options.config())
        except BaseException:
            self.replicas.close()
            raise
        self.vocab_size = self.disagg.model_config.vocab_size
        warm = [Request([1] * 64, 4, id=0), Request([2] * 8, 4, id=1)]
        for mode in MODES:  # one-off costs (allocator, first kernels) before anything is measured
            self.run(mode, warm)

    def run(self, mode: str, requests: Sequence[Request]) -> list[DisaggOutput]:
        if mode == "colocated":
            return self.replicas.run(requests, self.options.config())
        if mode == "chunked":
            return self.replicas.run(requests, self.options.config(chunked=True))
        if mode == "disagg 1:1":
            return self.disagg.run(requests)
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")

    def close(self) -> None:
        self.replicas.close()
        self.disagg.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def itl_series(outputs: Sequence[DisaggOutput], ids: Sequence[int]) -> list[tuple[float, float]]:
    """(time a token came out, s; the gap since that request's previous token, ms) for the requests ``ids``."""
    chosen = set(ids)
    points = []
    for o in outputs:
        if o.request.id in chosen:
            times = o.metrics.token_times
            points += [(t, 1e3 * (t - prev)) for prev, t in zip(times, times[1:])]
    return sorted(points)


def bench_interference(servers: Servers, workload: InterferenceWorkload) -> dict:
    """Each mode on the interference workload: gap figures and series of the decoding requests,
    and the long prompts' TTFT."""
    requests, ids = interference_workload(servers.vocab_size, workload)
    long_ids = [r.id for r in requests if r.id not in ids]
    runs = {}
    for mode in MODES:
        outputs = served(servers.run(mode, requests))
        long_ttft = [1e3 * o.metrics.ttft for o in outputs if o.request.id in long_ids]
        runs[mode] = {
            **itl_figures(outputs, ids),
            "long_ttft_p50_ms": percentiles(long_ttft, (50,))["p50"],
            "series": itl_series(outputs, ids),
        }
    arrivals = [r.arrival for r in requests if r.id in long_ids]
    return {"workload": asdict(workload), "arrivals": arrivals, "runs": runs}


def transfer_figures(outputs: Sequence[DisaggOutput], config) -> dict:
    """The disaggregated runs' K/V handoffs: bytes per request checked against the formula (fp32
    here), and the measured transfer times and rates."""
    moved = [o for o in outputs if o.decode_worker is not None]
    mismatched = sum(o.kv_bytes != kv_bytes(config, len(o.request.prompt), 4) for o in moved)
    seconds = [o.transfer_s for o in moved]
    rates = [o.kv_bytes / o.transfer_s for o in moved if o.transfer_s > 0]
    return {
        "handoffs": len(moved),
        "formula_mismatches": mismatched,
        "mean_kv_mb": float(np.mean([o.kv_bytes for o in moved])) / 1e6,
        "transfer_p50_ms": 1e3 * percentiles(seconds, (50,))["p50"],
        "transfer_p99_ms": 1e3 * percentiles(seconds, (99,))["p99"],
        "rate_p50_gb_s": percentiles(rates, (50,))["p50"] / 1e9,
        "handoff_wait_p50_ms": 1e3 * percentiles([o.handoff_wait_s for o in moved], (50,))["p50"],
    }


def bench_disagg(options: DisaggBench | None = None, simulated: SimulatedSweep | None = None) -> dict:
    """Everything of chapter 14 measured on this machine (see the module's docstring), and with
    ``simulated`` the GPU-sized sweeps on the simulated clock."""
    b = options or DisaggBench()
    record = provenance("cpu", b.model, "float32", workers=2, threads_per_worker=1, options=asdict(b))
    with Servers(b) as servers:
        record["interference"] = bench_interference(servers, b.interference)
        rows, handed = [], []
        for rate in b.rates:
            requests = b.workload(rate, servers.vocab_size)
            for mode in MODES:
                outputs = served(servers.run(mode, requests))
                rows.append({"mode": mode, "rate": rate, **run_figures(outputs, b.slo, rate)})
                if mode.startswith("disagg"):
                    handed += outputs
        logs = servers.disagg.step_logs
        record["goodput"] = rows
        record["transfer"] = transfer_figures(handed, servers.disagg.model_config)
        record["step_cost"] = {
            "prefill": asdict(fit_step_cost(logs[0])),
            "decode": asdict(fit_step_cost(logs[1])),
        }
    record["links"] = kv_transfer_table()
    finish_provenance(record)
    if simulated is not None:  # no processes of ours run now: the simulations take one core
        record["simulated"] = bench_simulated(simulated)
    return record


def bench_simulated(sweep: SimulatedSweep) -> dict:
    """The GPU-sized simulations: goodput vs rate, the P:D sweep, the scenarios and chunked
    prefill's token budget swept (the tuned baseline disaggregation has to beat)."""
    cost = asdict(sweep.engine().step_cost)
    return {
        "options": asdict(sweep),
        "step_cost": cost,
        "clock": "simulated: roofline step costs (an estimate), not a measurement",
        "goodput": simulated_goodput(sweep),
        "pd_ratio": pd_ratio_sweep(sweep),
        "scenarios": scenario_table(sweep),
        "budgets": budget_sweep(sweep),
    }


def kv_transfer_table(tokens: int = 4096) -> list[dict]:
    """One 4k-token request of Llama-3-8B and of Llama-3-70B (bf16 K/V) over each link, next to its
    prefill on one H100 at 50% MFU (a roofline estimate, ``measure.links``)."""
    return kv_transfer_rows([preset("Llama-3-8B"), preset("Llama-3-70B")], tokens, list(LINKS.values()))


# ---------------------------------------------------------------------------------------------
# Tables


def format_interference(figures: Mapping) -> str:
    runs = figures["interference"]["runs"]
    rows = [{"mode": mode, **r} for mode, r in runs.items()]
    columns = {
        "mode": "mode",
        "itl_p50_ms": "gap p50 ms",
        "itl_p99_ms": "gap p99 ms",
        "itl_max_ms": "gap max ms",
        "long_ttft_p50_ms": "long TTFT p50 ms",
    }
    return format_table(rows, columns, title="Decoding while long prompts arrive (measured)")


def format_goodput(figures: Mapping) -> str:
    slo = figures["options"]["slo"]
    columns = {
        "mode": "mode",
        "rate": "rate /s",
        "ttft_p50_ms": "TTFT p50",
        "ttft_p99_ms": "TTFT p99",
        "tpot_p50_ms": "TPOT p50",
        "tpot_p99_ms": "TPOT p99",
        "goodput_rps": "good /s",
        "slo_met_pct": "in SLO %",
    }
    title = f"Chat-like workload (measured), SLO TTFT {slo['ttft']} s, TPOT {1e3 * slo['tpot']:g} ms; times in ms"
    n = figures["options"].get("n_requests")
    if n is not None and n < 100:  # a p99 of fewer than 100 values is (nearly) the largest
        title += f"\n{n:,} requests per rate: each p99 is about the largest of them"
    return format_table(figures["goodput"], columns, title=title)


def format_transfer(figures: Mapping) -> str:
    t = figures["transfer"]
    rows = [
        {"what": "handoffs", "value": t["handoffs"]},
        {"what": "handoffs whose bytes differ from the formula", "value": t["formula_mismatches"]},
        {"what": "K/V per request, MB (mean)", "value": t["mean_kv_mb"]},
        {"what": "transfer p50 / p99, ms", "value": f"{t['transfer_p50_ms']:.2f} / {t['transfer_p99_ms']:.2f}"},
        {"what": "transfer rate p50, GB/s", "value": t["rate_p50_gb_s"]},
        {"what": "first token -> taken in, p50 ms", "value": t["handoff_wait_p50_ms"]},
    ]
    return format_table(rows, {"what": "measure", "value": "value"}, title="K/V handoffs (gloo, this machine)")


def format_links(rows: Sequence[Mapping]) -> str:
    body = [{**r, "kv_gb": r["kv_bytes"] / 1e9} for r in rows]
    columns = {
        "model": "model",
        "link": "link",
        "kv_gb": "K/V GB",
        "transfer_ms": "transfer ms",
        "prefill_ms": "prefill ms",
    }
    return format_table(body, columns, title="A 4k-token request's K/V (bf16) vs its prefill on one H100 (estimates)")


def format_disagg(figures: Mapping) -> str:
    from ..measure.report import describe, wrap_line

    parts = [
        "\n".join(wrap_line(f"{describe(figures)}; 2 worker processes per mode, 1 thread each")),
        format_interference(figures),
        format_goodput(figures),
        format_transfer(figures),
        format_links(figures["links"]),
    ]
    if "simulated" in figures:
        parts.append(format_simulated(figures["simulated"]))
    return "\n\n".join(parts)
