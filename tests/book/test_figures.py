"""Every figure of the book is legible at the page's width (issue 29): each public plotting
function of ``minillm.viz``, called as the chapters call it, makes a figure that
``viz.style.check_figure`` finds nothing wrong with (at most 6.9 in, so 760 px, wide after tight
cropping; no text under 7 pt; legends clear of the data; bars from zero; zoomed axes that say so).
A new plotting function must be added here, and every figure committed in a chapter fits the
column."""

import base64
import inspect
import json
import os
import types
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

import minillm.viz  # noqa: E402
from minillm.viz import (  # noqa: E402  # noqa: E402
    capstone,
    compression,
    decoding,
    disagg,
    guide,
    kv,
    paging,
    parallel,
    roofline,
    sampling,
    serving,
    style,
)
from minillm.viz.style import MAX_WIDTH_PX, check_figure, png_size, set_plot_style  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
MODULES = [capstone, compression, decoding, disagg, guide, kv, paging, parallel, roofline, sampling, serving]
HARDWARE = "cpu-epyc-2core (AMD EPYC 7B13, 2 cores), torch 2.5.1, float32"
NOT_PLOTS = {  # public functions of viz modules that make no figure, and why
    "decoding.tree_layout": "node positions for draw_tree",
    "disagg.mode_colors": "a color per mode",
    "disagg.best_ratio": "picks a row",
    "parallel.ring_schedule": "which block each rank holds",
    "sampling.describe": "a panel's caption",
    "sampling.interactive_sampling": "sliders over sampling_grid (a live kernel)",
    "kv.interactive_kv_calculator": "sliders that print",
}
PAGE_PX = 770  # a committed figure wider than this is shrunk on the page


def as_figure(made) -> Figure:
    return made if isinstance(made, Figure) else made.figure


# ---------------------------------------------------------------------------------------------
# Inputs like the chapters' own


def _sampling():
    logits = torch.tensor([6.1, 5.2, 4.9, 4.0, 3.7, 3.1, 2.8, 2.2, 1.9, 1.5, 1.1, 0.4])
    labels = ["'get'", "'main'", "'_'", "'test'", "'__'", "'init'", "'run'", "'f'", "'load'", "'set'", "'c'", "'x'"]
    settings = [
        {"temperature": 0},
        {"temperature": 1.0},
        {"temperature": 0.5},
        {"temperature": 2.0},
        {"temperature": 1.0, "top_k": 4},
        {"temperature": 1.0, "top_p": 0.5},
    ]
    yield (
        "sampling_grid",
        lambda: sampling.sampling_grid(
            logits, labels, settings, title=f"Next-token distribution after 'def ', minillm-target, {HARDWARE}"
        ),
    )


def _serving_ch2():
    from minillm.measure.metrics import SLO
    from minillm.measure.trace import Service, load_sweep, replay_fcfs

    rng = np.random.default_rng(0)
    latencies = list(rng.lognormal(np.log(120), 0.3, 200))
    services = [Service(16, tuple(0.05 + 0.02 * i for i in range(16))) for _ in range(8)]
    arrivals = [0.0, 0.1, 0.15, 0.5, 0.7, 0.75, 1.2, 1.3]
    yield (
        "plot_latency_histogram",
        lambda: serving.plot_latency_histogram(
            latencies, "end-to-end latency (ms)", f"Latency of 200 requests, minillm-target, {HARDWARE}"
        ),
    )
    yield (
        "plot_timeline",
        lambda: serving.plot_timeline(
            replay_fcfs(services, arrivals), services, f"Requests served one at a time, {HARDWARE}"
        ),
    )
    yield (
        "plot_load_sweep",
        lambda: serving.plot_load_sweep(
            load_sweep(services, [0.5, 1.0, 2.0, 4.0], SLO()), SLO(), f"Goodput falls behind the load, {HARDWARE}"
        ),
    )


