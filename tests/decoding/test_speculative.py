"""Speculative and prompt-lookup decoding: greedy parity with ``generate``, the acceptance rule,
and a chi-square test that speculative *sampling* keeps the target's distribution (and that the
same test rejects a wrong rule, so it can fail).

The statistical tests need 20k generations; a transformer takes ~3 ms each on a CPU, so they
use ``MarkovModel``: a model whose next-token logits depend on the last token and its position
only, behind the same forward/KV-cache interface. Its exact joint distribution of the first
three tokens is a product of three table rows, computed here with numpy.
"""

import json

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from torch import nn

import minillm
from minillm import generate
from minillm.bench.decoding import measure_forward_ms
from minillm.bench.lookup import copy_task_prompts, lookup_by_task, summarize_by_task
from minillm.bench.speculative import speculative_sweep
from minillm.cli.main import main
from minillm.core.sampling import SamplingParams
from minillm.decoding import speculative as spec
from minillm.decoding.common import DecodingStats, merged
from minillm.decoding.prompt_lookup import copyable_fraction, lookup_continuation, prompt_lookup_generate
from minillm.decoding.speculative import (
    accept_draft_tokens,
    expected_speedup,
    expected_tokens_per_forward,
    speculative_generate,
    teacher_forced_acceptance,
)
from tests.conftest import tiny_config, tiny_model

VOCAB = tiny_config().vocab_size
N_SAMPLES = 20_000


def random_prompt(length: int, seed: int, vocab: int = VOCAB) -> list[int]:
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def greedy(model, prompt, n, **kw) -> list[int]:
    return generate(model, prompt, n, **kw).tokens[0].tolist()


# --- greedy parity -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pair():
    return tiny_model(seed=0), tiny_model(seed=1, n_layers=1)


@pytest.mark.parametrize("k", [1, 3, 6])
def test_speculative_greedy_equals_generate(pair, k):
    target, draft = pair
    for seed in range(8):
        prompt = random_prompt(1 + 3 * seed, seed)
        result = speculative_generate(target, draft, prompt, 25, k=k, eos_token_id=None)
        assert result.tokens[0].tolist() == greedy(target, prompt, 25, eos_token_id=None), seed


