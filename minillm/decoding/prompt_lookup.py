"""Prompt-lookup decoding (chapter 8): speculative decoding whose drafter is no model at all.

The last n tokens are looked up in the prompt and the text so far, and the tokens that followed
their latest earlier occurrence are proposed (prompt-lookup decoding, Saxena 2023; inference
with reference, Yang et al. 2023, "Inference with Reference: Lossless Acceleration of Large
Language Models"). The target verifies them exactly as speculative decoding's proposals (a
deterministic proposal has q one-hot), so the output is the target's own. It wins where the
output copies its input: code edits, quoting a document, summaries. ``copyable_fraction`` says
how much of an output a lookup could have copied. Batch size 1.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..core.model import Transformer
from ..core.sampling import SamplingParams
from .common import DecodingResult, check_k, single_prompt
from .speculative import GREEDY, draft_and_verify


class PromptLookupDrafter:
    """Proposes what followed the latest earlier occurrence of the last n tokens (n from
    ``max_ngram`` down to ``min_ngram``) in the prompt and the text so far; nothing if none."""

    forwards = 0

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram} and {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, tokens: list[int], k: int) -> tuple[list[int], None]:
        return lookup_continuation(tokens, k, self.max_ngram, self.min_ngram), None


def lookup_continuation(tokens: Sequence[int], k: int, max_ngram: int, min_ngram: int = 1) -> list[int]:
    """Up to k tokens that followed the latest earlier match of the last n tokens
    (longest n first)."""
    t = torch.as_tensor(tokens)
    for n in range(min(max_ngram, len(t) - 1), min_ngram - 1, -1):
        windows = t[:-1].unfold(0, n, 1)  # (L-n, n): every n-gram that has a token after it
        hits = (windows == t[-n:]).all(dim=1).nonzero()
        if len(hits):
            start = int(hits[-1]) + n
            return t[start : start + k].tolist()
    return []


def prompt_lookup_generate(
    model: Transformer,
    input_ids,
    max_new_tokens: int,
    k: int = 8,
    max_ngram: int = 3,
    min_ngram: int = 1,
    sampling: SamplingParams = GREEDY,
    eos_token_id="config",
    compile: bool = False,
) -> DecodingResult:
    """Prompt-lookup decoding: proposals copied from the prompt and the text so far, verified
    exactly as speculative decoding's (a deterministic proposal has q one-hot). Batch size 1.
    ``compile=True`` verifies through one compiled graph of K + 1 tokens."""
    check_k(k)
    drafter = PromptLookupDrafter(max_ngram, min_ngram)
    prompt = single_prompt(input_ids)
    return draft_and_verify(model, drafter, prompt, max_new_tokens, k, sampling, eos_token_id, compile)


def copyable_fraction(prompt: Sequence[int], output: Sequence[int], n: int = 3) -> float:
    """The share of ``output``'s tokens that an n-gram lookup could have copied: the n tokens
    before it, followed by it, appear earlier in the prompt or the output so far."""
    if n < 1:
        raise ValueError(f"n must be positive, got {n}")
    tokens, seen, hits = list(prompt) + list(output), set(), 0
    for i in range(len(tokens)):
        gram = tuple(tokens[i - n : i + 1]) if i >= n else None
        if i >= len(prompt) and gram in seen:
            hits += 1
        if gram is not None:
            seen.add(gram)
    return hits / len(output) if len(output) else float("nan")
