"""Chapter 14's GPU-sized measurements, on the simulated clock (``serving.cluster``; step costs
from the roofline, an estimate): a GPU-sized model (Llama-3-8B on H100s by default), goodput
against the request rate for colocated, chunked and disaggregated serving (``simulated_goodput``),
and DistServe's figure of merit, the highest rate that keeps 90% of requests within the SLO per
GPU, by P:D ratio (``pd_ratio_sweep``) and in the scenarios where disaggregation should win and
where it should not (``scenario_table``), and every worker's steps over a short window of one
trace, per mode (``step_timelines``, for the timeline figure). ``run_figures`` gives the figures
of one run, measured (``bench.disagg``) or simulated.

    rows = simulated_goodput(SimulatedSweep(rates=(8.0, 16.0)))
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from ..core.config import check_field_types, preset
from ..measure.links import LINKS, Link
from ..measure.metrics import SLO, latency_percentiles, throughput
from ..measure.report import format_table
from ..serving.cluster import ClusterConfig, ClusterRun, roofline_step_cost, simulate_cluster
from ..serving.engine import EngineConfig, RequestOutput
from ..serving.scheduler import SchedulerConfig
from ..serving.step_cost import StepCost
from ..serving.workload import Request, chat_trace, requests_from_trace
from .batching import SIGMA


def run_figures(outputs: Sequence[RequestOutput], slo: SLO, rate: float) -> dict:
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


def simulate_run(sweep: SimulatedSweep, mode: str, rate: float, prefill: int = 1, decode: int = 1) -> ClusterRun:
    """One simulated run, whole: its outputs, every worker's step log and every handoff."""
    return simulate_cluster(preset(sweep.model), sweep.requests(rate), sweep.cluster(mode, prefill, decode))


def simulate_mode(sweep: SimulatedSweep, mode: str, rate: float, prefill: int = 1, decode: int = 1) -> dict:
    """One simulated run: the figures of ``run_figures`` plus the handoffs' mean transfer time."""
    run = simulate_run(sweep, mode, rate, prefill, decode)
    figures = run_figures(run.outputs, sweep.slo, rate)
    moved = [t for t in run.transfers if t is not None]
    figures["transfer_ms"] = 1e3 * float(np.mean([t.seconds + t.link_wait for t in moved])) if moved else 0.0
    return figures


def three_ways(sweep: SimulatedSweep) -> dict[str, tuple[str, int, int]]:
    """The three ways of serving on ``sweep.workers`` GPUs that the chapter compares, by name:
    (mode, prefill workers or replicas, decode workers): colocated and chunked replicas, and one
    prefill worker with the rest decode workers."""
    w = sweep.workers
    return {"colocated": ("colocated", w, 0), "chunked": ("chunked", w, 0), f"disagg 1:{w - 1}": ("disagg", 1, w - 1)}


def simulated_goodput(sweep: SimulatedSweep | None = None) -> list[dict]:
    """Goodput against the rate for the ``three_ways`` of serving, the same number of GPUs each."""
    s = sweep or SimulatedSweep()
    return [
        {"mode": name, "rate": rate, **simulate_mode(s, mode, rate, p, d)}
        for rate in s.rates
        for name, (mode, p, d) in three_ways(s).items()
    ]


def max_rate_within_slo(
    sweep: SimulatedSweep, mode: str, prefill: int, decode: int, attainment: float = 90.0, steps: int = 6
) -> float:
    """The highest rate at which ``attainment`` % of requests meet the SLO: bisection (on a log scale,
    ``steps`` halvings) from the lowest of ``sweep.rates`` (for the whole cluster) up to the highest
    times the workers. 0 if even the lowest fails; the upper end if it passes."""
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
        rows.append({"ratio": mode, "workers": 1, "max_rate_rps": rate, "max_rate_per_gpu": rate})
    for p, d in ratios:
        rate = max_rate_within_slo(s, "disagg", p, d, steps=steps)
        rows.append({"ratio": f"{p}:{d}", "workers": p + d, "max_rate_rps": rate, "max_rate_per_gpu": rate / (p + d)})
    return rows


def budget_sweep(
    sweep: SimulatedSweep | None = None, budgets: Sequence[int] = (64, 128, 256, 512, 1024), steps: int = 6
) -> list[dict]:
    """Chunked prefill tuned (Sarathi-Serve's knob): for each token budget, how long a step that
    carries a full budget of prompt tokens takes on the sweep's step cost (every running decode
    waits that long for its next token while a long prompt is chunked), and one chunked GPU's
    highest rate with 90% of requests within the SLO (``max_rate_within_slo``), beside one
    colocated GPU's (no budget: a prompt is prefilled whole)."""
    s = sweep or SimulatedSweep()
    cost = s.engine().step_cost
    rows = [
        {
            "token_budget": None,
            "chunk_step_ms": None,
            "max_rate": max_rate_within_slo(s, "colocated", 1, 0, steps=steps),
        }
    ]
    for budget in budgets:
        rate = max_rate_within_slo(replace(s, token_budget=budget), "chunked", 1, 0, steps=steps)
        rows.append({"token_budget": budget, "chunk_step_ms": 1e3 * cost(0, budget), "max_rate": rate})
    return rows


# ---------------------------------------------------------------------------------------------
# A window of steps, for the timeline figure (interference drawn as DistServe draws it)