@pytest.mark.parametrize("k", [1, 4, 8])
def test_prompt_lookup_greedy_equals_generate(pair, k):
    target, _ = pair
    for seed in range(8):
        prompt = random_prompt(2 + 3 * seed, 100 + seed)
        prompt = prompt + prompt[: len(prompt) // 2]  # something to look up
        result = prompt_lookup_generate(target, prompt, 30, k=k, eos_token_id=None)
        assert result.tokens[0].tolist() == greedy(target, prompt, 30, eos_token_id=None), seed


def test_greedy_stops_at_eos_like_generate():
    prompt = random_prompt(5, 7)
    free = greedy(tiny_model(), prompt, 30, eos_token_id=None)
    eos = free[12]  # a token greedy decoding makes, so it must stop there (or earlier)
    target, draft = tiny_model(eos_token_id=eos), tiny_model(seed=1, n_layers=1, eos_token_id=eos)
    expected = greedy(target, prompt, 30)
    assert expected[-1] == eos and len(expected) <= 13
    assert speculative_generate(target, draft, prompt, 30, k=4).tokens[0].tolist() == expected
    assert prompt_lookup_generate(target, prompt, 30, k=4).tokens[0].tolist() == expected


def test_self_draft_accepts_everything(pair):
    target, _ = pair
    result = speculative_generate(target, target, random_prompt(6, 3), 21, k=4, eos_token_id=None)
    assert result.tokens.shape == (1, 21)
    assert result.stats.acceptance_rates == [1.0] * 4
    assert result.stats.tokens_per_target_forward == 21 / 5  # four rounds of 5, one of 1
    assert result.stats.mean_accepted_length == 16 / 5


def test_prompt_lookup_accepts_copied_text():
    """A model that cycles through the vocabulary, prompted with the cycle: every proposal copied
    from the prompt is right, so each forward makes k + 1 tokens."""
    V, k = 10, 4
    cycle = torch.eye(V).roll(1, dims=1) * 5  # row a: token a + 1 is by far the most likely
    model = MarkovModel(cycle.expand(64, V, V) + torch.randn(64, V, V, generator=torch.Generator().manual_seed(0)))
    prompt = list(range(V)) + [0, 1]
    result = prompt_lookup_generate(model, prompt, 26, k=k, eos_token_id=None)
    assert result.tokens[0].tolist() == [(2 + i) % V for i in range(26)]
    assert result.stats.acceptance_rates == [1.0] * k
    assert result.stats.target_forwards == 6  # 5 rounds of 5 tokens, then 1


# --- the rule and the drafter ---------------------------------------------------------------------


def test_rule_accepts_all_when_draft_equals_target():
    p = torch.softmax(torch.randn(4, 10, generator=torch.Generator().manual_seed(0)), -1)
    draft = torch.tensor([1, 5, 2])
    for seed in range(20):
        n, _ = accept_draft_tokens(p, p[:3], draft, torch.Generator().manual_seed(seed))
        assert n == 3


def test_rule_rejects_impossible_token_and_resamples_from_the_residual():
    p = torch.tensor([[0.0, 0.5, 0.5, 0.0], [0.25] * 4])
    q = torch.tensor([[0.0, 1.0, 0.0, 0.0]])  # draft is sure of 1; target gives it 0.5
    counts = np.zeros(4)
    for seed in range(400):
        n, token = accept_draft_tokens(p, q, torch.tensor([1]), torch.Generator().manual_seed(seed))
        assert (n, token) in {(1, 0), (1, 1), (1, 2), (1, 3), (0, 2)}  # rejected: only the residual's token 2
        counts[token if n == 0 else 0] += n == 0
    assert 150 < counts[2] < 250  # rejected about half the time


def test_expected_tokens_per_forward_matches_a_simulation():
    assert expected_tokens_per_forward(0.0, 4) == 1.0 and expected_tokens_per_forward(1.0, 4) == 5.0
    gen = torch.Generator().manual_seed(0)
    accepted = torch.rand(100_000, 4, generator=gen) < 0.6  # i.i.d. acceptance of 4 proposals
    tokens = accepted.int().cumprod(dim=1).sum(dim=1) + 1  # accepted prefix + the target's own token
    assert abs(tokens.float().mean().item() - expected_tokens_per_forward(0.6, 4)) < 0.02
    assert expected_speedup(0.6, 4, cost_ratio=0.1) == pytest.approx(expected_tokens_per_forward(0.6, 4) / 1.4)
    with pytest.raises(ValueError, match="alpha"):
        expected_tokens_per_forward(1.5, 4)


def test_lookup_continuation_takes_the_longest_then_latest_match():
    tokens = [1, 2, 3, 9, 2, 3, 7, 8, 5, 2, 3]
    assert lookup_continuation(tokens, 2, max_ngram=2) == [7, 8]  # the latest (2, 3) before the end
    assert lookup_continuation([4, 1, 2, 3, 6, 2, 3, 5, 1, 2, 3], 3, max_ngram=3) == [6, 2, 3]  # (1, 2, 3) wins
    assert lookup_continuation([1, 2, 3, 4], 3, max_ngram=3) == []
    assert lookup_continuation([5, 6, 5], 4, max_ngram=1) == [6, 5]  # runs up to the end


def test_stats_count_reached_and_accepted_positions():
    stats = DecodingStats(3)
    stats.record(proposed=3, n_accepted=1, emitted=2)
    stats.record(proposed=3, n_accepted=3, emitted=4)
    assert stats.reached == [2, 2, 1] and stats.accepted == [2, 1, 1]
    assert stats.acceptance_rates == [1.0, 0.5, 1.0]
    assert stats.tokens_per_target_forward == 3.0 and stats.mean_accepted_length == 2.0
    # three names, three quantities: 4 accepted of 5 checked, of 6 proposed, 2 per round
    assert stats.acceptance_rate == 4 / 5 and stats.fraction_kept == 4 / 6
    both = merged([stats, stats])
    assert both.proposed == 12 and both.fraction_kept == stats.fraction_kept


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda t, d: speculative_generate(t, d, [1, 2], 5, k=0), "k"),
        (lambda t, d: speculative_generate(t, d, [1, 2], 5, k=2.0), "k"),
        (lambda t, d: speculative_generate(t, d, [[1, 2], [3, 4]], 5), "batch size 1"),
        (lambda t, d: speculative_generate(t, d, torch.ones(2, 3, dtype=torch.long), 5), "batch size 1"),
        (lambda t, d: speculative_generate(t, tiny_model(vocab_size=50), [1, 2], 5), "vocabulary"),
        (lambda t, d: speculative_generate(t, d, [1, 2], 5, sampling=SamplingParams(temperature=-1.0)), "temperature"),
        (lambda t, d: speculative_generate(t, d, [1, 2], 0), "max_new_tokens"),
        (lambda t, d: prompt_lookup_generate(t, [1, 2], 5, max_ngram=1, min_ngram=2), "min_ngram"),
        (lambda t, d: prompt_lookup_generate(t, [1, 2], 5, sampling=SamplingParams(1.0, top_p=1.5)), "top_p"),
    ],
)
def test_bad_input_raises(pair, call, match):
    with pytest.raises(ValueError, match=match):
        call(*pair)


