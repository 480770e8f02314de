"""GPTQ and AWQ against round-to-nearest: the same int4 format, less error where it is measured on
activations the calibration did not see, and the algorithm's sanity checks (H = I is RTN; every
fold of AWQ's scales is exact before rounding). The bundled target is calibrated on 16 windows of
128 training tokens and measured on the validation split."""

import copy
import math

import pytest
import torch

import minillm
from minillm.compression import QuantizedLinear, quantize
from minillm.compression.awq import AWQOptions, fold_scale, kv_groups, rtn_int4, search_clip, search_scale
from minillm.compression.calibration import (
    HessianAccumulator,
    calibration_batches,
    encoded_split,
    input_statistics,
    layer_inputs,
)
from minillm.compression.gptq import GPTQOptions, gptq_quantize_weight
from minillm.compression.quant import dequantize_int4, linear_layers, quantize_int4
from minillm.training.corpus import load_text
from minillm.training.train import evaluate
from tests.conftest import tiny_model

LAYERS = ["layers.0.self_attn.qkv_proj", "layers.2.self_attn.o_proj", "layers.3.mlp.gate_up_proj"]
LAYERS += ["layers.5.mlp.down_proj", "lm_head"]
VALID_TOKENS = 16 * 256


@pytest.fixture(scope="module")
def target():
    return minillm.load("minillm-target", device="cpu")


@pytest.fixture(scope="module")
def calibration(target):
    return calibration_batches(target[1], n=16, seq_len=128)


@pytest.fixture(scope="module")
def activations(target, calibration):
    """The statistics of the calibration inputs and the held-out inputs (other windows, the
    validation split) of LAYERS, both from the full-precision target."""
    model, tok = target
    held_out = calibration_batches(tok, n=8, seq_len=128, split="valid", seed=1)
    return input_statistics(model, LAYERS, calibration), layer_inputs(model, LAYERS, held_out)


def output_error(x, weight, approx):
    return ((x @ (weight - approx).T) ** 2).sum().item()


# ---------------------------------------------------------------------------------------------
# GPTQ, one weight


def test_gptq_with_an_identity_hessian_is_round_to_nearest_exactly():
    gen = torch.Generator().manual_seed(0)
    for k in (64, 40):  # 40: a last group of 8 real weights and 24 of padding
        w = torch.randn(24, k, generator=gen)
        got, expected = gptq_quantize_weight(w, torch.eye(k), 32), quantize_int4(w, 32)
        for a, b in zip(got, expected):
            assert a.dtype == b.dtype and torch.equal(a, b)


def correlated_inputs(rows: int, k: int, seed: int) -> torch.Tensor:
    """Inputs (rows, k) that live near a 16-dimensional subspace: strongly correlated channels."""
    gen = torch.Generator().manual_seed(seed)
    mixing = torch.randn(16, k, generator=torch.Generator().manual_seed(99))  # the same subspace for every seed
    return torch.randn(rows, 16, generator=gen) @ mixing + 0.1 * torch.randn(rows, k, generator=gen)


@pytest.mark.parametrize("k", [128, 40])
def test_gptq_beats_rtn_on_held_out_correlated_inputs_also_when_k_is_not_a_multiple_of_the_group(k):
    w = torch.randn(64, k, generator=torch.Generator().manual_seed(1))
    stats = HessianAccumulator(k)
    stats.add(correlated_inputs(2048, k, seed=2))
    codes, scales, zeros = gptq_quantize_weight(w, stats.hessian, 32)
    assert codes.shape == (64, 64 if k == 40 else 128) and scales.shape == zeros.shape == (64, 2 if k == 40 else 4)
    if k == 40:  # the padding rounds to exactly 0: its codes are the group's zero point
        assert torch.equal(codes[:, 40:], zeros[:, 1:].expand(64, 24))
    held_out = correlated_inputs(1024, k, seed=3)
    ratio = output_error(held_out, w, dequantize_int4(codes, scales, zeros, k)) / output_error(
        held_out, w, rtn_int4(w, 32)
    )
    assert ratio < 0.5  # observed 0.07 (K=128), 0.15 (K=40): the error goes where the inputs never do


