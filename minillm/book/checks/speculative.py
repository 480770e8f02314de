"""Checkers for chapters 7 and 8: the expected tokens per target forward, the speedup with measured
costs, greedy verification, the accept/resample step, the n-gram lookup, the copyable share of an
output, and a prompt-lookup decoding loop."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...core.generate import generate
from ...decoding.prompt_lookup import copyable_fraction, lookup_continuation
from ...decoding.speculative import expected_tokens_per_forward, predicted_speedup
from .base import close, passed, require


def check_expected_tokens(fn: Callable) -> None:
    """fn(alpha, k) -> expected new tokens per target forward."""
    name = "expected tokens per target forward"
    for alpha, k in [(0.0, 4), (0.5, 1), (0.6, 4), (0.8, 8), (0.99, 3), (1.0, 4), (1.0, 1)]:
        want, got = expected_tokens_per_forward(alpha, k), fn(alpha, k)
        hint = f"alpha={alpha}, K={k}: expected {want:.4f}, got {got!r}"
        if isinstance(got, (int, float)) and abs(got - (want - 1)) < 1e-6:
            hint += ": off by one; the target's own token comes with every forward, accepted or not"
        elif isinstance(got, (int, float)) and alpha < 1 and abs(got - (1 - alpha**k) / (1 - alpha)) < 1e-6:
            hint += ": the sum 1 + a + ... + a^K has K + 1 terms"
        elif alpha == 1:
            hint += ": at alpha = 1 every proposal is accepted (K + 1 tokens); avoid dividing by 1 - alpha"
        require(isinstance(got, (int, float)) and abs(got - want) < 1e-6, name, hint)
    passed(name, "(1 - a^(K+1)) / (1 - a), and K + 1 when every proposal is accepted")


def check_speedup_with_costs(fn: Callable) -> None:
    """fn(alpha, k, draft_ms, target_ms: {width: ms}) -> expected speedup over plain decoding."""
    name = "speedup with measured costs"
    costs = {1: 2.63, 2: 3.26, 3: 3.4, 4: 3.53, 5: 3.6, 9: 4.2}
    for alpha, k, draft_ms in [(0.68, 3, 0.57), (0.68, 1, 0.57), (0.9, 4, 0.1), (0.3, 8, 0.2), (1.0, 4, 2.63)]:
        want, got = predicted_speedup(alpha, k, draft_ms, costs), fn(alpha, k, draft_ms, costs)
        hint = f"alpha={alpha}, K={k}, draft {draft_ms} ms: expected {want:.4f}, got {got!r}"
        simple = expected_tokens_per_forward(alpha, k) / (k * draft_ms / costs[1] + 1)
        if isinstance(got, (int, float)) and abs(got - simple) < 1e-6 and costs[k + 1] != costs[1]:
            hint += ": that assumes verification costs one 1-token forward; use target_ms[K + 1]"
        k_plus_1_drafts = want * (k * draft_ms + costs[k + 1]) / ((k + 1) * draft_ms + costs[k + 1])
        if isinstance(got, (int, float)) and abs(got - k_plus_1_drafts) < 1e-6 and abs(got - want) > 1e-6:
            hint += ": the draft runs K times per round, not K + 1"
        require(isinstance(got, (int, float)) and abs(got - want) < 1e-6, name, hint)
    passed(name, "tokens per round x cost of a plain step / (K draft forwards + one (K+1)-wide target forward)")


def check_greedy_accept(fn: Callable) -> None:
    """fn(target_logits (K+1, V), draft (K,)) -> (accepted count, next token)."""
    name = "greedy verification"
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 11, generator=g)
    best = logits.argmax(-1)
    other = (best + 1) % 11
    cases = [
        (best[:4], 4, int(best[4])),
        (torch.stack([best[0], other[1], best[2], best[3]]), 1, int(best[1])),
        (other[:4], 0, int(best[0])),
        (torch.stack([best[0], best[1], best[2], other[3]]), 3, int(best[3])),
    ]
    for draft, n, token in cases:
        got = fn(logits.clone(), draft.clone())
        require(isinstance(got, tuple) and len(got) == 2, name, f"return (accepted count, next token), got {got!r}")
        hint = f"draft {draft.tolist()}, target argmax {best.tolist()}: expected ({n}, {token}), got {got}"
        if int(got[0]) == int((draft == best[:4]).sum()) != n:
            hint += ": you counted every match; stop at the first mismatch"
        elif int(got[0]) == n and int(got[1]) != token:
            hint += ": the next token is the target's argmax at the first rejected position (or after the last)"
        require((int(got[0]), int(got[1])) == (n, token), name, hint)
    passed(name, "keeps proposals up to the first disagreement, then takes the target's own token")


def check_accept_step(fn: Callable) -> None:
    """fn(p (K+1, V), q (K, V), draft (K,), generator) -> (accepted count, next token)."""
    name = "accept / resample step"
    p = torch.tensor([[0.1, 0.6, 0.3, 0.0], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0.5, 0.2, 0.1, 0.2]])
    g = torch.Generator().manual_seed(0)
    n_draws, counts, accepted = 12_000, torch.zeros(4), 0
    for draft in torch.multinomial(q[0], n_draws, replacement=True, generator=g):
        n, token = fn(p, q, draft[None], g)
        require(n in (0, 1), name, f"with K=1 the accepted count is 0 or 1, got {n!r}")
        counts[int(draft) if n == 1 else int(token)] += 1
        accepted += n
    freq = counts / n_draws
    a = float(torch.minimum(p[0], q[0]).sum())
    require(
        abs(accepted / n_draws - a) < 0.02,
        name,
        f"accepted {accepted / n_draws:.3f} of proposals; the rule "
        f"accepts x with probability min(1, p(x) / q(x)), {a:.2f} on average here",
    )
    hint = f"the first token's frequencies {[round(float(f), 3) for f in freq]} should match p {p[0].tolist()}"
    if freq[3] > 0.01:
        hint += ": a token the target gives probability 0 came out; after a rejection draw from max(0, p - q)"
    elif freq[0] > 0.12:
        hint += ": too much mass on a token the draft over-proposes; resample from the residual max(0, p - q), not p"
    require(close(freq, p[0], atol=0.02), name, hint)
    same = [fn(p, p[:1], torch.tensor([t]), g)[0] for t in (0, 1, 2)]
    require(same == [1, 1, 1], name, "when q equals p every proposal must be accepted")
    passed(name, f"output distributed as the target's p over {n_draws} draws, acceptance sum min(p, q) = {a:.2f}")


def check_ngram_lookup(fn: Callable) -> None:
    """fn(tokens, k, max_ngram) -> up to k tokens that followed the latest match of the longest n-gram."""
    name = "n-gram lookup"
    cases = [
        ([1, 2, 3, 9, 2, 3, 7, 8, 5, 2, 3], 2, 2),
        ([4, 1, 2, 3, 6, 2, 3, 5, 1, 2, 3], 3, 3),
        ([1, 2, 3, 4], 3, 3),
        ([5, 6, 5], 4, 1),
        ([7, 1, 7, 2, 7, 3, 7], 1, 2),
        ([3, 3, 3, 3], 2, 3),
    ]
    g = torch.Generator().manual_seed(3)
    cases += [(torch.randint(0, 5, (40,), generator=g).tolist(), 4, 3) for _ in range(20)]
    for tokens, k, n in cases:
        want = lookup_continuation(tokens, k, n)
        got = fn(list(tokens), k, n)
        got = list(got) if got is not None else None
        hint = f"tokens {tokens}, k={k}, max_ngram={n}: expected {want}, got {got}"
        t = list(tokens)
        first = next((t[i + 1 : i + 1 + k] for i in range(len(t) - 1) if t[i] == t[-1]), [])
        if n == 1 and got == first and first != want:
            hint += ": take the latest earlier occurrence, not the first"
        elif want and got and len(got) > k:
            hint += ": propose at most k tokens"
        elif not want and got:
            hint += ": the match must be earlier than the last n tokens themselves"
        else:
            hint += ": try the longest n-gram first (n = max_ngram down to 1), and its latest earlier match"
        require(got == want, name, hint)
    passed(name, "longest n-gram first, its latest earlier occurrence, up to k tokens after it")


def check_copyable_fraction(fn: Callable) -> None:
    """fn(prompt, output, n) -> share of output tokens whose n preceding tokens + itself occurred before."""
    name = "copyable share of an output"
    g = torch.Generator().manual_seed(4)
    cases = [
        ([1, 2, 3, 4, 5], [1, 2, 3, 4], 2),
        ([1, 2, 3, 4, 5], [6, 7, 8], 2),
        ([9, 8, 7], [9, 8, 7, 9, 8, 7], 2),
        ([1, 2, 3], [4, 1, 2, 3], 1),
    ]
    cases += [
        (torch.randint(0, 4, (30,), generator=g).tolist(), torch.randint(0, 4, (20,), generator=g).tolist(), 3)
        for _ in range(10)
    ]
    for prompt, output, n in cases:
        want, got = copyable_fraction(prompt, output, n), fn(list(prompt), list(output), n)
        hint = f"prompt {prompt}, output {output}, n={n}: expected {want:.4f}, got {got!r}"
        if isinstance(got, (int, float)) and abs(got - want) > 1e-9 and n == 2 and output == [9, 8, 7, 9, 8, 7]:
            hint += ": count matches in the output so far too, not only in the prompt"
        else:
            hint += (
                ": token i counts when (n tokens before it, itself) appeared earlier in prompt + output[:i]; "
                "the n tokens before it may reach back into the prompt"
            )
        require(isinstance(got, (int, float)) and abs(got - want) < 1e-9, name, hint)
    passed(name, "the share of output tokens an n-gram lookup could have copied from what came before")


def check_prompt_lookup_loop(fn: Callable, model, prompt: list[int], n: int = 24) -> None:
    """fn(model, prompt, n) -> n greedy tokens, made with fewer forwards than tokens on a copy prompt."""
    name = "prompt-lookup decoding loop"
    calls = []

    class Counting(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner, self.config = model, model.config

        def forward(self, *args, **kwargs):
            calls.append(1)
            return self.inner(*args, **kwargs)

    want = generate(model, prompt, n, eos_token_id=None).tokens[0].tolist()
    got = fn(Counting(), list(prompt), n)
    got = got.tolist() if hasattr(got, "tolist") else list(got)
    require(len(got) == n, name, f"return exactly the {n} new tokens, got {len(got)}")
    mismatch = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    require(
        mismatch is None,
        name,
        f"token {mismatch} differs from greedy decoding: keep proposals only while they "
        "equal the model's argmax, then append the model's own token at the first mismatch",
    )
    require(
        len(calls) < n,
        name,
        f"{len(calls)} forwards for {n} tokens: verify all proposals in one forward and keep every accepted one",
    )
    passed(name, f"greedy's {n} tokens in {len(calls)} forwards")
