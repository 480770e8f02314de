"""The KV benchmark: every technique's bytes and decode speed, its options, and its command line."""

import json

import pytest
import torch

from minillm import KVCache
from minillm.bench.kv import (
    KVBench,
    bench_kv,
    decode_tokens_per_s,
    format_kv_bench,
    kv_benchmark,
    mha_shape,
    summary_rows,
    techniques,
)
from minillm.cli.main import main
from minillm.core.cache import Cache
from minillm.core.config import PRESETS
from minillm.measure.report import PAGE_WIDTH
from tests.conftest import tiny_config, tiny_model


def test_benchmark_measures_every_technique_and_its_bytes():
    cfg = tiny_model(n_heads=4, n_kv_heads=4).config
    cfg = cfg.replace(max_seq_len=40)  # the benchmark stretches the context for the timed steps
    options = KVBench(contexts=(16, 40), new_tokens=2, repeats=3, device="cpu")
    rows = kv_benchmark(cfg, options, chosen=techniques(window=8, budget=8))
    by = {(r["technique"], r["context"]): r for r in rows}
    assert len(rows) == 2 * len(techniques())
    assert all(r["tokens_per_s"] > 0 for r in rows)
    base = by[("MHA (baseline)", 40)]["kv_bytes"]
    gqa = by[("GQA (about 1/4 of the K/V heads)", 40)]
    assert gqa["kv_bytes"] * 2 == base and gqa["kv_heads"] == 2  # 4 heads: 2 is the divisor nearest 4 / 4 above 1
    assert by[("MQA (1 K/V head)", 40)]["kv_bytes"] * 4 == base
    assert by[("cross-layer, groups of 2", 40)]["kv_bytes"] * 2 == base
    assert by[("sliding window 8", 40)]["kv_bytes"] == by[("sliding window 8", 16)]["kv_bytes"] == base * 8 // 40


def test_decode_speed_leaves_a_contiguous_cache_at_its_context():
    model = tiny_model()
    cache = KVCache.for_model(model, 2, 64)
    assert decode_tokens_per_s(model, cache, 30, new_tokens=4, repeats=2) > 0
    assert cache.length == 30  # the warm-up and every timed repeat were rolled back


def test_every_technique_makes_a_cache_the_model_takes():
    model = tiny_model(n_heads=4, n_kv_heads=4)
    for tech in techniques(window=8, budget=8):
        assert isinstance(tech.make_cache(model, 1, 16), Cache), tech.name


@pytest.mark.parametrize(
    "options, field",
    [
        (dict(contexts=()), "contexts"),
        (dict(contexts=(16, 0)), "contexts"),
        (dict(batch=0), "batch"),
        (dict(new_tokens=-1), "new_tokens"),
        (dict(repeats=1.5), "repeats"),
        (dict(repeats=True), "repeats"),
        (dict(dtype=torch.int8), "dtype"),
    ],
)
def test_kv_bench_options_are_checked_on_construction(options, field):
    with pytest.raises(ValueError, match=field):
        KVBench(**{"device": "cpu", **options})


def test_kv_bench_defaults_follow_the_device():
    options = KVBench(contexts=[8, 16], device="cpu")
    assert options.contexts == (8, 16) and options.device == torch.device("cpu") and options.dtype == torch.float32


def test_mha_shape_makes_a_preset_multi_head_and_names_unknown_shapes():
    config = mha_shape("SmolLM2-135M")
    assert config.n_kv_heads == config.n_heads and config.name.endswith("as MHA")
    with pytest.raises(ValueError, match="unknown preset"):
        mha_shape("no-such-model")


def test_bench_kv_reports_its_provenance_and_the_ratios_to_mha():
    config = tiny_model(n_heads=4, n_kv_heads=4).config
    result = bench_kv(config, KVBench(contexts=(16,), new_tokens=2, repeats=1, device="cpu"))
    for key in ("model", "parameters", "dtype", "batch", "new_tokens", "repeats", "device", "hardware", "threads"):
        assert key in result
    assert "load_average_before" in result and "load_average_after" in result
    mha = next(r for r in result["rows"] if r["technique"] == "MHA (baseline)")
    assert mha["memory_vs_mha"] == mha["speed_vs_mha"] == 1.0
    text = format_kv_bench(result)
    assert "tok/s" in text and "int8 KV" in text
    assert max(len(line) for line in text.splitlines()) <= PAGE_WIDTH
    assert {r["technique"].split()[0] for r in result["rows"]} >= {"GQA", "MQA"}
    assert "GQA (2 of 4 K/V heads)" in {r["technique"] for r in result["rows"]}
    summary = summary_rows(result["rows"], {"MHA (baseline)": 10.0, "int8 KV": 9.99}, 10.0)
    assert summary[0]["perplexity change"] == "+0.0" and summary[1]["perplexity change"] == "not measured"
    assert next(r for r in summary if r["technique"] == "int8 KV")["perplexity change"] == "+0.0"  # not -0.0
    assert "KV memory saved vs fp32 MHA" in summary[0]  # the header names its baseline


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--repeats", "0"], "repeats must be a positive integer"),
        (["--new-tokens", "0"], "new_tokens must be a positive integer"),
        (["--contexts", "16", "0"], "contexts must be positive integers"),
        (["--batch", "0"], "batch must be a positive integer"),
        (["--shape", "no-such-model"], "unknown preset 'no-such-model'"),
    ],
)
def test_bench_kv_cli_refuses_bad_options_in_one_line(argv, message, capsys):
    assert main(["bench", "kv", "--device", "cpu", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("minillm bench: error:") and message in err and len(err.strip().splitlines()) == 1


def test_bench_kv_cli_writes_its_figures(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(PRESETS, "tiny-mha", tiny_config())
    out = tmp_path / "kv.json"
    argv = ["bench", "kv", "--shape", "tiny-mha", "--contexts", "8", "--new-tokens", "2", "--repeats", "1"]
    assert main([*argv, "--device", "cpu", "--no-save", "--json", str(out)]) == 0
    assert "MHA (baseline)" in capsys.readouterr().out
    saved = json.loads(out.read_text())
    assert saved["model"].endswith("as MHA") and len(saved["rows"]) == len(techniques())


@pytest.mark.parametrize("argv, message", [(["--steps", "0"], "steps"), (["--eval-every", "0"], "eval_every")])
def test_train_gqa_cli_refuses_bad_options_before_loading(argv, message, capsys):
    assert main(["train", "gqa", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("minillm train: error:") and message in err
