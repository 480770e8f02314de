"""Chapter 14's benchmarks: the measured comparison on real worker processes (tiny), the
simulated GPU-sized sweeps, the tables, and the command line's bad input."""

import json
import math
from dataclasses import replace

import pytest

from minillm.bench.batching import InterferenceWorkload
from minillm.bench.disagg import (
    MODES,
    DisaggBench,
    bench_disagg,
    format_disagg,
    kv_transfer_table,
)
from minillm.bench.disagg_simulated import (
    SimulatedSweep,
    budget_sweep,
    format_budgets,
    max_rate_within_slo,
    pd_ratio_sweep,
    run_figures,
    simulate_mode,
    simulate_run,
    simulated_goodput,
    step_rows,
    step_timelines,
    tracked_request,
)
from minillm.cli.main import main
from minillm.core.config import preset
from minillm.measure.metrics import SLO
from minillm.serving.cluster import simulate_cluster

pytestmark = pytest.mark.slow  # several processes, a compile or a server: make test-fast leaves it out

TINY_SIM = SimulatedSweep(rates=(4.0, 32.0), duration=1.0, min_requests=20)  # Llama-3-8B, prompts of ~1k


def test_bench_disagg_measures_all_three_modes_on_real_processes(tmp_path):
    options = DisaggBench(
        model="minillm-draft",
        num_blocks=64,
        rates=(8.0,),
        n_requests=6,
        prompt_median=32,
        output_median=8,
        max_len=128,
        interference=InterferenceWorkload(n_chat=2, chat_tokens=12, n_long=2, long_prompt=96, first=0.02, gap=0.05),
        timeout=60.0,
    )
    figures = bench_disagg(options)
    assert set(figures["interference"]["runs"]) == set(MODES)
    for run in figures["interference"]["runs"].values():
        assert run["itl_p99_ms"] >= run["itl_p50_ms"] > 0 and run["series"]
    assert [r["mode"] for r in figures["goodput"]] == list(MODES)
    for r in figures["goodput"]:
        assert 0 <= r["slo_met_pct"] <= 100 and math.isclose(r["goodput_rps"], 8.0 * r["slo_met_pct"] / 100)
    t = figures["transfer"]
    assert t["handoffs"] == 6 and t["formula_mismatches"] == 0 and t["transfer_p50_ms"] > 0
    assert figures["step_cost"]["prefill"]["per_prefill_token"] >= 0
    text = format_disagg(figures)
    assert "Decoding while long prompts arrive" in text and "handoffs whose bytes differ from the formula" in text
    assert max(len(line) for line in text.splitlines()) <= 88
    json.dumps(figures)  # saved as JSON


def test_simulated_sweeps_rank_the_modes():
    rows = simulated_goodput(TINY_SIM)
    assert [r["mode"] for r in rows] == ["colocated", "chunked", "disagg 1:1"] * 2
    low = {r["mode"]: r for r in rows if r["rate"] == 4.0}
    assert all(r["slo_met_pct"] == 100 for r in low.values())  # light load: every mode meets the SLO
    high = {r["mode"]: r for r in rows if r["rate"] == 32.0}
    assert high["disagg 1:1"]["tpot_p99_ms"] < high["colocated"]["tpot_p99_ms"]  # no prefill in decode steps
    assert high["disagg 1:1"]["transfer_ms"] > 0 and high["colocated"]["transfer_ms"] == 0


def test_max_rate_within_slo_brackets_the_attainment():
    tight = replace(TINY_SIM, rates=(2.0, 64.0), slo=SLO(ttft=0.5, tpot=0.01))
    rate = max_rate_within_slo(tight, "colocated", 1, 0, steps=4)
    assert 2.0 <= rate < 64.0
    assert simulate_mode(tight, "colocated", rate, 1, 0)["slo_met_pct"] >= 90
    assert simulate_mode(tight, "colocated", 64.0, 1, 0)["slo_met_pct"] < 90
    impossible = replace(TINY_SIM, slo=SLO(ttft=1e-6, tpot=1e-6))
    assert max_rate_within_slo(impossible, "colocated", 1, 0) == 0.0
    rows = pd_ratio_sweep(TINY_SIM, ratios=((1, 1),))
    assert [r["ratio"] for r in rows] == ["colocated", "chunked", "1:1"]
    assert rows[2]["max_rate_per_gpu"] == rows[2]["max_rate_rps"] / 2


