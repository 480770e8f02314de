"""Chapter 16's tables, from a ``bench_capstone`` result (a live one or one saved with the
package): the ladder with its quality (``format_ladder``), where a decode step's time goes
(``step_split``), a live ladder beside a saved one (``format_live_vs_saved``), the decoding and
serving rows, and the ladder of a saved ``make gpu-check`` (``gpu_ladder_rows``). Each takes the
figures and measures nothing; ``bench.capstone`` measures them and joins the three parts'
tables (``format_capstone``).
"""

from __future__ import annotations

from ..core.config import preset
from ..measure.report import format_table, signed_pct, wrap_line
from ..runtime.recipes import LADDER, streamed_bytes


def with_ratios(rows: list[dict], key: str = "tokens_per_s") -> list[dict]:
    """Each row's ``key`` (a speed) over the first row's and over the previous row's."""
    for i, row in enumerate(rows):
        row["vs_baseline"] = row[key] / rows[0][key]
        row["vs_previous"] = row[key] / rows[max(i - 1, 0)][key]
    return rows


def _mb(n: int | None) -> float | None:
    return None if n is None else n / 1e6


def _pct(x: float | None) -> str | None:
    return None if x is None else f"{x:.1%}"


def ladder_table_rows(result: dict) -> list[dict]:
    rows = []
    for r in result["ladder"]:
        rows.append(
            {
                "step": r["step"],
                "tok_s": r["tokens_per_s"],
                "x": f"{r['vs_baseline']:.2f}x",
                "step_x": f"{r['vs_previous']:.2f}x",
                "weights": _mb(r["weights_bytes"]),
                "kv": _mb(r["kv_bytes"]),
                "ppl": signed_pct(r["ppl_change_pct"]),
                "agree": _pct(r["agreement"]) or ("= above" if rows else "(baseline)"),
                "same": f"{r['same_outputs']}/{r['outputs']}",
                "lossless": r["lossless"],
                "alone": f"{r['alone_vs_kv_cache']:.2f}x" if r.get("alone_vs_kv_cache") else None,
            }
        )
    return rows


LADDER_COLUMNS = {
    "step": "step",
    "tok_s": "tok/s at batch 1",
    "x": "vs baseline",
    "step_x": "vs row above",
    "weights": "weights MB",
    "kv": "KV MB",
    "ppl": "perplexity change",
    "agree": "greedy agreement",
    "same": "same outputs",
    "lossless": "lossless",
    "alone": "alone: vs KV cache",
}


def format_ladder(result: dict) -> str:
    title = (
        f"1. Batch-1 generation of a {result['prompt_len']}-token prompt + {result['new_tokens']} "
        f"tokens (random {result['shape']}, {result['dtype']}), median of {result['repeats']}; "
        f"quality on {result['quality_model']}; {result['hardware']}"
    )
    text = format_table(ladder_table_rows(result), LADDER_COLUMNS, title=title)
    if any(r.get("alone_vs_kv_cache") for r in result["ladder"]):
        note = (
            "alone: the rung's technique by itself on the KV-cache rung, over that rung's tok/s (int8 and "
            "int4 compute in bf16, so they include it; compiling alone compiles the fp32 model)."
        )
        text += "\n" + "\n".join(wrap_line(note))
    return text


def step_split(result: dict) -> list[dict]:
    """Each cached rung's prompt (its TTFT) and time per decoded token beside the weights a step
    streams, read at the copy bandwidth measured in the same run; the rest is everything else the
    step does (the KV cache, element-wise work, launching, matmul arithmetic the memory does not
    bound)."""
    rows = []
    for r in result["ladder"]:
        if r["kv_bytes"] == 0:  # recomputing: a step is a whole forward, not a decode step
            continue
        # runs saved before the field have the preset's name to compute it from
        rung = next(x for x in LADDER if x.name == r["step"])
        streamed = r.get("streamed_bytes") or streamed_bytes(rung, r["weights_bytes"], preset(result["shape"]))
        weights_ms = 1e3 * streamed / (1e9 * result["copy_GB_s"])
        rows.append({"step": r["step"], "prompt_ms": r["ttft_ms"], "step_ms": r["tpot_ms"], "weights_ms": weights_ms})
        rows[-1]["rest_ms"] = r["tpot_ms"] - weights_ms
    return rows


def format_step_split(result: dict) -> str:
    columns = {"step": "step", "prompt_ms": "prompt ms", "step_ms": "ms per token"}
    columns |= {"weights_ms": "weights streamed at copy speed", "rest_ms": "rest"}
    title = f"Where a decode step goes: weights read at {result['copy_GB_s']:.1f} GB/s (a copy, same run)"
    return format_table(step_split(result), columns, title=title)


