"""Pruning: the masks are exact (per row, 2:4), Wanda's score is what the paper says and beats
magnitude where activations have outlier features, structured pruning equals zeroing the dropped
heads and neurons and shrinks the parameter count exactly, a short fine-tune recovers. SparseGPT
is magnitude pruning per block with an identity Hessian, and below Wanda's layer output error on
correlated inputs, at its exact pattern."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import minillm
from minillm.compression import quantize
from minillm.compression.prune import (
    _input_norms,
    is_two_four,
    layer_sparsity,
    prune,
    pruning_scores,
    semi_structured,
    sparsity_of,
    two_four_mask,
    unstructured_mask,
)
from minillm.compression.quant import linear_layers
from minillm.compression.sparsegpt import sparsegpt_prune_weight
from minillm.compression.structured import (
    prune_heads,
    prune_neurons,
    prune_structured,
    recover,
    with_outlier_features,
)
from minillm.training import corpus
from minillm.training.train import evaluate
from tests.conftest import tiny_model


def random_calibration(vocab_size: int = 97, n: int = 4, length: int = 16, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab_size, (n, length), generator=torch.Generator().manual_seed(seed))


def pruned_rows(model) -> dict:
    return {name: m.weight for name, m in linear_layers(model, ("lm_head",)).items()}


# ---------------------------------------------------------------------------------------------
# The masks


@pytest.mark.parametrize("method", ["magnitude", "wanda"])
@pytest.mark.parametrize("sparsity", [0.1, 0.3, 0.5, 0.7])
def test_unstructured_drops_exactly_round_sparsity_k_per_row(method, sparsity):
    model = tiny_model()
    embedding = model.embed_tokens.weight.clone()
    prune(model, method, sparsity, calibration=random_calibration())
    for name, w in pruned_rows(model).items():
        zeros = (w == 0).sum(dim=1)  # (N,)
        assert (zeros == round(sparsity * w.shape[1])).all(), name
    assert torch.equal(model.embed_tokens.weight, embedding)  # the tied LM head is skipped
    total = sum(w.numel() for w in pruned_rows(model).values())
    expected = sum(w.shape[0] * round(sparsity * w.shape[1]) for w in pruned_rows(model).values())
    assert sparsity_of(model) == pytest.approx(expected / total, abs=1e-12)
    assert set(layer_sparsity(model)) == set(pruned_rows(model))
    assert model.pruning["method"] == method and model.pruning["sparsity"] == sparsity


def test_magnitude_keeps_the_largest_of_each_row_and_wanda_the_largest_scores():
    model, calibration = tiny_model(), random_calibration()
    dense = {name: w.clone() for name, w in pruned_rows(model).items()}
    norms = _input_norms(model, calibration, linear_layers(model, ("lm_head",)))
    for method in ("magnitude", "wanda"):
        pruned = prune(copy.deepcopy(model), method, 0.5, calibration=calibration)
        for name, w in pruned_rows(pruned).items():
            score = dense[name].abs() * (norms[name] if method == "wanda" else 1)  # (N, K)
            kept = w != 0
            lowest_kept = score.masked_fill(~kept, math.inf).amin(dim=1)
            highest_dropped = score.masked_fill(kept, -math.inf).amax(dim=1)
            assert (lowest_kept >= highest_dropped).all(), (method, name)


@pytest.mark.parametrize("method", ["magnitude", "wanda"])
def test_two_four_keeps_exactly_the_two_best_of_every_four(method):
    model = tiny_model()
    dense = {name: w.clone() for name, w in pruned_rows(model).items()}
    prune(model, method, None, "2:4", calibration=random_calibration())
    for name, w in pruned_rows(model).items():
        groups = w.view(w.shape[0], -1, 4)
        assert ((groups != 0).sum(-1) == 2).all(), name  # the dense weights have no zeros
        assert is_two_four(w)
        if method == "magnitude":
            magnitude = dense[name].abs().view_as(groups)
            kept = groups != 0
            lowest_kept = magnitude.masked_fill(~kept, math.inf).amin(-1)
            assert (lowest_kept >= magnitude.masked_fill(kept, -math.inf).amax(-1)).all()
    assert sparsity_of(model) == 0.5 and model.pruning["pattern"] == "2:4"


def test_pruning_keeps_the_rest_of_the_weights():
    model = tiny_model()
    dense = {name: w.clone() for name, w in pruned_rows(model).items()}
    prune(model, "magnitude", 0.3)
    for name, w in pruned_rows(model).items():
        assert torch.equal(w[w != 0], dense[name][w != 0])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(method="random"), "method"),
        (dict(pattern="1:2"), "pattern"),
        (dict(sparsity=1.0), "sparsity"),
        (dict(sparsity=-0.1), "sparsity"),
        (dict(sparsity="0.5"), "sparsity"),
        (dict(sparsity=True), "sparsity"),
        (dict(sparsity=None), "sparsity"),
        (dict(pattern="2:4", sparsity=0.3), "sparsity"),
        (dict(method="wanda"), "calibration"),
        (dict(method="wanda", calibration=torch.rand(2, 8)), "calibration"),
        (dict(method="wanda", calibration=torch.zeros(8, dtype=torch.long)), "calibration"),
        (dict(skip=("proj", "lm_head")), "no linear layers"),
    ],
)
def test_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        prune(tiny_model(), **kwargs)


def test_two_four_needs_in_features_divisible_by_four():
    with pytest.raises(ValueError, match=r"layers\.0\.mlp\.down_proj has 66"):
        prune(tiny_model(ffn_dim=66), pattern="2:4")


def test_a_quantized_model_is_refused():
    model = quantize(tiny_model(), "int8")
    for call in (lambda: prune(model), lambda: prune_heads(model, 0.5), lambda: prune_neurons(model)):
        with pytest.raises(ValueError, match="quantized.*first, then quantize"):
            call()


def test_semi_structured_needs_a_cuda_gpu():
    model = prune(tiny_model(), pattern="2:4")
    if torch.cuda.is_available():
        pytest.skip("the CPU refusal is tested where there is no GPU")
    with pytest.raises(RuntimeError, match="CUDA GPU.*no 2:4 sparse matmul kernel for the CPU"):
        semi_structured(model)


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0), reason="needs an Ampere or newer GPU"
)
def test_semi_structured_matches_the_masked_dense_model_on_a_gpu():
    model = tiny_model(dim=64, n_heads=4, n_kv_heads=4, ffn_dim=128).cuda().half()
    prune(model, pattern="2:4")
    ids = random_calibration(n=2, length=32).cuda()
    with torch.no_grad():
        dense = model(ids).float()
        semi_structured(model)
        sparse = model(ids).float()
    assert len(model.pruning["semi_structured"]) == 4 * model.config.n_layers
    torch.testing.assert_close(sparse, dense, atol=2e-2, rtol=2e-2)  # fp16 accumulation order


# ---------------------------------------------------------------------------------------------
# Wanda and magnitude on the bundled target


@pytest.fixture(scope="module")
def target():
    """The bundled target, calibration windows (16, 128) from every 10th training document,
    4096 + 1 validation tokens and that slice of the training split for the fine-tune."""
    model, tokenizer = minillm.load("minillm-target", device="cpu")
    train = torch.tensor([t for doc in corpus.documents("train")[::10] for t in tokenizer.encode(doc)])
    valid: list[int] = []
    for doc in corpus.documents("valid"):
        valid.extend(tokenizer.encode(doc))
        if len(valid) > 4096:
            break
    starts = torch.randint(0, len(train) - 129, (16,), generator=torch.Generator().manual_seed(0))
    calibration = torch.stack([train[s : s + 128] for s in starts.tolist()])
    return model, calibration, train, torch.tensor(valid[:4097])


def perplexity(model, valid) -> float:
    return math.exp(evaluate(model, valid, 256))


def test_wanda_ties_magnitude_on_the_target_and_beats_it_with_outlier_features(target):
    model, calibration, _, valid = target
    dense = perplexity(model, valid)
    magnitude = perplexity(prune(copy.deepcopy(model), "magnitude", 0.5), valid)
    wanda = perplexity(prune(copy.deepcopy(model), "wanda", 0.5, calibration=calibration), valid)
    # Observed 44.75 dense, 47.98 magnitude, 47.70 Wanda: at 50% both cost under 10%, and the two
    # tie (within 2%): this small model has no outlier features for Wanda to find.
    assert max(magnitude, wanda) < 1.10 * dense
    assert wanda < 1.02 * magnitude

    outliers = with_outlier_features(model)
    torch.testing.assert_close(outliers(valid[None, :256]), model(valid[None, :256]), atol=1e-4, rtol=1e-4)
    magnitude_out = perplexity(prune(copy.deepcopy(outliers), "magnitude", 0.5), valid)
    wanda_out = perplexity(prune(copy.deepcopy(outliers), "wanda", 0.5, calibration=calibration), valid)
    # Observed 52.68 magnitude (it drops the small weights on the large features), 47.70 Wanda:
    # |W_ij| * ||X_j|| does not change when a feature grows and its weights shrink alike.
    assert wanda_out < 0.95 * magnitude_out
    assert wanda_out == pytest.approx(wanda, rel=1e-3)


# ---------------------------------------------------------------------------------------------
# Structured pruning


def zeroed_heads(model, dropped: dict[int, list[int]]):
    """A copy of the model whose dropped key/value groups' query heads write nothing (their
    o_proj columns zero)."""
    model = copy.deepcopy(model)
    hd, rep = model.config.head_dim, model.config.n_rep
    with torch.no_grad():
        for i, groups in dropped.items():
            for g in groups:
                model.layers[i].self_attn.o_proj.weight[:, g * rep * hd : (g + 1) * rep * hd] = 0
    return model


def zeroed_neurons(model, dropped: dict[int, list[int]]):
    model = copy.deepcopy(model)
    with torch.no_grad():
        for i, neurons in dropped.items():
            model.layers[i].mlp.down_proj.weight[:, neurons] = 0
    return model


@pytest.mark.parametrize(
    ("n_kv_heads", "fraction", "calibrated"), [(4, 0.25, False), (4, 0.5, True), (2, 0.5, False), (2, 0.5, True)]
)
def test_prune_heads_equals_zeroing_them(n_kv_heads, fraction, calibrated):
    model = tiny_model(n_heads=4, n_kv_heads=n_kv_heads)
    ids = random_calibration(n=2, length=24, seed=1)
    pruned = prune_heads(copy.deepcopy(model), fraction, random_calibration() if calibrated else None)
    dropped = pruned.pruning["dropped_kv_groups"]
    n_drop = round(fraction * n_kv_heads)
    assert all(len(groups) == n_drop for groups in dropped.values())
    assert pruned.config.n_kv_heads == n_kv_heads - n_drop
    assert pruned.config.n_heads == 4 - n_drop * 4 // n_kv_heads
    assert pruned.config.head_dim == model.config.head_dim
    for layer in pruned.layers:
        attn = layer.self_attn
        assert (attn.n_heads, attn.n_kv_heads) == (pruned.config.n_heads, pruned.config.n_kv_heads)
        assert attn.qkv_proj.weight.shape == (attn.q_size + 2 * attn.kv_size, model.config.dim)
    with torch.no_grad():
        torch.testing.assert_close(pruned(ids), zeroed_heads(model, dropped)(ids), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("calibrated", [False, True])
def test_prune_neurons_equals_zeroing_them(calibrated):
    model = tiny_model()
    ids = random_calibration(n=2, length=24, seed=1)
    pruned = prune_neurons(copy.deepcopy(model), 0.25, random_calibration() if calibrated else None)
    dropped = pruned.pruning["dropped_neurons"]
    assert all(len(neurons) == 16 for neurons in dropped.values())
    assert pruned.config.ffn_dim == 48
    for layer in pruned.layers:
        assert layer.mlp.gate_up_proj.weight.shape == (96, 32)
        assert layer.mlp.down_proj.weight.shape == (32, 48)
    with torch.no_grad():
        torch.testing.assert_close(pruned(ids), zeroed_neurons(model, dropped)(ids), atol=1e-5, rtol=1e-5)


def test_prune_structured_shrinks_the_parameter_count_exactly_and_generates_with_a_cache():
    model = tiny_model(n_heads=4, n_kv_heads=4, ffn_dim=64)  # MHA, like the bundled target
    before = model.num_params()
    prune_structured(model, heads=0.25, neurons=0.25, calibration=random_calibration())
    d, hd, layers = model.config.dim, model.config.head_dim, model.config.n_layers
    per_head = 4 * hd * d  # q, k, v rows and o_proj columns
    per_neuron = 3 * d  # gate and up rows, the down_proj column
    assert (model.config.n_heads, model.config.n_kv_heads, model.config.ffn_dim) == (3, 3, 48)
    assert model.num_params() == before - layers * (1 * per_head + 16 * per_neuron)
    assert model.num_params() == model.config.num_params()
    prompt = random_calibration(n=1, length=8, seed=2)[0]
    cached = minillm.generate(model, prompt, max_new_tokens=12, eos_token_id=None)
    recomputed = minillm.generate(model, prompt, max_new_tokens=12, eos_token_id=None, use_cache=False)
    assert torch.equal(cached.tokens, recomputed.tokens) and cached.tokens.shape == (1, 12)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda m: prune_heads(m, 1.0), "fraction"),
        (lambda m: prune_heads(m, -0.25), "fraction"),
        (lambda m: prune_neurons(m, "half"), "fraction"),
        (lambda m: prune_structured(m, heads=1.5), "heads"),
        (lambda m: prune_structured(m, neurons=True), "neurons"),
        (lambda m: prune_heads(m, 0.9), "leave none"),
    ],
)
def test_structured_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call(tiny_model())


def test_multi_query_attention_has_no_head_to_drop():
    with pytest.raises(ValueError, match="multi-query"):
        prune_heads(tiny_model(n_kv_heads=1), 0.5)


# ---------------------------------------------------------------------------------------------
# Recovery


def test_recover_lowers_the_validation_loss_of_a_pruned_target(target):
    model, _, train, valid = target
    pruned = prune_structured(copy.deepcopy(model), heads=0.5, neurons=0.5)
    before = evaluate(pruned, valid[:2049], 256)
    log = recover(pruned, train, steps=12, lr=1e-3, batch_size=4, seq_len=64)
    after = evaluate(pruned, valid[:2049], 256)
    assert len(log["train_loss"]) == 12
    # Observed 3.88 nats dense, 5.31 pruned, 4.81 after 12 steps of 256 tokens (4.75 with seed 1).
    assert after < before - 0.2


def test_recover_keeps_the_zeros_of_prune():
    model = prune(tiny_model(), "magnitude", 0.5)
    mask = {name: w != 0 for name, w in pruned_rows(model).items()}
    dense_part = {name: w.clone() for name, w in pruned_rows(model).items()}
    recover(model, torch.randint(0, 97, (400,)), steps=3, lr=1e-2, batch_size=2, seq_len=16)
    for name, w in pruned_rows(model).items():
        assert torch.equal(w != 0, mask[name]), name
    assert any(not torch.equal(w, dense_part[name]) for name, w in pruned_rows(model).items())


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [(dict(steps=0), "steps"), (dict(lr=0.0), "lr"), (dict(lr="1"), "lr"), (dict(epochs=2), "epochs")],
)
def test_recover_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        recover(tiny_model(), torch.randint(0, 97, (400,)), **kwargs)


# ---------------------------------------------------------------------------------------------
# SparseGPT


def correlated_inputs(k: int, rows: int = 512, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=gen) / k**0.5 + torch.eye(k)
    return torch.randn(rows, k, generator=gen) @ mix


def test_sparsegpt_with_an_identity_hessian_is_magnitude_pruning_per_block():
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(0))
    pruned = sparsegpt_prune_weight(w, torch.eye(64), 0.5, block_size=32, damp=0.0)
    for block in range(2):  # no update: the kept weights unchanged, the block's lowest half dropped
        cols = slice(32 * block, 32 * (block + 1))
        kept, dense = pruned[:, cols] != 0, w[:, cols].abs()
        assert kept.sum() == 128
        assert dense[kept].min() >= dense[~kept].max()
        assert torch.equal(pruned[:, cols][kept], w[:, cols][kept])


@pytest.mark.parametrize("pattern", ["unstructured", "2:4"])
def test_sparsegpt_cuts_the_layer_output_error_of_magnitude_and_wanda(pattern):
    x = correlated_inputs(64)
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(1))
    pruned = sparsegpt_prune_weight(w, 2 / len(x) * x.T @ x, 0.5, pattern, block_size=32)
    norm = x.pow(2).sum(0).sqrt()
    score = pruning_scores(w, norm)
    wanda = w * (two_four_mask(score) if pattern == "2:4" else unstructured_mask(score, 0.5))
    error = {name: (x @ (v - w).T).pow(2).mean() for name, v in (("sparsegpt", pruned), ("wanda", wanda))}
    assert error["sparsegpt"] < 0.8 * error["wanda"]
    if pattern == "2:4":
        assert is_two_four(pruned)
    else:
        assert (pruned == 0).sum() == w.numel() // 2


def test_sparsegpt_prunes_a_model_to_its_pattern_and_records_it():
    model, calibration = tiny_model(), random_calibration()
    unstructured = prune(copy.deepcopy(model), "sparsegpt", 0.5, calibration=calibration, block_size=32)
    assert sparsity_of(unstructured) == pytest.approx(0.5, abs=1e-3)
    assert unstructured.pruning["method"] == "sparsegpt"
    two_four = prune(copy.deepcopy(model), "sparsegpt", None, "2:4", calibration=calibration)
    assert all(is_two_four(w) for w in pruned_rows(two_four).values())
    assert torch.equal(two_four.embed_tokens.weight, model.embed_tokens.weight)  # the head skipped
    # the kept weights moved: the update made up for the dropped ones
    dense = pruned_rows(model)
    assert any(not torch.equal(w[w != 0], dense[n][w != 0]) for n, w in pruned_rows(two_four).items())
    with pytest.raises(ValueError, match="calibration"):
        prune(copy.deepcopy(model), "sparsegpt", 0.5)
    with pytest.raises(ValueError, match="unknown GPTQ option"):
        prune(copy.deepcopy(model), "sparsegpt", 0.5, calibration=calibration, blocks=4)
    with pytest.raises(ValueError, match="SparseGPT's"):
        prune(copy.deepcopy(model), "magnitude", 0.5, block_size=32)
