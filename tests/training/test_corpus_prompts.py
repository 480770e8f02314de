"""The corpus-prompt family of training.corpus: the first tokens of a split, prompts spread over
it (none ending in a newline), and random windows (reproducible by seed)."""

import pytest

import minillm
from minillm.training.corpus import corpus_prompt, corpus_prompts, load_text


@pytest.fixture(scope="module")
def tokenizer():
    return minillm.load("minillm-target", device="cpu")[1]


def test_corpus_prompt_is_the_start_of_the_split(tokenizer):
    ids = corpus_prompt(tokenizer, 40)
    assert len(ids) == 40 and tokenizer.encode(load_text("valid")[:2000])[:40] == ids
    assert corpus_prompt(tokenizer, 10, split="train") != ids[:10]
    with pytest.raises(ValueError, match="positive"):
        corpus_prompt(tokenizer, 0)


def test_spread_prompts_start_apart_and_do_not_end_in_a_newline(tokenizer):
    prompts = corpus_prompts(tokenizer, 4, 32)
    assert len(prompts) == 4 and len({tuple(p) for p in prompts}) == 4
    assert prompts[0] == corpus_prompt(tokenizer, len(prompts[0]))
    for p in prompts:
        assert 1 <= len(p) <= 32 and not tokenizer.decode(p[-1:]).endswith("\n")


def test_random_windows_are_exact_and_reproducible(tokenizer):
    windows = corpus_prompts(tokenizer, 3, 24, split="train", placement="random", seed=5)
    assert [len(w) for w in windows] == [24, 24, 24]
    assert windows == corpus_prompts(tokenizer, 3, 24, split="train", placement="random", seed=5)
    assert windows != corpus_prompts(tokenizer, 3, 24, split="train", placement="random", seed=6)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(n=0), "positive"),
        (dict(length=0), "positive"),
        (dict(placement="middle"), "placement"),
        (dict(split="test"), "split"),
    ],
)
def test_bad_arguments_raise(tokenizer, kwargs, match):
    with pytest.raises(ValueError, match=match):
        corpus_prompts(tokenizer, **({"n": 2, "length": 8} | kwargs))
