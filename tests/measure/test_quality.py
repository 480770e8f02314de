"""Loss and perplexity of text fed through a cache: a full cache changes nothing, a window does."""

import math

import pytest
import torch

from minillm import KVCache
from minillm.kv.compressed import SlidingWindowCache
from minillm.measure.quality import mean_perplexity, streaming_loss
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
