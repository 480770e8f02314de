"""bench peers: minillm against llama.cpp and torchao, each contender a process of its own. The
peers are optional: without them their rows say how to install them, and the tests that need
them skip."""

import importlib.util

import pytest

from minillm.bench import peers
from minillm.bench.peers import PeersBench, Worker, WorkerError, agreement, bench_peers, format_peers, summary
from minillm.core.config import PRESETS
from tests.conftest import tiny_config

HAS_LLAMA_CPP = all(importlib.util.find_spec(m) is not None for m in ("llama_cpp", "gguf"))
HAS_TORCHAO = importlib.util.find_spec("torchao") is not None


def test_bad_options_are_value_errors_that_name_them():
    with pytest.raises(ValueError, match="a model .* or a shape"):
        PeersBench(model="minillm-target", shape="SmolLM2-360M")
    with pytest.raises(ValueError, match="formats must be some of"):
        PeersBench(formats=("fp16",))
    with pytest.raises(ValueError, match="new_tokens must be at least 2"):
        PeersBench(new_tokens=1)
    with pytest.raises(ValueError, match="rounds must be a positive integer"):
        PeersBench(rounds=0)


def test_a_missing_peer_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(peers.importlib.util, "find_spec", lambda name: None)
    assert peers.missing_peer("minillm") is None
    assert peers.missing_peer("llama.cpp").startswith("not installed: pip install 'minillm[peers]'")
    assert "torchao" in peers.missing_peer("torchao")


def test_agreement_and_summary():
    assert agreement([1, 2, 3], [1, 2, 4]) == 2 and agreement([1, 2], [1, 2]) == 2 and agreement([5], None) is None
    rows = [
        {"group": "int8", "engine": "minillm", "format": "W8A8", "tokens_per_s": 30.0},
        {"group": "int8", "engine": "minillm", "format": "int8 weight-only", "tokens_per_s": 20.0},
        {"group": "int8", "engine": "llama.cpp", "format": "Q8_0", "tokens_per_s": 25.0},
        {"group": "int8", "engine": "torchao", "format": "int8 weight-only", "skipped": "not installed"},
        {"group": "fp32", "engine": "minillm", "format": "fp32", "tokens_per_s": 9.0},  # no peer: no ratio
    ]
    (only,) = summary(rows)
    assert (
        only["group"] == "int8" and only["ratio"] == pytest.approx(1.2) and only["best peer"] == "llama.cpp Q8_0 25.0"
    )


def test_a_worker_that_fails_answers_an_error_and_is_reaped():
    worker = Worker("minillm fp32", threads=1)
    try:
        spec = {"engine": "minillm", "format": "fp32", "path": "/nonexistent/model", "prompt": [1], "new_tokens": 2}
        with pytest.raises(WorkerError, match="minillm fp32: .*nonexistent"):
            worker.request({"load": spec}, timeout=120)
        with pytest.raises(WorkerError, match="unknown engine"):  # still up, and says what was wrong
            worker.request({"load": {**spec, "engine": "vllm"}}, timeout=120)
    finally:
        worker.close()
    assert worker.proc.returncode == 0


@pytest.mark.slow
def test_minillm_rows_on_random_weights_and_the_peers_rows_without_them(monkeypatch):
    monkeypatch.setitem(PRESETS, "tiny-peers", tiny_config(vocab_size=4096, name="tiny-peers"))
    monkeypatch.setattr(peers, "missing_peer", lambda e: None if e == "minillm" else "not installed: pip install x")
    o = PeersBench(model=None, shape="tiny-peers", formats=("fp32", "int8"), new_tokens=6, rounds=2, compile=False)
    result = bench_peers(o)
    rows = {(r["engine"], r["format"]): r for r in result["rows"]}
    assert set(rows) == {(c.engine, c.label) for c in peers.CONTENDERS if c.group in ("fp32", "int8")}
    for name in ("fp32", "int8 weight-only", "W8A8"):
        r = rows["minillm", name]
        assert r["tokens_per_s"] > 0 and len(r["tokens_per_s_runs"]) == 2, r
    assert rows["minillm", "fp32"]["tokens_agree"] == 6  # itself
    assert rows["llama.cpp", "F32"]["skipped"] == "not installed: pip install x" and result["summary"] == []
    text = format_peers(result)
    assert "random tiny-peers (seed 0)" in text and "not installed: pip install x" in text