def test_gptq_beats_rtn_on_held_out_activations_layer_by_layer_on_the_bundled_target(target, activations):
    model, _ = target
    stats, held_out = activations
    for group in (32, 128):
        for name in LAYERS:
            w = model.get_submodule(name).weight.detach()
            q = dequantize_int4(*gptq_quantize_weight(w, stats[name].hessian, group), w.shape[1])
            x = held_out[name]
            ratio = output_error(x, w, q) / output_error(x, w, rtn_int4(w, group))
            assert ratio < 1.0, (name, group, ratio)  # observed 0.21-0.87 (down_proj the least gain)


# ---------------------------------------------------------------------------------------------
# AWQ, one weight


def awq_approx(w, stats, group, kv=None):
    """What AWQ's layer computes, as a weight on the unscaled input: Q(clip(W * s)) / s."""
    s, _ = search_scale(w, stats, group, 20, kv)
    scaled_hessian = stats.hessian / (s[:, None] * s[None, :])
    return rtn_int4(search_clip(w.float() * s, scaled_hessian, group), group) / s


def test_awq_beats_rtn_on_held_out_inputs_with_outlier_channels():
    k = 128
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(64, k, generator=gen)
    channel = torch.ones(k)
    channel[::16] = 20.0  # a few channels carry much larger activations, as in LLMs
    stats = HessianAccumulator(k)
    stats.add(torch.randn(2048, k, generator=gen) * channel)
    held_out = torch.randn(1024, k, generator=gen) * channel
    s, _ = search_scale(w, stats, 32)
    assert s[::16].min() > 2 * s.min()  # the outlier channels are the ones scaled up (observed 2.8x)
    rtn_error = output_error(held_out, w, rtn_int4(w, 32))
    scaled_only = output_error(held_out, w, rtn_int4(w * s, 32) / s) / rtn_error
    scaled_and_clipped = output_error(held_out, w, awq_approx(w, stats, 32)) / rtn_error
    assert scaled_only < 0.5 and scaled_and_clipped <= scaled_only  # observed 0.29 and 0.25


def test_awq_beats_rtn_on_held_out_activations_layer_by_layer_on_the_bundled_target(target, activations):
    model, _ = target
    stats, held_out = activations
    for group in (32, 128):
        for name in LAYERS:
            w = model.get_submodule(name).weight.detach()
            q = awq_approx(w, stats[name], group, kv_groups(model, name))
            x = held_out[name]
            ratio = output_error(x, w, q) / output_error(x, w, rtn_int4(w, group))
            assert ratio < 1.0, (name, group, ratio)  # observed 0.76-0.93 (the clip search gives the most)


@pytest.mark.parametrize("overrides", [{}, {"n_kv_heads": 4}, {"qkv_bias": True, "mlp_bias": True}])
def test_every_fold_of_awq_scales_leaves_the_logits_unchanged_before_rounding(overrides):
    model = tiny_model(**overrides)  # GQA (4 query heads, 2 kv heads) unless overridden; a tied head
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1, generator=gen)
    ids = torch.randint(0, 97, (2, 24), generator=gen)
    expected = model(ids)
    embedding = model.embed_tokens.weight.detach().clone()
    for name, linear in linear_layers(model).items():
        s = torch.exp(torch.randn(linear.in_features, generator=gen))  # scales from 1/e^3 to e^3
        groups = kv_groups(model, name)
        if groups is not None:  # one scale per (kv head, dim), repeated over its query heads
            s = s.view(groups)[:, :1].expand(groups).flatten()
        fold_scale(model, name, s)
    assert (model(ids) - expected).abs().max().item() < 1e-5
    assert torch.equal(model.embed_tokens.weight, embedding)  # the tied head was untied, not rescaled


def test_an_o_proj_scale_that_differs_within_a_kv_group_cannot_be_folded():
    model = tiny_model()  # 2 query heads per kv head
    s = torch.linspace(0.5, 2.0, model.config.n_heads * model.config.head_dim)
    with pytest.raises(ValueError, match="equal across the query heads"):
        fold_scale(model, "layers.0.self_attn.o_proj", s)


# ---------------------------------------------------------------------------------------------
# The model