def _serving_ch13():
    from minillm.bench.batching import RateSweep, rate_sweep
    from minillm.measure.metrics import SLO
    from minillm.serving.engine import Engine, EngineConfig, StepCost
    from minillm.serving.scheduler import SchedulerConfig
    from tests.serving.test_engine import MODEL, shared_prefix_workload

    cost, slo = StepCost(5e-3, 5e-4, 1e-4), SLO(1.0, 0.05)
    engines, outputs = {}, {}
    for policy in ("static", "dynamic", "continuous"):
        engines[policy] = Engine(MODEL, EngineConfig(40, 4, scheduler=SchedulerConfig(policy, 4), step_cost=cost))
        outputs[policy] = engines[policy].run(shared_prefix_workload(8))
    sweep = RateSweep(
        [5.0, 20.0, 50.0],
        cost,
        slo,
        ("static", "dynamic", "continuous"),
        n_requests=12,
        max_batch=4,
        prompt_median=8,
        output_median=8,
        max_len=32,
    )
    rows = rate_sweep(MODEL.config, sweep)
    title = f"Three batching policies, minillm-target, {HARDWARE}"
    yield (
        "plot_batch_timeline",
        lambda: serving.plot_batch_timeline({p: e.step_log for p, e in engines.items()}, 4, title),
    )
    yield "plot_step_costs", lambda: serving.plot_step_costs(engines["continuous"].step_log, cost, title)
    yield "plot_rate_sweep", lambda: serving.plot_rate_sweep(rows, slo, title)
    yield "plot_latency_throughput", lambda: serving.plot_latency_throughput(rows, slo, title)
    runs = {"without chunked prefill": outputs["continuous"], "with chunked prefill": outputs["dynamic"]}
    yield "plot_itl", lambda: serving.plot_itl(runs, [0, 1, 2], title=f"Gap before each token, measured, {HARDWARE}")


def _roofline():
    from minillm.measure.roofline import Roofline

    roof = Roofline(peak_flops=1.2e11, peak_bandwidth=1.5e10)
    points = [("prefill (measured)", 60.0, 6e10), ("decode (measured)", 1.0, 9e9)]
    points += [(f"decode, batch {b}", float(b), min(1.2e11, 1.4e10 * b)) for b in (2, 8, 32)]
    yield (
        "plot_roofline",
        lambda: roofline.plot_roofline(
            roof, points, title=f"Prefill is right of decode on the roofline, minillm-target\n{HARDWARE}"
        ),
    )


def _kv():
    from minillm import preset

    def result(per_token_ms):
        return types.SimpleNamespace(ttft=0.05, token_times=[t / 1e3 for t in per_token_ms])

    n = 120
    cached = result([5.0 + 0.01 * i for i in range(n)])
    recomputed = result([5.0 + 0.3 * i for i in range(n)])
    shapes = [preset("Llama-2-13B"), preset("Llama-3-8B"), preset("Llama-3.2-1B")]
    curves = {
        "sliding window": [(w, 30 + 400 / w) for w in (16, 32, 64, 128, 256)],
        "H2O": [(w, 30 + 200 / w) for w in (16, 32, 64, 128, 256)],
        "SnapKV": [(w, 30 + 150 / w) for w in (16, 32, 64, 128, 256)],
    }
    bench = [
        {"technique": t, "context": c, "kv_bytes": b * c, "tokens_per_s": s}
        for c in (512, 2048)
        for t, b, s in (("MHA (control)", 4096, 40.0), ("GQA 2 heads", 1024, 52.0), ("MQA", 512, 55.0))
        + (("int8 KV", 2048, 35.0), ("sliding window 256", 1024, 50.0))
    ]
    saved = {
        "batch_size": 16,
        "seq_len": 256,
        "curves": {str(h): [(s, 200 / (1 + s / 50) + 20 * (4 - h)) for s in (0, 50, 100, 200)] for h in (4, 2, 1)},
    }
    yield (
        "plot_cache_vs_recompute",
        lambda: kv.plot_cache_vs_recompute(
            cached, recomputed, 16, title=f"Each token costs more and more without a cache, batch 1\n{HARDWARE}"
        ),
    )
    yield (
        "plot_kv_vs_weights",
        lambda: kv.plot_kv_vs_weights(
            shapes, "bf16", title="The cache outgrows the weights at batch x context = the marked point"
        ),
    )
    yield (
        "plot_quality",
        lambda: kv.plot_quality(
            curves,
            "tokens kept in the cache (window or budget)",
            30.0,
            title=f"Perplexity as the cache keeps fewer tokens, minillm-target, 512-token segments\n{HARDWARE}",
        ),
    )
    yield "plot_kv_bench", lambda: kv.plot_kv_bench(bench, title=f"Each technique against MHA, {HARDWARE}")
    yield (
        "plot_uptraining",
        lambda: kv.plot_uptraining(
            saved, 4, title=f"Uptraining after mean-pooling, minillm-target, saved run on {HARDWARE}"
        ),
    )