def format_live_vs_saved(live: list[dict], saved: dict | None) -> str:
    """A live ``ladder_speed`` beside a saved run's ladder: each rung's speedup over the baseline
    here and there (the ratios should agree where the hardware does; absolute tokens/s need not)."""
    theirs = {r["step"]: r for r in (saved or {}).get("ladder", [])}
    rows = [
        {
            "step": r["step"],
            "tok_s": r["tokens_per_s"],
            "x": f"{r['vs_baseline']:.2f}x",
            "step_x": f"{r['vs_previous']:.2f}x",
            "saved_x": f"{theirs[r['step']]['vs_baseline']:.2f}x" if r["step"] in theirs else None,
            "saved_step_x": f"{theirs[r['step']]['vs_previous']:.2f}x" if r["step"] in theirs else None,
            "same": r["same_tokens_as_previous"] if r["lossless"] else None,
        }
        for r in live
    ]
    columns = {"step": "step", "tok_s": "tok/s here", "x": "vs baseline", "step_x": "vs row above"}
    columns |= {"saved_x": "saved: vs baseline", "saved_step_x": "vs row above", "same": "tokens = row above"}
    where = f"; saved: {saved['hardware']}, {saved['date']}" if saved else ""
    shape = live[0]["ran_on"].split(",")[0]
    return format_table(rows, columns, title=f"Live, {shape} (quantized rungs in bf16), batch 1{where}")


def format_decoding_rows(result: dict) -> str:
    rows = [
        {
            **r,
            "x": f"{r['vs_greedy']:.2f}x",
            "alpha": r["acceptance_rate"],
            "kept": f"{r['fraction_kept']:.0%}" if "fraction_kept" in r else "-",
            "tpf": r["tokens_per_target_forward"],
            "same": r["same_tokens_as_greedy"],
        }
        for r in result["decoding"]
    ]
    columns = {
        "step": "step",
        "workload": "workload",
        "greedy_tokens_per_s": "greedy tok/s",
        "tokens_per_s": "tok/s",
        "x": "vs greedy",
        "alpha": "per-position acceptance",
        "kept": "proposals kept",
        "tpf": "tokens per target forward",
        "same": "same tokens",
    }
    title = f"2. On the trained pair: {result['decoding'][0]['ran_on']}, batch 1"
    text = format_table(rows, columns, title=title)
    if any("fraction_kept" not in r for r in result["decoding"]):
        note = (
            "proposals kept: not recorded by this run (it predates the field); the per-position "
            "acceptance is the chance the target keeps a proposal given it kept the ones before."
        )
        text += "\n" + "\n".join(wrap_line(note))
    spec = result["decoding"][0]
    if "draft_cost_ratio" in spec:
        note = (
            f"A draft forward costs {spec['draft_cost_ratio']:.2f} of a target forward here ({spec['draft_ms']:.2f} "
            f"vs {spec['target_ms']:.2f} ms, eager); chapter 7's formula with the measured acceptance "
            f"predicts {spec['predicted_vs_greedy']:.2f}x."
        )
        text += "\n" + "\n".join(wrap_line(note))
    for r in result["decoding"]:
        d = r.get("first_difference")
        if d:
            note = (
                f"{r['step'].removeprefix('+ ')}: tokens leave greedy's at position {d['position']} of prompt "
                f"{d['prompt']}, where the target's two best logits are {d['top2_gap']:.4f} apart: a tie (or "
                "near-tie) that a forward over several positions can round the other way in 16 bits."
            )
            text += "\n" + "\n".join(wrap_line(note))
    return text


def format_serving(result: dict) -> str:
    w, slo = result["workload"], result["slo"]
    rows = [{**r, "kv": _mb(r.get("kv_bytes"))} for r in result["serving"]]
    columns = {
        "step": "step",
        "throughput": "out tok/s",
        "good_tokens_per_s": "in-SLO tok/s",
        "goodput_rps": "goodput req/s",
        "ttft_p50_ms": "TTFT p50 ms",
        "ttft_p99_ms": "p99",
        "tpot_p50_ms": "TPOT p50 ms",
        "tpot_p99_ms": "p99",
        "kv": "peak KV MB",
    }
    title = (
        f"3. Serving {result['quality_model']}: {w['requests']} requests at {w['rate']:g}/s (Poisson), "
        f"a {w['system_len']}-token shared system prompt, max batch {w['max_batch']}; SLO TTFT <= "
        f"{slo['ttft_s']:g} s, TPOT <= {1e3 * slo['tpot_s']:g} ms"
    )
    return format_table(rows, columns, title=title)


