"""Speculative decoding: a cheap drafter proposes K tokens, the target checks them in one forward.

The target runs once over its last token and the K proposals (K+1 positions, with its KV cache)
and so scores every proposal at once. Proposals are accepted left to right with the rejection
rule of Leviathan et al. (2023), "Fast Inference from Transformers via Speculative Decoding",
and Chen et al. (2023), "Accelerating Large Language Model Decoding with Speculative Sampling":

- accept proposal x (drawn from the draft's q) with probability min(1, p(x) / q(x));
- at the first rejection, draw the token instead from the residual max(0, p - q), normalized;
- when all K are accepted, draw a bonus token from the target's next distribution.

The tokens then follow the target's distribution p exactly, whatever the drafter (lossless).
p and q are the distributions the sampler would draw from (temperature, top-k, top-p applied);
greedy decoding makes both one-hot, and the same rule then accepts exactly on argmax agreement.
Rejected positions are rolled back with ``KVCache.truncate``.

Two drafters share that verification:

- ``DraftModelDrafter``: a small model with its own KV cache, run K times per round.
- ``PromptLookupDrafter``: no model at all. The last n tokens are looked up in the prompt and
  the text so far, and the tokens that followed their latest earlier occurrence are proposed
  (prompt-lookup decoding, Saxena 2023; inference with reference, Yang et al. 2023). It wins
  where the output copies its input: code edits, quoting a document, summaries.

Batch size 1 only: rows of a batch accept different numbers of tokens.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from ..core.cache import KVCache
from ..core.device import synchronize
from ..core.generate import check_request, resolve_eos
from ..core.model import Transformer
from ..core.sampling import SamplingParams, probabilities


@dataclass
class DecodingStats:
    """What a draft-and-verify decoder did: how much the target accepted, and at what cost."""

    k: int  # proposals per round, at most
    reached: list[int] = field(default_factory=list)  # per draft position: rounds that got to check it
    accepted: list[int] = field(default_factory=list)  # per draft position: rounds that accepted it
    target_forwards: int = 0  # forwards of the target; the first also prefills the prompt, as in generate
    draft_forwards: int = 0  # forwards of a draft model, if any
    new_tokens: int = 0

    def __post_init__(self) -> None:
        self.reached = self.reached or [0] * self.k
        self.accepted = self.accepted or [0] * self.k

    def record(self, proposed: int, n_accepted: int, emitted: int) -> None:
        """One verification: ``proposed`` tokens checked left to right, the first ``n_accepted`` kept."""
        for i in range(min(proposed, n_accepted + 1)):
            self.reached[i] += 1
        for i in range(n_accepted):
            self.accepted[i] += 1
        self.target_forwards += 1
        self.new_tokens += emitted

    @property
    def acceptance_rates(self) -> list[float]:
        """Per draft position i: P(accept i | all before i accepted); nan where never reached."""
        return [a / r if r else float("nan") for a, r in zip(self.accepted, self.reached)]

    @property
    def mean_accepted_length(self) -> float:
        """Proposed tokens accepted per verification (0 to K; the target's own token not counted)."""
        return sum(self.accepted) / self.target_forwards if self.target_forwards else float("nan")

    @property
    def tokens_per_target_forward(self) -> float:
        """New tokens per verification forward: 1 for plain decoding, up to K + 1 here."""
        return self.new_tokens / self.target_forwards if self.target_forwards else float("nan")

    def as_dict(self) -> dict:
        return {"k": self.k, "acceptance_rates": self.acceptance_rates,
                "mean_accepted_length": self.mean_accepted_length,
                "tokens_per_target_forward": self.tokens_per_target_forward,
                "target_forwards": self.target_forwards, "draft_forwards": self.draft_forwards,
                "new_tokens": self.new_tokens}  # fmt: skip


@dataclass
class DecodingResult:
    tokens: Tensor  # (1, N) the new token ids, EOS included if one was made
    stats: DecodingStats
    seconds: float  # wall time of the whole call, prefill included

    @property
    def tokens_per_s(self) -> float:
        return self.tokens.shape[1] / self.seconds


# ---------------------------------------------------------------------------------------------
# The acceptance rule


def residual_distribution(p: Tensor, q: Tensor) -> Tensor:
    """norm(max(0, p - q)) (V,): where the target wants more mass than the draft gave."""
    residual = (p - q).clamp(min=0)
    total = residual.sum()
    return residual / total if total > 0 else p  # p == q exactly: a rejection cannot happen


def draw(dist: Tensor, generator: torch.Generator | None = None) -> int:
    """One token from a distribution (V,) by inverting its CDF: the same law as torch.multinomial,
    several times cheaper for a single draw (and this loop draws one at a time)."""
    cdf = dist.cumsum(-1)  # (V,)
    u = torch.rand(1, generator=generator, device=dist.device) * cdf[-1]
    return min(int(torch.searchsorted(cdf, u, right=True)), dist.shape[-1] - 1)


def accept_draft_tokens(
    p: Tensor, q: Tensor, draft: Tensor, generator: torch.Generator | None = None
) -> tuple[int, int]:
    """Speculative sampling's rule: -> (how many proposals to keep, the token that follows them).

    p (K+1, V): the target's distributions at the K proposals and after them; q (K, V): the
    draft's distributions the proposals ``draft`` (K,) were drawn from.
    """
    K = draft.shape[0]
    idx = torch.arange(K, device=p.device)
    ratio = p[idx, draft] / q[idx, draft]  # (K,) q > 0 where a proposal was drawn
    u = torch.rand(K, generator=generator, device=p.device)
    rejected = (u >= ratio).nonzero()  # accept with probability min(1, p / q)
    n = int(rejected[0]) if len(rejected) else K
    dist = p[K] if n == K else residual_distribution(p[n], q[n])
    return n, draw(dist, generator)


def expected_tokens_per_forward(alpha: float, k: int) -> float:
    """(1 - alpha^(k+1)) / (1 - alpha): tokens per target forward when each proposal is accepted
    independently with probability alpha (Leviathan et al. 2023, eq. 1); k + 1 when alpha = 1."""
    if not 0 <= alpha <= 1:
        raise ValueError(f"alpha must be a probability, got {alpha!r}")
    return float(k + 1) if alpha == 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


def expected_speedup(alpha: float, k: int, cost_ratio: float) -> float:
    """Expected speedup over plain decoding when a draft forward costs ``cost_ratio`` target forwards
    and verifying k + 1 tokens costs one: tokens per forward / (k * cost_ratio + 1) (their theorem 3.8)."""
    return expected_tokens_per_forward(alpha, k) / (k * cost_ratio + 1)


# ---------------------------------------------------------------------------------------------
# Drafters


class Drafter(Protocol):
    """Proposes up to k tokens after ``tokens``, with the distributions (k, V) they were drawn
    from, or None when the proposal is deterministic (then q is one-hot on it)."""

    forwards: int

    def propose(self, tokens: list[int], k: int) -> tuple[list[int], Tensor | None]: ...


class DraftModelDrafter:
    """A small model that samples K tokens with the same sampling parameters as the target."""

    def __init__(self, draft: Transformer, params: SamplingParams, max_len: int, generator=None):
        self.model, self.params, self.generator = draft, params, generator
        self.cache = KVCache.for_model(draft, 1, max_len)
        self.fed: list[int] = []  # the tokens whose keys and values are in the cache
        self.forwards = 0

    def _step(self, ids: list[int]) -> Tensor:
        self.forwards += 1
        self.fed += ids
        logits = self.model(torch.tensor([ids], device=self.model.device), cache=self.cache, last_only=True)
        return probabilities(logits[0, -1], self.params)  # (V,)

    def propose(self, tokens: list[int], k: int) -> tuple[list[int], Tensor | None]:
        if k == 0:
            return [], None
        keep = common_prefix(self.fed, tokens[:-1])  # roll back what the target rejected
        self.cache.truncate(keep)
        del self.fed[keep:]
        q = self._step(tokens[keep:])
        draft, qs = [], []
        for i in range(k):
            draft.append(draw(q, self.generator))
            qs.append(q)
            if i + 1 < k:
                q = self._step(draft[-1:])
        return draft, torch.stack(qs)  # (k,), (k, V)


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
    """Up to k tokens that followed the latest earlier match of the last n tokens (longest n first)."""
    t = torch.as_tensor(tokens)
    for n in range(min(max_ngram, len(t) - 1), min_ngram - 1, -1):
        windows = t[:-1].unfold(0, n, 1)  # (L-n, n): every n-gram that has a token after it
        hits = (windows == t[-n:]).all(dim=1).nonzero()
        if len(hits):
            start = int(hits[-1]) + n
            return t[start : start + k].tolist()
    return []


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


# ---------------------------------------------------------------------------------------------
# The loop


def check_k(k: int) -> None:
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"k (tokens proposed per round) must be a positive integer, got {k!r}")