def _paging():
    from minillm.kv.paged import BlockManager

    bm = BlockManager(16, 4)
    system = list(range(100, 108))
    prompts = {0: system + [1, 2, 3, 4, 5], 1: system + [6, 7, 8], 2: [9, 10, 11, 12, 13, 14]}
    for sid, toks in prompts.items():
        cached = bm.match_prefix(sid, toks)
        bm.prepare_write(sid, cached, len(toks))
        bm.commit(sid, toks, len(toks))
    bm.fork(1, 3)
    bm.prepare_write(3, 11, 12)
    names = {0: "A: system + question", 1: "B: system + question", 2: "C: another prompt", 3: "D: fork of B, +1 token"}
    yield (
        "plot_block_tables",
        lambda: paging.plot_block_tables(
            bm,
            {0: 13, 1: 11, 2: 6, 3: 12},
            names,
            title="Four sequences' block tables pointing into one pool (block size 4)",
        ),
    )


def _decoding():
    from minillm.decoding.lookahead import LookaheadTrace
    from minillm.decoding.medusa import MedusaTree

    rows = [
        {"k": k, "alpha": 0.7, "tokens_per_target_forward": 1 + 0.6 * k**0.7, "speedup": 1.2 + 0.1 * k}
        for k in (1, 2, 3, 4, 6, 8)
    ]
    predicted = {"i.i.d. model, c = 0.1": [1.3 + 0.1 * k for k in (1, 2, 3, 4, 6, 8)]}
    predicted["i.i.d. model, measured c"] = [1.2 + 0.08 * k for k in (1, 2, 3, 4, 6, 8)]
    task_rows = [
        {"task": t, "copyable": c, "speedup": 0.9 + c, "tokens_per_target_forward": 1 + 2 * c}
        for t, cs in (("free writing", (0.05, 0.1, 0.15)), ("summarize", (0.4, 0.5)), ("edit code", (0.7, 0.85)))
        for c in cs
    ]
    guesses = [[1, 2, 9, 9, 9, 9, 9, 9], [1, 2, 3, 9, 5, 9, 9, 9], [1, 2, 3, 4, 5, 6, 9, 8], [1, 2, 3, 4, 5, 6, 7, 8]]
    vocab = ["<s>", "def", " main", "(", "):", "⏎", "    ", "print", '("', "x"]
    trace = LookaheadTrace()
    trace.steps = [
        {"root": 1, "window": [], "candidates": [[1, 2]] * (i % 4), "accepted": [0] * (i % 3), "pool_size": 3 * i}
        for i in range(40)
    ]
    tree = MedusaTree.product((3, 2, 1))
    relative = {
        "this CPU, minillm-target (measured now)": {t: 1 + 0.08 * t for t in (1, 2, 4, 8, 16, 32, 64)},
        "H100, Llama-2-7B (roofline model)": {t: max(1.0, t / 40) for t in (1, 2, 4, 8, 16, 32, 64)},
    }
    methods = {
        "speculative K=4": (5.0, 2.6),
        "prompt lookup": (11.0, 1.8),
        "lookahead": (45.0, 1.5),
        "Medusa": (10.0, 2.1),
    }
    split = [
        {"method": m, "ms_per_round": a + b, "forward_ms_per_round": a, "other_ms_per_round": b}
        | {"plain_step_ms": 9.0, "speedup": s}
        for m, a, b, s in (
            ("greedy", 9.0, 0.5, 1.0),
            ("speculative K=4", 22.0, 3.0, 1.4),
            ("prompt lookup", 11.0, 1.5, 1.3),
            ("lookahead", 12.0, 6.0, 1.1),
            ("Medusa", 10.5, 2.5, 1.6),
            ("speculative K=4, compiled", 15.0, 2.0, 1.7),
        )
    ]
    title = f"minillm-target, batch 1, {HARDWARE}"
    yield "plot_speculative_sweep", lambda: decoding.plot_speculative_sweep(rows, predicted, title=title)
    yield (
        "plot_acceptance_vs_temperature",
        lambda: decoding.plot_acceptance_vs_temperature(
            {0.0: 0.62, 0.5: 0.66, 1.0: 0.71, 1.5: 0.74}, {0.0: 0.65, 1.0: 0.69}, title=title
        ),
    )
    yield (
        "plot_speedup_map",
        lambda: decoding.plot_speedup_map(
            4, {"draft model": (0.7, 0.15), "self-draft": (0.95, 1.0), "n-gram": (0.4, 0.01)}, title=title
        ),
    )
    yield "plot_lookup_by_task", lambda: decoding.plot_lookup_by_task(task_rows, title=title)
    yield (
        "plot_jacobi",
        lambda: decoding.plot_jacobi(
            guesses, [1, 2, 3, 4, 5, 6, 7, 8], vocab, title=f"Jacobi iterations on a block of 8 tokens\n{title}"
        ),
    )
    block = [(3 * i) % 10 for i in range(16)]
    wide_guesses = [[t if i < 4 * it else 9 for i, t in enumerate(block)] for it in range(5)]
    yield (
        "plot_jacobi (16 tokens, as chapter 9)",
        lambda: decoding.plot_jacobi(
            wide_guesses, block, vocab, title=f"Jacobi iterations on a block of 16 tokens\n{title}"
        ),
    )
    big = torch.tril(torch.ones(44, 44, dtype=torch.bool))
    names = [f"{kind}{i}" for kind, n in (("w", 20), ("g", 24)) for i in range(n)]
    yield "plot_mask (a lookahead forward, 44 tokens)", lambda: decoding.plot_mask(big, names, title="one forward")
    yield (
        "plot_lookahead_trace",
        lambda: decoding.plot_lookahead_trace(trace, title=f"Lookahead (W=5, N=4, G=5), {title}"),
    )
    yield "draw_tree", lambda: decoding.draw_tree(tree, accepted=[0, 1, 4], title="candidate tree of one step")
    yield "plot_mask", lambda: decoding.plot_mask(tree.attention_mask(), title="the tree's attention mask")
    yield (
        "plot_break_even",
        lambda: decoding.plot_break_even(
            relative, methods, title="A method gains where its star is above the cost line"
        ),
    )
    yield "plot_round_split", lambda: decoding.plot_round_split(split, title=title)


