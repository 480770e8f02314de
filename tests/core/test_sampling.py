"""Sampling: greedy, temperature, top-k, top-p; validation, exact kept sets, and distributions.

The kept sets and target distributions are computed here independently (numpy, float64) from
the definitions, not by calling the filters under test. The distribution tests use a chi-square
goodness-of-fit test, and one of them shows that the same procedure rejects a wrong sampler.
"""

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from minillm.core.sampling import SamplingParams, apply_top_k, apply_top_p, filter_logits, probabilities, sample

# Fixed, hand-made logits over 10 categories: distinct values, every probability well above 1%.
LOGITS10 = torch.tensor([1.2, -0.3, 0.5, 2.0, -1.0, 0.0, 0.8, -0.6, 1.5, 0.3])
N_DRAWS = 20_000


def random_logits(seed: int, shape=(4, 50), scale: float = 2.0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale


def softmax64(logits) -> np.ndarray:
    x = np.asarray(logits, dtype=np.float64)
    e = np.exp(x - x.max())
    return e / e.sum()


def top_k_set(logits, k: int) -> set[int]:
    return {int(i) for i in np.argsort(-np.asarray(logits, dtype=np.float64), kind="stable")[:k]}


def top_p_set(probs, p: float) -> set[int]:
    """The smallest set of most likely tokens whose probability reaches p."""
    probs = np.asarray(probs, dtype=np.float64)
    order = np.argsort(-probs, kind="stable")
    cum = np.cumsum(probs[order])
    n = int(np.searchsorted(cum, p, side="left")) + 1  # first rank where the total reaches p
    return {int(i) for i in order[:n]}


def truncated(probs, keep: set[int]) -> np.ndarray:
    """probs restricted to ``keep`` and renormalized."""
    out = np.zeros_like(np.asarray(probs, dtype=np.float64))
    idx = sorted(keep)
    out[idx] = np.asarray(probs, dtype=np.float64)[idx]
    return out / out.sum()


def draw(logits: torch.Tensor, params: SamplingParams, n: int = N_DRAWS, seed: int = 0) -> np.ndarray:
    """n draws from one row of logits (V,), through ``sample`` in one batched call."""
    gen = torch.Generator().manual_seed(seed)
    return sample(logits.expand(n, -1), params, gen).numpy()


def chi_square_pvalue(draws: np.ndarray, expected_probs: np.ndarray) -> float:
    """Goodness of fit of the draws to expected_probs, over the categories with nonzero probability."""
    support = expected_probs > 0
    assert np.all(np.isin(draws, np.flatnonzero(support))), "a draw outside the expected support"
    counts = np.bincount(draws, minlength=len(expected_probs))[support]
    expected = expected_probs[support] / expected_probs[support].sum() * len(draws)
    assert expected.min() > 5, "chi-square needs at least ~5 expected draws per category"
    return float(chisquare(counts, expected).pvalue)


# --- parameters --------------------------------------------------------------------------------


def test_defaults_are_greedy():
    params = SamplingParams()
    assert params.greedy and params.temperature == 0
    assert params.generator() is None
    assert not SamplingParams(temperature=0.5).greedy


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=-1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(temperature="1.0"), "temperature"),
        (dict(temperature=1.0, top_k=0), "top_k"),
        (dict(temperature=1.0, top_k=-3), "top_k"),
        (dict(temperature=1.0, top_k=2.0), "top_k"),
        (dict(temperature=1.0, top_k=2.5), "top_k"),
        (dict(temperature=1.0, top_k=True), "top_k"),
        (dict(temperature=1.0, top_p=0), "top_p"),
        (dict(temperature=1.0, top_p=0.0), "top_p"),
        (dict(temperature=1.0, top_p=1.01), "top_p"),
        (dict(temperature=1.0, top_p=2), "top_p"),
        (dict(temperature=1.0, top_p=-0.5), "top_p"),
        (dict(temperature=1.0, top_p=float("nan")), "top_p"),
        (dict(temperature=1.0, top_p="0.9"), "top_p"),
    ],
)
def test_invalid_parameters_raise_naming_the_parameter(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [dict(temperature=0), dict(temperature=1), dict(temperature=0.7, top_k=1), dict(top_p=1), dict(top_p=1e-9)],
)
def test_valid_edge_parameters_are_accepted(kwargs):
    SamplingParams(**kwargs)


