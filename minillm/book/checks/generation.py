"""Checkers for chapter 1's exercises: softmax with temperature, top-p, a greedy loop."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...core.generate import generate
from .base import close as _close
from .base import passed, require


def check_softmax_with_temperature(fn: Callable) -> None:
    """fn(logits (V,), temperature > 0) -> probabilities (V,)."""
    name = "softmax with temperature"
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0, 3.0])
    for t in (1.0, 0.5, 2.0, 0.05):
        got = fn(logits.clone(), t)
        require(
            _close(got.sum(), 1.0),
            name,
            f"at temperature {t} the probabilities sum to {float(got.sum()):.4f}, "
            "not 1: normalize by the sum of the exponentials",
        )
        require(
            _close(got, torch.softmax(logits / t, -1)),
            name,
            f"wrong distribution at temperature {t}: divide the logits by the temperature *before* the softmax",
        )
    big = torch.tensor([1000.0, 999.0, -1000.0])
    require(bool(torch.isfinite(fn(big, 1.0)).all()), name, "overflow on large logits: subtract the max first")
    passed(name, "matches softmax(logits / T) at T = 0.05, 0.5, 1, 2 and is stable on large logits")


def check_top_p(fn: Callable) -> None:
    """fn(probs (V,), p) -> the renormalized nucleus distribution (V,)."""
    name = "top-p filter"
    probs = torch.tensor([0.05, 0.4, 0.1, 0.3, 0.15])
    cases = {
        0.5: [0, 0.4 / 0.7, 0, 0.3 / 0.7, 0],
        0.4: [0, 1.0, 0, 0, 0],
        0.01: [0, 1.0, 0, 0, 0],
        0.9: [0, 0.4 / 0.95, 0.1 / 0.95, 0.3 / 0.95, 0.15 / 0.95],
        1.0: probs.tolist(),
    }
    for p, want in cases.items():
        got = fn(probs.clone(), p)
        require(
            _close(got, want, atol=1e-6),
            name,
            f"with p={p} expected {[round(w, 3) for w in want]}, got "
            f"{[round(float(g), 3) for g in got]}: keep the most likely tokens until their mass reaches p "
            "(always at least one), zero the rest, renormalize",
        )
    passed(name, "keeps the smallest set of tokens whose probability reaches p, for p in 0.01 ... 1")


def check_greedy_generate(fn: Callable, model, prompt: list[int], n: int = 12) -> None:
    """fn(model, prompt ids, n) -> the n greedy token ids, computed without a KV cache."""
    name = "greedy generation loop"
    want = generate(model, prompt, n, eos_token_id=None).tokens[0].tolist()
    got = [int(t) for t in fn(model, list(prompt), n)]
    require(len(got) == n, name, f"expected {n} new tokens, got {len(got)}: return only the new ones")
    first_bad = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    require(
        first_bad is None,
        name,
        f"token {first_bad} differs from minillm.generate: at each step run the "
        "whole sequence so far, take the argmax of the *last* position's logits, append it",
    )
    passed(name, f"{n} tokens identical to minillm.generate (greedy)")
