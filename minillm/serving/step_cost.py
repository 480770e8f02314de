"""The engine's clock and its log: ``StepCost``, a simulated duration per step (a cost model),
``StepRecord``, what one step did and how long it took, and ``fit_step_cost``, the cost model
fitted to the steps of a measured run."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class StepCost:
    """A simulated clock, in seconds: ``fixed`` per forward, plus ``per_token`` per decode row and
    ``per_prefill_token`` per prompt token (by default the same as ``per_token``).

    The engine runs one forward for the decode rows of a step and one for its prompt chunks, so a
    mixed step pays ``fixed`` twice, unless ``fused``: one forward over decode rows and prompt
    chunks alike, what a variable-length attention kernel allows (vLLM's, for one), pays it once.
    A static batch's padding rows count as decode rows (they are computed like the others).
    ``StepCost()(n)`` is one forward of n tokens: fixed + per_token x n.
    """

    fixed: float = 5e-3
    per_token: float = 1e-4
    per_prefill_token: float | None = None
    fused: bool = False  # a mixed step is one forward (pays ``fixed`` once)

    def __post_init__(self) -> None:
        if min(self.fixed, self.per_token, self.prefill_rate) < 0:
            raise ValueError(f"step costs must be >= 0, got {self}")

    @property
    def prefill_rate(self) -> float:
        return self.per_token if self.per_prefill_token is None else self.per_prefill_token

    def __call__(self, tokens: int, prefill_tokens: int = 0, forwards: int = 1) -> float:
        forwards = min(forwards, 1) if self.fused else forwards
        return self.fixed * forwards + self.per_token * tokens + self.prefill_rate * prefill_tokens

    def half_batch(self) -> float:
        """The decode batch at which tokens/s reaches half its limit 1 / per_token: fixed / per_token.
        A decode step of B rows makes B / (fixed + per_token x B) tokens/s, which grows with B
        only while the fixed cost (reading the weights, launching the step) dominates."""
        return self.fixed / self.per_token if self.per_token > 0 else float("inf")


@dataclass(frozen=True)
class StepRecord:
    """One step of the engine, on its clock."""

    start: float  # seconds
    duration: float  # seconds: measured, or from the StepCost
    decode_rows: int  # one-token rows, a static batch's padding rows included
    padding_rows: int  # rows of finished members of a static batch, fed but wasted
    prefill_tokens: int  # prompt tokens fed in rows of more than one token
    forwards: int  # 1 or 2 (decode rows and prompt chunks run as two forwards)
    work: tuple[tuple[int, int], ...]  # (request id, tokens fed) per row
    blocks_used: int  # KV blocks referenced after the step

    @property
    def end(self) -> float:
        return self.start + self.duration


def fit_step_cost(records: Iterable[StepRecord]) -> StepCost:
    """Least-squares fit of duration = fixed x forwards + per_token x decode rows + per_prefill_token
    x prompt tokens to measured steps (non-negative coefficients)."""
    records = list(records)
    if len(records) < 3:
        raise ValueError(f"fitting a step cost needs at least 3 steps, got {len(records)}")
    X = np.array([[r.forwards, r.decode_rows, r.prefill_tokens] for r in records], dtype=float)
    y = np.array([r.duration for r in records])
    keep = [j for j in range(3) if X[:, j].any()]
    while True:  # drop a column whose coefficient comes out negative, refit the rest
        coef = np.linalg.lstsq(X[:, keep], y, rcond=None)[0]
        if (coef >= 0).all() or len(keep) == 1:
            break
        keep.pop(int(np.argmin(coef)))
    full = np.zeros(3)
    full[keep] = np.maximum(coef, 0)
    return StepCost(fixed=float(full[0]), per_token=float(full[1]), per_prefill_token=float(full[2]))