def _compression():
    torch.manual_seed(0)
    w = torch.randn(256, 128) * 0.02
    w[0, :4] = 0.3
    rounded = {
        "int8 per channel": (w * 127 / w.abs().amax(1, keepdim=True)).round() * w.abs().amax(1, keepdim=True) / 127,
        "int4 per channel (g=128)": (w * 7 / w.abs().amax(1, keepdim=True)).round() * w.abs().amax(1, keepdim=True) / 7,
        "int4 g32": (w * 7 / 0.05).round().clamp(-8, 7) * 0.05 / 7,
    }
    bits = [
        {"name": "int8", "bits": 8.125, "perplexity": 48.42},
        {"name": "fp8", "bits": 8.125, "perplexity": 48.47},
        {"name": "int4 g256", "bits": 4.25, "perplexity": 49.21},
        {"name": "int4 g128", "bits": 4.25, "perplexity": 49.18},
        {"name": "int4 g64", "bits": 4.5, "perplexity": 48.9},
        {"name": "int4 g32", "bits": 5.0, "perplexity": 48.7},
    ]
    matmul = [
        {"format": f, "rows": r, "ms": r * base * (1 + (0.2 if f != "bf16" and r > 8 else 0)) / 1e3}
        for f, base in (("bf16", 30.0), ("int8", 20.0), ("int4 g128", 14.0), ("fp8 e4m3", 24.0))
        for r in (1, 4, 16, 64, 256)
    ]
    speed = [
        {"technique": t, "batch": b, "vs_bf16": v}
        for b in (1, 8)
        for t, v in (("bf16", 1.0), ("int8", 0.93), ("int4 g128", 1.4), ("fp8 e4m3", 0.8), ("structured 25%", 1.2))
    ]
    curves = {"magnitude": [(0.2, 31.0), (0.4, 45.0), (0.5, 80.0), (0.6, 300.0), (0.7, 2000.0)]}
    curves["Wanda"] = [(0.2, 30.5), (0.4, 38.0), (0.5, 55.0), (0.6, 150.0), (0.7, 900.0)]
    marks = {"magnitude 2:4": (0.5, 400.0), "Wanda 2:4": (0.5, 120.0)}
    yield (
        "plot_rounding",
        lambda: compression.plot_rounding(w, rounded, title="minillm-target, layers.2.mlp.gate_up_proj"),
    )
    yield (
        "plot_quality_vs_bits",
        lambda: compression.plot_quality_vs_bits(
            bits, 48.38, title=f"Perplexity against bits per weight, minillm-target, {HARDWARE}"
        ),
    )
    yield (
        "plot_matmul_times",
        lambda: compression.plot_matmul_times(
            matmul, title=f"One linear layer by weight format, SmolLM2-135M shape, {HARDWARE}"
        ),
    )
    yield (
        "plot_decode_speed",
        lambda: compression.plot_decode_speed(speed, title=f"saved run: random SmolLM2-135M, on {HARDWARE}"),
    )
    yield (
        "plot_pruning",
        lambda: compression.plot_pruning(
            curves, 30.2, title=f"Perplexity as weights are removed, minillm-target, {HARDWARE}", marks=marks
        ),
    )


