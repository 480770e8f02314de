"""The hash chain against the radix tree (``EngineConfig.prefix_cache``) on workloads that share
prefixes in different ways: prompt tokens found in the cache, TTFT, peak KV blocks.

- ``multi_turn``: chats whose every turn sends the previous prompt, its answer and a new user
  message; the conversations take turns (round robin);
- ``few_shot``: an instruction, then a few examples drawn from a shared pool (in the pool's
  order, so prompts that start with the same examples share a prefix), then the question;
- ``branching``: tree of thought: several continuations of one stem, then of each continuation.

A workload is a list of ``Turn``s: a request whose prompt continues an earlier request's prompt
and answer (``parent``) with new tokens. Each request is served alone (its TTFT is its prefill
step, no queueing), and each request runs on both caches back to back, the order alternating,
so drift hits both alike; each cache builds its prompts from its own answers (greedy: the same,
``answers_agree_pct`` says). Per request the median TTFT over ``repeats`` rounds, then the
median and p90 over requests.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from ..core.model import Transformer
from ..kv.paged import blocks_for
from ..measure.metrics import percentiles
from ..serving.engine import BLOCK_MANAGERS, Engine, EngineConfig
from ..serving.scheduler import SchedulerConfig
from ..serving.workload import Request

CACHES = tuple(BLOCK_MANAGERS)  # ("hash", "radix")
WORKLOADS = ("multi_turn", "few_shot", "branching")


@dataclass(frozen=True)
class PrefixCacheBench:
    conversations: int = 4  # multi_turn: chats, taking turns
    turns: int = 6  # multi_turn: turns per chat
    few_shot_prompts: int = 12
    examples: int = 6  # few_shot: the pool of examples; each prompt takes `shots` of them
    shots: int = 3
    stems: int = 2  # branching: trees of thought
    branches: int = 3  # branching: continuations per node, two levels deep
    message_len: tuple[int, int] = (8, 40)  # user messages, examples, thoughts: tokens, uniform in [lo, hi)
    answer_len: tuple[int, int] = (8, 40)  # max_tokens of each request, uniform in [lo, hi)
    system_len: int = 64  # the instruction or system prompt every workload starts with
    block_size: int = 16
    num_blocks: int = 512  # KV pool per engine (the default holds every workload: no eviction)
    repeats: int = 3
    seed: int = 0

    def __post_init__(self) -> None:
        counts = ("conversations", "turns", "few_shot_prompts", "examples", "shots", "stems", "branches", "repeats")
        for name in counts:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.shots > self.examples:
            raise ValueError(f"shots ({self.shots}) cannot exceed examples ({self.examples})")
        for name in ("message_len", "answer_len"):
            lo, hi = getattr(self, name)
            if not 1 <= lo < hi:
                raise ValueError(f"{name} must be a range [lo, hi) with 1 <= lo < hi, got {(lo, hi)}")
        if self.system_len < 1 or self.block_size < 1 or self.num_blocks < 1:
            raise ValueError("system_len, block_size and num_blocks must be positive")


@dataclass(frozen=True)
class Turn:
    """A request: ``parent``'s prompt and answer (None: nothing), then ``new`` tokens."""

    parent: int | None
    new: list[int]
    max_tokens: int


def _tokens(rng: np.random.Generator, n: int, vocab: int) -> list[int]:
    return rng.integers(1, vocab, n).tolist()  # 1..vocab-1: no BOS/EOS id 0