def test_the_budget_sweep_prices_a_full_chunk_and_searches_each_budget():
    rows = budget_sweep(TINY_SIM, budgets=(64, 512), steps=2)
    assert [r["token_budget"] for r in rows] == [None, 64, 512]
    cost = TINY_SIM.engine().step_cost
    for r in rows[1:]:
        assert r["chunk_step_ms"] == pytest.approx(1e3 * (cost.fixed + cost.prefill_rate * r["token_budget"]))
        assert 0 <= r["max_rate"] <= max(TINY_SIM.rates)
    assert rows[0]["max_rate"] == max_rate_within_slo(TINY_SIM, "colocated", 1, 0, steps=2)
    text = format_budgets(rows)
    assert "none (colocated)" in text and max(len(line) for line in text.splitlines()) <= 88


@pytest.mark.parametrize("mode, prefill, decode", [("colocated", 2, 0), ("chunked", 2, 0), ("disagg", 1, 1)])
def test_the_recorded_steps_are_the_runs_own(mode, prefill, decode):
    """Reading the steps changes no figure; on each worker they follow one another without
    overlap, and each lasts what the cost model prices it (fused: one forward per step)."""
    sweep, rate = replace(TINY_SIM, token_budget=384), 32.0
    before = simulate_mode(sweep, mode, rate, prefill, decode)
    direct = simulate_cluster(preset(sweep.model), sweep.requests(rate), sweep.cluster(mode, prefill, decode))
    run = simulate_run(sweep, mode, rate, prefill, decode)
    rows = step_rows(run)
    step_timelines(sweep, rate, (0.2, 0.5))
    assert simulate_mode(sweep, mode, rate, prefill, decode) == before
    assert run_figures(run.outputs, sweep.slo, rate) == run_figures(direct.outputs, sweep.slo, rate)
    assert len(rows) == sum(len(e.step_log) for e in direct.engines)
    cost = sweep.engine(mode == "chunked").step_cost
    assert cost.fused
    for worker in range(prefill + decode):
        mine = [r for r in rows if r["worker"] == worker]
        assert mine and all(a["end"] <= b["start"] for a, b in zip(mine, mine[1:]))
        for r in mine:
            assert r["end"] - r["start"] == pytest.approx(cost(r["decode_rows"], r["prefill_tokens"]), rel=1e-9)
    if mode == "chunked":
        assert max(r["prefill_tokens"] + r["decode_rows"] for r in rows) <= 384
    if mode == "disagg":
        assert not any(r["prefill_tokens"] for r in rows if r["worker"] == 1)  # the decode worker runs no prompt


def test_step_timelines_cut_the_same_arrivals_to_a_window():
    window = (0.2, 0.5)
    timelines = step_timelines(replace(TINY_SIM, token_budget=384), 32.0, window)
    assert list(timelines) == ["colocated", "chunked", "disagg 1:1"]
    assert timelines["disagg 1:1"]["lanes"] == ["prefill worker", "decode worker"]
    assert timelines["colocated"]["lanes"] == ["replica 0", "replica 1"]
    for name, t in timelines.items():
        assert t["steps"] and all(s["end"] > window[0] and s["start"] < window[1] for s in t["steps"])
        assert all(window[0] <= x <= window[1] for times in t["tokens"].values() for x in times)
        assert set(t["through"]) <= set(t["tokens"])
        gaps = [1e3 * (b - a) for times in t["tokens"].values() for a, b in zip(times, times[1:])]
        assert t["longest_gap_ms"] <= max(gaps) + 1e-9
        assert (t["handoffs"] != []) == name.startswith("disagg")
        assert all(h["worker"] == 1 and window[0] <= h["ready"] <= window[1] for h in t["handoffs"])
    tracked = tracked_request(timelines)
    assert tracked is not None and all(tracked in t["through"] for t in timelines.values())
    assert timelines["disagg 1:1"]["longest_gap_ms"] < timelines["colocated"]["longest_gap_ms"]
    with pytest.raises(ValueError, match="window"):
        step_timelines(TINY_SIM, 32.0, (0.5, 0.2))


def test_kv_transfer_table_is_the_formula():
    rows = kv_transfer_table()
    eight = next(r for r in rows if r["model"] == "Llama-3-8B")
    assert eight["kv_bytes"] == 2 * 32 * 8 * 128 * 4096 * 2


@pytest.mark.parametrize(
    "field, value, match",
    [("rates", (0.0,), "rates"), ("n_requests", 0.5, "n_requests")],
)
def test_bad_options_are_named(field, value, match):
    with pytest.raises(ValueError, match=match):
        DisaggBench(**{field: value})


def test_simulated_sweep_bad_link():
    with pytest.raises(ValueError, match="link"):
        SimulatedSweep(link="carrier pigeon")


def test_cli_bad_input_exits_before_any_process(capsys):
    assert main(["bench", "disagg", "--rate", "-1", "--no-save"]) == 2
    assert "rates" in capsys.readouterr().err
    assert main(["bench", "disagg", "--model", "no-such-model", "--no-simulated", "--no-save"]) == 2
    assert "no-such-model" in capsys.readouterr().err
