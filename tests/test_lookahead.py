"""Lookahead decoding: greedy parity with ``generate``, the attention layout of one forward, the
n-gram pool, and that a model whose Jacobi iterations converge gets many tokens per forward."""

import pytest
import torch

from minillm import generate
from minillm.lookahead import LookaheadConfig, NGramPool, lookahead_generate, lookahead_layout
from tests.conftest import tiny_config, tiny_model
from tests.test_speculative import MarkovModel, random_prompt

VOCAB = tiny_config().vocab_size


def greedy(model, prompt, n, **kw) -> list[int]:
    return generate(model, prompt, n, **kw).tokens[0].tolist()


@pytest.mark.parametrize("window, ngram, candidates", [(5, 4, 5), (1, 2, 1), (3, 3, 8), (6, 5, 2)])
def test_greedy_equals_generate(window, ngram, candidates):
    model = tiny_model(seed=0)
    for seed in range(6):
        prompt = random_prompt(1 + 4 * seed, 200 + seed)
        result = lookahead_generate(model, prompt, 30, window, ngram, candidates, eos_token_id=None)
        assert result.tokens[0].tolist() == greedy(model, prompt, 30, eos_token_id=None), seed


def test_stops_at_eos_like_generate():
    prompt = random_prompt(6, 9)
    eos = greedy(tiny_model(), prompt, 30, eos_token_id=None)[10]
    model = tiny_model(eos_token_id=eos)
    expected = greedy(model, prompt, 30)
    assert expected[-1] == eos and len(expected) <= 11
    assert lookahead_generate(model, prompt, 30).tokens[0].tolist() == expected


def test_converging_model_accepts_whole_ngrams():
    """A model that cycles through the vocabulary: Jacobi iterations find the cycle, its n-grams
    enter the pool, and then every forward accepts N-1 tokens plus its own."""
    V = 7
    cycle = torch.eye(V).roll(1, dims=1) * 5
    model = MarkovModel(cycle.expand(128, V, V) + torch.randn(128, V, V, generator=torch.Generator().manual_seed(0)))
    result = lookahead_generate(model, [0, 1, 2], 60, window=4, ngram=4, max_candidates=3, eos_token_id=None)
    assert result.tokens[0].tolist() == [(3 + i) % V for i in range(60)]
    assert result.stats.tokens_per_target_forward > 3.0  # up to 4 = N-1 + 1
    assert result.stats.acceptance_rates[-1] > 0.8


def test_layout_of_a_small_window():
    """W=2, N=3 (two levels), one candidate: positions and mask written out by hand."""
    offsets, mask = lookahead_layout(window=2, levels=2, n_candidates=1)
    # tokens: root, L0c0, L0c1, L1c0, L1c1, cand0, cand1
    assert offsets.tolist() == [0, 1, 2, 2, 3, 1, 2]
    expected = [
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0],
        [1, 1, 0, 1, 0, 0, 0],  # L1c0: root, L0c0, itself
        [1, 1, 1, 0, 1, 0, 0],  # L1c1: root, L0c0, L0c1, itself
        [1, 0, 0, 0, 0, 1, 0],
        [1, 0, 0, 0, 0, 1, 1],
    ]
    assert mask.int().tolist() == expected


@pytest.mark.parametrize("window, levels, candidates", [(5, 3, 5), (4, 4, 2), (1, 1, 3)])
def test_every_token_sees_one_chain_of_consecutive_positions(window, levels, candidates):
    """Each token sees exactly one token at each position from the root's to its own: a sequence."""
    offsets, mask = lookahead_layout(window, levels, candidates)
    for t in range(len(offsets)):
        seen = sorted(offsets[mask[t]].tolist())
        assert seen == list(range(int(offsets[t]) + 1)), t


def test_pool_keeps_the_most_recent_continuations():
    pool = NGramPool(capacity=2)
    for ngram in [(1, 2, 3), (1, 4, 5), (2, 9, 9), (1, 2, 3), (1, 6, 7)]:
        pool.add(ngram)
    assert pool.candidates(1) == [(6, 7), (2, 3)]  # (4, 5) was the oldest: dropped
    assert pool.candidates(2) == [(9, 9)] and pool.candidates(3) == []
    assert len(pool) == 3


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(window=0), "window"),
        (dict(ngram=1), "ngram"),
        (dict(max_candidates=0), "max_candidates"),
        (dict(input_ids=[[1, 2], [3, 4]]), "batch size 1"),
        (dict(max_new_tokens=100), "max_seq_len"),
    ],
)
def test_bad_input_raises(kwargs, match):
    args = dict(input_ids=[1, 2, 3], max_new_tokens=10) | kwargs
    with pytest.raises(ValueError, match=match):
        lookahead_generate(tiny_model(), **args)


def test_config_counts_tokens_per_forward():
    assert LookaheadConfig(5, 4, 5).tokens_per_forward() == 1 + 3 * 5 + 5 * 3
