"""Roofline arithmetic by hand, and the measurements' sanity."""

import pytest
import torch

from minillm import preset
from minillm.bench.roofline import measure_bandwidth, measure_matmul_flops
from minillm.measure.roofline import DATASHEETS, Roofline, forward_cost, layer_costs, matmul_cost


def test_matmul_cost_by_hand():
    op = matmul_cost("x", m=1, k=4096, n=4096, bytes_per_element=2)
    assert op.flops == 2 * 4096 * 4096
    assert op.bytes == 2 * (4096 + 4096 * 4096 + 4096)
    assert op.intensity == pytest.approx(1.0, rel=1e-3)  # a decode matmul: ~1 FLOP per byte in fp16


def test_roof_and_ridge():
    roof = Roofline(peak_flops=100e12, peak_bandwidth=2e12)
    assert roof.ridge == 50
    assert roof.attainable(1) == 2e12 and roof.attainable(1000) == 100e12
    assert roof.bound(1) == "memory" and roof.bound(50) == "compute"


def test_decode_is_memory_bound_and_batching_moves_it_toward_the_ridge():
    cfg = preset("Llama-3-8B")
    h100 = next(a for a in DATASHEETS if a.name == "H100-SXM")
    assert 250 < h100.ridge < 350
    intensities = [forward_cost(cfg, batch=b, new_tokens=1, context=1024).intensity for b in (1, 8, 64)]
    assert intensities[0] < 2 and intensities[0] < intensities[1] < intensities[2] < h100.ridge
    prefill = forward_cost(cfg, batch=1, new_tokens=2048, context=2048)
    assert prefill.intensity > h100.ridge  # a long prefill is compute-bound


def test_forward_flops_are_about_two_per_parameter_per_token():
    cfg = preset("Llama-3-8B")
    cost = forward_cost(cfg, batch=1, new_tokens=1, context=1)
    params = cfg.num_params() - cfg.vocab_size * cfg.dim  # the input embedding is a lookup, not a matmul
    assert cost.flops == pytest.approx(2 * params, rel=0.01)
    assert {op.name for op in layer_costs(cfg, 1, 1, 1)} >= {"qkv_proj", "attention", "mlp_down"}


def test_measurements_are_positive_and_plausible():
    flops = measure_matmul_flops(n=256, repeats=2)
    bandwidth = measure_bandwidth(megabytes=16, repeats=2)
    assert 1e8 < flops < 1e15
    assert 1e8 < bandwidth < 1e13
    assert measure_matmul_flops(dtype=torch.float64, n=128, repeats=1) > 0


def test_decode_ceiling_of_an_8b_model_on_an_h100_by_hand():
    from minillm.measure.roofline import decode_upper_bound_tokens_per_s

    tps = decode_upper_bound_tokens_per_s(8.03e9, 2, 3.35e12)
    assert tps == pytest.approx(3.35e12 / 16.06e9)
    assert 200 < tps < 215
    with pytest.raises(ValueError, match="positive"):
        decode_upper_bound_tokens_per_s(8e9, 0, 3.35e12)


def test_accelerator_chooser_fits_ceilings_and_costs():
    from minillm.measure.roofline import accelerator_chooser, datasheet_rows

    rows = {r["accelerator"]: r for r in accelerator_chooser(8.03e9, 2, {"H100-SXM": 3.0, "L4": 1.0})}
    assert not rows["T4"]["fits"] and rows["T4"]["tokens_per_s"] is None  # 16.06 GB > 16 GB
    assert rows["H200-SXM"]["tokens_per_s"] > rows["H100-SXM"]["tokens_per_s"] > rows["L4"]["tokens_per_s"]
    h100 = rows["H100-SXM"]
    assert h100["dollars_per_1m_tokens"] == pytest.approx(3.0 / (h100["tokens_per_s"] * 3600) * 1e6)
    assert rows["A100-80GB-SXM"]["dollars_per_1m_tokens"] is None  # no price given
    assert [r["accelerator"] for r in datasheet_rows()] == [a.name for a in DATASHEETS]


def test_measure_phases_reports_consistent_utilization():
    from minillm.bench.roofline import measure_phases
    from tests.conftest import tiny_model

    model = tiny_model()
    roof = Roofline(peak_flops=1e11, peak_bandwidth=1e10)
    prefill, decode = measure_phases(model, roof, batch=2, prompt_len=8, new_tokens=4, repeats=1)
    assert (prefill["phase"], decode["phase"]) == ("prefill", "decode")
    assert prefill["intensity"] > decode["intensity"]
    for row in (prefill, decode):
        assert row["mfu"] == pytest.approx(row["flops_per_s"] / 1e11)
        assert row["mbu"] == pytest.approx(row["bytes_per_s"] / 1e10)
        assert row["flops_per_s"] / row["bytes_per_s"] == pytest.approx(row["intensity"])
    with pytest.raises(ValueError, match="new_tokens"):
        measure_phases(model, roof, batch=1, prompt_len=8, new_tokens=1)


def test_plot_roofline_draws_roof_ridge_and_points():
    import matplotlib

    matplotlib.use("Agg")
    from minillm.viz.roofline import plot_roofline

    roof = Roofline(peak_flops=100e12, peak_bandwidth=2e12)
    ax = plot_roofline(roof, [("decode", 1.0, None), ("prefill", 500.0, 50e12)], title="t")
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
    assert "FLOP/byte" in ax.get_xlabel() and ax.get_title() == "t"
    assert len(ax.get_lines()) == 4  # roof, ridge, two points


def test_measured_roofline_is_positive():
    from minillm.bench.roofline import measure_roofline

    roof = measure_roofline(n=128, megabytes=8, repeats=1, trials=2)
    assert roof.peak_flops > 0 and roof.peak_bandwidth > 0 and roof.ridge > 0


def test_a_prefill_that_keeps_one_tokens_logits_counts_the_head_once():
    cfg = preset("SmolLM2-135M")
    full = forward_cost(cfg, batch=2, new_tokens=256, context=256)
    last = forward_cost(cfg, batch=2, new_tokens=256, context=256, head_tokens=1)
    head_per_token = 2 * cfg.dim * cfg.vocab_size
    assert full.flops - last.flops == pytest.approx(2 * 255 * head_per_token)
