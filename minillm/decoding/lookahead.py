"""Lookahead decoding: Jacobi iterations guess n-grams, and the same forward verifies earlier ones.

Fu, Bailis, Stoica & Zhang (2024), "Break the Sequential Dependency of LLM Inference Using
Lookahead Decoding". No draft model and no training. Every forward of the model carries three
groups of tokens after the last accepted token (the root):

- the lookahead branch, a 2D window of N-1 levels x W columns of guesses. Each forward is one
  Jacobi iteration: the model's argmax at each top-level token becomes the next level, the
  oldest level is dropped. Along a column the levels form a chain the model conditioned on,
  so each column plus its new guess is an n-gram (N tokens) that goes into a pool. (The
  paper draws these chains as diagonals; here the window is indexed so they are columns.)
- the verification branch: up to G n-grams from the pool that start with the root token; their
  N-1 continuations are checked as in speculative decoding, greedily.
- the root itself, whose output is the next token whatever happens.

Attention follows the chains: the token at level j, column i sees the root, level 0 up to
column i, and levels 1..j of column i, at position root + 1 + i + j; a candidate's m-th token
sees the root and its own first m tokens. One ``tree_mask`` encodes both branches, and the
cache keeps the root and the accepted candidate's tokens (``KVCache.keep_slots``).

Greedy only, and lossless: every accepted token is the model's argmax after exactly the
accepted prefix, so the output equals greedy ``generate``'s. Batch size 1.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..core.compiled import CachedForward, CompiledForward, cached_forward
from ..core.device import synchronize
from ..core.generate import check_request, resolve_eos
from ..core.model import Transformer
from .common import DecodingResult, DecodingStats, single_prompt, stop_at_eos, warm_up


@dataclass(frozen=True)
class LookaheadConfig:
    window: int = 5  # W: columns of the lookahead window (tokens guessed ahead)
    ngram: int = 4  # N: n-gram length; the window has N-1 levels, a candidate N-1 tokens
    max_candidates: int = 5  # G: n-grams verified per forward
    seed: int = 0  # for the window's first guesses (random tokens of the prompt)

    def __post_init__(self) -> None:
        for name in ("window", "max_candidates"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.ngram, int) or isinstance(self.ngram, bool) or self.ngram < 2:
            raise ValueError(f"ngram must be an integer >= 2, got {self.ngram!r}")

    @property
    def levels(self) -> int:
        return self.ngram - 1

    def tokens_per_forward(self) -> int:
        """At most: root + window + candidates."""
        return 1 + self.levels * self.window + self.max_candidates * self.levels


class NGramPool:
    """n-grams keyed by their first token; each key keeps its ``capacity`` most recent
    continuations."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.table: dict[int, OrderedDict[tuple[int, ...], None]] = {}

    def add(self, ngram: tuple[int, ...]) -> None:
        entries = self.table.setdefault(ngram[0], OrderedDict())
        entries.pop(ngram[1:], None)
        entries[ngram[1:]] = None  # the most recent last
        if len(entries) > self.capacity:
            entries.popitem(last=False)

    def candidates(self, token: int) -> list[tuple[int, ...]]:
        return list(reversed(self.table.get(token, {})))

    def __len__(self) -> int:
        return sum(len(v) for v in self.table.values())


def lookahead_layout(window: int, levels: int, n_candidates: int) -> tuple[Tensor, Tensor]:
    """Position offsets (T,) from the root and the attention mask (T, T) of one forward.

    Token order: root; level 0 columns 0..W-1, level 1 ..., level N-2; candidate 0's N-1 tokens, ...
    """
    W, T = window, 1 + levels * window + n_candidates * levels
    offsets, mask = torch.zeros(T, dtype=torch.long), torch.eye(T, dtype=torch.bool)
    mask[:, 0] = True  # everyone sees the root
    for j in range(levels):
        for i in range(W):
            t = 1 + j * W + i
            offsets[t] = 1 + i + j
            mask[t, 1 : 2 + i] = True  # level 0, columns 0..i
            mask[t, [1 + jj * W + i for jj in range(1, j + 1)]] = True  # levels 1..j of column i
    base = 1 + levels * W
    for c in range(n_candidates):
        for m in range(levels):
            t = base + c * levels + m
            offsets[t] = 1 + m
            mask[t, base + c * levels : t + 1] = True
    return offsets, mask


