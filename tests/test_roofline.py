"""Roofline arithmetic by hand, and the measurements' sanity."""

import pytest
import torch

from minillm import preset
from minillm.roofline import (
    DATASHEETS,
    Roofline,
    forward_cost,
    layer_costs,
    matmul_cost,
    measure_bandwidth,
    measure_matmul_flops,
)


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