def best_online(sweep: list[dict]) -> dict:
    """The rate sweep's online row that sold the most output tokens within the SLO."""
    return max((r for r in sweep if r["rate"] is not None), key=lambda r: r["good_tokens_per_s"])


def format_rate_sweep(result: dict) -> str:
    """The online service offered more and more requests per second, and the same requests as a
    batch at the same max batch; the line under it names the best online rate."""
    w, slo = result["workload"], result["slo"]
    rows = [{**r, "rate": "at once" if r["rate"] is None else f"{r['rate']:g}/s"} for r in result["rate_sweep"]]
    columns = {
        "rate": "offered",
        "throughput": "out tok/s",
        "good_tokens_per_s": "in-SLO tok/s",
        "slo_met_pct": "% in SLO",
        "mean_batch": "mean batch",
        "ttft_p99_ms": "TTFT p99 ms",
        "tpot_p99_ms": "TPOT p99 ms",
    }
    title = (
        f"4. Online at rising rates, and as a batch: {w['sweep_requests']} requests each, prefix caching, "
        f"max batch {w['max_batch']}; SLO TTFT <= {slo['ttft_s']:g} s, TPOT <= {1e3 * slo['tpot_s']:g} ms"
    )
    best = best_online(result["rate_sweep"])
    batch = next(r for r in result["rate_sweep"] if r["rate"] is None)
    note = (
        f"most sold within the SLO: {best['good_tokens_per_s']:.0f} tok/s at {best['rate']:g} req/s; "
        f"the batch made {batch['throughput']:.0f} tok/s of the same requests at the same max batch "
        f"({batch['throughput'] / best['good_tokens_per_s']:.2f}x)."
    )
    return format_table(rows, columns, title=title) + "\n" + "\n".join(wrap_line(note))


# ---------------------------------------------------------------------------------------------
# On a GPU: the ladder from make gpu-check's sections (its capstone section is in bench.gpu)


# gpt-fast's order, the one the check's sections measure: compiled in 16 bits, then quantized
GPU_STEPS = ("recompute (baseline)", "+ KV cache", "+ compiled (CUDA graphs)", "+ int8 weights", "+ int4 weights")


def gpu_ladder_rows(gpu_check: dict) -> list[dict]:
    """The ladder on the GPU of a saved ``make gpu-check``: decode tokens/s at batch 1 of a random
    Llama-3-8B, each rung from the section that measured it; empty when the check has none."""
    sections = gpu_check.get("sections", {})
    first, decode = sections.get("capstone", {}), sections.get("decode", {})
    graphed = {r.get("scheme"): r.get("batch_1", {}) for r in sections.get("compression", {}).get("decode", [])}
    found = [
        (first.get(LADDER[0].name, {}).get("decode_tokens_per_s"), "capstone (eager)"),
        (first.get(LADDER[1].name, {}).get("decode_tokens_per_s"), "capstone (eager)"),
        (decode.get("compiled", {}).get("tokens_per_s"), "decode (CUDA graphs)"),
        (graphed.get("int8", {}).get("graphed_tokens_per_s"), "compression (CUDA graphs)"),
        (_int4(graphed).get("graphed_tokens_per_s"), "compression (CUDA graphs)"),
    ]
    rows = [
        {"step": step, "decode_tokens_per_s": t, "section": where} for step, (t, where) in zip(GPU_STEPS, found) if t
    ]
    return with_ratios(rows, "decode_tokens_per_s")


def _int4(graphed: dict) -> dict:
    """The int4 row of the compression section (g128 when it measured several group sizes)."""
    names = [n for n in graphed if n and n.startswith("int4")]
    return graphed[next((n for n in names if "128" in n), names[0])] if names else {}


def format_gpu_ladder(gpu_check: dict) -> str | None:
    """The GPU ladder as a table (None when the saved check has none of its rows)."""
    rows = gpu_ladder_rows(gpu_check)
    if not rows:
        return None
    shown = [{**r, "x": f"{r['vs_baseline']:.2f}x", "step_x": f"{r['vs_previous']:.2f}x"} for r in rows]
    columns = {"step": "step", "decode_tokens_per_s": "decode tok/s", "x": "vs baseline", "step_x": "vs row above"}
    columns["section"] = "gpu-check section"
    title = f"make gpu-check: random Llama-3-8B, batch 1, bf16, on {gpu_check.get('gpu', '?')}"
    return format_table(shown, columns, title=title)