def _disagg():
    rng = np.random.default_rng(0)
    t = np.sort(rng.uniform(0, 12, 300))
    colocated = [(x, 20 + (400 if any(0 < x - a < 0.3 for a in (3.0, 8.0)) else 0) + rng.normal(0, 2)) for x in t]
    runs = {"colocated": colocated, "disaggregated 1:1": [(x, 22 + rng.normal(0, 2)) for x in t]}
    runs["chunked prefill"] = [(x, 24 + (60 if any(0 < x - a < 0.5 for a in (3.0, 8.0)) else 0)) for x in t]
    goodput = [
        {"mode": mode, "rate": rate, "goodput_rps": rate * share, "slo_met_pct": 100 * share}
        for mode, shares in (
            ("colocated", (1.0, 0.9, 0.5, 0.2)),
            ("chunked", (1.0, 0.95, 0.7, 0.4)),
            ("disagg 1:1", (1.0, 1.0, 0.9, 0.6)),
        )
        for rate, share in zip((5.0, 10.0, 20.0, 30.0), shares)
    ]
    ratios = [
        {"ratio": r, "workers": n, "max_rate_rps": g, "max_rate_per_gpu": g / n}
        for r, n, g in (("1:1", 2, 6.0), ("1:2", 3, 10.5), ("2:1", 3, 7.0), ("1:3", 4, 12.0))
    ]
    transfer = [
        {"model": m, "link": link, "transfer_ms": tt, "prefill_ms": p}
        for m, p, ts in (("minillm-target", 15.0, (0.05, 1.2, 25.0)), ("Llama-3-8B", 120.0, (0.6, 14.0, 268.0)))
        for link, tt in zip(("NVLink 900 GB/s", "InfiniBand 50 GB/s", "gloo TCP (this machine)"), ts)
    ]
    yield (
        "draw_disaggregation",
        lambda: disagg.draw_disaggregation(1, 2, title="Disaggregated: prefill and decode on separate workers"),
    )
    yield "draw_colocated", lambda: disagg.draw_colocated(2, title="Colocated: every worker runs both phases")
    yield (
        "plot_itl_series",
        lambda: disagg.plot_itl_series(
            runs, arrivals=[3.0, 8.0], title=f"Token gaps while two long prompts arrive, {HARDWARE}"
        ),
    )
    yield (
        "plot_goodput_vs_rate",
        lambda: disagg.plot_goodput_vs_rate(goodput, title="H100 cost model, Llama-3-8B", measured=False),
    )
    yield (
        "plot_pd_ratio",
        lambda: disagg.plot_pd_ratio(ratios, title="Goodput per worker by split, H100 cost model (simulated)"),
    )
    yield (
        "plot_kv_transfer",
        lambda: disagg.plot_kv_transfer(transfer, title="Time to hand one 2048-token prompt's K/V over"),
    )
    yield (
        "plot_step_timeline",
        lambda: disagg.plot_step_timeline(
            _timelines(), (1.0, 1.3), tracked=0, title="Llama-3-8B, two H100s per mode, 24 req/s"
        ),
    )


