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
3. ``simulated_goodput`` and ``pd_ratio_sweep``: a GPU-sized model (Llama-3-8B on H100s by
   default) on the simulated clock (``serving.cluster``; step costs from the roofline, an
   estimate): goodput against the request rate for the three modes, and DistServe's figure of
   merit, the highest rate that keeps 90% of requests within the SLO per GPU, by P:D ratio.

    figures = bench_disagg(DisaggBench(rates=(2.0, 4.0)))
    print(format_disagg(figures))
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace

import numpy as np

from ..core.config import check_field_types, preset
from ..measure.links import LINKS, Link, kv_bytes, kv_transfer_rows
from ..measure.metrics import SLO, latency_percentiles, percentiles, throughput
from ..measure.report import finish_provenance, format_table, provenance
from ..serving.cluster import ClusterConfig, roofline_step_cost, simulate_cluster
from ..serving.disagg import DisaggConfig, DisaggOutput, DisaggregatedEngine, ReplicatedEngine
from ..serving.engine import EngineConfig
from ..serving.scheduler import SchedulerConfig
from ..serving.step_cost import StepCost, fit_step_cost
from ..serving.workload import Request, chat_trace, requests_from_trace
from .batching import SIGMA, InterferenceWorkload, interference_workload, itl_figures
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


def run_figures(outputs: Sequence[DisaggOutput], slo: SLO, rate: float) -> dict:
    """TTFT and TPOT p50/p99 (ms), output tokens/s, the % of requests within the SLO and goodput:
    the offered ``rate`` times that fraction (requests/s within the SLO while the load lasts; a
    count over the whole run's span would also charge the drain after the last arrival)."""
    metrics = [o.metrics for o in outputs]
    latency = latency_percentiles(metrics, (50, 99))
    tp = throughput(metrics)
    tpot = latency["tpot"] or dict.fromkeys(("p50", "p99"), float("nan"))
    met = sum(slo.met_by(m) for m in metrics) / len(metrics)
    return {
        "ttft_p50_ms": 1e3 * latency["ttft"]["p50"],
        "ttft_p99_ms": 1e3 * latency["ttft"]["p99"],
        "tpot_p50_ms": 1e3 * tpot["p50"],
        "tpot_p99_ms": 1e3 * tpot["p99"],
        "tokens_per_s": tp["output_tokens_per_s"],
        "goodput_rps": rate * met,
        "slo_met_pct": 100 * met,
    }


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
    """The GPU-sized simulations: goodput vs rate, the P:D sweep and the scenarios."""
    cost = asdict(sweep.engine().step_cost)
    return {
        "options": asdict(sweep),
        "step_cost": cost,
        "clock": "simulated: roofline step costs (an estimate), not a measurement",
        "goodput": simulated_goodput(sweep),
        "pd_ratio": pd_ratio_sweep(sweep),
        "scenarios": scenario_table(sweep),
    }


def kv_transfer_table(tokens: int = 4096) -> list[dict]:
    """One 4k-token request of Llama-3-8B and of Llama-3-70B (bf16 K/V) over each link, next to its
    prefill on one H100 at 50% MFU (a roofline estimate, ``measure.links``)."""
    return kv_transfer_rows([preset("Llama-3-8B"), preset("Llama-3-70B")], tokens, list(LINKS.values()))


# ---------------------------------------------------------------------------------------------
# GPU-sized, on the simulated clock