def step_rows(run: ClusterRun, window: tuple[float, float] | None = None) -> list[dict]:
    """Every step of every worker of ``run``, from the engines' step logs (simulated clock, s): its
    worker (the prefill workers or colocated replicas first, then the decode workers), start,
    end, prompt tokens, decode rows and the requests it carried; with a ``window`` (start, end),
    only the steps that overlap it."""
    rows = []
    for worker, engine in enumerate(run.engines):
        for r in engine.step_log:
            if window is None or (r.end > window[0] and r.start < window[1]):
                rows.append(
                    {
                        "worker": worker,
                        "start": r.start,
                        "end": r.end,
                        "prefill_tokens": r.prefill_tokens,
                        "decode_rows": r.decode_rows,
                        "requests": [rid for rid, _ in r.work],
                    }
                )
    return rows


def _longest_gap(
    outputs: Sequence[RequestOutput], window: tuple[float, float], first: bool
) -> tuple[float, int | None]:
    """The longest gap (ms) between two tokens of a request, both within ``window``, and its
    request: the gaps between its first and second tokens (``first``; disaggregated, the K/V
    handoff is in it) or those between its later tokens, each a decode step's."""
    gaps = [
        (1e3 * (b - a), o.request.id)
        for o in outputs
        for k, (a, b) in enumerate(zip(o.metrics.token_times, o.metrics.token_times[1:]))
        if (k == 0) == first and window[0] <= a and b <= window[1]
    ]
    return max(gaps, default=(0.0, None))


def step_timelines(sweep: SimulatedSweep, rate: float, window: tuple[float, float]) -> dict[str, dict]:
    """The same arrivals at ``rate`` served the ``three_ways`` on ``sweep.workers`` GPUs, as in
    ``simulated_goodput`` (chunked replicas run ``sweep.token_budget`` tokens a step), each cut
    to ``window`` (start, end; s) by ``window_of``."""
    if not (len(window) == 2 and 0 <= window[0] < window[1]):
        raise ValueError(f"window must be (start, end) seconds with 0 <= start < end, got {window!r}")
    runs = {name: simulate_run(sweep, mode, rate, p, d) for name, (mode, p, d) in three_ways(sweep).items()}
    return {name: window_of(run, window) for name, run in runs.items()}


def window_of(run: ClusterRun, window: tuple[float, float]) -> dict:
    """A run cut to ``window`` (start, end; s), for ``viz.disagg.plot_step_timeline``: the lanes'
    names (one per worker), the steps (``step_rows``), the handoffs whose K/V are ready within it
    (the decode worker's lane, sent and ready times), each request's token times within it, the
    requests decoding from its start to its end (``through``), the longest gap between two later
    tokens of a request within it (ms; from its second token on, each a decode step's) with its
    request, and the longest gap between a first token and a second."""
    front, back = len(run.prefill_engines), len(run.decode_engines)
    if back:
        lanes = ["prefill worker"] if front == 1 else [f"prefill worker {i}" for i in range(front)]
        lanes += ["decode worker"] if back == 1 else [f"decode worker {j}" for j in range(back)]
    else:
        lanes = [f"replica {i}" for i in range(front)]
    tokens = {}
    for o in run.outputs:
        if inside := [t for t in o.metrics.token_times if window[0] <= t <= window[1]]:
            tokens[o.request.id] = inside
    gap, request = _longest_gap(run.outputs, window, first=False)
    return {
        "lanes": lanes,
        "steps": step_rows(run, window),
        "handoffs": [
            {"worker": front + t.decode_worker, "request": t.request_id, "sent": t.sent, "ready": t.ready}
            for t in run.transfers
            if t is not None and window[0] <= t.ready <= window[1]
        ],
        "tokens": tokens,
        "through": [
            o.request.id
            for o in run.outputs
            if o.metrics.token_times and o.metrics.token_times[0] < window[0] < window[1] < o.metrics.token_times[-1]
        ],
        "longest_gap_ms": gap,
        "longest_gap_request": request,
        "longest_first_gap_ms": _longest_gap(run.outputs, window, first=True)[0],
    }


def tracked_request(timelines: Mapping[str, Mapping]) -> int | None:
    """The first request (lowest id) that decodes through the whole window in every mode, if any."""
    common = set.intersection(*(set(t["through"]) for t in timelines.values()))
    return min(common, default=None)


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
        best = max(pd[2:], key=lambda r: r["max_rate_per_gpu"])
        rows.append(
            {
                "scenario": name,
                "colocated": pd[0]["max_rate_per_gpu"],
                "chunked": pd[1]["max_rate_per_gpu"],
                "best P:D": best["ratio"],
                "disagg": best["max_rate_per_gpu"],
            }
        )
    return rows


BUDGET_COLUMNS = {
    "budget": "token budget",
    "chunk_step_ms": "a full chunk's step (ms)",
    "max_rate": "highest rate in SLO (req/s per GPU)",
}


def format_budgets(rows: Sequence[Mapping], title: str = "") -> str:
    """``budget_sweep``'s rows: colocated first (no budget), then each budget."""
    shown = [{**r, "budget": r["token_budget"] or "none (colocated)"} for r in rows]
    title = title or "Chunked prefill by token budget, one GPU (simulated clock, roofline step costs)"
    return format_table(shown, BUDGET_COLUMNS, title=title)


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
    if sim.get("budgets"):
        parts.append(format_budgets(sim["budgets"]))
    return "\n\n".join(parts)