# --- greedy and temperature --------------------------------------------------------------------


def test_greedy_is_argmax_and_ignores_the_generator():
    logits = random_logits(0)
    params = SamplingParams()
    expected = logits.argmax(-1)
    assert sample(logits, params).tolist() == expected.tolist()
    assert sample(logits, params, torch.Generator().manual_seed(1)).tolist() == expected.tolist()
    assert sample(logits, params).dtype == torch.long


def test_tiny_temperature_equals_greedy():
    logits = random_logits(1, shape=(8, 50))
    top2 = logits.topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).min() > 1e-2  # no near-ties, so the test is meaningful
    params = SamplingParams(temperature=1e-4, seed=0)
    gen = params.generator()
    for _ in range(50):
        assert sample(logits, params, gen).tolist() == logits.argmax(-1).tolist()


def test_top_k_one_is_greedy_at_any_temperature():
    logits = random_logits(2, shape=(6, 40))
    params = SamplingParams(temperature=5.0, top_k=1, seed=3)
    gen = params.generator()
    for _ in range(20):
        assert sample(logits, params, gen).tolist() == logits.argmax(-1).tolist()


# --- reproducibility ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=1.0),
        dict(temperature=0.8, top_k=10),
        dict(temperature=1.3, top_p=0.9),
        dict(temperature=1.0, top_k=20, top_p=0.8),
    ],
)
def test_same_seed_same_tokens_different_seed_different_tokens(kwargs):
    logits = random_logits(3, shape=(64, 50), scale=1.0)

    def run(seed):
        params = SamplingParams(seed=seed, **kwargs)
        gen = params.generator()
        return torch.stack([sample(logits, params, gen) for _ in range(5)])

    a, b, c = run(11), run(11), run(12)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert (a != c).float().mean() > 0.3  # not just one stray difference: the streams differ


# --- the kept sets -----------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 3, 7, 25])
def test_top_k_never_emits_an_excluded_token(k):
    logits = random_logits(4, shape=(50,), scale=1.0)
    allowed = top_k_set(logits, k)
    draws = draw(logits, SamplingParams(temperature=3.0, top_k=k), n=5000)
    assert set(draws.tolist()) == allowed  # never outside, and (hot temperature) every one is reached


@pytest.mark.parametrize("p", [0.05, 0.3, 0.62, 0.9, 0.99])
@pytest.mark.parametrize("temperature", [0.7, 1.0, 2.0])
def test_top_p_never_emits_an_excluded_token(p, temperature):
    logits = random_logits(5, shape=(40,), scale=1.5)
    probs = softmax64(logits.numpy() / temperature)
    cum = np.cumsum(np.sort(probs)[::-1])
    assert np.abs(cum - p).min() > 1e-4  # not on a boundary, where float32 rounding could decide
    allowed = top_p_set(probs, p)
    draws = draw(logits, SamplingParams(temperature=temperature, top_p=p), n=4000)
    assert set(draws.tolist()) <= allowed
    finite = torch.isfinite(filter_logits(logits, SamplingParams(temperature=temperature, top_p=p)))
    assert set(finite.nonzero().flatten().tolist()) == allowed


@pytest.mark.parametrize("k, p", [(5, 0.5), (10, 0.8), (3, 0.99), (30, 0.3)])
def test_top_k_then_top_p_never_emits_an_excluded_token(k, p):
    logits = random_logits(6, shape=(40,), scale=1.5)
    probs_k = truncated(softmax64(logits.numpy()), top_k_set(logits, k))  # top-k first, renormalized
    allowed = top_p_set(probs_k, p)  # then the nucleus of what is left
    assert allowed <= top_k_set(logits, k)
    draws = draw(logits, SamplingParams(temperature=1.0, top_k=k, top_p=p), n=4000)
    assert set(draws.tolist()) <= allowed
    finite = torch.isfinite(filter_logits(logits, SamplingParams(temperature=1.0, top_k=k, top_p=p)))
    assert set(finite.nonzero().flatten().tolist()) == allowed


