"""Loss and perplexity of text fed through a cache: a full cache changes nothing, a window does."""

import math

import pytest
import torch

from minillm import KVCache
from minillm.kv.compressed import SlidingWindowCache
from minillm.measure.quality import (
    continuation_agreement,
    layer_output_errors,
    logit_difference,
    mean_perplexity,
    perplexity,
    streaming_loss,
)
from tests.conftest import tiny_model


def test_streaming_loss_through_a_full_cache_equals_one_forward_and_a_window_raises_it():
    model = tiny_model(seed=3)
    text = torch.randint(0, 97, (80,))
    whole = streaming_loss(model, text)
    assert streaming_loss(model, text, KVCache.for_model(model, 1, 80), chunk=7) == pytest.approx(whole, rel=1e-5)
    assert streaming_loss(model, text, SlidingWindowCache.for_model(model, 1, 4), chunk=7) != pytest.approx(whole)


def test_mean_perplexity_is_the_exp_of_the_mean_loss_with_a_fresh_cache_per_segment():
    model = tiny_model(seed=4)
    segments = [torch.randint(0, 97, (30,), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    losses = [streaming_loss(model, seg) for seg in segments]
    assert mean_perplexity(model, segments) == pytest.approx(math.exp(sum(losses) / 2))
    made = []

    def make_cache(m):
        made.append(KVCache.for_model(m, 1, 30))
        return made[-1]

    assert mean_perplexity(model, segments, make_cache, chunk=5) == pytest.approx(math.exp(sum(losses) / 2), rel=1e-5)
    assert len(made) == 2 and all(c.length == 29 for c in made)


def test_perplexity_is_the_exp_of_the_mean_window_loss():
    model = tiny_model(seed=5)
    ids = torch.randint(0, 97, (3 * 16 + 1,), generator=torch.Generator().manual_seed(0))
    windows = ids.unfold(0, 17, 16)  # the three windows of 16 inputs and their next tokens
    logits = model(windows[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten())
    assert perplexity(model, ids, seq_len=16, batch_size=2) == pytest.approx(math.exp(loss.item()), rel=1e-5)
    with pytest.raises(ValueError, match="do not fill one window"):
        perplexity(model, ids[:10], seq_len=16)


def test_a_model_agrees_with_itself_and_differs_from_another():
    model, other = tiny_model(seed=6), tiny_model(seed=7)
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(1))
    same = logit_difference(model, model, ids)
    assert same["max_abs"] == 0 and same["argmax_agreement"] == 1
    diff = logit_difference(other, model, ids)
    assert diff["max_abs"] > 0 and diff["mean_abs"] <= diff["max_abs"]
    prompts = [[1, 2, 3], [4, 5]]
    assert continuation_agreement(model, model, prompts, new_tokens=6) == 1.0
    assert continuation_agreement(other, model, prompts, new_tokens=6) < 1.0
    with pytest.raises(ValueError, match="new_tokens"):
        continuation_agreement(model, model, prompts, new_tokens=0)


def test_layer_output_errors_are_zero_for_the_same_model_and_grow_downstream_of_a_change():
    model = tiny_model(seed=8)
    changed = tiny_model(seed=8)
    with torch.no_grad():
        changed.layers[1].mlp.down_proj.weight.mul_(1.1)
    ids = torch.randint(0, 97, (2, 10), generator=torch.Generator().manual_seed(2))
    names = ["layers.0.mlp.down_proj", "layers.1.mlp.down_proj", "lm_head"]
    assert layer_output_errors(model, model, ids, names) == {n: 0.0 for n in names}
    errors = layer_output_errors(changed, model, ids, names)
    assert errors["layers.0.mlp.down_proj"] == 0.0  # upstream of the change
    assert errors["layers.1.mlp.down_proj"] == pytest.approx(0.1, rel=1e-4)  # the change itself
    assert errors["lm_head"] > 0
