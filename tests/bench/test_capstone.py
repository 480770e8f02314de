"""bench capstone (chapter 16's table): every lossless rung and decoding row makes exactly the
baseline's greedy tokens; the KV bytes are the cache's formula; ratios are the rows' own figures;
serving with prefix caching holds fewer KV blocks than without; compiled quantized decoding makes
the tokens of its eager run; the GPU ladder is read from a saved check's sections; tables fit
the page; bad options get one-line errors."""

import pytest
import torch

from minillm.bench.capstone import (
    OFFLINE,
    SERVED,
    CapstoneBench,
    bench_capstone,
    first_difference,
    format_capstone,
    ladder_speed,
)
from minillm.bench.capstone_tables import (
    GPU_STEPS,
    best_online,
    format_decoding_rows,
    format_gpu_ladder,
    format_rate_sweep,
    format_step_split,
    gpu_ladder_rows,
    step_split,
)
from minillm.core.model import random_model
from minillm.measure.report import PAGE_WIDTH
from minillm.runtime.recipes import LADDER
from tests.conftest import tiny_config
from tests.test_cli import assert_one_line_error, run_main

pytestmark = pytest.mark.slow  # several processes, a compile or a server: make test-fast leaves it out

pytest.importorskip("httpx")

TINY = tiny_config(vocab_size=512, dim=128, ffn_dim=256, max_seq_len=512, tie_embeddings=True)
QUICK = dict(
    shape=TINY,
    prompt_len=16,
    new_tokens=6,
    repeats=1,
    decoding_prompts=1,
    quality_prompts=2,
    quality_windows=1,
    requests=4,
    rate=1000.0,  # every request at once: the batch is full from the start
    prompt_median=8,
    output_median=4,
    system_len=64,
    max_batch=4,
    sweep_rates=(2.0, 1000.0),
    sweep_requests=4,
    device="cpu",
)


@pytest.fixture(scope="module")
def result():
    return bench_capstone(CapstoneBench(**QUICK, compile=False, http=True))


def test_the_ladder_keeps_the_baselines_tokens_and_holds_the_caches_bytes(result):
    rows = {r["step"]: r for r in result["ladder"]}
    assert list(rows) == [r.name for r in LADDER if not r.compiled]
    bf16, int8, int4 = rows["+ bf16 weights"], rows["+ int8 weights"], rows["+ int4 weights (g128)"]
    for row in (bf16, int8, int4):
        assert row["agreement"] is not None  # new weights: measured
        # each is its technique alone on the KV-cache rung, so its alone ratio is its own speed's
        assert row["alone"] == row["step"] and row["alone_tokens_per_s"] == row["tokens_per_s"]
        assert row["alone_vs_kv_cache"] == pytest.approx(row["tokens_per_s"] / rows["+ KV cache"]["tokens_per_s"])
    assert bf16["kv_bytes"] == rows["+ KV cache"]["kv_bytes"] // 2  # 16-bit keys and values
    assert bf16["weights_bytes"] == rows["+ KV cache"]["weights_bytes"] // 2
    base, cached = rows["recompute (baseline)"], rows["+ KV cache"]
    assert cached["same_tokens_as_baseline"] and cached["same_tokens_as_previous"]
    assert cached["same_outputs"] == cached["outputs"] == 2
    length = QUICK["prompt_len"] + QUICK["new_tokens"]
    assert base["kv_bytes"] == 0
    assert cached["kv_bytes"] == 2 * TINY.n_layers * TINY.n_kv_heads * TINY.head_dim * length * 4  # K and V, fp32
    assert cached["ppl_change_pct"] == 0 and cached["agreement"] is None  # the same weights
    assert cached["vs_baseline"] == pytest.approx(cached["tokens_per_s"] / base["tokens_per_s"])
    assert base["vs_baseline"] == 1 and base["lossless"] and cached["lossless"]
    assert base["alone_vs_kv_cache"] is None and cached["alone_vs_kv_cache"] is None


