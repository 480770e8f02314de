"""Speculative decoding and prompt lookup inside the engine (``serving.speculative``): greedy
tokens equal ``generate``'s on a ragged workload with preemption and prefix sharing, a draft that
is the target accepts every proposal (its paged K/V mirror the target's exactly), stop ids,
min_tokens, penalties and logprobs as without speculation, the counters, the refusals, and a
chi-square test that sampling keeps the target's distribution (and rejects a wrong rule)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from minillm import generate
from minillm.core.sampling import SamplingParams
from minillm.decoding import speculative as spec_module
from minillm.serving.async_engine import AsyncEngine
from minillm.serving.engine import Engine, EngineConfig, SimulatedModel
from minillm.serving.logits import LogitAdjustments
from minillm.serving.scheduler import SchedulerConfig
from minillm.serving.speculative import Speculation
from minillm.serving.step_cost import StepCost
from minillm.serving.workload import Request
from tests.conftest import tiny_model
from tests.decoding.test_speculative import MarkovModel, filtered_probs, markov

VOCAB = 97


@pytest.fixture(scope="module")
def target():
    return tiny_model(seed=0, max_seq_len=256)


@pytest.fixture(scope="module")
def draft():
    return tiny_model(seed=1, n_layers=1, max_seq_len=256)


def workload(n: int = 12, seed: int = 0) -> list[tuple[list[int], int]]:
    """Ragged prompts, each ending with a copy of its start (so that a lookup finds matches)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        prompt = torch.randint(0, VOCAB, (int(torch.randint(3, 40, (1,), generator=g)),), generator=g).tolist()
        out.append((prompt + prompt[:10], int(torch.randint(5, 40, (1,), generator=g))))
    return out


def engine(target, speculation, draft=None, num_blocks=256, prefix_cache="hash", max_batch=6) -> Engine:
    scheduler = SchedulerConfig(max_batch=max_batch)
    config = EngineConfig(num_blocks, 8, scheduler=scheduler, speculation=speculation, prefix_cache=prefix_cache)
    return Engine(target, config, draft=draft)


def expected(target, work) -> list[list[int]]:
    return [generate(target, p, n, eos_token_id=None).tokens[0].tolist() for p, n in work]


CASES = {
    "lookup": (Speculation("lookup", 4), False),
    "lookup-k1": (Speculation("lookup", 1, max_ngram=2), False),
    "draft": (Speculation("draft", 3), True),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("prefix_cache", ["hash", "radix"])
@pytest.mark.parametrize("num_blocks", [256, 12])  # 12 blocks of 8: requests preempt each other
def test_greedy_equals_generate(target, draft, case, prefix_cache, num_blocks):
    speculation, uses_draft = CASES[case]
    work = workload()
    e = engine(target, speculation, draft if uses_draft else None, num_blocks, prefix_cache)
    outs = e.run([Request(p, n) for p, n in work])
    assert [o.tokens for o in outs] == expected(target, work)
    stats = e.stats()
    assert stats["spec_proposed_tokens"] > 0 and 0 <= stats["spec_accepted_tokens"] <= stats["spec_proposed_tokens"]
    if num_blocks == 12:
        assert stats["preemptions"] > 0 and stats["prefix_hit_tokens"] > 0
    assert e.blocks.allocator.num_used == 0  # every block given back
    per_request = sum(o.speculation.proposed for o in outs)
    assert per_request == stats["spec_proposed_tokens"]


@pytest.mark.parametrize("num_blocks", [256, 12])
def test_a_draft_that_is_the_target_accepts_everything(target, num_blocks):
    """Were the draft's paged K/V ever stale (after a rejection, a preemption, a prefix hit, a
    copy on write), a draft identical to the target would propose a token the target rejects."""
    work = workload(seed=1)
    e = engine(target, Speculation("draft", 4), target, num_blocks, "radix")
    outs = e.run([Request(p, n) for p, n in work])
    assert [o.tokens for o in outs] == expected(target, work)
    stats = e.stats()
    assert stats["spec_accepted_tokens"] == stats["spec_proposed_tokens"] > 0
    assert all(o.speculation.acceptance_rate == 1.0 for o in outs if o.speculation and o.speculation.proposed)
    if num_blocks == 12:
        assert stats["preemptions"] > 0 and e.blocks.cow_copies > 0


def test_fewer_forwards_when_the_draft_agrees(target):
    work = workload(4, seed=2)
    plain, fast = engine(target, None), engine(target, Speculation("draft", 4), target)
    assert [o.tokens for o in plain.run([Request(p, n) for p, n in work])] == [
        o.tokens for o in fast.run([Request(p, n) for p, n in work])
    ]
    assert fast.steps < plain.steps / 2


def test_stops_penalties_and_logprobs_as_without_speculation(target, draft):
    """Stop ids (not before min_tokens), a repetition penalty and logprobs: the same greedy answer
    and the same log-probabilities with and without speculation."""
    work = workload(8, seed=3)
    frequent = expected(target, work)[0][3]  # a token the first answer makes: it stops there
    requests = lambda: [  # noqa: E731
        Request(
            p,
            n,
            stop_ids=(frequent,),
            min_tokens=2,
            logprobs=2,
            adjust=LogitAdjustments(repetition_penalty=1.3) if i % 2 else LogitAdjustments(),
        )
        for i, (p, n) in enumerate(work)
    ]
    want = engine(target, None).run(requests())
    for speculation, d in ((Speculation("lookup", 4), None), (Speculation("draft", 3), draft)):
        got = engine(target, speculation, d).run(requests())
        assert [o.tokens for o in got] == [o.tokens for o in want]
        assert [o.finish_reason for o in got] == [o.finish_reason for o in want]
        assert any(o.finish_reason == "stop" for o in got)
        for g, w in zip(got, want):
            assert len(g.logprobs) == len(g.tokens) == len(w.logprobs)
            assert [[t for t, _ in x.top] for x in g.logprobs] == [[t for t, _ in x.top] for x in w.logprobs]
            assert np.allclose([x.logprob for x in g.logprobs], [x.logprob for x in w.logprobs], atol=1e-4)


def test_the_async_engine_reports_the_counters(target):
    e = AsyncEngine(engine(target, Speculation("lookup", 4))).start()
    try:
        streams = [e.add_request(Request(p, n)) for p, n in workload(3)]
        for stream in streams:
            assert sum(len(delta.tokens) for delta in stream) == stream.request.max_tokens
        stats = e.stats
        assert stats["spec_proposed_tokens"] > 0 and "spec_accepted_tokens" in stats
    finally:
        e.shutdown(timeout=10)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda t, d: engine(t, Speculation("draft", 2)), "needs a draft model"),
        (lambda t, d: engine(t, None, d), "does not use one"),
        (lambda t, d: engine(t, Speculation("lookup", 2), d), "does not use one"),
        (lambda t, d: engine(t, Speculation("draft", 2), tiny_model(vocab_size=50)), "vocabulary"),
        (lambda t, d: engine(t, Speculation("draft", 2), tiny_model(max_seq_len=64)), "context"),
        (
            lambda t, d: EngineConfig(scheduler=SchedulerConfig("static"), speculation=Speculation()),
            "continuous policy",
        ),
        (lambda t, d: Speculation("medusa"), "method"),
        (lambda t, d: Speculation("lookup", 0), "k"),
        (lambda t, d: Speculation("lookup", 2, max_ngram=1, min_ngram=2), "min_ngram"),
        (
            lambda t, d: Engine(
                SimulatedModel(t.config), EngineConfig(step_cost=StepCost(0.01), speculation=Speculation())
            ),
            "real model",
        ),
    ],
)
def test_refused_with_a_reason(target, draft, make, match):
    with pytest.raises(ValueError, match=match):
        make(target, draft)


