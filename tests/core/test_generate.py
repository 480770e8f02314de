"""Generation and the KV cache: cache vs recompute, ragged batches, EOS, limits, errors, timings.

The oracles here are independent of ``generate``: a naive greedy loop over full forward passes,
one prompt at a time, and the model's own logits without a cache.
"""

import math

import pytest
import torch

import minillm
from minillm import CacheFullError, GenerationResult, KVCache, generate, preset
from minillm.core.generate import left_pad
from tests.conftest import tiny_config, tiny_model

VOCAB = tiny_config().vocab_size

# Tiny models covering the attention variants. The prompt + generation (up to ~30 tokens) is
# longer than the sliding window, so the window really drops keys.
VARIANTS = {
    "mha": dict(n_kv_heads=4),
    "gqa": dict(n_kv_heads=2),
    "mqa": dict(n_kv_heads=1),
    "qkv_bias": dict(qkv_bias=True),
    "window": dict(sliding_window=5),
    "tied": dict(tie_embeddings=True),
    "wide_heads": dict(head_dim=16, n_kv_heads=1),  # head_dim * n_heads != dim
}


def make_model(variant: str = "gqa", seed: int = 0, **overrides):
    model = tiny_model(seed=seed, **{**VARIANTS[variant], **overrides})
    gen = torch.Generator().manual_seed(1000 + seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):  # init_weights zeroes biases; make them matter
                p.normal_(0.0, 0.2, generator=gen)
    return model