def make_workloads(o: PrefixCacheBench, vocab: int) -> dict[str, list[Turn]]:
    """The three workloads, random tokens of random lengths (``o.seed``)."""
    rng = np.random.default_rng(o.seed)

    def message() -> list[int]:
        return _tokens(rng, int(rng.integers(*o.message_len)), vocab)

    def answer() -> int:
        return int(rng.integers(*o.answer_len))

    system = _tokens(rng, o.system_len, vocab)
    chats = [Turn(None, system + message(), answer()) for _ in range(o.conversations)]
    for t in range(1, o.turns):  # turn t of chat c continues request (t - 1) * C + c
        chats += [Turn((t - 1) * o.conversations + c, message(), answer()) for c in range(o.conversations)]
    pool = [message() for _ in range(o.examples)]
    few_shot = []
    for _ in range(o.few_shot_prompts):
        picked = sorted(rng.choice(o.examples, o.shots, replace=False))
        few_shot.append(Turn(None, system + [t for i in picked for t in pool[i]] + message(), answer()))
    branching: list[Turn] = []
    for _ in range(o.stems):
        root = len(branching)
        branching.append(Turn(None, system + message(), answer()))
        level1 = []
        for _ in range(o.branches):
            level1.append(len(branching))
            branching.append(Turn(root, message(), answer()))
        branching += [Turn(p, message(), answer()) for p in level1 for _ in range(o.branches)]
    return {"multi_turn": chats, "few_shot": few_shot, "branching": branching}


def _engine(model: Transformer, o: PrefixCacheBench, cache: str) -> Engine:
    config = EngineConfig(o.num_blocks, o.block_size, True, SchedulerConfig(max_batch=1), prefix_cache=cache)
    return Engine(model, config)


def _serve(engine: Engine, prompt: list[int], max_tokens: int) -> tuple[list[int], float, int]:
    """One request alone: its answer, its TTFT (ms, measured) and the prompt tokens the cache held."""
    hits = engine.scheduler.prefix_hit_tokens
    (out,) = engine.run([Request(prompt, max_tokens, arrival=engine.now)])
    return out.tokens, 1e3 * out.metrics.ttft, engine.scheduler.prefix_hit_tokens - hits


def _round(model: Transformer, o: PrefixCacheBench, turns: list[Turn], flip: bool) -> dict:
    """Serve a workload once on a fresh engine per cache, each request on both back to back."""
    engines = {c: _engine(model, o, c) for c in CACHES}
    prompts: dict[str, list[list[int]]] = {c: [] for c in CACHES}
    answers: dict[str, list[list[int]]] = {c: [] for c in CACHES}
    ttft: dict[str, list[float]] = {c: [] for c in CACHES}
    hits = dict.fromkeys(CACHES, 0)
    for i, turn in enumerate(turns):
        order = CACHES[::-1] if (i % 2) ^ flip else CACHES
        for c in order:
            before = [] if turn.parent is None else prompts[c][turn.parent] + answers[c][turn.parent]
            prompts[c].append(before + turn.new)
            tokens, ms, hit = _serve(engines[c], prompts[c][-1], turn.max_tokens)
            answers[c].append(tokens)
            ttft[c].append(ms)
            hits[c] += hit
    out = {}
    for c, e in engines.items():
        stats = e.stats()
        out[c] = {
            "ttft_ms": ttft[c],
            "prompt_tokens": sum(map(len, prompts[c])),
            "prefix_hit_tokens": hits[c],
            "peak_blocks": e.peak_blocks,
            "evictions": stats["evictions"],
            "cow_copies": stats["cow_copies"],
        }
    out["answers_agree"] = sum(a == b for a, b in zip(*answers.values())) / len(turns)
    return out


def _summary(rounds: list[dict], cache: str) -> dict:
    last = rounds[-1][cache]
    per_request = np.median([r[cache]["ttft_ms"] for r in rounds], axis=0)  # (requests,)
    q = percentiles(per_request, (50, 90))
    return {
        "prefix_hit_tokens": last["prefix_hit_tokens"],
        "hit_pct": 100 * last["prefix_hit_tokens"] / last["prompt_tokens"],
        "prefill_tokens": last["prompt_tokens"] - last["prefix_hit_tokens"],
        "ttft_p50_ms": q["p50"],
        "ttft_p90_ms": q["p90"],
        "peak_blocks": last["peak_blocks"],
        "evictions": last["evictions"],
        "cow_copies": last["cow_copies"],
    }