def test_decoding_rows_are_lossless_against_greedy(result):
    spec, lookup = result["decoding"]
    for row in (spec, lookup):
        assert row["same_tokens_as_greedy"] and row["first_difference"] is None, row["step"]
        assert 0 <= row["fraction_kept"] <= row["acceptance_rate"] <= 1 and row["tokens_per_target_forward"] >= 1
        assert row["vs_greedy"] == pytest.approx(row["tokens_per_s"] / row["greedy_tokens_per_s"])
    assert "speculative" in spec["step"] and "lookup" in lookup["step"]
    assert spec["weights_bytes"] > lookup["weights_bytes"]  # the draft's weights count too


def test_first_difference_names_the_position_and_the_targets_top_two_gap():
    model = random_model(TINY, seed=1)
    prompts = [[1, 2, 3], [4, 5, 6]]
    greedy = [[7, 8, 9], [10, 11, 12]]
    assert first_difference(model, prompts, greedy, greedy) is None
    d = first_difference(model, prompts, greedy, [[7, 8, 9], [10, 99, 12]])
    logits = model(torch.tensor([[4, 5, 6, 10]]))[0, -1]
    top2 = logits.topk(2).values
    assert d == {"prompt": 1, "position": 1, "top2_gap": pytest.approx((top2[0] - top2[1]).item())}


def test_serving_rows_with_prefix_caching_hold_fewer_blocks(result):
    rows = {r["step"]: r for r in result["serving"]}
    assert list(rows) == [name for name, *_ in SERVED] + ["+ served over HTTP", OFFLINE]
    one, batched, prefix = (rows[name] for name, *_ in SERVED)
    # the batch row runs at the online rows' max batch (like for like): no more rows per step
    assert rows[OFFLINE]["throughput"] > 0
    # 4 requests at once share a 64-token (4-block) system prompt: 12 blocks fewer when it is shared
    assert prefix["kv_bytes"] < batched["kv_bytes"]
    assert one["kv_bytes"] < batched["kv_bytes"]  # one sequence at a time holds one sequence's blocks
    for row in rows.values():
        assert row["throughput"] > 0 and row["ttft_p99_ms"] >= row["ttft_p50_ms"] > 0
        assert 0 <= row["good_tokens_per_s"] <= row["throughput"] * (1 + 1e-9) and row["goodput_rps"] >= 0


def test_the_rate_sweep_offers_each_rate_and_the_batch_at_the_same_max_batch(result):
    sweep = result["rate_sweep"]
    assert [r["rate"] for r in sweep] == [2.0, 1000.0, None]
    for row in sweep:
        assert 0 <= row["good_tokens_per_s"] <= row["throughput"] * (1 + 1e-9)
        assert 1 <= row["mean_batch"] <= QUICK["max_batch"]
    best = best_online(sweep)
    assert best["rate"] is not None and best["good_tokens_per_s"] == max(r["good_tokens_per_s"] for r in sweep[:2])
    text = format_rate_sweep(result)
    assert f"at {best['rate']:g} req/s" in text and "at once" in text


def test_the_step_split_is_the_step_minus_the_weights_at_copy_speed(result):
    rows = step_split(result)
    cached = [r for r in result["ladder"] if r["kv_bytes"]]
    assert [r["step"] for r in rows] == [r["step"] for r in cached]  # recomputing has no decode step
    for split, r in zip(rows, cached):
        weights_ms = 1e3 * r["streamed_bytes"] / (1e9 * result["copy_GB_s"])
        assert split["weights_ms"] == pytest.approx(weights_ms)
        assert split["rest_ms"] == pytest.approx(r["tpot_ms"] - weights_ms)
    assert result["copy_GB_s"] > 0
    by_step = {r["step"]: r for r in cached}
    # a tied head quantized beside its 16-bit embedding: the table is looked up, not streamed
    embedding = TINY.vocab_size * TINY.dim * 2
    assert by_step["+ KV cache"]["streamed_bytes"] == by_step["+ KV cache"]["weights_bytes"]
    int8 = by_step["+ int8 weights"]
    assert int8["streamed_bytes"] == int8["weights_bytes"] - embedding