def test_gptq_and_awq_int4_g128_perplexity_is_not_worse_than_rtn_on_the_validation_split(
    target, calibration, activations
):
    model, tok = target
    valid = encoded_split(tok, "valid")[: VALID_TOKENS + 1]
    embedding = model.embed_tokens.weight.detach().clone()
    ppl, weights = {"fp32": math.exp(evaluate(model, valid, 256))}, {}
    for method in ("rtn", "gptq", "awq"):
        quantized = quantize(copy.deepcopy(model), "int4", 128, method=method, calibration=calibration)
        assert all(isinstance(m, QuantizedLinear) for m in (quantized.lm_head, quantized.layers[5].mlp.down_proj))
        assert torch.equal(quantized.embed_tokens.weight, embedding)
        ppl[method] = math.exp(evaluate(quantized, valid, 256))
        weights[method] = {name: quantized.get_submodule(name).dequantized_weight() for name in LAYERS}
    _, held_out = activations
    for name in LAYERS:  # layer by layer (calibrated on quantized predecessors), on full-precision inputs
        w = model.get_submodule(name).weight.detach()
        errors = {m: output_error(held_out[name], w, weights[m][name]) for m in ("rtn", "gptq")}
        assert errors["gptq"] < errors["rtn"], name  # observed ratios 0.19-0.75
    print({k: round(v, 3) for k, v in ppl.items()}, f"on {VALID_TOKENS} validation tokens")
    # observed fp32 44.75, rtn 45.59, gptq 44.90, awq 45.18: no tolerance, "not worse" is the claim
    assert ppl["gptq"] <= ppl["rtn"] and ppl["awq"] <= ppl["rtn"]
    assert max(ppl.values()) < 1.1 * ppl["fp32"]


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_calibrated_methods_quantize_a_gqa_model_whose_widths_are_not_multiples_of_the_group(method):
    model = tiny_model(ffn_dim=48)  # down_proj reads 48 channels: groups of 32 and 16 (padded)
    ids = torch.randint(0, 97, (4, 32), generator=torch.Generator().manual_seed(6))
    expected = model(ids)
    quantize(model, "int4", 32, method=method, calibration=ids, batch_size=3)
    layers = linear_layers(model)
    assert not layers  # every nn.Linear was replaced
    assert model.layers[1].mlp.down_proj.scales.shape == (32, 2)
    got = model(ids)
    assert got.isfinite().all() and (got - expected).abs().max().item() < 0.5 * expected.abs().max().item()


# ---------------------------------------------------------------------------------------------
# Bad input


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_calibrated_methods_need_calibration_data_a_window_the_model_can_read_and_known_options(method):
    model = tiny_model()
    with pytest.raises(ValueError, match="needs calibration data"):
        quantize(tiny_model(), "int4", 32, method=method)
    with pytest.raises(ValueError, match="max_seq_len"):
        quantize(model, "int4", 32, method=method, calibration=torch.zeros(1, 129, dtype=torch.long))
    with pytest.raises(ValueError, match="token ids"):
        quantize(model, "int4", 32, method=method, calibration=torch.zeros(2, 8))
    with pytest.raises(ValueError, match=r"\[0, 97\)"):
        quantize(model, "int4", 32, method=method, calibration=torch.full((2, 8), 97))
    with pytest.raises(ValueError, match="unknown"):
        quantize(model, "int4", 32, method=method, calibration=torch.zeros(2, 8, dtype=torch.long), bogus=1)
    assert isinstance(model.lm_head, torch.nn.Linear) and not isinstance(model.lm_head, QuantizedLinear)


def test_bad_options_and_calibration_sizes_are_refused(target):
    _, tok = target
    with pytest.raises(ValueError, match=r"^n \("):
        calibration_batches(tok, n=0)
    with pytest.raises(ValueError, match="seq_len"):
        calibration_batches(tok, seq_len=0)
    with pytest.raises(ValueError, match="longer than"):
        calibration_batches(tok, seq_len=10**8, split="valid")
    with pytest.raises(ValueError, match="damp"):
        GPTQOptions(damp=-0.1)
    with pytest.raises(ValueError, match="block_size"):
        GPTQOptions(block_size=0)
    with pytest.raises(ValueError, match="max_shrink"):
        AWQOptions(max_shrink=1.0)
    with pytest.raises(ValueError, match="Hessian must be"):
        gptq_quantize_weight(torch.randn(4, 8), torch.eye(6), 8)


def test_calibration_windows_are_seeded_windows_of_the_split(target):
    _, tok = target
    text = load_text("valid")
    a, b = calibration_batches(tok, 4, 64, "valid", seed=3), calibration_batches(tok, 4, 64, "valid", seed=3)
    assert a.shape == (4, 64) and a.dtype == torch.long and torch.equal(a, b)
    assert not torch.equal(a, calibration_batches(tok, 4, 64, "valid", seed=4))
    for row in a:  # each window is a run of the split's own text
        assert tok.decode(row.tolist()) in text