# --- the distribution ---------------------------------------------------------------------------


def exact_joint(model: MarkovModel, prompt: list[int], temperature: float) -> np.ndarray:
    """P(t1, t2, t3) (V, V, V) after ``prompt`` (positions from 0)."""
    table, L = model.table.numpy(), len(prompt)
    V = table.shape[-1]
    p1 = filtered_probs(table[L - 1, prompt[-1]], temperature, None)
    p2 = np.stack([filtered_probs(table[L, a], temperature, None) for a in range(V)])
    p3 = np.stack([filtered_probs(table[L + 1, b], temperature, None) for b in range(V)])
    return p1[:, None, None] * p2[:, :, None] * p3[None, :, :]


def engine_pvalue(target, draft, speculation, prompt, n=12_000, temperature=1.0) -> float:
    """Chi-square p-value of n sampled three-token answers from the speculating engine."""
    V = target.config.vocab_size
    torch.manual_seed(0)  # unseeded requests draw from the global generator
    scheduler = SchedulerConfig(max_batch=256)
    e = Engine(target, EngineConfig(512, 4, False, scheduler, speculation=speculation), draft=draft)
    params = SamplingParams(temperature=temperature)
    counts = np.zeros((V, V, V))
    for o in e.run([Request(prompt, 3, params=params) for _ in range(n)]):
        counts[tuple(o.tokens)] += 1
    assert e.stats()["spec_accepted_tokens"] > 0  # the rule was exercised, not bypassed
    want = exact_joint(target, prompt, temperature).ravel() * n
    support = want > 0
    assert counts.ravel()[~support].sum() == 0, "a sample outside the target's support"
    assert want[support].min() > 5, "chi-square needs ~5 expected samples per cell"
    return float(chisquare(counts.ravel()[support], want[support]).pvalue)


@pytest.mark.slow
def test_sampling_with_a_draft_keeps_the_target_distribution():
    assert engine_pvalue(markov(0), markov(1), Speculation("draft", 2), [0]) > 1e-3


@pytest.mark.slow
def test_sampling_with_prompt_lookup_keeps_the_target_distribution():
    """A lookup's proposals are deterministic (q one-hot): accepted with probability p(x)."""
    assert engine_pvalue(markov(4), None, Speculation("lookup", 2, max_ngram=1), [0, 1, 0, 1]) > 1e-3


@pytest.mark.slow
def test_the_engine_distribution_test_rejects_a_wrong_rule(monkeypatch):
    """Resampling from p after a rejection (instead of the residual) must be noticed."""
    monkeypatch.setattr(spec_module, "residual_distribution", lambda p, q: p)
    assert engine_pvalue(markov(0), markov(1), Speculation("draft", 2), [0]) < 1e-6