@dataclass(frozen=True)
class SimulatedSweep:
    """A GPU-sized cluster on the simulated clock: the model (a preset), one accelerator's peak
    FLOP/s and memory bandwidth (default: an H100 SXM's datasheet, bf16), the link between prefill
    and decode workers, a chat-like workload and the SLO."""

    model: str = "Llama-3-8B"
    peak_flops: float = 989e12
    bandwidth: float = 3.35e12
    link: str = "RDMA 400 Gb/s"  # a key of measure.links.LINKS, or "<name>=<GB/s>"
    rates: tuple[float, ...] = (8.0, 16.0, 24.0, 32.0, 40.0)  # requests/s (whole cluster; per GPU in pd_ratio_sweep)
    duration: float = 20.0  # seconds of arrivals per run: a short burst would hide a queue that keeps growing
    min_requests: int = 100  # requests per run at least
    prompt_median: float = 1024
    output_median: float = 128
    max_len: int = 4096
    max_batch: int = 64
    num_blocks: int = 8192  # blocks of 16 tokens per worker
    token_budget: int = 512  # chunked prefill
    workers: int = 2  # GPUs per mode in the rate sweep (colocated replicas, or 1P + 1D)
    slo: SLO = field(default_factory=lambda: SLO(ttft=1.0, tpot=0.02, max_itl=0.25))
    seed: int = 0
    step_cost: StepCost | None = None  # None: the roofline estimate; else e.g. one fitted to a GPU's steps

    def __post_init__(self) -> None:
        check_field_types(self, ints=("min_requests", "max_len", "max_batch", "num_blocks", "token_budget", "workers"))
        if not (math.isfinite(self.duration) and self.duration > 0):
            raise ValueError(f"duration must be positive seconds, got {self.duration!r}")
        if self.workers < 2:
            raise ValueError(f"workers must be at least 2 (a prefill and a decode worker), got {self.workers}")
        self.link_spec()

    def link_spec(self) -> Link:
        if self.link in LINKS:
            return LINKS[self.link]
        name, _, gbs = self.link.partition("=")
        try:
            return Link(name, float(gbs) * 1e9, LINKS["RDMA 400 Gb/s"].latency, "")
        except ValueError:
            raise ValueError(f"link must be one of {list(LINKS)} or '<name>=<GB/s>', got {self.link!r}") from None

    def engine(self, chunked: bool = False) -> EngineConfig:
        cost = self.step_cost or roofline_step_cost(preset(self.model), self.peak_flops, self.bandwidth)
        budget = self.token_budget if chunked else None
        return EngineConfig(
            self.num_blocks, 16, False, SchedulerConfig("continuous", self.max_batch, token_budget=budget), cost
        )

    def cluster(self, mode: str, prefill: int = 1, decode: int = 1) -> ClusterConfig:
        if mode in ("colocated", "chunked"):
            return ClusterConfig(prefill=self.engine(mode == "chunked"), prefill_workers=prefill, decode_workers=0)
        link = self.link_spec()
        return ClusterConfig(
            prefill=self.engine(),
            prefill_workers=prefill,
            decode_workers=decode,
            transfer_seconds_per_byte=1 / link.bandwidth,
            transfer_latency=link.latency,
        )

    def requests(self, rate: float) -> list[Request]:
        n = max(self.min_requests, math.ceil(rate * self.duration))
        trace = chat_trace(n, rate, self.prompt_median, SIGMA, self.output_median, SIGMA, self.max_len, self.seed)
        return requests_from_trace(trace, preset(self.model).vocab_size, self.seed)


def simulate_mode(sweep: SimulatedSweep, mode: str, rate: float, prefill: int = 1, decode: int = 1) -> dict:
    """One simulated run: the figures of ``run_figures`` plus the handoffs' mean transfer time."""
    run = simulate_cluster(preset(sweep.model), sweep.requests(rate), sweep.cluster(mode, prefill, decode))
    figures = run_figures(run.outputs, sweep.slo, rate)
    moved = [t for t in run.transfers if t is not None]
    figures["transfer_ms"] = 1e3 * float(np.mean([t.seconds + t.link_wait for t in moved])) if moved else 0.0
    return figures


def simulated_goodput(sweep: SimulatedSweep | None = None) -> list[dict]:
    """Goodput against the rate for colocated and chunked replicas and 1:(workers-1) disaggregation,
    the same number of GPUs each."""
    s = sweep or SimulatedSweep()
    rows = []
    for rate in s.rates:
        for mode in ("colocated", "chunked"):
            rows.append({"mode": mode, "rate": rate, **simulate_mode(s, mode, rate, prefill=s.workers)})
        name = f"disagg 1:{s.workers - 1}"
        rows.append({"mode": name, "rate": rate, **simulate_mode(s, "disagg", rate, 1, s.workers - 1)})
    return rows


def max_rate_within_slo(
    sweep: SimulatedSweep, mode: str, prefill: int, decode: int, attainment: float = 90.0, steps: int = 6
) -> float:
    """The highest rate at which ``attainment`` % of requests meet the SLO: bisection (on a log scale,
    ``steps`` halvings) between the lowest and highest of ``sweep.rates``, taken per worker, times the
    workers. 0 if even the lowest fails; the highest if it passes."""
    workers = prefill + decode
    low, high = min(sweep.rates), max(sweep.rates) * workers

    def ok(rate: float) -> bool:
        return simulate_mode(sweep, mode, rate, prefill, decode)["slo_met_pct"] >= attainment

    if not ok(low):
        return 0.0
    if ok(high):
        return high
    for _ in range(steps):
        mid = math.sqrt(low * high)
        low, high = (mid, high) if ok(mid) else (low, mid)
    return low


