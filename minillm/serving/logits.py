"""What a served request may ask of its next-token logits beyond sampling (``SamplingParams``):
the penalties, biases and cut-offs that OpenAI's API and vLLM's extensions name.

- ``logit_bias``: a number added to chosen tokens' logits (-100 bans a token, +100 all but
  forces it), as OpenAI defines it.
- ``repetition_penalty`` (CTRL, as Hugging Face applies it): a logit of a token already in the
  prompt or the output is divided by the penalty when positive and multiplied by it when
  negative, so a penalty above 1 makes every seen token less likely.
- ``presence_penalty`` and ``frequency_penalty`` (OpenAI): subtracted from the logit of each token
  the output already holds, once (presence) or once per occurrence (frequency).
- ``min_p``: after temperature, tokens less likely than ``min_p`` times the most likely one are
  dropped (the cut-off scales with how sure the model is).

The engine applies them, in that order, to a request's row of logits before it samples
(``LogitAdjustments.apply``); speculative and parallel decoders do not take them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor


def _number(value, name: str, low: float, high: float, low_open: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < low or value > high or (low_open and value == low):
        interval = f"{'(' if low_open else '['}{low:g}, {high:g}]"
        raise ValueError(f"{name} must be a number in {interval}, got {value!r}")


@dataclass(frozen=True)
class LogitAdjustments:
    presence_penalty: float = 0.0  # OpenAI's range, [-2, 2]
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1: none; > 1 discourages seen tokens, < 1 encourages them
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100])
    min_p: float = 0.0  # 0: none

    def __post_init__(self) -> None:
        _number(self.presence_penalty, "presence_penalty", -2, 2)
        _number(self.frequency_penalty, "frequency_penalty", -2, 2)
        _number(self.repetition_penalty, "repetition_penalty", 0, 100, low_open=True)
        _number(self.min_p, "min_p", 0, 1)
        for pair in self.logit_bias:
            token, bias = pair
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {token!r}")
            _number(bias, f"logit_bias[{token}]", -100, 100)

    @property
    def active(self) -> bool:
        return self != LogitAdjustments()

    def check_vocabulary(self, vocab_size: int) -> None:
        for token, _ in self.logit_bias:
            if token >= vocab_size:
                raise ValueError(f"logit_bias names token {token}, outside the vocabulary of {vocab_size}")

    def apply(self, logits: Tensor, tokens: list[int], prompt_len: int, temperature: float) -> Tensor:
        """A request's logits (1, V) adjusted, given its tokens so far (prompt, then output) and
        its sampling temperature (0: greedy, where min_p cannot change the argmax)."""
        logits = logits.float().clone()
        row = logits[0]
        if self.logit_bias:
            ids = torch.tensor([t for t, _ in self.logit_bias], device=row.device)
            row[ids] += torch.tensor([b for _, b in self.logit_bias], device=row.device, dtype=row.dtype)
        if self.repetition_penalty != 1.0 and tokens:
            seen = torch.tensor(sorted(set(tokens)), device=row.device)
            values = row[seen]
            row[seen] = torch.where(values > 0, values / self.repetition_penalty, values * self.repetition_penalty)
        output = tokens[prompt_len:]
        if (self.presence_penalty or self.frequency_penalty) and output:
            counts = torch.bincount(torch.tensor(output, device=row.device), minlength=row.numel()).to(row.dtype)
            row -= self.frequency_penalty * counts + self.presence_penalty * (counts > 0).to(row.dtype)
        if self.min_p > 0 and temperature > 0:
            probs = (row / temperature).softmax(-1)
            row[probs < self.min_p * probs.max()] = float("-inf")
        return logits


def ban(logits: Tensor, token_ids: tuple[int, ...]) -> Tensor:
    """Logits (1, V) with ``token_ids`` made impossible: how ``min_tokens`` holds back the stop ids."""
    logits = logits.clone()
    logits[0, list(token_ids)] = float("-inf")
    return logits


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability under the model, and the ``top`` most likely (id, log-prob) at
    its position, most likely first. Of the model's own distribution (log-softmax of its logits),
    before temperature, penalties or filters, as vLLM reports by default."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprob(logits: Tensor, token: int, top: int) -> TokenLogprob:
    """``token``'s log-probability from one position's logits (V,) or (1, V), and the ``top`` best."""
    logp = logits.reshape(-1).float().log_softmax(-1)
    best = torch.topk(logp, top) if top else None
    pairs = tuple(zip(best.indices.tolist(), best.values.tolist())) if best is not None else ()
    return TokenLogprob(float(logp[token]), pairs)


@torch.no_grad()
def prompt_logprobs(model, ids: list[int], top: int) -> list[TokenLogprob | None]:
    """Each prompt token's log-probability given the tokens before it (one forward of the whole
    prompt, no cache); None for the first, which nothing predicts."""
    logits = model(torch.tensor([ids], device=model.device))[0]  # (T, V)
    return [None] + [token_logprob(logits[i - 1], ids[i], top) for i in range(1, len(ids))]
