"""KV transfer over real links against prefill, by hand."""

import pytest

from minillm import preset
from minillm.kv.memory import kv_cache_bytes
from minillm.measure.links import LINKS, Link, kv_bytes, kv_transfer_rows, prefill_flops, prefill_seconds
from minillm.serving.handoff import kv_handoff_bytes

H100_BF16 = 989e12


def test_transfer_time_is_latency_plus_bytes_over_bandwidth():
    link = Link("test", bandwidth=10e9, latency=2e-6, source="none")
    assert link.transfer_time(0) == 2e-6
    assert link.transfer_time(5e9) == pytest.approx(0.5 + 2e-6, rel=1e-12)
    assert Link("free", 1.0, 0.0, "none").transfer_time(3) == 3.0


def test_link_presets_are_one_direction_spec_figures():
    bandwidths = {name: link.bandwidth for name, link in LINKS.items()}
    assert bandwidths == pytest.approx(
        {
            "PCIe 4.0 x16": 31.5e9,
            "PCIe 5.0 x16": 63.0e9,
            "NVLink 4 (H100)": 450e9,  # 900 GB/s is both directions together
            "RDMA 100 Gb/s": 12.5e9,
            "RDMA 400 Gb/s": 50e9,
        }
    )
    assert all(0 < link.latency < 1e-4 and link.source for link in LINKS.values())


def test_kv_bytes_for_llama_3_8b_and_70b_at_4k_tokens_in_bf16():
    assert kv_bytes(preset("Llama-3-8B"), 4096, 2) == 2 * 32 * 8 * 128 * 4096 * 2 == 536_870_912
    assert kv_bytes(preset("Llama-3-70B"), 4096, 2) == 2 * 80 * 8 * 128 * 4096 * 2 == 1_342_177_280


@pytest.mark.parametrize("name", ["Llama-3-8B", "Llama-3-70B", "Llama-2-7B", "Qwen2.5-0.5B"])
def test_kv_bytes_agrees_with_the_kv_and_serving_formulas(name):
    config = preset(name)
    assert kv_bytes(config, 1000, 2) == kv_cache_bytes(config, 1000, dtype="bf16") == kv_handoff_bytes(config, 1000, 2)


def test_prefill_of_llama_3_8b_at_4k_tokens_on_an_h100_by_hand():
    config = preset("Llama-3-8B")
    params = config.num_params(include_embeddings=False)  # ~6.98e9
    attention = 2 * 2 * 32 * 4096**2 * 32 * 128 / 2  # QK^T and PV, causal: half the pairs
    flops = 2 * params * 4096 + attention  # ~6.16e13
    assert prefill_flops(config, 4096) == pytest.approx(flops, rel=1e-3)
    seconds = prefill_seconds(config, 4096, H100_BF16, mfu=0.5)
    assert seconds == pytest.approx(flops / (H100_BF16 * 0.5), rel=1e-3)
    assert 0.12 < seconds < 0.13
    assert prefill_seconds(config, 4096, H100_BF16, mfu=0.25) == pytest.approx(2 * seconds)


def test_attention_makes_prefill_grow_faster_than_linearly():
    config = preset("Llama-3-8B")
    assert 2 * prefill_flops(config, 2048) < prefill_flops(config, 4096) < 2.2 * prefill_flops(config, 2048)


def test_kv_transfer_rows_one_per_model_and_link():
    configs = [preset("Llama-3-8B"), preset("Llama-3-70B")]
    rows = kv_transfer_rows(configs, 4096, list(LINKS.values()))
    assert len(rows) == 2 * len(LINKS)
    assert [r["model"] for r in rows] == ["Llama-3-8B"] * len(LINKS) + ["Llama-3-70B"] * len(LINKS)
    assert [r["link"] for r in rows[: len(LINKS)]] == list(LINKS)
    by_key = {(r["model"], r["link"]): r for r in rows}
    nvlink_8b = by_key["Llama-3-8B", "NVLink 4 (H100)"]
    assert nvlink_8b["kv_bytes"] == 536_870_912 and nvlink_8b["tokens"] == 4096
    assert nvlink_8b["transfer_ms"] == pytest.approx((5e-6 + 536_870_912 / 450e9) * 1e3)
    rdma_70b = by_key["Llama-3-70B", "RDMA 100 Gb/s"]
    assert rdma_70b["transfer_ms"] == pytest.approx(107.4, abs=0.1)
    for r in rows:
        assert r["transfer_vs_prefill"] == pytest.approx(r["transfer_ms"] / r["prefill_ms"])
    # the 70B's K/V grow 2.5x over the 8B's but its prefill ~9.5x: the transfer matters less
    ratio = {model: by_key[model, "PCIe 4.0 x16"]["transfer_vs_prefill"] for model in ("Llama-3-8B", "Llama-3-70B")}
    assert ratio["Llama-3-70B"] < ratio["Llama-3-8B"]


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: Link("x", 0, 1e-6, "s"), "bandwidth"),
        (lambda: Link("x", -1e9, 1e-6, "s"), "bandwidth"),
        (lambda: Link("x", float("inf"), 1e-6, "s"), "bandwidth"),
        (lambda: Link("x", 1e9, -1e-6, "s"), "latency"),
        (lambda: Link("x", 1e9, 1e-6, "s").transfer_time(-1), "nbytes"),
        (lambda: kv_bytes(preset("Llama-3-8B"), 0), "tokens"),
        (lambda: kv_bytes(preset("Llama-3-8B"), 16, dtype_bytes=0), "dtype_bytes"),
        (lambda: prefill_seconds(preset("Llama-3-8B"), 4096, 0), "peak_flops"),
        (lambda: prefill_seconds(preset("Llama-3-8B"), 4096, H100_BF16, mfu=0), "mfu"),
        (lambda: prefill_seconds(preset("Llama-3-8B"), 4096, H100_BF16, mfu=1.5), "mfu"),
        (lambda: prefill_seconds(preset("Llama-3-8B"), 8193, H100_BF16), "max_seq_len"),
        (lambda: kv_transfer_rows([], 4096, list(LINKS.values())), "at least one"),
        (lambda: kv_transfer_rows([preset("Llama-3-8B")], 4096, []), "at least one"),
    ],
)
def test_bad_inputs_raise_value_error_naming_the_problem(make, message):
    with pytest.raises(ValueError, match=message):
        make()