def random_prompt(length: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def naive_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding the slow, obvious way: the whole sequence through the model every step."""
    ids = torch.tensor([prompt])
    out = []
    with torch.no_grad():
        for _ in range(n):
            token = int(model(ids)[0, -1].argmax())
            out.append(token)
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return out


def first_new_token_index(row: list[int], start: int) -> int:
    """The first index >= start whose token did not occur earlier in the row."""
    return next(i for i in range(start, len(row)) if row[i] not in row[:i])


# --- cache vs recompute ------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("variant", VARIANTS)
def test_cache_and_recompute_give_identical_greedy_tokens(variant, seed):
    model = make_model(variant, seed)
    prompt = random_prompt(7, seed)
    cached = generate(model, prompt, 20, eos_token_id=None)
    recomputed = generate(model, prompt, 20, eos_token_id=None, use_cache=False)
    assert cached.tokens.tolist() == recomputed.tokens.tolist()
    assert cached.tokens[0].tolist() == naive_greedy(model, prompt, 20)
    assert len(set(cached.tokens[0].tolist())) > 3  # a varied sequence, not one token repeated


@pytest.mark.parametrize("use_cache", [True, False])
@pytest.mark.parametrize("variant", VARIANTS)
def test_ragged_batch_equals_one_prompt_at_a_time(variant, use_cache):
    model = make_model(variant, seed=2)
    prompts = [random_prompt(n, seed=10 + n) for n in (3, 11, 6, 1)]
    batch = generate(model, prompts, 12, eos_token_id=None, use_cache=use_cache)
    assert batch.tokens.shape == (4, 12)
    assert batch.prompt_lengths == [3, 11, 6, 1]
    for prompt, row in zip(prompts, batch.tokens):
        alone = generate(model, prompt, 12, eos_token_id=None, use_cache=use_cache)
        assert row.tolist() == alone.tokens[0].tolist()


def test_equal_length_batch_equals_one_prompt_at_a_time():
    model = make_model("gqa", seed=3)
    ids = torch.randint(0, VOCAB, (3, 8), generator=torch.Generator().manual_seed(3))
    batch = generate(model, ids, 10, eos_token_id=None)
    for i in range(3):
        assert batch.tokens[i].tolist() == naive_greedy(model, ids[i].tolist(), 10)


# --- sampling through generate -----------------------------------------------------------------


def test_seeded_sampling_is_reproducible_and_seed_dependent():
    model = make_model("gqa", seed=4)
    prompts = [random_prompt(5, 1), random_prompt(9, 2)]
    kwargs = dict(max_new_tokens=24, temperature=1.0, top_k=40, top_p=0.95, eos_token_id=None)
    a = generate(model, prompts, seed=7, **kwargs).tokens
    b = generate(model, prompts, seed=7, **kwargs).tokens
    c = generate(model, prompts, seed=8, **kwargs).tokens
    assert torch.equal(a, b)
    assert (a != c).float().mean() > 0.3
    # the same seed draws the same tokens whether the logits came from the cache or not
    d = generate(model, prompts, seed=7, use_cache=False, **kwargs).tokens
    assert torch.equal(a, d)


def test_sampling_is_not_greedy_and_top_k_one_is():
    model = make_model("gqa", seed=5)
    prompt = random_prompt(6, 5)
    greedy = generate(model, prompt, 16, eos_token_id=None).tokens
    sampled = generate(model, prompt, 16, temperature=1.0, seed=0, eos_token_id=None).tokens
    top1 = generate(model, prompt, 16, temperature=1.5, top_k=1, seed=0, eos_token_id=None).tokens
    assert not torch.equal(sampled, greedy)
    assert torch.equal(top1, greedy)


@pytest.mark.parametrize(
    "kwargs, name", [(dict(temperature=-1.0), "temperature"), (dict(top_k=0), "top_k"), (dict(top_p=1.5), "top_p")]
)
def test_invalid_sampling_parameters_are_refused(kwargs, name):
    with pytest.raises(ValueError, match=name):
        generate(make_model(), [1, 2, 3], 4, **kwargs)


# --- EOS ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("use_cache", [True, False])
def test_stops_at_the_eos_the_model_produces(use_cache):
    model = make_model("gqa", seed=6)
    prompt = random_prompt(5, 6)
    reference = generate(model, prompt, 16, eos_token_id=None, use_cache=use_cache).tokens[0].tolist()
    k = first_new_token_index(reference, start=3)
    eos = reference[k]

    explicit = generate(model, prompt, 16, eos_token_id=eos, use_cache=use_cache)
    assert explicit.tokens.shape == (1, k + 1)
    assert explicit.tokens[0].tolist() == reference[: k + 1]
    assert explicit.lengths == [k + 1]
    assert explicit.token_lists() == [reference[: k + 1]]
    assert len(explicit.token_times) == k

    # the same weights with the EOS id in the config: the default eos_token_id uses it
    with_eos = make_model("gqa", seed=6, eos_token_id=eos)
    from_config = generate(with_eos, prompt, 16, use_cache=use_cache)
    assert from_config.tokens[0].tolist() == reference[: k + 1]
    # and None turns stopping off
    no_stop = generate(with_eos, prompt, 16, eos_token_id=None, use_cache=use_cache)
    assert no_stop.tokens[0].tolist() == reference


@pytest.mark.parametrize("use_cache", [True, False])
def test_a_finished_row_is_padded_with_eos_while_the_others_go_on(use_cache):
    model = make_model("gqa", seed=7)
    prompts = [random_prompt(4, 70), random_prompt(8, 71)]
    ref = generate(model, prompts, 14, eos_token_id=None, use_cache=use_cache).tokens.tolist()
    # an EOS that row 0 emits early and row 1 never emits
    k = next(i for i in range(2, 14) if ref[0][i] not in ref[0][:i] and ref[0][i] not in ref[1])
    eos = ref[0][k]
    seen = []
    result = generate(model, prompts, 14, eos_token_id=eos, use_cache=use_cache, on_token=seen.append)
    assert result.tokens.shape == (2, 14)
    assert result.tokens[0].tolist() == ref[0][: k + 1] + [eos] * (14 - k - 1)
    assert result.tokens[1].tolist() == ref[1]
    assert result.lengths == [k + 1, 14]
    assert result.token_lists() == [ref[0][: k + 1], ref[1]]
    assert len(seen) == 14


@pytest.mark.parametrize("use_cache", [True, False])
def test_generation_stops_early_when_every_row_is_done(use_cache):
    model = make_model("mqa", seed=8)
    prompts = [random_prompt(3, 80), random_prompt(7, 81), random_prompt(5, 82)]
    ref = generate(model, prompts, 16, eos_token_id=None, use_cache=use_cache).tokens.tolist()
    eos_ids = (ref[0][2], ref[1][4], ref[2][1])  # several EOS ids, as Llama 3 instruct has
    stops = [next(i for i, t in enumerate(row) if t in eos_ids) for row in ref]  # the oracle
    n = max(stops) + 1
    assert n <= 5

    seen = []
    result = generate(model, prompts, 16, eos_token_id=eos_ids, use_cache=use_cache, on_token=seen.append)
    assert result.tokens.shape == (3, n)
    assert result.lengths == [s + 1 for s in stops]
    assert len(seen) == n and len(result.token_times) == n - 1
    for row, ref_row, stop in zip(result.tokens.tolist(), ref, stops):
        assert row[: stop + 1] == ref_row[: stop + 1]
        assert row[stop] in eos_ids
        assert all(t in eos_ids for t in row[stop + 1 :])  # padding after EOS is an EOS id
    assert result.token_lists() == [ref_row[: s + 1] for ref_row, s in zip(ref, stops)]


def test_eos_in_the_prompt_does_not_stop_generation():
    model = make_model("gqa", seed=6)
    prompt = random_prompt(5, 6)
    reference = generate(model, prompt, 8, eos_token_id=None).tokens[0].tolist()
    eos = next(t for t in range(VOCAB) if t not in reference)
    result = generate(model, prompt + [eos], 8, eos_token_id=eos)
    assert result.tokens.shape == (1, 8) and result.lengths == [8]


# --- limits and errors -------------------------------------------------------------------------


@pytest.mark.parametrize("use_cache", [True, False])
def test_max_new_tokens_is_honored(use_cache):
    model = make_model("gqa")
    for n in (1, 2, 9):
        result = generate(model, [[1, 2, 3], [4, 5]], n, eos_token_id=None, use_cache=use_cache)
        assert result.tokens.shape == (2, n)
        assert result.lengths == [n, n]
        assert len(result.token_times) == n - 1


@pytest.mark.parametrize("use_cache", [True, False])
def test_the_context_length_is_never_exceeded_or_truncated(use_cache):
    model = make_model("gqa", max_seq_len=32)
    prompt = random_prompt(20, 9)
    full = generate(model, prompt, 12, eos_token_id=None, use_cache=use_cache)  # exactly 32
    assert full.tokens.shape == (1, 12)
    with pytest.raises(ValueError, match="max_seq_len"):
        generate(model, prompt, 13, eos_token_id=None, use_cache=use_cache)
    with pytest.raises(ValueError, match="max_seq_len"):  # the longest prompt of a batch counts
        generate(model, [[1, 2], prompt + [3]], 12, eos_token_id=None, use_cache=use_cache)
    with pytest.raises(ValueError, match="max_seq_len"):
        generate(model, random_prompt(33, 9), 1, use_cache=use_cache)


@pytest.mark.parametrize(
    "input_ids, max_new_tokens, match",
    [
        ([], 4, "at least one token"),
        ([[]], 4, "at least one token"),
        ([[1, 2], []], 4, "at least one token"),
        (torch.tensor([], dtype=torch.long), 4, "at least one token"),
        ([1, VOCAB], 4, "token ids"),
        ([[1, 2], [-1, 3]], 4, "token ids"),
        (torch.tensor([[5, 1000]]), 4, "token ids"),
        ([1, 2, 3], 0, "max_new_tokens"),
        ([1, 2, 3], -2, "max_new_tokens"),
        ([1, 2, 3], True, "max_new_tokens"),
        ([1, 2, 3], 2.0, "max_new_tokens"),
        (torch.zeros(1, 2, 3, dtype=torch.long), 4, "input_ids"),
    ],
)
def test_bad_inputs_raise_value_error(input_ids, max_new_tokens, match):
    with pytest.raises(ValueError, match=match):
        generate(make_model(), input_ids, max_new_tokens)


# --- the result --------------------------------------------------------------------------------


def test_result_fields_and_timings():
    model = make_model("gqa")
    result = generate(model, [[1, 2, 3], [4, 5, 6, 7, 8]], 6, eos_token_id=None)
    assert isinstance(result, GenerationResult)
    assert result.tokens.dtype == torch.long and result.tokens.shape == (2, 6)
    assert result.tokens.device.type == "cpu"
    assert result.tokens.min() >= 0 and result.tokens.max() < VOCAB
    assert result.prompt_lengths == [3, 5]
    assert result.ttft > 0
    assert len(result.token_times) == 5 and all(t > 0 for t in result.token_times)
    assert math.isfinite(result.tpot) and result.tpot > 0
    assert result.tpot == pytest.approx(sum(result.token_times) / 5)
    assert result.decode_tokens_per_s == pytest.approx(2 * 5 / sum(result.token_times))
    assert result.total_time >= result.ttft
    assert result.token_lists() == result.tokens.tolist()

    one = generate(model, [1, 2, 3], 1)
    assert one.token_times == [] and math.isnan(one.tpot) and math.isnan(one.decode_tokens_per_s)


@pytest.mark.parametrize("use_cache", [True, False])
def test_on_token_sees_every_steps_tokens(use_cache):
    model = make_model("gqa")
    seen = []
    result = generate(
        model, [[1, 2, 3], [4, 5]], 7, eos_token_id=None, use_cache=use_cache, on_token=lambda t: seen.append(t.clone())
    )
    assert len(seen) == 7
    assert all(t.shape == (2,) and t.dtype == torch.long for t in seen)
    assert torch.equal(torch.stack(seen, dim=1), result.tokens)


def test_input_forms_agree():
    model = make_model("gqa")
    prompt = random_prompt(6, 12)
    expected = generate(model, prompt, 8, eos_token_id=None).tokens
    assert expected.shape == (1, 8)
    for form in (torch.tensor(prompt), torch.tensor([prompt]), [prompt], tuple(prompt)):
        assert torch.equal(generate(model, form, 8, eos_token_id=None).tokens, expected)
    other = random_prompt(6, 13)
    as_tensor = generate(model, torch.tensor([prompt, other]), 8, eos_token_id=None).tokens
    as_lists = generate(model, [prompt, other], 8, eos_token_id=None).tokens
    assert torch.equal(as_tensor, as_lists) and torch.equal(as_tensor[:1], expected)


def test_left_pad_puts_padding_first_with_position_minus_one():
    ids, pos = left_pad([[7, 8, 9], [5]], pad_id=0, device="cpu")
    assert ids.tolist() == [[7, 8, 9], [0, 0, 5]]
    assert pos.tolist() == [[0, 1, 2], [-1, -1, 0]]


# --- the KV cache ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "overrides",
    [dict(n_kv_heads=4), dict(n_kv_heads=2), dict(n_kv_heads=1), dict(head_dim=16, n_kv_heads=2, n_layers=3)],
)
@pytest.mark.parametrize("batch_size, max_len", [(1, 1), (3, 17), (8, 128)])
def test_cache_nbytes_is_the_kv_memory_formula(overrides, dtype, batch_size, max_len):
    cfg = tiny_config(**overrides)
    cache = KVCache(cfg, batch_size, max_len, dtype=dtype)
    element_size = torch.empty(0, dtype=dtype).element_size()
    expected = 2 * cfg.n_layers * batch_size * cfg.n_kv_heads * max_len * cfg.head_dim * element_size
    assert cache.nbytes == expected


def test_cache_nbytes_for_a_real_model_shape():
    # Llama-2-13B (MHA, 40 layers x 5120) in fp16, batch 32 at 2048 tokens: the book's ~54 GB
    cache = KVCache(preset("Llama-2-13B"), 32, 2048, dtype=torch.float16, device="meta")
    assert cache.nbytes == 2 * 40 * 32 * 40 * 2048 * 128 * 2 == 53_687_091_200
    # Llama-3-8B has 8 KV heads for 32 query heads: a quarter of the MHA size
    cache = KVCache(preset("Llama-3-8B"), 1, 8192, dtype=torch.bfloat16, device="meta")
    assert cache.nbytes == 2 * 32 * 1 * 8 * 8192 * 128 * 2


def test_cache_for_model_follows_the_model():
    model = make_model("mqa").to(torch.bfloat16)
    cache = KVCache.for_model(model, 2)
    assert cache.max_len == model.config.max_seq_len and cache.batch_size == 2
    assert cache.k.dtype == torch.bfloat16 and cache.k.shape == (2, 2, 1, 128, 8)
    assert cache.length == 0 and (cache.positions == -1).all()


@pytest.mark.parametrize("variant", VARIANTS)
def test_prefix_logits_one_pass_equal_token_by_token_with_cache(variant):
    """The core equivalence: a cache changes how much is computed, never the result."""
    model = make_model(variant, seed=11)
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        full = model(ids)  # (B, T, V)
        cache = KVCache.for_model(model, 2, 24)
        steps = torch.cat([model(ids[:, t : t + 1], cache=cache) for t in range(24)], dim=1)
        torch.testing.assert_close(steps, full, atol=1e-5, rtol=1e-5)
        assert cache.length == 24

        chunked_cache = KVCache.for_model(model, 2, 24)  # prefill in uneven chunks, as chunked prefill does
        chunks = [model(ids[:, s:e], cache=chunked_cache) for s, e in [(0, 7), (7, 8), (8, 13), (13, 24)]]
        torch.testing.assert_close(torch.cat(chunks, dim=1), full, atol=1e-5, rtol=1e-5)


def test_writing_past_capacity_raises_cache_full_error():
    model = make_model("gqa")
    ids = torch.randint(0, VOCAB, (1, 10), generator=torch.Generator().manual_seed(12))
    cache = KVCache.for_model(model, 1, 8)
    assert issubclass(CacheFullError, ValueError)
    with torch.no_grad():
        model(ids[:, :6], cache=cache)
        with pytest.raises(CacheFullError, match=r"full.*6 of 8.*3 more"):
            model(ids[:, 6:9], cache=cache)
        assert cache.length == 6  # the failed write left the cache as it was
        last = model(ids[:, 6:8], cache=cache)  # exactly fills it
        torch.testing.assert_close(last, model(ids[:, :8])[:, 6:8], atol=1e-5, rtol=1e-5)
        with pytest.raises(CacheFullError):
            model(ids[:, 8:9], cache=cache)


def test_cache_refuses_a_different_batch_size():
    model = make_model("gqa")
    cache = KVCache.for_model(model, 2, 16)
    with pytest.raises(ValueError, match="batch size"):
        model(torch.zeros(3, 4, dtype=torch.long), cache=cache)


def test_truncate_rolls_back_exactly():
    model = make_model("window", seed=13)  # window 5: rollback must restore what falls out of it too
    g = torch.Generator().manual_seed(13)
    prefix = torch.randint(0, VOCAB, (2, 9), generator=g)
    accepted = torch.randint(0, VOCAB, (2, 4), generator=g)
    rejected = torch.randint(0, VOCAB, (2, 6), generator=g)
    with torch.no_grad():
        cache = KVCache.for_model(model, 2, 32)
        model(prefix, cache=cache)
        before = [model(accepted[:, t : t + 1], cache=cache) for t in range(4)]

        cache.truncate(9)  # drop the accepted tokens, write a rejected draft, roll back again
        assert cache.length == 9 and (cache.positions[:, 9:] == -1).all()
        model(rejected, cache=cache)
        cache.truncate(9)
        after = [model(accepted[:, t : t + 1], cache=cache) for t in range(4)]
        for a, b in zip(after, before):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
        full = model(torch.cat([prefix, accepted], dim=1))[:, 9:]
        torch.testing.assert_close(torch.cat(after, dim=1), full, atol=1e-5, rtol=1e-5)

        cache.truncate(0)  # back to empty: the cache behaves as new
        torch.testing.assert_close(model(prefix, cache=cache), model(prefix), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("length", [-1, 10])
def test_truncate_refuses_impossible_lengths(length):
    cache = KVCache(tiny_config(), 1, 16)
    cache.reserve(torch.arange(5)[None])
    with pytest.raises(ValueError, match="truncate"):
        cache.truncate(length)
    assert cache.length == 5


def test_cache_constructor_refuses_non_positive_sizes():
    with pytest.raises(ValueError, match="batch_size"):
        KVCache(tiny_config(), 0, 16)
    with pytest.raises(ValueError, match="max_len"):
        KVCache(tiny_config(), 1, 0)


def test_generate_takes_the_sampling_params_every_decoder_takes(model):
    """generate(..., sampling=SamplingParams(...)) is the keyword sugar's twin, and both at once
    are refused with a reason."""
    from minillm import SamplingParams

    ids = [1, 2, 3, 4]
    params = SamplingParams(temperature=0.9, top_k=20, seed=3)
    one = minillm.generate(model, ids, 8, sampling=params, eos_token_id=None)
    sugar = minillm.generate(model, ids, 8, temperature=0.9, top_k=20, seed=3, eos_token_id=None)
    assert one.tokens.tolist() == sugar.tokens.tolist()
    greedy = minillm.generate(model, ids, 8, sampling=SamplingParams(), eos_token_id=None)
    assert greedy.tokens.tolist() == minillm.generate(model, ids, 8, eos_token_id=None).tokens.tolist()
    with pytest.raises(ValueError, match="not both"):
        minillm.generate(model, ids, 8, sampling=params, temperature=0.5)
    with pytest.raises(ValueError, match="sampling must be a SamplingParams"):
        minillm.generate(model, ids, 8, sampling={"temperature": 0.5})


def test_every_decoding_loop_runs_without_autograd(model):
    """No forward of generate (cached, recomputing) or of a decoder builds an autograd graph."""
    from minillm.decoding.lookahead import LookaheadConfig, lookahead_generate
    from minillm.decoding.prompt_lookup import prompt_lookup_generate
    from minillm.decoding.speculative import speculative_generate

    grad_seen = []
    model.register_forward_hook(lambda module, args, out: grad_seen.append(torch.is_grad_enabled()))
    prompt = [3, 14, 15, 92, 65, 35, 3, 14]
    generate(model, prompt, 4, eos_token_id=None)
    generate(model, prompt, 4, eos_token_id=None, use_cache=False)
    speculative_generate(model, model, prompt, 4, k=2, eos_token_id=None)
    prompt_lookup_generate(model, prompt, 4, k=2, eos_token_id=None)
    lookahead_generate(model, prompt, 4, LookaheadConfig(window=2, ngram=3, max_candidates=2), eos_token_id=None)
    assert len(grad_seen) > 5 and not any(grad_seen)