# Dyadic probabilities are exact in binary, so the cumulative sums land exactly on p.
DYADIC = [0.046875, 0.5, 0.125, 0.25, 0.0625, 0.015625]  # ranked ids: 1, 3, 2, 4, 0, 5
# cumulative mass by rank:             0.5, 0.75, 0.875, 0.9375, 0.984375, 1.0


@pytest.mark.parametrize(
    "p, kept",
    [
        (1e-9, {1}),  # the top token always survives, however small p is
        (0.3, {1}),
        (0.5, {1}),  # boundary: the top token alone reaches p exactly, nothing else is needed
        (0.5000001, {1, 3}),
        (0.6, {1, 3}),
        (0.75, {1, 3}),  # boundary: 0.5 + 0.25 == 0.75 exactly
        (0.8, {1, 3, 2}),
        (0.875, {1, 3, 2}),  # boundary
        (0.9375, {1, 3, 2, 4}),  # boundary
        (0.95, {1, 3, 2, 4, 0}),
        (0.99, {0, 1, 2, 3, 4, 5}),
        (1.0, {0, 1, 2, 3, 4, 5}),
    ],
)
def test_top_p_keeps_the_smallest_set_reaching_p(p, kept):
    assert top_p_set(DYADIC, p) == kept  # the test's own reference agrees with the hand-made table
    logits = torch.tensor(DYADIC).log()
    out = apply_top_p(logits, p)
    assert set(torch.isfinite(out).nonzero().flatten().tolist()) == kept
    assert torch.equal(out[sorted(kept)], logits[sorted(kept)])  # kept logits are unchanged
    draws = draw(logits, SamplingParams(temperature=1.0, top_p=p), n=2000)
    assert set(draws.tolist()) <= kept


def test_top_p_keeps_the_top_token_even_when_it_is_far_below_p():
    logits = torch.zeros(2, 100)  # uniform: every token has 1%
    logits[1, 17] = 0.01  # a barely-leading token
    out = apply_top_p(logits, 1e-6)
    assert torch.isfinite(out[1]).sum() == 1 and torch.isfinite(out[1, 17])
    assert torch.isfinite(out[0]).sum() == 1  # a row of ties keeps exactly one token


def test_top_p_works_row_by_row():
    a, b = torch.tensor(DYADIC).log(), torch.tensor(DYADIC[::-1]).log()
    out = apply_top_p(torch.stack([a, b]), 0.75)
    last = len(DYADIC) - 1
    assert set(torch.isfinite(out[0]).nonzero().flatten().tolist()) == {1, 3}
    assert set(torch.isfinite(out[1]).nonzero().flatten().tolist()) == {last - 1, last - 3}


def test_top_k_per_row_and_large_k():
    logits = random_logits(7, shape=(5, 30))
    out = apply_top_k(logits, 4)
    for row, orig in zip(out, logits):
        assert set(torch.isfinite(row).nonzero().flatten().tolist()) == top_k_set(orig, 4)
        kept = torch.isfinite(row)
        assert torch.equal(row[kept], orig[kept])  # surviving logits are unchanged
    assert torch.equal(apply_top_k(logits, 30), logits)
    assert torch.equal(apply_top_k(logits, 1000), logits)


# --- probabilities() ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=1.0),
        dict(temperature=0.5),
        dict(temperature=2.0, top_k=7),
        dict(temperature=1.0, top_p=0.8),
        dict(temperature=1.5, top_k=12, top_p=0.7),
    ],
)
def test_probabilities_sum_to_one_and_match_the_definition(kwargs):
    logits = random_logits(8, shape=(3, 30), scale=1.5)
    params = SamplingParams(**kwargs)
    probs = probabilities(logits, params)
    assert probs.shape == logits.shape and probs.dtype == torch.float32
    torch.testing.assert_close(probs.sum(-1), torch.ones(3))
    for row, lg in zip(probs, logits):
        expected = softmax64(lg.numpy() / params.temperature)
        keep = set(range(30))
        if params.top_k is not None:
            keep = top_k_set(lg, params.top_k)
            expected = truncated(expected, keep)
        if params.top_p is not None:
            keep = top_p_set(expected, params.top_p)
            expected = truncated(expected, keep)
        np.testing.assert_allclose(row.numpy(), expected, atol=1e-6, rtol=1e-5)


