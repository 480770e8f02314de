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

Here: the rule, the loop around any ``Drafter`` (``draft_and_verify``), the draft-model drafter
(``speculative_generate``), the acceptance a draft model would get on a real text, read from one
forward of each model (``teacher_forced_acceptance``), and what to expect from an acceptance rate
alpha (tokens per forward, speedup). The drafter without a model, prompt lookup, is in ``prompt_lookup``.

Batch size 1 only: rows of a batch accept different numbers of tokens.
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import Tensor

from ..core.compiled import cached_forward
from ..core.device import synchronize
from ..core.generate import check_request, resolve_eos
from ..core.model import Transformer
from ..core.sampling import SamplingParams, probabilities
from .common import (
    DecodingResult,
    DecodingStats,
    Drafter,
    check_k,
    common_prefix,
    forward_seconds,
    modeled_speedup,
    single_prompt,
    stop_at_eos,
    warm_up,
)

GREEDY = SamplingParams()

# ---------------------------------------------------------------------------------------------
# The acceptance rule


def residual_distribution(p: Tensor, q: Tensor) -> Tensor:
    """norm(max(0, p - q)) (V,): where the target wants more mass than the draft
    gave."""
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
    """Speculative sampling's rule: -> (how many proposals to keep, the token that
    follows them).

    p (K+1, V): the target's distributions at the K proposals and after them;
    q (K, V): the draft's distributions the proposals ``draft`` (K,) were drawn from.
    """
    K = draft.shape[0]
    idx = torch.arange(K, device=p.device)
    ratio = p[idx, draft] / q[idx, draft]  # (K,) q > 0 where a proposal was drawn
    u = torch.rand(K, generator=generator, device=p.device)
    rejected = (u >= ratio).nonzero()  # accept with probability min(1, p / q)
    n = int(rejected[0]) if len(rejected) else K
    dist = p[K] if n == K else residual_distribution(p[n], q[n])
    return n, draw(dist, generator)


# ---------------------------------------------------------------------------------------------
# The draft model


class DraftModelDrafter:
    """A small model that samples K tokens with the same sampling parameters as the target.
    Greedy, its proposals are its argmaxes, deterministic (no distributions kept: q is None)."""

    def __init__(self, draft: Transformer, params: SamplingParams, max_len: int, generator=None, compile=False):
        self.model, self.params, self.generator = draft, params, generator
        self.fwd = cached_forward(draft, 1, max_len, compile, widths=(1, 2), role="draft")  # catch-up: 1 or 2
        self.fed: list[int] = []  # the tokens whose keys and values are in the cache
        self.forwards = 0

    def warmup(self) -> float:
        return sum(self.fwd.warmup(width) for width in (1, 2))

    def _step(self, ids: list[int]) -> Tensor:
        self.forwards += 1
        self.fed += ids
        return self.fwd(torch.tensor([ids], device=self.model.device), last_only=True)[0, -1]  # (V,)

    def propose(self, tokens: list[int], k: int) -> tuple[list[int], Tensor | None]:
        if k == 0:
            return [], None
        keep = common_prefix(self.fed, tokens[:-1])  # roll back what the target rejected
        self.fwd.truncate(keep)
        del self.fed[keep:]
        logits = self._step(tokens[keep:])
        if self.params.greedy:  # argmaxes only: no distribution over the vocabulary is built
            draft = [int(logits.argmax())]
            for _ in range(k - 1):
                draft.append(int(self._step(draft[-1:]).argmax()))
            return draft, None
        draft, qs = [], []
        for i in range(k):
            q = probabilities(logits, self.params)  # (V,)
            draft.append(draw(q, self.generator))
            qs.append(q)
            if i + 1 < k:
                logits = self._step(draft[-1:])
        return draft, torch.stack(qs)  # (k,), (k, V)


def greedy_accept(logits: Tensor, draft: Tensor) -> tuple[int, int]:
    """The rule when both sides are greedy, as one comparison: logits (K+1, V) of the
    target at the K proposals ``draft`` (K,) and after them -> (proposals kept: the
    leading ones that equal the target's argmax, the target's argmax after them).
    ``accept_draft_tokens`` on one-hot p and q gives the same (the tests check it)."""
    best = logits.argmax(-1)  # (K+1,)
    n = int((best[: draft.shape[0]] != draft).cumsum(0).eq(0).sum())
    return n, int(best[n])


# ---------------------------------------------------------------------------------------------
# The loop


