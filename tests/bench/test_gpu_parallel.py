"""The GPU check's tensor-parallel section on a CPU: a tiny model's shards decode, their bytes
shrink with tp, and the prediction adds exactly the all-reduce cost model to the measured compute."""

from __future__ import annotations

import time

import pytest
import torch

from minillm.bench.gpu_parallel import LINKS, predicted_rows, tp_shard_decode
from minillm.core.config import preset
from minillm.parallel.predict import TP_LINKS, allreduce_seconds, published_speedups
from tests.conftest import tiny_config

TINY = tiny_config(n_heads=8, n_kv_heads=8, head_dim=8, dim=64, ffn_dim=64, max_seq_len=64)


def test_the_section_runs_small_on_a_cpu():
    out: dict = {}
    tp_shard_decode(time.monotonic() + 60, out, "cpu", TINY, dtype=torch.float32, context=16, steps=4)
    shards = out["shards"]
    assert [r["tp"] for r in shards] == [1, 2, 4, 8]
    assert all(r["eager_ms"] > 0 and r["compute_ms"] == r["eager_ms"] and "graphed_ms" not in r for r in shards)
    sizes = [r["bytes_per_step"] for r in shards]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] > sizes[-1]  # 1/tp of the layers, the head whole
    assert len(out["predicted"]) == len(LINKS) * 4
    first = next(r for r in out["predicted"] if r["tp"] == 1)
    assert first["comm_ms"] == 0 and first["predicted_speedup"] == pytest.approx(1.0)
    assert all(r["published_speedup"] is None for r in out["predicted"])  # not Llama-2-7B


def test_past_the_deadline_every_shard_is_skipped():
    out: dict = {}
    tp_shard_decode(time.monotonic() - 1, out, "cpu", TINY, dtype=torch.float32, context=16, steps=4)
    assert all(r["skipped"] == "time budget" for r in out["shards"]) and out["predicted"] == []


def test_bad_splits_and_contexts_fail_at_once():
    with pytest.raises(ValueError, match="3 ranks"):
        tp_shard_decode(time.monotonic() + 60, {}, "cpu", TINY, tps=(3,))
    with pytest.raises(ValueError, match="context"):
        tp_shard_decode(time.monotonic() + 60, {}, "cpu", TINY, context=8, steps=8)


def test_the_prediction_is_measured_compute_plus_the_all_reduces():
    config = preset("Llama-2-7B")
    shards = [{"tp": 1, "compute_ms": 10.0}, {"tp": 2, "compute_ms": 6.0}, {"tp": 4, "skipped": "time budget"}]
    rows = predicted_rows(config, shards)
    assert [(r["link"], r["tp"]) for r in rows] == [(link, tp) for link in LINKS for tp in (1, 2)]
    two = next(r for r in rows if r["tp"] == 2 and r["link"] == "NVLink 3 (A100)")
    comm = 2 * 32 * allreduce_seconds(4096 * 2, 2, TP_LINKS["NVLink 3 (A100)"])
    assert two["comm_ms"] == pytest.approx(1e3 * comm)
    assert two["predicted_speedup"] == pytest.approx(10.0 / (6.0 + 1e3 * comm))
    assert two["compute_speedup"] == pytest.approx(10.0 / 6.0)
    assert two["published_speedup"] == pytest.approx(published_speedups("Llama-2-7B")[2])
    assert predicted_rows(config, shards[1:]) == []  # no 1-GPU shard: nothing to compare with
