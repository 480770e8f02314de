"""The decision guide's evidence: one measured sentence from one saved result.

A ``Reader`` names a saved result (``minillm/results/<hardware>/<name>.json``), the command that
writes it, and the function that turns its record into one sentence (for bench compression: how
much faster int4 weights decode than bf16 at batch 1, at what share of the bytes), or None when
the record lacks the figures.
``book.guide`` picks, for each symptom, the best saved run its readers can read.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

Evidence = Callable[[Mapping], "str | None"]


@dataclass(frozen=True)
class Reader:
    """Where one symptom's evidence can come from: a saved result's name, the command that writes
    it, and the function that turns the record into a sentence."""

    name: str  # e.g. "bench_compression"
    command: str  # e.g. "python -m minillm bench compression"
    sentence: Evidence


def _row(rows: Sequence[Mapping], **match) -> Mapping | None:
    """The first row whose fields equal ``match`` (None when there is none)."""
    return next((r for r in rows if all(r.get(k) == v for k, v in match.items())), None)


def _technique(rows: Sequence[Mapping], key: str, prefix: str, **match) -> Mapping | None:
    """The first row whose ``key`` starts with ``prefix`` (and whose fields equal ``match``)."""
    return next((r for r in rows if str(r.get(key, "")).startswith(prefix) and _row([r], **match)), None)


def prefill_from_step_cost(record: Mapping) -> str | None:
    """bench disagg: the step costs fitted to the prefill worker's and the decode worker's steps."""
    prefill, decode = record["step_cost"]["prefill"], record["step_cost"]["decode"]
    return _prefill_sentence(prefill["per_prefill_token"], decode["fixed"] + decode["per_token"])


def _prefill_sentence(per_prompt_token: float, decode_step: float, model: str = "") -> str | None:
    """Seconds per prompt token and per one-row decode step, as one sentence (None if not positive)."""
    if per_prompt_token <= 0 or decode_step <= 0:
        return None
    return (
        f"prefill: {1e3 * per_prompt_token:.3g} ms per prompt token; a decode step: {1e3 * decode_step:.1f} ms, "
        f"as much as {decode_step / per_prompt_token:.0f} prompt tokens{model}"
    )


def prefill_from_gpu_steps(record: Mapping) -> str | None:
    """make gpu-check, disagg section: one step cost fitted to a continuous engine's steps on the GPU."""
    cost = record["sections"]["disagg"]["steps"]["fitted"]
    per_prompt = cost["per_token"] if cost.get("per_prefill_token") is None else cost["per_prefill_token"]
    return _prefill_sentence(per_prompt, cost["fixed"] + cost["per_token"], " (Llama-3-8B)")


def decode_from_compression(record: Mapping) -> str | None:
    """bench compression: decode tokens/s of int4 (group 128) vs bf16 weights at batch 1."""
    rows = record["decode"]
    bf16, int4 = _row(rows, technique="bf16", batch=1), _row(rows, technique="int4 g128", batch=1)
    if not bf16 or not int4:
        return None
    speed, size = int4["tokens_per_s"] / bf16["tokens_per_s"], int4["model_bytes"] / bf16["model_bytes"]
    where = f"random {record['shape']}"
    return f"int4 g128 ({size:.2f}x the bytes) decodes {speed:.2f}x faster than bf16 at batch 1 ({where})"


def decode_from_gpu_compression(record: Mapping) -> str | None:
    """make gpu-check, compression section: CUDA-graphed decode of int4 (group 128) vs 16-bit weights."""
    rows = record["sections"]["compression"]["decode"]
    base = _row(rows, scheme="bf16") or _row(rows, scheme="fp16")
    int4 = _row(rows, scheme="int4-g128")
    speed = int4["batch_1"]["graphed_tokens_per_s"] / base["batch_1"]["graphed_tokens_per_s"]
    size = int4["model_bytes"] / base["model_bytes"]
    return f"int4 g128 ({size:.2f}x the bytes) decodes {speed:.2f}x faster than {base['scheme']} (random Llama-3-8B)"


def overhead_from_generate(record: Mapping) -> str | None:
    """bench generate --compile: minillm's decode tokens/s, compiled vs eager."""
    run = record["vs_transformers"]
    eager, compiled = run["minillm"]["decode_tokens_per_s"], run["minillm_compiled"]["decode_tokens_per_s"]
    same = "same" if run["compiled_same_greedy_tokens"] else "NOT the same"
    return (
        f"compiled decode {compiled / eager:.2f}x eager ({compiled:.0f} vs {eager:.0f} tok/s), "
        f"{same} greedy tokens ({run['model']})"
    )