class LookaheadDecoder:
    """The window, the pool and one step: forward, verify, update the window, collect n-grams.

    ``pad`` feeds G candidates every step (the missing ones made of the root, never accepted), so
    that every forward has one width: what a compiled forward wants."""

    def __init__(
        self,
        model: Transformer,
        config: LookaheadConfig,
        prompt: list[int],
        fwd: CachedForward | CompiledForward,
        pad: bool = False,
    ):
        self.model, self.config, self.fwd, self.pad = model, config, fwd, pad
        gen = torch.Generator().manual_seed(config.seed)
        picks = torch.randint(0, len(prompt), (config.levels, config.window), generator=gen)
        self.window = torch.tensor(prompt)[picks]  # (N-1, W) guesses, level 0 the oldest
        self.pool = NGramPool(config.max_candidates)
        self.layouts: dict[int, tuple[Tensor, Tensor]] = {}

    def layout(self, n_candidates: int) -> tuple[Tensor, Tensor]:
        if n_candidates not in self.layouts:
            c = self.config
            offsets, mask = lookahead_layout(c.window, c.levels, n_candidates)
            self.layouts[n_candidates] = offsets.to(self.model.device), mask.to(self.model.device)
        return self.layouts[n_candidates]

    def step(self, root: int) -> tuple[list[int], int, int]:
        """One forward after ``root`` -> (accepted candidate tokens, the next token, tokens
        proposed)."""
        candidates = self.pool.candidates(root)
        missing = self.config.max_candidates - len(candidates) if self.pad else 0
        fed = candidates + [(root,) * self.config.levels] * missing  # the padding is never verified
        offsets, mask = self.layout(len(fed))
        cand = torch.tensor(fed, dtype=torch.long).view(-1)  # (G * (N-1),)
        tokens = torch.cat([torch.tensor([root]), self.window.view(-1), cand]).to(self.model.device)
        start = self.fwd.length
        best = self.fwd(tokens[None], (start + offsets)[None], tree_mask=mask)[0].argmax(-1)  # (T,)
        n_acc, c_best = self.verify(candidates, best)
        self.update_window(best)
        base = 1 + self.config.levels * self.config.window + c_best * self.config.levels
        keep = [start] + [start + base + m for m in range(n_acc)]
        self.fwd.keep_slots(start, keep)
        accepted = list(candidates[c_best][:n_acc]) if n_acc else []
        last = base + n_acc - 1 if n_acc else 0
        return accepted, int(best[last]), len(candidates[c_best]) if candidates else 0

    def verify(self, candidates: list[tuple[int, ...]], best: Tensor) -> tuple[int, int]:
        """(tokens accepted, which candidate): the longest prefix that matches the argmaxes,
        every candidate at once (``verify_reference`` is the same, one candidate at a
        time)."""
        if not candidates:
            return 0, 0
        L, base, G = self.config.levels, 1 + self.config.levels * self.config.window, len(candidates)
        cand = torch.tensor(candidates, dtype=torch.long, device=best.device)  # (G, L)
        expected = torch.cat([best[:1].expand(G, 1), best[base : base + G * L].view(G, L)[:, : L - 1]], dim=1)
        matched = (cand == expected).long().cumprod(1).sum(1)  # (G,) leading matches of each
        c_best = int(matched.argmax())  # the first of the longest, as the reference picks
        return int(matched[c_best]), c_best

    def verify_reference(self, candidates: list[tuple[int, ...]], best: Tensor) -> tuple[int, int]:
        """``verify`` written out: each candidate against the argmaxes it conditioned on."""
        L, base = self.config.levels, 1 + self.config.levels * self.config.window
        n_best, c_best = 0, 0
        for c, cand in enumerate(candidates):
            expected = [int(best[0])] + best[base + c * L : base + c * L + L - 1].tolist()
            n = next((m for m in range(L) if cand[m] != expected[m]), L)
            if n > n_best:
                n_best, c_best = n, c
        return n_best, c_best

    def update_window(self, best: Tensor) -> None:
        """Jacobi: the top level's argmaxes become the newest level; each column plus its new guess
        is an n-gram for the pool."""
        c = self.config
        top = best[1 + (c.levels - 1) * c.window : 1 + c.levels * c.window].cpu()  # (W,)
        ngrams, self.window = window_update(self.window, top)
        for ngram in ngrams:
            self.pool.add(ngram)


def window_update(window: Tensor, top: Tensor) -> tuple[list[tuple[int, ...]], Tensor]:
    """One Jacobi step of the window (N-1, W), given the argmaxes ``top`` (W,) at its
    newest level: -> the W n-grams (column i, top to bottom, then top[i]) and the new
    window (oldest level dropped)."""
    ngrams = [tuple(window[:, i].tolist()) + (int(top[i]),) for i in range(window.shape[1])]
    return ngrams, torch.cat([window[1:], top[None].to(window.dtype)])