def test_probabilities_are_one_hot_when_greedy():
    logits = random_logits(9, shape=(4, 20))
    probs = probabilities(logits, SamplingParams())
    assert torch.equal(probs, torch.nn.functional.one_hot(logits.argmax(-1), 20).float())


def test_half_precision_logits_are_sampled_in_fp32():
    logits = random_logits(10, shape=(2, 30)).half()
    probs = probabilities(logits, SamplingParams(temperature=1.0))
    assert probs.dtype == torch.float32
    torch.testing.assert_close(probs.sum(-1), torch.ones(2))


# --- distributions (chi-square) ----------------------------------------------------------------


def test_temperature_one_draws_follow_softmax():
    draws = draw(LOGITS10, SamplingParams(temperature=1.0), seed=0)
    assert chi_square_pvalue(draws, softmax64(LOGITS10.numpy())) > 1e-3


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature_draws_follow_scaled_softmax(temperature):
    draws = draw(LOGITS10, SamplingParams(temperature=temperature), seed=1)
    assert chi_square_pvalue(draws, softmax64(LOGITS10.numpy() / temperature)) > 1e-3


def test_the_chi_square_check_rejects_a_wrong_sampler():
    """The same procedure, pointed at draws from the wrong distribution, must fail loudly."""
    target = softmax64(LOGITS10.numpy())
    too_flat = draw(LOGITS10, SamplingParams(temperature=2.0), seed=0)  # softmax(logits / 2)
    assert chi_square_pvalue(too_flat, target) < 1e-6
    uniform = np.random.default_rng(0).integers(0, 10, N_DRAWS)
    assert chi_square_pvalue(uniform, target) < 1e-6
    too_sharp = draw(LOGITS10, SamplingParams(temperature=0.8), seed=0)  # a subtler error
    assert chi_square_pvalue(too_sharp, target) < 1e-6


@pytest.mark.parametrize("temperature, k, p", [(1.0, 6, 0.8), (1.5, 8, 0.9), (0.8, 5, 0.85)])
def test_top_k_and_top_p_draws_follow_the_renormalized_truncated_distribution(temperature, k, p):
    scaled = LOGITS10.numpy() / temperature
    probs_k = truncated(softmax64(scaled), top_k_set(scaled, k))
    cum = np.cumsum(np.sort(probs_k)[::-1])
    assert np.abs(cum - p).min() > 1e-4  # not on a boundary
    expected = truncated(probs_k, top_p_set(probs_k, p))
    assert 2 <= np.count_nonzero(expected) < k  # top-p really cut something, and something is left
    draws = draw(LOGITS10, SamplingParams(temperature=temperature, top_k=k, top_p=p), seed=2)
    assert chi_square_pvalue(draws, expected) > 1e-3
    assert chi_square_pvalue(draws, softmax64(scaled)) < 1e-6  # the untruncated softmax is rejected


def test_draws_from_a_batch_use_each_rows_own_distribution():
    logits = torch.stack([LOGITS10, LOGITS10.flip(0)])  # row 1 is row 0 reversed
    gen = torch.Generator().manual_seed(5)
    draws = sample(logits.repeat(N_DRAWS // 2, 1), SamplingParams(temperature=1.0), gen).view(-1, 2).numpy()
    target = softmax64(LOGITS10.numpy())
    assert chi_square_pvalue(draws[:, 0], target) > 1e-3
    assert chi_square_pvalue(9 - draws[:, 1], target) > 1e-3
    assert chi_square_pvalue(draws[:, 1], target) < 1e-6  # the rows were not mixed up


def test_booleans_are_not_numbers_here():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(temperature=1.0, top_p=True)