def prefill_ms_by_new_tokens(
    model: Transformer, context: int = 256, news: tuple[int, ...] = (1, 4, 8, 16, 32, 64), repeats: int = 9
) -> dict[int, float]:
    """Median TTFT (ms) of a request whose first ``context`` tokens are cached and ``n`` are new,
    per n: what a prefix cache saves by finding n more tokens. The n take turns in every round;
    each request's first new token is one no earlier request had there, so nothing more is cached."""
    rng, vocab = np.random.default_rng(0), model.config.vocab_size
    calls = (repeats + 1) * len(news)
    if calls >= vocab:
        raise ValueError(f"{calls} requests need as many distinct first tokens, the vocabulary has {vocab}")
    pool = PrefixCacheBench(block_size=16, num_blocks=4 * blocks_for(context + max(news), 16))
    engine = _engine(model, pool, "radix")
    stem = _tokens(rng, context, vocab)
    _serve(engine, stem, 1)  # cached from now on
    times: dict[int, list[float]] = {n: [] for n in news}
    firsts = iter(range(1, vocab))
    for r in range(repeats + 1):  # the first round warms up
        for n in news[r % len(news) :] + news[: r % len(news)]:
            _, ms, hit = _serve(engine, stem + [next(firsts)] + _tokens(rng, n - 1, vocab), 1)
            if hit != context:
                raise RuntimeError(f"expected {context} cached tokens, found {hit}")
            if r:
                times[n].append(ms)
    return {n: float(np.median(t)) for n, t in times.items()}


def bench_prefix_caches(model: Transformer, o: PrefixCacheBench | None = None) -> dict:
    """Hash chain vs radix tree on every workload (see the module's docstring)."""
    o = o or PrefixCacheBench()
    workloads = make_workloads(o, model.config.vocab_size)
    warm = _engine(model, o, "hash")  # one-off costs (allocator, kernel selection) before any timing
    _serve(warm, workloads["multi_turn"][0].new, 2)
    result: dict = {"block_size": o.block_size, "repeats": o.repeats, "num_blocks": o.num_blocks, "workloads": {}}
    for name, turns in workloads.items():
        rounds = [_round(model, o, turns, flip=bool(r % 2)) for r in range(o.repeats)]
        figures = {c: _summary(rounds, c) for c in CACHES}
        hash_, radix = figures["hash"]["ttft_p50_ms"], figures["radix"]["ttft_p50_ms"]
        figures.update(
            requests=len(turns),
            prompt_tokens=rounds[-1]["hash"]["prompt_tokens"],
            answers_agree_pct=100 * min(r["answers_agree"] for r in rounds),
            radix_ttft_p50_saving_pct=100 * (1 - radix / hash_),
        )
        result["workloads"][name] = figures
    result["prefill_cost"] = {"context": 256, "ms_by_new_tokens": prefill_ms_by_new_tokens(model, 256)}
    return result


def format_prefix_caches(result: Mapping) -> str:
    """The table: per workload and cache, hits, tokens prefilled, TTFT, peak blocks."""
    head = f"{'workload':<11} {'cache':<6} {'hit tok':>8} {'hit %':>6} {'prefilled':>9} "
    head += f"{'TTFT p50':>9} {'TTFT p90':>9} {'peak blk':>8} {'CoW':>5}"
    lines = [f"prefix caches, block size {result['block_size']}, TTFT in ms (median of {result['repeats']})", head]
    for name, w in result["workloads"].items():
        for c in CACHES:
            f = w[c]
            row = f"{name:<11} {c:<6} {f['prefix_hit_tokens']:>8} {f['hit_pct']:>6.1f} {f['prefill_tokens']:>9} "
            row += f"{f['ttft_p50_ms']:>9.1f} {f['ttft_p90_ms']:>9.1f} {f['peak_blocks']:>8} {f['cow_copies']:>5}"
            lines.append(row)
        saving, agree = w["radix_ttft_p50_saving_pct"], w["answers_agree_pct"]
        lines.append(f"{'':<11} radix vs hash, TTFT p50: {-saving:+.1f}%; answers agree: {agree:.0f}%")
    cost = result.get("prefill_cost")
    if cost:
        by_n = ", ".join(f"{n}: {ms:.1f}" for n, ms in cost["ms_by_new_tokens"].items())
        lines += [f"TTFT in ms after {cost['context']} cached tokens, by the number of new tokens:", f"  {by_n}"]
    return "\n".join(lines)
