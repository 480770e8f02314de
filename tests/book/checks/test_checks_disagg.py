"""Chapter 14's checkers accept the right answers and reject plausible wrong ones."""

import pytest

from minillm.book.checks import CheckFailed
from minillm.book.checks.disagg import (
    check_attainment,
    check_choose_ratio,
    check_handoff,
    reference_handoff,
    reference_ratio,
)
from minillm.measure.metrics import SLO


def test_handoff_accepts_the_formula_and_rejects_slips():
    check_handoff(lambda *case: reference_handoff(*case))
    wrong = [
        lambda L, H, D, T, b, g: (L * H * D * T * b, 1e3 * (5e-6 + L * H * D * T * b / (g * 1e9))),  # K only
        lambda L, H, D, T, b, g: (
            2 * L * 4 * H * D * T * b,
            1e3 * (5e-6 + 8 * L * H * D * T * b / (g * 1e9)),
        ),  # q heads
        lambda L, H, D, T, b, g: (2 * L * H * D * T * b, 5e-6 + 2 * L * H * D * T * b / (g * 1e9)),  # seconds
        lambda L, H, D, T, b, g: (2 * L * H * D * T * b, 1e3 * 2 * L * H * D * T * b / (g * 2**30)),  # GiB, no latency
    ]
    for fn in wrong:
        with pytest.raises(CheckFailed):
            check_handoff(fn)


def test_choose_ratio_rejects_a_fixed_or_unbalanced_answer():
    check_choose_ratio(reference_ratio)
    for fn in (
        lambda p, d, n: (1, 1),
        lambda p, d, n: (max(1, round(n * d / (p + d))), max(1, n - round(n * d / (p + d)))),  # inverted
        lambda p, d, n: max(
            ((a, b) for a in range(1, n) for b in range(1, n - a + 1)), key=lambda r: min(r[0] * p, r[1] * d)
        ),  # total, not per worker
    ):
        with pytest.raises(CheckFailed):
            check_choose_ratio(fn)


def test_attainment_rejects_ignoring_the_gap_or_strict_bounds():
    def right(metrics, ttft, tpot, gap):
        slo = SLO(ttft, tpot, gap)
        return 100 * sum(slo.met_by(m) for m in metrics) / len(metrics)

    check_attainment(right)

    def no_gap(metrics, ttft, tpot, gap):
        return right(metrics, ttft, tpot, None)

    def strict(metrics, ttft, tpot, gap):
        return right(metrics, ttft - 1e-9, tpot - 1e-9, gap)

    def fraction(metrics, ttft, tpot, gap):
        return right(metrics, ttft, tpot, gap) / 100

    for fn in (no_gap, strict, fraction):
        with pytest.raises(CheckFailed):
            check_attainment(fn)
