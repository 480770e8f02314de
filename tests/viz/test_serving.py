"""The serving plots of chapters 2 and 13 draw from what the library returns."""

import matplotlib
import numpy as np

from minillm.bench.batching import RateSweep, rate_sweep
from minillm.measure.metrics import SLO
from minillm.measure.trace import Service, load_sweep, replay_fcfs
from minillm.serving.engine import Engine, EngineConfig, StepCost
from minillm.serving.scheduler import SchedulerConfig
from minillm.viz.serving import (
    plot_batch_timeline,
    plot_itl,
    plot_latency_histogram,
    plot_latency_throughput,
    plot_load_sweep,
    plot_rate_sweep,
    plot_step_costs,
    plot_timeline,
)
from tests.serving.test_engine import MODEL, shared_prefix_workload


def test_chapter_2_plots_draw(tmp_path):
    matplotlib.use("Agg")
    ax = plot_latency_histogram(list(np.linspace(1, 10, 20)), "e2e (ms)", "t")
    assert "p50" in ax.get_legend().get_texts()[0].get_text()
    services = [Service(1, (0.1, 0.2))] * 3
    plot_timeline(replay_fcfs(services, [0.0, 0.05, 0.5]), services, "t")
    ax = plot_load_sweep(load_sweep(services, [1.0, 5.0], SLO()), SLO(), "t")
    ax.figure.savefig(tmp_path / "sweep.png")


def test_chapter_13_plots_draw(tmp_path):
    matplotlib.use("Agg")
    cost, slo = StepCost(5e-3, 5e-4, 1e-4), SLO(1.0, 0.05)
    engines = {}
    for policy in ("static", "continuous"):
        engines[policy] = Engine(MODEL, EngineConfig(40, 4, scheduler=SchedulerConfig(policy, 3), step_cost=cost))
        outputs = engines[policy].run(shared_prefix_workload(6))
    sweep = RateSweep(
        [5.0, 50.0],
        cost,
        slo,
        ("static", "continuous"),
        n_requests=10,
        max_batch=3,
        prompt_median=8,
        output_median=8,
        max_len=32,
    )
    rows = rate_sweep(MODEL.config, sweep)
    figs = [
        plot_batch_timeline({p: e.step_log for p, e in engines.items()}, 3, "t"),
        plot_step_costs(engines["continuous"].step_log, cost),
        plot_rate_sweep(rows, slo),
        plot_latency_throughput(rows, slo),
        plot_itl({"run": outputs}, [0, 1]),
    ]
    for i, fig in enumerate(figs):
        fig.savefig(tmp_path / f"{i}.png")