# --- the distribution ---------------------------------------------------------------------------


class MarkovModel(nn.Module):
    """Next-token logits from a table indexed by (position, last token): the forward interface
    and KV-cache bookkeeping of a Transformer, at a small fraction of the cost per call."""

    def __init__(self, table: torch.Tensor):  # (positions, V, V)
        super().__init__()
        self.table = table
        self.config = tiny_config(vocab_size=table.shape[-1], n_layers=1, dim=8, n_heads=1, n_kv_heads=1)

    device = torch.device("cpu")
    dtype = torch.float32

    def forward(self, input_ids, positions=None, cache=None, last_only=False, **_):
        T = input_ids.shape[1]
        start = cache.length if cache is not None else 0
        positions = torch.arange(start, start + T)[None] if positions is None else positions
        if cache is not None:
            cache.reserve(positions)
        logits = self.table[positions, input_ids]  # (1, T, V)
        return logits[:, -1:] if last_only else logits


def markov(seed: int, vocab: int = 4, scale: float = 0.6) -> MarkovModel:
    return MarkovModel(torch.randn(8, vocab, vocab, generator=torch.Generator().manual_seed(seed)) * scale)


def filtered_probs(logits: np.ndarray, temperature: float, top_k: int | None) -> np.ndarray:
    """softmax(logits / T) restricted to the top k, in float64, independently of minillm.core.sampling."""
    x = np.asarray(logits, dtype=np.float64) / temperature
    if top_k is not None:
        x = np.where(x >= np.sort(x)[-top_k], x, -np.inf)
    e = np.exp(x - x.max())
    return e / e.sum()


def exact_joint(model: MarkovModel, first: int, temperature: float, top_k: int | None) -> np.ndarray:
    """P(t1, t2, t3) (V, V, V) after the one-token prompt [first] at position 0."""
    table = model.table.numpy()
    p1 = filtered_probs(table[0, first], temperature, top_k)
    p2 = np.stack([filtered_probs(table[1, a], temperature, top_k) for a in range(table.shape[-1])])
    p3 = np.stack([filtered_probs(table[2, b], temperature, top_k) for b in range(table.shape[-1])])
    return p1[:, None, None] * p2[:, :, None] * p3[None, :, :]


def joint_pvalue(target, draft, temperature=1.0, top_k=None, n=N_SAMPLES) -> float:
    """Chi-square p-value of n speculative samples (K=2, three tokens) against the exact joint."""
    V = target.config.vocab_size
    torch.manual_seed(0)  # seed=None draws from the global generator: one stream for all n runs
    counts = np.zeros((V, V, V))
    for _ in range(n):
        sampling = SamplingParams(temperature=temperature, top_k=top_k)
        t = speculative_generate(target, draft, [0], 3, k=2, sampling=sampling, eos_token_id=None).tokens[0]
        counts[tuple(t.tolist())] += 1
    expected = exact_joint(target, 0, temperature, top_k).ravel() * n
    support = expected > 0
    assert counts.ravel()[~support].sum() == 0, "a sample outside the target's support"
    assert expected[support].min() > 5, "chi-square needs ~5 expected samples per cell"
    return float(chisquare(counts.ravel()[support], expected[support]).pvalue)


def test_speculative_sampling_keeps_the_target_distribution():
    assert joint_pvalue(markov(0), markov(1)) > 1e-3


def test_speculative_sampling_with_top_k_keeps_the_filtered_distribution():
    assert joint_pvalue(markov(2, vocab=5), markov(3, vocab=5), temperature=0.8, top_k=3, n=8_000) > 1e-3


def test_the_distribution_test_rejects_a_wrong_rule(monkeypatch):
    """Resampling from p instead of max(0, p - q) after a rejection over-weights the draft's
    choices; the chi-square test must notice (a test that cannot fail proves nothing)."""
    monkeypatch.setattr(spec, "residual_distribution", lambda p, q: p)
    assert joint_pvalue(markov(0), markov(1)) < 1e-6


# --- the benchmark and its command ----------------------------------------------------------------


def test_cli_bench_decoding_writes_every_method(tmp_path, capsys):
    """``python -m minillm bench decoding`` on the bundled pair, tiny sizes: every method present,
    every method's greedy tokens equal plain greedy's, the figures in the JSON file."""
    out = tmp_path / "bench_decoding.json"
    argv = [
        "bench",
        "decoding",
        "--prompts",
        "1",
        "--prompt-len",
        "16",
        "--new-tokens",
        "12",
        "--repeats",
        "1",
        "--device",
        "cpu",
        "--no-save",
        "--json",
        str(out),
    ]
    assert main(argv) == 0
    figures = json.loads(out.read_text())
    methods = [row["method"].split(" (")[0] for row in figures["rows"]]
    assert methods == ["greedy", "speculative", "prompt lookup", "lookahead", "medusa"]
    assert all(row["same_greedy_tokens"] for row in figures["rows"])
    assert figures["rows"][0]["speedup"] == 1.0 and figures["hardware"]
    assert set(figures["forward_ms_by_new_tokens"]) == {"target", "draft"}
    assert "tokens/forward" in capsys.readouterr().out


