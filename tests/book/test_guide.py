"""The decision guide (book.guide, viz.guide): every evidence sentence holds the figures of the
saved JSON it names, recomputed here from the raw fields; no saved run means a 'no saved run'
sentence, not an exception; a new result changes its entry; the chapters named exist; the text
fits the page; the diagram shows every symptom without overlapping text."""

import json
import shutil
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from minillm.book.guide import (  # noqa: E402
    STAGES,
    SYMPTOMS,
    decision_guide,
    format_guide,
    guide_markdown,
    result_date,
)
from minillm.measure.report import RESULTS_DIR  # noqa: E402
from minillm.viz.guide import STAGE_HEIGHT, plot_decision_guide  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def by_symptom(entries):
    return {e.symptom: e for e in entries}


def row(rows, **match):
    return next(r for r in rows if all(r[k] == v for k, v in match.items()))


# What each evidence sentence must contain, recomputed from the JSON fields (by result file)
def expect_compression(d):
    bf16, int4 = row(d["decode"], technique="bf16", batch=1), row(d["decode"], technique="int4 g128", batch=1)
    return [
        f"{int4['tokens_per_s'] / bf16['tokens_per_s']:.2f}x faster",
        f"{int4['model_bytes'] / bf16['model_bytes']:.2f}x the bytes",
    ]


def expect_disagg_prefill(d):
    p, dec = d["step_cost"]["prefill"]["per_prefill_token"], d["step_cost"]["decode"]
    step = dec["fixed"] + dec["per_token"]
    return [f"{p * 1e3:.3g} ms per prompt token", f"{step * 1e3:.1f} ms", f"{step / p:.0f} prompt tokens"]


def expect_generate_cache(d):
    r = max(d["cache_vs_recompute"]["rows"], key=lambda r: r["prompt_len"])
    return [f"{r['prompt_len']}-token", f"{r['cache_tokens_per_s'] / r['recompute_tokens_per_s']:.1f}x faster"]


def expect_generate_compile(d):
    v = d["vs_transformers"]
    eager, compiled = v["minillm"]["decode_tokens_per_s"], v["minillm_compiled"]["decode_tokens_per_s"]
    return [f"{compiled / eager:.2f}x eager", f"{compiled:.0f} vs {eager:.0f} tok/s", "same greedy tokens"]


def expect_decoding(d):
    r = row(d["rows"], method="prompt lookup (K=8, n<=3)")
    return [f"{r['speedup']:.2f}x greedy", f"{r['tokens_per_target_forward']:.2f} tokens per forward"]


def expect_kv(d):
    ctx = max(r["context"] for r in d["rows"])
    mha = row(d["rows"], technique="MHA (baseline)", context=ctx)["kv_bytes"]
    gqa = next(r for r in d["rows"] if r["technique"].startswith("GQA") and r["context"] == ctx)["kv_bytes"]
    int8 = row(d["rows"], technique="int8 KV", context=ctx)["kv_bytes"]
    return [f"at {ctx} tokens", f"GQA keeps {gqa / mha:.2f}x", f"int8 KV {int8 / mha:.2f}x"]


def expect_waste(d):
    r = row(d["memory_waste"]["rows"], block_size=16)
    return [f"{r['paged_waste_pct']:.1f}%", f"{r['contiguous_waste_pct']:.0f}%"]


def expect_prefix(d):
    p = d["prefix_cache"]
    return [
        f"{p['without_cache']['ttft_ms_mean']:.0f} -> {p['with_cache']['ttft_ms_mean']:.0f} ms",
        f"{p['system_len']}-token",
    ]


def expect_throughput(d):
    t = d["throughput"]  # ratio: the median of the runs' ratios, not the ratio of the medians
    tokens = f"{t['continuous']['output_tokens_per_s']:.0f} vs {t['static']['output_tokens_per_s']:.0f}"
    return [f"{t['ratio']:.2f}x", tokens]