def _timelines() -> dict:
    """Three modes' steps over 300 ms: decode steps of 7 ms, prompts whole, chunked or apart."""

    def steps(worker, pattern, t=1.0):
        rows = []
        for prefill, decode, ms in pattern:
            rows.append(
                {"worker": worker, "start": t, "end": t + ms / 1e3, "prefill_tokens": prefill, "decode_rows": decode}
            )
            t += ms / 1e3
        return rows

    whole = [(0, 7, 7)] * 8 + [(1423, 7, 50)] + [(0, 7, 7)] * 6 + [(2048, 7, 70)] + [(0, 7, 7)] * 15
    chunks = [(0, 7, 7)] * 8 + [(377, 7, 18.4)] * 4 + [(0, 7, 7)] * 6 + [(377, 7, 18.4)] * 6 + [(0, 7, 7)] * 8
    timelines = {
        "colocated": {"lanes": ["replica 0", "replica 1"], "steps": steps(0, whole) + steps(1, whole[3:])},
        "chunked": {"lanes": ["replica 0", "replica 1"], "steps": steps(0, chunks) + steps(1, chunks[5:])},
        "disagg 1:1": {
            "lanes": ["prefill worker", "decode worker"],
            "steps": steps(0, [(795, 0, 30), (3471, 0, 110), (4930, 0, 155)]) + steps(1, [(0, 14, 7.5)] * 40),
            "handoffs": [{"worker": 1, "ready": 1.07}, {"worker": 1, "ready": 1.18}],
        },
    }
    for t in timelines.values():
        ends = sorted(s["end"] for s in t["steps"] if s["worker"] == len(t["lanes"]) - 1)
        t["tokens"] = {0: [x for x in ends if x <= 1.3]}
        t["longest_gap_ms"] = 1e3 * max(b - a for a, b in zip(ends, ends[1:]))
    return timelines


