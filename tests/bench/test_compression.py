"""The compression benchmark on a tiny random model and the bundled target: every table has
its rows, the speedups are relative to bf16, and bad options are refused."""

import pytest

from minillm.bench.compression import (
    TECHNIQUE_NAMES,
    CompressionBench,
    baseline_perplexity,
    bench_compression,
    format_compression,
    format_gpu_decode,
    format_matmul,
    matmul_copies,
    structured_shape,
    summary_rows,
)
from minillm.core.config import preset
from tests.conftest import tiny_config


def test_options_are_validated():
    with pytest.raises(ValueError, match="unknown technique 'int3'"):
        CompressionBench(techniques=("int3",))
    with pytest.raises(ValueError, match="batches must be positive integers"):
        CompressionBench(batches=(0,))
    with pytest.raises(ValueError, match="unknown preset"):
        CompressionBench(shape="no-such-shape")
    with pytest.raises(ValueError, match="repeats must be a positive integer"):
        CompressionBench(repeats=0)
    assert CompressionBench().shape.name == "SmolLM2-360M"


def test_structured_shape_drops_whole_kv_groups_and_a_quarter_of_the_neurons():
    c = structured_shape(preset("SmolLM2-360M"))  # 15 heads in 5 K/V groups of 3, ffn 2560
    assert (c.n_kv_heads, c.n_heads, c.ffn_dim) == (4, 12, 1920)
    assert c.num_params() < preset("SmolLM2-360M").num_params()


def test_a_small_run_has_every_table():
    options = CompressionBench(
        shape=tiny_config(dim=64, ffn_dim=128, n_heads=4, n_kv_heads=4, vocab_size=256, name="tiny64"),
        techniques=("bf16", "int8", "int4 g32", "int4 g128 GPTQ", "Wanda 2:4", "structured 25%"),
        batches=(1, 2),
        context=8,
        new_tokens=2,
        repeats=1,
        matmul_shape=(64, 64),
        matmul_rows=(1, 4),
        quality_windows=1,
        calibration=2,
        device="cpu",
    )
    result = bench_compression(options)
    assert {r["format"] for r in result["matmul"]} >= {"bf16", "int8", "int4 g128"}
    # each timing cycles through copies of its layer spanning more than a last-level cache
    assert result["matmul_copies"] == matmul_copies((64, 64)) == 16 and matmul_copies((4096, 4096)) == 4
    assert "cycling 16 copies" in format_matmul(result)
    bf16 = [r for r in result["matmul"] if r["format"] == "bf16"]
    assert all(r["vs_bf16"] == 1.0 for r in bf16)
    timed = {(r["technique"], r["batch"]) for r in result["decode"]}
    # GPTQ times like int4 g128 and Wanda like bf16 (the same kernels): int4 g128 is timed for it
    assert timed == {(t, b) for t in ("bf16", "int8", "int4 g32", "int4 g128", "structured 25%") for b in (1, 2)}
    decode = {(r["technique"], r["batch"]): r for r in result["decode"]}
    assert (
        decode[("int4 g32", 1)]["model_bytes"] < decode[("int8", 1)]["model_bytes"] < decode[("bf16", 1)]["model_bytes"]
    )
    assert decode[("structured 25%", 1)]["parameters"] < decode[("bf16", 1)]["parameters"]
    quality = {r["technique"]: r for r in result["quality"]}
    assert set(quality) == {"fp32 (reference)", *options.techniques}
    assert quality["int8"]["agreement"] > 0.9 and quality["Wanda 2:4"]["perplexity"] > baseline_perplexity(result)
    summary = {r["technique"]: r for r in summary_rows(result)}
    # rows timed as another format are marked, with a note saying whose figures they carry
    assert summary["int4 g128 GPTQ"]["speed"] == summary["int4 g128"]["speed"] + "*"
    assert summary["Wanda 2:4"]["speed"] == summary["bf16"]["speed"] + "*" and not summary["int8"]["speed"].endswith(
        "*"
    )
    text = format_compression(result)
    assert "* not timed" in text
    assert max(len(line) for line in text.splitlines()) <= 88
    for title in ("linear layer", "Decode on a random tiny64", "Quality on minillm-target", "Summary"):
        assert title in text


def test_every_technique_has_a_unique_name():
    assert len(set(TECHNIQUE_NAMES)) == len(TECHNIQUE_NAMES) == 14


def test_saved_gpu_check_rows_become_a_table():
    saved = {
        "gpu": "NVIDIA H200",
        "sections": {
            "compression": {
                "model": "Llama-3-8B (random weights)",
                "decode": [
                    {
                        "scheme": "bf16",
                        "model_bytes": 16.06e9,
                        "batch_1": {"graphed_tokens_per_s": 200.0, "GB_s": 3212.0},
                    },
                    {"scheme": "int4-g128", "model_bytes": 4.5e9, "batch_1": {"graphed_tokens_per_s": 390.0}},
                    {"scheme": "fp8", "skipped": "fp8 e4m3 needs compute capability 8.9"},
                ],
            }
        },
    }
    text = format_gpu_decode(saved)
    assert "NVIDIA H200" in text and "int4-g128" in text and "390" in text and "needs compute" in text
    assert format_gpu_decode({"sections": {}}) is None