def overhead_from_gpu_decode(record: Mapping) -> str | None:
    """make gpu-check, decode section: batch-1 decode, eager vs torch.compile with CUDA graphs."""
    decode = record["sections"]["decode"]
    eager, compiled = decode["eager"]["tokens_per_s"], decode["compiled"]["tokens_per_s"]
    return (
        f"CUDA graphs decode {compiled / eager:.2f}x eager ({compiled:.0f} vs {eager:.0f} tok/s, "
        f"MBU {decode['compiled']['mbu']:.2f}), random Llama-3-8B"
    )


def lookup_from_decoding(record: Mapping) -> str | None:
    """bench decoding: prompt lookup decoding against plain greedy decoding (the eager rows)."""
    row = next(r for r in record["rows"] if r["method"].startswith("prompt lookup") and "compiled" not in r["method"])
    same = "same" if row["same_greedy_tokens"] else "NOT the same"
    return (
        f"prompt lookup: {row['speedup']:.2f}x greedy tok/s, {row['tokens_per_target_forward']:.2f} tokens "
        f"per forward, {same} tokens"
    )


def cache_from_generate(record: Mapping) -> str | None:
    """bench generate: KV cache vs recomputing the prefix, at the longest prompt measured."""
    row = max(record["cache_vs_recompute"]["rows"], key=lambda r: r["prompt_len"])
    return (
        f"at a {row['prompt_len']}-token prompt the KV cache generates {row['speedup']:.1f}x faster "
        f"than recomputing ({record['cache_vs_recompute']['model']})"
    )


def kv_from_kv(record: Mapping) -> str | None:
    """bench kv: cache bytes of GQA, MQA and an int8 cache against MHA, at the longest context."""
    context = max(r["context"] for r in record["rows"])
    rows = [_technique(record["rows"], "technique", name, context=context) for name in ("GQA", "MQA", "int8 KV")]
    if not all(rows):
        return None
    mha = _row(record["rows"], technique="MHA (baseline)", context=context)["kv_bytes"]
    gqa, mqa, int8 = (r["kv_bytes"] / mha for r in rows)
    return f"at {context} tokens GQA keeps {gqa:.2f}x, MQA {mqa:.2f}x, int8 KV {int8:.2f}x the MHA cache bytes"


def waste_from_batching(record: Mapping) -> str | None:
    """bench batching: KV memory reserved but unused, paged blocks vs max-length slots."""
    rows = record["memory_waste"]["rows"]
    row = _row(rows, block_size=16) or rows[0]
    return (
        f"paged KV (blocks of {row['block_size']}) wastes {row['paged_waste_pct']:.1f}% of its memory, "
        f"max-length slots {row['contiguous_waste_pct']:.0f}%"
    )


def prefix_from_batching(record: Mapping) -> str | None:
    """bench batching: mean TTFT with and without the prefix cache, requests sharing a system prompt."""
    p = record["prefix_cache"]
    return (
        f"prefix caching: TTFT {p['without_cache']['ttft_ms_mean']:.0f} -> {p['with_cache']['ttft_ms_mean']:.0f} ms "
        f"(-{p['ttft_saving_pct']:.0f}%) under a shared {p['system_len']}-token system prompt"
    )


def throughput_from_batching(record: Mapping) -> str | None:
    """bench batching: output tokens/s of continuous vs static batching on the same workload."""
    t = record["throughput"]
    return (
        f"continuous batching: {t['ratio']:.2f}x the output tok/s of static batches "
        f"({t['continuous']['output_tokens_per_s']:.0f} vs {t['static']['output_tokens_per_s']:.0f})"
    )


def tail_from_disagg(record: Mapping) -> str | None:
    """bench disagg: the p99 gap between tokens while long prompts arrive, per serving mode."""
    runs = record["interference"]["runs"]
    disagg = next(k for k in runs if k.startswith("disagg"))
    return (
        f"p99 gap between tokens: {runs['colocated']['itl_p99_ms']:.0f} ms colocated, "
        f"{runs['chunked']['itl_p99_ms']:.0f} chunked, {runs[disagg]['itl_p99_ms']:.0f} {disagg}"
    )


def _against_one(rows: Sequence[Mapping], key: str, sentence: Callable[[Mapping, Mapping, str], str]) -> str | None:
    """``sentence(one, most, same)`` of the row of 1 (rank or replica), the row of the most, and
    whether every row's tokens were the same ("same" / "NOT the same"); None without a row of 1
    or a row of more."""
    one, most = _row(rows, **{key: 1}), max(rows, key=lambda r: r[key])
    if not one or most[key] == 1:
        return None
    return sentence(one, most, "same" if all(r["tokens_equal"] for r in rows) else "NOT the same")


def split_from_parallel(record: Mapping) -> str | None:
    """bench parallel: each tensor-parallel rank's share of the weights, and whether the tokens stayed."""
    return _against_one(
        record["tensor_parallel"],
        "ranks",
        lambda one, most, same: (
            f"{most['ranks']}-way tensor parallel: each rank holds "
            f"{most['local_params'] / one['local_params']:.2f}x the weights; {same} greedy tokens as 1 rank"
        ),
    )