def _parallel():
    from minillm.parallel.pipeline import Interval

    timeline = [[Interval("prefill", 0, i, (i + r) * 0.01, (i + r + 0.9) * 0.01) for i in range(6)] for r in range(4)]
    speedup = [
        {"model": "Llama-2-70B", "link": "NVLink", "gpus": g, "predicted_speedup": p, "published_speedup": q}
        for g, p, q in ((1, 1.0, 1.0), (2, 1.8, 1.7), (4, 3.2, 3.0), (8, 5.5, 5.1))
    ] + [
        {"model": "Llama-2-70B", "link": "PCIe", "gpus": g, "predicted_speedup": p}
        for g, p in ((1, 1.0), (2, 1.3), (4, 1.6), (8, 1.7))
    ]
    comm = [
        {"kind": "TP all-reduce", "measured": 196608, "formula": 196608},
        {"kind": "pipeline send", "measured": 24576, "formula": 24576},
        {"kind": "ring K/V", "measured": 98304, "formula": 98304},
        {"kind": "all-gather", "measured": 1024, "formula": 1024},
    ]
    yield "draw_parallelism_kinds", parallel.draw_parallelism_kinds
    yield "plot_pipeline_timeline", lambda: parallel.plot_pipeline_timeline(timeline, 4, 6, hardware=HARDWARE)
    yield "plot_ring_steps", lambda: parallel.plot_ring_steps(4)
    yield "plot_ring_steps (8 ranks)", lambda: parallel.plot_ring_steps(8)
    yield "plot_ring_steps (16 ranks)", lambda: parallel.plot_ring_steps(16)
    yield "plot_causal_work", lambda: parallel.plot_causal_work({"contiguous": [1, 3, 5, 7], "zigzag": [4, 4, 4, 4]})
    yield "plot_tp_speedup", lambda: parallel.plot_tp_speedup(speedup)
    yield "plot_comm_bytes", lambda: parallel.plot_comm_bytes(comm, hardware=HARDWARE)


def _capstone_and_guide():
    from minillm.bench.capstone_tables import gpu_ladder_rows
    from minillm.book.guide import decision_guide
    from minillm.measure.report import load_results

    saved = next(iter(load_results("bench_capstone").values()))
    check = {"sections": {"capstone": {"recompute (baseline)": {"decode_tokens_per_s": 5.0}}}}
    check["sections"]["decode"] = {"compiled": {"tokens_per_s": 50.0}}
    title = f"One rung at a time: random {saved['shape']}, {saved['hardware']}"
    yield "plot_ladder", lambda: capstone.plot_ladder(saved["ladder"], title=title)
    yield (
        "plot_ladder (with a GPU run)",
        lambda: capstone.plot_ladder(saved["ladder"], title=title, gpu_rows=gpu_ladder_rows(check)),
    )
    yield "plot_serving", lambda: capstone.plot_serving(saved["serving"], title=f"Serving, {saved['hardware']}")
    from minillm.book.guide import STAGES

    for stage in STAGES:  # one figure per stage, as chapter 16 draws them
        entries = [e for e in decision_guide() if e.stage == stage]
        yield f"plot_decision_guide {stage}", lambda entries=entries: guide.plot_decision_guide(entries)


def cases() -> dict:
    found = {}
    for group in (
        _sampling,
        _serving_ch2,
        _serving_ch13,
        _roofline,
        _kv,
        _paging,
        _decoding,
        _compression,
        _disagg,
        _parallel,
        _capstone_and_guide,
    ):
        for name, make in group():
            found[name] = make
    return found


CASES = cases()


@pytest.fixture(autouse=True)
def book_style():
    with matplotlib.rc_context():
        set_plot_style()
        yield
    plt.close("all")


@pytest.mark.parametrize("name", list(CASES))
def test_every_figure_keeps_the_rules(name):
    fig = as_figure(CASES[name]())
    if os.environ.get("MINILLM_FIGURES"):  # a folder to look at them in
        fig.savefig(Path(os.environ["MINILLM_FIGURES"]) / f"{name.split(' ')[0]}{'_gpu' if 'GPU' in name else ''}.png")
    assert check_figure(fig) == []


def public_plots() -> set[str]:
    found = set()
    for module in MODULES:
        short = module.__name__.rsplit(".", 1)[1]
        for name, fn in inspect.getmembers(module, inspect.isfunction):
            if fn.__module__ == module.__name__ and not name.startswith("_"):
                found.add(f"{short}.{name}")
    return found


