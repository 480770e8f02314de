"""Chapter 15's benchmark, --quick only (one run of the command line for the whole module): the
JSON's structure, greedy tokens equal to one process, counted bytes equal to the formulas, and
the pure pricing of the counts on GPU links."""

from __future__ import annotations

import json

import pytest

from minillm.bench.parallel import GPU_LINKS, ParallelBench, format_parallel, gpu_link_rows, message_seconds
from minillm.cli.main import main
from minillm.core.config import preset
from minillm.parallel.predict import TP_LINKS, allreduce_seconds

pytestmark = pytest.mark.slow  # several processes, a compile or a server: make test-fast leaves it out

DIM, LAYERS = 256, 6  # minillm-target
RANKS = (2, 4)  # the lead's full run adds 1 rank; here, the world sizes that communicate


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("parallel")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MINILLM_RESULTS", str(folder / "store"))
        command = ["bench", "parallel", "--quick", "--ranks", *map(str, RANKS), "--replicas", "1"]
        assert main([*command, "--json", str(folder / "out.json")]) == 0
    return json.loads((folder / "out.json").read_text()), folder


def test_quick_run_writes_json_and_saves_nothing(run):
    figures, folder = run
    assert not (folder / "store").exists()  # a quick run is never a saved result
    for key in ("hardware", "threads_per_rank", "cpu_cores", "note", "options", "load_average_after"):
        assert key in figures
    assert "share" in figures["note"] and "communication volume" in figures["note"]
    assert figures["dtype"] == "float32" and figures["threads_per_rank"] == 1
    for key in ("tensor_parallel", "pipeline_parallel", "gpu_links", "tp_speedups", "replicas"):
        assert figures[key], key


def test_tensor_parallel_bytes_are_the_formula(run):
    rows = run[0]["tensor_parallel"]
    assert [r["ranks"] for r in rows] == list(RANKS)
    for r in rows:
        assert r["tokens_equal"] and r["bytes_equal"]
        assert r["calls_per_token"] == 2 * LAYERS
        assert r["bytes_per_token"] == r["formula_bytes_per_token"] == 2 * LAYERS * DIM * 4
        assert r["prefill_bytes"] == r["prefill_formula_bytes"] == 2 * LAYERS * 128 * DIM * 4
        assert r["wire_bytes_per_token"] == 2 * LAYERS * 2 * (r["ranks"] - 1) / r["ranks"] * DIM * 4
        assert r["prefill_ms"] > 0 and r["decode_ms"] > 0


def test_pipeline_bytes_are_the_formula(run):
    rows = run[0]["pipeline_parallel"]
    assert [r["ranks"] for r in rows] == list(RANKS)
    for r in rows:
        p = r["ranks"]
        assert r["tokens_equal"] and r["bytes_equal"] and sum(r["layers"]) == LAYERS
        expected = (p - 1) * DIM * 4 + 8  # one activation per boundary, the token back
        assert r["bytes_per_token"] == r["formula_bytes_per_token"] == expected
        assert r["total_bytes"] == r["total_formula_bytes"]
        assert r["messages_per_token"] == p  # p - 1 activations forward, one token back
        assert r["bubble_formula"] == pytest.approx((p - 1) / p)
        assert 0 <= r["bubble_measured"] < 1


def test_gpu_links_speedups_and_replicas(run):
    figures = run[0]
    links = figures["gpu_links"]
    assert len(links) == len(GPU_LINKS) * 2 * 2  # tensor and pipeline, 2 and 4 ranks
    assert all(r["comm_us_per_token"] > 0 for r in links)
    published = [r for r in figures["tp_speedups"] if r["published_speedup"] is not None]
    assert {r["model"] for r in published} >= {"Llama-2-7B"}
    assert "Llama-3-70B" in {r["model"] for r in figures["tp_speedups"]}
    replicas = figures["replicas"]
    assert [r["replicas"] for r in replicas] == [1]  # tests/parallel/test_replicas.py runs 2
    for r in replicas:
        assert r["tokens_equal"] and r["errors"] == 0 and r["output_tokens_per_s"] > 0
        assert r["output_tokens"] == 4 * 4  # ParallelBench.quick(): 4 requests of 4 tokens
    text = format_parallel(figures)
    assert "Tensor parallel" in text and "gpt-fast" in text and "Data parallel" in text
    assert max(len(line) for line in text.splitlines()) <= 88


def test_experts_and_the_ring_equal_one_process_and_count_their_bytes(run):
    figures = run[0]
    ep, cp = figures["expert_parallel"], figures["context_parallel"]
    assert ep["max_abs_diff"] <= ep["tolerance"] and ep["bytes_equal"]
    assert sum(ep["tokens"]) == 128 and sum(ep["rows_per_expert"]) == 128 * ep["top_k"]
    assert ep["max_over_mean"] >= 1 and ep["rank_max_over_mean"] >= 1
    assert cp["max_abs_diff"] <= cp["tolerance"] and cp["kv_share"] == 0.5  # 64 tokens, 32 a rank
    assert cp["imbalance"] == pytest.approx(1.0) and cp["contiguous_imbalance"] > 1  # zigzag balances the work
    text = format_parallel(figures)
    assert "Expert parallel" in text and "Context parallel" in text


def test_gpu_link_prices_are_the_counts_times_the_cost_model():
    config = preset("Llama-2-7B")
    tensor = [{"ranks": 2, "payload_per_call": 8192, "calls_per_token": 64, "decode_ms": 1.0}]
    pipeline = [{"ranks": 4, "bytes_per_token": 3 * 4096 * 4 + 8, "decode_ms": 1.0}]
    rows = gpu_link_rows(config, tensor, pipeline)
    nv3 = TP_LINKS["NVLink 3 (A100)"]
    t = next(r for r in rows if r["scheme"] == "tensor" and r["link"] == nv3.name)
    assert t["comm_us_per_token"] == pytest.approx(1e6 * 64 * allreduce_seconds(8192, 2, nv3))
    p = next(r for r in rows if r["scheme"] == "pipeline" and r["link"] == nv3.name)
    assert p["comm_us_per_token"] == pytest.approx(1e6 * (3 * message_seconds(4096 * 4, nv3) + message_seconds(8, nv3)))


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"ranks": (3,)}, "3 ranks"),
        ({"ranks": (8,)}, "pipeline stages"),  # 8 query heads split, but only 6 layers
        ({"prompt_len": 1000}, "context"),
        ({"repeats": 0}, "repeats"),
        ({"replicas": ()}, "replicas"),
    ],
)
def test_bad_options_fail_before_any_process(changes, match):
    with pytest.raises(ValueError, match=match):
        ParallelBench(**changes).check()


def test_cli_bad_input_exits_2(capsys):
    assert main(["bench", "parallel", "--ranks", "3", "--no-save"]) == 2
    assert "3 ranks" in capsys.readouterr().err
