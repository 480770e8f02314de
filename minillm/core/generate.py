"""Autoregressive generation: prefill the prompt, then decode one token at a time.

Two paths, side by side so that the difference is the lesson:

- ``use_cache=False``, the teaching baseline: every step runs the whole sequence so far
  through the model again, so step n costs O(n) token-passes and a generation O(n^2).
- ``use_cache=True``: the prompt is run once (prefill) and its keys and values are kept in a
  preallocated ``KVCache``; each decode step then feeds one token per sequence.

Prompts of different lengths are left-padded; padding slots get position -1 and are never
attended to, so every sequence sees exactly what it would see alone.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .cache import Cache, KVCache
from .compiled import compiled_forward_for
from .device import synchronize
from .model import Transformer
from .outputs import TimedTokens
from .prompts import check_vocabulary, token_id_tuple, token_rows
from .sampling import SamplingParams, sample


@dataclass
class GenerationResult(TimedTokens):
    tokens: Tensor  # (B, N) new token ids; a row that stopped early is padded with the first EOS id
    lengths: list[int]  # new tokens of each row, its EOS included
    prompt_lengths: list[int]
    ttft: float  # seconds from the call to the first new token (prefill + first sample)
    token_times: list[float] = field(default_factory=list)  # seconds of each later decode step
    total_time: float = 0.0
    compile_time: float = 0.0  # seconds spent compiling before the timer started (``compile=True``)

    @property
    def tpot(self) -> float:
        """Mean time per output token after the first (seconds); nan if only one was made."""
        return sum(self.token_times) / len(self.token_times) if self.token_times else float("nan")

    @property
    def decode_tokens_per_s(self) -> float:
        """Decode throughput over the whole batch, first token excluded."""
        steps = len(self.token_times)
        return self.tokens.shape[0] * steps / sum(self.token_times) if steps else float("nan")

    def token_lists(self) -> list[list[int]]:
        return [row[:n].tolist() for row, n in zip(self.tokens, self.lengths)]


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int, device) -> tuple[Tensor, Tensor]:
    """Ragged prompts -> ids (B, T) and positions (B, T), padding on the left with position -1."""
    T = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), T), pad_id, dtype=torch.long)
    positions = torch.full((len(prompts), T), -1, dtype=torch.long)
    for i, p in enumerate(prompts):
        if len(p):
            ids[i, T - len(p) :] = torch.as_tensor(list(p), dtype=torch.long)
            positions[i, T - len(p) :] = torch.arange(len(p))
    return ids.to(device), positions.to(device)


def prefill(model: Transformer, ids: Tensor, positions: Tensor | None, cache: Cache) -> Tensor:
    """Run the prompt through the model, filling the cache: the last logits (B, V)."""
    return model(ids, positions, cache, last_only=True)[:, -1]


def decode_one_token(model: Transformer, token: Tensor, positions: Tensor | None, cache: Cache) -> Tensor:
    """One step with the cache: token (B,) -> next logits (B, V)."""
    return model(token[:, None], positions, cache)[:, -1]


def recompute_step(model: Transformer, ids: Tensor, positions: Tensor) -> Tensor:
    """The baseline: the whole sequence (B, T) through the model again -> last logits (B, V)."""
    return model(ids, positions, last_only=True)[:, -1]


def check_max_new_tokens(max_new_tokens: object) -> None:
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")


def check_request(prompts: list[list[int]], max_new_tokens: int, config) -> None:
    """Clear errors for what cannot be generated; nothing is ever silently truncated."""
    check_max_new_tokens(max_new_tokens)
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    check_vocabulary(prompts, config.vocab_size)
    longest = max(len(p) for p in prompts)
    if longest + max_new_tokens > config.max_seq_len:
        raise ValueError(
            f"prompt of {longest} tokens + max_new_tokens={max_new_tokens} exceeds the context "
            f"length max_seq_len={config.max_seq_len}; shorten the prompt or ask for fewer tokens"
        )


def resolve_eos(eos_token_id, config) -> tuple[int, ...]:
    """The stop ids: "config" takes the model's own, None means never stop early; otherwise an id
    or a collection of ids, each checked."""
    if isinstance(eos_token_id, str):
        if eos_token_id != "config":
            raise ValueError(f"eos_token_id must be an id, a list of ids, None or 'config', got {eos_token_id!r}")
        return config.eos_ids
    if eos_token_id is None:
        return ()
    ids = (eos_token_id,) if not isinstance(eos_token_id, (Sequence, set, frozenset)) else eos_token_id
    return token_id_tuple(ids, "eos_token_id")


def sampling_params(
    sampling: SamplingParams | None, temperature: float, top_k: int | None, top_p: float | None, seed: int | None
) -> SamplingParams:
    """``sampling`` itself, or one made of the keyword sugar; both at once is refused."""
    if sampling is None:
        return SamplingParams(temperature, top_k, top_p, seed)
    if not isinstance(sampling, SamplingParams):
        raise ValueError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
    if (temperature, top_k, top_p, seed) != (0.0, None, None, None):
        raise ValueError("pass either sampling=SamplingParams(...) or temperature/top_k/top_p/seed, not both")
    return sampling


@torch.inference_mode()
def generate(
    model: Transformer,
    input_ids,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    eos_token_id: int | Sequence[int] | None | str = "config",
    use_cache: bool = True,
    on_token: Callable[[Tensor], None] | None = None,
    cache: Cache | None = None,
    compile: bool = False,
    sampling: SamplingParams | None = None,
) -> GenerationResult:
    """Generate up to ``max_new_tokens`` tokens after each prompt.

    ``sampling``: a ``SamplingParams``, as every decoder and ``Request`` take (the documented
    way); ``temperature``, ``top_k``, ``top_p`` and ``seed`` are keyword sugar for one, and cannot
    be given beside it. Greedy by default.

    ``input_ids``: a LongTensor (T,) or (B, T), a list of ids, or a list of lists of different
    lengths. Generation stops at ``max_new_tokens`` or when every row has produced an EOS: by
    default the model config's EOS ids; None never stops early. ``on_token`` is called with
    each step's tokens (B,), for streaming; its time counts in the step's timing, as it does
    for a user watching the stream.
    """
    params = sampling_params(sampling, temperature, top_k, top_p, seed)
    prompts = token_rows(input_ids)
    check_request(prompts, max_new_tokens, model.config)
    eos_ids = resolve_eos(eos_token_id, model.config)
    pad_id = eos_ids[0] if eos_ids else 0
    device, generator = model.device, params.generator(model.device)

    lengths = [len(p) for p in prompts]
    B, P = len(prompts), max(lengths)
    ids, positions = left_pad(prompts, pad_id, device)
    padded = any(n != P for n in lengths)  # only then do positions need to be passed explicitly
    eos = torch.tensor(eos_ids, dtype=torch.long, device=device)
    done = torch.zeros(B, dtype=torch.bool, device=device)
    out = torch.full((B, max_new_tokens), pad_id, dtype=torch.long, device=device)
    n_new = torch.zeros(B, dtype=torch.long, device=device)
    if cache is not None:
        if not use_cache:
            raise ValueError("use_cache=False recomputes every step; it cannot take a cache")
        if cache.length != 0 or cache.batch_size != B:
            raise ValueError(
                f"cache must be empty and built for batch size {B}; it holds {cache.length} "
                f"tokens for batch size {cache.batch_size}"
            )
    elif use_cache and not compile:
        cache = KVCache.for_model(model, B, P + max_new_tokens)
    if compile and not use_cache:
        raise ValueError("compile=True decodes over a static KV cache; it cannot run with use_cache=False")
    if compile and cache is not None:
        raise ValueError("compile=True brings its own static cache; drop the cache argument")
    compiled = compiled_forward_for(model, B, P + max_new_tokens) if compile else None
    # one graph for every decode step, compiled before the timer starts
    compile_time = compiled.warmup(1) if compiled is not None else 0.0
    token_times: list[float] = []

    synchronize(device)
    t_start = t_prev = time.perf_counter()
    if compiled is not None:  # the prompt runs eagerly over the static cache, the steps compiled
        logits = compiled(ids, positions if padded else None, last_only=True)[:, -1]
    elif cache is not None:
        logits = prefill(model, ids, positions if padded else None, cache)
    else:
        logits = recompute_step(model, ids, positions)
    next_pos = positions[:, -1:]  # (B, 1): each row continues from its own length
    for step in range(max_new_tokens):
        token = sample(logits, params, generator)  # (B,)
        if eos_ids:  # without stop ids no row is ever done: a step spends nothing on them
            token.masked_fill_(done, pad_id)
            n_new += (~done).long()
            done |= torch.isin(token, eos)
        out[:, step] = token
        if on_token is not None:
            on_token(token)
        synchronize(device)
        now = time.perf_counter()
        if step == 0:
            ttft = now - t_start
        else:
            token_times.append(now - t_prev)
        t_prev = now
        if step + 1 == max_new_tokens or (eos_ids and bool(done.all())):
            break
        next_pos = next_pos + 1
        if cache is None and compiled is None:  # only recomputing needs every position
            positions = torch.cat([positions, next_pos], dim=1)
        if compiled is not None:
            logits = compiled(token[:, None], next_pos if padded else None)[:, -1]
        elif cache is not None:
            logits = decode_one_token(model, token, next_pos if padded else None, cache)
        else:
            ids = torch.cat([ids, token[:, None]], dim=1)
            logits = recompute_step(model, ids, positions)

    return GenerationResult(
        tokens=out[:, : step + 1].cpu(),
        lengths=n_new.tolist() if eos_ids else [step + 1] * B,
        prompt_lengths=lengths,
        ttft=ttft,
        token_times=token_times,
        total_time=t_prev - t_start,
        compile_time=compile_time,
    )