def pd_ratio_sweep(
    sweep: SimulatedSweep | None = None,
    ratios: Sequence[tuple[int, int]] = ((1, 1), (1, 2), (2, 1), (1, 3), (3, 1)),
    steps: int = 6,
) -> list[dict]:
    """DistServe's per-GPU goodput (Zhong et al., 2024): the highest rate at which 90% of requests
    meet the SLO, divided by the GPUs, for one colocated GPU, one chunked GPU and each P:D ratio.
    ``sweep.rates`` bound the search, per GPU."""
    s = sweep or SimulatedSweep()
    rows = []
    for mode in ("colocated", "chunked"):
        rate = max_rate_within_slo(s, mode, 1, 0, steps=steps)
        rows.append({"ratio": mode, "workers": 1, "goodput_rps": rate, "goodput_per_worker": rate})
    for p, d in ratios:
        rate = max_rate_within_slo(s, "disagg", p, d, steps=steps)
        rows.append({"ratio": f"{p}:{d}", "workers": p + d, "goodput_rps": rate, "goodput_per_worker": rate / (p + d)})
    return rows


SCENARIOS = {  # where disaggregation should win, and where it should not (changes to SimulatedSweep)
    "long prompts, TPOT <= 20 ms": {},
    "short prompts, TPOT <= 100 ms": {
        "prompt_median": 64,
        "output_median": 256,
        "slo": SLO(ttft=1.0, tpot=0.1, max_itl=0.25),
    },
    "long prompts, 10 Gb/s link": {"link": "10 Gb/s Ethernet=1.25"},
}


def scenario_table(sweep: SimulatedSweep | None = None, ratios=((1, 1), (2, 1), (1, 2))) -> list[dict]:
    """Per-GPU goodput of colocated, chunked and the best P:D ratio in each of ``SCENARIOS``."""
    s = sweep or SimulatedSweep()
    rows = []
    for name, changes in SCENARIOS.items():
        pd = pd_ratio_sweep(replace(s, **changes), ratios)
        best = max(pd[2:], key=lambda r: r["goodput_per_worker"])
        rows.append(
            {
                "scenario": name,
                "colocated": pd[0]["goodput_per_worker"],
                "chunked": pd[1]["goodput_per_worker"],
                "best P:D": best["ratio"],
                "disagg": best["goodput_per_worker"],
            }
        )
    return rows


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
    return format_table(figures["goodput"], columns, title=title)


def format_transfer(figures: Mapping) -> str:
    t = figures["transfer"]
    rows = [
        {"what": "handoffs", "value": t["handoffs"]},
        {"what": "bytes that differ from the formula", "value": t["formula_mismatches"]},
        {"what": "K/V per request, MB (mean)", "value": t["mean_kv_mb"]},
        {"what": "transfer p50 / p99, ms", "value": f"{t['transfer_p50_ms']:.2f} / {t['transfer_p99_ms']:.2f}"},
        {"what": "transfer rate p50, GB/s", "value": t["rate_p50_gb_s"]},
        {"what": "first token -> taken in, p50 ms", "value": t["handoff_wait_p50_ms"]},
    ]
    return format_table(rows, {"what": "K/V handoffs (gloo, this machine)", "value": ""})


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


def format_simulated(sim: Mapping) -> str:
    o = sim["options"]
    slo = o["slo"]
    where = f"{o['model']}, roofline step costs ({o['peak_flops'] / 1e12:g} TFLOP/s, {o['bandwidth'] / 1e12:g} TB/s)"
    bound = f", max gap {1e3 * slo['max_itl']:g} ms" if slo.get("max_itl") else ""
    rule = f"SLO TTFT {slo['ttft']} s, TPOT {1e3 * slo['tpot']:g} ms{bound}"
    keys = ["mode", "rate", "ttft_p99_ms", "tpot_p99_ms", "goodput_rps", "slo_met_pct"]
    rows = [{k: r[k] for k in keys} for r in sim["goodput"]]
    parts = [
        format_table(rows, title=f"SIMULATED clock: {where}, {o['workers']} GPUs per mode, {rule}"),
        format_table(sim["pd_ratio"], title="Per-GPU goodput by P:D ratio (90% within the SLO; simulated)"),
        format_table(sim["scenarios"], title="Per-GPU goodput, req/s, where disaggregation wins and loses (simulated)"),
    ]
    return "\n\n".join(parts)


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