@pytest.mark.slow
@pytest.mark.skipif(not HAS_LLAMA_CPP, reason="llama-cpp-python and gguf are not installed (minillm[peers])")
def test_llama_cpp_f32_decodes_minillms_tokens_on_the_same_weights():
    o = PeersBench(model="minillm-target", formats=("fp32", "int4"), new_tokens=16, rounds=2, compile=False)
    result = bench_peers(o)
    rows = {(r["engine"], r["format"]): r for r in result["rows"]}
    assert rows["llama.cpp", "F32"]["tokens_agree"] == 16, rows["llama.cpp", "F32"]
    assert rows["llama.cpp", "Q4_0"]["tokens_per_s"] > 0
    assert {s["group"] for s in result["summary"]} == {"fp32", "int4"}


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TORCHAO, reason="torchao is not installed (minillm[peers])")
def test_torchao_quantizes_minillms_model_and_decodes():
    o = PeersBench(model="minillm-target", formats=("fp32", "int8", "int4"), new_tokens=8, rounds=1, compile=False)
    result = bench_peers(o)
    rows = {(r["engine"], r["format"]): r for r in result["rows"]}
    assert rows["torchao", "int8 weight-only"]["tokens_per_s"] > 0, rows["torchao", "int8 weight-only"]
    assert rows["torchao", "int8 weight-only"]["tokens_agree"] >= 2
    assert rows["torchao", "int4 g32"]["tokens_per_s"] > 0, rows["torchao", "int4 g32"]


def test_format_peers_shows_only_the_groups_asked_for():
    rows = [
        {"group": g, "engine": e, "format": f, "tokens_per_s": v, "prefill_ms": 1.0, "tokens_agree": 4}
        for g, e, f, v in [
            ("fp32", "minillm", "fp32", 10.0),
            ("fp32", "llama.cpp", "F32", 8.0),
            ("int8", "minillm", "W8A8", 20.0),
            ("int8", "llama.cpp", "Q8_0", 25.0),
        ]
    ]
    result = {"model": "m", "prompt_len": 4, "new_tokens": 4, "rounds": 1, "threads": 1, "rows": rows}
    result["summary"] = summary(rows)
    fp32 = format_peers(result, groups=("fp32",))
    assert "F32" in fp32 and "1.25x" in fp32 and "Q8_0" not in fp32 and "0.80x" not in fp32
    both = format_peers(result)
    assert "Q8_0" in both and "0.80x" in both


def test_a_compiled_contender_whose_tokens_differ_from_its_eager_ones_is_not_compared():
    c = next(c for c in peers.CONTENDERS if c.engine == "torchao" and c.group == "int8")
    r = {"loaded_s": 1.0, "decode": [900.0], "prefill": [0.01], "eager_tokens": [5, 6, 7, 8]}
    row = peers._row(c, r, "int8", tokens=[5, 9, 9, 9, 9])
    assert "eager tokens differ from token 2" in row["invalid"]
    assert "invalid" not in peers._row(c, r, "int8", tokens=[5, 6, 7, 8, 1])
    assert "invalid" not in peers._row(c, r, "int8", tokens=[5, 6])  # fewer timed tokens than checked
    ours = {"group": "int8", "engine": "minillm", "format": "W8A8", "tokens_per_s": 20.0, "prefill_ms": 1.0}
    assert summary([ours, row]) == []  # the only peer was wrong: nothing to compare with
    text = format_peers(
        {"model": "m", "prompt_len": 4, "new_tokens": 5, "rounds": 1, "threads": 1, "rows": [ours, row], "summary": []}
    )
    assert "(1)" in text and "not compared" in text and all(len(line) <= 88 for line in text.splitlines())