def single_prompt(input_ids) -> list[int]:
    """A prompt as a list of ids; batch size 1 only: rows of a batch would accept different counts."""
    if isinstance(input_ids, Tensor):
        if input_ids.dim() == 2 and input_ids.shape[0] != 1:
            raise ValueError(f"these decoders take batch size 1, got input_ids of shape {tuple(input_ids.shape)}")
        return input_ids.flatten().tolist()
    if len(input_ids) and not isinstance(input_ids[0], int):
        if len(input_ids) != 1:
            raise ValueError(f"these decoders take batch size 1, got {len(input_ids)} prompts")
        return list(input_ids[0])
    return list(input_ids)


@torch.inference_mode()
def draft_and_verify(target: Transformer, drafter: Drafter, prompt: list[int], max_new_tokens: int, k: int,
                     params: SamplingParams, eos_token_id="config") -> DecodingResult:  # fmt: skip
    """The speculative loop around any drafter; the target keeps all tokens but the last cached."""
    check_request([prompt], max_new_tokens, target.config)
    eos, generator = set(resolve_eos(eos_token_id, target.config)), params.generator(target.device)
    stats = DecodingStats(k)
    synchronize(target.device)
    t0 = time.perf_counter()
    cache = KVCache.for_model(target, 1, len(prompt) + max_new_tokens + k)
    tokens = list(prompt)
    while stats.new_tokens < max_new_tokens:
        draft, q = drafter.propose(tokens, min(k, max_new_tokens - stats.new_tokens - 1))
        feed = torch.tensor([tokens[cache.length :] + draft], device=target.device)  # the last token + proposals
        p = probabilities(target(feed, cache=cache)[0, -len(draft) - 1 :], params)  # (len(draft)+1, V)
        drafted = torch.tensor(draft, dtype=torch.long, device=p.device)
        q = F.one_hot(drafted, p.shape[-1]).float() if q is None else q
        n, token = accept_draft_tokens(p, q, drafted, generator)
        cache.truncate(cache.length - (len(draft) - n))
        emitted = stop_at_eos(draft[:n] + [token], eos)
        tokens += emitted
        stats.record(len(draft), n, len(emitted))
        if emitted[-1] in eos:
            break
    stats.draft_forwards = drafter.forwards
    synchronize(target.device)
    new = torch.tensor([tokens[len(prompt) :]], dtype=torch.long)
    return DecodingResult(new, stats, time.perf_counter() - t0)


