"""Simulated quantization (compression.simulated): b-bit RTN stays within half a step of each
group and uses at most 2^b codes; NF4's levels are QLoRA's; rounding the weights unties a tied
head and leaves the embedding lookup alone; W8A8 rounds each token's activations within half
its step; SmoothQuant's fold keeps the model's function and, on a model with outlier features,
brings W8A8's logits far closer to the original's. GPTQ onto the b-bit grid is RTN with an
identity Hessian, cuts a layer's output error on correlated inputs below RTN's, and leaves every
group on at most 2^b values."""

import copy

import pytest
import torch

from minillm.compression.gptq import gptq_round_weight
from minillm.compression.simulated import (
    gptq_round,
    nbit_grid,
    nf4,
    nf4_bits_per_weight,
    nf4_levels,
    quantize_rows_int8,
    round_weights,
    rtn_nbit,
    smooth,
    smoothing_scales,
    w8a8,
)
from minillm.compression.structured import with_outlier_features
from minillm.core.model import random_model
from tests.conftest import tiny_config


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_rtn_nbit_keeps_each_group_within_half_a_step(bits):
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(bits))
    out = rtn_nbit(w, bits, 16)
    groups, approx = w.view(8, 4, 16), out.view(8, 4, 16)
    lo, hi = groups.amin(-1).clamp(max=0), groups.amax(-1).clamp(min=0)
    step = (hi - lo) / (2**bits - 1)
    # a zero point of whole codes shifts the range by up to half a step: one step at the very end
    assert ((approx - groups).abs() <= step[..., None] * (1 + 1e-5)).all()
    assert all(len(g.unique()) <= 2**bits for g in approx.flatten(0, 1))
    assert rtn_nbit(torch.zeros(2, 16), bits, 16).abs().max() == 0  # 0 stays exact
    with pytest.raises(ValueError, match="bits"):
        rtn_nbit(w, 1, 16)


def test_fewer_bits_round_coarser():
    w = torch.randn(16, 128, generator=torch.Generator().manual_seed(0))
    errors = [float((rtn_nbit(w, b, 32) - w).pow(2).mean()) for b in (2, 3, 4, 8)]
    assert errors == sorted(errors, reverse=True) and errors[-1] < errors[0] / 100


def test_nf4_levels_are_qloras():
    levels = nf4_levels()
    assert levels.shape == (16,) and bool((levels.diff() > 0).all())
    assert levels[0] == -1 and levels[-1] == 1 and 0.0 in levels.tolist()
    # QLoRA's published NormalFloat4 values (Dettmers et al., 2023), to four places
    for i, value in ((1, -0.6962), (2, -0.5251), (8, 0.0796), (14, 0.7230)):
        assert levels[i].item() == pytest.approx(value, abs=1e-4)
    assert nf4_bits_per_weight() == 4.5


def test_nf4_rounds_each_block_to_its_levels():
    w = torch.randn(4, 96, generator=torch.Generator().manual_seed(1))
    out = nf4(w, block=32)
    blocks, approx = w.flatten().view(-1, 32), out.flatten().view(-1, 32)
    absmax = blocks.abs().amax(1, keepdim=True)
    levels = nf4_levels()
    normalized = approx / absmax
    assert (normalized[..., None] - levels).abs().min(-1).values.max() < 1e-6  # on the levels
    largest_gap = levels.diff().max()
    assert ((approx - blocks).abs() <= absmax * largest_gap / 2 + 1e-6).all()
    assert (approx.abs().amax(1) == absmax[:, 0]).all()  # each block's largest weight is exact


def test_round_weights_unties_a_tied_head_and_keeps_the_lookup():
    model = random_model(tiny_config(tie_embeddings=True), seed=0)
    table = model.embed_tokens.weight.detach().clone()
    round_weights(model, lambda w: rtn_nbit(w, 2, 16))
    assert torch.equal(model.embed_tokens.weight, table)
    assert model.lm_head.weight is not model.embed_tokens.weight
    assert not torch.equal(model.lm_head.weight, table)


def test_w8a8_rounds_each_tokens_activations_within_half_a_step():
    x = torch.randn(3, 5, 32, generator=torch.Generator().manual_seed(2)) * torch.linspace(0.1, 10, 32)
    q = quantize_rows_int8(x)
    step = x.abs().amax(-1, keepdim=True) / 127
    assert ((q - x).abs() <= step / 2 + 1e-6).all()
    model = random_model(tiny_config(), seed=0)
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        exact = model(ids)
        simulated = w8a8(copy.deepcopy(model))(ids)
    assert 0 < (simulated - exact).abs().max() < 0.1 * exact.abs().max()


