"""What the draft-and-verify decoders of Part III share: their statistics and result, the
checks of their input, and the cost model of a step from measured forward costs.

Speculative decoding (``speculative``), prompt lookup (``prompt_lookup``), lookahead
(``lookahead``) and Medusa (``medusa``) all emit one or more tokens per forward of the target
over several new tokens; ``DecodingStats`` counts how many they proposed, how many the target
accepted and how many forwards it took. ``cost_at`` and ``modeled_speedup`` turn measured
forward costs by width (milliseconds of one forward of T new tokens) into what a method gains.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from torch import Tensor

from ..core.outputs import TimedTokens
from ..core.prompts import token_rows


@dataclass
class DecodingStats:
    """What a draft-and-verify decoder did: how much the target accepted, and at what cost."""

    k: int  # proposals per round, at most
    reached: list[int] = field(default_factory=list)  # per draft position: rounds that got to check it
    accepted: list[int] = field(default_factory=list)  # per draft position: rounds that accepted it
    proposed: int = 0  # proposals made, all rounds together
    target_forwards: int = 0  # forwards of the target; the first also prefills the prompt, as in generate
    draft_forwards: int = 0  # forwards of a draft model, if any
    new_tokens: int = 0

    def __post_init__(self) -> None:
        self.reached = self.reached or [0] * self.k
        self.accepted = self.accepted or [0] * self.k

    def record(self, proposed: int, n_accepted: int, emitted: int) -> None:
        """One verification: ``proposed`` tokens checked left to right, the first ``n_accepted`` kept."""
        self.proposed += proposed
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
    def acceptance_rate(self) -> float:
        """The per-position acceptance rate, all positions pooled: accepted over the proposals a
        round got to check (the ones after a rejection are never checked). The alpha of chapter 7."""
        reached = sum(self.reached)
        return sum(self.accepted) / reached if reached else float("nan")

    @property
    def fraction_kept(self) -> float:
        """Accepted over proposed: lower than ``acceptance_rate``, because a rejection discards the
        rest of its round unchecked."""
        return sum(self.accepted) / self.proposed if self.proposed else float("nan")

    @property
    def mean_accepted_length(self) -> float:
        """Proposed tokens accepted per verification (0 to K; the target's own token not counted)."""
        return sum(self.accepted) / self.target_forwards if self.target_forwards else float("nan")

    @property
    def tokens_per_target_forward(self) -> float:
        """New tokens per verification forward: 1 for plain decoding, up to K + 1 here."""
        return self.new_tokens / self.target_forwards if self.target_forwards else float("nan")

    def as_dict(self) -> dict:
        return {
            "k": self.k,
            "acceptance_rates": self.acceptance_rates,
            "acceptance_rate": self.acceptance_rate,
            "fraction_kept": self.fraction_kept,
            "mean_accepted_length": self.mean_accepted_length,
            "tokens_per_target_forward": self.tokens_per_target_forward,
            "target_forwards": self.target_forwards,
            "draft_forwards": self.draft_forwards,
            "new_tokens": self.new_tokens,
        }


def merged(stats: list[DecodingStats]) -> DecodingStats | None:
    """Statistics of several generations as one."""
    if not stats:
        return None
    total = DecodingStats(stats[0].k)
    for s in stats:
        total.reached = [a + b for a, b in zip(total.reached, s.reached)]
        total.accepted = [a + b for a, b in zip(total.accepted, s.accepted)]
        total.proposed += s.proposed
        total.target_forwards += s.target_forwards
        total.draft_forwards += s.draft_forwards
        total.new_tokens += s.new_tokens
    return total


@dataclass
class DecodingResult(TimedTokens):
    tokens: Tensor  # (1, N) the new token ids, EOS included if one was made
    stats: DecodingStats
    total_time: float  # wall time of the whole call, prefill included (compiling not)
    compile_time: float = 0.0  # seconds compiling before the timer started (``compile=True``)
    forward_seconds: float = float("nan")  # of ``total_time``, the time inside model forwards

    def token_lists(self) -> list[list[int]]:
        return [self.tokens[0].tolist()]


class Drafter(Protocol):
    """Proposes up to k tokens after ``tokens``, with the distributions (k, V) they were drawn
    from, or None when the proposal is deterministic (then q is one-hot on it)."""

    forwards: int

    def propose(self, tokens: list[int], k: int) -> tuple[list[int], Tensor | None]: ...


# ---------------------------------------------------------------------------------------------
# Checks and small helpers of the decoding loops


def check_k(k: int) -> None:
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"k (tokens proposed per round) must be a positive integer, got {k!r}")


def single_prompt(input_ids) -> list[int]:
    """A prompt as a list of ids (any form ``generate`` takes, checked the same way); batch size 1
    only: rows of a batch would accept different counts."""
    rows = token_rows(input_ids)
    if len(rows) != 1:
        raise ValueError(f"these decoders take batch size 1, got {len(rows)} prompts")
    return rows[0]


def warm_up(forwards: list, widths: list[int], drafter=None, tree_mask=None) -> float:
    """Compile what will be compiled before a timer starts (the target's ``widths``, the
    drafter's own); -> the seconds it took. The forwards' clocks start from zero after it."""
    seconds = sum(forwards[0].warmup(width, tree_mask) for width in widths)
    if drafter is not None and hasattr(drafter, "warmup"):
        seconds += drafter.warmup()
    for f in forwards:
        if f is not None:
            f.forward_seconds = 0.0
    return seconds


def forward_seconds(forwards: list) -> float:
    """Seconds spent inside the forwards of ``forwards`` since ``warm_up``."""
    return sum(f.forward_seconds for f in forwards if f is not None)


def stop_at_eos(tokens: list[int], eos: set[int]) -> list[int]:
    return next((tokens[: i + 1] for i, t in enumerate(tokens) if t in eos), tokens)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


# ---------------------------------------------------------------------------------------------
# What a step costs, from measured forward costs by width


def cost_at(forward_ms_by_width: Mapping, width: float) -> float:
    """Milliseconds of one forward of ``width`` new tokens: the measured figure at a measured width,
    else interpolated linearly between the measured widths (keys may be ints or, as saved in JSON, strings)."""
    points = sorted((int(t), ms) for t, ms in forward_ms_by_width.items())
    for t, ms in points:
        if t == width:
            return ms
    for (t0, ms0), (t1, ms1) in zip(points, points[1:]):
        if width <= t1:
            return ms0 + (ms1 - ms0) * (max(width, t0) - t0) / (t1 - t0)
    return points[-1][1] * width / points[-1][0]  # past the last width: proportional


def modeled_speedup(
    tokens_per_forward: float,
    width: float,
    target_ms: Mapping,
    draft_forwards: float = 0.0,
    draft_ms: Mapping | None = None,
) -> float:
    """The speedup over plain decoding if a step cost only its forwards: tokens per target forward,
    times cost(1) over what one step costs (a target forward of ``width`` tokens, plus
    ``draft_forwards`` one-token draft forwards). Python overheads come on top of this."""
    step = cost_at(target_ms, width) + (draft_forwards * cost_at(draft_ms, 1) if draft_forwards else 0.0)
    return tokens_per_forward * cost_at(target_ms, 1) / step