def test_cli_bench_decoding_rejects_bad_counts(capsys):
    assert main(["bench", "decoding", "--k", "0"]) == 2
    assert "--k" in capsys.readouterr().err


# --- chapters 7 and 8: what to expect, sweeps, copy tasks, plots ---------------------------------


def test_acceptance_probability_is_the_overlap():
    p = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]])
    assert torch.allclose(spec.acceptance_probability(p, p), torch.ones(2))
    q = torch.tensor([[0.0, 0.0, 1.0], [0.5, 0.3, 0.2]])
    assert torch.allclose(spec.acceptance_probability(p, q), torch.tensor([0.0, 0.7]))


def test_predicted_speedup_reduces_to_the_simple_model():
    flat = {1: 2.0, 4: 2.0}  # verification as cheap as one token
    assert spec.predicted_speedup(0.7, 3, 0.4, flat) == pytest.approx(expected_speedup(0.7, 3, 0.2))
    assert spec.predicted_speedup(0.7, 3, 0.4, {1: 2.0, 4: 3.0}) < expected_speedup(0.7, 3, 0.2)
    with pytest.raises(ValueError, match="widths"):
        spec.predicted_speedup(0.7, 4, 0.4, flat)


def test_copyable_fraction_counts_what_a_lookup_could_copy():
    assert copyable_fraction([1, 2, 3, 4, 5], [1, 2, 3, 4], n=2) == 0.5  # 3 and 4 follow (1, 2), (2, 3)
    assert copyable_fraction([1, 2, 3, 4, 5, 1, 2], [3, 4, 9], n=2) == 2 / 3
    assert copyable_fraction([7], [1, 2, 1, 2, 1, 2], n=1) == 3 / 6  # from its own output: (1, 2) (2, 1) (1, 2)
    with pytest.raises(ValueError, match="n must"):
        copyable_fraction([1], [1], n=0)


def test_teacher_forced_acceptance_is_one_for_a_self_draft(pair):
    target, draft = pair
    ids = random_prompt(40, 5)
    assert teacher_forced_acceptance(target, target, ids, (0.0, 0.5, 1.0)) == pytest.approx({0.0: 1, 0.5: 1, 1.0: 1})
    other = teacher_forced_acceptance(target, draft, ids, (0.0, 1.0))
    assert all(0 <= a < 1 for a in other.values())


def test_speculative_sweep_rows(pair):
    target, draft = pair
    prompts = [random_prompt(8, 1), random_prompt(8, 2)]
    rows = speculative_sweep(target, draft, prompts, 12, ks=(1, 3), temperatures=(0.0, 1.0))
    assert [(r["k"], r["temperature"]) for r in rows] == [(1, 0.0), (3, 0.0), (1, 1.0), (3, 1.0)]
    for r in rows:
        assert 0 <= r["alpha"] <= 1 and 1 <= r["tokens_per_target_forward"] <= r["k"] + 1
        assert r["speedup"] > 0 and r["ms_per_round"] > 0
    self_draft = speculative_sweep(target, target, prompts, 12, ks=(3,))[0]
    assert self_draft["alpha"] == 1.0


def test_copy_tasks_and_lookup_by_task():
    model, tokenizer = minillm.load("minillm-target", device="cpu")
    tasks = copy_task_prompts(model, tokenizer, n=1, prompt_len=16, new_tokens=4)
    assert list(tasks) == ["free", "rewrite a function", "regenerate an answer"]
    free, regen = tasks["free"][0], tasks["regenerate an answer"][0]
    assert regen[: len(free)] == free and regen[-len(free) :] == free
    assert tokenizer.decode(tasks["rewrite a function"][0]).count("    def ") == 2
    rows = lookup_by_task(model, tasks, 6, repeats=1)
    assert len(rows) == 3 and all(r["same_greedy_tokens"] for r in rows)
    summary = summarize_by_task(rows)
    assert [s["task"] for s in summary] == list(tasks) and all(0 <= s["copyable"] <= 1 for s in summary)


def test_measure_forward_ms_one_positive_time_per_width(pair):
    target, _ = pair
    costs = measure_forward_ms(target, sizes=(1, 4), prefix=8, repeats=2)
    assert set(costs) == {1, 4} and all(0 < ms < float("inf") for ms in costs.values())
