"""The GPU check script: its pure helpers, and that without CUDA it exits 0 and writes nothing."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import minillm
from minillm.bench import gpu as gpu_check
from minillm.bench import gpu_compression, gpu_decode
from minillm.bench.gpu_kernels import attention_flops
from minillm.compression import model_bytes
from minillm.core.cache import KVCache
from minillm.core.compiled import StaticCache
from minillm.measure.report import gpu_slug, result_path
from tests.conftest import tiny_model


def test_no_gpu_exits_zero_and_writes_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main(["--results", str(tmp_path / "results")]) == 0
    assert "needs a CUDA GPU" in capsys.readouterr().out
    assert not (tmp_path / "results").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU path of the command line")
def test_no_gpu_command_line(tmp_path):
    root = Path(__file__).resolve().parents[2]
    command = [sys.executable, "-m", "minillm.bench.gpu", "--results", str(tmp_path / "r")]
    done = subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "needs a CUDA GPU" in done.stdout
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "name, slug",
    [
        ("NVIDIA H200", "h200"),
        ("Tesla T4", "t4"),
        ("NVIDIA A100-SXM4-80GB", "a100-sxm4-80gb"),
        ("NVIDIA L4", "l4"),
        ("NVIDIA GeForce RTX 4090", "geforce-rtx-4090"),
        ("  ", "gpu"),
    ],
)
def test_gpu_slug(name, slug):
    """The check's results folder is the results store's own slug of the GPU's name."""
    assert gpu_slug(name) == slug


def test_results_path():
    path = result_path("gpu_check", gpu_slug("NVIDIA H200"), "results")
    assert path == Path("results/h200/gpu_check.json")


def test_datasheet_bandwidth():
    assert gpu_check.datasheet_bandwidth("NVIDIA H200") == pytest.approx(4.8e12)
    assert gpu_check.datasheet_bandwidth("Tesla T4") == pytest.approx(0.32e12)
    assert gpu_check.datasheet_bandwidth("Some Future GPU") is None


def test_attention_flops_non_causal():
    # 2 matmuls of 2 * T * S * hd FLOPs each, per (batch, head)
    assert attention_flops(2, 3, 5, 7, 64, causal=False) == 2 * 3 * 4 * 5 * 7 * 64


def test_attention_flops_causal_counts_the_visible_pairs():
    T, S, hd = 6, 10, 8
    visible = torch.ones(T, S, dtype=torch.bool).tril(S - T).sum().item()  # query i sees keys <= S - T + i
    assert attention_flops(1, 1, T, S, hd, causal=True) == 4 * hd * visible
    square = attention_flops(1, 1, 1024, 1024, 64, causal=True)
    assert square / attention_flops(1, 1, 1024, 1024, 64, causal=False) == pytest.approx(0.5, abs=1e-3)


def test_attention_flops_rejects_more_queries_than_keys():
    with pytest.raises(ValueError, match="q_len <= kv_len"):
        attention_flops(1, 1, 8, 4, 64, causal=True)


def test_the_static_cache_view_gives_the_same_logits_as_the_kv_cache():
    """The fixed-shape cache the GPU check's hand-written steps read (``StaticCache.view``, each
    token at the slot of its position) computes what KVCache computes."""
    model = tiny_model()
    static = StaticCache(model.config, 1, 16, torch.float32, device="cpu")
    cache = KVCache.for_model(model, 1, 16)
    with torch.no_grad():
        for i, token in enumerate([3, 14, 15, 92, 65]):
            ids = torch.tensor([[token]])
            expected = model(ids, None, cache)
            torch.testing.assert_close(model(ids, torch.tensor([[i]]), static.view), expected, atol=1e-5, rtol=0)
    assert static.positions[0, :6].tolist() == [0, 1, 2, 3, 4, -1]