@torch.inference_mode()
def draft_and_verify(
    target: Transformer,
    drafter: Drafter,
    prompt: list[int],
    max_new_tokens: int,
    k: int,
    params: SamplingParams,
    eos_token_id="config",
    compile: bool = False,
) -> DecodingResult:
    """The speculative loop around any drafter; the target keeps all tokens but the last cached.

    Greedy, acceptance is ``greedy_accept`` on the logits (no distributions); otherwise the
    rejection rule on p and q. ``compile=True`` verifies through one compiled graph of width
    K + 1 (proposals padded to K, the padding never accepted), compiled before the timer starts.
    """
    check_request([prompt], max_new_tokens, target.config)
    eos, generator = set(resolve_eos(eos_token_id, target.config)), params.generator(target.device)
    stats = DecodingStats(k)
    fwd = cached_forward(target, 1, len(prompt) + max_new_tokens + k + 1, compile, widths=(k + 1,))
    compile_time = warm_up([fwd, getattr(drafter, "fwd", None)], [k + 1], drafter)
    synchronize(target.device)
    t0 = time.perf_counter()
    tokens = list(prompt)
    while stats.new_tokens < max_new_tokens:
        draft, q = drafter.propose(tokens, min(k, max_new_tokens - stats.new_tokens - 1))
        fresh = tokens[fwd.length :]  # the last token (the whole prompt at first)
        pad = [0] * (k - len(draft)) if compile and len(fresh) == 1 else []  # one width for the graph
        feed = torch.tensor([fresh + draft + pad], device=target.device)
        logits = fwd(feed)[0, len(fresh) - 1 : len(fresh) + len(draft)]  # (len(draft)+1, V)
        drafted = torch.tensor(draft, dtype=torch.long, device=logits.device)
        if params.greedy:
            n, token = greedy_accept(logits, drafted)
        else:
            p = probabilities(logits, params)
            q = F.one_hot(drafted, p.shape[-1]).float() if q is None else q
            n, token = accept_draft_tokens(p, q, drafted, generator)
        fwd.truncate(fwd.length - (len(draft) - n) - len(pad))
        emitted = stop_at_eos(draft[:n] + [token], eos)
        tokens += emitted
        stats.record(len(draft), n, len(emitted))
        if emitted[-1] in eos:
            break
    stats.draft_forwards = drafter.forwards
    synchronize(target.device)
    seconds = time.perf_counter() - t0
    new = torch.tensor([tokens[len(prompt) :]], dtype=torch.long)
    return DecodingResult(new, stats, seconds, compile_time, forward_seconds([fwd, getattr(drafter, "fwd", None)]))


def speculative_generate(
    target: Transformer,
    draft: Transformer,
    input_ids,
    max_new_tokens: int,
    k: int = 4,
    sampling: SamplingParams = GREEDY,
    eos_token_id="config",
    compile: bool = False,
) -> DecodingResult:
    """Speculative decoding with a draft model: K proposals per round, verified by ``target``.

    The tokens follow the target's own distribution under ``sampling`` (greedy by default: exactly
    ``generate``'s tokens). The two models must share a tokenizer (the same vocabulary). Batch size 1.
    ``compile=True`` runs both models' forwards compiled over static caches (``core.compiled``).
    """
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(
            f"draft and target must share a vocabulary, got {draft.config.vocab_size} "
            f"and {target.config.vocab_size} tokens"
        )
    check_k(k)
    prompt = single_prompt(input_ids)
    draft_params = replace(sampling, seed=None if sampling.seed is None else sampling.seed + 1)  # its own stream
    drafter = DraftModelDrafter(
        draft, sampling, len(prompt) + max_new_tokens + k, draft_params.generator(draft.device), compile
    )
    return draft_and_verify(target, drafter, prompt, max_new_tokens, k, sampling, eos_token_id, compile)


# ---------------------------------------------------------------------------------------------
# What to expect: acceptance from distributions, tokens per forward and speedup from alpha


def acceptance_probability(p: Tensor, q: Tensor) -> Tensor:
    """sum_x min(p(x), q(x)) over the last dimension: the chance the rule accepts a proposal
    drawn from q when the target wants p (1 - their total-variation distance)."""
    return torch.minimum(p, q).sum(-1)


@torch.inference_mode()
def teacher_forced_acceptance(
    target: Transformer, draft: Transformer, ids: list[int], temperatures=(0.0, 0.25, 0.5, 0.75, 1.0, 1.5)
) -> dict[float, float]:
    """Mean chance that one draft proposal is accepted, at each temperature, over the positions of
    a real text ``ids``: sum_x min(p, q) of the two models' next-token distributions (at T = 0,
    how often their argmaxes agree). No generation needed: one forward of each model."""
    x = torch.tensor([ids], device=target.device)
    lp, lq = target(x)[0].float(), draft(x)[0].float()  # (T, V) each
    out = {}
    for temp in temperatures:
        if temp == 0:
            out[temp] = float((lp.argmax(-1) == lq.argmax(-1)).float().mean())
        else:
            params = SamplingParams(temperature=temp)
            out[temp] = float(acceptance_probability(probabilities(lp, params), probabilities(lq, params)).mean())
    return out


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


def predicted_speedup(alpha: float, k: int, draft_ms: float, target_ms: dict[int, float]) -> float:
    """``expected_speedup`` with measured costs: a round is k draft forwards of one token plus one
    target forward of k + 1 tokens (``target_ms[k + 1]``), plain decoding one of one (``target_ms[1]``);
    the cost model of ``common.modeled_speedup`` at the widths measured."""
    if 1 not in target_ms or k + 1 not in target_ms:
        raise ValueError(f"need the target's cost at widths 1 and {k + 1}, got widths {sorted(target_ms)}")
    return modeled_speedup(expected_tokens_per_forward(alpha, k), k + 1, target_ms, k, {1: draft_ms})
