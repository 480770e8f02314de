"""Chapters 7 and 8's checkers accept the right answers and reject plausible wrong ones."""

import pytest
import torch

from minillm.book.checks import CheckFailed
from minillm.book.checks.speculative import (
    check_accept_step,
    check_copyable_fraction,
    check_expected_tokens,
    check_greedy_accept,
    check_ngram_lookup,
    check_prompt_lookup_loop,
    check_speedup_with_costs,
)
from minillm.decoding.prompt_lookup import copyable_fraction, lookup_continuation
from minillm.decoding.speculative import accept_draft_tokens, expected_tokens_per_forward, predicted_speedup
from tests.conftest import tiny_model


def stub(*args):
    raise NotImplementedError


def test_expected_tokens_checker():
    check_expected_tokens(expected_tokens_per_forward)
    with pytest.raises(CheckFailed, match="off by one"):
        check_expected_tokens(lambda a, k: expected_tokens_per_forward(a, k) - 1)
    with pytest.raises(CheckFailed, match="K \\+ 1 terms"):
        check_expected_tokens(lambda a, k: (1 - a**k) / (1 - a) if a < 1 else k + 1.0)
    with pytest.raises((CheckFailed, ZeroDivisionError)):
        check_expected_tokens(lambda a, k: (1 - a ** (k + 1)) / (1 - a))
    with pytest.raises(NotImplementedError):
        check_expected_tokens(stub)


def test_speedup_with_costs_checker():
    check_speedup_with_costs(predicted_speedup)
    with pytest.raises(CheckFailed, match="target_ms\\[K \\+ 1\\]"):
        check_speedup_with_costs(lambda a, k, d, t: expected_tokens_per_forward(a, k) / (k * d / t[1] + 1))
    with pytest.raises(CheckFailed, match="K times"):
        check_speedup_with_costs(lambda a, k, d, t: expected_tokens_per_forward(a, k) * t[1] / ((k + 1) * d + t[k + 1]))
    with pytest.raises(NotImplementedError):
        check_speedup_with_costs(stub)


def test_greedy_accept_checker():
    def right(logits, draft):
        best = logits.argmax(-1)
        n = 0
        while n < len(draft) and draft[n] == best[n]:
            n += 1
        return n, int(best[n])

    def counts_all_matches(logits, draft):
        best = logits.argmax(-1)
        n = int((draft == best[: len(draft)]).sum())
        return n, int(best[n])

    check_greedy_accept(right)
    with pytest.raises(CheckFailed, match="first mismatch"):
        check_greedy_accept(counts_all_matches)
    with pytest.raises(CheckFailed, match="next token"):
        check_greedy_accept(lambda logits, draft: (right(logits, draft)[0], int(logits[-1].argmax())))
    with pytest.raises(NotImplementedError):
        check_greedy_accept(stub)


def test_accept_step_checker():
    check_accept_step(accept_draft_tokens)

    def resample_from_p(p, q, draft, g):
        for i, x in enumerate(draft.tolist()):
            if torch.rand(1, generator=g).item() >= p[i, x] / q[i, x]:
                return i, int(torch.multinomial(p[i], 1, generator=g))
        return len(draft), int(torch.multinomial(p[len(draft)], 1, generator=g))

    def accept_if_likelier(p, q, draft, g):
        for i, x in enumerate(draft.tolist()):
            if p[i, x] < q[i, x]:
                residual = (p[i] - q[i]).clamp(min=0)
                return i, int(torch.multinomial(residual / residual.sum(), 1, generator=g))
        return len(draft), int(torch.multinomial(p[len(draft)], 1, generator=g))

    with pytest.raises(CheckFailed, match="residual"):
        check_accept_step(resample_from_p)
    with pytest.raises(CheckFailed, match="accepted|residual"):
        check_accept_step(accept_if_likelier)
    with pytest.raises(NotImplementedError):
        check_accept_step(stub)


def test_ngram_lookup_checker():
    check_ngram_lookup(lookup_continuation)

    def first_match(tokens, k, n):
        for m in range(min(n, len(tokens) - 1), 0, -1):
            tail = tokens[-m:]
            for s in range(len(tokens) - m):
                if tokens[s : s + m] == tail:
                    return tokens[s + m : s + m + k]
        return []

    def shortest_first(tokens, k, n):
        for m in range(1, min(n, len(tokens) - 1) + 1):
            got = lookup_continuation(tokens, k, m, min_ngram=m)
            if got:
                return got
        return []

    with pytest.raises(CheckFailed, match="latest"):
        check_ngram_lookup(first_match)
    with pytest.raises(CheckFailed, match="longest"):
        check_ngram_lookup(shortest_first)
    with pytest.raises(NotImplementedError):
        check_ngram_lookup(stub)


def test_copyable_fraction_checker():
    check_copyable_fraction(copyable_fraction)

    def prompt_only(prompt, output, n):
        grams = {tuple(prompt[i - n : i + 1]) for i in range(n, len(prompt))}
        tokens = prompt + output
        hits = sum(tuple(tokens[i - n : i + 1]) in grams for i in range(len(prompt), len(tokens)))
        return hits / len(output)

    with pytest.raises(CheckFailed, match="output so far"):
        check_copyable_fraction(prompt_only)
    with pytest.raises(CheckFailed, match="earlier"):
        check_copyable_fraction(lambda p, o, n: copyable_fraction(p, o, n + 1))
    with pytest.raises(NotImplementedError):
        check_copyable_fraction(stub)


@torch.inference_mode()
def test_prompt_lookup_loop_checker():
    model = tiny_model()
    prompt = list(range(10, 30)) * 2

    def loop(model, prompt, n, k=8):
        tokens = list(prompt)
        while len(tokens) - len(prompt) < n:
            proposal = lookup_continuation(tokens, min(k, n - (len(tokens) - len(prompt)) - 1), 3)
            best = model(torch.tensor([tokens + proposal]))[0, len(tokens) - 1 :].argmax(-1).tolist()
            a = 0
            while a < len(proposal) and proposal[a] == best[a]:
                a += 1
            tokens += proposal[:a] + [best[a]]
        return tokens[len(prompt) :]

    def one_at_a_time(model, prompt, n):
        tokens = list(prompt)
        for _ in range(n):
            tokens.append(int(model(torch.tensor([tokens]))[0, -1].argmax()))
        return tokens[len(prompt) :]

    greedy = one_at_a_time(model, prompt, 24)
    copy_prompt = prompt + greedy + prompt  # the answer is in the prompt: lookups succeed
    check_prompt_lookup_loop(loop, model, copy_prompt, n=24)
    with pytest.raises(CheckFailed, match="forwards"):
        check_prompt_lookup_loop(one_at_a_time, model, copy_prompt, n=24)
    with pytest.raises(CheckFailed, match="differs"):
        check_prompt_lookup_loop(lambda m, p, n: [0] * n, model, copy_prompt, n=24)
    with pytest.raises(NotImplementedError):
        check_prompt_lookup_loop(stub, model, copy_prompt, n=24)