def test_smoothing_keeps_the_function_and_rescues_w8a8_from_outliers():
    model = random_model(tiny_config(n_kv_heads=4), seed=0)
    outliers = with_outlier_features(model, n_features=4, scale=50.0)
    calibration = torch.randint(0, 97, (4, 32), generator=torch.Generator().manual_seed(4))
    ids = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        reference = model(ids)
        smoothed = smooth(copy.deepcopy(outliers), calibration, alpha=0.5)
        assert torch.allclose(smoothed(ids), reference, atol=1e-4)  # the same function
        plain_error = (w8a8(copy.deepcopy(outliers))(ids) - reference).pow(2).mean()
        smooth_error = (w8a8(smoothed)(ids) - reference).pow(2).mean()
    assert smooth_error < plain_error / 2


def test_smoothing_scales_balance_activation_and_weight_ranges():
    w = torch.tensor([[1.0, 0.1], [-2.0, 0.2]])
    s = smoothing_scales(w, torch.tensor([4.0, 0.0]), alpha=0.5)
    assert s[0].item() == pytest.approx((4.0**0.5) / (2.0**0.5)) and s[1] == 1  # a dead channel keeps 1
    with pytest.raises(ValueError, match="alpha"):
        smoothing_scales(w, torch.ones(2), alpha=1.5)


# ---------------------------------------------------------------------------------------------
# GPTQ onto the b-bit grid


def correlated_inputs(k: int, rows: int = 512, seed: int = 0) -> torch.Tensor:
    """Inputs (rows, K) whose channels correlate: what GPTQ's and SparseGPT's updates exploit."""
    gen = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=gen) / k**0.5 + torch.eye(k)
    return torch.randn(rows, k, generator=gen) @ mix


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_gptq_with_an_identity_hessian_is_rtn_nbit(bits):
    w = torch.randn(6, 64, generator=torch.Generator().manual_seed(bits))
    codes, scales, zeros = gptq_round_weight(w, torch.eye(64), 16, damp=0.0, grid=nbit_grid(bits))
    gptq = ((codes.view(6, 4, 16) - zeros[..., None]) * scales[..., None]).flatten(1)
    torch.testing.assert_close(gptq, rtn_nbit(w, bits, 16))
    assert codes.max() <= 2**bits - 1 and codes.min() >= 0


@pytest.mark.parametrize("bits", [2, 3])
def test_gptq_nbit_cuts_the_layer_output_error_of_rtn(bits):
    x = correlated_inputs(64)
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(1))
    hessian = 2 / len(x) * x.T @ x
    codes, scales, zeros = gptq_round_weight(w, hessian, 16, grid=nbit_grid(bits))
    gptq = ((codes.view(16, 4, 16) - zeros[..., None]) * scales[..., None]).flatten(1)
    gptq_error = (x @ (gptq - w).T).pow(2).mean()
    rtn_error = (x @ (rtn_nbit(w, bits, 16) - w).T).pow(2).mean()
    assert gptq_error < 0.8 * rtn_error
    assert all(len(g.unique()) <= 2**bits for g in gptq.view(16, 4, 16).flatten(0, 1))


def test_gptq_round_rounds_every_linear_onto_its_grid_and_unties_the_head():
    model = random_model(tiny_config(), seed=0)
    table = model.embed_tokens.weight.detach().clone()
    calibration = torch.randint(0, 97, (4, 32), generator=torch.Generator().manual_seed(2))
    rounded = gptq_round(copy.deepcopy(model), 3, 16, calibration)
    for name, linear in rounded.named_modules():
        if isinstance(linear, torch.nn.Linear):
            groups = linear.weight.detach().view(linear.out_features, -1, 16).flatten(0, 1)
            assert all(len(g.unique()) <= 8 for g in groups), name
    assert torch.equal(rounded.embed_tokens.weight, table)  # the lookup keeps its table
    assert rounded.lm_head.weight is not rounded.embed_tokens.weight
    ids = calibration[:1]
    with torch.no_grad():
        assert (rounded(ids) - model(ids)).abs().max() > 0
    with pytest.raises(ValueError, match="bits"):
        gptq_round(copy.deepcopy(model), 1, 16, calibration)
    with pytest.raises(ValueError, match="unknown GPTQ option"):
        gptq_round(copy.deepcopy(model), 3, 16, calibration, blocks=4)