def test_the_tables_fit_the_page(result):
    text = format_capstone(result) + "\n" + format_step_split(result)
    assert "recompute (baseline)" in text and "+ served over HTTP" in text
    assert max(len(line) for line in text.splitlines()) <= PAGE_WIDTH


def test_a_saved_run_without_the_fraction_kept_says_so(result):
    assert "proposals kept: not recorded" not in format_decoding_rows(result)
    older = {**result, "decoding": [{k: v for k, v in r.items() if k != "fraction_kept"} for r in result["decoding"]]}
    assert "proposals kept: not recorded by this run" in format_decoding_rows(older)


def test_compiled_int4_decoding_makes_the_eager_int4_tokens():
    rows = ladder_speed(CapstoneBench(**QUICK))
    by_step = {r["step"]: r for r in rows}
    assert list(by_step) == [r.name for r in LADDER]
    compiled, int4, int8 = by_step["+ compiled decode"], by_step["+ int4 weights (g128)"], by_step["+ int8 weights"]
    assert compiled["lossless"] and compiled["same_tokens_as_previous"] and compiled["compile_s"] > 0
    # compiling alone: the fp32 model compiled, lossless against the eager KV-cache rung
    assert compiled["alone"] == "compiled decode alone" and compiled["alone_compile_s"] > 0
    assert compiled["alone_same_tokens_as_kv_cache"] and compiled["alone_vs_kv_cache"] > 0
    assert not int4["lossless"] and not int8["lossless"] and int4["compile_s"] == 0
    assert (
        compiled["weights_bytes"]
        == int4["weights_bytes"]
        < int8["weights_bytes"]
        < by_step["+ KV cache"]["weights_bytes"]
    )
    assert compiled["kv_bytes"] >= int4["kv_bytes"]  # the static cache holds its whole bucket


def test_the_gpu_ladder_comes_from_the_checks_sections():
    check = {
        "gpu": "NVIDIA H200",
        "sections": {
            "capstone": {
                "recompute (baseline)": {"decode_tokens_per_s": 10.0},
                "+ KV cache": {"decode_tokens_per_s": 40.0},
            },
            "decode": {"compiled": {"tokens_per_s": 120.0}},
            "compression": {
                "decode": [
                    {"scheme": "bfloat16", "batch_1": {"graphed_tokens_per_s": 120.0}},
                    {"scheme": "int8", "batch_1": {"graphed_tokens_per_s": 180.0}},
                    {"scheme": "int4-g128", "batch_1": {"graphed_tokens_per_s": 240.0}},
                ]
            },
        },
    }
    rows = gpu_ladder_rows(check)
    assert [r["step"] for r in rows] == list(GPU_STEPS)
    assert [r["vs_baseline"] for r in rows] == [1.0, 4.0, 12.0, 18.0, 24.0]
    assert rows[3]["vs_previous"] == pytest.approx(1.5)
    assert "H200" in format_gpu_ladder(check)
    assert gpu_ladder_rows({}) == [] and format_gpu_ladder({"sections": {}}) is None


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--shape", "no-such-model"], ["no-such-model"]),
        (["--requests", "0"], ["requests"]),
        (["--rate", "-1"], ["rate"]),
    ],
)
def test_bad_options_get_one_line_errors(argv, words, capsys):
    status, out, err = run_main(["bench", "capstone", "--no-save", *argv], capsys)
    assert_one_line_error(status, err, *words)
    assert out == ""


def test_options_are_checked_on_construction():
    with pytest.raises(ValueError, match="repeats"):
        CapstoneBench(repeats=0)
    with pytest.raises(ValueError, match="rate"):
        CapstoneBench(rate=0.0)
    with pytest.raises(ValueError, match="sweep_rates"):
        CapstoneBench(sweep_rates=(4.0, 0.0))
    assert CapstoneBench(device="cpu").dense_dtype == torch.float32