def test_the_timed_decode_step_is_greedy_decoding_and_its_timer_a_median_of_single_steps():
    model = tiny_model()
    step, cache = gpu_decode.decode_step(model, 2, 16)
    tokens, token = [], torch.zeros(2, 1, dtype=torch.long)
    for position in range(4):
        token = step(token, torch.full((2, 1), position))
        tokens.append(token[0].item())
    expected = minillm.generate(model, [0], max_new_tokens=4, temperature=0.0).token_lists()[0]
    assert tokens == expected
    assert cache.positions[1, :5].tolist() == [0, 1, 2, 3, -1]


def test_the_decode_timer_is_the_median_of_single_steps_after_the_warm_up(monkeypatch):
    times = iter([9.0, 9.0, 3.0, 1.0, 2.0, 100.0, 4.0])  # two warm-up steps, then five timed
    positions = []

    def fake_timed(fn, device):
        out = fn()
        return next(times), out

    def step(token, position):
        positions.append(position[0, 0].item())
        return token + 1

    monkeypatch.setattr(gpu_decode, "timed", fake_timed)
    assert gpu_decode.median_step_seconds(step, 2, steps=5, device="cpu", warmup=2) == 3.0
    assert positions == list(range(7))  # one position per step, warm-up included


def test_section_errors_are_recorded_not_raised(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    report = {"sections": {}}

    def broken(deadline, out):
        out["rows"] = ["measured before the failure"]
        raise RuntimeError("boom")

    gpu_check.run_section(report, "correctness", broken, tmp_path / "out.json")
    section = report["sections"]["correctness"]
    assert section["error"] == "RuntimeError: boom"
    assert section["rows"] == ["measured before the failure"]
    assert json.loads((tmp_path / "out.json").read_text())["sections"]["correctness"]["error"] == "RuntimeError: boom"


def test_a_section_past_its_limit_is_stopped_and_keeps_its_figures(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setitem(gpu_check.SECTION_LIMITS_S, "slow", 1)
    report = {"sections": {}}

    def slow(deadline, out):
        out["first"] = 1.0
        time.sleep(5)
        out["second"] = 2.0

    gpu_check.run_section(report, "slow", slow, tmp_path / "out.json")
    section = report["sections"]["slow"]
    assert section["error"].startswith("SectionTimeout") and section["first"] == 1.0 and "second" not in section
    assert section["seconds"] < 4


def test_the_section_limits_fit_in_nine_minutes():
    assert set(gpu_check.SECTION_LIMITS_S) == {
        "correctness",
        "attention_speed",
        "paged_bandwidth",
        "decode",
        "compression",
        "disagg",
        "parallel",
        "capstone",
        "serving",
    }
    assert sum(gpu_check.SECTION_LIMITS_S.values()) < 9 * 60  # one device command: at most 10 minutes


def test_the_2_4_mask_keeps_the_two_largest_of_every_four():
    w = torch.tensor([[0.1, -3.0, 2.0, 0.5, 4.0, 0.0, -0.2, 0.3]])
    mask = gpu_compression.two_four_mask(w)
    assert mask.tolist() == [[False, True, True, False, True, False, False, True]]
    big = gpu_compression.two_four_mask(torch.randn(6, 40))
    assert (big.view(6, 10, 4).sum(-1) == 2).all()
    with pytest.raises(ValueError, match="multiple of 4"):
        gpu_compression.two_four_mask(torch.zeros(2, 6))


def test_speedup_goals_compare_batch_1_with_the_16_bit_row():
    rows = [
        {"scheme": "bf16", "batch_1": {"graphed_tokens_per_s": 100.0}},
        {"scheme": "int8", "batch_1": {"graphed_tokens_per_s": 150.0}},
        {"scheme": "int4-g128", "error": "RuntimeError: boom"},
    ]
    int8, int4 = gpu_compression.speedup_goals(rows)
    assert int8["speedup"] == pytest.approx(1.5) and int8["met"] and "int8" in int8["text"]
    assert int4["speedup"] is None and not int4["met"]


def test_print_goals_prints_every_goal_of_a_section(capsys):
    goals = [{"text": "int8 fast", "speedup": 1.5, "met": True}, {"text": "int4 fast", "speedup": 1.2, "met": False}]
    gpu_check.print_goals({"sections": {"compression": {"goals": goals}, "decode": {"error": "OOM"}}})
    out = capsys.readouterr().out
    assert "[MET] int8 fast" in out and "[not met] int4 fast" in out and "[error] decode: OOM" in out


def test_a_scheme_row_quantizes_and_decodes():
    """The compression section's row on the CPU (eager only, no CUDA graph): the fp32 weights
    stored in 8 bits take under half the bytes (the embedding stays fp32); every layer reports
    its path."""
    made = []

    def make():
        made.append(tiny_model())
        return made[-1]

    dense = gpu_compression.scheme_row(make, "fp32", None, None, batches=(1, 2), steps=2, graphed=False)
    row = gpu_compression.scheme_row(make, "int8", "int8", None, batches=(1, 2), steps=2, graphed=False)
    assert row["batch_1"]["eager_tokens_per_s"] > 0 and "eager_tokens_per_s" not in row["batch_2"]
    assert row["model_bytes"] < 0.5 * dense["model_bytes"]
    assert row["batch_1"]["bytes_per_step"] < row["batch_2"]["bytes_per_step"]  # a second cache row
    assert sum(row["paths"].values()) == 2 * 4 + 1  # qkv, o, gate_up, down per layer; lm_head
    assert dense["paths"] == {"nn.Linear (dense)": 9}


def test_decode_bytes_count_the_weights_the_looked_up_rows_and_the_cache():
    model = tiny_model()
    cache = StaticCache(model.config, 2, 16, torch.float32, device="cpu")
    embed = model.embed_tokens.weight
    kv = 2 * model.config.n_layers * 2 * model.config.n_kv_heads * 16 * model.config.head_dim * 4
    assert cache.nbytes == kv
    expected = model_bytes(model) - embed.nbytes + 2 * embed[0].nbytes + kv
    assert gpu_decode.decode_bytes(model, cache) == expected


def test_the_disagg_section_runs_small_on_a_cpu():
    """The GPU section's code path on a tiny model: step costs fitted, a handoff's bytes equal to
    the formula, the simulated sweep on the fitted costs."""
    import time

    from minillm.bench.gpu_disagg import disagg_steps
    from tests.conftest import tiny_config

    out: dict = {}
    config = tiny_config(vocab_size=2048, max_seq_len=2100, name="tiny-2k")
    disagg_steps(time.monotonic() + 600, out, device="cpu", model_config=config)
    assert out["steps"]["count"] > 10 and out["steps"]["fitted"]["per_prefill_token"] >= 0
    assert out["handoff"]["equal"] and out["handoff"]["bytes"] == 2 * 2 * 2 * 8 * 1024 * 2
    assert out["handoff"]["to_host_gb_s"] > 0
    assert {r["mode"] for r in out["simulated"]["rows"]} == {"colocated", "chunked", "disagg 1:1"}


@pytest.mark.slow
def test_the_serving_section_runs_small_on_a_cpu():
    """The GPU section's code path on a tiny model on a CPU: both engines run, the tokens agree."""
    import time

    from minillm.bench.gpu_serving import composed_engine
    from tests.conftest import tiny_config

    out: dict = {}
    config = tiny_config(vocab_size=256, max_seq_len=128, name="tiny")
    composed_engine(time.monotonic() + 600, out, "cpu", config, torch.float32, batch=2, prompt_len=8, new_tokens=4)
    assert out["eager"]["decode_step_ms"] > 0 and out["compiled"]["graphs_compiled"] >= 1
    assert out["tokens_agree_pct"] == 100.0 and out["compiled"]["attention"] == "reference"  # compiled on a CPU
