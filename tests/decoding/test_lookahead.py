"""Lookahead decoding: greedy parity with ``generate``, the attention layout of one forward, the
n-gram pool, and that a model whose Jacobi iterations converge gets many tokens per forward."""

import pytest
import torch

from minillm import generate
from minillm.decoding.lookahead import (
    LookaheadConfig,
    LookaheadTrace,
    NGramPool,
    jacobi_iterations,
    jacobi_step,
    lookahead_generate,
    lookahead_layout,
    window_update,
)
from tests.conftest import tiny_config, tiny_model
from tests.decoding.test_speculative import MarkovModel, random_prompt

VOCAB = tiny_config().vocab_size


def greedy(model, prompt, n, **kw) -> list[int]:
    return generate(model, prompt, n, **kw).tokens[0].tolist()


@pytest.mark.parametrize("window, ngram, candidates", [(5, 4, 5), (1, 2, 1), (3, 3, 8), (6, 5, 2)])
def test_greedy_equals_generate(window, ngram, candidates):
    model = tiny_model(seed=0)
    for seed in range(6):
        prompt = random_prompt(1 + 4 * seed, 200 + seed)
        result = lookahead_generate(model, prompt, 30, LookaheadConfig(window, ngram, candidates), eos_token_id=None)
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
    result = lookahead_generate(
        model, [0, 1, 2], 60, LookaheadConfig(window=4, ngram=4, max_candidates=3), eos_token_id=None
    )
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
    "kwargs, match", [(dict(window=0), "window"), (dict(ngram=1), "ngram"), (dict(max_candidates=0), "max_candidates")]
)
def test_bad_config_raises(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LookaheadConfig(**kwargs)


@pytest.mark.parametrize(
    "kwargs, match", [(dict(input_ids=[[1, 2], [3, 4]]), "batch size 1"), (dict(max_new_tokens=100), "max_seq_len")]
)
def test_bad_input_raises(kwargs, match):
    args = dict(input_ids=[1, 2, 3], max_new_tokens=10) | kwargs
    with pytest.raises(ValueError, match=match):
        lookahead_generate(tiny_model(), **args)


def test_config_counts_tokens_per_forward():
    assert LookaheadConfig(5, 4, 5).tokens_per_forward() == 1 + 3 * 5 + 5 * 3


# --- Jacobi iteration, the window update and the trace (chapter 9) ---------------------------


def test_jacobi_iterations_reach_greedy_and_fix_one_more_token_each_time():
    model = tiny_model(seed=1)
    prompt = random_prompt(6, 5)
    expected = greedy(model, prompt, 10, eos_token_id=None)
    guesses = jacobi_iterations(model, prompt, [0] * 10)
    assert guesses[-1] == expected and len(guesses) <= 12
    for it, guess in enumerate(guesses):
        assert guess[:it] == expected[:it]  # after k iterations at least the first k are right


def test_jacobi_step_uses_the_old_guess():
    model = tiny_model(seed=2)
    prompt, guess = random_prompt(4, 1), random_prompt(5, 2)
    new = jacobi_step(model, prompt, guess)
    for i in range(5):
        assert new[i] == int(model(torch.tensor([prompt + guess[:i]]))[0, -1].argmax())


def test_window_update_makes_one_ngram_per_column():
    window = torch.tensor([[1, 2, 3], [4, 5, 6]])  # 2 levels, 3 columns; level 0 the oldest
    ngrams, new = window_update(window, torch.tensor([7, 8, 9]))
    assert ngrams == [(1, 4, 7), (2, 5, 8), (3, 6, 9)]
    assert new.tolist() == [[4, 5, 6], [7, 8, 9]]


def test_trace_records_every_step_and_keeps_the_pool():
    model, prompt = tiny_model(), random_prompt(8, 3)
    trace = LookaheadTrace()
    result = lookahead_generate(model, prompt, 25, eos_token_id=None, trace=trace)
    assert len(trace.steps) == result.stats.target_forwards
    emitted = [t for s in trace.steps for t in s["accepted"] + [s["next"]]]
    assert emitted[:25] == result.tokens[0].tolist()
    assert trace.pool is not None and len(trace.pool) == trace.steps[-1]["pool_size"] > 0
    assert all(len(s["window"]) == 3 and len(s["window"][0]) == 5 for s in trace.steps)
