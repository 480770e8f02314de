"""What the serving benchmarks of chapters 6 and 13 share: fresh copies of requests, a measured
run after a warm-up, a run on the simulated clock, and the figures of a finished run.

    outputs, engine = simulate(model.config, requests, EngineConfig(256, 16, step_cost=StepCost()))
    figures = serving_figures(outputs, engine, SLO(ttft=1.0, tpot=0.05))
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..core.config import ModelConfig
from ..core.model import Transformer
from ..measure.metrics import SLO, goodput, latency_percentiles, slo_met_pct, throughput
from ..serving.engine import Engine, EngineConfig, RequestOutput, SimulatedModel
from ..serving.workload import Request, copy_requests  # noqa: F401 (copy_requests: importable from here too)


def run_measured(
    model: Transformer, requests: Sequence[Request], config: EngineConfig, progress: bool = False
) -> tuple[list[RequestOutput], Engine]:
    """Serve copies of ``requests`` on the wall clock, after a short run of another engine of the
    same config has paid the one-off costs (allocator, kernel selection)."""
    engine = Engine(model, config)
    warm = Engine(model, config)
    warm.run([Request(list(r.prompt), 2) for r in requests[:2]])
    return served(engine.run(copy_requests(requests), progress=progress)), engine


def simulate(
    config: ModelConfig, requests: Sequence[Request], engine_config: EngineConfig
) -> tuple[list[RequestOutput], Engine]:
    """Serve copies of ``requests`` with the engine's real scheduler and block manager, a
    ``SimulatedModel`` in place of the model, and the clock of ``engine_config.step_cost``."""
    engine = Engine(SimulatedModel(config), engine_config)
    return served(engine.run(copy_requests(requests))), engine


def served(outputs: list[RequestOutput]) -> list[RequestOutput]:
    """The outputs of a benchmark run, or a ValueError naming the first request that failed: a
    benchmark's figures would be wrong with a request that was not served."""
    failed = [o for o in outputs if o.finish_reason == "error"]
    if failed:
        raise ValueError(f"{len(failed)} request(s) failed, the first ({failed[0].request.id}) with {failed[0].error}")
    return outputs


def serving_figures(outputs: Sequence[RequestOutput], engine: Engine, slo: SLO | None = None) -> dict:
    """The figures of a finished run: output tokens/s and requests/s, the run's length (s), TTFT and
    TPOT p50/p99 (ms), the mean rows per step, steps, preemptions, padding rows, the measured KV
    waste (%), and with an ``slo`` the goodput (requests/s) and the % of requests within it."""
    metrics = [o.metrics for o in outputs]
    tp = throughput(metrics)
    latency = latency_percentiles(metrics, (50, 99))
    ttft, tpot = latency["ttft"], latency["tpot"] or dict.fromkeys(("p50", "p99"), float("nan"))
    figures = {
        "tokens_per_s": tp["output_tokens_per_s"],
        "requests_per_s": tp["requests_per_s"],
        "seconds": engine.now,
        "ttft_p50_ms": 1e3 * ttft["p50"],
        "ttft_p99_ms": 1e3 * ttft["p99"],
        "tpot_p50_ms": 1e3 * tpot["p50"],
        "tpot_p99_ms": 1e3 * tpot["p99"],
        "mean_batch": float(np.mean([len(r.work) for r in engine.step_log])),
        "steps": engine.steps,
        "preemptions": engine.scheduler.preemptions,
        "padding_rows": engine.padding_rows,
        "measured_kv_waste_pct": 100 * engine.kv_waste,
    }
    if slo is not None:
        figures.update(goodput_rps=goodput(metrics, slo), slo_met_pct=slo_met_pct(metrics, slo))
    return figures