@dataclass
class LookaheadTrace:
    """What each step of ``lookahead_generate`` saw and did, and the pool at the end."""

    steps: list[dict] = field(default_factory=list)
    pool: NGramPool | None = None

    def record_before(self, decoder: LookaheadDecoder, root: int) -> None:
        self.pool = decoder.pool
        self.steps.append(
            {"root": root, "window": decoder.window.tolist(), "candidates": decoder.pool.candidates(root)}
        )

    def record_after(self, decoder: LookaheadDecoder, accepted: list[int], next_token: int) -> None:
        self.steps[-1] |= {"accepted": accepted, "next": next_token, "pool_size": len(decoder.pool)}

    @property
    def accepted_lengths(self) -> list[int]:
        return [len(s["accepted"]) for s in self.steps]


@torch.inference_mode()
def lookahead_generate(
    model: Transformer,
    input_ids,
    max_new_tokens: int,
    config: LookaheadConfig = LookaheadConfig(),
    eos_token_id="config",
    trace: LookaheadTrace | None = None,
    compile: bool = False,
) -> DecodingResult:
    """Greedy lookahead decoding: the same tokens as greedy ``generate``, in fewer forwards when
    the pool's n-grams are right. ``stats.k`` is N-1: the longest candidate. A ``trace`` records
    every step (and keeps the pool) to look at afterwards. ``compile=True`` runs every step
    through one compiled graph (G candidates always fed), compiled before the timer starts."""
    prompt = single_prompt(input_ids)
    check_request([prompt], max_new_tokens, model.config)
    if len(prompt) + max_new_tokens + config.tokens_per_forward() > model.config.max_seq_len:
        raise ValueError(
            f"prompt of {len(prompt)} + {max_new_tokens} new tokens + {config.tokens_per_forward()} "
            f"tokens per forward exceeds max_seq_len={model.config.max_seq_len}; "
            "use a smaller window, ngram or max_candidates"
        )
    eos = set(resolve_eos(eos_token_id, model.config))
    stats = DecodingStats(config.levels)
    width = config.tokens_per_forward()
    fwd = cached_forward(model, 1, len(prompt) + max_new_tokens + width, compile, widths=(width,))
    decoder = LookaheadDecoder(model, config, prompt, fwd, pad=compile)
    compile_time = warm_up([fwd], [width], tree_mask=decoder.layout(config.max_candidates)[1])
    synchronize(model.device)
    t0 = time.perf_counter()
    if len(prompt) > 1:  # prefill all but the last prompt token, the first root
        fwd(torch.tensor([prompt[:-1]], device=model.device), last_only=True)
    new, root = [], prompt[-1]
    while len(new) < max_new_tokens:
        if trace is not None:
            trace.record_before(decoder, root)
        accepted, root, proposed = decoder.step(root)
        if trace is not None:
            trace.record_after(decoder, accepted, root)
        emitted = stop_at_eos(accepted + [root], eos)[: max_new_tokens - len(new)]
        stats.record(proposed, len(accepted), len(emitted))
        new += emitted
        if new[-1] in eos:
            break
    stats.new_tokens = len(new)
    synchronize(model.device)
    return DecodingResult(torch.tensor([new]), stats, time.perf_counter() - t0, compile_time, fwd.forward_seconds)


# ---------------------------------------------------------------------------------------------
# Jacobi decoding, the idea lookahead starts from


@torch.inference_mode()
def jacobi_step(model: Transformer, prompt: list[int], guess: list[int]) -> list[int]:
    """One Jacobi iteration: every position of the guess updated at once, in one
    forward.

    Token i of the new guess is the model's argmax after the prompt and the *old*
    guess's first i tokens; so if the old guess's first i tokens were right, so is the
    new guess's token i."""
    ids = torch.tensor([prompt + guess[:-1]], device=model.device)
    return model(ids)[0, len(prompt) - 1 :].argmax(-1).tolist()


def jacobi_iterations(
    model: Transformer, prompt: list[int], guess: list[int], max_iters: int | None = None
) -> list[list[int]]:
    """Iterate ``jacobi_step`` from ``guess`` to its fixed point (greedy decoding's tokens): the guesses,
    the initial one first. At most len(guess) iterations are needed, since each fixes one more token."""
    guesses = [list(guess)]
    for _ in range(len(guess) if max_iters is None else max_iters):
        guesses.append(jacobi_step(model, prompt, guesses[-1]))
        if guesses[-1] == guesses[-2]:
            break
    return guesses