def replicas_from_parallel(record: Mapping) -> str | None:
    """bench parallel: output tokens/s of several whole-model replicas against one, same requests."""
    return _against_one(
        record["replicas"],
        "replicas",
        lambda one, most, same: (
            f"{most['replicas']} replicas: {most['output_tokens_per_s'] / one['output_tokens_per_s']:.2f}x the "
            f"output tok/s of one, TTFT p50 {one['ttft_p50_ms']:.0f} -> {most['ttft_p50_ms']:.0f} ms; {same} tokens"
        ),
    )


def context_from_parallel(record: Mapping) -> str | None:
    """bench parallel: ring attention over the ranks against attention over the whole sequence."""
    cp = record["context_parallel"]
    same = "equals" if cp["max_abs_diff"] <= cp["tolerance"] else "does NOT equal"
    return (
        f"{cp['ranks']}-way ring attention over {cp['seq_len']} tokens {same} one process's; each rank keeps "
        f"{cp['kv_share']:.2f}x of the K/V, and the {cp['layout']} split leaves the busiest rank "
        f"{cp['imbalance']:.2f}x the mean work"
    )


def experts_from_parallel(record: Mapping) -> str | None:
    """bench parallel: a mixture-of-experts layer split over the ranks against one process."""
    ep = record["expert_parallel"]
    same = "equals" if ep["max_abs_diff"] <= ep["tolerance"] else "does NOT equal"
    bytes_ok = "=" if ep["bytes_equal"] else "!="
    return (
        f"{ep['ranks']}-way expert parallel MoE ({ep['n_experts']} experts, top-{ep['top_k']}) {same} one process's; "
        f"all-to-all bytes {bytes_ok} the routing's count; busiest expert {ep['max_over_mean']:.2f}x the mean load"
    )


def batch_from_capstone(record: Mapping) -> str | None:
    """bench capstone: the most an online service sells within the SLO against a batch of the same requests."""
    sweep = record["rate_sweep"]
    online = max((r for r in sweep if r["rate"] is not None), key=lambda r: r["good_tokens_per_s"])
    batch = next(r for r in sweep if r["rate"] is None)
    return (
        f"a batch of the same requests: {batch['throughput']:.0f} tok/s, against {online['good_tokens_per_s']:.0f} "
        f"within the SLO online at best ({online['rate']:g} req/s), same max batch: a batch token costs "
        f"{online['good_tokens_per_s'] / batch['throughput']:.2f} of an online one"
    )


def generation_from_generate(record: Mapping) -> str | None:
    """bench generate: minillm's greedy generation against transformers' on the same weights."""
    run = record["vs_transformers"]
    same = "same" if run["same_greedy_tokens"] else "NOT the same"
    return (
        f"{run['minillm']['tokens_per_s']:.0f} tok/s against transformers' {run['transformers']['tokens_per_s']:.0f} "
        f"({run['speedup']:.2f}x), {same} greedy tokens ({run['model']}, eager)"
    )


def _method(record: Mapping, prefix: str) -> Mapping:
    return next(r for r in record["rows"] if r["method"].startswith(prefix) and "compiled" not in r["method"])


def speculative_from_decoding(record: Mapping) -> str | None:
    """bench decoding: speculative decoding with the bundled draft against greedy (eager rows)."""
    row = _method(record, "speculative")
    return (
        f"draft model, K={record['k']}: {row['speedup']:.2f}x greedy tok/s, "
        f"{row['tokens_per_target_forward']:.2f} tokens per target forward"
    )


def parallel_from_decoding(record: Mapping) -> str | None:
    """bench decoding: lookahead and Medusa decoding against greedy (eager rows)."""
    look, medusa = _method(record, "lookahead"), _method(record, "medusa")
    return (
        f"lookahead {look['speedup']:.2f}x, Medusa {medusa['speedup']:.2f}x greedy tok/s "
        f"({look['tokens_per_target_forward']:.2f} and {medusa['tokens_per_target_forward']:.2f} tokens per forward)"
    )


def ladder_from_capstone(record: Mapping) -> str | None:
    """bench capstone: the whole ladder, from recomputing and from the KV-cache rung."""
    rows = record["ladder"]
    base, top = rows[0], rows[-1]
    cached = next(r for r in rows if r["step"] == "+ KV cache")
    return (
        f"batch 1, random {record['shape']}: {base['tokens_per_s']:.1f} -> {top['tokens_per_s']:.1f} tok/s "
        f"({top['tokens_per_s'] / base['tokens_per_s']:.1f}x; {top['tokens_per_s'] / cached['tokens_per_s']:.2f}x "
        "from the KV-cache rung)"
    )