def expect_tail(d):
    runs = d["interference"]["runs"]
    return [f"{runs[m]['itl_p99_ms']:.0f}" for m in ("colocated", "chunked", "disagg 1:1")]


def expect_parallel(d):
    tp = d["tensor_parallel"]
    most = max(tp, key=lambda r: r["ranks"])
    share = most["local_params"] / row(tp, ranks=1)["local_params"]
    return [f"{most['ranks']}-way", f"{share:.2f}x the weights", "same greedy tokens"]


def expect_replicas(d):
    one, two = row(d["replicas"], replicas=1), max(d["replicas"], key=lambda r: r["replicas"])
    return [f"{two['replicas']} replicas", f"{two['output_tokens_per_s'] / one['output_tokens_per_s']:.2f}x"]


def expect_experts(d):
    ep = d["expert_parallel"]
    return [f"{ep['ranks']}-way", f"{ep['n_experts']} experts", f"{ep['max_over_mean']:.2f}x the mean load"]


def expect_context(d):
    cp = d["context_parallel"]
    return [f"{cp['ranks']}-way", f"{cp['seq_len']} tokens", f"{cp['kv_share']:.2f}x of the K/V"]


def expect_batch(d):
    online = max((r for r in d["rate_sweep"] if r["rate"] is not None), key=lambda r: r["good_tokens_per_s"])
    batch = row(d["rate_sweep"], rate=None)
    return [f"{batch['throughput']:.0f} tok/s", f"{online['good_tokens_per_s']:.0f}", f"{online['rate']:g} req/s"]


EXPECTED = {
    ("an MoE model too large for one device", "bench_parallel"): expect_experts,
    ("one server saturated by its users", "bench_parallel"): expect_replicas,
    ("one long prompt's TTFT breaks the SLO", "bench_parallel"): expect_context,
    ("cost matters more than latency", "bench_capstone"): expect_batch,
    ("prefill is compute-bound", "bench_disagg"): expect_disagg_prefill,
    ("decode is bandwidth-bound", "bench_compression"): expect_compression,
    ("each step recomputes the whole prefix", "bench_generate"): expect_generate_cache,
    ("per-step overhead at small batch", "bench_generate"): expect_generate_compile,
    ("the output copies the input", "bench_decoding"): expect_decoding,
    ("the KV cache fills the memory", "bench_kv"): expect_kv,
    ("KV memory reserved but unused", "bench_batching"): expect_waste,
    ("long prompts shared by many requests", "bench_batching"): expect_prefix,
    ("throughput low with many users", "bench_batching"): expect_throughput,
    ("tail latency spikes under load", "bench_disagg"): expect_tail,
    ("the model is too large for one device", "bench_parallel"): expect_parallel,
}


def test_saved_evidence_holds_the_figures_of_its_json():
    entries = decision_guide(RESULTS_DIR)
    assert {e.symptom for e in entries} == {s for s, _ in EXPECTED}
    checked = 0
    for e in entries:
        if not e.source:
            assert e.evidence == f"no saved run: run `{e.benchmark}`"
            continue
        hardware, name = e.source.removesuffix(".json").split("/")
        expect = EXPECTED.get((e.symptom, name))
        if expect is None:  # e.g. a gpu_check.json saved later: its figures are checked below
            continue
        record = json.loads((RESULTS_DIR / e.source).read_text())
        for text in expect(record):
            assert text in e.evidence, (e.symptom, text, e.evidence)
        checked += 1
    assert checked >= 8  # the store ships CPU runs of these benchmarks


def test_entries_follow_the_guides_order_fit_first_the_step_last():
    entries = decision_guide(RESULTS_DIR)
    stages = [STAGES.index(e.stage) for e in entries]
    assert stages == sorted(stages) and set(stages) == set(range(len(STAGES)))
    assert entries[0].symptom == "the model is too large for one device"
    kv = by_symptom(entries)["the KV cache fills the memory"]
    assert kv.techniques.startswith("int8/fp8 KV cache")  # GQA changes the architecture: not first