def stop_at_eos(tokens: list[int], eos: set[int]) -> list[int]:
    return next((tokens[: i + 1] for i, t in enumerate(tokens) if t in eos), tokens)


def speculative_generate(target: Transformer, draft: Transformer, input_ids, max_new_tokens: int, k: int = 4,
                         temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
                         seed: int | None = None, eos_token_id="config") -> DecodingResult:  # fmt: skip
    """Speculative decoding with a draft model: K proposals per round, verified by ``target``.

    The tokens follow the target's own distribution (greedy: exactly ``generate``'s tokens).
    The two models must share a tokenizer (the same vocabulary). Batch size 1.
    """
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(f"draft and target must share a vocabulary, got {draft.config.vocab_size} "
                         f"and {target.config.vocab_size} tokens")  # fmt: skip
    check_k(k)
    params = SamplingParams(temperature, top_k, top_p, seed)
    prompt = single_prompt(input_ids)
    draft_params = SamplingParams(temperature, top_k, top_p, None if seed is None else seed + 1)  # its own stream
    drafter = DraftModelDrafter(draft, params, len(prompt) + max_new_tokens + k, draft_params.generator(draft.device))
    return draft_and_verify(target, drafter, prompt, max_new_tokens, k, params, eos_token_id)


def prompt_lookup_generate(model: Transformer, input_ids, max_new_tokens: int, k: int = 8, max_ngram: int = 3,
                           min_ngram: int = 1, temperature: float = 0.0, top_k: int | None = None,
                           top_p: float | None = None, seed: int | None = None,
                           eos_token_id="config") -> DecodingResult:  # fmt: skip
    """Prompt-lookup decoding: proposals copied from the prompt and the text so far, verified
    exactly as speculative decoding's (a deterministic proposal has q one-hot). Batch size 1."""
    check_k(k)
    params = SamplingParams(temperature, top_k, top_p, seed)
    drafter = PromptLookupDrafter(max_ngram, min_ngram)
    return draft_and_verify(model, drafter, single_prompt(input_ids), max_new_tokens, k, params, eos_token_id)


# ---------------------------------------------------------------------------------------------
# What to expect: acceptance from distributions, speedup from measured costs, overlap of a copy


def acceptance_probability(p: Tensor, q: Tensor) -> Tensor:
    """sum_x min(p(x), q(x)) over the last dimension: the chance the rule accepts a proposal
    drawn from q when the target wants p (1 - their total-variation distance)."""
    return torch.minimum(p, q).sum(-1)


def predicted_speedup(alpha: float, k: int, draft_ms: float, target_ms: dict[int, float]) -> float:
    """``expected_speedup`` with measured costs: a round is k draft forwards of one token plus one
    target forward of k + 1 tokens (``target_ms[k + 1]``), plain decoding one of one (``target_ms[1]``)."""
    if 1 not in target_ms or k + 1 not in target_ms:
        raise ValueError(f"need the target's cost at widths 1 and {k + 1}, got widths {sorted(target_ms)}")
    return expected_tokens_per_forward(alpha, k) * target_ms[1] / (k * draft_ms + target_ms[k + 1])


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