def test_every_plotting_function_is_checked():
    covered = set(NOT_PLOTS)
    for module in MODULES:
        short = module.__name__.rsplit(".", 1)[1]
        covered |= {f"{short}.{name.split(' ')[0]}" for name in CASES if hasattr(module, name.split(" ")[0])}
    missing = public_plots() - covered
    assert not missing, f"plotting functions without a case in tests/book/test_figures.py: {sorted(missing)}"
    modules = {p.stem for p in Path(minillm.viz.__file__).parent.glob("*.py")} - {"__init__", "style"}
    assert modules == {m.__name__.rsplit(".", 1)[1] for m in MODULES}, "a viz module this test does not know"
    assert style.check_figure in vars(style).values()


def test_the_checker_fails_a_wide_figure_and_a_small_label():
    fig, ax = plt.subplots(figsize=(12, 4))
    ax.plot([0, 1], [0, 1])
    ax.set(xlabel="x (s)", ylabel="y (ms)")
    problems = check_figure(fig)
    assert any("px wide" in p for p in problems) and any("12.00 in wide" in p for p in problems)
    fig, ax = plt.subplots(figsize=(5, 3))
    ax.plot([0, 1], [0, 1])
    ax.set_xlabel("time (s)", fontsize=5)
    assert check_figure(fig) == ["5 pt text 'time (s)'"]


def test_the_checker_fails_a_legend_over_a_histogram_bars_off_zero_and_an_unmarked_zoom():
    fig, ax = plt.subplots(figsize=(5, 3))
    ax.hist(np.random.default_rng(0).normal(size=2000), bins=40, label="the values")
    ax.legend(loc="center")
    assert any(p.startswith("legend (the values) over the data") for p in check_figure(fig))
    fig, ax = plt.subplots(figsize=(5, 3))
    ax.bar([0, 1], [48.4, 49.2])
    ax.set_ylim(48, 49.5)
    assert any("start at 48" in p for p in check_figure(fig))
    fig, ax = plt.subplots(figsize=(5, 3))
    ax.plot([4, 8], [48.4, 49.2], "o")
    assert any("is zoomed and does not say so" in p for p in check_figure(fig))
    ax.set_ylabel("perplexity (zoomed)")
    assert check_figure(fig) == []


def test_finish_says_a_zoomed_axis_is_zoomed_and_wraps_a_long_title():
    fig, ax = plt.subplots(figsize=(5, 3))
    ax.plot([4, 8], [48.4, 49.2], "o-")
    ax.set(ylabel="perplexity", title="a title far longer than the five inches of this figure hold " * 2)
    style.finish(fig)
    assert ax.get_ylabel() == "perplexity (zoomed)" and "\n" in ax.get_title()
    assert check_figure(fig) == []


def png_widths(nb: dict) -> list[tuple[int, int]]:
    """(cell index, width in px) of every PNG a notebook's outputs hold."""
    found = []
    for i, cell in enumerate(nb["cells"]):
        for out in cell.get("outputs", []):
            data = out.get("data", {}).get("image/png")
            if data:
                png = base64.b64decode("".join(data) if isinstance(data, list) else data)
                found.append((i, png_size(png)[0]))
    return found


@pytest.mark.parametrize("path", sorted((ROOT / "chapters").glob("*.ipynb")), ids=lambda p: p.stem)
def test_every_committed_figure_fits_the_column(path):
    wide = [(i, w) for i, w in png_widths(json.loads(path.read_text())) if w > PAGE_PX]
    assert not wide, f"{path.name}: figures wider than {PAGE_PX} px (cell, px): {wide}"


def test_png_size_reads_the_header():
    fig, _ = plt.subplots(figsize=(2, 1))
    assert MAX_WIDTH_PX == 759
    assert png_size(base64.b64decode(base64.b64encode(_png(fig)))) == (220, 110)


def _png(fig) -> bytes:
    import io

    buf = io.BytesIO()
    with matplotlib.rc_context({"savefig.bbox": "standard"}):
        fig.savefig(buf, format="png", dpi=110)
    return buf.getvalue()