def test_newest_run_wins_unless_another_is_preferred():
    both = json.loads((RESULTS_DIR / "cpu-epyc-2core/bench_decoding.json").read_text())
    assert result_date(both) is not None
    entry = by_symptom(decision_guide(RESULTS_DIR))["the output copies the input"]
    assert entry.source == "cpu-epyc-2core/bench_decoding.json"  # the dated run beats the undated one
    xeon = by_symptom(decision_guide(RESULTS_DIR, prefer="cpu-xeon-2core"))["the output copies the input"]
    assert xeon.source == "cpu-xeon-2core/bench_decoding.json"
    lookup = row(json.loads((RESULTS_DIR / xeon.source).read_text())["rows"], method="prompt lookup (K=8, n<=3)")
    assert f"{lookup['speedup']:.2f}x greedy" in xeon.evidence and xeon.evidence != entry.evidence
    with pytest.raises(ValueError, match="prefer"):
        decision_guide(RESULTS_DIR, prefer=[""])


def test_no_saved_results_means_no_saved_run_for_every_entry(tmp_path):
    entries = decision_guide(tmp_path)
    assert len(entries) == len(SYMPTOMS)
    for e in entries:
        assert e.source == "" and e.evidence == f"no saved run: run `{e.benchmark}`"
        assert e.benchmark.startswith(("python -m minillm bench ", "make gpu-check"))


def test_one_crafted_result_changes_its_entry_only(tmp_path):
    rows = [
        {"technique": "MHA (baseline)", "context": 512, "kv_bytes": 1000},
        {"technique": "GQA (1/2)", "context": 512, "kv_bytes": 500},
        {"technique": "MQA (1 K/V head)", "context": 512, "kv_bytes": 125},
        {"technique": "int8 KV", "context": 512, "kv_bytes": 250},
    ]
    (tmp_path / "tiny-box").mkdir()
    (tmp_path / "tiny-box" / "bench_kv.json").write_text(json.dumps({"rows": rows}))
    (tmp_path / "tiny-box" / "bench_parallel.json").write_text(json.dumps({"tensor_parallel": "mangled"}))
    entries = by_symptom(decision_guide(tmp_path))
    kv = entries["the KV cache fills the memory"]
    assert kv.source == "tiny-box/bench_kv.json"
    assert kv.evidence == "at 512 tokens GQA keeps 0.50x, MQA 0.12x, int8 KV 0.25x the MHA cache bytes"
    # a file without the figures an entry needs counts as no saved run
    assert entries["the model is too large for one device"].evidence.startswith("no saved run")
    assert sum(e.source != "" for e in entries.values()) == 1


def gpu_check(date: str) -> dict:
    return {
        "gpu": "NVIDIA H200",
        "started": date,
        "sections": {
            "decode": {"eager": {"tokens_per_s": 50.0}, "compiled": {"tokens_per_s": 150.0, "mbu": 0.71}},
            "compression": {
                "decode": [
                    {"scheme": "bf16", "model_bytes": 16e9, "batch_1": {"graphed_tokens_per_s": 150.0}},
                    {"scheme": "int4-g128", "model_bytes": 4.8e9, "batch_1": {"graphed_tokens_per_s": 330.0}},
                ]
            },
            "disagg": {"steps": {"fitted": {"fixed": 0.006, "per_token": 0.0001, "per_prefill_token": 0.00004}}},
        },
    }


