"""Checkers for the exercises: each prints a pass line or raises CheckFailed with a hint.

One module per chapter; this package re-exports them all, so a notebook writes
``from minillm.checks import check_top_p``.
"""

from .base import CheckFailed, close, passed, require
from .generation import check_greedy_generate, check_softmax_with_temperature, check_top_p

__all__ = ["CheckFailed", "check_greedy_generate", "check_softmax_with_temperature", "check_top_p", "close",
           "passed", "require"]  # fmt: skip