def test_a_newer_gpu_check_takes_over_the_entries_it_measures(tmp_path):
    for hardware in ("cpu-epyc-2core", "cpu-xeon-2core"):
        shutil.copytree(RESULTS_DIR / hardware, tmp_path / hardware)
    (tmp_path / "h200").mkdir()
    (tmp_path / "h200" / "gpu_check.json").write_text(json.dumps(gpu_check("2030-01-01T00:00:00Z")))
    entries = by_symptom(decision_guide(tmp_path))
    overhead = entries["per-step overhead at small batch"]
    assert overhead.source == "h200/gpu_check.json" and overhead.benchmark == "make gpu-check"
    assert "3.00x eager (150 vs 50 tok/s, MBU 0.71)" in overhead.evidence
    decode = entries["decode is bandwidth-bound"]
    assert "0.30x the bytes" in decode.evidence and "2.20x faster than bf16" in decode.evidence
    prefill = entries["prefill is compute-bound"]
    assert "0.04 ms per prompt token" in prefill.evidence and "152 prompt tokens" in prefill.evidence
    assert entries["the output copies the input"].source.startswith("cpu-")
    # an older GPU run loses to the CPU runs, unless preferred
    (tmp_path / "h200" / "gpu_check.json").write_text(json.dumps(gpu_check("2020-01-01T00:00:00Z")))
    assert by_symptom(decision_guide(tmp_path))["per-step overhead at small batch"].source.startswith("cpu-")
    preferred = by_symptom(decision_guide(tmp_path, prefer="h200"))["per-step overhead at small batch"]
    assert preferred.source == "h200/gpu_check.json"


def test_every_chapter_named_exists():
    written = {int(p.name[:2]) for p in (ROOT / "chapters").glob("[0-9][0-9]_*.ipynb")}
    named = {n for e in decision_guide(RESULTS_DIR) for n in e.chapters}
    assert named and named - {16} <= written, sorted(named - written)


@pytest.mark.parametrize("width", [88, 60])
def test_text_fits_its_width_and_markdown_has_a_row_per_entry(width, tmp_path):
    for entries in (decision_guide(RESULTS_DIR), decision_guide(tmp_path)):
        text = format_guide(entries, width=width)
        assert max(len(line) for line in text.splitlines()) <= width
        assert all(e.symptom in text and f"ch. {e.chapters[0]}" in text for e in entries)
    md = guide_markdown(entries).splitlines()
    assert len(md) == len(entries) + 2
    assert all(line.replace("\\|", "").count("|") == 9 for line in md)
    with pytest.raises(ValueError, match="width"):
        format_guide(entries, width=20)


def overlapping(fig) -> list[tuple[str, str]]:
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    boxes = [(t.get_text(), t.get_window_extent(renderer)) for ax in fig.axes for t in ax.texts]
    return [(a, b) for i, (a, ea) in enumerate(boxes) for b, eb in boxes[i + 1 :] if ea.overlaps(eb)]


def test_diagram_shows_every_symptom_and_its_evidence_without_overlap(tmp_path):
    entries = decision_guide(RESULTS_DIR)
    fig = plot_decision_guide(entries)
    texts = [t.get_text().replace("\n", " ") for t in fig.axes[0].texts]
    for e in entries:
        assert texts.count(e.symptom) == 1
        assert any(t.startswith(e.evidence) for t in texts)
    assert all(hw in fig.axes[0].get_title() for hw in ("cpu-epyc-2core", "cpu-xeon-2core"))
    # one unit per entry and a heading per stage, 1.15 in each
    assert fig.get_size_inches()[1] == pytest.approx(1.15 * (len(entries) + STAGE_HEIGHT * len(STAGES)) + 1)
    assert all(stage in texts for stage in STAGES)
    for stage in STAGES:  # one stage alone: its name in the title, no heading, no overlap
        alone = plot_decision_guide([e for e in entries if e.stage == stage])
        assert alone.axes[0].get_title().startswith(f"{stage}: what to try")
        assert stage not in [t.get_text() for t in alone.axes[0].texts] and overlapping(alone) == []
        plt.close(alone)
    assert overlapping(fig) == []
    plt.close(fig)
    empty = plot_decision_guide(decision_guide(tmp_path))
    assert "no saved runs yet" in empty.axes[0].get_title()
    plt.close(empty)
    with pytest.raises(ValueError, match="empty"):
        plot_decision_guide([])
